"""The memory manager: pools, the cache table, the key table and the region table of one engine.

Theory of operation
-------------------
* **Pools.** ``llm.MemPoolConfig`` configures the DEVICE pool and
  ``llm.HostMemPoolConfig`` the HOST pool (JSON parsed by
  :func:`llmdd._base.config.parse_mem_pool_cfg`; a bad config fails ``init`` with
  ``LLM_PARAM_INVALID``).  A configured pool is created **on demand, at the
  first allocation** from it: an engine that configures a pool it never uses
  reserves no memory, and a pool that cannot be created (``/dev/shm`` too small)
  fails that allocation with ``LLM_OUT_OF_MEMORY``.
* **Caches.** Cache ids start at 1 and increase for every successful
  ``allocate`` or ``register`` (one counter, as the C++ engine; a failed call
  consumes no id).  Each cache is a :class:`CacheRecord` with its lifecycle
  (``Lifecycle(Machine.CACHE)``: ``allocate``/``register``, ``keys_changed``,
  ``defer_release``, ``keys_released``, ``deallocate``, ``unregister``,
  ``finalize``) and one region per tensor in the :class:`RegionTable`.
* **Keys.** A ``CacheKey`` is stored under its lookup index
  (``(req_id or prefix_id, model_id)``) -> ``(cache_id, batch_index)``; a
  duplicate index is ``LLM_PARAM_INVALID``; the padding key (index
  ``2**64-1``) only holds its batch slot.  A ``BlocksCacheKey`` maps
  ``model_id`` -> ``cache_id``; a later registration with the same ``model_id``
  overwrites the mapping (one blocks cache per model_id, as the C++ engine).
* **Deferred release.** Deallocating an allocated cache still referenced by
  ``CacheKey``s only marks it (``RELEASE_PENDING``); its memory is freed when the
  last key is removed (:meth:`MemoryManager.remove_key`) or consumed by a
  successful pull (:meth:`MemoryManager.consume_key`).  Keys of *registered*
  caches are never consumed or removed (the memory is the caller's); they go
  with ``unregister``.
* **Trust.** Geometry (addresses, sizes, strides) always comes from the record,
  never from a caller's ``Cache`` object.
* **No upcalls under the lock.** Every change is decided under ``_lock``; what it causes (cache
  lifecycle events to subscribers, region notices to transports, the "tables changed" notice from
  which the control plane announces to peers) is recorded in an :class:`~.outbox.Outbox` and
  delivered, in order, after ``_lock`` is released; a mutating method returns once its records have
  been delivered.  ``_lock`` is therefore a leaf for every other component: they may call into the
  manager while holding their own locks, and the manager never calls out while holding its own.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, TypeVar, Union, cast

import attrs

from llmdd._base.backing import SharedSegment
from llmdd._base.config import parse_mem_pool_cfg
from llmdd._base.enums import Placement
from llmdd._lifecycle.machines import Lifecycle, Tracked
from llmdd._lifecycle.tables import CACHE_HOLDS_MEMORY, CACHE_RELEASE_PENDING, CacheState
from llmdd._base.log import get_logger
from llmdd._base.status import LLMException, LLMStatusCode
from llmdd._base.types import BlocksCacheKey, CacheDesc, CacheKey, cache_key_index
from llmdd._base.validation import INVALID_ID
from llmdd._memory.backend import MemoryBackend, backend_for
from llmdd._memory.copy import Bounds
from llmdd._memory.outbox import Outbox
from llmdd._runtime.runtime import Threads
from llmdd._memory.pool import PagePool
from llmdd._memory.regions import Region, RegionSpec, RegionTable
from llmdd._memory.segments import reclaim_leftovers

__all__ = ["MemoryManager", "CacheRecord", "OPT_MEM_POOL", "OPT_HOST_MEM_POOL"]

_log = get_logger("llmdd.memory")

#: "0"/"false"/"off": this engine leaves crash leftovers in /dev/shm alone (``llmdd doctor`` uses it to
#: list them without removing them); default: reclaim at init
OPT_RECLAIM_SHM = "llmdd.reclaim_leftover_shm"
OPT_MEM_POOL = "llm.MemPoolConfig"
OPT_HOST_MEM_POOL = "llm.HostMemPoolConfig"

KeyIndex = tuple  # (id, model_id)


def _invalid(msg: str) -> LLMException:
    return LLMException(msg, status_code=LLMStatusCode.LLM_PARAM_INVALID)


_F = TypeVar("_F", bound=Callable[..., Any])


def _publishes(method: _F) -> _F:
    """A mutating method: once it has released ``_lock``, deliver what it recorded (even when it raised)."""
    @functools.wraps(method)
    def wrapper(self: "MemoryManager", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        finally:
            self._outbox.flush()
    return wrapper  # type: ignore[return-value]  # functools.wraps keeps the signature


@attrs.define(eq=False, kw_only=True)
class CacheRecord:
    """The engine's trusted view of one cache."""

    cache_id: int
    desc: CacheDesc
    addrs: tuple          # one address per tensor
    tensor_size: int      # bytes of one tensor (desc.size at creation)
    rows: int             # shape[0]: batch size (non-blocks) or number of blocks
    placement: Placement
    owned: bool           # allocated from a pool (True) or registered caller memory
    is_blocks: bool
    remote_accessible: bool
    tracked: Tracked
    regions: tuple = ()
    keys: set = attrs.field(factory=set)  # CacheKey lookup indices bound to this cache
    blocks_model_id: Optional[int] = None
    pool_addrs: tuple = ()

    @property
    def stride(self) -> int:
        """Bytes of one batch slot (non-blocks) or one block (blocks)."""
        return self.tensor_size // self.rows if self.rows > 0 else 0

    @property
    def state(self) -> CacheState:
        # cast: Tracked.state is typed Enum for every machine; a CacheRecord's Tracked runs the cache
        # machine, whose states are CacheState members
        return cast(CacheState, self.tracked.state)

    @property
    def live(self) -> bool:
        """Usable by local operations: not released and not waiting for release."""
        return self.tracked.in_(CACHE_HOLDS_MEMORY)

    @property
    def release_pending(self) -> bool:
        """Deallocated while keys still reference it (released when the last key goes)."""
        return self.tracked.in_(CACHE_RELEASE_PENDING)

    def bounds(self) -> Bounds:
        return Bounds.from_ranges((a, self.tensor_size) for a in self.addrs)


