"""Sans-io descriptor-table bookkeeping of a link: what a peer announced, and what this side announces.

After the handshake (:mod:`llmdd._protocol.handshake`), each side announces its memory with
:class:`TableAnnouncer` and applies the peer's announcements to a :class:`DescriptorTables`:
versions only move forward (a delta carries exactly ``last + 1``, a full snapshot anything newer),
and a rejected update changes nothing and raises :class:`TableUpdateError`.  What one peer may make
this side hold is bounded (``MAX_PEER_*``).
"""

from __future__ import annotations

import bisect
from typing import Any, Iterable, Optional, TypeVar

import msgspec

from llmdd._base.status import LLMStatusCode, LocalUsageError
from llmdd._protocol import messages as m
from llmdd._protocol.codec import ProtocolError

__all__ = ["TableUpdateError", "DescriptorTables", "TableAnnouncer"]


class TableUpdateError(ProtocolError):
    """A RegionsUpdate / CacheTableUpdate that is stale, out of sequence or inconsistent."""


def _check_version(kind: str, current: int, version: int, full: bool) -> None:
    if full:
        if version <= current:
            raise TableUpdateError(f"{kind} snapshot version {version} is not newer than {current}")
    elif version != current + 1:
        what = "stale or repeated" if version <= current else "out of sequence (missing updates)"
        raise TableUpdateError(f"{kind} update version {version} is {what}; expected {current + 1}")


def _unique(kind: str, items: Iterable) -> set:
    seen: set = set()
    for item in items:
        if item in seen:
            raise TableUpdateError(f"{kind} {item!r} listed twice in one update")
        seen.add(item)
    return seen


#: what one peer may announce (its tables are held per link, so these bound the memory a peer can
#: make this engine hold, whatever it sends): regions (one per tensor), caches and CacheKeys
MAX_PEER_REGIONS = 1 << 17
MAX_PEER_CACHES = 1 << 16
MAX_PEER_KEYS = 1 << 18
#: tensor addresses over all of a peer's caches (each is one of its tensor regions, so a correct
#: peer never announces more than it has regions): one cache of 2**20 addresses per update used to
#: make this side hold ~40 MiB more each time, without end
MAX_PEER_CACHE_ADDRS = MAX_PEER_REGIONS
#: a region's per-transport descriptor, MessagePack-encoded, and all of a peer's together (the
#: built-in transports describe a region in well under 1 KiB)
MAX_REGION_DESCRIPTOR_BYTES = 16 * 1024
MAX_PEER_DESCRIPTOR_BYTES = 16 * 1024 * 1024   # what one full snapshot frame (the default frame limit) carries
_encode_descriptor = msgspec.msgpack.Encoder().encode
#: up to this many region changes in one update are applied to the address index one by one
_INDEX_ONE_BY_ONE = 16


