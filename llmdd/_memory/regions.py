"""The region table: every registered or allocated range of memory of this engine.

One region per tensor of a cache.  Regions never overlap (checked on add, with
``bisect`` over the sorted starts).  Listeners are told about every change
(``"add"``, ``"remove"``, ``"remap"``) with the regions concerned and the new
``version``: the control plane announces descriptor updates to linked peers
from these notifications and transports (re-)register the memory.

Listeners run after the table's lock is released, in the caller's thread; one
that raises is logged and does not break the table.  A caller that holds a lock of its own
(the memory manager) passes ``defer``: the change is then handed to it as a record to deliver once
that lock is released too (see :mod:`llmdd._memory.outbox`).
"""

from __future__ import annotations

import bisect
import itertools
import threading
from typing import Any, Callable, Iterable, Optional, Sequence

import attrs

from llmdd._base.backing import SharedSegment
from llmdd._base.enums import Placement
from llmdd._base.log import get_logger
from llmdd._base.status import LLMException, LLMStatusCode
from llmdd._memory.copy import Bounds
from llmdd._seam.abc import MemRegion

__all__ = ["Region", "RegionSpec", "RegionTable", "RegionListener"]

_log = get_logger("llmdd.memory")

_MAX_REGION_ID = 2**32 - 1


@attrs.frozen(kw_only=True)
class Region:
    """One registered or allocated range: ``[addr, addr + size)``."""

    region_id: int
    cache_id: int
    tensor_index: int
    addr: int
    size: int
    placement: Placement
    remote_accessible: bool
    owned: bool                   # True: drawn from an llmdd pool; False: the caller's memory
    backing: Optional[SharedSegment] = None  # the pool segment holding it (same-host peers map it)
    generation: int = 0           # bumped by every remap of the region

    @property
    def end(self) -> int:
        return self.addr + self.size

    def to_mem_region(self):
        """The transport seam's view of this region (:class:`llmdd._seam.abc.MemRegion`)."""
        return MemRegion(region_id=self.region_id, addr=self.addr, size=self.size,
                         remote_accessible=self.remote_accessible, placement=int(self.placement),
                         backing=self.backing)


@attrs.frozen(kw_only=True)
class RegionSpec:
    """What :meth:`RegionTable.add_many` needs to create a region."""

    cache_id: int
    tensor_index: int
    addr: int
    size: int
    placement: Placement
    remote_accessible: bool
    owned: bool
    backing: Optional[SharedSegment] = None


#: ``listener(kind, regions, version)`` with kind ``"add"``, ``"remove"`` or ``"remap"``
RegionListener = Callable[[str, tuple, int], None]
#: receives a change notice to deliver later, outside the caller's locks
Defer = Callable[[Callable[[], None]], Any]


def _invalid(msg: str) -> LLMException:
    return LLMException(msg, status_code=LLMStatusCode.LLM_PARAM_INVALID)


