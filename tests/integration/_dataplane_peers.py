"""Peer-side functions of the data-plane integration tests (run in harness children).

Every function is ``fn(state, ...)`` and module-level so that the harness can pickle it by
reference.  ``state`` keeps the engine (``state["dd"]``), named caches (``state["caches"]``)
with the numpy arrays or pool addresses behind them, recorded events and async tasks.

Contents are random (``numpy`` generator seeded by the test) and compared byte for byte:
the tests fetch snapshots of both sides with :func:`snapshot` and compare them.
"""

from __future__ import annotations

import ctypes
import threading
import time
import tracemalloc
from typing import Any, Optional

import numpy as np

import llmdd
from llmdd import (BlocksCacheKey, CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType, LayerSynchronizer,
                   LLMClusterInfo, LLMConfig, LLMDataDist, LLMException, LLMRole, Placement, TransferConfig,
                   TransferWithCacheKeyConfig)

HOST = "127.0.0.1"


class Ref:
    """Stands for the peer's cache named ``name`` in arguments of :func:`cm`."""

    def __init__(self, name: str) -> None:
        self.name = name


# ---------------------------------------------------------------------------- engine setup
def setup(state: dict, role: str, cluster_id: int, *, listen: bool = False, transport: Optional[str] = None,
          remote_accessible: bool = False, sync_ms: int = 3000, mem_pool: int = 0, host_pool: int = 0,
          page_shift: int = 12, extra: Optional[dict] = None) -> Optional[int]:
    """Create and init the engine (finalizing the one a previous test left); returns the listening port."""
    old = state.get("dd")
    if old is not None:
        old.finalize()
        state.clear()
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.sync_kv_timeout = sync_ms
    if remote_accessible:
        cfg.enable_remote_cache_accessible = True
    if mem_pool:
        cfg.mem_pool_cfg = f'{{"memory_size": {mem_pool}, "page_shift": {page_shift}}}'
    if host_pool:
        cfg.host_mem_pool_cfg = f'{{"memory_size": {host_pool}, "page_shift": {page_shift}}}'
    if listen:
        cfg.listen_ip_info = f"{HOST}:0"
    options = cfg.generate_options()
    if transport:
        options["llmdd.transport"] = transport
    options.update(extra or {})
    dd = LLMDataDist(LLMRole[role], cluster_id)
    dd.init(options)
    state.update(dd=dd, caches={}, arrays={}, events=[], tasks={}, syncs={})
    return dd.statistics()["listen"][1] if listen else None


def _cluster(remote: int, port: Optional[int]) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = remote
    info.append_local_ip_info(HOST, 0)
    if port is not None:
        info.append_remote_ip_info(HOST, port)
    return info


def link(state: dict, remote: int, port: int, timeout_ms: int = 5000) -> list:
    ret, rets = state["dd"].link_clusters([_cluster(remote, port)], timeout_ms)
    return [ret.name] + [r.name for r in rets]


def unlink(state: dict, remote: int, port: Optional[int], force: bool = False, timeout_ms: int = 3000) -> list:
    ret, rets = state["dd"].unlink_clusters([_cluster(remote, port)], timeout_ms, force=force)
    return [ret.name] + [r.name for r in rets]


def link_state(state: dict, remote: int) -> Optional[str]:
    links = state["dd"].statistics()["links"]
    entry = links.get(remote)
    return None if entry is None else entry["state"]


def link_info(state: dict, remote: int) -> Optional[dict]:
    entry = state["dd"].statistics()["links"].get(remote)
    return None if entry is None else {k: entry[k] for k in ("state", "transport", "last_error")}


def wait_link_state(state: dict, remote: int, wanted: tuple, timeout: float = 10.0) -> Optional[str]:
    deadline = time.monotonic() + timeout
    st = link_state(state, remote)
    while st not in wanted and time.monotonic() < deadline:
        time.sleep(0.01)
        st = link_state(state, remote)
    return st


def memory_stats(state: dict) -> dict:
    return state["dd"].statistics()["memory"]


