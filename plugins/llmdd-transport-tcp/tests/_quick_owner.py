"""Child side of the tcp quick-path tests (an importable module: spawned children import it by name).

The owner opens a tcp endpoint and registers, as blocks of ``bs`` bytes: regions 5 and 8 (seeded random
contents: :func:`pattern`), 6 and 9 (zeros: the sinks of pushes), all remote-accessible, and 7 (random,
not remote-accessible), with the transport ``options`` given.  Commands: ``("snapshot", rid)`` the region's bytes, ``("deregister", rid)``,
``("stats",)``, ``("stop",)``."""

from __future__ import annotations

import numpy as np

from llmdd.lowlevel import MemRegion
from llmdd_tcp import TcpTransport

SOURCES, SINKS, PRIVATE = (5, 8), (6, 9), 7


def pattern(rid: int, size: int, seed: int) -> np.ndarray:
    """The seeded random contents of source region ``rid``."""
    return np.random.default_rng([seed, rid]).integers(0, 256, size, dtype=np.uint8)


def owner_main(conn, size: int, seed: int, options: dict | None = None) -> None:
    ep = TcpTransport(dict(options or {})).open_endpoint(host="127.0.0.1")
    bufs = {rid: pattern(rid, size, seed) for rid in SOURCES + (PRIVATE,)}
    bufs.update({rid: np.zeros(size, np.uint8) for rid in SINKS})
    descs = {rid: ep.register(MemRegion(region_id=rid, addr=b.ctypes.data, size=size,
                                        remote_accessible=rid != PRIVATE, placement=0))
             for rid, b in bufs.items()}
    conn.send((ep.describe(), descs))
    while True:
        cmd = conn.recv()
        if cmd[0] == "snapshot":
            conn.send(bytes(bufs[cmd[1]]))
        elif cmd[0] == "deregister":
            ep.deregister(cmd[1])
            conn.send(True)
        elif cmd[0] == "stats":
            conn.send(ep.statistics())
        else:
            break
    ep.close()
