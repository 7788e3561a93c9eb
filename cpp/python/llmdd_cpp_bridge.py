"""The Python half of libllm_datadist: the C++ API's semantics on the llmdd engine.

The C++ library embeds this module (its text is compiled into the shared library) and calls
one ``Bridge`` per ``LlmDataDist``.  Every method returns ``(status, message, value)``:
``status`` is the uint32 code the C++ call returns (llmdd's ``LLMStatusCode`` values, an
unnamed one as it is), ``message`` the reason of a failure ("" on success).  Nothing here
prints or configures logging.

C++ caches are registered in llmdd as blocks caches (``shape[0]`` = blocks = batch slots;
one slot and one block have the same size, ``tensor_size / shape[0]``), each under the
``BlocksCacheKey(cluster_id, model_id=cache_id)`` so that Python peers can pull its blocks
by key.  Upstream's C++ caches are of a "mix" kind, usable by cache and by block transfers;
this module keeps that by planning each transfer with the kind the C++ call asks for, over
the geometry of the engine's own cache tables (the caller's ``Cache.tensor_addrs`` and
``cache_desc`` are never trusted for bounds).

What the public API offers, this module calls there; the rest (caches keyed by their own id,
transfers naming the peer's cache by id, copies between two caches, the records the checks read)
goes through :class:`llmdd._api.bridge_api.EngineApi`, the one internal API it stands on: it imports
no other private module of llmdd and reads no private attribute.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Optional, Union

import llmdd
from llmdd import CacheDesc, DataType, LLMClusterInfo, LLMException, LLMRole, LLMStatusCode, Placement
from llmdd._api.bridge_api import EngineApi

S = LLMStatusCode
OK = 0
FAILED = 0xFFFFFFFF
PARAM_INVALID = S.LLM_PARAM_INVALID.value
NOT_INITIALIZED = "LlmDataDist is not initialized"
_DONE = (OK, "", None)  # a successful call's answer without a value (one object, not one per call)

# C++ option key -> Python engine key (the rest pass through unchanged)
_KEY_MAP = {
    "llm.ListenIpInfo": "llm.listenIpInfo",
    "llm.DeviceId": "ge.exec.deviceId",
}
_BUF_POOL = "llm.BufPoolCfg"
_ROLES = {1: LLMRole.PROMPT, 2: LLMRole.DECODER, 3: LLMRole.MIX}
_ROLE_NAMES = {1: "prompt", 2: "decoder", 3: "mix"}
_PULLERS = (2, 3)  # the guide: pulls on a decoder (a mix engine is both)
_PUSHERS = (1, 3)  # pushes on a prompt
_DTYPES = {dt.value: dt for dt in DataType}


class _Fail(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _code(exc: BaseException) -> int:
    if isinstance(exc, _Fail):
        return exc.status
    if isinstance(exc, LLMException):
        value = exc.status_code.value
        return value & 0xFFFFFFFF  # LLM_UNKNOWN_ERROR (-1) reads as 0xFFFFFFFF
    if isinstance(exc, (TypeError, ValueError, OverflowError)):
        return PARAM_INVALID
    return FAILED


class _Partial:
    """A failed call that still has a value for the caller (the per-cluster statuses of a link)."""

    def __init__(self, status: int, message: str, value: Any) -> None:
        self.status, self.message, self.value = status, message, value


def _call(fn):
    def wrapper(self, *args):
        try:
            out = fn(self, *args)
            if isinstance(out, _Partial):
                return out.status, out.message, out.value
            return _DONE if out is None else (OK, "", out)
        except BaseException as exc:  # every failure becomes a status; nothing escapes into C++
            return _code(exc), f"{type(exc).__name__}: {exc}", None
    wrapper.__name__ = fn.__name__
    return wrapper


def _invalid(message: str) -> _Fail:
    return _Fail(PARAM_INVALID, message)


def _ipv4(text: str, what: str) -> str:
    """A dotted-quad IPv4 address, as upstream's IpToInt reads it (no host names)."""
    parts = text.split(".")
    if len(parts) != 4 or not all(p.isdigit() and len(p) <= 3 and int(p) <= 255 for p in parts):
        raise _invalid(f"{what} must be an IPv4 address, got {text!r}")
    return text


def _listen(text: str) -> str:
    ip, sep, port = text.partition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise _invalid(f"llm.ListenIpInfo must be ip:port, got {text!r}")
    _ipv4(ip, "llm.ListenIpInfo")
    return text