def wait_memory(state: dict, path: tuple, wanted: Any, timeout: float = 5.0) -> Any:
    """Poll ``statistics()["memory"][path...]`` until it equals ``wanted`` (owner-side effects of a
    pull, such as key consumption, arrive asynchronously); returns the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = memory_stats(state)
        for part in path:
            value = value[part]
        if value == wanted or time.monotonic() >= deadline:
            return value
        time.sleep(0.005)


def finalize(state: dict) -> None:
    state["dd"].finalize()


# ---------------------------------------------------------------------------- memory
def _view(addr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def _fill(views: list, seed: Optional[int]) -> None:
    rng = np.random.default_rng(seed)
    for v in views:
        if seed is None:
            v[:] = 0
        else:
            v[:] = np.frombuffer(rng.bytes(v.nbytes), dtype=np.uint8)


def register(state: dict, name: str, num_tensors: int, shape: list, *, blocks: bool, seed: Optional[int] = None,
             key: Any = None, keys: tuple = (), placement: str = "DEVICE", remote_accessible: Optional[bool] = None,
             dtype: str = "DT_UINT8") -> int:
    """Register numpy memory (one array per tensor) as a cache or blocks cache; returns its cache_id."""
    nbytes = int(np.prod(shape)) * {"DT_UINT8": 1, "DT_FLOAT16": 2, "DT_FLOAT": 4}[dtype]
    arrays = [np.zeros(nbytes, np.uint8) for _ in range(num_tensors)]
    _fill(arrays, seed)
    desc = CacheDesc(num_tensors, list(shape), DataType[dtype], Placement[placement])
    cm = state["dd"].cache_manager
    addrs = [a.ctypes.data for a in arrays]
    if blocks:
        cache = cm.register_blocks_cache(desc, addrs, key, remote_accessible)
    else:
        cache = cm.register_cache(desc, addrs, list(keys), remote_accessible)
    state["caches"][name] = cache
    state["arrays"][name] = arrays
    return cache.cache_id


def allocate(state: dict, name: str, num_tensors: int, shape: list, *, seed: Optional[int] = None,
             keys: tuple = (), placement: str = "DEVICE", blocks: bool = False, key: Any = None) -> int:
    """allocate_cache (pool memory) and fill it; returns the cache_id."""
    desc = CacheDesc(num_tensors, list(shape), DataType.DT_UINT8, Placement[placement])
    cm = state["dd"].cache_manager
    cache = cm.allocate_blocks_cache(desc, key) if blocks else cm.allocate_cache(desc, list(keys))
    views = [_view(a, desc.size) for a in cache.tensor_addrs]
    _fill(views, seed)
    state["caches"][name] = cache
    state["arrays"][name] = views
    return cache.cache_id


def fill(state: dict, name: str, value: int) -> None:
    for a in state["arrays"][name]:
        a[:] = value


def snapshot(state: dict, name: str) -> np.ndarray:
    """A copy of every tensor of cache ``name``: shape (num_tensors, tensor_bytes), uint8."""
    return np.stack([np.array(a, copy=True) for a in state["arrays"][name]])


def deallocate(state: dict, name: str) -> None:
    state["dd"].cache_manager.deallocate_cache(state["caches"][name])


def remove_key(state: dict, key: CacheKey) -> None:
    state["dd"].cache_manager.remove_cache_key(key)


# ---------------------------------------------------------------------------- calls
def _resolve(state: dict, value: Any) -> Any:
    return state["caches"][value.name] if isinstance(value, Ref) else value


def cm(state: dict, method: str, *args: Any, **kwargs: Any) -> float:
    """Call ``cache_manager.<method>`` with ``Ref`` arguments resolved; returns the seconds it took."""
    args = tuple(_resolve(state, a) for a in args)
    kwargs = {k: _resolve(state, v) for k, v in kwargs.items()}
    t0 = time.monotonic()
    getattr(state["dd"].cache_manager, method)(*args, **kwargs)
    return time.monotonic() - t0


def cm_status(state: dict, method: str, *args: Any, **kwargs: Any) -> tuple:
    """Like :func:`cm`, but returns ``(status name or exception type name, seconds, end time)``."""
    t0 = time.monotonic()
    try:
        cm(state, method, *args, **kwargs)
    except LLMException as exc:
        return exc.status_code.name, time.monotonic() - t0, time.monotonic()
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, time.monotonic() - t0, time.monotonic()
    return "LLM_SUCCESS", time.monotonic() - t0, time.monotonic()


def threaded_pulls(state: dict, jobs: list) -> list:
    """Run ``cm(state, *job)`` for every job in its own thread at once; returns statuses in order."""
    results: list = [None] * len(jobs)
    barrier = threading.Barrier(len(jobs))

    def run(i: int, job: tuple) -> None:
        barrier.wait(5)
        method, args, kwargs = job
        results[i] = cm_status(state, method, *args, **kwargs)[0]

    threads = [threading.Thread(target=run, args=(i, j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def pull_until_error(state: dict, method: str, args: tuple, kwargs: dict, limit_s: float,
                     progress_path: str = "") -> dict:
    """Pull again and again until a pull fails (or ``limit_s``); the destination is then re-filled
    with a sentinel, and the result says whether any byte of it changed within 0.5 s (a measurement
    window).  With ``progress_path``, that file is created once the first pull has completed (the
    parent waits for it instead of sleeping)."""
    n_ok = 0
    deadline = time.monotonic() + limit_s
    status = None
    started = ended = 0.0
    while time.monotonic() < deadline:
        started = time.monotonic()
        status, _, ended = cm_status(state, method, *args, **kwargs)
        if status != "LLM_SUCCESS":
            break
        n_ok += 1
        if n_ok == 1 and progress_path:
            with open(progress_path, "w"):
                pass
    dst = args[1].name
    fill(state, dst, 0xA5)
    time.sleep(0.5)
    clean = all(bool((a == 0xA5).all()) for a in state["arrays"][dst])
    return {"ok": n_ok, "status": status, "started": started, "ended": ended, "sentinel_kept": clean}


# ---------------------------------------------------------------------------- events
class _Recorder:
    def __init__(self, sink: list) -> None:
        self.sink = sink

    @llmdd.plugin.hookimpl
    def llmdd_cache_transition(self, event) -> None:
        self.sink.append(("cache", event.trigger, event.id, dict(event.info), event.error is not None, event.at))

    @llmdd.plugin.hookimpl
    def llmdd_task_transition(self, event) -> None:
        self.sink.append(("task", event.trigger, event.id, dict(event.info), event.error is not None, event.at))


def subscribe(state: dict) -> None:
    state["dd"]._pm.register(_Recorder(state["events"]))


def _plain(value: Any) -> Any:
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


def events(state: dict, machine: Optional[str] = None, trigger: Optional[str] = None) -> list:
    out = []
    for m, trig, ident, info, err, at in list(state["events"]):
        if (machine is None or m == machine) and (trigger is None or trig == trigger):
            out.append({"machine": m, "trigger": trig, "id": _plain(ident), "error": err, "at": at,
                        "info": {k: _plain(v) for k, v in info.items()}})
    return out


def wait_events(state: dict, machine: str, trigger: str, count: int = 1, timeout: float = 5.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = events(state, machine, trigger)
        if len(found) >= count:
            return found
        time.sleep(0.005)
    return events(state, machine, trigger)


# ---------------------------------------------------------------------------- async transfers
class GatedSynchronizer(LayerSynchronizer):
    """Releases layer ``i`` when the test calls :func:`release_layer`; ``refuse`` layers return False."""

    def __init__(self, refuse: tuple = ()) -> None:
        self.gates: dict[int, threading.Event] = {}
        self.released_at: dict[int, float] = {}
        self.asked_at: dict[int, float] = {}
        self.refuse = set(refuse)
        self.lock = threading.Lock()

    def gate(self, layer: int) -> threading.Event:
        with self.lock:
            return self.gates.setdefault(layer, threading.Event())

    def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        self.asked_at[layer_index] = time.monotonic()
        if not self.gate(layer_index).wait(30):
            return False
        self.released_at[layer_index] = time.monotonic()
        return layer_index not in self.refuse


def start_async(state: dict, name: str, src: str, configs: list, *, refuse: tuple = (),
                src_blocks: Optional[list] = None, dst_blocks: Optional[list] = None,
                dst_block_memory_size: Optional[int] = None) -> None:
    sync = GatedSynchronizer(refuse)
    task = state["dd"].cache_manager.transfer_cache_async(state["caches"][src], sync, configs, src_blocks,
                                                          dst_blocks, dst_block_memory_size)
    state["tasks"][name] = task
    state["syncs"][name] = sync


def release_layer(state: dict, name: str, layer: int) -> None:
    state["syncs"][name].gate(layer).set()


def wait_layer_done(state: dict, name: str, layer: int, timeout: float = 5.0) -> bool:
    """Wait until ``layer`` shows in the task's ``layer_times`` (or the task ended)."""
    task = state["tasks"][name]._transfer_async_task
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(entry[0] == layer for entry in task.layer_times):
            return True
        if task.wait(0):
            return any(entry[0] == layer for entry in task.layer_times)
        time.sleep(0.002)
    return False