class DescriptorTables:
    """The peer's regions, caches and keys for one peer incarnation, as announced.

    :meth:`apply` validates an update completely before changing anything.  Lookups are what the
    data plane needs: ``cache(cache_id)`` for ``CacheKeyByIdAndIndex``, ``lookup_key(KeyRef)``
    for ``CacheKey`` / ``BlocksCacheKey``, ``find_region(addr, length)`` for bounds checks.
    """

    def __init__(self) -> None:
        self._regions_version = 0
        self._cache_version = 0
        self._regions: dict[int, m.RegionDescriptor] = {}
        self._caches: dict[int, m.CacheEntry] = {}
        self._keys: dict[m.KeyRef, m.KeyEntry] = {}
        self._by_addr: list[tuple[int, int]] = []  # sorted (addr, region_id)
        self._max_size = 0
        self._keys_of: dict[int, set] = {}  # cache id -> its keys
        self._addr_total = 0                      # tensor addresses over all caches (MAX_PEER_CACHE_ADDRS)
        self._desc_bytes: dict[int, int] = {}     # region id -> encoded size of its transports descriptor
        self._desc_total = 0                      # their sum (MAX_PEER_DESCRIPTOR_BYTES)

    # -- state
    @property
    def regions_version(self) -> int:
        return self._regions_version

    @property
    def cache_table_version(self) -> int:
        return self._cache_version

    @property
    def regions(self) -> dict:
        return dict(self._regions)

    @property
    def caches(self) -> dict:
        return dict(self._caches)

    @property
    def keys(self) -> dict:
        return dict(self._keys)

    # -- lookups
    def region(self, region_id: int) -> Optional[m.RegionDescriptor]:
        return self._regions.get(region_id)

    def cache(self, cache_id: int) -> Optional[m.CacheEntry]:
        return self._caches.get(cache_id)

    def lookup_key(self, key: m.KeyRef) -> Optional[m.KeyEntry]:
        return self._keys.get(key)

    def find_region(self, addr: int, length: int) -> Optional[m.RegionDescriptor]:
        """The region holding all of ``[addr, addr + length)``, or None."""
        i = bisect.bisect_right(self._by_addr, (addr, m.U32_MAX + 1)) - 1
        while i >= 0:
            start, rid = self._by_addr[i]
            if addr - start >= self._max_size:  # no earlier region reaches addr
                break
            region = self._regions[rid]
            if region.contains(addr, length):
                return region
            i -= 1
        return None

    # -- updates
    def apply(self, update: m.RegionsUpdate | m.CacheTableUpdate) -> None:
        if isinstance(update, m.RegionsUpdate):
            self._apply_regions(update)
        elif isinstance(update, m.CacheTableUpdate):
            self._apply_cache_table(update)
        else:
            raise LocalUsageError(f"not a table update: {type(update).__name__}",
                                  status_code=LLMStatusCode.LLM_PARAM_INVALID)

    def _apply_regions(self, u: m.RegionsUpdate) -> None:
        # validated completely first; then applied in place, so the work is proportional to the
        # update's size (a peer's small updates never make this side copy its whole table)
        _check_version("regions", self._regions_version, u.version, u.full)
        added_ids = _unique("region", (r.region_id for r in u.added))
        removed = _unique("removed region", u.removed)
        if u.full:
            if removed:
                raise TableUpdateError("a regions snapshot removes nothing")
            if len(added_ids) > MAX_PEER_REGIONS:
                raise TableUpdateError(f"{len(added_ids)} regions exceed the {MAX_PEER_REGIONS} a peer may announce")
        else:
            for rid in removed:
                if rid not in self._regions:
                    raise TableUpdateError(f"removed region {rid} is unknown")
            for rid in added_ids:
                if rid in self._regions and rid not in removed:
                    raise TableUpdateError(f"region {rid} is already announced")
            if len(self._regions) - len(removed) + len(added_ids) > MAX_PEER_REGIONS:
                raise TableUpdateError(f"the update would exceed the {MAX_PEER_REGIONS} regions a peer may announce")
        # what the regions' descriptors weigh, checked before anything changes
        sizes = {}
        for r in u.added:
            size = len(_encode_descriptor(r.transports)) if r.transports else 0
            if size > MAX_REGION_DESCRIPTOR_BYTES:
                raise TableUpdateError(f"region {r.region_id}'s transport descriptor takes {size} bytes, more than the "
                                       f"{MAX_REGION_DESCRIPTOR_BYTES} a peer may announce per region")
            sizes[r.region_id] = size
        kept = 0 if u.full else self._desc_total - sum(self._desc_bytes.get(rid, 0) for rid in removed)
        if kept + sum(sizes.values()) > MAX_PEER_DESCRIPTOR_BYTES:
            raise TableUpdateError(f"the update would exceed the {MAX_PEER_DESCRIPTOR_BYTES} bytes of region "
                                   f"descriptors a peer may announce")
        if u.full:
            self._regions = {}
            self._by_addr = []
            self._max_size = 0
            self._desc_bytes = {}
        # the sorted address index: a few changes one by one (bisect), more by one pass (a filter,
        # one sort of the table plus the sorted additions: two runs, merged in linear time); one by
        # one for all of them cost a memmove of the index per entry, quadratic in a peer's snapshot
        # (1.8 s of CPU for a 2.2 MB snapshot of 131,072 regions in descending address order)
        gone = [self._regions.pop(rid) for rid in removed]
        if len(gone) <= _INDEX_ONE_BY_ONE:
            for r in gone:
                del self._by_addr[bisect.bisect_left(self._by_addr, (r.addr, r.region_id))]
        else:
            self._by_addr = [e for e in self._by_addr if e[1] not in removed]
        for rid in removed:
            self._desc_bytes.pop(rid, None)
        for r in u.added:
            self._regions[r.region_id] = r
            self._max_size = max(self._max_size, r.size)
        self._desc_bytes.update(sizes)
        self._desc_total = kept + sum(sizes.values())
        if len(u.added) <= _INDEX_ONE_BY_ONE:
            for r in u.added:
                bisect.insort(self._by_addr, (r.addr, r.region_id))
        else:
            self._by_addr.extend(sorted((r.addr, r.region_id) for r in u.added))
            self._by_addr.sort()
        if removed:  # the largest size may have gone (only a removal costs a scan)
            self._max_size = max((r.size for r in self._regions.values()), default=0)
        self._regions_version = u.version

    def _apply_cache_table(self, u: m.CacheTableUpdate) -> None:
        _check_version("cache table", self._cache_version, u.version, u.full)
        added_caches = _unique("cache", (c.cache_id for c in u.caches_added))
        removed_caches = _unique("removed cache", u.caches_removed)
        added_keys = _unique("key", (e.key for e in u.keys_added))
        removed_keys = _unique("removed key", u.keys_removed)
        caches = {} if u.full else self._caches
        keys = {} if u.full else self._keys
        if u.full:
            if removed_caches or removed_keys:
                raise TableUpdateError("a cache-table snapshot removes nothing")
        else:
            for cid in removed_caches:
                if cid not in caches:
                    raise TableUpdateError(f"removed cache {cid} is unknown")
            for cid in added_caches:
                if cid in caches and cid not in removed_caches:
                    raise TableUpdateError(f"cache {cid} is already announced")
            for key in removed_keys:
                if key not in keys:
                    raise TableUpdateError(f"removed key {key} is unknown")
        if len(caches) - len(removed_caches) + len(added_caches) > MAX_PEER_CACHES:
            raise TableUpdateError(f"the update would exceed the {MAX_PEER_CACHES} caches a peer may announce")
        addr_total = ((0 if u.full else self._addr_total - sum(len(caches[cid].addrs) for cid in removed_caches))
                      + sum(len(c.addrs) for c in u.caches_added))
        if addr_total > MAX_PEER_CACHE_ADDRS:
            raise TableUpdateError(f"the update would exceed the {MAX_PEER_CACHE_ADDRS} tensor addresses a peer's "
                                   f"caches may hold")
        # keys of a removed cache go with it: found through the cache-to-keys index, never by a scan
        dropped = set(removed_keys)
        for cid in removed_caches:
            dropped.update(self._keys_of.get(cid, ()))
        for e in u.keys_added:
            if e.key in keys and e.key not in dropped:
                raise TableUpdateError(f"key {e.key} is already bound")
            if e.cache_id not in added_caches and (e.cache_id not in caches or e.cache_id in removed_caches):
                raise TableUpdateError(f"key {e.key} refers to unknown cache {e.cache_id}")
        if len(keys) - len(dropped) + len(added_keys) > MAX_PEER_KEYS:
            raise TableUpdateError(f"the update would exceed the {MAX_PEER_KEYS} keys a peer may announce")
        # valid: apply in place (work proportional to the update)
        if u.full:
            self._caches, self._keys, self._keys_of = {}, {}, {}
        for key in dropped:
            e = self._keys.pop(key)
            owned = self._keys_of.get(e.cache_id)
            if owned is not None:
                owned.discard(key)
                if not owned:
                    del self._keys_of[e.cache_id]
        for cid in removed_caches:
            del self._caches[cid]
        for c in u.caches_added:
            self._caches[c.cache_id] = c
        for e in u.keys_added:
            self._keys[e.key] = e
            self._keys_of.setdefault(e.cache_id, set()).add(e.key)
        self._addr_total = addr_total
        self._cache_version = u.version


