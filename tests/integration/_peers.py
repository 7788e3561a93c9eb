"""Functions run inside peer processes by the link tests (``handle.call(fn, ...)``).

Every function takes the peer's private ``state`` dict first (see ``llmdd.testing._harness``).
The harness pickles these functions by reference and loads this file in the child from its
path, so this module only imports what a fresh interpreter can import.

One engine per process: :func:`start` creates it in ``state["dd"]`` and registers a blocks cache
whose bytes are a deterministic pattern of ``(cluster id, seed)``, so any pair of peers can
compare what they pulled or pushed with :func:`pattern`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Optional

import numpy as np

from llmdd import (BlocksCacheKey, CacheDesc, CacheKeyByIdAndIndex, DataType, LLMClusterInfo, LLMConfig, LLMDataDist, LLMException,
                   LLMRole, LLMStatusCode, RegisterMemStatus)
from llmdd.plugin import hookimpl

NUM_BLOCKS = 4
BLOCK_ELEMS = 64          # float32 per block per tensor (256 bytes)


def pattern(cluster_id: int, seed: int, num_tensors: int = 2, num_blocks: int = NUM_BLOCKS,
            block_elems: int = BLOCK_ELEMS) -> np.ndarray:
    """The bytes an engine registered: shape ``(num_tensors, num_blocks, block_elems)``, float32."""
    rng = np.random.default_rng([cluster_id & 0xFFFFFFFF, cluster_id >> 32, seed])
    return rng.standard_normal((num_tensors, num_blocks, block_elems)).astype(np.float32)


class LinkRecorder:
    """Plugin recording link and comm-group transitions of this process's engine."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._lock = threading.Lock()

    def _add(self, event) -> None:
        with self._lock:
            self.events.append({
                "machine": event.machine.value, "id": event.id, "trigger": event.trigger,
                "source": event.source.value, "dest": event.dest.value,
                "error": None if event.error is None else f"{type(event.error).__name__}: {event.error}",
                "at": time.monotonic(), "peer": event.info.get("peer"),
            })

    @hookimpl
    def llmdd_link_transition(self, event) -> None:
        self._add(event)

    @hookimpl
    def llmdd_comm_group_transition(self, event) -> None:
        self._add(event)


# ----------------------------------------------------------------------------- engine


def options(listen: Optional[str] = None, extra: Optional[dict] = None, *, local_comm_res: bool = True,
            link_total_time: Optional[int] = None) -> dict:
    cfg = LLMConfig()
    cfg.device_id = 0
    if local_comm_res:
        cfg.local_comm_res = ""      # the samples' single-sided mode (cache manager implied)
    else:
        cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    if listen:
        cfg.listen_ip_info = listen
    if link_total_time is not None:
        cfg.link_total_time = link_total_time
    opts = dict(cfg.generate_options())
    opts.update(extra or {})
    return opts


def start(state: dict, role: str, cluster_id: int, listen: Optional[str] = None, *, seed: int = 0,
          extra: Optional[dict] = None, num_tensors: int = 2, key: bool = True, local_comm_res: bool = True,
          link_total_time: Optional[int] = None, register: bool = True) -> Optional[int]:
    """Create and init the engine, register a patterned blocks cache; returns the listen port (or None)."""
    dd = LLMDataDist(LLMRole[role], cluster_id)
    dd._ensure_plugins()
    rec = LinkRecorder()
    dd._pm.register(rec)
    dd.init(options(listen, extra, local_comm_res=local_comm_res, link_total_time=link_total_time))
    state.update(dd=dd, rec=rec, cluster_id=cluster_id, seed=seed)
    if register:
        data = pattern(cluster_id, seed, num_tensors)
        bufs = [np.ascontiguousarray(data[i]) for i in range(num_tensors)]
        desc = CacheDesc(num_tensors, [NUM_BLOCKS, BLOCK_ELEMS], DataType.DT_FLOAT)
        cache = dd.cache_manager.register_blocks_cache(desc, [b.ctypes.data for b in bufs],
                                                       BlocksCacheKey(cluster_id, 0) if key else None)
        state.update(bufs=bufs, cache=cache)
    listen_addr = dd.statistics()["listen"]
    return None if listen_addr is None else int(listen_addr[1])


def listen_port(state: dict) -> Optional[int]:
    addr = state["dd"].statistics()["listen"]
    return None if addr is None else int(addr[1])


