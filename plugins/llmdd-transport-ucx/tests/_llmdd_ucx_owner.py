"""The owner process of test_quick.py and test_split.py (a plain module so that spawned children can
import it).

It registers three regions of ``size`` (default :data:`SIZE`) bytes of seeded random content (10 and 11 remote-accessible,
12 not), sends its endpoint's and regions' descriptors and its pid, then serves commands until told to
close: ``("bytes", rid)`` (the region's content now), ``("dereg", rid)`` (deregister it)."""

from __future__ import annotations

import os

import numpy as np

from llmdd.lowlevel import MemRegion
from llmdd_ucx import UcxTransport

SIZE = 256 << 10
REMOTE_RIDS = (10, 11)
PRIVATE_RID = 12


def content(seed: int, size: int = SIZE) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def owner_main(conn, tls: str, size: int = SIZE) -> None:
    ep = UcxTransport({"llmdd.ucx.tls": tls, "llmdd.ucx.control_timeout": 2.0}).open_endpoint()
    bufs = {rid: content(rid, size) for rid in REMOTE_RIDS + (PRIVATE_RID,)}
    descs = {rid: ep.register(MemRegion(region_id=rid, addr=buf.ctypes.data, size=size,
                                        remote_accessible=rid != PRIVATE_RID, placement=0))
             for rid, buf in bufs.items()}
    conn.send((ep.describe(), descs, os.getpid()))
    while True:
        cmd = conn.recv()
        if cmd[0] == "bytes":
            conn.send(bufs[cmd[1]].tobytes())
        elif cmd[0] == "dereg":
            ep.deregister(cmd[1])
            conn.send(True)
        else:
            ep.close()
            conn.send(True)
            return
