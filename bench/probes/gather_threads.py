#!/usr/bin/env python3
"""Does a second thread add copy bandwidth on this machine? (issue 22, target 1: profile)

An in-process gather of 1 GiB in 64 KiB blocks (a seeded random permutation), ``np.take(out=,
mode="clip")`` as ``llmdd bench``'s gather anchor, from (a) anonymous memory and (b) a POSIX
shared-memory mapping (the kind the shm transport copies from), with 1 and 2 threads (the block
list cut in halves; the caller takes the first), interleaved, the first round a warm-up.  Prints and
writes (``--out``) GB/s per case, every round, the load before and after, and the transparent huge
page settings (they decide the page size of both sources).

Usage: python bench/probes/gather_threads.py [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from multiprocessing import shared_memory

import numpy as np

N = 1 << 30
B = 64 << 10


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        return f"unreadable: {exc}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    load_before = _read("/proc/loadavg")
    idx = np.random.default_rng(1).permutation(N // B)
    anon = np.empty(N, np.uint8)
    anon.view(np.uint64)[:] = np.arange(N // 8, dtype=np.uint64)
    shm = shared_memory.SharedMemory(create=True, size=N)
    try:
        mapped = np.frombuffer(shm.buf, np.uint8, count=N)
        mapped[:] = anon
        dst = np.empty(N, np.uint8)
        dst[:] = 0

        def take(src: np.ndarray, lo: int, hi: int) -> None:
            np.take(src.reshape(-1, B), idx[lo:hi], axis=0, out=dst.reshape(-1, B)[lo:hi], mode="clip")

        def run(src: np.ndarray, threads: int) -> float:
            n = len(idx)
            cuts = [n * k // threads for k in range(threads + 1)]
            ts = [threading.Thread(target=take, args=(src, cuts[k], cuts[k + 1])) for k in range(1, threads)]
            t0 = time.perf_counter()
            for t in ts:
                t.start()
            take(src, cuts[0], cuts[1])
            for t in ts:
                t.join()
            dt = time.perf_counter() - t0
            w = B // 8   # check a sample of blocks: block idx[i] of the source landed at block i
            pick = np.random.default_rng(threads).integers(0, len(idx), 256)
            got = dst.view(np.uint64).reshape(-1, w)[pick, 0]
            assert np.array_equal(got, idx[pick].astype(np.uint64) * w), "gather moved the wrong bytes"
            return N / dt / 1e9

        cases = [("anon", 1), ("anon", 2), ("shm", 1), ("shm", 2)]
        res: dict = {f"{m}_{t}t": [] for m, t in cases}
        for r in range(args.rounds + 1):
            for m, t in (cases if r % 2 else cases[::-1]):
                v = run(anon if m == "anon" else mapped, t)
                if r:
                    res[f"{m}_{t}t"].append(round(v, 3))
        del mapped
    finally:
        shm.close()
        shm.unlink()
    med = {k: statistics.median(v) for k, v in res.items()}
    doc = {"command": "python bench/probes/gather_threads.py" + (f" --rounds {args.rounds}" if args.rounds != 5 else ""),
           "cpus": os.cpu_count(), "load_before": load_before, "load_after": _read("/proc/loadavg"),
           "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
           "thp_shmem_enabled": _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
           "gbps_all": res, "gbps_median": med,
           "two_vs_one_anon": med["anon_2t"] / med["anon_1t"], "two_vs_one_shm": med["shm_2t"] / med["shm_1t"],
           "shm_vs_anon_1t": med["shm_1t"] / med["anon_1t"]}
    for k, v in med.items():
        print(f"{k:8s} {v:6.2f} GB/s  {res[k]}")
    print(f"2 threads / 1: anon {doc['two_vs_one_anon']:.2f}x, shm {doc['two_vs_one_shm']:.2f}x; "
          f"shm / anon (1 thread) {doc['shm_vs_anon_1t']:.2f}x; load {doc['load_before']} -> {doc['load_after']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
