#!/usr/bin/env python3
"""Mooncake Transfer Engine over TCP between two processes on this host: the peer llmdd's tcp figures
are compared with.

The decoder (this process) reads from a prompt (a spawned child) that owns and registers the
source buffer; both engines use ``P2PHANDSHAKE`` (no metadata server) bound to 127.0.0.1.
Workloads, each checked against the source pattern:

* ``mooncake_contiguous``: one ``transfer_sync_read`` of the whole buffer.
* ``mooncake_kv64`` / ``mooncake_kv16``: 64 tensors x N blocks of 64 / 16 KiB, independent random
  permutations as source and destination block ids, one ``batch_transfer_sync_read`` call.
* ``mooncake_latency``: one 64 KiB ``transfer_sync_read`` per call, p50 of 1000 after 100 warm-up;
  ``mooncake_latency_write``: the same with ``transfer_sync_write`` (checked by reading the last
  written block back).

Mooncake's per-peer TCP queue limits are raised (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` and
``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER`` 65535, ``MC_TCP_ADMISSION_TIMEOUT_MS`` 120000), as
deployments that batch whole KV caches do: with the defaults one batch of 16384 entries is
refused (rc -1).

Usage: python bench/peers/mooncake_peer.py --out DIR [--runs 5] [--gib 1]
Install: pip install mooncake-transfer-engine (CUDA build; needs libcudart), or on a host without
CUDA pip install mooncake-transfer-engine-non-cuda; both link libibverbs.so.1 (apt-get install
libibverbs1).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import HOST, GiB, KiB, Output, blocks_ok, contiguous_ok, fill, kv_layout, touch  # noqa: E402

LIMITS = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
          "MC_TCP_ADMISSION_TIMEOUT_MS": "120000"}


def _environment() -> None:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", HOST)
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    os.environ.setdefault("GLOG_minloglevel", "1")
    for k, v in LIMITS.items():
        os.environ.setdefault(k, v)


def _engine():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize returned {rc}")
    return engine


def _prompt_main(conn, nbytes: int) -> None:
    import numpy as np

    _environment()
    engine = _engine()
    src = np.empty(nbytes, dtype=np.uint8)
    fill(src)
    rc = engine.register_memory(src.ctypes.data, nbytes)
    if rc != 0:
        conn.send({"error": f"register_memory returned {rc}"})
        return
    conn.send({"segment": f"{HOST}:{engine.get_rpc_port()}", "addr": src.ctypes.data})
    if conn.poll(3600):
        conn.recv()
    engine.unregister_memory(src.ctypes.data)
    conn.send("bye")


def measure(args, out: Output) -> None:
    import numpy as np

    nbytes = int(args.gib * GiB)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_prompt_main, args=(there, nbytes), daemon=True)
    child.start()
    try:
        t0 = time.perf_counter()
        engine = _engine()
        dst = np.empty(nbytes, dtype=np.uint8)
        touch(dst)
        daddr = dst.ctypes.data
        if engine.register_memory(daddr, nbytes) != 0:
            raise RuntimeError("register_memory failed on the decoder")
        if not here.poll(300):
            raise RuntimeError("the prompt engine did not start within 300 s")
        peer = here.recv()
        if "error" in peer:
            raise RuntimeError(peer["error"])
        seg, raddr = peer["segment"], peer["addr"]
        rc = engine.transfer_sync_read(seg, daddr, raddr, 4096)
        if rc != 0:
            raise RuntimeError(f"first read returned {rc}")
        out.info("set-up", seconds=round(time.perf_counter() - t0, 3), limits=LIMITS)

        dst[:] = 0
        secs = []
        for i in range(args.runs + 1):
            t = time.perf_counter()
            rc = engine.transfer_sync_read(seg, daddr, raddr, nbytes)
            dt = time.perf_counter() - t
            if rc != 0:
                raise RuntimeError(f"transfer_sync_read returned {rc}")
            if i:
                secs.append(dt)
        out.bandwidth("mooncake_contiguous", f"Mooncake TCP contiguous {nbytes // (1 << 20)} MiB", nbytes, secs,
                      contiguous_ok(dst, nbytes))

        rng = np.random.default_rng(0)
        for block, key in ((64 * KiB, "mooncake_kv64"), (16 * KiB, "mooncake_kv16")):
            tensors, per = kv_layout(nbytes, block)
            src_ids, dst_ids = rng.permutation(per), rng.permutation(per)
            rows = np.arange(tensors)[:, None] * per
            local = ((rows + dst_ids[None, :]).reshape(-1) * block + daddr).tolist()
            remote = ((rows + src_ids[None, :]).reshape(-1) * block + raddr).tolist()
            lengths = [block] * len(local)
            dst[:] = 0
            secs, failed = [], 0
            for i in range(args.runs + 1):
                t = time.perf_counter()
                rc = engine.batch_transfer_sync_read(seg, local, remote, lengths)
                dt = time.perf_counter() - t
                if rc != 0:
                    failed += 1
                elif i:
                    secs.append(dt)
            label = f"Mooncake TCP KV {tensors}x{per}x{block // KiB}KiB one batch call"
            if not secs:
                out.info(label, error=f"every run returned rc != 0 ({failed})")
                continue
            out.bandwidth(key, label, tensors * per * block, secs, blocks_ok(dst, tensors, per, block, src_ids, dst_ids),
                          failed_runs=failed)

        block = 64 * KiB
        count = nbytes // block
        n, warm = args.latency_n, args.latency_n // 10
        draws = list(zip(rng.integers(0, count, n + warm).tolist(), rng.integers(0, count, n + warm).tolist()))
        dst[:] = 0
        us, failed = [], 0
        for i, (s, d) in enumerate(draws):
            t = time.perf_counter()
            rc = engine.transfer_sync_read(seg, daddr + d * block, raddr + s * block, block)
            dt = (time.perf_counter() - t) * 1e6
            if rc != 0:
                failed += 1
            elif i >= warm:
                us.append(dt)
        s, d = draws[-1]
        w = block // 8
        ok = bool((dst[d * block:(d + 1) * block].view(np.uint64) == np.arange(s * w, (s + 1) * w,
                                                                                 dtype=np.uint64)).all())
        if us:
            out.latency("mooncake_latency", "Mooncake TCP one 64 KiB block transfer_sync_read", us, ok,
                        failed_calls=failed)
        else:
            out.info("one 64 KiB block", error=f"every call returned rc != 0 ({failed})")
        # the same for a write of one block into the prompt's buffer (the last measurement: it changes
        # the source); checked by reading the last written block back into a block written nowhere
        draws = list(zip(rng.integers(0, count, n + warm).tolist(), rng.integers(1, count, n + warm).tolist()))
        us, failed = [], 0
        for i, (s, d) in enumerate(draws):
            t = time.perf_counter()
            rc = engine.transfer_sync_write(seg, daddr + d * block, raddr + s * block, block)
            dt = (time.perf_counter() - t) * 1e6
            if rc != 0:
                failed += 1
            elif i >= warm:
                us.append(dt)
        s, d = draws[-1]
        back = engine.transfer_sync_read(seg, daddr, raddr + s * block, block)   # local block 0: no write source
        ok = back == 0 and bool((dst[:block] == dst[d * block:(d + 1) * block]).all())
        if us:
            out.latency("mooncake_latency_write", "Mooncake TCP one 64 KiB block transfer_sync_write", us, ok,
                        failed_calls=failed)
        else:
            out.info("one 64 KiB block write", error=f"every call returned rc != 0 ({failed})")
        engine.unregister_memory(daddr)
        here.send("done")
        here.poll(30)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join(5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for mooncake_peer.jsonl")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--gib", type=float, default=1.0, help="buffer per side, GiB")
    ap.add_argument("--latency-n", type=int, default=1000)
    args = ap.parse_args()
    _environment()
    out = Output(args.out, "mooncake_peer")
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        out.info("unavailable", error=str(exc))
        return 3
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for dist in ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            pass
    out.info("versions", **versions)
    measure(args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
