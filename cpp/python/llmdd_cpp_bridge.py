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
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Optional

import attrs

import llmdd
from llmdd import (BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMException,
                   LLMRole, LLMStatusCode, Placement)
from llmdd._memory.copy import as_index_array, block_copy_ops, execute, slot_copy_ops
from llmdd._data.planner import plan_blocks, plan_cache, tensor_range
from llmdd._data.port import RequestOp
from llmdd._control.protocol import messages as _m
from llmdd._data.notices import READ as _READ
from llmdd._data.quick import QuickPlan as _QuickPlan

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
        self._caches: dict[int, Any] = {}  # cache id -> llmdd Cache (allocated ones)
        self._flipped: dict[int, tuple] = {}
        self._plans: dict[tuple, _QuickPlan] = {}  # kept per-shape plans of block transfers (_move)
        # the last ext of pull_blocks that passed _check_ext: (ext, src_range, dst_range, the ranges
        # as the plan key holds them); C++ passes the same tuple object while the ext is the same
        # (a tuple of ints: its check cannot change), and this reference keeps that object alive
        self._pull_ext: Optional[tuple] = None
        self._lock = threading.Lock()
        self._starting = False
        self._switch_role = False
        self._alloc_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    def _engine(self):
        dd = self.dd
        if dd is None or dd._core is None:
            raise _Fail(FAILED, NOT_INITIALIZED)
        return dd, dd._core

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
            dd, self.dd = self.dd, None
            self._caches.clear()
            self._flipped.clear()
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
    def link(self, clusters: list, timeout_ms: int) -> list:
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
    def unlink(self, clusters: list, timeout_ms: int, force: bool) -> list:
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

    def _with_own_key(self, core, make, drop):
        """A cache made under ``BlocksCacheKey(cluster_id, model_id=<its own id>)``, so that Python
        peers pull its blocks by that key.  The id is the memory manager's next one: C++ calls make
        caches one at a time (``_alloc_lock``); should anything else take that id first, the cache
        is dropped and made again."""
        with self._alloc_lock:
            for _ in range(8):
                cache_id = core.memory._next_id
                cache = make(BlocksCacheKey(self.cluster_id, cache_id))
                if cache.cache_id == cache_id:
                    return cache
                drop(cache)
        raise _Fail(FAILED, "could not give a cache its own id as its key (concurrent allocations)")

    @_call
    def allocate(self, desc: tuple) -> tuple:
        dd, core = self._engine()
        cd = self._desc(desc)
        cm = dd.cache_manager
        cache = self._with_own_key(core, lambda key: cm.allocate_blocks_cache(cd, key), cm.deallocate_blocks_cache)
        self._caches[cache.cache_id] = cache
        return cache.cache_id, list(cache.tensor_addrs)

    @_call
    def deallocate(self, cache_id: int) -> None:
        dd, core = self._engine()
        cache = self._caches.pop(cache_id, None)
        if cache is None:
            rec = core.memory.get(cache_id)
            if rec is not None and rec.live and not rec.owned:
                raise _invalid(f"cache {cache_id} is registered, not allocated: use UnregisterKvCache")
            return  # unknown or already released: success
        dd.cache_manager.deallocate_blocks_cache(cache)

    @_call
    def register(self, desc: tuple, addrs: list) -> int:
        dd, core = self._engine()
        if not addrs:
            raise _invalid("addrs cannot be empty")
        placement, num_tensors, _, _ = desc
        if len(addrs) != num_tensors:
            raise _invalid(f"addrs length:{len(addrs)} should be equal to num_tensors:{num_tensors}")
        if any(a == 0 for a in addrs):
            raise _invalid("addr cannot be nullptr")
        cd = self._desc(desc)
        cm = dd.cache_manager
        cache = self._with_own_key(core, lambda key: cm.register_blocks_cache(cd, list(addrs), key, True),
                                   lambda c: cm.unregister_cache(c.cache_id))
        return cache.cache_id

    @_call
    def unregister(self, cache_id: int) -> None:
        dd, core = self._engine()
        rec = core.memory.get(cache_id)
        if rec is not None and rec.live and rec.owned:
            raise _invalid(f"cache {cache_id} is allocated, not registered: use DeallocateCache")
        dd.cache_manager.unregister_cache(cache_id)

    # ------------------------------------------------------------------ transfers
    def _check_role(self, allowed: tuple, call: str) -> None:
        if self.role not in allowed:
            who = " or ".join(_ROLE_NAMES[r] for r in allowed)
            raise _invalid(f"{call} is only supported by a {who}; this LlmDataDist is a {_ROLE_NAMES[self.role]}")

    def _as(self, layout, blocks: bool):
        """``layout`` planned as a blocks (or non-blocks) cache: same geometry, other kind."""
        if layout.is_blocks == blocks:
            return layout
        hit = self._flipped.get(id(layout))
        if hit is not None and hit[0] is layout:
            return hit[1]
        other = attrs.evolve(layout, is_blocks=blocks)
        if len(self._flipped) > 4096:
            self._flipped.clear()
        self._flipped[id(layout)] = (layout, other)
        return other

    @staticmethod
    def _remote_layout(core, te, link, cache_id: int):
        """The peer's cache ``cache_id`` from its announced tables. A cache the peer made after the
        link reaches this side in an update that may still be on its way: on a miss, one round trip
        with the peer (its answer follows every update it sent before) and a second look."""
        try:
            return te.remote_layout(link, cache_id)
        except LLMException as exc:
            if exc.status_code is not S.LLM_KV_CACHE_NOT_EXIST:
                raise
        core.link_manager.request(link, RequestOp.ENGINE_INFO, {}, deadline=time.monotonic() + te.timeout_s)
        return te.remote_layout(link, cache_id)

    def _move(self, core, *, write: bool, blocks: bool, local_id: int, remote_cluster: int, remote_id: int,
              local_unit: int = 0, remote_unit: int = 0, size: int = -1, local_blocks=None, remote_blocks=None,
              src_range=None, dst_range=None, tnpl: int = 2) -> None:
        if remote_cluster == self.cluster_id:
            raise _invalid(f"data can not be moved between cluster {remote_cluster} and itself")
        te = core.transfers
        kind = ("push_blocks" if write else "pull_blocks") if blocks else ("push_cache" if write else "pull_cache")
        rec, local = te.local_layout(local_id)
        link = te.link_for(remote_cluster)
        # Block transfers keep what depends only on their shape (the engine's small-transfer plan:
        # layouts, placement rules, tensor ranges, regions) per (direction, link, local cache, remote
        # cache, layer ranges, tnpl), valid while the peer's tables, the local record and its regions
        # are the same objects and versions, the conditions under which the engine keeps its own.
        plan = pk = None
        if blocks:
            pk = (write, id(link), local_id, remote_id,
                  None if src_range is None else (src_range.start, src_range.stop),
                  None if dst_range is None else (dst_range.start, dst_range.stop), tnpl)
            plan = self._plans.get(pk)
            tables = link.tables
            if plan is not None and not (plan.link is link and plan.tables is tables and plan.rec is rec
                                         and plan.regions is rec.regions
                                         and plan.cv == tables.cache_table_version
                                         and plan.rv == tables.regions_version):
                plan = None
        sb, db = (local_blocks, remote_blocks) if write else (remote_blocks, local_blocks)
        if plan is not None:
            ops, nbytes = plan.ops(sb, db)
            dst_tensors = plan.dst_tensors
        else:
            nbytes = None
            tables = link.tables  # the versions a kept plan is valid for: read before the layouts
            cv, rv = tables.cache_table_version, tables.regions_version
            remote = self._remote_layout(core, te, link, remote_id)
            te.layouts.check_placements(link, remote_cache_id=remote_id, local_rec=rec, local_is="src" if write else "dst",
                                 kind=kind, remote_is_blocks=True if blocks else remote.is_blocks)
            local, remote = self._as(local, blocks), self._as(remote, blocks)
            src, dst = (local, remote) if write else (remote, local)
            src_tensors = tensor_range(src_range, src.num_tensors, tnpl)
            dst_tensors = tensor_range(dst_range, dst.num_tensors, tnpl)
            side = "src" if write else "dst"
            if blocks:
                ops = plan_blocks(src=src, dst=dst, src_blocks=sb, dst_blocks=db, src_tensors=src_tensors,
                                  dst_tensors=dst_tensors, local=side)
                if len(self._plans) > 4096:
                    self._plans.clear()
                kept = _QuickPlan(link, tables, rec, remote_id, src, dst, src_tensors, dst_tensors, write)
                kept.cv, kept.rv = cv, rv
                self._plans[pk] = kept
            else:
                su, du = (local_unit, remote_unit) if write else (remote_unit, local_unit)
                ops = plan_cache(src=src, dst=dst, src_tensors=src_tensors, dst_tensors=dst_tensors, src_unit=su,
                                 dst_unit=du, size=size, local=side)
        te._busy.acquire(link)
        try:
            te.run_ops(link, ops, write=write, kind=kind, nbytes=nbytes)
        except LLMException:
            if write:
                te._notices.push_done(link, remote_id, remote_blocks, dst_tensors, failed=True)
            raise
        finally:
            link.transfer_lock.release()
        if write:
            te._notices.push_done(link, remote_id, remote_blocks, dst_tensors, failed=False)
        else:
            te._notices.queue(link, (_READ, int(remote_id), tuple(remote_blocks) if remote_blocks else None))

    @_call
    def pull_cache(self, src: tuple, dst_id: int, batch_index: int, size: int, ext: tuple) -> None:
        dd, core = self._engine()
        self._check_role(_PULLERS, "PullKvCache")
        if size != -1 and size <= 0:
            raise _invalid(f"invalid size ({size}), size must = -1 or > 0")
        src_range, dst_range = _check_ext(ext[0], ext[1], ext[2], False)
        cluster_id, cache_id, src_batch = src
        self._move(core, write=False, blocks=False, local_id=dst_id, remote_cluster=cluster_id, remote_id=cache_id,
                   local_unit=batch_index, remote_unit=src_batch, size=size, src_range=src_range,
                   dst_range=dst_range, tnpl=ext[2])

    def pull_blocks(self, src: tuple, dst_id: int, src_blocks: list, dst_blocks: list, ext: tuple) -> tuple:
        """PullKvBlocks.  Not wrapped by ``_call`` (one Python frame less per call) but answering as
        it does: the same checks in the same order, every failure a status.  A pull whose kept
        plan is valid (the conditions of ``_move``) runs the steps of ``_move`` inline, as the
        engine's own small-transfer path does; anything else goes through ``_move``."""
        try:
            dd = self.dd
            core = None if dd is None else dd._core
            if core is None:
                raise _Fail(FAILED, NOT_INITIALIZED)
            if self.role not in _PULLERS:
                self._check_role(_PULLERS, "PullKvBlocks")
            cluster_id, cache_id, src_batch = src
            if src_batch != 0:
                raise _invalid(f"invalid src_cache_index.batch_index ({src_batch}), only 0 is supported in pull "
                               f"block")
            hit = self._pull_ext
            if hit is None or hit[0] is not ext:  # identity: an equal tuple of other types is checked anew
                src_range, dst_range = _check_ext(ext[0], ext[1], ext[2], False)
                hit = (ext, src_range, dst_range,
                       None if src_range is None else (src_range.start, src_range.stop),
                       None if dst_range is None else (dst_range.start, dst_range.stop))
                self._pull_ext = hit
            _, src_range, dst_range, src_key, dst_key = hit
            tnpl = ext[2]
            if not src_blocks:
                raise _invalid("src_blocks is empty, pull from non-block cache is not supported yet")
            if len(src_blocks) != len(dst_blocks):
                raise _invalid(f"number of src_blocks ({len(src_blocks)}) mismatches that of dst_blocks "
                               f"({len(dst_blocks)})")
            _check_blocks("dst_blocks", dst_blocks)
            _check_blocks("src_blocks", src_blocks)
            te = core.transfers
            rec = core.memory.get(dst_id) if te is not None and cluster_id != self.cluster_id else None
            if rec is not None and rec.live:
                link = te.link_for(cluster_id)
                plan = self._plans.get((False, id(link), dst_id, cache_id, src_key, dst_key, tnpl))
                tables = link.tables
                if (plan is not None and plan.link is link and plan.tables is tables and plan.rec is rec
                        and plan.regions is rec.regions and plan.cv == tables.cache_table_version
                        and plan.rv == tables.regions_version):
                    ops, nbytes = plan.ops(src_blocks, dst_blocks)
                    te._busy.acquire(link)
                    try:
                        te.run_ops(link, ops, write=False, kind="pull_blocks", nbytes=nbytes)
                    finally:
                        link.transfer_lock.release()
                    te._notices.queue(link, (_READ, int(cache_id), tuple(src_blocks)))
                    return _DONE
            self._move(core, write=False, blocks=True, local_id=dst_id, remote_cluster=cluster_id,
                       remote_id=cache_id, local_blocks=dst_blocks, remote_blocks=src_blocks,
                       src_range=src_range, dst_range=dst_range, tnpl=tnpl)
            return _DONE
        except BaseException as exc:  # as _call: every failure becomes a status
            return _code(exc), f"{type(exc).__name__}: {exc}", None

    @staticmethod
    def _check_push_src(core, src_id: int, ext: tuple):
        if core.memory.live(src_id).placement != Placement.DEVICE:
            raise _invalid("only support push from a device cache")
        return _check_ext(ext[0], ext[1], ext[2], True)

    @_call
    def push_cache(self, src_id: int, dst: tuple, src_batch: int, size: int, ext: tuple) -> None:
        dd, core = self._engine()
        self._check_role(_PUSHERS, "PushKvCache")
        if size != -1:
            raise _invalid(f"invalid size ({size}), size only support -1 currently")
        src_range, dst_range = self._check_push_src(core, src_id, ext)
        cluster_id, cache_id, dst_batch = dst
        self._move(core, write=True, blocks=False, local_id=src_id, remote_cluster=cluster_id, remote_id=cache_id,
                   local_unit=src_batch, remote_unit=dst_batch, size=-1, src_range=src_range, dst_range=dst_range,
                   tnpl=ext[2])

    @_call
    def push_blocks(self, src_id: int, dst: tuple, src_blocks: list, dst_blocks: list, ext: tuple) -> None:
        dd, core = self._engine()
        self._check_role(_PUSHERS, "PushKvBlocks")
        cluster_id, cache_id, dst_batch = dst
        src_range, dst_range = self._check_push_src(core, src_id, ext)
        if not src_blocks:
            raise _invalid("src_blocks is empty, push from non-block cache is not supported yet")
        if len(src_blocks) != len(dst_blocks):
            raise _invalid(f"number of src_blocks ({len(src_blocks)}) mismatches that of dst_blocks "
                           f"({len(dst_blocks)})")
        if dst_batch != 0:
            raise _invalid(f"invalid dst_cache_index.batch_index ({dst_batch}), only 0 is supported in push block")
        self._move(core, write=True, blocks=True, local_id=src_id, remote_cluster=cluster_id, remote_id=cache_id,
                   local_blocks=_check_blocks("src_blocks", src_blocks),
                   remote_blocks=_check_blocks("dst_blocks", dst_blocks),
                   src_range=src_range, dst_range=dst_range, tnpl=ext[2])

    # ------------------------------------------------------------------ local copies
    @_call
    def copy_cache(self, src_id: int, dst_id: int, src_batch: int, dst_batch: int, offset: int, size: int) -> None:
        dd, core = self._engine()
        if size != -1 and size <= 0:
            raise _invalid(f"size ({size}) is invalid, should be = -1 or > 0")
        s, d = core.memory.live(src_id), core.memory.live(dst_id)
        if s.desc.num_tensors != d.desc.num_tensors:
            raise _invalid(f"src num_tensors:{s.desc.num_tensors} and dst num_tensors:{d.desc.num_tensors} "
                           f"must be equal")
        if src_batch >= s.rows:
            raise _invalid(f"src_batch_index:{src_batch} must be in [0, {s.rows})")
        if dst_batch >= d.rows:
            raise _invalid(f"dst_batch_index:{dst_batch} must be in [0, {d.rows})")
        if offset >= s.stride:
            raise _invalid(f"offset:{offset} must be less than the src batch stride {s.stride}")
        length = s.stride - offset if size == -1 else size
        if offset + length > s.stride or offset + length > d.stride:
            raise _invalid(f"offset + size ({offset + length}) exceeds a batch stride (src {s.stride}, "
                           f"dst {d.stride})")
        ops = slot_copy_ops(s.addrs, d.addrs, src_batch * s.stride + offset, dst_batch * d.stride + offset, length)
        execute(ops, src_bounds=s.bounds(), dst_bounds=d.bounds())

    @_call
    def copy_blocks(self, src_id: int, dst_id: int, src_blocks: list, dst_lists: list) -> None:
        dd, core = self._engine()
        s, d = core.memory.live(src_id), core.memory.live(dst_id)
        if s.desc.num_tensors != d.desc.num_tensors:
            raise _invalid(f"src num_tensors:{s.desc.num_tensors} and dst num_tensors:{d.desc.num_tensors} "
                           f"must be equal")
        if s.stride != d.stride:
            raise _invalid(f"block sizes differ: src {s.stride} bytes, dst {d.stride} bytes")
        if not src_blocks:
            raise _invalid("src_blocks can not be empty")
        if not dst_lists:
            raise _invalid("dst_blocks_list can not be empty")
        src_idx = as_index_array(src_blocks, "src block", s.rows)
        plans = []
        for i, dst_blocks in enumerate(dst_lists):
            if len(dst_blocks) != len(src_blocks):
                raise _invalid(f"dst_blocks_list[{i}] has {len(dst_blocks)} blocks, src_blocks {len(src_blocks)}")
            plans.append(block_copy_ops(s.addrs, d.addrs, s.stride, src_idx,
                                        as_index_array(dst_blocks, f"dst_blocks_list[{i}] block", d.rows)))
        for ops in plans:  # every list is checked before the first byte moves
            execute(ops, src_bounds=s.bounds(), dst_bounds=d.bounds())


def make(cluster_id: int, role: int) -> Bridge:
    return Bridge(cluster_id, role)
