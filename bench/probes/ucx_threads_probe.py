#!/usr/bin/env python3
"""Probe: can two threads post NIXL (UCX backend) gets concurrently, and does it pay on this host?

Two processes on this host. The owner (spawned) registers one region of ``--mib`` MiB of seeded
random bytes with a raw NIXL agent and keeps its worker progressed. The reader pulls the whole
region as ``--block-kib`` KiB blocks in a random block order (source and destination permuted
independently), three ways, interleaved round by round:

* ``cma 1T``: single-thread ``process_vm_readv``, one iovec per block, at most 1024 iovecs per call
  (what ``llmdd bench``'s ``cma_64k`` anchor does); ``cma 2T``: two threads, half the blocks each
  (does the kernel's copy itself scale to two cores here?);
* ``nixl 1T``: one thread posts every block as one NIXL request (``initialize_xfer`` +
  ``transfer``) and polls it;
* ``nixl 2T``: two threads each post half the blocks as one request of their own and poll it,
  started together (a barrier).

The NIXL rows are measured for each agent configuration of ``--configs`` (sync mode / UCX backend
``num_workers``); each configuration is its own reader agent. Every pull's bytes are compared with
the owner's (seeded random data). Prints GB/s (1e9 B/s): median, min, max of ``--runs``.

Usage: UCX_MODULES=^ib python bench/probes/ucx_threads_probe.py [--runs 15] [--mib 64] [--block-kib 64]
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import statistics
import threading
import time

import numpy as np

MiB = 1 << 20
KiB = 1 << 10
_IOV_MAX = 1024
CONFIGS = ("STRICT:1", "STRICT:2", "RW:2", "NONE:2")


def _api():
    os.environ.setdefault("UCX_MODULES", "^ib")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import nixl_cu12._api as api
    return api


def _agent(api, name: str, sync: str, workers: int):
    conf = api.nixl_agent_config(enable_prog_thread=False, backends=[],
                                 sync_mode=getattr(api.nixl_thread_sync_t, "NIXL_THREAD_SYNC_" + sync))
    agent = api.nixl_agent(name, conf)
    agent.create_backend("UCX", {"num_workers": str(workers)})
    return agent


def _owner(conn, nbytes: int, seed: int) -> None:
    api = _api()
    agent = _agent(api, "probe-owner", "STRICT", 1)
    src = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    dl = agent.register_memory(np.array([[src.ctypes.data, nbytes, 0]], np.uint64), "DRAM")
    conn.send((agent.get_agent_metadata(), src.ctypes.data, os.getpid()))
    while not conn.poll(0.001):
        agent.get_new_notifs()   # progresses the worker (wire-up of the readers' endpoints)
    conn.recv()
    agent.deregister_memory(dl)
    conn.send("bye")


def _readv():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.process_vm_readv
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return fn


def _post_and_wait(agent, ldesc: np.ndarray, rdesc: np.ndarray, peer: str) -> None:
    h = agent.initialize_xfer("READ", agent.get_xfer_descs(ldesc, "DRAM"), agent.get_xfer_descs(rdesc, "DRAM"), peer)
    st = agent.transfer(h)
    end = time.monotonic() + 60
    while st == "PROC":
        st = agent.check_xfer_state(h)
        if time.monotonic() > end:
            raise TimeoutError("NIXL request did not finish in 60 s")
    if st != "DONE":
        raise RuntimeError(f"NIXL request failed: {st}")
    agent.release_xfer_handle(h)


class _Pair:
    """A second thread that posts its half when the first thread reaches the barrier."""

    def __init__(self, agent, peer: str) -> None:
        self.agent, self.peer = agent, peer
        self.go = threading.Barrier(2)
        self.done = threading.Barrier(2)
        self.work = None
        self.error = None
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        while True:
            self.go.wait()
            if self.work is None:
                return
            try:
                _post_and_wait(self.agent, *self.work, self.peer)
            except Exception as exc:  # noqa: BLE001 - reported by the posting thread
                self.error = exc
            self.done.wait()

    def pull(self, halves) -> None:
        self.work = halves[1]
        self.go.wait()
        _post_and_wait(self.agent, *halves[0], self.peer)
        self.done.wait(60)
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self.work = None
        self.go.wait()
        self.t.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list of SYNC:num_workers")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    api = _api()
    nbytes, blk = args.mib * MiB, args.block_kib * KiB
    nb = nbytes // blk
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=_owner, args=(there, nbytes, args.seed), daemon=True)
    p.start()
    try:
        if not here.poll(120):
            raise RuntimeError("owner did not start")
        md, raddr, pid = here.recv()
        expect = np.random.default_rng(args.seed).integers(0, 256, nbytes, dtype=np.uint8)
        dst = np.zeros(nbytes, np.uint8)
        rng = np.random.default_rng(args.seed + 1)
        sblk, dblk = rng.permutation(nb).astype(np.uint64), rng.permutation(nb).astype(np.uint64)
        laddrs = np.uint64(dst.ctypes.data) + dblk * np.uint64(blk)
        raddrs = np.uint64(raddr) + sblk * np.uint64(blk)
        want = expect.reshape(nb, blk)[sblk.astype(np.int64)]

        def check(what: str) -> None:
            if not np.array_equal(dst.reshape(nb, blk)[dblk.astype(np.int64)], want):
                raise AssertionError(f"{what} moved wrong bytes")

        # cma anchor
        readv = _readv()
        liov = np.stack([laddrs, np.full(nb, blk, np.uint64)], axis=1)
        riov = np.stack([raddrs, np.full(nb, blk, np.uint64)], axis=1)
        iov = [(np.ascontiguousarray(liov[i:i + _IOV_MAX]), np.ascontiguousarray(riov[i:i + _IOV_MAX]))
               for i in range(0, nb, _IOV_MAX)]

        def cma() -> None:
            done = 0
            for lv, rv in iov:
                got = readv(pid, lv.ctypes.data, len(lv), rv.ctypes.data, len(rv), 0)
                if got < 0:
                    raise OSError(ctypes.get_errno(), "process_vm_readv")
                done += got
            if done != nbytes:
                raise RuntimeError("short process_vm_readv")

        chalf = [iov[: len(iov) // 2], iov[len(iov) // 2:]] if len(iov) > 1 else None

        def cma_part(part: list, out: list) -> None:
            for lv, rv in part:
                got = readv(pid, lv.ctypes.data, len(lv), rv.ctypes.data, len(rv), 0)
                out.append(got)

        def cma2() -> None:
            assert chalf is not None
            got: list = []
            t = threading.Thread(target=cma_part, args=(chalf[1], got))
            t.start()
            cma_part(chalf[0], got)
            t.join(60)
            if sum(got) != nbytes:
                raise RuntimeError("short process_vm_readv (2 threads)")

        ldesc = np.stack([laddrs, np.full(nb, blk, np.uint64), np.zeros(nb, np.uint64)], axis=1)
        rdesc = np.stack([raddrs, np.full(nb, blk, np.uint64), np.zeros(nb, np.uint64)], axis=1)
        half = nb // 2
        halves = [(ldesc[:half].copy(), rdesc[:half].copy()), (ldesc[half:].copy(), rdesc[half:].copy())]
        dregs = []
        readers = {}
        for cfg in args.configs.split(","):
            sync, workers = cfg.split(":")
            a = _agent(api, f"probe-reader-{sync}-{workers}", sync, int(workers))
            dregs.append((a, a.register_memory(np.array([[dst.ctypes.data, nbytes, 0]], np.uint64), "DRAM")))
            peer = a.add_remote_agent(md)
            peer = peer.decode() if isinstance(peer, bytes) else peer
            readers[cfg] = (a, peer, _Pair(a, peer))
        fns = {"cma 1T": cma}
        if chalf is not None:
            fns["cma 2T"] = cma2
        for cfg, (a, peer, pair) in readers.items():
            fns[f"nixl {cfg} 1T"] = (lambda a=a, peer=peer: _post_and_wait(a, ldesc, rdesc, peer))
            fns[f"nixl {cfg} 2T"] = (lambda pair=pair: pair.pull(halves))
        res: dict = {k: [] for k in fns}
        names = list(fns)
        for r in range(args.runs + 1):   # round 0 is warm-up
            order = names if r % 2 == 0 else names[::-1]
            for k in order:
                dst[:] = 0
                t = time.perf_counter()
                fns[k]()
                dt = time.perf_counter() - t
                check(k)
                if r:
                    res[k].append(nbytes / dt / 1e9)
        for _cfg, (_a, _peer, pair) in readers.items():
            pair.stop()
        base = statistics.median(res["cma 1T"])
        print(f"{args.mib} MiB as {nb} random {args.block_kib} KiB blocks, {args.runs} runs, pid {os.getpid()}, "
              f"load {os.getloadavg()[0]:.2f}")
        print("| path | median GB/s | min | max | vs cma 1T |")
        print("|---|---:|---:|---:|---:|")
        for k, v in res.items():
            m = statistics.median(v)
            print(f"| {k} | {m:.2f} | {min(v):.2f} | {max(v):.2f} | {m / base:.2f}x |", flush=True)
        for a, dl in dregs:
            a.deregister_memory(dl)
        here.send("done")
        here.poll(30)
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()


if __name__ == "__main__":
    main()