def _pool_size(text: str) -> int:
    """``buf_pool_size`` of an OPTION_BUF_POOL_CFG JSON; the whole text is checked."""
    try:
        cfg = json.loads(text)
    except ValueError as exc:
        raise _invalid(f"{_BUF_POOL} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise _invalid(f"{_BUF_POOL} must be a JSON object, got {text!r}")
    if not cfg:
        raise _invalid(f"{_BUF_POOL} names neither buf_cfg nor buf_pool_size")
    unknown = set(cfg) - {"buf_cfg", "buf_pool_size"}
    if unknown:
        raise _invalid(f"{_BUF_POOL} has unknown keys {sorted(unknown)}")
    buf_cfg = cfg.get("buf_cfg", [])
    if not isinstance(buf_cfg, list):
        raise _invalid(f"{_BUF_POOL} buf_cfg must be a list, got {buf_cfg!r}")
    for i, entry in enumerate(buf_cfg):
        if not isinstance(entry, dict) or set(entry) != {"total_size", "blk_size", "max_buf_size"}:
            raise _invalid(f"{_BUF_POOL} buf_cfg[{i}] must hold exactly total_size, blk_size, max_buf_size")
        for name, value in entry.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise _invalid(f"{_BUF_POOL} buf_cfg[{i}].{name} must be a positive integer, got {value!r}")
        if entry["blk_size"] > entry["max_buf_size"] or entry["max_buf_size"] > entry["total_size"]:
            raise _invalid(f"{_BUF_POOL} buf_cfg[{i}] needs blk_size <= max_buf_size <= total_size")
    size = cfg.get("buf_pool_size")
    if size is None:
        return 0
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size < 2 ** 63:
        raise _invalid(f"{_BUF_POOL} buf_pool_size must be a positive 64-bit integer, got {size!r}")
    return size


def _layers(pair: tuple) -> Optional[range]:
    first, last = pair
    return None if first < 0 else range(first, last + 1)


def _check_ext(src: tuple, dst: tuple, tnpl: int, same: bool) -> tuple:
    """Upstream's KvCacheExtParam rules; returns the half-open ranges (None = every layer)."""
    for name, (first, last) in (("src", src), ("dst", dst)):
        if first < -1 or last < -1 or first > last:
            raise _invalid(f"invalid {name}_layer_range [{first},{last}]: layers must be >= -1 and first <= last")
    if tnpl <= 0:
        raise _invalid(f"tensor_num_per_layer must be > 0, got {tnpl}")
    if same and (src[1] - src[0]) != (dst[1] - dst[0]):
        raise _invalid("src_layer_range must have the same size as dst_layer_range")
    if src[0] < 0 or dst[0] < 0:
        # as upstream: a range is used only when both sides name layers
        if same and src[0] >= 0:
            raise _invalid("dst_layer_range must name layers when src_layer_range does")
        return None, None
    return _layers(src), _layers(dst)


def _check_blocks(name: str, blocks: list) -> list:
    for b in blocks:
        if b < 0 or b >= 2 ** 63:
            raise _invalid(f"{name} holds an index out of range: {b}")
    return blocks


class Bridge:
    """One C++ ``LlmDataDist``: its cluster id, role and (once initialized) llmdd engine."""

    def __init__(self, cluster_id: int, role: int) -> None:
        self.cluster_id = cluster_id
        self.role = role
        self.dd: Optional[llmdd.LLMDataDist] = None
        self.api: Optional[EngineApi] = None   # the engine's internal API for what the public one lacks
        self._caches: dict[int, llmdd.Cache] = {}  # cache id -> llmdd Cache (allocated ones)
        # the last ext of pull_blocks that passed _check_ext: (ext, src_range, dst_range, the ranges
        # as the plan key holds them); C++ passes the same tuple object while the ext is the same
        # (a tuple of ints: its check cannot change), and this reference keeps that object alive
        self._pull_ext: Optional[tuple] = None
        self._lock = threading.Lock()
        self._starting = False
        self._switch_role = False

    # ------------------------------------------------------------------ lifecycle
    def _engine(self) -> tuple[llmdd.LLMDataDist, EngineApi]:
        dd, api = self.dd, self.api
        if dd is None or api is None or not api.initialized():
            raise _Fail(FAILED, NOT_INITIALIZED)
        return dd, api

    @_call
    def initialize(self, options: dict) -> None:
        with self._lock:  # state only: the engine is started and stopped outside the lock
            if self.dd is not None:
                return  # already initialized: success, as upstream
            if self._starting:
                raise _Fail(FAILED, "Initialize is already running on another thread")
            self._starting = True
        try:
            role = _ROLES.get(self.role)
            if role is None:
                raise _invalid(f"invalid role {self.role}")
            if self.role == 1 and "llm.ListenIpInfo" not in options:
                raise _invalid("a prompt listens: option llm.ListenIpInfo is required")
            opts = self._engine_options(options)
            dd = llmdd.LLMDataDist(role, self.cluster_id)
            dd.init(opts)  # a failed init leaves no engine, pool, socket or thread behind
        finally:
            with self._lock:
                self._starting = False
        with self._lock:
            self.dd = dd
            self.api = EngineApi(dd)
            self._switch_role = options.get("llm.EnableSwitchRole") == "1"

    def _engine_options(self, options: dict) -> dict:
        if "llm.DeviceId" not in options:
            raise _invalid("option llm.DeviceId is required")
        device = options["llm.DeviceId"].strip()
        parts = device.split(";")
        if not device or not all(p.strip().isdigit() and int(p) <= 2 ** 31 - 1 for p in parts):
            raise _invalid(f"option llm.DeviceId must be a device id in [0, 2**31), got {device!r}")
        if len(parts) != 1:
            raise _invalid("one device per process: llm.DeviceId must name exactly one device")
        if "llm.ListenIpInfo" in options:
            _listen(options["llm.ListenIpInfo"])
        opts = {}
        for key, value in options.items():
            if key == _BUF_POOL:
                continue
            opts[_KEY_MAP.get(key, key)] = value
        if _BUF_POOL in options:
            size = _pool_size(options[_BUF_POOL])
            if size:
                # pools are created on first use: only the placement a cache asks for costs memory
                pool = json.dumps({"memory_size": size})
                opts["llm.MemPoolConfig"] = pool
                opts["llm.HostMemPoolConfig"] = pool
        opts["llm.EnableCacheManager"] = "1"
        opts["llm.EnableRemoteCacheAccessible"] = "1"
        return opts

    @_call
    def finalize(self) -> None:
        with self._lock:
            dd, self.dd, self.api = self.dd, None, None
            self._caches.clear()
        if dd is not None:
            dd.finalize()

    @_call
    def set_role(self, role: int, options: dict) -> None:
        dd, _ = self._engine()
        target = _ROLES.get(role)
        if target is None:
            raise _invalid(f"invalid role {role}")
        if not self._switch_role:
            raise _Fail(S.LLM_FEATURE_NOT_ENABLED.value, "SetRole needs option llm.EnableSwitchRole=1 at Initialize")
        if role == 1 and "llm.ListenIpInfo" not in options:
            raise _invalid("switching to prompt needs option llm.ListenIpInfo")
        if "llm.ListenIpInfo" in options:
            _listen(options["llm.ListenIpInfo"])
        dd.switch_role(target, {_KEY_MAP.get(k, k): v for k, v in options.items()})
        self.role = role

    # ------------------------------------------------------------------ links
    @staticmethod
    def _cluster(info: tuple) -> LLMClusterInfo:
        remote_id, local_ips, remote_ips = info
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = remote_id
        for ip, port in local_ips:
            cluster.append_local_ip_info(_ipv4(ip, "local_ip_infos ip"), port)
        for ip, port in remote_ips:
            cluster.append_remote_ip_info(_ipv4(ip, "remote_ip_infos ip"), port)
        return cluster

    @_call
    def link(self, clusters: list, timeout_ms: int) -> Union[list, _Partial]:
        dd, _ = self._engine()
        if timeout_ms <= 0:
            raise _invalid(f"timeout ({timeout_ms}) must be > 0")
        infos = [self._cluster(c) for c in clusters]
        status, rets = dd.link_clusters(infos, timeout_ms)
        rets = [r.value & 0xFFFFFFFF for r in rets]
        code = status.value & 0xFFFFFFFF
        if code != OK:
            why = dd.statistics()["link_failures"]   # the reason of each failed cluster (docs/cpp.md)
            return _Partial(code, f"link_clusters failed, per cluster: {[hex(r) for r in rets]}" + "".join(
                f"; cluster {c[0]}: {why[c[0]]['error']}" for c, r in zip(clusters, rets) if r != OK and c[0] in why), rets)
        return rets

    @_call
    def unlink(self, clusters: list, timeout_ms: int, force: bool) -> Union[list, _Partial]:
        dd, _ = self._engine()
        if timeout_ms <= 0:
            raise _invalid(f"timeout ({timeout_ms}) must be > 0")
        infos = [self._cluster(c) for c in clusters]
        status, rets = dd.unlink_clusters(infos, timeout_ms, force)
        rets = [r.value & 0xFFFFFFFF for r in rets]
        code = status.value & 0xFFFFFFFF
        if code != OK:
            return _Partial(code, f"unlink_clusters failed, per cluster: {[hex(r) for r in rets]}", rets)
        return rets

    # ------------------------------------------------------------------ caches
    @staticmethod
    def _desc(desc: tuple) -> CacheDesc:
        placement, num_tensors, data_type, shape = desc
        if placement not in (0, 1):
            raise _invalid(f"invalid placement {placement}")
        dtype = _DTYPES.get(data_type)
        if dtype is None:
            raise _invalid(f"data_type {data_type} is not supported by llmdd")
        if num_tensors <= 0:
            raise _invalid("num_tensors should be bigger than zero")
        if not shape or any(d <= 0 for d in shape):
            raise _invalid(f"shape {list(shape)} must be non-empty with dims > 0")
        return CacheDesc(num_tensors, list(shape), dtype, Placement(placement))

    @_call
    def allocate(self, desc: tuple) -> tuple:
        dd, api = self._engine()
        cache = api.allocate_own_key(self._desc(desc))
        self._caches[cache.cache_id] = cache
        return cache.cache_id, list(cache.tensor_addrs)

    @_call
    def deallocate(self, cache_id: int) -> None:
        dd, api = self._engine()
        cache = self._caches.pop(cache_id, None)
        if cache is None:
            rec = api.record(cache_id)
            if rec is not None and rec.live and not rec.owned:
                raise _invalid(f"cache {cache_id} is registered, not allocated: use UnregisterKvCache")
            return  # unknown or already released: success
        dd.cache_manager.deallocate_blocks_cache(cache)

    @_call
    def register(self, desc: tuple, addrs: list) -> int:
        dd, api = self._engine()
        if not addrs:
            raise _invalid("addrs cannot be empty")
        placement, num_tensors, _, _ = desc
        if len(addrs) != num_tensors:
            raise _invalid(f"addrs length:{len(addrs)} should be equal to num_tensors:{num_tensors}")
        if any(a == 0 for a in addrs):
            raise _invalid("addr cannot be nullptr")
        return api.register_own_key(self._desc(desc), addrs).cache_id

    @_call
    def unregister(self, cache_id: int) -> None:
        dd, api = self._engine()
        rec = api.record(cache_id)
        if rec is not None and rec.live and rec.owned:
            raise _invalid(f"cache {cache_id} is allocated, not registered: use DeallocateCache")
        dd.cache_manager.unregister_cache(cache_id)

    # ------------------------------------------------------------------ transfers
    def _check_role(self, allowed: tuple, call: str) -> None:
        if self.role not in allowed:
            who = " or ".join(_ROLE_NAMES[r] for r in allowed)
            raise _invalid(f"{call} is only supported by a {who}; this LlmDataDist is a {_ROLE_NAMES[self.role]}")

    def _move(self, api: EngineApi, *, write: bool, blocks: bool, local_id: int, remote_cluster: int,
              remote_id: int, local_unit: int = 0, remote_unit: int = 0, size: int = -1,
              local_blocks: Optional[list] = None, remote_blocks: Optional[list] = None,
              src_range: Optional[range] = None, dst_range: Optional[range] = None, tnpl: int = 2) -> None:
        if remote_cluster == self.cluster_id:
            raise _invalid(f"data can not be moved between cluster {remote_cluster} and itself")
        api.move(write=write, blocks=blocks, local_id=local_id, cluster_id=remote_cluster, remote_id=remote_id,
                 local_unit=local_unit, remote_unit=remote_unit, size=size, local_blocks=local_blocks,
                 remote_blocks=remote_blocks, src_layer_range=src_range, dst_layer_range=dst_range, tnpl=tnpl)

    @_call
    def pull_cache(self, src: tuple, dst_id: int, batch_index: int, size: int, ext: tuple) -> None:
        dd, api = self._engine()
        self._check_role(_PULLERS, "PullKvCache")
        if size != -1 and size <= 0:
            raise _invalid(f"invalid size ({size}), size must = -1 or > 0")
        src_range, dst_range = _check_ext(ext[0], ext[1], ext[2], False)
        cluster_id, cache_id, src_batch = src
        self._move(api, write=False, blocks=False, local_id=dst_id, remote_cluster=cluster_id, remote_id=cache_id,
                   local_unit=batch_index, remote_unit=src_batch, size=size, src_range=src_range,
                   dst_range=dst_range, tnpl=ext[2])

    def pull_blocks(self, src: tuple, dst_id: int, src_blocks: list, dst_blocks: list, ext: tuple) -> tuple:
        """PullKvBlocks.  Not wrapped by ``_call`` (one Python frame less per call) but answering as
        it does: the same checks in the same order, every failure a status."""
        try:
            api = self.api
            if api is None or not api.initialized():
                raise _Fail(FAILED, NOT_INITIALIZED)
            if self.role not in _PULLERS:
                self._check_role(_PULLERS, "PullKvBlocks")
            cluster_id, cache_id, src_batch = src
            if src_batch != 0:
                raise _invalid(f"invalid src_cache_index.batch_index ({src_batch}), only 0 is supported in pull "
                               f"block")
            hit = self._pull_ext
            if hit is None or hit[0] is not ext:  # identity: an equal tuple of other types is checked anew
                hit = (ext, *_check_ext(ext[0], ext[1], ext[2], False))
                self._pull_ext = hit
            _, src_range, dst_range = hit
            if not src_blocks:
                raise _invalid("src_blocks is empty, pull from non-block cache is not supported yet")
            if len(src_blocks) != len(dst_blocks):
                raise _invalid(f"number of src_blocks ({len(src_blocks)}) mismatches that of dst_blocks "
                               f"({len(dst_blocks)})")
            _check_blocks("dst_blocks", dst_blocks)
            _check_blocks("src_blocks", src_blocks)
            self._move(api, write=False, blocks=True, local_id=dst_id, remote_cluster=cluster_id,
                       remote_id=cache_id, local_blocks=dst_blocks, remote_blocks=src_blocks,
                       src_range=src_range, dst_range=dst_range, tnpl=ext[2])
            return _DONE
        except BaseException as exc:  # as _call: every failure becomes a status
            return _code(exc), f"{type(exc).__name__}: {exc}", None

    @staticmethod
    def _check_push_src(api: EngineApi, src_id: int, ext: tuple) -> tuple:
        if api.live(src_id).placement != Placement.DEVICE:
            raise _invalid("only support push from a device cache")
        return _check_ext(ext[0], ext[1], ext[2], True)

    @_call
    def push_cache(self, src_id: int, dst: tuple, src_batch: int, size: int, ext: tuple) -> None:
        dd, api = self._engine()
        self._check_role(_PUSHERS, "PushKvCache")
        if size != -1:
            raise _invalid(f"invalid size ({size}), size only support -1 currently")
        src_range, dst_range = self._check_push_src(api, src_id, ext)
        cluster_id, cache_id, dst_batch = dst
        self._move(api, write=True, blocks=False, local_id=src_id, remote_cluster=cluster_id, remote_id=cache_id,
                   local_unit=src_batch, remote_unit=dst_batch, size=-1, src_range=src_range, dst_range=dst_range,
                   tnpl=ext[2])

    @_call
    def push_blocks(self, src_id: int, dst: tuple, src_blocks: list, dst_blocks: list, ext: tuple) -> None:
        dd, api = self._engine()
        self._check_role(_PUSHERS, "PushKvBlocks")
        cluster_id, cache_id, dst_batch = dst
        src_range, dst_range = self._check_push_src(api, src_id, ext)
        if not src_blocks:
            raise _invalid("src_blocks is empty, push from non-block cache is not supported yet")
        if len(src_blocks) != len(dst_blocks):
            raise _invalid(f"number of src_blocks ({len(src_blocks)}) mismatches that of dst_blocks "
                           f"({len(dst_blocks)})")
        if dst_batch != 0:
            raise _invalid(f"invalid dst_cache_index.batch_index ({dst_batch}), only 0 is supported in push block")
        self._move(api, write=True, blocks=True, local_id=src_id, remote_cluster=cluster_id, remote_id=cache_id,
                   local_blocks=_check_blocks("src_blocks", src_blocks),
                   remote_blocks=_check_blocks("dst_blocks", dst_blocks),
                   src_range=src_range, dst_range=dst_range, tnpl=ext[2])

    # ------------------------------------------------------------------ local copies
    @_call
    def copy_cache(self, src_id: int, dst_id: int, src_batch: int, dst_batch: int, offset: int, size: int) -> None:
        dd, api = self._engine()
        if size != -1 and size <= 0:
            raise _invalid(f"size ({size}) is invalid, should be = -1 or > 0")
        api.copy_cache(src_id, dst_id, src_batch, dst_batch, offset, size)

    @_call
    def copy_blocks(self, src_id: int, dst_id: int, src_blocks: list, dst_lists: list) -> None:
        dd, api = self._engine()
        api.live(src_id)   # an unknown cache first, as upstream
        api.live(dst_id)
        if not src_blocks:
            raise _invalid("src_blocks can not be empty")
        if not dst_lists:
            raise _invalid("dst_blocks_list can not be empty")
        api.copy_blocks(src_id, dst_id, src_blocks, dst_lists)


def make(cluster_id: int, role: int) -> Bridge:
    return Bridge(cluster_id, role)
