"""Peer functions of the connector-extension tests (tags, non-blocking pulls, torch registration).
Module-level ``fn(state, ...)`` for the harness; engines and patterns come from ``_rel_peers``."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REL = os.path.join(os.path.dirname(HERE), "reliability")
for p in (HERE, REL):
    if p not in sys.path:
        sys.path.insert(0, p)
import _rel_peers as R  # noqa: E402

import llmdd.plugin  # noqa: E402
from llmdd import BlocksCacheKey, CacheDesc, DataType, LLMException, Placement  # noqa: E402


class _Events:
    """Every cache event of the engine, in the order the owner fired them."""

    def __init__(self) -> None:
        self.events: list = []
        self.lock = threading.Lock()

    @llmdd.plugin.hookimpl
    def llmdd_cache_transition(self, event) -> None:
        if event.trigger in ("peer_read", "peer_written"):
            with self.lock:
                self.events.append(event)


def record_events(state: dict) -> None:
    rec = _Events()
    state["dd"].add_plugin(rec)
    state["events"] = rec


def peer_events(state: dict, trigger: str = "peer_read") -> list:
    """(tag, blocks, error status name or None, peer) of every ``trigger`` event, in firing order."""
    with state["events"].lock:
        evs = [e for e in state["events"].events if e.trigger == trigger]
    return [(e.info.get("tag"), e.info.get("blocks"), None if e.error is None else e.error.status_code.name,
             e.info.get("peer")) for e in evs]


def tagged_pulls_in_threads(state: dict, remote: int, threads: int, per_thread: int, num_blocks: int,
                            seed: int, log_path: str = "") -> dict:
    """``threads`` threads, each pulling ``per_thread`` times one block (a different one each time)
    with tag ``t<thread>-<i>``; each pull's bytes are compared with the owner's pattern.  With
    ``log_path``, a tag is appended to that file once its pull returned success."""
    cm = state["dd"].cache_manager
    nt = len(state["arrays"]["dst"])
    want = R.pattern(remote, seed, nt, num_blocks * (state["arrays"]["dst"][0].size // num_blocks))
    block = state["arrays"]["dst"][0].size // num_blocks
    out = {"ok": 0, "failed": {}, "wrong": 0}
    lock = threading.Lock()
    log = open(log_path, "a", buffering=1) if log_path else None

    def run(t: int) -> None:
        rng = np.random.default_rng([seed, t])
        for i in range(per_thread):
            src = int(rng.integers(0, num_blocks))
            dst = t % num_blocks
            tag = f"t{t}-{i}"
            try:
                cm.pull_blocks(BlocksCacheKey(remote, 0), state["caches"]["dst"], [src], [dst], tag=tag)
            except LLMException as exc:
                with lock:
                    out["failed"][exc.status_code.name] = out["failed"].get(exc.status_code.name, 0) + 1
                continue
            ok = all(np.array_equal(state["arrays"]["dst"][k][dst * block:(dst + 1) * block],
                                    want[k][src * block:(src + 1) * block]) for k in range(nt))
            with lock:
                out["ok"] += 1
                out["wrong"] += 0 if ok else 1
                if log is not None:
                    log.write(f"{tag} {src}\n")

    # each thread owns one destination block, so its bytes can be checked after its own pull
    workers = [threading.Thread(target=run, args=(t,), name=f"tagged-{t}") for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    if log is not None:
        log.close()
    return out


def async_pulls(state: dict, remote: int, jobs: list, timeout_ms: int) -> dict:
    """Submit every ``(src_blocks, dst_blocks, tag)`` as a non-blocking pull at once, then wait for all.
    Returns the statuses, the callbacks' statuses (and how often each fired) and the submit time."""
    cm = state["dd"].cache_manager
    calls: dict = {}
    lock = threading.Lock()

    def callback_for(i: int):
        def cb(status) -> None:
            with lock:
                calls.setdefault(i, []).append(status.name)
        return cb

    t0 = time.monotonic()
    tasks = [cm.pull_blocks_async(BlocksCacheKey(remote, 0), state["caches"]["dst"], list(s), list(d), tag=tag,
                                  callback=callback_for(i)) for i, (s, d, tag) in enumerate(jobs)]
    submitted = time.monotonic() - t0
    # how many were still in flight once every submit had returned (synchronize(0): not done yet)
    in_flight = sum(t.synchronize(0).name == "LLM_TIMEOUT" for t in tasks)
    results = [t.synchronize(timeout_ms).name for t in tasks]
    again = [t.get_results(0)[0].name for t in tasks]
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        with lock:
            if len(calls) == len(jobs):
                break
        time.sleep(0.01)
    with lock:
        return {"results": results, "again": again, "callbacks": {i: list(v) for i, v in calls.items()},
                "submit_s": submitted, "in_flight_after_submit": in_flight}