def rss(state: dict) -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def finalize(state: dict) -> None:
    state["dd"].finalize()


# ----------------------------------------------------------------------------- links


def _cluster(remote_id: int, host: Optional[str] = None, port: Optional[int] = None,
             local_port: int = 0) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = remote_id
    if host is not None:
        info.append_local_ip_info("127.0.0.1", local_port)
        info.append_remote_ip_info(host, port)
    return info


def link(state: dict, targets: list, timeout: int = 5000) -> tuple:
    """``link_clusters`` to ``[(remote_id, host, port), ...]``; returns its ``(status, [status...])``."""
    clusters = [_cluster(*t) for t in targets]
    started = time.monotonic()
    result = state["dd"].link_clusters(clusters, timeout)
    state["last_link_s"] = time.monotonic() - started
    return result


def unlink(state: dict, targets: list, force: bool = False, timeout: int = 5000) -> tuple:
    """``unlink_clusters``; a target is ``remote_id`` (no ips) or ``(remote_id, host, port)``."""
    clusters = [_cluster(t) if isinstance(t, int) else _cluster(*t) for t in targets]
    return state["dd"].unlink_clusters(clusters, timeout, force=force)


def unlink_on_go(state: dict, barrier_port: int, targets: list, timeout: int = 5000) -> tuple:
    """Wait for the parent's go (a byte on a connection to its barrier socket), then ``unlink``:
    two peers released by one go unlink at the same moment, with no sleep involved."""
    with socket.create_connection(("127.0.0.1", barrier_port), timeout=30.0) as sock:
        sock.settimeout(30.0)
        if sock.recv(1) != b"g":
            raise RuntimeError("the barrier closed without a go")
    return unlink(state, targets, timeout=timeout)


def link_released(state: dict) -> dict:
    """peer -> ``statistics()["links"][peer]["released"]`` (this side unlinked it; the peer kept it)."""
    return {cid: v["released"] for cid, v in state["dd"].statistics()["links"].items()}


def link_states(state: dict) -> dict:
    return {cid: v["state"] for cid, v in state["dd"].statistics()["links"].items()}


def wait_link_state(state: dict, peer: int, wanted: tuple, timeout: float = 5.0) -> tuple:
    """Poll until the link to ``peer`` is in one of ``wanted`` (``None`` = no link); returns (state, seconds)."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        current = link_states(state).get(peer)
        if current in wanted or time.monotonic() >= deadline:
            return current, time.monotonic() - started
        time.sleep(0.01)


def events(state: dict, machine: str = "link") -> list:
    return [e for e in state["rec"].events if e["machine"] == machine]


def now(state: dict) -> float:
    """This child's monotonic clock (shared with the parent on Linux: CLOCK_MONOTONIC is system-wide)."""
    return time.monotonic()


def switch_role(state: dict, role: str, listen: Optional[str] = None) -> Optional[str]:
    """``switch_role``; returns None, or the status name of the LLMException it raised."""
    opts = LLMConfig()
    if listen:
        opts.listen_ip_info = listen
    try:
        state["dd"].switch_role(LLMRole[role], opts.generate_options() if listen else None)
    except LLMException as exc:
        return exc.status_code.name
    return None


# ----------------------------------------------------------------------------- transfers


def _status_of(fn) -> str:
    try:
        fn()
    except LLMException as exc:
        return exc.status_code.name
    return "LLM_SUCCESS"


def pull(state: dict, remote_id: int, src_blocks: list, dst_blocks: list, **kwargs) -> tuple:
    """``pull_blocks(BlocksCacheKey(remote_id, 0), ...)``; returns (status name, seconds)."""
    dd = state["dd"]
    started = time.monotonic()
    status = _status_of(lambda: dd.cache_manager.pull_blocks(BlocksCacheKey(remote_id, 0), state["cache"],
                                                             src_blocks=src_blocks, dst_blocks=dst_blocks, **kwargs))
    return status, time.monotonic() - started


def push(state: dict, remote_id: int, src_blocks: list, dst_blocks: list, **kwargs) -> tuple:
    dd = state["dd"]
    started = time.monotonic()
    status = _status_of(lambda: dd.cache_manager.push_blocks(BlocksCacheKey(remote_id, 0), state["cache"],
                                                             src_blocks=src_blocks, dst_blocks=dst_blocks, **kwargs))
    return status, time.monotonic() - started


def blocks(state: dict) -> np.ndarray:
    """A copy of this engine's registered cache, shape ``(num_tensors, blocks, elems)``."""
    return np.stack([b.copy() for b in state["bufs"]])


