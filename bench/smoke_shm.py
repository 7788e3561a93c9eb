#!/usr/bin/env python3
"""Smoke bench (not a test): pull paged KV through the shm transport vs a raw process_vm_readv.

A spawned "prompt" process holds 1 GiB twice: (a) in a POSIX shared-memory pool segment
(regions registered with a ``backing`` segment: the decoder maps the segment) and (b) in a plain numpy
array (user memory: cross-memory attach). This process pulls every block with one batch of
random block tables (src and dst permuted per tensor) for

* 64 tensors x 256 blocks x 64 KiB and 64 x 1024 x 16 KiB,

and in the same run the anchor: a single-thread ``process_vm_readv`` of the same blocks from (b)
(one iovec per block, batches of IOV_MAX, iovecs prepared before timing), as
``llmdd bench``'s ``cma_64k`` / ``cma_16k`` anchors measure it. Also p50/p99 of 1000 single-block (one
tensor, 64 KiB) pulls, ``read`` + ``wait``, per memory kind. GB/s = 1e9 B/s, medians of --runs.

Usage: python bench/smoke_shm.py [--runs 3]
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

from llmdd.lowlevel import SharedSegment
from llmdd.lowlevel import MemRegion, make_ops
from llmdd_shm import ShmTransport, endpoint_fields
from llmdd_shm._cma import IOV_MAX, libc_syscalls

TENSORS = 64
TENSOR_BYTES = 16 << 20
TOTAL = TENSORS * TENSOR_BYTES
POOL_BASE, USER_BASE, LOCAL_BASE = 100, 300, 500


def _prompt(conn) -> None:
    from llmdd._memory.backend import HostBackend

    backend = HostBackend()
    seg = backend.allocate_segment(TOTAL)
    pool = seg.array()
    pool.view(np.uint64)[:] = np.arange(TOTAL // 8, dtype=np.uint64)
    user = np.empty(TOTAL, dtype=np.uint8)
    user.view(np.uint64)[:] = np.arange(TOTAL // 8, dtype=np.uint64)
    ep = ShmTransport({}).open_endpoint()
    descs = {}
    for t in range(TENSORS):
        off = t * TENSOR_BYTES
        descs[POOL_BASE + t] = ep.register(MemRegion(region_id=POOL_BASE + t, addr=seg.addr + off,
                                                     size=TENSOR_BYTES, remote_accessible=True, placement=0,
                                                     backing=SharedSegment(name=seg.name, offset=off)))
        descs[USER_BASE + t] = ep.register(MemRegion(region_id=USER_BASE + t, addr=user.ctypes.data + off,
                                                     size=TENSOR_BYTES, remote_accessible=True, placement=0))
    conn.send((ep.describe(), descs, user.ctypes.data))
    conn.recv()
    ep.close()
    backend.release(seg)


def _tables(block: int, seed: int):
    nb = TENSOR_BYTES // block
    rng = np.random.default_rng(seed)
    t = np.repeat(np.arange(TENSORS), nb)
    src = np.concatenate([rng.permutation(nb) for _ in range(TENSORS)])
    dst = np.concatenate([rng.permutation(nb) for _ in range(TENSORS)])
    return t, src, dst, nb


def _verify(dst: np.ndarray, t, src, dst_idx, block: int) -> bool:
    w = block // 8
    d = dst.view(np.uint64).reshape(TENSORS, -1, w)
    pick = np.random.default_rng(7).integers(0, len(t), 512)
    first = d[t[pick], dst_idx[pick], 0]
    expect = (t[pick].astype(np.uint64) * (TENSOR_BYTES // 8) + src[pick].astype(np.uint64) * w)
    return bool(np.array_equal(first, expect))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_prompt, args=(child,), daemon=True)
    p.start()
    try:
        assert parent.poll(120), "prompt did not start"
        desc, descs, user_addr = parent.recv()
        pid = endpoint_fields(desc).pid
        dst = np.empty(TOTAL, dtype=np.uint8)
        dst[:] = 1  # pre-fault
        ep = ShmTransport({}).open_endpoint()
        for t in range(TENSORS):
            ep.register(MemRegion(region_id=LOCAL_BASE + t, addr=dst.ctypes.data + t * TENSOR_BYTES,
                                  size=TENSOR_BYTES, remote_accessible=False, placement=0))
        ch = ep.connect(desc, timeout=10)
        for rid, d in descs.items():
            ch.add_remote_region(rid, TENSOR_BYTES, d)
        readv, _ = libc_syscalls()
        print(f"shm transport smoke: {TENSORS} tensors x 16 MiB, runs={args.runs}, cpus={os.cpu_count()}, "
              f"IOV_MAX={IOV_MAX}, probe={ShmTransport.probe().details.get('cma_reason')}")
        for block in (64 << 10, 16 << 10):
            t, src, dsti, nb = _tables(block, block)
            res = {"pool": [], "user": [], "anchor": []}
            ok = {}
            ops = {kind: make_ops(LOCAL_BASE + t, dsti * block, base + t, src * block, block)
                   for kind, base in (("pool", POOL_BASE), ("user", USER_BASE))}
            lv = np.empty((len(t), 2), np.uint64)
            lv[:, 0] = dst.ctypes.data + t.astype(np.uint64) * TENSOR_BYTES + dsti.astype(np.uint64) * block
            lv[:, 1] = block
            rv = np.empty((len(t), 2), np.uint64)
            rv[:, 0] = user_addr + t.astype(np.uint64) * TENSOR_BYTES + src.astype(np.uint64) * block
            rv[:, 1] = block

            def anchor():
                done = 0
                for i in range(0, len(lv), IOV_MAX):
                    n = min(IOV_MAX, len(lv) - i)
                    k = readv(pid, lv[i:].ctypes.data, n, rv[i:].ctypes.data, n, 0)
                    if k < 0:
                        raise OSError(ctypes.get_errno(), "process_vm_readv")
                    done += k
                assert done == TOTAL, done

            for r in range(args.runs + 1):  # first round is a warm-up
                for kind in ("pool", "user", "anchor"):
                    if r == args.runs:
                        dst[:] = 0  # the last round is verified on zeroed memory
                    t0 = time.perf_counter()
                    if kind == "anchor":
                        anchor()
                    else:
                        c = ch.read(ops[kind], deadline=time.monotonic() + 60)
                        assert c.wait(120) and c.error is None, c.error
                    dt = time.perf_counter() - t0
                    if r:
                        res[kind].append(TOTAL / dt / 1e9)
                    ok[kind] = _verify(dst, t, src, dsti, block)
            med = {k: statistics.median(v) for k, v in res.items()}
            kb = block >> 10
            print(f"\n{TENSORS} x {nb} x {kb} KiB ({len(t)} blocks, random tables both sides):")
            print(f"  anchor: single-thread process_vm_readv, {IOV_MAX} iov/call: {med['anchor']:6.2f} GB/s "
                  f"verified={ok['anchor']}")
            for kind, what in (("pool", "shm transport, pool (mapped segment)"),
                               ("user", "shm transport, user memory (CMA)")):
                print(f"  {what:40s}: {med[kind]:6.2f} GB/s  ratio to anchor {med[kind] / med['anchor']:.2f}x  "
                      f"verified={ok[kind]}  runs={[round(x, 2) for x in res[kind]]}")
        print("\none 64 KiB block of one tensor, read + wait, 1000 pulls (after 100 warm-up):")
        rng = np.random.default_rng(3)
        for kind, base in (("pool", POOL_BASE), ("user", USER_BASE)):
            us = []
            for i in range(1100):
                op = make_ops(LOCAL_BASE, int(rng.integers(256)) * 65536, base, int(rng.integers(256)) * 65536, 65536)
                t0 = time.perf_counter()
                c = ch.read(op, deadline=time.monotonic() + 5)
                c.wait(5)
                dt = (time.perf_counter() - t0) * 1e6
                assert c.error is None, c.error
                if i >= 100:
                    us.append(dt)
            us.sort()
            print(f"  {kind:5s}: p50 {us[len(us) // 2]:6.1f} us   p99 {us[int(len(us) * 0.99)]:6.1f} us")
        ch.close()
        ep.close()
        parent.send("done")
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()


if __name__ == "__main__":
    main()