def start_async_pulls(state: dict, remote: int, jobs: list) -> None:
    cm = state["dd"].cache_manager
    state["async_tasks"] = [cm.pull_blocks_async(BlocksCacheKey(remote, 0), state["caches"]["dst"], list(s),
                                                 list(d), tag=tag) for s, d, tag in jobs]


def finish_async_pulls(state: dict, timeout_ms: int) -> list:
    return [t.synchronize(timeout_ms).name for t in state.pop("async_tasks")]


def register_torch_layers(state: dict, name: str, layers: int, num_blocks: int, block_bytes: int, *,
                          seed=None, key=None, shared: bool = True) -> int:
    """A blocks cache over torch CPU tensors, one per layer; with ``shared`` every layer is a view of
    one shared buffer (vLLM's CPU backend layout).  ``seed``: the owner's pattern, else POISON."""
    import torch

    buf = torch.empty((layers, num_blocks * block_bytes), dtype=torch.uint8)
    if seed is None:
        buf.fill_(R.POISON)
    else:
        buf.copy_(torch.from_numpy(R.pattern(state["cluster_id"], seed, layers, num_blocks * block_bytes)))
    views = [buf[i] for i in range(layers)] if shared else [buf[i].clone() for i in range(layers)]
    desc = CacheDesc(layers, [num_blocks, block_bytes], DataType.DT_UINT8, Placement.DEVICE)
    cache = state["dd"].cache_manager.register_blocks_cache(desc, views, None if key is None else BlocksCacheKey(*key))
    state["caches"][name] = cache
    state["arrays"][name] = [v.numpy() for v in views]
    state.setdefault("torch_buffers", []).append(buf)
    return cache.cache_id


def register_bad_tensor(state: dict, kind: str) -> str:
    """Try to register a tensor llmdd must refuse; the refusal's status and message."""
    import torch

    desc = CacheDesc(1, [4, 256], DataType.DT_UINT8, Placement.DEVICE)
    if kind == "small":
        t = torch.zeros(512, dtype=torch.uint8)
    elif kind == "strided":
        t = torch.zeros((2, 1024), dtype=torch.uint8).t()
    elif kind == "cuda_like":
        class CudaLike:            # a CUDA tensor's interface, on a machine without a GPU
            device = torch.device("cuda", 0)

            def data_ptr(self):
                return 0x7F0000000000
        t = CudaLike()
    else:
        raise ValueError(kind)
    try:
        state["dd"].cache_manager.register_blocks_cache(desc, [t])
    except LLMException as exc:
        return f"{exc.status_code.name}: {exc}"
    return "registered"


def async_bad(state: dict, remote: int) -> list:
    """Non-blocking pulls that must be refused at submit: (status or exception type) of each."""
    cm = state["dd"].cache_manager
    dst = state["caches"]["dst"]
    out = []
    for call in (lambda: cm.pull_blocks_async(BlocksCacheKey(remote, 0), dst, [0], []),          # empty dst
                 lambda: cm.pull_blocks_async(BlocksCacheKey(remote, 0), dst, [0], [0], callback=3),
                 lambda: cm.pull_blocks_async(BlocksCacheKey(remote, 0), dst, [0], [0], tag=1.5),
                 lambda: cm.pull_blocks_async(BlocksCacheKey(99, 0), dst, [0], [0])):            # not linked
        try:
            call()
            out.append("accepted")
        except LLMException as exc:
            out.append(exc.status_code.name)
        except (TypeError, ValueError) as exc:
            out.append(type(exc).__name__)
    return out


def push_tagged(state: dict, remote: int, model: int, src_blocks: list, dst_blocks: list, tag) -> str:
    try:
        state["dd"].cache_manager.push_blocks(BlocksCacheKey(remote, model), state["caches"]["src"], src_blocks,
                                              dst_blocks, tag=tag)
    except LLMException as exc:
        return exc.status_code.name
    return "LLM_SUCCESS"


def finalize_under_async_pulls(state: dict, remote: int, jobs: list, timeout_ms: int) -> list:
    """Submit non-blocking pulls, finalize the engine at once, then read every task's status."""
    start_async_pulls(state, remote, jobs)
    tasks = state.pop("async_tasks")
    R.finalize(state)
    return [t.synchronize(timeout_ms).name for t in tasks]