def restore(state: dict) -> None:
    """Put this engine's seeded pattern back into its registered cache."""
    data = pattern(state["cluster_id"], state["seed"], len(state["bufs"]))
    for i, b in enumerate(state["bufs"]):
        b[:] = data[i]


def fill(state: dict, value: float) -> None:
    for b in state["bufs"]:
        b[:] = value


def last_link_s(state: dict) -> float:
    return state["last_link_s"]


def plain_pattern(seed):
    return np.random.default_rng(seed).standard_normal((2, 1, 128)).astype(np.float32)


def register_plain(state, seed):
    data = plain_pattern(seed)
    bufs = [np.ascontiguousarray(data[i]) for i in range(2)]
    cache = state["dd"].cache_manager.register_cache(CacheDesc(2, [1, 128], DataType.DT_FLOAT),
                                                     [b.ctypes.data for b in bufs])
    state.update(plain=cache, plain_bufs=bufs)
    return cache.cache_id


def plain_bytes(state):
    return np.stack([b.copy() for b in state["plain_bufs"]])


def push_cache(state, remote_id):
    try:
        state["dd"].cache_manager.push_cache(CacheKeyByIdAndIndex(cluster_id=remote_id, cache_id=1, batch_index=0),
                                             state["plain"], src_batch_index=0)
    except LLMException as exc:
        return exc.status_code.name
    return "LLM_SUCCESS"


# ----------------------------------------------------------------------------- comm groups


def group_link(state: dict, comm_name: str, rank_info: dict, rank_table: str) -> int:
    return state["dd"].link(comm_name, rank_info, rank_table)


def group_wait(state: dict, comm_id: int, timeout: float = 8.0) -> tuple:
    """Poll ``query_register_mem_status`` until it leaves PREPARING; returns (status name, seconds)."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        status = state["dd"].query_register_mem_status(comm_id)
        if status is not RegisterMemStatus.PREPARING or time.monotonic() >= deadline:
            return status.name, time.monotonic() - started
        time.sleep(0.02)


def groups_polled(state: dict, comm_names: list, rank_info: dict, rank_table: str, timeout: float = 10.0) -> dict:
    """``link()`` each of ``comm_names`` back to back (same members), then poll every group's
    ``query_register_mem_status`` every millisecond until none is PREPARING: the comm ids, their
    final statuses, and every status any poll saw (a FAILED seen once is FAILED for good)."""
    dd = state["dd"]
    ids = [dd.link(name, rank_info, rank_table) for name in comm_names]
    seen: dict = {cid: set() for cid in ids}
    deadline = time.monotonic() + timeout
    while True:
        now = {cid: dd.query_register_mem_status(cid) for cid in ids}
        for cid, status in now.items():
            seen[cid].add(status.name)
        if all(st is not RegisterMemStatus.PREPARING for st in now.values()) or time.monotonic() >= deadline:
            return {"ids": ids, "final": {cid: st.name for cid, st in now.items()},
                    "seen": {cid: sorted(v) for cid, v in seen.items()}}
        time.sleep(0.001)


def group_unlink(state: dict, comm_id: int) -> Optional[str]:
    try:
        state["dd"].unlink(comm_id)
    except LLMException as exc:
        return exc.status_code.name
    return None


def group_status(state: dict, comm_id: int) -> str:
    try:
        return state["dd"].query_register_mem_status(comm_id).name
    except LLMException as exc:
        return exc.status_code.name


# ----------------------------------------------------------------------------- logs


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name} {record.getMessage()}")


def capture_logs(state: dict) -> None:
    """Collect this child's ``llmdd`` log lines (WARNING and above) from now on."""
    handler = _Collect()
    handler.setLevel(logging.WARNING)
    logging.getLogger("llmdd").addHandler(handler)
    state["logs"] = handler


def logs(state: dict) -> list:
    return list(state["logs"].lines)


# ----------------------------------------------------------------------------- raw sockets


def raw_send(state: dict, host: str, port: int, payload: bytes, wait: float = 0.5) -> bytes:
    """Connect, send ``payload``, read whatever comes back for ``wait`` s (or until closed)."""
    got = b""
    with socket.create_connection((host, port), timeout=2.0) as s:
        s.sendall(payload)
        s.settimeout(wait)
        try:
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
        except (socket.timeout, OSError):
            pass
    return got

