"""Peer-side functions of the v1-mode integration tests (run in harness children).

The ``v0_*`` / ``pipe_*`` functions transcribe the call sequences of vllm-ascend's v0 connectors
(spec/clients.md sections 2 and 3) against ``llm_datadist`` (the drop-in alias on PYTHONPATH),
with one change that needs an NPU upstream: the connectors fill and read caches through
``torchair.llm_datadist.create_npu_tensors`` on ``per_device_tensor_addrs[0]``; here the same
addresses are read and written as host memory (llmdd's device memory).  Contents are seeded random.

Every function is ``fn(state, ...)`` at module level, so that the harness pickles it by reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import time
from typing import Any, Optional

import numpy as np

HOST = "127.0.0.1"


_ALIAS_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "compat", "llm-datadist-alias",
                          "src")


def _ld():
    """``import llm_datadist``: the opt-in alias package (llm_datadist is llmdd), put on this child's path."""
    alias = os.path.normpath(_ALIAS_SRC)
    if alias not in sys.path:
        sys.path.insert(0, alias)
    import llm_datadist

    return llm_datadist


def _view(addr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def _digest(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def _finalize_previous(state: dict) -> None:
    old = state.get("dd")
    if old is not None:
        old.finalize()
    state.clear()


# ---------------------------------------------------------------------------- engine setup (KVTransferEngine)
def v0_prepare_data_dist(state: dict, role: str, cluster_id: int, *, sync_ms: int = 3000,
                         extra: Optional[dict] = None) -> Optional[int]:
    """``KVTransferEngine.prepare_data_dist``: raw options, no LLMConfig; returns the PROMPT's port."""
    _finalize_previous(state)
    ld = _ld()
    llm_role = ld.LLMRole.PROMPT if role == "PROMPT" else ld.LLMRole.DECODER
    data_dist = ld.LLMDataDist(llm_role, cluster_id)
    options = {"llm.SyncKvCacheWaitTime": str(sync_ms)}
    if llm_role == ld.LLMRole.PROMPT:
        options["ge.exec.deviceId"] = "0"
        options["llm.listenIpInfo"] = f"{HOST}:0"  # the connector's prompt_device_ip:LLMDATADIST_COMM_PORT
    else:
        options["ge.exec.deviceId"] = "0"
    options.update(extra or {})
    data_dist.init(options)
    state.update(dd=data_dist, kv=data_dist.kv_cache_manager, bufs={}, data={}, events=[])
    if llm_role == ld.LLMRole.PROMPT:
        return data_dist.statistics()["listen"][1]  # test glue: the port the OS picked
    return None


def v0_link(state: dict, prompt_cluster_id: int, port: int, timeout_ms: int = 20000) -> list:
    """The decoder connector's ctor: ``LLMClusterInfo`` with device ips, ``link_clusters([c], 20000)``."""
    ld = _ld()
    cluster = ld.LLMClusterInfo()
    cluster.remote_cluster_id = prompt_cluster_id
    cluster.append_local_ip_info(HOST, 0)
    cluster.append_remote_ip_info(HOST, port)
    state["cluster"] = cluster
    ret, rets = state["dd"].link_clusters([cluster], timeout_ms)
    return [ret.name] + [r.name for r in rets]


def v0_close(state: dict) -> list:
    """``close()``: ``unlink_clusters([self.cluster], 5000)``."""
    ret, rets = state["dd"].unlink_clusters([state["cluster"]], 5000)
    return [ret.name] + [r.name for r in rets]


def _descs(num_layer: int, num_tokens: int, num_heads: int, head_size: int, hidden: int, *,
           kv_seq_dim: int = 1) -> list:
    """The connector's four CacheDescs: K, V (the PROMPT passes seq_len_dim_index=1, the DECODER -1),
    input ids, hidden states."""
    ld = _ld()
    dtype = ld.DataType.DT_FLOAT16
    kv = ld.CacheDesc(num_layer, (1, num_tokens, num_heads, head_size), dtype, seq_len_dim_index=kv_seq_dim)
    return [kv, kv,
            ld.CacheDesc(1, (1, num_tokens, 1, 1), ld.DataType.DT_INT32, seq_len_dim_index=-1),
            ld.CacheDesc(1, (1, num_tokens, 1, hidden), dtype, seq_len_dim_index=-1)]


def v0_send(state: dict, cluster_id: int, geometry: tuple, seed: int) -> dict:
    """PROMPT ``send_kv_caches_and_hidden_states``: K, V, input ids, hidden; keys CacheKey(cluster, 0, 1..4)."""
    ld = _ld()
    rng = np.random.default_rng(seed)
    out = {}
    for model_id, desc in enumerate(_descs(*geometry), start=1):
        key = ld.CacheKey(cluster_id, 0, model_id)
        try:
            buf = state["kv"].allocate_cache(desc, [key])
        except ld.LLMException as exc:
            return {"error": exc.status_code.name, "message": str(exc), "model_id": model_id}
        addrs = buf.per_device_tensor_addrs[0]
        digests = []
        for addr in addrs:
            data = rng.integers(0, 256, desc.size, dtype=np.uint8)
            _view(addr, desc.size)[:] = data  # the connector's scatter_update_ into the npu tensors
            digests.append(_digest(data))
        state["bufs"][model_id] = buf
        out[model_id] = {"cache_id": buf.cache_id, "digests": digests}
    return out


def v0_recv(state: dict, prompt_cluster_id: int, geometry: tuple) -> dict:
    """DECODER ``recv_kv_caches_and_hidden_states``: 4 keyless buffers, pulls by cache id 1..4."""
    ld = _ld()
    kv = state["kv"]
    bufs = [kv.allocate_cache(desc) for desc in _descs(*geometry, kv_seq_dim=-1)]
    for cache_id, buf in enumerate(bufs, start=1):
        kv.pull_cache(ld.CacheKeyByIdAndIndex(prompt_cluster_id, cache_id, 0), buf, 0)
    out = {}
    for model_id, buf in enumerate(bufs, start=1):
        size = buf.cache_desc.size
        out[model_id] = {"cache_id": buf.cache_id,
                         "digests": [_digest(_view(a, size)) for a in buf.per_device_tensor_addrs[0]]}
        state["bufs"][model_id] = buf
    return out


# ---------------------------------------------------------------------------- simple_pipe / simple_buffer
def _int32_hash(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest(), 16) % (2**31)


def pipe_send_tensor(state: dict, cluster_id: int, req: str, model_id: int, shape: list, seed: int) -> dict:
    """``SimplePipe.send_tensor``: allocate with the key, fill, then deallocate right away (deferred free)."""
    ld = _ld()
    rng = np.random.default_rng(seed)
    desc = ld.CacheDesc(1, shape, ld.DataType.DT_FLOAT16, seq_len_dim_index=1)
    key = ld.CacheKey(cluster_id, _int32_hash(req), model_id)
    buf = state["kv"].allocate_cache(desc, [key])
    data = rng.integers(0, 256, desc.size, dtype=np.uint8)
    _view(buf.per_device_tensor_addrs[0][0], desc.size)[:] = data
    cache_id = buf.cache_id
    state["kv"].deallocate_cache(buf)  # "actual deallocate will happen after consumer performing pull_cache"
    return {"cache_id": cache_id, "digest": _digest(data), "addrs_after": buf.per_device_tensor_addrs}


def pipe_recv_tensor(state: dict, prompt_cluster_id: int, req: str, model_id: int, shape: list) -> dict:
    """``SimplePipe.recv_tensor``: free the previous round's buffer, allocate, pull by CacheKey."""
    ld = _ld()
    kv = state["kv"]
    previous = state["bufs"].pop(model_id, None)
    if previous is not None:
        kv.deallocate_cache(previous)  # deallocate_buffer of the previous round
    desc = ld.CacheDesc(1, shape, ld.DataType.DT_FLOAT16, seq_len_dim_index=1)
    tmp = kv.allocate_cache(desc)
    try:
        kv.pull_cache(ld.CacheKey(prompt_cluster_id, _int32_hash(req), model_id), tmp, 0)
    except Exception as exc:  # the buffer's broad except -> recompute; the test wants the code
        kv.deallocate_cache(tmp)
        code = getattr(exc, "status_code", None)
        return {"error": type(exc).__name__, "status": code.name if code is not None else None}
    state["bufs"][model_id] = tmp
    return {"digest": _digest(_view(tmp.per_device_tensor_addrs[0][0], desc.size))}


# ---------------------------------------------------------------------------- generic helpers
def memory_stats(state: dict) -> dict:
    return state["dd"].statistics()["memory"]


def wait_memory(state: dict, path: tuple, wanted: Any, timeout: float = 5.0) -> Any:
    """Poll ``statistics()["memory"][...]`` until it equals ``wanted`` (bounded); returns the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = memory_stats(state)
        for part in path:
            value = value[part]
        if value == wanted or time.monotonic() >= deadline:
            return value
        time.sleep(0.005)


def finalize(state: dict) -> None:
    dd = state.get("dd")
    if dd is not None:
        dd.finalize()
    state.clear()


def km_call(state: dict, method: str, *args: Any, **kwargs: Any) -> tuple:
    """Call ``kv_cache_manager.<method>`` with ``("buf", name)`` tuples resolved; returns
    ``("ok", result repr)`` or ``("error", exception type name, status name or None, message)``."""
    args = tuple(_resolve(state, a) for a in args)
    kwargs = {k: _resolve(state, v) for k, v in kwargs.items()}
    target = state["dd"] if method in ("check_link_status", "link_clusters", "unlink_clusters", "switch_role") \
        else state["kv"]
    try:
        result = getattr(target, method)(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test compares the error
        if isinstance(exc, _ld().LLMException):  # subclasses (the planner's LocalUsageError) included
            return ("error", "LLMException", exc.status_code.name, str(exc))
        return ("error", type(exc).__name__, None, str(exc))
    if isinstance(result, tuple) and result and hasattr(result[0], "name"):
        return ("ok", [result[0].name, [r.name for r in result[1]]])
    return ("ok", None if result is None else repr(result))


def _resolve(state: dict, value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "buf":
        return state["bufs"][value[1]]
    return value


def allocate(state: dict, name: str, num_tensors: int, shape: list, *, keys: tuple = (), blocks: bool = False,
             blocks_key: Any = None, seed: Optional[int] = None, dtype: str = "DT_UINT8") -> dict:
    ld = _ld()
    desc = ld.CacheDesc(num_tensors, shape, ld.DataType[dtype])
    kv = state["kv"]
    buf = kv.allocate_blocks_cache(desc, blocks_key) if blocks else kv.allocate_cache(desc, list(keys))
    state["bufs"][name] = buf
    if seed is not None:
        rng = np.random.default_rng(seed)
        for addr in buf.per_device_tensor_addrs[0]:
            _view(addr, desc.size)[:] = rng.integers(0, 256, desc.size, dtype=np.uint8)
    return {"cache_id": buf.cache_id, "addrs": list(buf.per_device_tensor_addrs[0]), "size": desc.size}


def snapshot(state: dict, name: str) -> np.ndarray:
    buf = state["bufs"][name]
    size = buf.cache_desc.size
    return np.stack([_view(a, size).copy() for a in buf.per_device_tensor_addrs[0]])


def deallocate(state: dict, name: str) -> None:
    state["kv"].deallocate_cache(state["bufs"].pop(name))


def transfer_async(state: dict, src: str, dst_cluster: int, dst_addrs: list, *, layers: Optional[range] = None,
                   timeout_ms: int = 10000) -> dict:
    ld = _ld()

    class Sync(ld.LayerSynchronizer):
        def __init__(self) -> None:
            self.seen: list = []

        def synchronize_layer(self, layer_index, timeout_in_millis):
            self.seen.append(layer_index)
            return True

    sync = Sync()
    config = ld.TransferConfig(dst_cluster, dst_addrs, layers)
    task = state["kv"].transfer_cache_async(state["bufs"][src], sync, [config])
    status = task.synchronize(timeout_ms)
    return {"status": status.name, "results": [r.name if r is not None else None for r in task.get_results(0)],
            "layers": sync.seen, "range": [config.src_layer_range.start, config.src_layer_range.stop]}


def switch_role(state: dict, role: str, listen: Optional[str] = None) -> tuple:
    """``switch_role(LLMRole.<role>, {"llm.listenIpInfo": listen} or None)``; returns (outcome, port)."""
    ld = _ld()
    options = None if listen is None else {"llm.listenIpInfo": listen}
    out = km_call(state, "switch_role", ld.LLMRole[role], options)
    addr = state["dd"].statistics()["listen"]
    return out, (addr[1] if addr else None)


def link_count(state: dict) -> int:
    return sum(1 for entry in state["dd"].statistics()["links"].values() if entry["state"] == "linked")


def start_gated_transfer(state: dict, src: str, configs: list) -> None:
    """``transfer_cache_async`` whose synchronizer holds every layer until :func:`open_gate` (bounded wait).

    ``configs`` items: ``("addrs", dst_cluster, [addr...])``, one TransferConfig each (upstream's v1
    takes no other config)."""
    import threading

    ld = _ld()
    gate = threading.Event()

    class Gate(ld.LayerSynchronizer):
        def synchronize_layer(self, layer_index, timeout_in_millis):
            return gate.wait(30.0)  # released by the test; bounded so a broken test cannot hang

    built = [ld.TransferConfig(cluster, addrs) for _, cluster, addrs in configs]
    task = state["kv"].transfer_cache_async(state["bufs"][src], Gate(), built)
    state["gated"] = (task, gate)


def gated_status(state: dict, timeout_ms: Optional[int]) -> dict:
    task, _ = state["gated"]
    return {"sync": task.synchronize(timeout_ms).name,
            "results": [r.name if r is not None else None for r in task.get_results(0 if timeout_ms is not None
                                                                                   else None)]}


def open_gate(state: dict) -> None:
    state["gated"][1].set()


def wait_link_count(state: dict, wanted: int, timeout: float = 5.0) -> int:
    """Poll the number of linked peers until it is ``wanted`` (bounded); returns the last count."""
    deadline = time.monotonic() + timeout
    count = link_count(state)
    while count != wanted and time.monotonic() < deadline:
        time.sleep(0.005)
        count = link_count(state)
    return count


def threaded_pipe_recv(state: dict, prompt_cluster_id: int, reqs: list, shape: list, workers: int = 4) -> dict:
    """``pipe_recv_tensor``'s pull for every ``(req, model_id)`` from ``workers`` threads at once;
    returns ``[(f"{req}/{model_id}", digest or status name), ...]`` in the order of ``reqs``."""
    import concurrent.futures

    ld = _ld()
    kv = state["kv"]
    desc = ld.CacheDesc(1, shape, ld.DataType.DT_FLOAT16, seq_len_dim_index=1)

    def one(item):
        req, model_id = item
        tmp = kv.allocate_cache(desc)
        try:
            kv.pull_cache(ld.CacheKey(prompt_cluster_id, _int32_hash(req), model_id), tmp, 0)
            return f"{req}/{model_id}", _digest(_view(tmp.per_device_tensor_addrs[0][0], desc.size))
        except ld.LLMException as exc:
            return f"{req}/{model_id}", exc.status_code.name
        finally:
            kv.deallocate_cache(tmp)

    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(one, item) for item in reqs]
        return [f.result(timeout=30) for f in futures]
