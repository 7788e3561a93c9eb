#!/usr/bin/env python3
"""Does a busy Python thread in the decoder's process slow llmdd's link and pulls (the GIL convoy)?

llmdd's engine runs on threads of the process that uses it; in vLLM that is the worker process,
whose model-runner thread runs Python on every engine step (and steps without pause while a request
waits for its KV).  A thread that waits for the GIL while another runs pure Python gets it only when
the runner is forced to drop it, after ``sys.getswitchinterval()`` (5 ms by default); every hand-off
between llmdd's threads (caller -> I/O loop -> completion) pays that.  This probe measures it without
vLLM: an owner process holds a blocks cache, a decoder process links and pulls, and in the decoder a
second thread runs one of

* ``none``: nothing (the reference);
* ``yield``: a Python loop calling ``os.sched_yield()`` each round (vLLM's idle worker between messages);
* ``python``: a pure-Python loop that never blocks (the model runner's step code);
* ``python-0.5ms``: the same with ``sys.setswitchinterval(0.0005)`` in the decoder.

Conditions alternate in rounds; per condition it prints the median link time, the median one-block
(64 KiB) pull and the median many-block pull (``--blocks`` blocks of 64 KiB), and the ratio of each to
``none`` in the same round.  Not a test and no verdict.

Usage: python bench/probes/gil_convoy.py [--transport shm|tcp] [--rounds 3] [--pulls 40] [--blocks 128] [--out F]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time

import numpy as np

from llmdd import (BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMConfig, LLMDataDist, LLMRole,
                   Placement)

HOST = "127.0.0.1"
OWNER, DECODER = 1, 2
TENSORS, NB, BLOCK = 4, 256, 16 * 1024          # 4 tensors x 256 blocks x 16 KiB: a block is 64 KiB in all
CONDITIONS = ("none", "yield", "python", "python-0.5ms")


def _engine(role: LLMRole, cluster: int, transport: str, listen: bool) -> LLMDataDist:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.sync_kv_timeout = 60000
    if listen:
        cfg.listen_ip_info = f"{HOST}:0"
    options = cfg.generate_options()
    options["llmdd.transport"] = transport
    dd = LLMDataDist(role, cluster)
    dd.init(options)
    return dd


def _register(dd: LLMDataDist, key, seed: int) -> tuple:
    arrays = [np.random.default_rng(seed + t).integers(0, 256, NB * BLOCK, dtype=np.uint8) for t in range(TENSORS)]
    desc = CacheDesc(TENSORS, [NB, BLOCK], DataType.DT_UINT8, Placement.DEVICE)
    cache = dd.cache_manager.register_blocks_cache(desc, [a.ctypes.data for a in arrays], key)
    return cache, arrays


def _owner(conn, transport: str) -> None:
    dd = _engine(LLMRole.PROMPT, OWNER, transport, listen=True)
    _cache, arrays = _register(dd, BlocksCacheKey(OWNER, 0), seed=7)
    conn.send(dd.statistics()["listen"][1])
    conn.recv()
    dd.finalize()
    del arrays


def _busy(kind: str, stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(200):
            x += 1
        if kind == "yield":
            os.sched_yield()


def _decoder(conn, port: int, transport: str, condition: str, pulls: int, blocks: int) -> None:
    if condition == "python-0.5ms":
        sys.setswitchinterval(0.0005)
    dd = _engine(LLMRole.DECODER, DECODER, transport, listen=False)
    cache, arrays = _register(dd, None, seed=99)
    stop = threading.Event()
    if condition != "none":
        threading.Thread(target=_busy, args=("yield" if condition == "yield" else "python", stop),
                         daemon=True).start()
    info = LLMClusterInfo()
    info.remote_cluster_id = OWNER
    info.append_local_ip_info(HOST, 0)
    info.append_remote_ip_info(HOST, port)
    t0 = time.perf_counter()
    ret, rets = dd.link_clusters([info], 60000)
    link_s = time.perf_counter() - t0
    if ret.name != "LLM_SUCCESS" or any(r.name != "LLM_SUCCESS" for r in rets):
        raise RuntimeError(f"link failed: {ret.name} {[r.name for r in rets]}")
    key = BlocksCacheKey(OWNER, 0)
    one, many = [], []
    for i in range(pulls):
        t0 = time.perf_counter()
        dd.cache_manager.pull_blocks(key, cache, [i % NB], [i % NB])
        one.append(time.perf_counter() - t0)
        src = list(range(blocks))
        t0 = time.perf_counter()
        dd.cache_manager.pull_blocks(key, cache, src, src)
        many.append(time.perf_counter() - t0)
    stop.set()
    # the bytes arrived: the decoder's first `blocks` blocks equal the owner's (same seeds)
    for t in range(TENSORS):
        want = np.random.default_rng(7 + t).integers(0, 256, NB * BLOCK, dtype=np.uint8)
        if not np.array_equal(arrays[t][:blocks * BLOCK], want[:blocks * BLOCK]):
            raise RuntimeError(f"tensor {t}: pulled bytes differ from the owner's")
    conn.send({"link_s": link_s, "one_s": statistics.median(one), "many_s": statistics.median(many)})
    dd.finalize()


def _run(transport: str, condition: str, pulls: int, blocks: int) -> dict:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    owner = ctx.Process(target=_owner, args=(b, transport))
    owner.start()
    if not a.poll(120):
        raise RuntimeError("the owner did not start within 120 s")
    port = a.recv()
    c, d = ctx.Pipe()
    dec = ctx.Process(target=_decoder, args=(d, port, transport, condition, pulls, blocks))
    dec.start()
    try:
        if not c.poll(600):
            raise RuntimeError(f"{condition}: no result within 600 s")
        return c.recv()
    finally:
        a.send("stop")
        dec.join(60)
        owner.join(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pulls", type=int, default=40)
    ap.add_argument("--blocks", type=int, default=128, help="blocks of the many-block pull (at most 256)")
    ap.add_argument("--out", default=None, help="write the rows and the summary as JSON here")
    args = ap.parse_args()
    if not 1 <= args.blocks <= NB:
        ap.error(f"--blocks must be in 1..{NB}")
    rows = []
    for r in range(args.rounds):
        base = None
        for cond in CONDITIONS:
            got = _run(args.transport, cond, args.pulls, args.blocks)
            base = got if cond == "none" else base
            row = dict(round=r, condition=cond, **got,
                       **{f"{k}_ratio": got[k] / base[k] for k in ("link_s", "one_s", "many_s")})
            rows.append(row)
            print(f"round {r} {cond:13s} link {got['link_s'] * 1e3:8.1f} ms  one block {got['one_s'] * 1e3:7.2f} ms "
                  f"({row['one_s_ratio']:5.1f}x)  {args.blocks} blocks {got['many_s'] * 1e3:7.2f} ms "
                  f"({row['many_s_ratio']:5.1f}x)", flush=True)
    summary = {cond: {k: statistics.median(x[k] for x in rows if x["condition"] == cond)
                      for k in ("link_s", "one_s", "many_s", "one_s_ratio", "many_s_ratio")} for cond in CONDITIONS}
    for cond, s in summary.items():
        print(f"median {cond:13s} link {s['link_s'] * 1e3:8.1f} ms  one block {s['one_s'] * 1e3:7.2f} ms "
              f"({s['one_s_ratio']:5.1f}x)  {args.blocks} blocks {s['many_s'] * 1e3:7.2f} ms ({s['many_s_ratio']:5.1f}x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "transport": args.transport, "blocks": args.blocks,
                       "block_bytes": TENSORS * BLOCK, "load": os.getloadavg(), "rows": rows,
                       "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
