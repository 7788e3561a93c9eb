"""The owner process of test_shm.py (a plain module so that spawned children can import it)."""

from __future__ import annotations

import hashlib

import numpy as np

from llmdd.lowlevel import SharedSegment
from llmdd.lowlevel import MemRegion
from llmdd_shm import ShmTransport

MiB = 1 << 20
SIZE = 4 * MiB
POOL_RID, USER_RID, POOL_SINK, USER_SINK = 5, 6, 7, 8


def _content(seed: int, size: int = SIZE) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _owner_main(conn) -> None:
    from llmdd._memory.backend import HostBackend

    backend = HostBackend()
    seg = backend.allocate_segment(2 * SIZE + 8192)
    pool = seg.array()
    off_src, off_sink = 4096, 4096 + SIZE + 4096
    pool[off_src:off_src + SIZE] = _content(1)
    pool[off_sink:off_sink + SIZE] = 0
    user = _content(2)
    user_sink = np.zeros(SIZE, dtype=np.uint8)
    ep = ShmTransport({}).open_endpoint()
    descs = {}
    for rid, addr, off in ((POOL_RID, seg.addr + off_src, off_src), (POOL_SINK, seg.addr + off_sink, off_sink)):
        descs[rid] = ep.register(MemRegion(region_id=rid, addr=addr, size=SIZE, remote_accessible=True,
                                           placement=0, backing=SharedSegment(name=seg.name, offset=off)))
    for rid, arr in ((USER_RID, user), (USER_SINK, user_sink)):
        descs[rid] = ep.register(MemRegion(region_id=rid, addr=arr.ctypes.data, size=SIZE, remote_accessible=True,
                                           placement=0))
    conn.send((ep.describe(), descs, seg.name))
    views = {POOL_RID: pool[off_src:off_src + SIZE], POOL_SINK: pool[off_sink:off_sink + SIZE],
             USER_RID: user, USER_SINK: user_sink}
    while True:
        cmd = conn.recv()
        if cmd[0] == "digest":
            conn.send(hashlib.sha256(views[cmd[1]]).hexdigest())
        elif cmd[0] == "stats":
            conn.send(ep.statistics())
        else:
            break
    ep.close()
    backend.release(seg)
    conn.send("bye")