class MemoryManager:
    """Pools, caches, keys and regions of one engine (built by ``init``, closed by ``finalize``)."""

    def __init__(self, *, caches: Lifecycle,
                 device_pool: Optional[tuple[int, int]] = None,
                 host_pool: Optional[tuple[int, int]] = None,
                 backends: Optional[Mapping[Placement, MemoryBackend]] = None,
                 threads: Optional[Threads] = None) -> None:
        self._caches_lc = caches
        self._pool_cfg: dict[Placement, Optional[tuple[int, int]]] = {
            Placement.DEVICE: device_pool, Placement.HOST: host_pool}
        self._backends = dict(backends or {})
        self._pools: dict[Placement, PagePool] = {}
        self._lock = threading.RLock()
        self._next_id = 1
        self._records: dict[int, CacheRecord] = {}
        self._keys: dict[KeyIndex, tuple[int, int]] = {}
        self._blocks_keys: dict[int, int] = {}
        self._reserved: dict[KeyIndex, tuple[int, int]] = {}
        self._change_listeners: list = []
        self._coverage: dict[KeyIndex, set] = {}
        self.regions = RegionTable()
        self._closed = False
        self._outbox = Outbox("memory", threads)
        self._defer = self._outbox.record

    @classmethod
    def from_options(cls, options: Mapping[str, str], *, caches: Lifecycle,
                     backends: Optional[Mapping[Placement, MemoryBackend]] = None,
                     threads: Optional[Threads] = None) -> "MemoryManager":
        """Pools from ``llm.MemPoolConfig`` (DEVICE) and ``llm.HostMemPoolConfig`` (HOST); empty = none.

        An engine's memory starts by reclaiming the shared-memory segments crashed llmdd processes
        left behind (:mod:`llmdd._memory.segments`: same user, same pid namespace, creator gone).
        """
        reclaim = (options.get(OPT_RECLAIM_SHM) or "1").strip().lower() not in ("0", "false", "off", "no")
        reclaimed = reclaim_leftovers() if reclaim else []
        if reclaimed:
            _log.info("llmdd.memory.leftovers_reclaimed", segments=len(reclaimed),
                      bytes=sum(left.size for left in reclaimed), pids=sorted({left.pid for left in reclaimed}))
        dev = options.get(OPT_MEM_POOL) or ""
        host = options.get(OPT_HOST_MEM_POOL) or ""
        return cls(caches=caches,
                   device_pool=parse_mem_pool_cfg(dev, "mem_pool_cfg") if dev else None,
                   host_pool=parse_mem_pool_cfg(host, "host_mem_pool_cfg") if host else None,
                   backends=backends, threads=threads)

    # ------------------------------------------------------------------ pools
    def has_pool(self, placement: Placement) -> bool:
        return self._pool_cfg.get(placement) is not None

    def pool(self, placement: Placement) -> PagePool:
        """The pool of ``placement``, created on first use (``LLM_PARAM_INVALID`` when not configured)."""
        with self._lock:
            self._check_open()
            pool = self._pools.get(placement)
            if pool is None:
                cfg = self._pool_cfg.get(placement)
                if cfg is None:
                    raise _invalid(f"no memory pool is configured for {placement}")
                backend = self._backends.get(placement) or backend_for(placement)
                pool = PagePool(cfg[0], cfg[1], backend)
                self._pools[placement] = pool
                _log.info("llmdd.memory.pool_created", placement=placement.name, bytes=pool.size,
                          page_size=pool.page_size, backend=backend.describe().get("kind"))
            return pool

    def existing_pool(self, placement: Placement) -> Optional[PagePool]:
        return self._pools.get(placement)

    def _check_open(self) -> None:
        if self._closed:
            raise LLMException("memory manager is closed (engine finalized)",
                               status_code=LLMStatusCode.LLM_ENGINE_FINALIZED)

    # ------------------------------------------------------------------ keys
    def _key_indices(self, keys: Sequence[CacheKey], rows: int) -> list[tuple[KeyIndex, int]]:
        """``(index, batch_index)`` of the non-padding keys; checks count and duplicates."""
        if len(keys) > rows:
            raise _invalid(f"cache_keys size ({len(keys)}) is bigger than batch size ({rows})")
        out: list[tuple[KeyIndex, int]] = []
        seen: set = set()
        for batch_index, key in enumerate(keys):
            index = cache_key_index(key)
            if index[0] == INVALID_ID:
                continue  # padding key: its batch slot stays without a key
            if index in seen or index in self._keys:
                raise _invalid(f"cache key {key!r} already exists")
            seen.add(index)
            out.append((index, batch_index))
        return out

    def resolve_index(self, index: KeyIndex) -> Optional[tuple[CacheRecord, int]]:
        """``(record, batch_index)`` for a key's lookup index (BlocksCacheKey: batch index 0)."""
        with self._lock:
            if index[0] == INVALID_ID:
                cache_id = self._blocks_keys.get(index[1])
                rec = self._records.get(cache_id) if cache_id is not None else None
                return (rec, 0) if rec is not None and rec.live else None
            hit = self._keys.get(tuple(index))
            if hit is None:
                return None
            rec = self._records.get(hit[0])
            return (rec, hit[1]) if rec is not None else None

    def resolve_key(self, key: Union[CacheKey, BlocksCacheKey]) -> Optional[tuple[CacheRecord, int]]:
        return self.resolve_index(cache_key_index(key))

    @_publishes
    def consume_key(self, index: KeyIndex) -> bool:
        """A successful pull by ``CacheKey`` consumed the key (allocated caches only).

        Returns True when the key existed.  The last key of a deallocated cache frees it.
        """
        with self._lock:
            index = tuple(index)
            hit = self._keys.get(index)
            if hit is None:
                return False
            rec = self._records[hit[0]]
            if not rec.owned:
                return True  # registered memory: keys stay until unregister
            self._drop_key_locked(rec, index, reason="consumed")
            return True

    @_publishes
    def reserve_key(self, index: KeyIndex) -> Optional[tuple[int, int]]:
        """A peer starts pulling by ``CacheKey``: take the key out of the table (a second puller
        sees ``LLM_KV_CACHE_NOT_EXIST``) while keeping the cache alive until
        :meth:`finish_reserved`.  Registered caches keep their keys.  None when unknown."""
        with self._lock:
            index = tuple(index)
            hit = self._keys.get(index)
            if hit is None:
                return None
            rec = self._records.get(hit[0])
            if rec is None:
                return None
            if rec.owned:
                del self._keys[index]
                self._reserved[index] = hit
                self._changed()
            return hit

    @_publishes
    def finish_reserved(self, index: KeyIndex, tensors: Optional[Iterable[int]], *, pulled: bool) -> None:
        """End a reservation: a successful pull of ``tensors`` (None = all) consumes the key once every
        tensor has been pulled (layer-wise pulls); a failed pull puts the key back."""
        with self._lock:
            index = tuple(index)
            hit = self._reserved.pop(index, None)
            if hit is None:
                return
            rec = self._records.get(hit[0])
            if rec is None:
                return
            if pulled:
                covered = self._coverage.setdefault(index, set())
                covered.update(range(len(rec.addrs)) if tensors is None else tensors)
                if len(covered) >= len(rec.addrs):
                    self._coverage.pop(index, None)
                    self._keys[index] = hit
                    self._drop_key_locked(rec, index, reason="consumed")
                    return
            self._keys[index] = hit
            self._changed()

    @_publishes
    def remove_key(self, index: KeyIndex) -> bool:
        """``remove_cache_key``: unknown key or registered cache -> no-op. True when removed."""
        with self._lock:
            index = tuple(index)
            hit = self._keys.get(index)
            if hit is None:
                return False
            rec = self._records[hit[0]]
            if not rec.owned:
                return False
            self._drop_key_locked(rec, index, reason="removed")
            return True

    def _drop_key_locked(self, rec: CacheRecord, index: KeyIndex, reason: str) -> None:
        del self._keys[index]
        rec.keys.discard(index)
        if rec.release_pending and not rec.keys:
            rec.tracked.fire("keys_released", defer=self._defer, cache_id=rec.cache_id, reason=reason)
            self._release_locked(rec)
        else:
            rec.tracked.fire("keys_changed", defer=self._defer, cache_id=rec.cache_id, reason=reason, keys=len(rec.keys))
            self._changed()

    # ------------------------------------------------------------------ caches
    def add_change_listener(self, listener) -> None:
        """``listener()`` is called after every change of the cache, key or region tables, once the
        tables are consistent again (the control plane announces them to linked peers from there)."""
        self._change_listeners.append(listener)

    def remove_change_listener(self, listener) -> None:
        if listener in self._change_listeners:
            self._change_listeners.remove(listener)

    def _changed(self) -> None:
        """Under ``_lock``: the tables changed; listeners hear it after the lock is released."""
        self._outbox.record(self._notify_change, coalesce=True)

    def _notify_change(self) -> None:
        for listener in list(self._change_listeners):
            try:
                listener()
            except Exception as exc:  # a listener must not corrupt the tables
                _log.error("llmdd.memory.change_listener_failed", error=repr(exc))

    def key_items(self) -> list[tuple[KeyIndex, tuple[int, int]]]:
        """Snapshot of the CacheKey table: ``(index, (cache_id, batch_index))`` pairs."""
        with self._lock:
            return list(self._keys.items())

    def get(self, cache_id: int) -> Optional[CacheRecord]:
        return self._records.get(cache_id)

    def next_cache_id(self) -> int:
        """The id the next cache made here will get, unless another one is made first (a caller that
        keys a cache by its own id checks the id it got and makes it again otherwise)."""
        return self._next_id

    def live(self, cache_id: int) -> CacheRecord:
        """The live record of ``cache_id``; ``LLM_KV_CACHE_NOT_EXIST`` when unknown or released."""
        rec = self._records.get(cache_id)
        if rec is None or not rec.live:
            raise LLMException(f"cache {cache_id} does not exist", status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
        return rec

    def records(self) -> list[CacheRecord]:
        with self._lock:
            return list(self._records.values())

    def _new_record(self, desc: CacheDesc, addrs: Sequence[int], *, owned: bool, is_blocks: bool,
                    remote_accessible: bool, keys: Sequence[CacheKey], blocks_key: Optional[BlocksCacheKey],
                    pool: Optional[PagePool]) -> CacheRecord:
        """Under the lock: regions, record, keys; rolls back the regions on failure."""
        size = desc.size
        rows = desc.shape[0]
        key_slots = self._key_indices(keys, rows) if keys else []
        cache_id = self._next_id
        specs = [RegionSpec(cache_id=cache_id, tensor_index=i, addr=a, size=size, placement=desc.placement,
                            remote_accessible=remote_accessible, owned=owned,
                            backing=SharedSegment(name=pool.segment.name, offset=pool.offset_of(a))
                            if pool is not None else None)
                 for i, a in enumerate(addrs)]
        regions = self.regions.add_many(specs, defer=self._defer)
        try:
            tracked = self._caches_lc.create(cache_id, cache_id=cache_id, placement=desc.placement.name,
                                             blocks=is_blocks, owned=owned)
            tracked.fire("allocate" if owned else "register", defer=self._defer, cache_id=cache_id, tensors=len(addrs),
                         bytes=size * len(addrs))
        except BaseException:
            self.regions.remove_many((r.region_id for r in regions), defer=self._defer)
            raise
        self._next_id += 1
        rec = CacheRecord(cache_id=cache_id, desc=desc, addrs=tuple(addrs), tensor_size=size, rows=rows,
                          placement=desc.placement, owned=owned, is_blocks=is_blocks,
                          remote_accessible=remote_accessible, tracked=tracked, regions=tuple(regions),
                          pool_addrs=tuple(addrs) if owned else ())
        self._records[cache_id] = rec
        for index, batch_index in key_slots:
            self._keys[index] = (cache_id, batch_index)
            rec.keys.add(index)
        if blocks_key is not None:
            rec.blocks_model_id = blocks_key.model_id
            previous = self._blocks_keys.get(blocks_key.model_id)
            if previous is not None and previous != cache_id:
                _log.info("llmdd.memory.blocks_key_overwritten", model_id=blocks_key.model_id,
                          previous_cache_id=previous, cache_id=cache_id)
            self._blocks_keys[blocks_key.model_id] = cache_id
        self._changed()
        return rec

    @_publishes
    def register_cache(self, desc: CacheDesc, addrs: Sequence[int], *, keys: Sequence[CacheKey] = (),
                       blocks_key: Optional[BlocksCacheKey] = None, remote_accessible: bool,
                       is_blocks: bool) -> CacheRecord:
        """Register caller memory (one address per tensor, ``desc.size`` bytes each)."""
        if desc.num_tensors != len(addrs):
            raise _invalid(f"num_tensors ({desc.num_tensors}) is not equal to the number of addrs ({len(addrs)})")
        if any(a <= 0 for a in addrs):
            raise _invalid("addr can not be zero")
        with self._lock:
            self._check_open()
            return self._new_record(desc, addrs, owned=False, is_blocks=is_blocks,
                                    remote_accessible=remote_accessible, keys=keys, blocks_key=blocks_key,
                                    pool=None)

    @_publishes
    def allocate_cache(self, desc: CacheDesc, *, keys: Sequence[CacheKey] = (),
                       blocks_key: Optional[BlocksCacheKey] = None, is_blocks: bool) -> CacheRecord:
        """Allocate ``num_tensors`` tensors of ``desc.size`` bytes from the pool of ``desc.placement``."""
        with self._lock:
            self._check_open()
            if keys:
                self._key_indices(keys, desc.shape[0])  # refuse bad keys before touching the pool
            size = desc.size
            pool = self.pool(desc.placement)
            addrs: list[int] = []
            try:
                for _ in range(desc.num_tensors):
                    addrs.append(pool.allocate(size))
                return self._new_record(desc, addrs, owned=True, is_blocks=is_blocks, remote_accessible=True,
                                        keys=keys, blocks_key=blocks_key, pool=pool)
            except BaseException:
                for a in addrs:
                    pool.free(a)
                raise

    @_publishes
    def deallocate_cache(self, cache_id: int) -> bool:
        """Drop the id reference of an allocated cache; returns True when freed now.

        Unknown id (or already deallocated): success, nothing happens.  A registered
        cache is ``LLM_PARAM_INVALID`` (use ``unregister_cache``).
        """
        with self._lock:
            self._check_open()
            rec = self._records.get(cache_id)
            if rec is None or rec.release_pending:
                return False
            if not rec.owned:
                raise _invalid(f"cache {cache_id} is registered memory, unregister it instead")
            self._drop_blocks_key_locked(rec)
            if rec.keys:
                rec.tracked.fire("defer_release", defer=self._defer, cache_id=cache_id, keys=len(rec.keys))
                return False
            rec.tracked.fire("deallocate", defer=self._defer, cache_id=cache_id)
            self._release_locked(rec)
            return True

    @_publishes
    def unregister_cache(self, cache_id: int) -> bool:
        """Forget registered memory; unknown id: success. An allocated cache is ``LLM_PARAM_INVALID``."""
        with self._lock:
            self._check_open()
            rec = self._records.get(cache_id)
            if rec is None:
                return False
            if rec.owned:
                raise _invalid(f"cache {cache_id} was allocated, deallocate it instead")
            for index in list(rec.keys):
                self._keys.pop(index, None)
            rec.keys.clear()
            self._drop_blocks_key_locked(rec)
            rec.tracked.fire("unregister", defer=self._defer, cache_id=cache_id)
            self._release_locked(rec)
            return True

    def _drop_blocks_key_locked(self, rec: CacheRecord) -> None:
        if rec.blocks_model_id is not None and self._blocks_keys.get(rec.blocks_model_id) == rec.cache_id:
            del self._blocks_keys[rec.blocks_model_id]

    def _release_locked(self, rec: CacheRecord) -> None:
        """Remove regions and record; give pool memory back. The lifecycle has already moved."""
        self._records.pop(rec.cache_id, None)
        self.regions.remove_cache(rec.cache_id, defer=self._defer)
        if rec.owned:
            pool = self._pools.get(rec.placement)
            if pool is not None and not pool.closed:
                for a in rec.pool_addrs:
                    pool.free(a)
        self._changed()

    # ------------------------------------------------------------------ remap
    @_publishes
    def remap(self, ranges: Iterable[tuple[int, int]]) -> list[Region]:
        """``remap_registered_memory``: mark device regions remapped and tell listeners (transports)."""
        with self._lock:
            self._check_open()
            updated = self.regions.remap(list(ranges), placement=Placement.DEVICE, defer=self._defer)
            for cache_id in sorted({r.cache_id for r in updated}):
                rec = self._records.get(cache_id)
                if rec is not None:
                    rec.tracked.offer("remapped", defer=self._defer, cache_id=cache_id,
                                      regions=[r.region_id for r in updated if r.cache_id == cache_id])
            self._changed()
            return updated

    # ------------------------------------------------------------------ teardown
    @property
    def closed(self) -> bool:
        return self._closed

    @_publishes
    def close(self) -> None:
        """Release everything: every cache goes through ``finalize``, pools are unlinked. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            records = list(self._records.values())
            self._records.clear()
            self._keys.clear()
            self._blocks_keys.clear()
            errors = []
            for rec in records:
                try:
                    rec.tracked.offer("finalize", defer=self._defer, cache_id=rec.cache_id)
                except Exception as exc:  # noqa: BLE001 - finalize is silent
                    errors.append(exc)
                rec.keys.clear()
            try:
                self.regions.clear(defer=self._defer)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
            pools = list(self._pools.values())
            self._pools.clear()
        self._outbox.flush()  # transports forget the regions before their memory goes
        for pool in pools:
            try:
                pool.close()
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
        for err in errors:
            _log.warning("llmdd.memory.close_error", error=repr(err))

    # ------------------------------------------------------------------ observability
    def statistics(self) -> dict:
        with self._lock:
            states: dict[str, int] = {}
            for rec in self._records.values():
                states[rec.state.value] = states.get(rec.state.value, 0) + 1
            return {
                "caches": states,
                "cache_keys": len(self._keys),
                "blocks_keys": len(self._blocks_keys),
                "regions": len(self.regions),
                "regions_version": self.regions.version,
                "registered_bytes": sum(r.size for r in self.regions.regions() if not r.owned),
                "pools": {p.name: (self._pools[p].statistics().as_dict() if p in self._pools else
                                   {"configured": self._pool_cfg[p] is not None, "created": False})
                          for p in (Placement.DEVICE, Placement.HOST)},
                "closed": self._closed,
            }