def async_synchronize(state: dict, name: str, timeout_ms: Optional[int] = None) -> str:
    return state["tasks"][name].synchronize(timeout_ms).name


def async_results(state: dict, name: str, timeout_ms: Optional[int] = None) -> list:
    return [None if r is None else r.name for r in state["tasks"][name].get_results(timeout_ms)]


def async_timeline(state: dict, name: str) -> dict:
    sync = state["syncs"][name]
    return {"layer_times": list(state["tasks"][name]._transfer_async_task.layer_times), "released_at": dict(sync.released_at),
            "asked_at": dict(sync.asked_at)}


def async_transfer_config_addrs(state: dict, name: str, layers: range) -> list:
    """Raw destination addresses (two per layer) of the registered cache ``name``."""
    arrays = state["arrays"][name]
    return [arrays[t].ctypes.data for layer in layers for t in (2 * layer, 2 * layer + 1)]


# ---------------------------------------------------------------------------- heap
def traced_pulls(state: dict, method: str, args: tuple, kwargs: dict, repeat: int) -> dict:
    """Pull ``repeat`` times under tracemalloc; returns the traced peak and bytes moved."""
    args = tuple(_resolve(state, a) for a in args)
    call = getattr(state["dd"].cache_manager, method)
    call(*args, **kwargs)  # warm caches (layouts, channel buffers) before measuring
    moved = state["dd"].statistics()["links"]
    before = sum(v["bytes_read"] for v in moved.values())
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        t0 = time.monotonic()
        for _ in range(repeat):
            call(*args, **kwargs)
        elapsed = time.monotonic() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    after = sum(v["bytes_read"] for v in state["dd"].statistics()["links"].values())
    return {"peak": peak, "moved": after - before, "elapsed": elapsed}



