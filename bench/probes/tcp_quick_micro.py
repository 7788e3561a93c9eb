"""The tcp one-call small-transfer path without the engine: one 64 KiB block per call, owner in a child.

The owner child opens a tcp endpoint with one random region and serves, on another port, the raw
Python request/reply of ``llmdd bench`` (16-byte request, ``sendall`` of the block).  The parent times
``--n`` calls each of the raw request/reply, the channel's quick pull and quick push (interleaved in
rounds of 100), and prints p50 / p99 and the ratios; ``--profile`` adds a cProfile of the owner side
(the child's serving threads) and of the client's quick calls.

    .venv/bin/python bench/probes/tcp_quick_micro.py --n 5000 [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import multiprocessing as mp
import os
import pstats
import socket
import struct
import sys
import threading
import time

import numpy as np

BB = 64 * 1024


def _owner(conn, nbytes: int, profile: bool) -> None:
    from llmdd.lowlevel import MemRegion
    from llmdd_tcp import TcpTransport

    if profile:
        threading.setprofile(None)
        prof = cProfile.Profile()
        from llmdd_tcp import _endpoint
        orig = _endpoint.TcpEndpoint.serve_ready

        def wrapped(self, c):   # the worker's whole serving of a stream, profiled
            prof.enable()
            try:
                orig(self, c)
            finally:
                prof.disable()
        _endpoint.TcpEndpoint.serve_ready = wrapped
    buf = np.random.default_rng(11).integers(0, 256, nbytes, dtype=np.uint8)
    ep = TcpTransport({}).open_endpoint(host="127.0.0.1")
    d = ep.register(MemRegion(region_id=5, addr=buf.ctypes.data, size=nbytes, remote_accessible=True, placement=0))
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(4)

    def rr() -> None:
        c, _ = ls.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mv = memoryview(buf)
        req = bytearray(16)
        while True:
            got = c.recv_into(req, 16, socket.MSG_WAITALL)
            if got < 16:
                return
            off, length = struct.unpack("<QQ", req)
            c.sendall(mv[off:off + length])

    threading.Thread(target=rr, daemon=True).start()
    conn.send((ep.describe(), d, ls.getsockname()[1]))
    conn.recv()
    ep.close()
    if profile:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        conn.send(out.getvalue())
    else:
        conn.send("")


def _p(us: list) -> str:
    s = sorted(us)
    return f"p50 {s[len(s) // 2]:.1f} us p99 {s[int(len(s) * 0.99)]:.1f} us"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    from llmdd.lowlevel import MemRegion
    from llmdd_tcp import TcpTransport

    nbytes = a.mib << 20
    nb = nbytes // BB
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_owner, args=(child, nbytes, a.profile), daemon=True)
    proc.start()
    desc, rdesc, rr_port = parent.recv()
    local = np.zeros(nbytes, np.uint8)
    ep = TcpTransport({}).open_endpoint()
    ep.register(MemRegion(region_id=1, addr=local.ctypes.data, size=nbytes, remote_accessible=False, placement=0))
    ch = ep.connect(desc, timeout=10)
    ch.add_remote_region(5, nbytes, rdesc)
    pull = ch.prepare([(1, 5)], BB, nb, nb, False, timeout_s=10.0)
    push = ch.prepare([(1, 5)], BB, nb, nb, True, timeout_s=10.0)
    if pull is None or push is None:
        raise SystemExit("no quick plan")
    s = socket.create_connection(("127.0.0.1", rr_port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mv = memoryview(local)
    rng = np.random.default_rng(7)
    srcs = rng.integers(0, nb, a.n).tolist()
    dsts = rng.integers(0, nb, a.n).tolist()
    pack = struct.Struct("<QQ").pack
    res: dict = {"raw": [], "pull": [], "push": []}
    pc = time.perf_counter
    prof = cProfile.Profile() if a.profile else None
    for r0 in range(-200, a.n, 100):
        for i in range(max(r0, 0), min(r0 + 100, a.n)) if r0 >= 0 else range(100):
            t0 = pc()
            s.sendall(pack(srcs[i] * BB, BB))
            off = dsts[i] * BB
            s.recv_into(mv[off:off + BB], BB, socket.MSG_WAITALL)
            if r0 >= 0:
                res["raw"].append((pc() - t0) * 1e6)
        for name, fn in (("pull", pull), ("push", push)):
            if prof is not None and r0 >= 0:
                prof.enable()
            for i in range(max(r0, 0), min(r0 + 100, a.n)) if r0 >= 0 else range(100):
                t0 = pc()
                got = fn([srcs[i]], [dsts[i]])
                dt = pc() - t0
                if got != BB:
                    raise SystemExit(f"{name}: {got}")
                if r0 >= 0:
                    res[name].append(dt * 1e6)
            if prof is not None:
                prof.disable()
    s.close()
    ch.close()
    ep.close()
    parent.send("stop")
    owner_prof = parent.recv()
    proc.join(10)
    raw = sorted(res["raw"])[len(res["raw"]) // 2]
    print(f"load {os.getloadavg()}")
    for k in ("raw", "pull", "push"):
        p50 = sorted(res[k])[len(res[k]) // 2]
        print(f"{k}: {_p(res[k])} [{p50 / raw:.2f}x raw]")
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
        print("client:\n" + out.getvalue())
        print("owner:\n" + owner_prof)
    return 0


if __name__ == "__main__":
    sys.exit(main())
