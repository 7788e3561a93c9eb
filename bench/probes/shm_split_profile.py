#!/usr/bin/env python3
"""Where a split shm pull spends its time (issue 22, target 1): profile, no change to the plugin.

Same set-up as bench/smoke_shm.py (a spawned prompt process holds 1 GiB in a POSIX shared-memory pool
segment; this process pulls 64 tensors x 256 blocks x 64 KiB and 64 x 1024 x 16 KiB with random block
tables).  ``ShmChannel._run_mapped`` is wrapped from the outside (this process only) to record, for
every part of a split batch, the thread it ran on and when it started and ended relative to the
``read`` call.  Per run and block size, interleaved, in the same process:

* ``split``: the default channel (``llmdd.shm.threads`` 2: the caller's part + a pool thread's);
* ``one``: a channel with ``llmdd.shm.threads`` 1 (the caller copies everything);
* ``gather``: the in-process single-thread gather anchor of ``llmdd bench`` (``np.take(out=,
  mode="clip")`` of the same blocks from a local copy), the 22.1 target's denominator.

Reported per split batch: wall time, each part's start delay and duration, how long the caller
waited after its own part for the other part (``tail_wait``), and the overlap of the two parts.
Seeded tables; every batch's bytes are checked on a sample.  Writes JSON with ``--out``.

Usage: python bench/probes/shm_split_profile.py [--runs 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import threading
import time

import numpy as np

from llmdd.lowlevel import SharedSegment
from llmdd.lowlevel import MemRegion, make_ops
import llmdd_shm
from llmdd_shm import ShmTransport

TENSORS = 64
TENSOR_BYTES = 16 << 20
TOTAL = TENSORS * TENSOR_BYTES
POOL_BASE, LOCAL_BASE = 100, 500


def _prompt(conn) -> None:
    from llmdd._memory.backend import HostBackend

    backend = HostBackend()
    seg = backend.allocate_segment(TOTAL)
    seg.array().view(np.uint64)[:] = np.arange(TOTAL // 8, dtype=np.uint64)
    ep = ShmTransport({}).open_endpoint()
    descs = {}
    for t in range(TENSORS):
        off = t * TENSOR_BYTES
        descs[POOL_BASE + t] = ep.register(MemRegion(region_id=POOL_BASE + t, addr=seg.addr + off,
                                                     size=TENSOR_BYTES, remote_accessible=True, placement=0,
                                                     backing=SharedSegment(name=seg.name, offset=off)))
    conn.send((ep.describe(), descs))
    conn.recv()
    ep.close()
    backend.release(seg)


_TRACE: list = []
_TRACE_LOCK = threading.Lock()


def _wrap() -> None:
    orig = llmdd_shm.ShmChannel._run_mapped

    def traced(self, batch, write, plan, deadline):
        t0 = time.perf_counter()
        try:
            return orig(self, batch, write, plan, deadline)
        finally:
            with _TRACE_LOCK:
                _TRACE.append({"thread": threading.current_thread().name, "start": t0,
                               "end": time.perf_counter(), "bytes": int(plan.total)})

    llmdd_shm.ShmChannel._run_mapped = traced


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    _wrap()
    load_before = open("/proc/loadavg").read().split()[:3]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_prompt, args=(child,), daemon=True)
    p.start()
    out: dict = {"command": "python bench/probes/shm_split_profile.py " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if v is not None), "cpus": os.cpu_count(),
        "load_before": load_before, "cases": {}}
    try:
        assert parent.poll(120), "prompt did not start"
        desc, descs = parent.recv()
        dst = np.empty(TOTAL, dtype=np.uint8)
        dst[:] = 1
        src_local = np.empty(TOTAL, dtype=np.uint8)
        src_local.view(np.uint64)[:] = np.arange(TOTAL // 8, dtype=np.uint64)
        chans = {}
        for name, opts in (("split", {}), ("one", {"llmdd.shm.threads": 1})):
            ep = ShmTransport(opts).open_endpoint()
            for t in range(TENSORS):
                ep.register(MemRegion(region_id=LOCAL_BASE + t, addr=dst.ctypes.data + t * TENSOR_BYTES,
                                      size=TENSOR_BYTES, remote_accessible=False, placement=0))
            ch = ep.connect(desc, timeout=10)
            for rid, d in descs.items():
                ch.add_remote_region(rid, TENSOR_BYTES, d)
            chans[name] = (ep, ch)
        rng = np.random.default_rng(22)
        for block in (64 << 10, 16 << 10):
            nb = TENSOR_BYTES // block
            t = np.repeat(np.arange(TENSORS), nb)
            src = np.concatenate([rng.permutation(nb) for _ in range(TENSORS)])
            dsti = np.concatenate([rng.permutation(nb) for _ in range(TENSORS)])
            ops = make_ops(LOCAL_BASE + t, dsti * block, POOL_BASE + t, src * block, block)
            rows_src = src_local.reshape(-1, block)
            idx = (t * nb + src).astype(np.int64)
            rows_dst = dst.reshape(-1, block)
            res: dict = {"split": [], "one": [], "gather": [], "parts": []}
            for r in range(args.runs + 1):   # round 0: warm-up
                for kind in (("split", "one", "gather") if r % 2 else ("gather", "one", "split")):
                    _TRACE.clear()
                    t0 = time.perf_counter()
                    if kind == "gather":
                        np.take(rows_src, idx, axis=0, out=rows_dst[: len(idx)], mode="clip")
                    else:
                        c = chans[kind][1].read(ops, deadline=time.monotonic() + 120)
                        assert c.wait(180) and c.error is None, c.error
                    t1 = time.perf_counter()
                    if kind != "gather":
                        pick = np.random.default_rng(r).integers(0, len(t), 256)
                        got = dst.view(np.uint64).reshape(TENSORS, -1, block // 8)[t[pick], dsti[pick], 0]
                        want = t[pick].astype(np.uint64) * (TENSOR_BYTES // 8) + src[pick].astype(np.uint64) * (block // 8)
                        assert np.array_equal(got, want), kind
                    if not r:
                        continue
                    res[kind].append(TOTAL / (t1 - t0) / 1e9)
                    if kind == "split":
                        parts = sorted(_TRACE, key=lambda x: x["start"])
                        caller = [x for x in parts if x["thread"] == threading.current_thread().name]
                        other = [x for x in parts if x["thread"] != threading.current_thread().name]
                        row = {"wall_ms": (t1 - t0) * 1e3,
                               "parts": [{"thread": x["thread"], "start_ms": (x["start"] - t0) * 1e3,
                                          "dur_ms": (x["end"] - x["start"]) * 1e3, "bytes": x["bytes"]}
                                         for x in parts]}
                        if caller and other:
                            a, b = caller[0], other[0]
                            row["tail_wait_ms"] = max(0.0, (t1 - a["end"])) * 1e3
                            row["overlap"] = max(0.0, min(a["end"], b["end"]) - max(a["start"], b["start"])) / (
                                max(a["end"], b["end"]) - min(a["start"], b["start"]))
                            row["other_start_delay_ms"] = (b["start"] - t0) * 1e3
                        res["parts"].append(row)
            med = {k: statistics.median(v) for k, v in res.items() if k != "parts"}
            case = {"block": block, "gbps_all": {k: [round(x, 3) for x in res[k]] for k in ("split", "one", "gather")},
                    "gbps_median": med, "split_vs_gather": med["split"] / med["gather"],
                    "one_vs_gather": med["one"] / med["gather"], "split_vs_one": med["split"] / med["one"],
                    "split_batches": res["parts"]}
            out["cases"][f"{block >> 10}k"] = case
            waits = [x.get("tail_wait_ms", 0) for x in res["parts"]]
            over = [x.get("overlap", 0) for x in res["parts"]]
            print(f"{block >> 10} KiB: split {med['split']:.2f} GB/s, one thread {med['one']:.2f}, gather "
                  f"{med['gather']:.2f}; split/gather {case['split_vs_gather']:.2f}x, split/one "
                  f"{case['split_vs_one']:.2f}x; caller's tail wait ms {[round(w, 1) for w in waits]}, "
                  f"overlap {[round(o, 2) for o in over]}")
        for ep, ch in chans.values():
            ch.close()
            ep.close()
        parent.send("done")
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    out["load_after"] = open("/proc/loadavg").read().split()[:3]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