class _EventFile:
    """Appends ``<tag> <error status or ok>`` per "peer finished reading" event to a file, line by
    line as the owner fires them (written before the acknowledgement leaves, so it survives SIGKILL)."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)
        self.lock = threading.Lock()

    @llmdd.plugin.hookimpl
    def llmdd_cache_transition(self, event) -> None:
        if event.trigger == "peer_read" and event.info.get("tag") is not None:
            err = "ok" if event.error is None else event.error.status_code.name
            with self.lock:
                self.file.write(f"{event.info['tag']} {err}\n")


def record_events_to_file(state: dict, path: str) -> None:
    state["dd"].add_plugin(_EventFile(path))


def pull_cache_async_once(state: dict, key: tuple, dst: str, batch_index: int, tag, timeout_ms: int) -> dict:
    """``pull_cache_async`` of ``key`` (``R._key`` spec) into slot ``batch_index`` of ``dst`` with a
    callback; its status by ``synchronize``, ``get_results`` and the callback's calls."""
    calls: list = []
    done = threading.Event()

    def cb(status) -> None:
        calls.append(status.name)
        done.set()

    task = state["dd"].cache_manager.pull_cache_async(R._key(key), state["caches"][dst], batch_index, tag=tag,
                                                      callback=cb)
    status = task.synchronize(timeout_ms).name
    again = [r.name for r in task.get_results(0)]
    done.wait(timeout_ms / 1000.0)   # the callback runs on the worker, after the task's result is set
    return {"status": status, "again": again, "callbacks": list(calls)}


def unlink_relink_under_async_pulls(state: dict, remote: int, port: int, jobs: list, after: tuple,
                                    timeout_ms: int) -> dict:
    """Submit non-blocking pulls, force-unlink their link at once and relink, then submit ``after``
    on the new link; every task's status (``synchronize``) and the unlink's and link's."""
    start_async_pulls(state, remote, jobs)
    tasks = state.pop("async_tasks")
    unlinked = R.unlink(state, [(remote, port)], True)["status"]
    linked = R.link(state, [(remote, port)])["status"]
    s, d, tag = after
    late = state["dd"].cache_manager.pull_blocks_async(BlocksCacheKey(remote, 0), state["caches"]["dst"], list(s),
                                                       list(d), tag=tag)
    return {"unlink": unlinked, "link": linked, "statuses": [t.synchronize(timeout_ms).name for t in tasks],
            "after": late.synchronize(timeout_ms).name}


class _DeviceStandIn:
    type = "cuda"
    index = 0

    def __str__(self) -> str:
        return "cuda:0"


class _TensorStandIn:
    """The part of a tensor's interface llmdd reads; records ``data_ptr`` calls."""

    def __init__(self) -> None:
        self.ptr_calls = 0

    def data_ptr(self) -> int:
        self.ptr_calls += 1
        return 0x7F0000000000     # not mapped here: reading it would crash the process

    def is_contiguous(self) -> bool:
        return True


class _CudaByDevice(_TensorStandIn):
    """A CUDA tensor without torch: ``device.type == "cuda"``."""

    device = _DeviceStandIn()


class _CudaByFlag(_TensorStandIn):
    """A tensor-like object that says ``is_cuda`` and has no ``device`` attribute."""

    is_cuda = True


def register_cuda_stand_ins(state: dict) -> list:
    """Register stand-ins for CUDA tensors (alone, and after a valid host address) as a blocks cache:
    (status, message, data_ptr calls, caches registered before == after) per attempt."""
    desc = CacheDesc(2, [4, 256], DataType.DT_UINT8, Placement.DEVICE)
    host = np.zeros(1024, np.uint8)
    state.setdefault("keep", []).append(host)
    out = []
    for make in (_CudaByDevice, _CudaByFlag):
        for mixed in (False, True):
            t = make()
            addrs = [host.ctypes.data, t] if mixed else [t, t]
            before = state["dd"].statistics()["memory"]["caches"]
            try:
                state["dd"].cache_manager.register_blocks_cache(desc, addrs)
                res = ("registered", "")
            except LLMException as exc:
                res = (exc.status_code.name, str(exc))
            out.append((make.__name__, mixed, res[0], res[1], t.ptr_calls,
                        state["dd"].statistics()["memory"]["caches"] == before))
    return out