# ---------------------------------------------------------------------------- parent side
class PeerPool:
    """Parent side: a prompt and a decoder child kept for a whole test module.

    Spawning a child costs about a second; engines are cheap.  :meth:`pair` gives a freshly
    initialized (prompt, decoder, port) on the kept children (``setup`` finalizes the previous
    test's engines first) and respawns a child that a test killed or left stalled.
    """

    def __init__(self, env: dict) -> None:
        from llmdd.testing._harness import Cluster

        self._env = env
        self._cluster_cls = Cluster
        self._clusters: list = []
        self._p = self._d = None

    def _spawn(self) -> None:
        cluster = self._cluster_cls(env=self._env)
        self._clusters.append(cluster)
        self._p, self._d = cluster.spawn(f"p{len(self._clusters)}", f"d{len(self._clusters)}")

    def pair(self, transport: Optional[str], *, prompt_kw: Optional[dict] = None,
             decoder_kw: Optional[dict] = None) -> tuple:
        if self._p is None or not (self._p.is_alive() and self._d.is_alive()) or self._p.stalled \
                or self._d.stalled:
            if self._clusters:
                self._clusters[-1].close()
            self._spawn()
        try:
            # importing this module, llmdd and the transports in a fresh child, then an engine's init:
            # CPU-bound work, waited for while the child lives (its death fails the call at once); the
            # test's timeout bounds it (a fixed 10 s failed busy machines, issue 41)
            port = self._p.call(setup, "PROMPT", 1, listen=True, transport=transport, **(prompt_kw or {}),
                                timeout=None)
            self._d.call(setup, "DECODER", 2, transport=transport, **(decoder_kw or {}), timeout=None)
        except BaseException:
            self.discard()
            raise
        return self._p, self._d, port

    def discard(self) -> None:
        """Throw the current children away (after a test that broke them); the next pair respawns."""
        for handle in (self._p, self._d):
            if handle is not None:
                handle.kill()  # no graceful stop: their engines may be waiting on a dead peer
        if self._clusters:
            self._clusters[-1].close()
        self._p = self._d = None

    def close(self) -> None:
        for cluster in self._clusters:
            cluster.close()


def digest_blocks(state: dict, name: str, tensors: list, blocks: list, block_size: int) -> list:
    """sha256 of the given blocks (in list order) of the given tensors of cache ``name``."""
    import hashlib

    out = []
    for t in tensors:
        rows = state["arrays"][name][t].reshape(-1, block_size)
        out.append(hashlib.sha256(np.ascontiguousarray(rows[blocks]).tobytes()).hexdigest())
    return out
