"""Issue 39 (5): the connector's pull without vLLM: two llmdd engines in two processes, each
registering a KV cache shaped like vLLM's CPU cache of the ``scripts/bench_vllm_ttft.py`` model
(8 layers of ``[blocks, 8 heads, 32 tokens, 2 x 64]`` float32, one shared buffer) exactly as
``llmdd_vllm.worker`` registers it (units of one head of one block, ``llmdd_vllm.tp.plan``), and
the decoder pulling a prompt's blocks with ``pull_blocks_async`` the way the connector's pull
thread does, timed from the call to the callback (a probe; no verdict).

With ``--spin`` a Python thread of the decoder process runs a busy loop meanwhile, as vLLM's
engine-core thread does while a request waits for its KV (``WAITING_FOR_REMOTE_KVS``): every
Python step of the pull then waits for the GIL.  Every pull's bytes are compared with the
prefill side's.

    .venv-vllm/bin/python bench/probes/vllm_layout_pull.py [--blocks 128] [--reps 5] [--spin]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time

import numpy as np
import torch

LAYERS, HEADS, BS, HD = 8, 8, 32, 64
NUM_BLOCKS = 160


def _kv(seed: int) -> tuple:
    """One buffer, one [blocks, heads, block_size, 2*head] view per layer (vLLM's CPU layout)."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.rand((LAYERS, NUM_BLOCKS, HEADS, BS, 2 * HD), generator=g, dtype=torch.float32)
    return buf, [buf[i] for i in range(LAYERS)]


def _engine(role, cid: int, tensors: list, listen: bool):
    from llmdd import BlocksCacheKey, CacheDesc, DataType, LLMConfig, LLMDataDist

    cfg = LLMConfig()
    cfg.enable_cache_manager = True
    if listen:
        cfg.listen_ip_info = "127.0.0.1:0"
    opts = dict(cfg.generate_options())
    opts["llmdd.transport"] = "shm"
    dd = LLMDataDist(role, cid)
    dd.init(opts)
    units = NUM_BLOCKS * HEADS
    views = [t.view(units, -1).view(torch.uint8) for t in tensors]
    per_unit = views[0].shape[1]
    cache = dd.cache_manager.register_blocks_cache(CacheDesc(len(views), [units, per_unit], DataType.DT_UINT8), views,
                                                   BlocksCacheKey(cid, 0) if listen else None)
    return dd, cache


def _prefill(q_out, q_in) -> None:
    from llmdd import LLMRole

    buf, tensors = _kv(1)
    dd, _ = _engine(LLMRole.PROMPT, 7001, tensors, True)
    q_out.put((dd.statistics()["listen"][1], os.getpid(), buf.data_ptr()))
    q_in.get()
    dd.finalize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--spin", action="store_true")
    args = ap.parse_args()
    from llmdd import BlocksCacheKey, LLMClusterInfo, LLMRole, LLMStatusCode
    from llmdd_shm._cma import Cma, iovecs
    from llmdd_vllm.tp import plan

    # where a pull's time goes inside llmdd: the ops (the copy) and the tag's acknowledged notice
    from llmdd._data import engine as _eng
    inside: dict = {"run_ops": [], "tag_notice": []}

    def _timed(name: str, fn):
        def wrapper(*a, **k):
            t = time.monotonic()
            try:
                return fn(*a, **k)
            finally:
                inside[name].append(time.monotonic() - t)
        return wrapper
    _eng.TransferEngine.run_ops = _timed("run_ops", _eng.TransferEngine.run_ops)          # type: ignore[method-assign]
    _eng.TransferEngine._tag_notice = _timed("tag_notice", _eng.TransferEngine._tag_notice)  # type: ignore[method-assign]
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_prefill, args=(q_out, q_in), daemon=True)
    p.start()
    port, ppid, paddr = q_out.get(timeout=120)
    src_buf, _ = _kv(1)
    buf, tensors = _kv(2)
    dd, cache = _engine(LLMRole.DECODER, 7002, tensors, False)
    info = LLMClusterInfo()
    info.remote_cluster_id = 7001
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", port)
    ret, rets = dd.link_clusters([info], 10000)
    assert (rets[0] if rets else ret) == LLMStatusCode.LLM_SUCCESS, (ret, rets)
    stop = threading.Event()
    spinner = None
    if args.spin:
        def spin() -> None:
            x = 0
            while not stop.is_set():
                x += 1
        spinner = threading.Thread(target=spin, daemon=True)
        spinner.start()
    rng = np.random.default_rng(3)
    rows = []
    try:
        for rep in range(args.reps):
            src = sorted(rng.choice(NUM_BLOCKS, args.blocks, replace=False).tolist())
            dst = list(range(10 + rep, 10 + rep + args.blocks))
            (piece,) = plan(0, 1, 1, HEADS, src, dst)
            buf[:, dst] = 0
            done = threading.Event()
            got: list = []

            def cb(status) -> None:
                got.append((status, time.monotonic()))
                done.set()

            nbytes = args.blocks * HEADS * BS * 2 * HD * 4 * LAYERS
            row: dict = {"rep": rep, "bytes": nbytes}
            for how in ("tagged", "untagged", "raw_cma"):
                buf[:, dst] = 0
                done.clear()
                got.clear()
                t0 = time.monotonic()
                if how == "raw_cma":
                    # the same bytes, one process_vm_readv iovec per (layer, block) run of 8 heads
                    blk = HEADS * BS * 2 * HD * 4
                    lay = NUM_BLOCKS * blk
                    la = np.array([buf.data_ptr() + l * lay + b * blk for l in range(LAYERS) for b in dst], np.uint64)
                    ra = np.array([paddr + l * lay + b * blk for l in range(LAYERS) for b in src], np.uint64)
                    ln = np.full(len(la), blk, np.uint64)
                    Cma().transfer(ppid, iovecs(la, ln), iovecs(ra, ln), write=False)
                    t1 = t2 = time.monotonic()
                else:
                    for v in inside.values():
                        v.clear()
                    dd.cache_manager.pull_blocks_async(BlocksCacheKey(7001, 0), cache, piece.src, piece.dst,
                                                       tag=f"r{rep}" if how == "tagged" else None, callback=cb)
                    t1 = time.monotonic()
                    assert done.wait(60)
                    status, t2 = got[0]
                    assert status == LLMStatusCode.LLM_SUCCESS, status
                row[how] = {"submit_s": round(t1 - t0, 5), "done_s": round(t2 - t0, 5),
                            "gbps": round(nbytes / (t2 - t0) / 1e9, 3),
                            "same_bytes": bool(torch.equal(buf[:, dst], src_buf[:, src]))}
                if how != "raw_cma":
                    row[how].update({k: round(sum(v), 5) for k, v in inside.items()})
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        stop.set()
        q_in.put(None)
        dd.finalize()
        p.join(30)
    print(json.dumps({"spin": args.spin, "load": os.getloadavg(), "median_gbps": {
        k: float(np.median([r[k]["gbps"] for r in rows])) for k in ("tagged", "untagged", "raw_cma")}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