class RegionTable:
    """Registered/allocated regions, indexed by id, by cache and by address."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._regions: dict[int, Region] = {}
        self._by_cache: dict[int, list[int]] = {}
        self._starts: list[int] = []    # sorted starts of non-empty regions
        self._start_ids: list[int] = []  # region id at the same position
        self._version = 0
        self._bounds: Optional[Bounds] = None
        self._bounds_version = -1
        self._listeners: list[RegionListener] = []

    # ---------------------------------------------------------------- listeners
    def add_listener(self, listener: RegionListener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: RegionListener) -> None:
        with self._lock:
            try:
                self._listeners.remove(listener)
            except ValueError:
                pass

    def _publish(self, kind: str, regions: tuple, version: int, defer: Optional[Defer]) -> None:
        """Outside the table's lock: tell listeners now, or hand the notice to ``defer``."""
        if defer is not None:
            defer(lambda: self._notify(kind, regions, version))
        else:
            self._notify(kind, regions, version)

    def _notify(self, kind: str, regions: tuple, version: int) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(kind, regions, version)
            except Exception as exc:  # noqa: BLE001 - a listener cannot break the table
                _log.warning("llmdd.memory.region_listener_failed", kind=kind, error=repr(exc))

    # ---------------------------------------------------------------- queries
    @property
    def version(self) -> int:
        return self._version

    def __len__(self) -> int:
        return len(self._regions)

    def get(self, region_id: int) -> Region:
        """The region with this id; ``LLMException(LLM_PARAM_INVALID)`` when unknown."""
        try:
            return self._regions[region_id]
        except KeyError:
            raise _invalid(f"region {region_id} is not registered") from None

    def regions(self) -> list[Region]:
        """All regions, by address."""
        with self._lock:
            empty = [r for r in self._regions.values() if r.size == 0]
            return [self._regions[i] for i in self._start_ids] + empty

    def regions_of(self, cache_id: int) -> list[Region]:
        """The regions of a cache, by tensor index."""
        with self._lock:
            return [self._regions[i] for i in self._by_cache.get(cache_id, ())]

    def _find_overlap(self, addr: int, size: int) -> Optional[Region]:
        if size <= 0:
            return None
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0:
            r = self._regions[self._start_ids[i]]
            if r.end > addr:
                return r
        if i + 1 < len(self._starts) and self._starts[i + 1] < addr + size:
            return self._regions[self._start_ids[i + 1]]
        return None

    def find_overlap(self, addr: int, size: int) -> Optional[Region]:
        """A region overlapping ``[addr, addr+size)``, if any."""
        with self._lock:
            return self._find_overlap(addr, size)

    def contains(self, addr: int, length: int) -> Optional[Region]:
        """The region holding all of ``[addr, addr+length)``, or None."""
        with self._lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            if i < 0:
                return None
            r = self._regions[self._start_ids[i]]
            return r if addr + length <= r.end and length >= 0 else None

    def bounds(self) -> Bounds:
        """Every region as vectorised :class:`~llmdd._memory.copy.Bounds` (cached per version)."""
        with self._lock:
            if self._bounds is None or self._bounds_version != self._version:
                self._bounds = Bounds.from_ranges((r.addr, r.size) for r in
                                                  (self._regions[i] for i in self._start_ids))
                self._bounds_version = self._version
            return self._bounds

    # ---------------------------------------------------------------- changes
    def add(self, **spec) -> Region:
        """Add one region (keywords of :class:`RegionSpec`)."""
        return self.add_many([RegionSpec(**spec)])[0]

    def add_many(self, specs: Iterable[RegionSpec], *, defer: Optional[Defer] = None) -> list[Region]:
        """Add regions atomically: all or none (``LLM_PARAM_INVALID`` on any overlap)."""
        specs = list(specs)
        for s in specs:
            if s.addr < 0 or s.size < 0 or s.addr + s.size > 2**64:
                raise _invalid(f"invalid region addr={s.addr:#x} size={s.size}")
        # overlaps among the new regions themselves
        new = sorted((s.addr, s.addr + s.size, k) for k, s in enumerate(specs) if s.size > 0)
        for (_, e0, k0), (a1, _, k1) in zip(new, new[1:]):
            if a1 < e0:
                raise _invalid(f"address ranges overlap: tensor {specs[k0].tensor_index} and tensor "
                               f"{specs[k1].tensor_index}")
        with self._lock:
            for s in specs:
                other = self._find_overlap(s.addr, s.size)
                if other is not None:
                    raise _invalid(f"address range [{s.addr:#x}, +{s.size}) overlaps region {other.region_id} "
                                   f"of cache {other.cache_id} [{other.addr:#x}, +{other.size})")
            added = []
            for s in specs:
                rid = next(self._ids)
                if rid > _MAX_REGION_ID:
                    raise LLMException("region ids exhausted", status_code=LLMStatusCode.LLM_FAILED)
                r = Region(region_id=rid, **attrs.asdict(s, recurse=False))
                self._regions[rid] = r
                self._by_cache.setdefault(r.cache_id, []).append(rid)
                if r.size > 0:
                    i = bisect.bisect_left(self._starts, r.addr)
                    self._starts.insert(i, r.addr)
                    self._start_ids.insert(i, rid)
                added.append(r)
            for lst in self._by_cache.values():
                lst.sort(key=lambda rid: self._regions[rid].tensor_index)
            self._version += 1
            version = self._version
        self._publish("add", tuple(added), version, defer)
        return added

    def remove(self, region_id: int) -> Region:
        return self.remove_many([region_id])[0]

    def remove_many(self, region_ids: Iterable[int], *, defer: Optional[Defer] = None) -> list[Region]:
        with self._lock:
            removed = self._remove_many_locked(list(region_ids))
            version = self._version
        self._publish("remove", tuple(removed), version, defer)
        return removed

    def _remove_many_locked(self, region_ids: list) -> list[Region]:
        for rid in region_ids:
            self.get(rid)
        removed = [self._remove_locked(rid) for rid in region_ids]
        self._version += 1
        return removed

    def remove_cache(self, cache_id: int, *, defer: Optional[Defer] = None) -> list[Region]:
        """Remove every region of a cache (none: nothing happens)."""
        return self._remove_selected(lambda: self._by_cache.get(cache_id, ()), defer)

    def _remove_selected(self, select: Callable[[], Iterable[int]], defer: Optional[Defer]) -> list[Region]:
        """Remove the region ids ``select()`` gives (read under the lock); nothing: no notice."""
        with self._lock:
            ids = list(select())
            if not ids:
                return []
            removed = self._remove_many_locked(ids)
            version = self._version
        self._publish("remove", tuple(removed), version, defer)
        return removed

    def _remove_locked(self, rid: int) -> Region:
        r = self._regions.pop(rid)
        lst = self._by_cache.get(r.cache_id)
        if lst is not None:
            lst.remove(rid)
            if not lst:
                del self._by_cache[r.cache_id]
        if r.size > 0:
            i = bisect.bisect_left(self._starts, r.addr)
            while self._start_ids[i] != rid:
                i += 1
            del self._starts[i]
            del self._start_ids[i]
        return r

    def remap(self, ranges: Iterable[tuple[int, int]], *, placement: Optional[Placement] = None,
              defer: Optional[Defer] = None) -> list[Region]:
        """Mark the regions holding each ``(addr, size)`` range as remapped.

        Every range must lie inside one region (of ``placement`` when given), else
        ``LLM_PARAM_INVALID`` and nothing changes.  Each affected region gets a new
        ``generation``; listeners receive ``"remap"`` so transports re-register it.
        """
        ranges = list(ranges)
        with self._lock:
            hit: dict[int, Region] = {}
            for addr, size in ranges:
                r = self.contains(addr, size)
                if r is None or size <= 0:
                    raise _invalid(f"memory [{addr:#x}, +{size}) is not inside registered memory")
                if placement is not None and r.placement != placement:
                    raise _invalid(f"memory [{addr:#x}, +{size}) is registered as {r.placement}, "
                                   f"not {placement}")
                hit[r.region_id] = r
            updated = []
            for rid, r in hit.items():
                nr = attrs.evolve(r, generation=r.generation + 1)
                self._regions[rid] = nr
                updated.append(nr)
            self._version += 1
            version = self._version
        self._publish("remap", tuple(updated), version, defer)
        return updated

    def clear(self, *, defer: Optional[Defer] = None) -> list[Region]:
        """Remove everything (engine finalize)."""
        return self._remove_selected(lambda: self._regions, defer)
