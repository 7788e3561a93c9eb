"""``CacheManager``: the contract's cache API (spec section 7), local operations.

Argument checks follow the contract (``TypeError`` for a wrong type,
``ValueError`` for an integer out of range, ``LLMException(LLM_PARAM_INVALID)``
for a semantic violation, ``LLMException(LLM_ENGINE_FINALIZED)`` (a ``RuntimeError``
saying "llm datadist is not initialized") once the engine was finalized), then the call is translated to the memory
manager.  Every copy takes its geometry from the engine's cache table (or, for
a ``Cache.create_cpu_cache``, from that cache's own ``CacheDesc``) and is
checked against those bounds before a byte moves.

Remote operations (pull/push/transfer) delegate to the data plane (``_transfer.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple, Union

from llmdd._base.enums import Memtype, Placement
from llmdd._api.cache_manager_remote import RemoteOperations, _check_blocks
from llmdd._data.fence import BlockFence, FenceTable
from llmdd._base.log import get_logger
from llmdd._base.profiles import PROFILES, ChipProfile, check_registration
from llmdd._memory.copy import Bounds, as_index_array, block_copy_ops, copy_block_lists, copy_slot, execute
from llmdd._memory.manager import CacheRecord, MemoryManager
from llmdd._base.status import LLMException, LLMStatusCode, raise_if_false, raise_if_true
from llmdd._base.types import BlocksCacheKey, Cache, CacheDesc, CacheKey, MemInfo, cache_key_index, check_cache_key
from llmdd._base.validation import check_dict, check_int64, check_isinstance, check_uint32, check_uint64

if TYPE_CHECKING:
    from llmdd._data.engine import TransferEngine

__all__ = ["CacheManager"]

_log = get_logger("llmdd.cache_manager")

_NUM_TENSORS_PER_LAYER = 2


def _tensor_addrs(addrs: Any, cache_desc: CacheDesc) -> tuple:
    """``addrs`` with CPU torch tensors (duck-typed: ``data_ptr`` and ``device`` / ``is_cuda``) replaced by their
    addresses, and the tensors to keep alive while registered.  Other elements pass unchanged (the
    contract's checks judge them).  torch is never imported here."""
    if not isinstance(addrs, list) or not any(_tensor_like(a) for a in addrs):
        return addrs, ()
    out: list = []
    held: list = []
    for i, a in enumerate(addrs):
        if not _tensor_like(a):
            out.append(a)
            continue
        device = getattr(a.device, "type", str(a.device)) if hasattr(a, "device") else "cpu"
        if getattr(a, "is_cuda", False) is True:
            device = "cuda"
        if device != "cpu":
            # refused before data_ptr() is read: no device address is ever taken for host memory
            raise LLMException(f"addrs[{i}] is a tensor on {getattr(a, 'device', device)}: llmdd has no "
                               f"device-memory path yet "
                               f"(register host memory: a CPU tensor or an address)",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        if not a.is_contiguous():
            raise LLMException(f"addrs[{i}] is a non-contiguous tensor: a cache tensor must be one contiguous range",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        nbytes = int(a.numel()) * int(a.element_size())
        if nbytes < cache_desc.size:
            raise LLMException(f"addrs[{i}] is a tensor of {nbytes} bytes; each tensor of this cache needs "
                               f"{cache_desc.size} bytes", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        out.append(int(a.data_ptr()))
        held.append(a)
    return out, tuple(held)


def _tensor_like(a: Any) -> bool:
    """A torch tensor or an object with its interface: ``data_ptr`` and ``device`` or ``is_cuda``."""
    return hasattr(a, "data_ptr") and (hasattr(a, "device") or getattr(a, "is_cuda", False) is True)


class CacheManager(RemoteOperations):
    """Obtained through ``LLMDataDist.cache_manager``; not built by users."""

    def __init__(self, memory: MemoryManager, options: Mapping[str, str], *,
                 profile: ChipProfile = PROFILES["generic"], transfers: Optional["TransferEngine"] = None) -> None:
        self._memory = memory
        self._transfers = transfers   # the data plane (None: a local-only manager refuses remote calls)
        self._initialized = True
        self._is_call_linked = False
        self._enabled_mem_pool = len(options.get("llm.MemPoolConfig", "") or "") > 0
        self._enable_host_mem_pool = len(options.get("llm.HostMemPoolConfig", "") or "") > 0
        self._enable_remote_cache_accessible = options.get("llm.EnableRemoteCacheAccessible", "0") == "1"
        self._enable_local_comm_res = "llm.LocalCommRes" in options
        self._profile = profile   # the engine's chip-family profile
        self._held_tensors: dict = {}  # cache id -> the torch tensors registered in place (kept alive)

    # ------------------------------------------------------------------ helpers
    def _mark_finalized(self) -> None:
        """The engine that made this manager was finalized: every later call raises LLM_ENGINE_FINALIZED."""
        self._initialized = False

    def _check_is_inited(self) -> None:
        # A manager lives as long as the engine that made it: once that engine is finalized the
        # manager stays dead, also after the same object is initialized again (which makes a new
        # manager) and while another engine runs.  LLMException is a RuntimeError.
        if not self._initialized:
            raise LLMException("llm datadist is not initialized: the engine of this cache manager was finalized.",
                               status_code=LLMStatusCode.LLM_ENGINE_FINALIZED)

    @staticmethod
    def check_cache_key(cache_key: CacheKey) -> None:
        """Exactly one of ``req_id`` / ``prefix_id`` must be valid (``LLM_PARAM_INVALID``)."""
        check_cache_key(cache_key)

    def set_is_call_linked(self) -> None:
        """Called by ``LLMDataDist.link()``: remote-accessible registrations are refused from now on."""
        self._is_call_linked = True

    def _remote_accessible(self, cache_desc: CacheDesc, remote_accessible: Optional[bool]) -> bool:
        if remote_accessible is not None:
            return remote_accessible
        if self._is_call_linked:
            return False
        return cache_desc.placement == Placement.DEVICE

    def _check_addrs(self, addrs: List[int]) -> None:
        raise_if_false(len(addrs) > 0, "addrs can not be empty.")
        for i, addr in enumerate(addrs):
            raise_if_false(addr != 0, "addr can not be zero.")
            check_uint64(f"addrs[{i}]", addr)

    def _check_pool(self, cache_desc: CacheDesc) -> None:
        raise_if_false(
            (self._enabled_mem_pool and cache_desc.placement == Placement.DEVICE)
            or (self._enable_host_mem_pool and cache_desc.placement == Placement.HOST),
            "you should config memory pool firstly and then set placement that matches it.")

    def _record(self, cache: Cache) -> CacheRecord:
        return self._memory.live(cache.cache_id)

    # ------------------------------------------------------------------ register
    def register_cache(self, cache_desc: CacheDesc, addrs: List[int],
                       cache_keys: Union[Tuple[CacheKey, ...], List[CacheKey]] = (),
                       remote_accessible: Optional[bool] = None) -> Cache:
        """Register caller memory: one address per tensor, ``cache_desc.size`` bytes each.

        llmdd extension: an element of ``addrs`` may be a CPU ``torch.Tensor`` (contiguous, at least
        ``cache_desc.size`` bytes), registered in place through ``data_ptr()`` and kept alive while
        registered; a CUDA tensor is refused (no device-memory path yet)."""
        self._check_is_inited()
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        addrs, held = _tensor_addrs(addrs, cache_desc)
        check_isinstance("addrs", addrs, list, int, allow_none=False)
        check_isinstance("cache_keys", cache_keys, [tuple, list], CacheKey)
        check_isinstance("remote_accessible", remote_accessible, bool)
        raise_if_true(self._is_call_linked and bool(remote_accessible),
                      "you can not register remote accessible cache after link.")
        raise_if_false(len(addrs) > 0, "addrs can not be empty.")
        raise_if_false(len(addrs) == cache_desc.num_tensors, "addrs length should be equal to num_tensors.")
        self._check_addrs(addrs)
        granted = self._remote_accessible(cache_desc, remote_accessible)
        check_registration(self._profile, self._memory.records(), cache_desc, addrs, remote_accessible=granted)
        rec = self._memory.register_cache(cache_desc, list(addrs), keys=tuple(cache_keys or ()),
                                          remote_accessible=granted, is_blocks=False)
        if held:
            self._held_tensors[rec.cache_id] = held
        _log.debug("llmdd.cache.registered", cache_id=rec.cache_id, tensors=len(addrs))
        return Cache(rec.cache_id, cache_desc, list(addrs), self, True, False)

    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: List[int],
                              blocks_cache_key: Optional[BlocksCacheKey] = None,
                              remote_accessible: Optional[bool] = None) -> Cache:
        """Register caller memory as a blocks cache (``shape[0]`` = number of blocks).

        llmdd extension: ``addrs`` may hold CPU ``torch.Tensor`` objects, as for :meth:`register_cache`
        (e.g. one tensor per layer, every layer a view of one shared buffer: each view is one tensor
        of the blocks cache)."""
        self._check_is_inited()
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        addrs, held = _tensor_addrs(addrs, cache_desc)
        check_isinstance("addrs", addrs, list, int, allow_none=False)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        check_isinstance("remote_accessible", remote_accessible, bool)
        raise_if_true(self._is_call_linked and bool(remote_accessible),
                      "you can not register remote accessible cache after link.")
        self._check_addrs(addrs)
        cache_desc._is_blocks = True
        # the engine's check (C++ side): one address per tensor
        raise_if_false(cache_desc.num_tensors == len(addrs),
                       "cache_desc num_tensors:{0} is not equal to addrs num:{1}.", cache_desc.num_tensors, len(addrs))
        granted = self._remote_accessible(cache_desc, remote_accessible)
        check_registration(self._profile, self._memory.records(), cache_desc, addrs, remote_accessible=granted)
        rec = self._memory.register_cache(cache_desc, list(addrs), blocks_key=blocks_cache_key,
                                          remote_accessible=granted, is_blocks=True)
        if held:
            self._held_tensors[rec.cache_id] = held
        _log.debug("llmdd.cache.registered", cache_id=rec.cache_id, tensors=len(addrs), blocks=True)
        return Cache(rec.cache_id, cache_desc, list(addrs), self, True, True)

    def unregister_cache(self, cache_id: int) -> None:
        """Forget registered memory (unknown id: success). Call after unlinking."""
        self._check_is_inited()
        check_isinstance("cache_id", cache_id, int, allow_none=False)
        check_int64("cache_id", cache_id)
        self._memory.unregister_cache(cache_id)
        self._held_tensors.pop(cache_id, None)

    # ------------------------------------------------------------------ allocate
    def allocate_cache(self, cache_desc: CacheDesc,
                       cache_keys: Union[Tuple[CacheKey, ...], List[CacheKey]] = ()) -> Cache:
        """Allocate from the pool of ``cache_desc.placement``; ``cache_keys[i]`` names batch slot ``i``."""
        self._check_is_inited()
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("cache_keys", cache_keys, [list, tuple], CacheKey)
        raise_if_false(cache_desc.num_tensors > 0, "num_tensors should be bigger than zero.")
        self._check_pool(cache_desc)
        rec = self._memory.allocate_cache(cache_desc, keys=tuple(cache_keys or ()), is_blocks=False)
        return Cache(rec.cache_id, cache_desc, list(rec.addrs), self, False, False)

    def allocate_blocks_cache(self, cache_desc: CacheDesc,
                              blocks_cache_key: Optional[BlocksCacheKey] = None) -> Cache:
        """Allocate a blocks cache from the pool of ``cache_desc.placement``."""
        self._check_is_inited()
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        raise_if_false(cache_desc.num_tensors > 0, "num_tensors should be bigger than zero.")
        self._check_pool(cache_desc)
        cache_desc._is_blocks = True
        rec = self._memory.allocate_cache(cache_desc, blocks_key=blocks_cache_key, is_blocks=True)
        return Cache(rec.cache_id, cache_desc, list(rec.addrs), self, False, True)

    def deallocate_cache(self, cache: Cache) -> None:
        """Release an allocated cache; deferred while ``CacheKey``s still reference it."""
        self._check_is_inited()
        check_isinstance("cache", cache, Cache, allow_none=False)
        raise_if_true(cache.is_blocks_cache, "param check failed, cache can not be blocks cache.")
        self._memory.deallocate_cache(cache.cache_id)
        cache._tensor_addrs = []
        cache._valid = False

    def deallocate_blocks_cache(self, cache: Cache) -> None:
        """Release an allocated blocks cache."""
        self._check_is_inited()
        check_isinstance("cache", cache, Cache, allow_none=False)
        raise_if_false(cache.is_blocks_cache, "param check failed, cache should be blocks cache.")
        self._memory.deallocate_cache(cache.cache_id)
        cache._tensor_addrs = []
        cache._valid = False

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """The cache can no longer be pulled by this key (unknown key: no-op)."""
        self._check_is_inited()
        check_isinstance("cache_key", cache_key, CacheKey, allow_none=False)
        self._memory.remove_key(cache_key_index(cache_key))

    # ------------------------------------------------------------------ copies
    def copy_cache(self, dst: Cache, src: Cache, dst_batch_index: int = 0, src_batch_index: int = 0,
                   offset: int = 0, size: int = -1, req_id: Optional[int] = None) -> None:
        """Copy ``size`` bytes (``-1``: the rest of the slot) at ``offset`` of one batch slot, every tensor."""
        self._check_is_inited()
        check_isinstance("dst", dst, Cache, allow_none=False)
        check_isinstance("src", src, Cache, allow_none=False)
        check_uint32("dst_batch_index", dst_batch_index)
        check_uint32("src_batch_index", src_batch_index)
        check_uint64("offset", offset)
        check_int64("size", size)
        raise_if_true(src.is_blocks_cache, "param check failed, src cache can not be blocks cache.")
        raise_if_true(dst.is_blocks_cache, "param check failed, dst cache can not be blocks cache.")
        raise_if_false(size == -1 or size > 0,
                       "[copy_cache] param check failed, size ({0}) is invalid, should be = -1 or > 0", size)
        if req_id is not None:
            check_uint64("req_id", req_id)  # kept for diagnostics only, as upstream
        s, d = self._record(src), self._record(dst)
        raise_if_true(s.is_blocks or d.is_blocks, "param check failed, copy_cache needs non-blocks caches.")
        copy_slot(s, d, src_batch_index, dst_batch_index, offset, size)

    def copy_blocks(self, cache: Cache, copy_block_info: Dict[int, List[int]]) -> None:
        """Inside one blocks cache, copy block ``src`` to every block of ``copy_block_info[src]``."""
        self._check_is_inited()
        check_isinstance("cache", cache, Cache, allow_none=False)
        check_isinstance("copy_block_info", copy_block_info, dict, allow_none=False)
        check_dict("copy_block_info", copy_block_info, int, list, int)
        raise_if_false(cache.is_blocks_cache, "param check failed, cache should be blocks cache.")
        rec = self._record(cache)
        raise_if_false(rec.is_blocks, "param check failed, cache should be blocks cache.")
        src = [b for b, dsts in copy_block_info.items() for _ in dsts]
        dst = [b for dsts in copy_block_info.values() for b in dsts]
        if src:
            copy_block_lists(rec, rec, src, [dst], dst_label="dst block")

    def _swap_side(self, cache: Cache) -> tuple[tuple, int, Bounds]:
        """(addrs, tensor_size, bounds) of one side of ``swap_blocks``: the table's, or a trusted cpu cache's."""
        rec = self._memory.get(cache.cache_id) if cache.cache_id >= 0 else None
        if rec is not None:
            rec = self._memory.live(cache.cache_id)
            raise_if_false(rec.is_blocks, "param check failed, cache {0} should be blocks cache.", cache.cache_id)
            return rec.addrs, rec.tensor_size, rec.bounds()
        if cache.cache_id != -1:
            raise LLMException(f"cache {cache.cache_id} does not exist",
                               status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
        # Cache.create_cpu_cache: caller-owned host memory, trusted with sizes from its CacheDesc
        desc = cache.cache_desc
        addrs = tuple(cache.tensor_addrs)
        raise_if_false(desc.placement == Placement.HOST, "a cache that is not registered must be a cpu cache.")
        raise_if_false(len(addrs) == desc.num_tensors and all(isinstance(a, int) and a > 0 for a in addrs),
                       "cpu cache addrs are invalid.")
        return addrs, desc.size, Bounds.from_ranges((a, desc.size) for a in addrs)

    def swap_blocks(self, src_cache: Cache, dst_cache: Cache, src_to_dst: Dict[int, int]) -> None:
        """Copy blocks between a HOST and a DEVICE blocks cache (swap in: H2D, swap out: D2H)."""
        self._check_is_inited()
        check_isinstance("src_cache", src_cache, Cache, allow_none=False)
        check_isinstance("dst_cache", dst_cache, Cache, allow_none=False)
        raise_if_false(src_cache.is_blocks_cache, "param check failed, src cache should be blocks cache.")
        raise_if_false(dst_cache.is_blocks_cache, "param check failed, dst cache should be blocks cache.")
        check_isinstance("src_to_dst", src_to_dst, dict, int, allow_none=False)
        check_isinstance("src_to_dst values", list(src_to_dst.values()), list, int)
        sd, dd = src_cache.cache_desc, dst_cache.cache_desc
        raise_if_false(sd.batch_size > 0 and dd.batch_size > 0, "block number must be bigger than zero.")
        src_block_size = sd.size // sd.batch_size
        dst_block_size = dd.size // dd.batch_size
        raise_if_false(src_block_size == dst_block_size,
                       "src block size:{0} and dst block size:{1} must be equal", src_block_size, dst_block_size)
        raise_if_false(sd.num_tensors == dd.num_tensors,
                       "src num_tensors:{0} and dst num_tensors:{1} must be equal", sd.num_tensors, dd.num_tensors)
        src_idx = as_index_array(list(src_to_dst.keys()), "src_block_index", sd.batch_size)
        dst_idx = as_index_array(list(src_to_dst.values()), "dst_block_index", dd.batch_size)
        swap_in = sd.placement == Placement.HOST and dd.placement == Placement.DEVICE
        swap_out = sd.placement == Placement.DEVICE and dd.placement == Placement.HOST
        raise_if_false(swap_in or swap_out, "swap src placement:{0} to dst placement:{1} is not support",
                       sd.placement, dd.placement)
        s_addrs, _, s_bounds = self._swap_side(src_cache)
        d_addrs, _, d_bounds = self._swap_side(dst_cache)
        raise_if_false(len(s_addrs) == len(d_addrs) == sd.num_tensors, "swap caches have different tensor counts.")
        if not len(src_idx):
            return
        ops = block_copy_ops(s_addrs, d_addrs, src_block_size, src_idx, dst_idx)
        execute(ops, src_bounds=s_bounds, dst_bounds=d_bounds)

    # ------------------------------------------------------------------ remap
    # ------------------------------------------------------------------ fences (llmdd extension, docs/fencing.md)
    def block_fence(self, cache: Cache, blocks: Union[Tuple[int, ...], List[int]]) -> BlockFence:
        """llmdd extension, owner side: the :class:`BlockFence` a fenced pull of ``blocks`` (in this
        order) of this engine's registered blocks cache ``cache`` must find (docs/fencing.md)."""
        check_isinstance("cache", cache, Cache, allow_none=False)
        return self._fences().expect(self._record(cache), _check_blocks("blocks", blocks))

    def _fences(self) -> FenceTable:
        self._check_is_inited()
        if self._transfers is None:
            raise LLMException("the data plane is not available", status_code=LLMStatusCode.LLM_FAILED)
        return self._transfers.owner.fences

    def fence_blocks(self, cache: Cache, blocks: Union[Tuple[int, ...], List[int]]) -> None:
        """llmdd extension, owner side: bump the generations of ``blocks`` of ``cache`` before they are
        reused: from now on every fenced pull that expects an older generation of any of them fails
        with ``LLM_KV_CACHE_NOT_EXIST`` at its check, whether its copy ran before or after."""
        check_isinstance("cache", cache, Cache, allow_none=False)
        self._fences().fence(self._record(cache), _check_blocks("blocks", blocks))

    def remap_registered_memory(self, mem_infos: Union[MemInfo, List[MemInfo]]) -> None:
        """Re-map registered device memory after a memory fault; transports re-register it."""
        self._check_is_inited()
        self._profile.require_api("remap_registered_memory")
        raise_if_false(isinstance(mem_infos, (list, MemInfo)),
                       "mem_infos type only support list of MemInfo or MemInfo, but got {0}.", type(mem_infos))
        infos = mem_infos if isinstance(mem_infos, list) else [mem_infos]
        for i, info in enumerate(infos):
            raise_if_false(isinstance(info, MemInfo), "mem_infos[{0}] type only support MemInfo, but got {1}.",
                           i, type(info))
            raise_if_false(info.mem_type == Memtype.MEM_TYPE_DEVICE,
                           "check mem_info.mem_type failed, only support Memtype.MEM_TYPE_DEVICE, index={0}.", i)
            raise_if_false(info.addr != 0, "check mem_info.addr failed, addr can not be zero, index={0}.", i)
            raise_if_false(info.size > 0, "check mem_info.size failed, size must be > 0, index={0}.", i)
        self._memory.remap([(info.addr, info.size) for info in infos])
