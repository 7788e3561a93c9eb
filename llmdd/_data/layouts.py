"""Cache layouts: this engine's caches and the peers' as the planner sees them, and the placement rules.

:class:`Layouts` turns a local cache record, or a peer's cache table entry and regions, into the
planner's :class:`~llmdd._data.planner.CacheLayout` (cached while the record, or the peer's table
versions, stay the same), resolves a key the puller can resolve alone (ids, blocks keys) to the
owner's cache, and checks the contract's D2D/D2H/H2D rules before a byte moves (asking a peer for
its memory pools once per link).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Callable, Union

from llmdd._base.enums import Placement
from llmdd._base.options import EngineOptions
from llmdd._base.status import LLMException, LLMStatusCode
from llmdd._base.types import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex
from llmdd._protocol import messages as m
from llmdd._data.owner import device_pool_bytes
from llmdd._data.planner import CacheLayout
from llmdd._protocol.port import ControlPort, LinkView, RequestOp

if TYPE_CHECKING:
    from llmdd._memory.manager import CacheRecord, MemoryManager

__all__ = ["Layouts", "RemoteKey"]

#: a key naming a peer's cache: by request or prefix id, by cache id and batch index, or a blocks key
RemoteKey = Union[CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey]

S = LLMStatusCode


def _err(msg: str, code: LLMStatusCode) -> LLMException:
    return LLMException(msg, status_code=code)


class Layouts:
    """The layouts of local and remote caches, and the placement rules, for one engine."""

    def __init__(self, *, port: ControlPort, memory: "MemoryManager", options: EngineOptions,
                 timeout_s: float, clock: Callable[[], float]) -> None:
        self._lm = port
        self._clock = clock   # the runtime's monotonic clock (deadlines)
        self._memory = memory
        self._options = options
        self.timeout_s = timeout_s
        self._layouts: dict[tuple[int, int], tuple[int, CacheLayout]] = {}
        # each link's peer's pools and profile, asked once per link (this plane's, not the link record's:
        # a relinked peer is a new link and is asked again)
        self._peer_info: weakref.WeakKeyDictionary[LinkView, dict] = weakref.WeakKeyDictionary()
        self._local_layouts: dict[int, tuple["CacheRecord", tuple, CacheLayout]] = {}
        self._blocks_refs: dict[int, m.KeyRef] = {}  # model_id -> KeyRef of its blocks key (immutable)

    def local_layout(self, cache_id: int) -> tuple["CacheRecord", CacheLayout]:
        rec = self._memory.get(cache_id)
        if rec is None or not rec.live:
            raise _err(f"local cache {cache_id} does not exist", S.LLM_KV_CACHE_NOT_EXIST)
        # cached per cache: valid while the engine holds the same record with the same regions
        # tuple (re-registration makes a new record, a region change a new tuple)
        hit = self._local_layouts.get(cache_id)
        if hit is not None and hit[0] is rec and hit[1] is rec.regions:
            return rec, hit[2]
        regions = sorted(rec.regions, key=lambda r: r.tensor_index)
        layout = CacheLayout(cache_id=cache_id, region_ids=tuple(r.region_id for r in regions),
                             tensor_size=rec.tensor_size, units=rec.rows, is_blocks=rec.is_blocks)
        if len(self._local_layouts) > 4096:
            self._local_layouts.clear()
        self._local_layouts[cache_id] = (rec, rec.regions, layout)
        return rec, layout

    def remote_layout(self, link: LinkView, cache_id: int) -> CacheLayout:
        version = link.tables.cache_table_version * 1_000_003 + link.tables.regions_version
        key = (id(link), cache_id)
        hit = self._layouts.get(key)
        if hit is not None and hit[0] == version:
            return hit[1]
        entry = link.tables.cache(cache_id)
        if entry is None:
            raise _err(f"cache {cache_id} does not exist on cluster {link.peer_cluster_id}",
                       S.LLM_KV_CACHE_NOT_EXIST)
        region_ids = []
        for addr in entry.addrs:
            region = link.tables.find_region(addr, entry.tensor_size)
            # a region the owner does not grant (remote-accessible mode) reads as absent, so the
            # answer does not reveal that such a cache exists (reliability.md S6)
            if region is None or region.addr != addr or not region.remote_accessible:
                raise _err(f"cache {cache_id} of cluster {link.peer_cluster_id} is not registered for remote "
                           f"access", S.LLM_KV_CACHE_NOT_EXIST)
            region_ids.append(region.region_id)
        units = int(entry.shape[0]) if entry.shape else 1
        layout = CacheLayout(cache_id=cache_id, region_ids=tuple(region_ids), tensor_size=entry.tensor_size,
                             units=max(units, 1), is_blocks=entry.is_blocks)
        if len(self._layouts) > 4096:
            self._layouts.clear()
        self._layouts[key] = (version, layout)
        return layout

    def resolve_remote(self, link: LinkView, key: RemoteKey) -> tuple[int, int]:
        """(cache_id, batch_index) of a remote key without the owner's help (ids and blocks keys)."""
        if isinstance(key, CacheKeyByIdAndIndex):
            return key.cache_id, key.batch_index
        if isinstance(key, BlocksCacheKey):
            ref = self._blocks_refs.get(key.model_id)
            if ref is None:
                ref = m.KeyRef.for_blocks(key.model_id)
                if len(self._blocks_refs) > 4096:
                    self._blocks_refs.clear()
                self._blocks_refs[key.model_id] = ref
            entry = link.tables.lookup_key(ref)
            if entry is None:
                raise _err(f"no blocks cache with model_id {key.model_id} on cluster {link.peer_cluster_id}",
                           S.LLM_KV_CACHE_NOT_EXIST)
            return entry.cache_id, 0
        raise TypeError(f"unsupported key type {type(key)}")

    # ------------------------------------------------------------------ device memory rules
    MIN_HOST_SIDE_DEVICE_POOL = 100 * 1024 * 1024

    def _peer_device_pool_bytes(self, link: LinkView) -> int:
        info = self._peer_info.get(link)
        if info is None:
            status, info = self._lm.request(link, RequestOp.ENGINE_INFO, {},
                                            deadline=self._clock() + self.timeout_s)
            if status != 0:
                raise _err(f"cluster {link.peer_cluster_id} did not describe its memory pools", S.LLM_FAILED)
            self._peer_info[link] = info
        return int(info.get("device_pool_bytes", 0))

    def check_placements(self, link: LinkView, *, remote_cache_id: int, local_rec: "CacheRecord", local_is: str, kind: str,
                          remote_is_blocks: bool) -> None:
        """The contract's D2D/D2H/H2D rules, checked before a byte moves.

        * host -> device ``pull_blocks`` only between two blocks caches;
        * D2H and H2D transfers need a device memory pool of at least 100 MB on the side that holds
          the host cache (that side stages the copy on an NPU; llmdd keeps the rule so that code
          tested here keeps working on hardware).
        """
        entry = link.tables.cache(remote_cache_id)
        if entry is None:
            return
        local_place, remote_place = local_rec.placement, Placement(entry.placement)
        src_place, dst_place = (remote_place, local_place) if local_is == "dst" else (local_place, remote_place)
        if src_place == dst_place:
            return
        if (kind == "pull_blocks" and src_place == Placement.HOST and dst_place == Placement.DEVICE
                and not remote_is_blocks):
            raise _err("pull_blocks from a host cache into a device cache needs both to be blocks caches",
                       S.LLM_PARAM_INVALID)
        host_is_local = local_place == Placement.HOST
        pool = device_pool_bytes(self._options) if host_is_local else self._peer_device_pool_bytes(link)
        if pool < self.MIN_HOST_SIDE_DEVICE_POOL:
            where = "this engine" if host_is_local else f"cluster {link.peer_cluster_id}"
            raise _err(f"{'D2H' if dst_place == Placement.HOST else 'H2D'} transfer: {where} holds the host cache "
                       f"and needs a device memory pool (mem_pool_cfg) of at least 100 MB, it has {pool} bytes",
                       S.LLM_PARAM_INVALID)
