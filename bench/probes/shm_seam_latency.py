"""The shm transport alone (the plugin's part of issue 21): ``Channel.read`` / ``write`` p50 against a
bare ``process_vm_readv`` / ``writev`` of the same iovecs, both data paths, another process's memory.

An owner process (spawned) registers a 64 MiB user-memory region (seeded random bytes) and a 64 MiB
sink; this process connects, and for each shape and data path times ``n`` batches (random distinct
blocks drawn up front; one op per block and tensor, tensors 32 MiB apart) interleaved call by call with
the bare system call of the same shape (its own random blocks, iovecs built before timing, so neither
warms the cache for the other), and checks the bytes of the last batch on the owner's side.
Shapes: 1 x 64 KiB (read and write), 8 blocks x 2 tensors x 16 KiB (read).

    .venv/bin/python bench/probes/shm_seam_latency.py --out bench/results-committed/issue21/<name>
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np

from llmdd._tools.bench.common import load_average

MiB = 1 << 20
SIZE = 64 * MiB
HALF = SIZE // 2


def _owner(conn) -> None:
    from llmdd.lowlevel import MemRegion
    from llmdd_shm import ShmTransport

    src = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    sink = np.zeros(SIZE, np.uint8)
    ep = ShmTransport({}).open_endpoint()
    d1 = ep.register(MemRegion(region_id=10, addr=src.ctypes.data, size=SIZE, remote_accessible=True, placement=0))
    d2 = ep.register(MemRegion(region_id=11, addr=sink.ctypes.data, size=SIZE, remote_accessible=True, placement=0))
    conn.send((ep.describe(), d1, d2, os.getpid(), src.ctypes.data, sink.ctypes.data))
    while True:
        cmd = conn.recv()
        if cmd[0] == "slice":
            _, which, off, n = cmd
            conn.send(bytes((src if which == 10 else sink)[off:off + n]))
        else:
            break
    ep.close()


def _syscall(name):
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, name)
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return fn


def measure(native: str, info, bb: int, blocks: int, tensors: int, write: bool, n: int, warmup: int) -> dict:
    from llmdd.lowlevel import MemRegion, make_ops
    from llmdd_shm import ShmTransport

    desc, d1, d2, pid, src_addr, sink_addr = info
    local = np.random.default_rng(2).integers(0, 256, SIZE, dtype=np.uint8)
    ep = ShmTransport({"llmdd.shm.native": native}).open_endpoint()
    ep.register(MemRegion(region_id=1, addr=local.ctypes.data, size=SIZE, remote_accessible=False, placement=0))
    ch = ep.connect(desc, timeout=10)
    rid, raddr = (11, sink_addr) if write else (10, src_addr)
    ch.add_remote_region(rid, SIZE, d2 if write else d1)
    fn = _syscall("process_vm_writev" if write else "process_vm_readv")
    per = HALF // bb
    rng = np.random.default_rng(3)
    k = blocks * tensors
    t = (np.arange(tensors, dtype=np.uint64) * np.uint64(HALF))[:, None]

    def draw():
        lb = rng.permutation(per)[:blocks].astype(np.uint64)
        rb = rng.permutation(per)[:blocks].astype(np.uint64)
        return (t + lb[None, :] * np.uint64(bb)).reshape(-1), (t + rb[None, :] * np.uint64(bb)).reshape(-1)

    calls = []
    for _ in range(n + warmup):
        lo, ro = draw()  # llmdd's blocks
        ops = make_ops(1, lo, rid, ro, bb)
        lo, ro = draw()  # the bare call's own blocks (same shape; no cache warmed for the other)
        liov = np.stack([np.uint64(local.ctypes.data) + lo, np.full(k, bb, np.uint64)], axis=1).copy()
        riov = np.stack([np.uint64(raddr) + ro, np.full(k, bb, np.uint64)], axis=1).copy()
        calls.append((ops, liov, riov))
    pc = time.perf_counter
    bare, llmdd = [], []
    go = ch.write if write else ch.read
    for i, (ops, liov, riov) in enumerate(calls):
        t0 = pc()
        got = fn(pid, liov.ctypes.data, k, riov.ctypes.data, k, 0)
        t1 = pc()
        c = go(ops, deadline=time.monotonic() + 10)
        err = c.error if c.wait(10) else "not done"
        t2 = pc()
        if got != k * bb or err is not None:
            raise RuntimeError(f"bare returned {got}, llmdd {err}")
        if i >= warmup:
            bare.append((t1 - t0) * 1e6)
            llmdd.append((t2 - t1) * 1e6)
    ops = calls[-1][0]
    stats = ch.statistics()
    ch.close()
    ep.close()
    return {"bare_p50": statistics.median(bare), "llmdd_p50": statistics.median(llmdd),
            "ratio_p50": statistics.median(llmdd) / statistics.median(bare), "last_ops": ops.tolist(),
            "native_batches": stats.get("native_batches"), "local_digest_of_last": [
                hashlib.sha256(bytes(local[o[1]:o[1] + o[4]])).hexdigest() for o in ops.tolist()]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_owner, args=(child,), daemon=True)
    p.start()
    info = parent.recv()
    res = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "load_before": load_average(),
           "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": []}
    shapes = {"read_1x64k": (64 << 10, 1, 1, False), "write_1x64k": (64 << 10, 1, 1, True),
              "read_8x2x16k": (16 << 10, 8, 2, False)}
    ok = True
    try:
        for r in range(a.runs):
            for native in ("off", "on"):
                for name, (bb, blocks, tensors, write) in shapes.items():
                    m = measure(native, info, bb, blocks, tensors, write, a.n, a.warmup)
                    # the bytes of the last batch, checked on the other side
                    for o, dig in zip(m.pop("last_ops"), m.pop("local_digest_of_last")):
                        parent.send(("slice", 11 if write else 10, o[3], o[4]))
                        other = hashlib.sha256(parent.recv()).hexdigest()
                        ok &= other == dig
                    m.update(run=r, path="native" if native == "on" else "python", shape=name,
                             load=load_average())
                    res["runs"].append(m)
                    print(f"run {r + 1} {m['path']:>6} {name:<13} llmdd p50 {m['llmdd_p50']:.1f} us, bare "
                          f"{m['bare_p50']:.1f} us: {m['ratio_p50']:.2f}x", flush=True)
    finally:
        parent.send(("exit",))
        p.join(30)
    summary = {}
    for path in ("python", "native"):
        for name in shapes:
            rs = [m["ratio_p50"] for m in res["runs"] if m["path"] == path and m["shape"] == name]
            summary[f"{path}/{name}"] = {"ratio_p50_median": statistics.median(rs), "ratios": rs}
    res.update(summary=summary, verified=bool(ok), load_after=load_average())
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    for k, v in summary.items():
        print(f"{k:<22} median {v['ratio_p50_median']:.2f}x ({', '.join(f'{x:.2f}' for x in v['ratios'])})")
    print(f"verified={ok}; load {res['load_before']} -> {res['load_after']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
