#!/usr/bin/env python3
"""Smoke benchmark of the llmdd ``ucx`` transport against raw NIXL on the same bytes.

Two processes on this host: the spawned owner registers a 1 GiB source through the plugin; the
parent (decoder) registers a 1 GiB destination and PULLS paged KV blocks:

* KV 64 KiB: 64 tensors x 256 blocks x 64 KiB (16384 blocks)
* KV 16 KiB: 64 tensors x 1024 blocks x 16 KiB (65536 blocks)

source and destination block ids are independent random permutations (the same table in every
tensor). Each workload runs through the plugin (``Channel.read(ops)`` + ``wait``: validation,
coalescing, descriptor arrays, chunked NIXL requests, polling) and through raw NIXL's per-request
path on the same agents and bytes (``make_prepped_xfer`` on descriptor lists prepared once, then
``transfer`` + busy ``check_xfer_state`` + ``release``), interleaved run by run, alternating
which goes first. Prints GB/s (1e9 B/s, median of --runs) and the plugin's overhead in %.

Usage: python bench/smoke_ucx.py [--runs 5] [--tls default,tcp]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time

import numpy as np

GiB = 1 << 30
KiB = 1 << 10
WORKLOADS = ((64, 256, 64 * KiB), (64, 1024, 16 * KiB))


def _owner(conn, tls: str) -> None:
    from llmdd.lowlevel import MemRegion
    from llmdd_ucx import UcxTransport

    ep = UcxTransport({"llmdd.ucx.tls": tls}).open_endpoint()
    src = np.empty(GiB, np.uint8)
    src.view(np.uint64)[:] = np.arange(GiB // 8, dtype=np.uint64)
    desc = ep.register(MemRegion(region_id=10, addr=src.ctypes.data, size=GiB, remote_accessible=True, placement=0))
    conn.send((ep.describe(), desc))
    conn.recv()
    ep.close()
    conn.send("bye")


def _raw_pull(agent, lp, lidx, rp, ridx, peer) -> float:
    t = time.perf_counter()
    h = agent.make_prepped_xfer("READ", lp, lidx, rp, ridx)
    st = agent.transfer(h)
    end = time.monotonic() + 120
    while st == "PROC":
        st = agent.check_xfer_state(h)
        if time.monotonic() > end:
            raise TimeoutError("raw NIXL transfer did not finish")
    if st != "DONE":
        raise RuntimeError(f"raw NIXL transfer failed: {st}")
    dt = time.perf_counter() - t
    agent.release_xfer_handle(h)
    return dt


def run(tls: str, runs: int) -> list:
    from llmdd._seam.ops import make_ops
    from llmdd.lowlevel import MemRegion
    from llmdd_ucx import UcxTransport, region_fields

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=_owner, args=(there, tls), daemon=True)
    p.start()
    rows = []
    try:
        ep = UcxTransport({"llmdd.ucx.tls": tls}).open_endpoint()
        dst = np.zeros(GiB, np.uint8)
        ep.register(MemRegion(region_id=1, addr=dst.ctypes.data, size=GiB, remote_accessible=False, placement=0))
        if not here.poll(120):
            raise RuntimeError("owner did not start")
        peer, desc = here.recv()
        ch = ep.connect(peer, timeout=30)
        ch.add_remote_region(10, GiB, desc)
        agent, remote = ep.agent, ch.peer_name
        raddr = region_fields(desc).addr
        rng = np.random.default_rng(0)
        for nt, nb, blk in WORKLOADS:
            n = nt * nb
            src_ids, dst_ids = rng.permutation(nb), rng.permutation(nb)
            tens = np.arange(nt)[:, None] * nb
            lidx = (tens + dst_ids[None, :]).reshape(-1)
            ridx = (tens + src_ids[None, :]).reshape(-1)
            ops = make_ops(1, lidx * blk, 10, ridx * blk, blk)
            grid = np.zeros((n, 3), np.uint64)
            grid[:, 0] = np.arange(n, dtype=np.uint64) * blk
            grid[:, 1] = blk
            lg, rg = grid.copy(), grid.copy()
            lg[:, 0] += dst.ctypes.data
            rg[:, 0] += raddr
            lp = agent.prep_xfer_dlist("NIXL_INIT_AGENT", lg, "DRAM")
            rp = agent.prep_xfer_dlist(remote, rg, "DRAM")
            li32, ri32 = lidx.astype(np.int32), ridx.astype(np.int32)
            plugin, raw = [], []
            for r in range(runs + 1):
                order = ("plugin", "raw") if r % 2 == 0 else ("raw", "plugin")
                for which in order:
                    dst[:] = 0
                    if which == "plugin":
                        t = time.perf_counter()
                        c = ch.read(ops, deadline=time.monotonic() + 120)
                        c.wait()
                        dt = time.perf_counter() - t
                        if c.error is not None:
                            raise c.error
                    else:
                        dt = _raw_pull(agent, lp, li32, rp, ri32, remote)
                    w = blk // 8
                    got = dst.view(np.uint64).reshape(n, w)[lidx, 0]
                    if not np.array_equal(got, ridx.astype(np.uint64) * w):
                        raise AssertionError(f"{which} moved wrong bytes")
                    if r:
                        (plugin if which == "plugin" else raw).append(GiB / dt / 1e9)
            agent.release_dlist_handle(lp)
            agent.release_dlist_handle(rp)
            mp_, mr = statistics.median(plugin), statistics.median(raw)
            rows.append((tls or "default", f"{nt}x{nb}x{blk // KiB}KiB", mp_, mr, (mr - mp_) / mr * 100.0,
                         min(plugin), max(plugin), min(raw), max(raw)))
        ch.close()
        here.send("done")
        here.poll(30)
        ep.close()
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tls", default="default,tcp", help="comma list: default (UCX's choice), tcp, ...")
    args = ap.parse_args()
    from llmdd_ucx import UcxTransport
    info = UcxTransport.probe()
    if not info.available:
        print(f"ucx transport unavailable: {info.reason}")
        sys.exit(2)
    print(f"nixl: {dict(info.details)}")
    print("| UCX_TLS | workload | plugin GB/s | raw NIXL per-request GB/s | plugin overhead | plugin min-max | raw min-max |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for tls in args.tls.split(","):
        for row in run("" if tls == "default" else tls, args.runs):
            print("| %s | %s | %.2f | %.2f | %+.1f %% | %.2f-%.2f | %.2f-%.2f |" % row, flush=True)


if __name__ == "__main__":
    main()
