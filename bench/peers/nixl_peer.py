#!/usr/bin/env python3
"""NIXL (UCX backend) between two processes on this host: the peer llmdd's same-host figures are compared with.

The decoder (this process) READs from a prompt (a spawned child) that owns the source buffer;
the agents exchange metadata and the buffer address over a pipe.  Each side registers one
buffer of ``--gib`` GiB as one region.  Workloads, each checked against the source pattern:

* ``nixl_contiguous``: one descriptor of the whole buffer.
* ``nixl_kv64`` / ``nixl_kv16``: 64 tensors x N blocks of 64 / 16 KiB, independent random
  permutations as source and destination block ids, per request (``make_prepped_xfer`` on
  prepared descriptor lists, post, wait, release: what a KV pull costs per request);
  ``*_prepared``: one prepared handle posted again (the steady state).
* ``nixl_latency``: one 64 KiB block per call, per request (``get_xfer_descs`` +
  ``initialize_xfer`` + post + wait + release), p50 of 1000 after 100 warm-up;
  ``nixl_latency_prepared``: a prepared handle per call (post + wait); ``nixl_latency_write``: one
  64 KiB block WRITE per request into the prompt's buffer (checked by reading the last one back).

Completion: ``check_xfer_state`` polled from Python, bounded by a deadline.  UCX picks its own
transport (cross-memory attach here).  ``UCX_MODULES=^ib`` is set: the IB module of the
nixl-cu12 1.5.1 wheel crashes at process exit on a host without RDMA devices.

Usage: python bench/peers/nixl_peer.py --out DIR [--runs 5] [--gib 1] [--prog-thread on|off]
Install (torch-free): pip install numpy && pip install --no-deps nixl-cu12==1.5.1
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import GiB, KiB, Output, blocks_ok, contiguous_ok, fill, kv_layout, touch  # noqa: E402

DEADLINE_S = 120.0


def _api():
    for mod in ("nixl_cu12", "nixl_cu13", "nixl"):
        try:
            pkg = importlib.import_module(mod)
        except ImportError:
            continue
        if mod == "nixl":
            pkg = importlib.import_module(pkg._pkg.__name__)
        return importlib.import_module(pkg.__name__ + "._api"), pkg.__name__
    raise ImportError("no NIXL package (pip install --no-deps nixl-cu12)")


def _agent(name: str, prog_thread: bool):
    import logging

    logging.getLogger("nixl").setLevel(logging.WARNING)
    api, _ = _api()
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=prog_thread, backends=["UCX"]))


def _prompt_main(conn, nbytes: int, prog_thread: bool) -> None:
    import numpy as np

    agent = _agent("prompt", prog_thread)
    src = np.empty(nbytes, dtype=np.uint8)
    fill(src)
    reg = agent.register_memory([(src.ctypes.data, nbytes, 0, "")], "DRAM")
    conn.send({"meta": agent.get_agent_metadata(), "addr": src.ctypes.data})
    if conn.poll(3600):
        conn.recv()
    agent.deregister_memory(reg)
    conn.send("bye")


def _run_to_done(agent, handle) -> None:
    state = agent.transfer(handle)
    deadline = time.monotonic() + DEADLINE_S
    while state != "DONE":
        if state == "ERR":
            raise RuntimeError("NIXL transfer failed")
        if time.monotonic() > deadline:
            raise TimeoutError(f"NIXL transfer not done within {DEADLINE_S:.0f} s")
        state = agent.check_xfer_state(handle)


def _descs(base: int, count: int, block: int):
    import numpy as np

    d = np.zeros((count, 3), dtype=np.uint64)
    d[:, 0] = np.uint64(base) + np.arange(count, dtype=np.uint64) * np.uint64(block)
    d[:, 1] = block
    return d


def measure(args, out: Output) -> None:
    import numpy as np

    nbytes = int(args.gib * GiB)
    prog = args.prog_thread == "on"
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_prompt_main, args=(there, nbytes, prog), daemon=True)
    child.start()
    try:
        t0 = time.perf_counter()
        agent = _agent("decoder", prog)
        dst = np.empty(nbytes, dtype=np.uint8)
        touch(dst)
        agent.register_memory([(dst.ctypes.data, nbytes, 0, "")], "DRAM")
        if not here.poll(300):
            raise RuntimeError("the prompt agent did not start within 300 s")
        peer = here.recv()
        remote = agent.add_remote_agent(peer["meta"])
        raddr = peer["addr"]
        out.info("set-up", seconds=round(time.perf_counter() - t0, 3), prog_thread=prog,
                 ucx_tls=os.environ.get("UCX_TLS", "UCX's choice"))

        dst[:] = 0
        loc = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(dst.ctypes.data, nbytes, 0)], "DRAM")
        rem = agent.prep_xfer_dlist(remote, [(raddr, nbytes, 0)], "DRAM")
        h = agent.make_prepped_xfer("READ", loc, [0], rem, [0])
        secs = []
        for i in range(args.runs + 1):
            t = time.perf_counter()
            _run_to_done(agent, h)
            if i:
                secs.append(time.perf_counter() - t)
        agent.release_xfer_handle(h)
        out.bandwidth("nixl_contiguous", f"NIXL contiguous {nbytes // (1 << 20)} MiB READ", nbytes, secs,
                      contiguous_ok(dst, nbytes))

        rng = np.random.default_rng(0)
        for block, key in ((64 * KiB, "nixl_kv64"), (16 * KiB, "nixl_kv16")):
            tensors, per = kv_layout(nbytes, block)
            src_ids, dst_ids = rng.permutation(per), rng.permutation(per)
            rows = np.arange(tensors)[:, None] * per
            lidx = (rows + dst_ids[None, :]).reshape(-1).astype(np.int32)
            ridx = (rows + src_ids[None, :]).reshape(-1).astype(np.int32)
            lb = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(dst.ctypes.data, tensors * per, block), "DRAM")
            rb = agent.prep_xfer_dlist(remote, _descs(raddr, tensors * per, block), "DRAM")
            moved = tensors * per * block
            label = f"{tensors}x{per}x{block // KiB}KiB"
            dst[:] = 0
            secs = []
            for i in range(args.runs + 1):
                t = time.perf_counter()
                h = agent.make_prepped_xfer("READ", lb, lidx, rb, ridx)
                _run_to_done(agent, h)
                agent.release_xfer_handle(h)
                if i:
                    secs.append(time.perf_counter() - t)
            out.bandwidth(key, f"NIXL KV {label} READ per request", moved, secs,
                          blocks_ok(dst, tensors, per, block, src_ids, dst_ids))
            dst[:] = 0
            h = agent.make_prepped_xfer("READ", lb, lidx, rb, ridx)
            secs = []
            for i in range(args.runs + 1):
                t = time.perf_counter()
                _run_to_done(agent, h)
                if i:
                    secs.append(time.perf_counter() - t)
            agent.release_xfer_handle(h)
            out.bandwidth(key + "_prepared", f"NIXL KV {label} READ prepared handle", moved, secs,
                          blocks_ok(dst, tensors, per, block, src_ids, dst_ids))
            agent.release_dlist_handle(lb)
            agent.release_dlist_handle(rb)

        block = 64 * KiB
        count = nbytes // block
        n, warm = args.latency_n, args.latency_n // 10
        draws = [(int(a), int(b)) for a, b in zip(rng.integers(0, count, n + warm), rng.integers(0, count, n + warm))]
        dst[:] = 0
        us = []
        for i, (s, d) in enumerate(draws):
            t = time.perf_counter()
            ld = agent.get_xfer_descs([(dst.ctypes.data + d * block, block, 0)], "DRAM")
            rd = agent.get_xfer_descs([(raddr + s * block, block, 0)], "DRAM")
            h = agent.initialize_xfer("READ", ld, rd, remote)
            _run_to_done(agent, h)
            agent.release_xfer_handle(h)
            if i >= warm:
                us.append((time.perf_counter() - t) * 1e6)
        s, d = draws[-1]
        w = block // 8
        ok = bool((dst[d * block:(d + 1) * block].view(np.uint64) == np.arange(s * w, (s + 1) * w,
                                                                                 dtype=np.uint64)).all())
        out.latency("nixl_latency", "NIXL one 64 KiB block READ per request", us, ok)
        lb = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(dst.ctypes.data, count, block), "DRAM")
        rb = agent.prep_xfer_dlist(remote, _descs(raddr, count, block), "DRAM")
        handles = [agent.make_prepped_xfer("READ", lb, [d], rb, [s]) for s, d in draws]
        dst[:] = 0
        us = []
        for i, h in enumerate(handles):
            t = time.perf_counter()
            _run_to_done(agent, h)
            if i >= warm:
                us.append((time.perf_counter() - t) * 1e6)
        for h in handles:
            agent.release_xfer_handle(h)
        ok = bool((dst[d * block:(d + 1) * block].view(np.uint64) == np.arange(s * w, (s + 1) * w,
                                                                                 dtype=np.uint64)).all())
        out.latency("nixl_latency_prepared", "NIXL one 64 KiB block READ prepared handle", us, ok)
        # WRITE of one block per request into the prompt's buffer (the last measurement: it changes the
        # source); checked by reading the last written block back into local block 0 (written from nowhere)
        draws = [(int(a), int(b)) for a, b in zip(rng.integers(0, count, n + warm), rng.integers(1, count, n + warm))]
        us = []
        for i, (s, d) in enumerate(draws):
            t = time.perf_counter()
            ld = agent.get_xfer_descs([(dst.ctypes.data + d * block, block, 0)], "DRAM")
            rd = agent.get_xfer_descs([(raddr + s * block, block, 0)], "DRAM")
            h = agent.initialize_xfer("WRITE", ld, rd, remote)
            _run_to_done(agent, h)
            agent.release_xfer_handle(h)
            if i >= warm:
                us.append((time.perf_counter() - t) * 1e6)
        s, d = draws[-1]
        h = agent.initialize_xfer("READ", agent.get_xfer_descs([(dst.ctypes.data, block, 0)], "DRAM"),
                                  agent.get_xfer_descs([(raddr + s * block, block, 0)], "DRAM"), remote)
        _run_to_done(agent, h)
        agent.release_xfer_handle(h)
        ok = bool((dst[:block] == dst[d * block:(d + 1) * block]).all())
        out.latency("nixl_latency_write", "NIXL one 64 KiB block WRITE per request", us, ok)
        agent.release_dlist_handle(lb)
        agent.release_dlist_handle(rb)
        agent.remove_remote_agent(remote)
        here.send("done")
        here.poll(30)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join(5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for nixl_peer.jsonl")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--gib", type=float, default=1.0, help="buffer per side, GiB")
    ap.add_argument("--latency-n", type=int, default=1000)
    ap.add_argument("--prog-thread", choices=("on", "off"), default="on", help="NIXL's progress thread")
    args = ap.parse_args()
    os.environ.setdefault("UCX_MODULES", "^ib")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    out = Output(args.out, "nixl_peer")
    try:
        from importlib.metadata import version

        _, pkg = _api()
        out.info("versions", package=pkg, version=version(pkg.replace("_", "-")))
    except ImportError as exc:
        out.info("unavailable", error=str(exc))
        return 3
    measure(args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
