"""Child side of the tcp two-process tests (an importable module: spawned children import it)."""

from __future__ import annotations

import hashlib

import numpy as np

from llmdd.lowlevel import MemRegion
from llmdd_tcp import TcpTransport


def _fill(size: int, seed: int) -> np.ndarray:
    buf = np.empty(size, dtype=np.uint8)
    buf.view(np.uint64)[:] = np.arange(size // 8, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(seed)
    return buf


def _peer_main(conn, size: int, seed: int) -> None:
    ep = TcpTransport({}).open_endpoint(host="127.0.0.1")
    src = _fill(size, seed)
    sink = np.zeros(size, dtype=np.uint8)
    d_src = ep.register(MemRegion(region_id=5, addr=src.ctypes.data, size=size, remote_accessible=True, placement=0))
    d_sink = ep.register(MemRegion(region_id=6, addr=sink.ctypes.data, size=size, remote_accessible=True,
                                   placement=0))
    conn.send((ep.describe(), d_src, d_sink))
    while True:
        cmd = conn.recv()
        if cmd == "digest":
            conn.send(hashlib.sha256(sink).hexdigest())
        elif cmd == "stats":
            conn.send(ep.statistics())
        else:
            break
    ep.close()
