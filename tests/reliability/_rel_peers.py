"""Peer-side functions of the reliability suite (run in harness children) and parent helpers.

Every function is ``fn(state, ...)`` and module-level so the harness pickles it by reference
(the child loads this file from its path).  ``state`` holds one engine (``state["dd"]``), its
caches by name (``state["caches"]``) with the numpy arrays behind them (``state["arrays"]``), the
fault injector (``state["inj"]``) and captured log lines (``state["logs"]``).

Contents: the owner fills its blocks with a deterministic pattern of ``(cluster, seed)``; the
puller's destination starts as the poison byte ``POISON`` so every byte a transfer did (or did
not) write is visible.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import threading
import time
from typing import Any, Optional

import numpy as np

import llmdd.plugin  # noqa: F401  (makes ``llmdd.plugin`` importable in a fresh child)
from llmdd import (BlocksCacheKey, CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType, LLMClusterInfo, LLMConfig,
                   LLMDataDist, LLMException, LLMRole, Placement)

HOST = "127.0.0.1"
POISON = 0xA5
#: small timeouts of the whole suite (reliability.md 3.1 "tiny timeouts"), sized for a shared, loaded
#: 2-core machine: the transfer deadline is what the cases measure; the peer timeout (silence after
#: which a link is declared lost) stays >= 2 s so that a descheduled keepalive thread never fails a
#: healthy link, and the handshake deadline leaves room for a slow accept under load
SYNC_MS = 800
KEEPALIVE_MS = 200
PEER_TIMEOUT_MS = 2000
HANDSHAKE_MS = 3000
FAST = {"llmdd.keepalive_interval_ms": str(KEEPALIVE_MS), "llmdd.peer_timeout_ms": str(PEER_TIMEOUT_MS),
        "llmdd.handshake_timeout_ms": str(HANDSHAKE_MS)}
ERRORS_OK = (TypeError, ValueError, AttributeError, LLMException)


# ---------------------------------------------------------------------------- logs
class _ListHandler(logging.Handler):
    def __init__(self, sink: list) -> None:
        super().__init__(logging.DEBUG)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sink.append(record.getMessage() + " " + " ".join(f"{k}={v}" for k, v in vars(record).items()
                                                                   if k not in ("msg", "args")))
        except Exception:  # noqa: BLE001 - a log line that cannot be formatted must not break the engine
            self.sink.append(repr(record.msg))


def capture_logs(state: dict) -> None:
    """Route every ``llmdd`` log record of this child (all levels) into ``state["logs"]``."""
    sink = state.setdefault("logs", [])
    handler = _ListHandler(sink)
    for name in ("llmdd", ""):
        lg = logging.getLogger(name)
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    state["log_handler"] = handler


def logs(state: dict) -> list:
    return list(state.get("logs", []))


# ---------------------------------------------------------------------------- engine
def setup(state: dict, role: str, cluster_id: int, *, listen: bool = False, transport: Optional[str] = "tcp",
          sync_ms: int = SYNC_MS, mem_pool: int = 0, faults: Optional[str] = None, extra: Optional[dict] = None,
          remote_accessible: bool = False, fast: bool = True, log: bool = False,
          port: int = 0) -> Optional[int]:
    """Create and init this child's engine (finalizing a previous one); returns its listen port.

    ``faults``: a ``FaultPlan`` JSON text; a ``FaultInjector`` with it is added before ``init``.
    """
    old = state.get("dd")
    if old is not None:
        try:
            old.finalize()
        except LLMException:
            pass
    for k in ("dd", "caches", "arrays", "inj", "keys"):
        state.pop(k, None)
    if log and "logs" not in state:
        capture_logs(state)
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.sync_kv_timeout = sync_ms
    if remote_accessible:
        cfg.enable_remote_cache_accessible = True
    if mem_pool:
        cfg.mem_pool_cfg = f'{{"memory_size": {mem_pool}, "page_shift": 12}}'
    if listen:
        cfg.listen_ip_info = f"{HOST}:{port}"
    options = dict(cfg.generate_options())
    if transport:
        options["llmdd.transport"] = transport
    if fast:
        options.update(FAST)
    options.update(extra or {})
    dd = LLMDataDist(LLMRole[role], cluster_id)
    if faults is not None:
        from llmdd_faults import FaultInjector, FaultPlan

        inj = FaultInjector(FaultPlan.from_json(faults))
        dd.add_plugin(inj)
        state["inj"] = inj
    dd.init(options)
    state.update(dd=dd, caches={}, arrays={}, cluster_id=cluster_id)
    return dd.statistics()["listen"][1] if listen else None


def is_up(state: dict) -> bool:
    return state.get("dd") is not None


def finalize(state: dict) -> None:
    dd = state.pop("dd", None)
    if dd is not None:
        dd.finalize()
    state.pop("caches", None)
    state.pop("arrays", None)


def _cluster(remote: int, port: Optional[int]) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = remote
    info.append_local_ip_info(HOST, 0)
    if port is not None:
        info.append_remote_ip_info(HOST, port)
    return info


def link(state: dict, targets: list, timeout_ms: int = 3000) -> dict:
    """``link_clusters([(remote, port), ...])``; returns statuses and seconds."""
    t0 = time.monotonic()
    try:
        ret, rets = state["dd"].link_clusters([_cluster(r, p) for r, p in targets], timeout_ms)
    except LLMException as exc:
        return {"status": exc.status_code.name, "each": [], "took": time.monotonic() - t0}
    return {"status": ret.name, "each": [r.name for r in rets], "took": time.monotonic() - t0}


def unlink(state: dict, targets: list, force: bool = False, timeout_ms: int = 1500) -> dict:
    t0 = time.monotonic()
    try:
        ret, rets = state["dd"].unlink_clusters([_cluster(r, p) for r, p in targets], timeout_ms, force=force)
    except LLMException as exc:
        return {"status": exc.status_code.name, "each": [], "took": time.monotonic() - t0}
    return {"status": ret.name, "each": [r.name for r in rets], "took": time.monotonic() - t0}


def link_states(state: dict) -> dict:
    return {cid: v["state"] for cid, v in state["dd"].statistics()["links"].items()}


def wait_link_state(state: dict, remote: int, wanted: tuple, timeout: float = 5.0) -> tuple:
    t0 = time.monotonic()
    while True:
        cur = link_states(state).get(remote)
        if cur in wanted or time.monotonic() - t0 >= timeout:
            return cur, time.monotonic() - t0
        time.sleep(0.01)


def stats(state: dict) -> dict:
    """The parts of ``statistics()`` the suite checks, as plain data."""
    s = state["dd"].statistics()
    lcs = {}
    for name, lc in s["lifecycles"].items():
        lcs[name] = {"live": dict(lc.live), "triggers": dict(lc.triggers), "refused": lc.refused}
    links = {cid: {"state": v["state"], "transport": v.get("transport"), "last_error": v.get("last_error")}
             for cid, v in s["links"].items()}
    return {"links": links, "memory": _plain(s["memory"]), "lifecycles": lcs}


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)


def live_tasks(state: dict) -> dict:
    """Task lifecycle states with a live count (non-terminal tasks still in the table)."""
    lc = state["dd"].statistics()["lifecycles"]["task"]
    return {k: v for k, v in lc.live.items() if k in ("created", "waiting", "running")}


def wait_tasks_terminal(state: dict, timeout: float = 3.0) -> dict:
    t0 = time.monotonic()
    while True:
        live = live_tasks(state)
        if not live or time.monotonic() - t0 >= timeout:
            return live
        time.sleep(0.01)


def pool_in_use(state: dict) -> Any:
    """Pool accounting that must come back to baseline (in-use bytes/blocks of every pool)."""
    mem = state["dd"].statistics()["memory"]
    out = {k: v for k, v in mem.items() if k not in ("caches", "regions_version", "pools")}
    out["pools"] = {name: int(pool.get("used_bytes", 0)) for name, pool in mem.get("pools", {}).items()}
    return _plain(out)


def resource_snapshot(state: dict):
    from llmdd.testing import ResourceSnapshot

    return ResourceSnapshot.take()


def fault_heal(state: dict) -> None:
    state["inj"].plan.heal()


def fault_fired(state: dict) -> list:
    inj = state.get("inj")
    return [] if inj is None else [(f.op, f.fault.action) for f in inj.fired]


# ---------------------------------------------------------------------------- memory
def _view(addr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def pattern(cluster_id: int, seed: int, num_tensors: int, nbytes: int) -> np.ndarray:
    rng = np.random.default_rng([cluster_id, seed])
    return rng.integers(0, 255, size=(num_tensors, nbytes), dtype=np.uint8)  # never 0xFF: not POISON-like


def register_blocks(state: dict, name: str, num_tensors: int, num_blocks: int, block_bytes: int, *,
                    seed: Optional[int] = None, key: Optional[tuple] = None,
                    remote_accessible: Optional[bool] = None) -> int:
    """Register numpy blocks memory; ``seed``: pattern of (own cluster id, seed), else POISON."""
    nbytes = num_blocks * block_bytes
    if seed is None:
        arrays = [np.full(nbytes, POISON, np.uint8) for _ in range(num_tensors)]
    else:
        data = pattern(state["cluster_id"], seed, num_tensors, nbytes)
        arrays = [np.ascontiguousarray(data[i]) for i in range(num_tensors)]
    desc = CacheDesc(num_tensors, [num_blocks, block_bytes], DataType.DT_UINT8, Placement.DEVICE)
    bkey = None if key is None else BlocksCacheKey(*key)
    cache = state["dd"].cache_manager.register_blocks_cache(desc, [a.ctypes.data for a in arrays], bkey,
                                                           remote_accessible)
    state["caches"][name] = cache
    state["arrays"][name] = arrays
    return cache.cache_id


def allocate(state: dict, name: str, num_tensors: int, shape: list, *, seed: Optional[int] = None,
             keys: tuple = ()) -> int:
    desc = CacheDesc(num_tensors, list(shape), DataType.DT_UINT8, Placement.DEVICE)
    cache = state["dd"].cache_manager.allocate_cache(desc, [CacheKey(*k) for k in keys])
    views = [_view(a, desc.size) for a in cache.tensor_addrs]
    if seed is None:
        for v in views:
            v[:] = POISON
    else:
        data = pattern(state["cluster_id"], seed, num_tensors, desc.size)
        for i, v in enumerate(views):
            v[:] = data[i]
    state["caches"][name] = cache
    state["arrays"][name] = views
    return cache.cache_id


def deallocate(state: dict, name: str) -> str:
    try:
        state["dd"].cache_manager.deallocate_cache(state["caches"][name])
    except LLMException as exc:
        return exc.status_code.name
    return "LLM_SUCCESS"


def unregister(state: dict, name: str) -> str:
    try:
        state["dd"].cache_manager.unregister_cache(state["caches"][name].cache_id)
    except LLMException as exc:
        return exc.status_code.name
    return "LLM_SUCCESS"


def fill(state: dict, name: str, value: int) -> None:
    for a in state["arrays"][name]:
        a[:] = value


def write_pattern(state: dict, name: str, seed: int) -> None:
    """Refill cache ``name`` with the pattern of (own cluster id, ``seed``)."""
    arrays = state["arrays"][name]
    data = pattern(state["cluster_id"], seed, len(arrays), arrays[0].size)
    for i, a in enumerate(arrays):
        a[:] = data[i]


def snapshot(state: dict, name: str) -> np.ndarray:
    return np.stack([np.array(a, copy=True) for a in state["arrays"][name]])


def poison_kept(state: dict, name: str) -> bool:
    return all(bool((a == POISON).all()) for a in state["arrays"][name])


def digest(state: dict, name: str) -> str:
    h = hashlib.sha256()
    for a in state["arrays"][name]:
        h.update(a.tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------- transfers
def _key(spec: tuple) -> Any:
    kind, *args = spec
    return {"blocks": BlocksCacheKey, "id": CacheKeyByIdAndIndex, "key": CacheKey}[kind](*args)


def transfer(state: dict, method: str, key: tuple, dst: str, *args: Any, **kwargs: Any) -> tuple:
    """``cache_manager.<method>(key, caches[dst], *args)``: (status or exception type, seconds, end)."""
    cm = state["dd"].cache_manager
    t0 = time.monotonic()
    state["last_error"] = None
    try:
        getattr(cm, method)(_key(key), state["caches"][dst], *args, **kwargs)
    except LLMException as exc:
        state["last_error"] = str(exc)   # what failed and why, for a case's failure message
        return exc.status_code.name, time.monotonic() - t0, time.monotonic()
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, time.monotonic() - t0, time.monotonic()
    return "LLM_SUCCESS", time.monotonic() - t0, time.monotonic()


#: how long :func:`transfer_watch` watches the destination after an error for late bytes: a
#: measurement window (nothing may happen in it), not synchronisation
WATCH_S = 0.5


def transfer_watch(state: dict, method: str, key: tuple, dst: str, *args: Any, watch_s: float = WATCH_S,
                   **kwargs: Any) -> dict:
    """A transfer; if it fails, refill ``dst`` with POISON at once and report whether any byte of it
    changed within ``watch_s`` (the "no write after the error" invariant)."""
    status, took, end = transfer(state, method, key, dst, *args, **kwargs)
    kept = None
    if status != "LLM_SUCCESS":
        fill(state, dst, POISON)
        time.sleep(watch_s)
        kept = poison_kept(state, dst)
    return {"status": status, "took": took, "end": end, "poison_kept": kept, "error": state.get("last_error")}


def transfers_in_threads(state: dict, jobs: list, start_gap: float = 0.0) -> list:
    """Run ``transfer(state, *job)`` for every job, each in its own thread; results in order."""
    results: list = [None] * len(jobs)

    def run(i: int, job: tuple) -> None:
        results[i] = transfer(state, *job)

    threads = [threading.Thread(target=run, args=(i, j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
        time.sleep(start_gap)
    for t in threads:
        t.join(30)
    return results


def start_background(state: dict, name: str, method: str, key: tuple, dst: str, *args: Any, **kwargs: Any) -> None:
    """Start ``transfer`` in a thread of this child; collect it with :func:`join_background`."""
    box: dict = {}

    def run() -> None:
        box["result"] = transfer(state, method, key, dst, *args, **kwargs)

    t = threading.Thread(target=run, name=f"rel-bg-{name}")
    state.setdefault("bg", {})[name] = (t, box)
    box["started"] = time.monotonic()
    t.start()


def join_background(state: dict, name: str, timeout: float = 10.0) -> Optional[tuple]:
    t, box = state["bg"].pop(name)
    t.join(timeout)
    return box.get("result")


def now(state: dict) -> float:
    return time.monotonic()


def sleep(state: dict, seconds: float) -> None:
    time.sleep(seconds)


def tcp_data_endpoint(state: dict) -> dict:
    """The tcp data endpoint of this engine: port and the served regions (id, size, remote flag)."""
    core = state["dd"]._core
    ep = core.link_manager.endpoint("tcp")
    desc = ep.describe()
    regions = [{"id": r.region_id, "addr": r.addr, "size": r.size, "remote": bool(r.remote_accessible)}
               for r in core.memory.regions.regions()]
    from llmdd_tcp import endpoint_fields

    return {"port": endpoint_fields(desc).port, "regions": regions}


def allocate_status(state: dict, name: str, num_tensors: int, shape: list, keys: tuple = ()) -> str:
    try:
        allocate(state, name, num_tensors, shape, keys=keys)
    except LLMException as exc:
        return exc.status_code.name
    return "LLM_SUCCESS"


def switch_role(state: dict, role: str) -> str:
    try:
        state["dd"].switch_role(LLMRole[role])
    except LLMException as exc:
        return exc.status_code.name
    return "LLM_SUCCESS"


def bytes_read(state: dict) -> int:
    return sum(int(v.get("bytes_read", 0)) for v in state["dd"].statistics()["links"].values())


def region_of(state: dict, name: str) -> list:
    """The region ids that back the tensors of cache ``name`` (by address)."""
    addrs = {a.ctypes.data if hasattr(a, "ctypes") else 0 for a in state["arrays"][name]}
    core = state["dd"]._core
    return [r.region_id for r in core.memory.regions.regions() if r.addr in addrs]


def write_canary(state: dict, name: str, tensor: int, start: int, value: bytes) -> None:
    arr = state["arrays"][name][tensor]
    arr[start:start + len(value)] = np.frombuffer(value, np.uint8)


def fault_reset(state: dict) -> None:
    """Clear the injector's counters (after the rig's warm-up transfers) so ``nth`` counts from here."""
    inj = state.get("inj")
    if inj is not None:
        inj.plan.reset()


def fault_arm(state: dict, plan_json: str) -> None:
    """Give the injector (registered before ``init`` with an empty plan) its real plan now, after
    warm-up transfers that must not count.  Re-initialises the same plan object, which the wrapped
    transports hold."""
    from llmdd_faults import FaultPlan

    new = FaultPlan.from_json(plan_json)
    plan = state["inj"].plan
    plan.heal()
    plan.__init__(new.faults, seed=new.seed)


def link_race(state: dict, port: int, n: int, unlink_too: bool = False, rounds: int = 1) -> list:
    """``n`` threads link (and, with ``unlink_too``, force-unlink) cluster 1 at the same moment, for
    ``rounds`` rounds; returns every status in the order the calls returned."""
    out: list = []
    lock = threading.Lock()
    barrier = threading.Barrier(n)

    def run(i: int) -> None:
        for _ in range(rounds):
            barrier.wait(10)
            if unlink_too and i % 2:
                res = unlink(state, [(1, None)], True)
                tag = "unlink"
            else:
                res = link(state, [(1, port)], 5000)
                tag = "link"
            status = res["each"][0] if res["each"] else res["status"]
            with lock:
                out.append((tag, status))

    threads = [threading.Thread(target=run, args=(i,), name=f"rel-race-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


# ---------------------------------------------------------------------------- guarded memory, events, resources
def register_guarded(state: dict, name: str, num_tensors: int, num_blocks: int, block_bytes: int, *,
                     seed: int, guard_bytes: int = 4096, key: Optional[tuple] = None,
                     remote_accessible: Optional[bool] = None) -> bytes:
    """Register a blocks cache whose tensors are slices of ONE numpy buffer, each with
    ``guard_bytes`` of *unregistered* canary memory right before and right after it::

        [guard][tensor 0][guard][tensor 1] ... [tensor n-1][guard]

    An over-read (or under-read) of a tensor's region by a peer would return canary bytes; an
    over-write would change them.  The canary is seeded random (cluster id, seed + 1000), never a
    constant fill; returns it (``guard_bytes`` long) so the caller can look for it in what it got.
    """
    nbytes = num_blocks * block_bytes
    rng = np.random.default_rng([state["cluster_id"], seed + 1000])
    canary = rng.integers(0, 256, size=guard_bytes, dtype=np.uint8)
    buf = np.empty(guard_bytes + num_tensors * (nbytes + guard_bytes), dtype=np.uint8)
    data = pattern(state["cluster_id"], seed, num_tensors, nbytes)
    arrays = []
    for i in range(num_tensors):
        start = guard_bytes + i * (nbytes + guard_bytes)
        buf[start - guard_bytes:start] = canary
        buf[start:start + nbytes] = data[i]
        arrays.append(buf[start:start + nbytes])
    buf[len(buf) - guard_bytes:] = canary
    desc = CacheDesc(num_tensors, [num_blocks, block_bytes], DataType.DT_UINT8, Placement.DEVICE)
    bkey = None if key is None else BlocksCacheKey(*key)
    cache = state["dd"].cache_manager.register_blocks_cache(desc, [a.ctypes.data for a in arrays], bkey,
                                                           remote_accessible)
    state["caches"][name] = cache
    state["arrays"][name] = arrays
    state.setdefault("guarded", {})[name] = (buf, canary, guard_bytes, nbytes)
    return canary.tobytes()


def guarded_digest(state: dict, name: str) -> dict:
    """Whether every guard of cache ``name`` still holds its canary, and a digest of the tensors."""
    buf, canary, guard, nbytes = state["guarded"][name]
    n = len(state["arrays"][name])
    guards_ok = all(np.array_equal(buf[i * (nbytes + guard):i * (nbytes + guard) + guard], canary)
                    for i in range(n + 1))
    return {"guards_intact": guards_ok, "tensors": digest(state, name)}


class _CacheEvents:
    """A subscriber of this engine's cache lifecycle: ``(cache id, trigger, source, dest)`` in order."""

    def __init__(self) -> None:
        self.events: list = []
        self._lock = threading.Lock()

    @llmdd.plugin.hookimpl
    def llmdd_cache_transition(self, event: Any) -> None:
        with self._lock:
            self.events.append((event.id, event.trigger, event.source.value, event.dest.value))


