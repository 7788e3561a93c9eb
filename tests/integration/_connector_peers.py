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
                "submit_s": submitted}


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
