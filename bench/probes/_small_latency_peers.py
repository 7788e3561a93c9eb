"""Child side of bench/probes/small_latency.py (run in harness children: ``fn(state, ...)``, module level)."""

from __future__ import annotations

import hashlib
import socket
import struct
import threading
import time
from typing import Optional

import numpy as np

from llmdd import (BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMConfig, LLMDataDist, LLMRole,
                   Placement)

HOST = "127.0.0.1"
BB = 64 * 1024


def setup(state: dict, role: str, cluster_id: int, transport: str, listen: bool,
          extra: Optional[dict] = None) -> Optional[int]:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.sync_kv_timeout = 10000
    cfg.enable_remote_cache_accessible = True
    if listen:
        cfg.listen_ip_info = f"{HOST}:0"
    options = cfg.generate_options()
    options["llmdd.transport"] = transport
    options.update(extra or {})
    dd = LLMDataDist(LLMRole[role], cluster_id)
    dd.init(options)
    state["dd"] = dd
    return dd.statistics()["listen"][1] if listen else None


def register(state: dict, cluster_id: int, nbytes: int, seed: int) -> None:
    """One blocks cache of one tensor of ``nbytes`` (64 KiB blocks), seeded random contents."""
    nb = nbytes // BB
    buf = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    desc = CacheDesc(1, [nb, BB], DataType.DT_UINT8, Placement.DEVICE)
    state["buf"] = buf
    state["cache"] = state["dd"].cache_manager.register_blocks_cache(desc, [buf.ctypes.data],
                                                                     BlocksCacheKey(cluster_id, 0), True)


def link(state: dict, remote: int, port: int) -> str:
    info = LLMClusterInfo()
    info.remote_cluster_id = remote
    info.append_local_ip_info(HOST, 0)
    info.append_remote_ip_info(HOST, port)
    ret, _ = state["dd"].link_clusters([info], 10000)
    return ret.name


def timed(state: dict, op: str, remote: int, n: int, warmup: int, seed: int) -> dict:
    """``n`` timed calls (after ``warmup``) of ``pull_blocks`` / ``push_blocks`` of one random 64 KiB
    block; the microseconds, and the last call's blocks."""
    cm = state["dd"].cache_manager
    cache, key = state["cache"], BlocksCacheKey(remote, 0)
    nb = state["buf"].size // BB
    rng = np.random.default_rng(seed)
    srcs = rng.integers(0, nb, n + warmup).tolist()
    dsts = rng.integers(0, nb, n + warmup).tolist()
    fn = cm.pull_blocks if op == "pull" else cm.push_blocks
    one = range(0, 1)   # one layer of one tensor
    us = []
    pc = time.perf_counter
    for i in range(n + warmup):
        s, d = [srcs[i]], [dsts[i]]
        t0 = pc()
        fn(key, cache, s, d, src_layer_range=one, dst_layer_range=one, tensor_num_per_layer=1)
        dt = pc() - t0
        if i >= warmup:
            us.append(dt * 1e6)
    return {"us": us, "last": (srcs[-1], dsts[-1])}


def digest(state: dict, block: int) -> str:
    return hashlib.sha256(state["buf"][block * BB:(block + 1) * BB].tobytes()).hexdigest()


def rr_serve(state: dict) -> int:
    """Serve raw request/replies (16-byte request: offset, length; the bytes back) on a new port, in a thread."""
    ls = socket.socket()
    ls.bind((HOST, 0))
    ls.listen(1)
    mv = memoryview(state["buf"])

    def serve() -> None:
        c, _ = ls.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        req = bytearray(16)
        while c.recv_into(req, 16, socket.MSG_WAITALL) == 16:
            off, length = struct.unpack("<QQ", req)
            c.sendall(mv[off:off + length])
        c.close()
        ls.close()

    threading.Thread(target=serve, daemon=True).start()
    return ls.getsockname()[1]


def rr_client(state: dict, port: int, n: int, warmup: int, seed: int) -> list:
    """``n`` timed raw request/replies (after ``warmup``) on this child's one connection to ``port``."""
    s = state.get("rr")
    if s is None:
        s = state["rr"] = socket.create_connection((HOST, port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mv = memoryview(state["buf"])
    nb = state["buf"].size // BB
    rng = np.random.default_rng(seed)
    srcs = rng.integers(0, nb, n + warmup).tolist()
    dsts = rng.integers(0, nb, n + warmup).tolist()
    pack = struct.Struct("<QQ").pack
    us = []
    pc = time.perf_counter
    for i in range(n + warmup):
        t0 = pc()
        s.sendall(pack(srcs[i] * BB, BB))
        off = dsts[i] * BB
        s.recv_into(mv[off:off + BB], BB, socket.MSG_WAITALL)
        dt = pc() - t0
        if i >= warmup:
            us.append(dt * 1e6)
    return us