def record_cache_events(state: dict) -> None:
    """Subscribe to this engine's cache transitions (again after every :func:`setup`)."""
    rec = _CacheEvents()
    state["dd"].add_plugin(rec)
    state["cache_events"] = rec


def cache_events(state: dict, cache_id: Optional[int] = None) -> list:
    """The recorded cache transitions (of ``cache_id`` only, when given), in order."""
    rec = state["cache_events"]
    with rec._lock:
        return [e for e in rec.events if cache_id is None or e[0] == cache_id]


def cache_id_of(state: dict, name: str) -> int:
    return int(state["caches"][name].cache_id)


def fault_fired_n(state: dict, op: str, action: str) -> int:
    inj = state.get("inj")
    return 0 if inj is None else inj.plan.fired_count(op, action)


def wait_fault_fired(state: dict, op: str, action: str, n: int = 1, timeout: float = 5.0) -> int:
    """Wait (deadline ``timeout``) until the faults plugin fired ``n`` faults ``action`` at ``op``.
    The plugin records a fault when the batch is posted, before it acts: once this returns, that
    batch is in flight (e.g. inside its injected delay).  Returns the count reached."""
    t0 = time.monotonic()
    while True:
        got = fault_fired_n(state, op, action)
        if got >= n or time.monotonic() - t0 >= timeout:
            return got
        time.sleep(0.005)


def shm_accounting(state: dict) -> dict:
    """This process's pid and the /dev/shm segments its pool accounting covers (created pools)."""
    import os

    segs = []
    dd = state.get("dd")
    if dd is not None:
        for pool in dd.statistics()["memory"].get("pools", {}).values():
            if pool.get("segment"):
                segs.append(pool["segment"])
    return {"pid": os.getpid(), "pool_segments": segs}



def tcp_data_grant(state: dict, cluster: int) -> Optional[dict]:
    """What this engine's tcp channel to ``cluster`` presents when it opens a data stream: the grant
    handle and MAC key its link received from the owner (llmdd-tcp v2; the owner serves linked
    peers only).  None when the channel needs no grant (llmdd-tcp v1).  A hostile *linked* peer
    holds exactly this, which is what the forged-request tests play."""
    core = state["dd"]._core
    link = next((lk for lk in core.link_manager.links() if lk.peer_cluster_id == cluster), None)
    channel = None if link is None else link.channel
    channel = getattr(channel, "inner", channel)   # under the faults plugin
    handle, key = getattr(channel, "_handle", None), getattr(channel, "_key", None)
    if handle is None or key is None:
        return None
    return {"handle": bytes(handle), "key": bytes(key)}
