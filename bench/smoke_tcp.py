#!/usr/bin/env python3
"""Smoke bench (not a test): pull paged KV through the tcp transport vs a raw 2-stream socket.

Workload: 64 tensors x 256 blocks x 64 KiB (1 GiB) held by a spawned "prompt" process; this
process pulls every block with one batch of random block tables (src and dst permuted per
tensor). In the same run a raw Python two-stream socket moves the same 1 GiB (as ``llmdd bench``'s
``tcp_2stream`` anchor: ``sendall`` of memoryview halves, ``recv_into`` a pre-faulted
buffer). Runs alternate; medians are printed in GB/s (1e9 B/s) with the ratio tcp / raw.

Usage: python bench/smoke_tcp.py [--runs 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import threading
import time

import numpy as np

from llmdd.lowlevel import MemRegion, make_ops
from llmdd_tcp import TcpTransport

TENSORS, BLOCKS, BLOCK = 64, 256, 64 * 1024
TENSOR_BYTES = BLOCKS * BLOCK
TOTAL = TENSORS * TENSOR_BYTES
HOST = "127.0.0.1"


def _recv_exact(sock: socket.socket, mv: memoryview) -> None:
    got = 0
    while got < len(mv):
        r = sock.recv_into(mv[got:], len(mv) - got)
        if r == 0:
            raise ConnectionError("peer closed")
        got += r


def _prompt(conn) -> None:
    pool = np.empty(TOTAL, dtype=np.uint8)
    pool.view(np.uint64)[:] = np.arange(TOTAL // 8, dtype=np.uint64)
    ep = TcpTransport({}).open_endpoint(host=HOST)
    descs = []
    for t in range(TENSORS):
        descs.append(ep.register(MemRegion(region_id=100 + t, addr=pool.ctypes.data + t * TENSOR_BYTES,
                                           size=TENSOR_BYTES, remote_accessible=True, placement=0)))
    ls = socket.socket()
    ls.bind((HOST, 0))
    ls.listen(2)
    conn.send((ep.describe(), descs, ls.getsockname()[1]))
    raw = [ls.accept()[0] for _ in range(2)]
    for s in raw:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mv = memoryview(pool)
    half = TOTAL // 2

    def push(i: int, s: socket.socket) -> None:
        s.sendall(mv[i * half:(i + 1) * half])

    while True:
        cmd = conn.recv()
        if cmd != "raw":
            break
        ts = [threading.Thread(target=push, args=(i, s)) for i, s in enumerate(raw)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    for s in raw:
        s.close()
    ep.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_prompt, args=(child,), daemon=True)
    p.start()
    try:
        desc, descs, raw_port = parent.recv()
        dst = np.zeros(TOTAL, dtype=np.uint8)  # pre-faulted
        ep = TcpTransport({}).open_endpoint(host=HOST)
        for t in range(TENSORS):
            ep.register(MemRegion(region_id=t, addr=dst.ctypes.data + t * TENSOR_BYTES, size=TENSOR_BYTES,
                                  remote_accessible=False, placement=0))
        ch = ep.connect(desc, timeout=30)
        for t, d in enumerate(descs):
            ch.add_remote_region(100 + t, TENSOR_BYTES, d)
        raw = [socket.create_connection((HOST, raw_port)) for _ in range(2)]
        for s in raw:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rng = np.random.default_rng(0)
        src_tbl = np.stack([rng.permutation(BLOCKS) for _ in range(TENSORS)])
        dst_tbl = np.stack([rng.permutation(BLOCKS) for _ in range(TENSORS)])
        tensor = np.repeat(np.arange(TENSORS), BLOCKS)

        def pull_tcp() -> float:
            t0 = time.perf_counter()
            ops = make_ops(tensor, dst_tbl.reshape(-1) * BLOCK, 100 + tensor, src_tbl.reshape(-1) * BLOCK, BLOCK)
            c = ch.read(ops, deadline=time.monotonic() + 60)
            c.wait()
            dt = time.perf_counter() - t0
            if c.error is not None:
                raise c.error
            return dt

        mv = memoryview(dst)
        half = TOTAL // 2

        def pull_raw() -> float:
            t0 = time.perf_counter()
            parent.send("raw")
            ts = [threading.Thread(target=_recv_exact, args=(s, mv[i * half:(i + 1) * half]))
                  for i, s in enumerate(raw)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            return time.perf_counter() - t0

        pull_tcp()
        pull_raw()  # warm-up
        tcp, rawr = [], []
        for _ in range(args.runs):
            dst[:] = 0
            tcp.append(TOTAL / pull_tcp() / 1e9)
            # verify: the source holds uint64 indices; check first and last word of every block
            words = dst.reshape(TENSORS, BLOCKS, BLOCK // 8 * 8).view(np.uint64)
            src_block = tensor.reshape(TENSORS, BLOCKS) * BLOCKS + src_tbl
            first = np.empty((TENSORS, BLOCKS), dtype=np.uint64)
            first[np.arange(TENSORS)[:, None], dst_tbl] = (src_block * (BLOCK // 8)).astype(np.uint64)
            assert np.array_equal(words[:, :, 0], first), "tcp pull moved wrong bytes"
            assert np.array_equal(words[:, :, -1], first + np.uint64(BLOCK // 8 - 1)), "tcp pull moved wrong bytes"
            rawr.append(TOTAL / pull_raw() / 1e9)
        ch.close()
        ep.close()
        mt, mr = statistics.median(tcp), statistics.median(rawr)
        print(f"workload: {TENSORS} tensors x {BLOCKS} blocks x {BLOCK // 1024} KiB = {TOTAL / 2**30:.0f} GiB, "
              f"random block tables, {args.runs} runs (verified)")
        print(f"llmdd tcp pull       : {mt:.2f} GB/s  (runs {', '.join(f'{x:.2f}' for x in tcp)})")
        print(f"raw 2-stream socket  : {mr:.2f} GB/s  (runs {', '.join(f'{x:.2f}' for x in rawr)})")
        print(f"ratio tcp / raw      : {mt / mr:.2f}x  (target >= 0.8x)")
        for s in raw:
            s.close()
        parent.send("stop")
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()


if __name__ == "__main__":
    main()