#: a table update this side announces (regions or caches and keys)
_Update = TypeVar("_Update", m.RegionsUpdate, m.CacheTableUpdate)


class TableAnnouncer:
    """Builds this side's outgoing table updates with the right versions.

    It mirrors what the peer will hold (a :class:`DescriptorTables` fed with every update it
    builds), so an update the peer would reject is refused here with ``LocalUsageError``.
    """

    def __init__(self) -> None:
        self._mirror = DescriptorTables()

    @property
    def announced(self) -> DescriptorTables:
        """What the peer holds once it has applied everything built so far (read-only use)."""
        return self._mirror

    def _commit(self, update: _Update) -> _Update:
        try:
            self._mirror.apply(update)
        except TableUpdateError as exc:
            raise LocalUsageError(str(exc), status_code=LLMStatusCode.LLM_PARAM_INVALID) from None
        return update

    def regions_update(self, *, added: Iterable[m.RegionDescriptor] = (), removed: Iterable[int] = (),
                       full: bool = False) -> m.RegionsUpdate:
        return self._commit(m.RegionsUpdate(version=self._mirror.regions_version + 1, full=full,
                                            added=tuple(added), removed=tuple(removed)))

    def cache_table_update(self, *, caches_added: Iterable[m.CacheEntry] = (), caches_removed: Iterable[int] = (),
                           keys_added: Iterable[m.KeyEntry] = (), keys_removed: Iterable[m.KeyRef] = (),
                           full: bool = False) -> m.CacheTableUpdate:
        return self._commit(m.CacheTableUpdate(version=self._mirror.cache_table_version + 1, full=full,
                                               caches_added=tuple(caches_added), caches_removed=tuple(caches_removed),
                                               keys_added=tuple(keys_added), keys_removed=tuple(keys_removed)))
