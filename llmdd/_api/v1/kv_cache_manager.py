"""``KvCacheManager``: the legacy v1 cache API (``LLMDataDist.kv_cache_manager``), on the shared engine.

The v1 API is role-bound: keys are given at allocation by a PROMPT only, ``remove_cache_key`` and
``transfer_cache_async`` are PROMPT calls, ``pull_cache`` / ``pull_blocks`` DECODER calls; any
other role gets ``LLMException(LLM_PARAM_INVALID)`` ("... is not supported by ...").

Every call maps onto the engine that cache-manager mode uses:

* allocations come from the memory manager's DEVICE pool, sized at ``init`` from
  ``ge.flowGraphMemMaxSize`` x ``llm.MemoryUtilization`` (see ``options.py``); beyond it an
  allocation fails with ``LLM_DEVICE_OUT_OF_MEMORY`` (v1's status, as upstream v1) and leaves nothing behind.  Cache ids start at 1
  (the memory manager's counter), so the v0 connector's hard-coded ids 1..4 hold;
* keys, deferred free and key consumption are the memory manager's (a cache deallocated while
  ``CacheKey``\\ s still name it is freed when the last one is pulled or removed);
* pulls and the layer-wise transfer go through the data plane (``TransferEngine``), local copies
  through the cache manager's bounds-checked executors, always with the geometry of the engine's
  cache table, never with what a caller's ``KvCache`` claims.
"""

from __future__ import annotations

import ctypes
from typing import Dict, List, Optional, Tuple, Union

from llmdd._base.lazy import np

from llmdd._base.enums import LLMRole, Placement
from llmdd._base.log import get_logger
from llmdd._base.status import LLMException, LLMStatusCode, raise_if_false, raise_if_true
from llmdd._base.types import (BlocksCacheKey, Cache, CacheDesc, CacheKey, CacheKeyByIdAndIndex, CacheTask, KvCache,
                      LayerSynchronizer, TransferConfig, cache_key_index,
                      check_cache_key)
from llmdd._base.types.transfer import _timeout_seconds
from llmdd._base.validation import INVALID_ID, check_dict, check_int32, check_int64, check_isinstance, check_uint32, \
    check_uint64
from llmdd._api.v1.offsets import allocate_device, pull_with_offsets
from llmdd._api.v1.tensor import Tensor, TensorDesc

__all__ = ["KvCacheManager"]

_log = get_logger("llmdd.v1")

_NUM_TENSORS_PER_LAYER = 2
_MAX_DIMS = 32
_PULL_KWARGS = ("src_layer_range", "dst_layer_range", "src_cache_offset", "dst_cache_offset",
                "tensor_num_per_layer")
_BLOCKS_KWARGS = ("src_layer_range", "dst_layer_range", "tensor_num_per_layer")


class _V1CacheTask(CacheTask):
    """v1's ``CacheTask``: an unfinished task reports ``LLM_WAIT_PROCESS_TIMEOUT`` (v2: ``LLM_TIMEOUT``)."""

    def synchronize(self, timeout_in_millis: Optional[int] = None) -> LLMStatusCode:
        if not self._transfer_async_task.wait(_timeout_seconds(timeout_in_millis)):
            return LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT
        for ret in self._transfer_async_task.results():
            if ret is not None and ret != LLMStatusCode.LLM_SUCCESS:
                return ret
        return LLMStatusCode.LLM_SUCCESS

    def get_results(self, timeout_in_millis: Optional[int] = None) -> List[Optional[LLMStatusCode]]:
        if not self._transfer_async_task.wait(_timeout_seconds(timeout_in_millis)):
            return [LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT] * len(self._transfer_async_task.results())
        return list(self._transfer_async_task.results())


def _check_kwargs(kwargs: dict, allowed: tuple) -> None:
    for name in kwargs:
        raise_if_false(name in allowed, "Unsupported param:{0}", name)


def _check_offset(name: str, value) -> int:
    """``None`` -> -1 (not given); else an int64 >= 0.  A negative one is ``ValueError``, as upstream's
    v1 check raises it (not an ``LLMException``)."""
    if value is None:
        return -1
    check_isinstance(name, value, int, allow_none=False)
    check_int64(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, but got {value}.")
    return value


def _check_tnpl(value, fn: str, num_tensors: int) -> int:
    check_uint32("tensor_num_per_layer", value)
    raise_if_false(value > 0, "[{0}] param check failed, tensor_num_per_layer ({1}) is invalid, should [1, {2}]",
                   fn, value, num_tensors)
    return value


class KvCacheManager:
    """Obtained through ``LLMDataDist.kv_cache_manager`` of an engine initialized without cache-manager mode."""

    def __init__(self, llm_engine, role: LLMRole, cache_manager) -> None:
        self._engine = llm_engine  # the engine core (memory manager, data plane)
        self._cache_manager = cache_manager   # the engine's CacheManager (copies and swaps go through it)
        self._role = role
        self._initialized = True

    # ------------------------------------------------------------------ state
    def _mark_finalized(self) -> None:
        """The engine that made this manager was finalized: later calls raise LLM_ENGINE_FINALIZED."""
        self._initialized = False

    def is_initialized(self) -> bool:
        """False once the owning ``LLMDataDist`` was finalized."""
        return self._initialized

    def _check_is_inited(self) -> None:
        # as the cache manager of cache-manager mode: once its engine is finalized the manager stays
        # dead (also after the same LLMDataDist is initialized again); LLMException is a RuntimeError
        if not self._initialized:
            raise LLMException("llm datadist is not initialized: the engine of this kv cache manager was finalized.",
                               status_code=LLMStatusCode.LLM_ENGINE_FINALIZED)

    def _check_role(self, func_name: str, role: LLMRole) -> None:
        raise_if_false(self._role == role, "{0} is not supported by {1}", func_name, self._role)

    def _switch_role(self, role: LLMRole) -> None:
        _log.info("llmdd.v1.switch_role", old=self._role.name, new=role.name)
        self._role = role

    @property
    def _memory(self):
        return self._engine.memory

    def _live(self, cache: KvCache):
        """The engine's record of ``cache`` (``LLM_KV_CACHE_NOT_EXIST`` once released)."""
        return self._memory.live(cache.cache_id)

    @staticmethod
    def _is_cpu_cache(cache: KvCache) -> bool:
        return cache.cache_desc.placement == Placement.HOST

    def _as_cache(self, cache: KvCache) -> Cache:
        """A cache-manager view of an allocated ``KvCache`` (geometry still comes from the record)."""
        rec = self._live(cache)
        return Cache(rec.cache_id, cache.cache_desc, list(rec.addrs), None, False, rec.is_blocks)

    # ------------------------------------------------------------------ allocate / free
    def _check_desc(self, cache_desc: CacheDesc) -> None:
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        raise_if_false(cache_desc.num_tensors > 0, "num_tensors should be bigger than zero.")
        raise_if_false(cache_desc.placement == Placement.DEVICE, "Only support allocate device cache")
        shape = cache_desc.shape
        raise_if_false(0 < len(shape) < _MAX_DIMS, "Invalid shape: {0}, dim_num ({1}) must be in range [1, {2})",
                       list(shape), len(shape), _MAX_DIMS)
        raise_if_false(all(d > 0 for d in shape), "Invalid shape: {0}, every dim must be > 0", list(shape))

    def _check_pool(self) -> None:
        if not self._memory.has_pool(Placement.DEVICE):
            raise LLMException("the v1 device pool is empty (ge.flowGraphMemMaxSize x llm.MemoryUtilization is 0)",
                               status_code=LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY)

    def allocate_cache(self, cache_desc: CacheDesc,
                       cache_keys: Union[Tuple[CacheKey, ...], List[CacheKey]] = ()) -> KvCache:
        """Allocate ``num_tensors`` device tensors; ``cache_keys[i]`` (PROMPT only) names batch slot ``i``.

        The cache is referenced by its id and by its keys: ``deallocate_cache`` drops the first,
        a DECODER's successful ``pull_cache`` by key or ``remove_cache_key`` drop the others, and
        the memory goes back to the pool when none is left.  A padding key (``req_id = 2**64-1``)
        only holds its slot; of repeated keys the last one wins.
        """
        self._check_is_inited()
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("cache_keys", cache_keys, [list, tuple], CacheKey)
        self._check_desc(cache_desc)
        keys = list(cache_keys or ())
        if self._role != LLMRole.PROMPT:
            raise_if_false(len(keys) == 0, "cache_keys is not supported by {0}", self._role.name)
        self._check_pool()
        rec = allocate_device(self._memory, cache_desc, keys=self._last_wins(keys), is_blocks=False)
        _log.debug("llmdd.v1.allocated", cache_id=rec.cache_id, keys=len(keys))
        return KvCache(rec.cache_id, cache_desc, [list(rec.addrs)], self)

    @staticmethod
    def _last_wins(keys: list) -> tuple:
        """Repeated keys: the last occurrence keeps its slot, earlier ones become padding."""
        last = {}
        for i, key in enumerate(keys):
            last[cache_key_index(key)] = i
        out = []
        for i, key in enumerate(keys):
            if last[cache_key_index(key)] != i:
                key = CacheKey(key.cluster_id, INVALID_ID, key.model_id)
            out.append(key)
        return tuple(out)

    def allocate_blocks_cache(self, cache_desc: CacheDesc,
                              blocks_cache_key: Optional[BlocksCacheKey] = None) -> KvCache:
        """Allocate a blocks cache (``shape[0]`` blocks); a PROMPT may name it by ``blocks_cache_key``."""
        self._check_is_inited()
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        self._check_desc(cache_desc)
        if self._role == LLMRole.DECODER:
            raise_if_false(blocks_cache_key is None, "blocks_cache_key is not supported by DECODER")
        self._check_pool()
        cache_desc._is_blocks = True
        rec = allocate_device(self._memory, cache_desc, blocks_key=blocks_cache_key, is_blocks=True)
        return KvCache(rec.cache_id, cache_desc, [list(rec.addrs)], self)

    def deallocate_cache(self, cache: KvCache) -> None:
        """Drop the id reference; freed now, or when the last ``CacheKey`` of it goes (no-op if unknown)."""
        self._check_is_inited()
        check_isinstance("cache", cache, KvCache, allow_none=False)
        raise_if_true(self._is_cpu_cache(cache), "Only support device cache")
        self._memory.deallocate_cache(cache.cache_id)
        cache._per_device_tensor_addrs = []
        cache._valid = False

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """PROMPT: the cache can no longer be pulled by ``cache_key`` (unknown key: no-op)."""
        self._check_is_inited()
        self._check_role("[remove_cache_key]", LLMRole.PROMPT)
        check_isinstance("cache_key", cache_key, CacheKey, allow_none=False)
        self._memory.remove_key(cache_key_index(cache_key))

    # ------------------------------------------------------------------ pulls (DECODER)
    @staticmethod
    def check_cache_key(cache_key: CacheKey) -> None:
        """Exactly one of ``req_id`` / ``prefix_id`` must be valid (``LLM_PARAM_INVALID``)."""
        check_cache_key(cache_key)

    def _transfers(self):
        engine = self._engine.transfers
        if engine is None:
            raise LLMException("the data plane is not available", status_code=LLMStatusCode.LLM_FAILED)
        return engine

    def pull_cache(self, cache_key: Union[CacheKey, CacheKeyByIdAndIndex], kv_cache: KvCache,
                   batch_index: int = 0, size: int = -1, **kwargs) -> None:
        """DECODER: pull a PROMPT's batch slot (by ``CacheKey`` or ``CacheKeyByIdAndIndex``) into slot
        ``batch_index`` of ``kv_cache``; a pull by ``CacheKey`` consumes the key on the PROMPT.

        kwargs: ``src_layer_range``, ``dst_layer_range``, ``tensor_num_per_layer`` (layer-wise) and
        ``src_cache_offset`` / ``dst_cache_offset`` (bytes into the slots; ``size=-1`` then copies the
        rest of the destination slot).
        """
        self._check_is_inited()
        _check_kwargs(kwargs, _PULL_KWARGS)
        src_range = kwargs.get("src_layer_range")
        dst_range = kwargs.get("dst_layer_range")
        tnpl = kwargs.get("tensor_num_per_layer", _NUM_TENSORS_PER_LAYER)
        self._check_role("[pull_cache]", LLMRole.DECODER)
        check_isinstance("cache_key", cache_key, [CacheKey, CacheKeyByIdAndIndex], allow_none=False)
        check_isinstance("kv_cache", kv_cache, KvCache, allow_none=False)
        raise_if_true(self._is_cpu_cache(kv_cache), "Only support device cache")
        check_int64("size", size)
        check_uint32("batch_index", batch_index)
        raise_if_false(size == -1 or size > 0,
                       "[pull_cache] param check failed, size ({0}) is invalid, should be = -1 or > 0", size)
        src_offset = _check_offset("src_cache_offset", kwargs.get("src_cache_offset"))
        dst_offset = _check_offset("dst_cache_offset", kwargs.get("dst_cache_offset"))
        if isinstance(cache_key, CacheKey):
            check_cache_key(cache_key)
        _check_tnpl(tnpl, "pull_cache", kv_cache.cache_desc.num_tensors)
        check_isinstance("src_layer_range", src_range, range)
        check_isinstance("dst_layer_range", dst_range, range)
        rec = self._live(kv_cache)
        raise_if_true(rec.is_blocks, "[pull_cache] kv_cache is a blocks cache, use pull_blocks.")
        raise_if_false(batch_index < rec.rows, "[pull_cache] batch_index ({0}) out of range [0, {1})",
                       batch_index, rec.rows)
        if src_offset >= 0 or dst_offset >= 0:

            pull_with_offsets(self._memory, self._transfers(), cache_key, rec, batch_index=batch_index, size=size,
                              src_offset=max(src_offset, 0), dst_offset=max(dst_offset, 0),
                              src_layer_range=src_range, dst_layer_range=dst_range, tnpl=tnpl)
            return
        self._transfers().pull(cache_key, kv_cache, kind="pull_cache", batch_index=batch_index, size=size,
                               src_layer_range=src_range, dst_layer_range=dst_range, tnpl=tnpl)

    def pull_blocks(self, prompt_cache_key: BlocksCacheKey, decoder_kv_cache: KvCache, prompt_blocks: List[int],
                    decoder_blocks: List[int], **kwargs) -> None:
        """DECODER: pull blocks ``prompt_blocks`` of the PROMPT's blocks cache into ``decoder_blocks``."""
        self._check_is_inited()
        _check_kwargs(kwargs, _BLOCKS_KWARGS)
        src_range = kwargs.get("src_layer_range")
        dst_range = kwargs.get("dst_layer_range")
        tnpl = kwargs.get("tensor_num_per_layer", _NUM_TENSORS_PER_LAYER)
        self._check_role("[pull_blocks]", LLMRole.DECODER)
        check_isinstance("prompt_cache_key", prompt_cache_key, BlocksCacheKey, allow_none=False)
        check_isinstance("decoder_kv_cache", decoder_kv_cache, KvCache, allow_none=False)
        check_isinstance("prompt_blocks", prompt_blocks, list, int, allow_none=False)
        check_isinstance("decoder_blocks", decoder_blocks, list, int, allow_none=False)
        raise_if_true(self._is_cpu_cache(decoder_kv_cache), "Only support device cache")
        raise_if_false(len(prompt_blocks) > 0, "prompt_blocks can not be empty.")
        raise_if_false(len(decoder_blocks) > 0, "decoder_blocks can not be empty.")
        raise_if_false(len(prompt_blocks) == len(decoder_blocks),
                       "Param prompt_blocks and decoder_blocks size should be same.")
        for name, blocks in (("prompt_blocks", prompt_blocks), ("decoder_blocks", decoder_blocks)):
            for i, b in enumerate(blocks):
                check_uint64(f"{name}[{i}]", b)
        _check_tnpl(tnpl, "pull_blocks", decoder_kv_cache.cache_desc.num_tensors)
        check_isinstance("src_layer_range", src_range, range)
        check_isinstance("dst_layer_range", dst_range, range)
        rec = self._live(decoder_kv_cache)
        raise_if_false(rec.is_blocks, "[pull_blocks] decoder_kv_cache must be a blocks cache.")
        self._transfers().pull(prompt_cache_key, decoder_kv_cache, kind="pull_blocks", src_blocks=list(prompt_blocks),
                               dst_blocks=list(decoder_blocks), src_layer_range=src_range,
                               dst_layer_range=dst_range, tnpl=tnpl)

    # ------------------------------------------------------------------ local copies
    def copy_cache(self, dst: KvCache, src: KvCache, dst_batch_index: int = 0, src_batch_index: int = 0,
                   offset: int = 0, size: int = -1, req_id: Optional[int] = None) -> None:
        """Copy ``size`` bytes (``-1``: the rest of the slot) at ``offset`` of one batch slot, every tensor."""
        self._check_is_inited()
        check_isinstance("dst", dst, KvCache, allow_none=False)
        raise_if_true(self._is_cpu_cache(dst), "Only support device cache")
        check_isinstance("src", src, KvCache, allow_none=False)
        raise_if_true(self._is_cpu_cache(src), "Only support device cache")
        check_uint32("dst_batch_index", dst_batch_index)
        check_uint32("src_batch_index", src_batch_index)
        check_uint64("offset", offset)
        check_int64("size", size)
        raise_if_false(size == -1 or size > 0,
                       "[copy_cache] param check failed, size ({0}) is invalid, should be = -1 or > 0", size)
        check_isinstance("req_id", req_id, int)
        self._cache_manager.copy_cache(self._as_cache(dst), self._as_cache(src), dst_batch_index,
                                              src_batch_index, offset, size, req_id)

    def copy_blocks(self, cache: KvCache, copy_block_info: Dict[int, List[int]]) -> None:
        """Inside one blocks cache, copy block ``src`` to every block of ``copy_block_info[src]``."""
        self._check_is_inited()
        check_isinstance("cache", cache, KvCache, allow_none=False)
        check_isinstance("copy_block_info", copy_block_info, dict, allow_none=False)
        check_dict("copy_block_info", copy_block_info, int, list, int)
        raise_if_true(self._is_cpu_cache(cache), "Only support device cache")
        for src_block, dst_blocks in copy_block_info.items():
            check_uint64("src_block", src_block)
            for dst_block in dst_blocks:
                check_uint64("dst_block", dst_block)
        self._cache_manager.copy_blocks(self._as_cache(cache), copy_block_info)

    def get_cache_tensors(self, cache: KvCache, tensor_index: int = 0) -> List[Tensor]:
        """A host copy of tensor ``tensor_index`` of ``cache``: one ``Tensor`` per device (one here)."""
        self._check_is_inited()
        check_isinstance("cache", cache, KvCache, allow_none=False)
        check_int32("tensor_index", tensor_index)
        raise_if_false(0 <= tensor_index < cache.cache_desc.num_tensors,
                       "[get_cache_tensors] param check failed, tensor_index ({0}) out of range, [0, {1})",
                       tensor_index, cache.cache_desc.num_tensors)
        rec = self._live(cache)
        raise_if_false(tensor_index < len(rec.addrs), "[get_cache_tensors] tensor_index ({0}) out of range, [0, {1})",
                       tensor_index, len(rec.addrs))
        addr, nbytes = rec.addrs[tensor_index], rec.tensor_size
        # the record's own region: inside the pool segment this engine owns and keeps mapped
        raw = np.frombuffer(ctypes.string_at(addr, nbytes), dtype=np.uint8).copy()
        desc = TensorDesc(rec.desc.data_type, list(rec.desc.shape))
        return [Tensor._from_buffer(raw, desc)]

    def swap_blocks(self, src: KvCache, dst: KvCache, src_to_dst: Dict[int, int]) -> None:
        """Swap blocks between a ``KvCache.create_cpu_cache`` (HOST) and a device blocks cache."""
        self._check_is_inited()
        check_isinstance("src", src, KvCache, allow_none=False)
        check_isinstance("dst", dst, KvCache, allow_none=False)
        check_isinstance("src_to_dst", src_to_dst, dict, int, allow_none=False)
        self._cache_manager.swap_blocks(self._swap_side(src), self._swap_side(dst), src_to_dst)

    def _swap_side(self, cache: KvCache) -> Cache:
        if self._is_cpu_cache(cache):
            per_device = cache.per_device_tensor_addrs
            raise_if_false(isinstance(per_device, list) and len(per_device) == 1,
                           "Param invalid, per_device_tensor_addrs size:{0} of the cpu cache should be equal to "
                           "device num:1.", len(per_device) if isinstance(per_device, list) else per_device)
            addrs = per_device[0]
            check_isinstance("cpu cache addrs", addrs, list, int, allow_none=False)
            return Cache(-1, cache.cache_desc, list(addrs), None, False, True)
        return self._as_cache(cache)

    # ------------------------------------------------------------------ layer-wise transfer (PROMPT)
    def transfer_cache_async(self, src_cache: KvCache, layer_synchronizer: LayerSynchronizer,
                             transfer_configs: Union[List[TransferConfig], Tuple[TransferConfig]],
                             src_block_indices: Optional[Union[List[int], Tuple[int, ...]]] = None,
                             dst_block_indices: Optional[Union[List[int], Tuple[int, ...]]] = None,
                             dst_block_memory_size: Optional[int] = None) -> CacheTask:
        """PROMPT: send ``src_cache`` layer by layer as ``layer_synchronizer`` releases each layer.

        As upstream's v1 path: ``TransferConfig`` (raw destination addresses) only (anything else,
        ``TransferWithCacheKeyConfig`` included, is ``TypeError``); a cache source with
        ``dst_block_indices`` given (cache to blocks) and a blocks source without destination blocks
        are ``LLM_PARAM_INVALID``."""
        self._check_is_inited()
        self._check_role("[transfer_cache_async]", LLMRole.PROMPT)
        check_isinstance("src_cache", src_cache, KvCache, allow_none=False)
        src_blocks = self._block_list("src_block_indices", src_block_indices)
        dst_blocks = self._block_list("dst_block_indices", dst_block_indices)
        if dst_block_memory_size is not None:
            check_uint64("dst_block_memory_size", dst_block_memory_size)
        if src_blocks:
            raise_if_false(dst_blocks, "transfer from blocks to cache is not supported")
            dst_n = len(dst_blocks or ())   # dst_blocks is a non-empty list here (refused just above)
            raise_if_false(len(src_blocks) == dst_n,
                           "num_block_indices mismatches, src_num = {0}, dst_num = {1}",
                           len(src_blocks), dst_n)
        else:
            raise_if_true(dst_blocks is not None, "transfer from cache to blocks is not supported")
        check_isinstance("layer_synchronizer", layer_synchronizer, LayerSynchronizer, allow_none=False)
        check_isinstance("transfer_configs", transfer_configs, (list, tuple), inner_class=TransferConfig,
                         allow_none=False)
        raise_if_false(dst_blocks or dst_block_memory_size in (None, 0),
                       "dst_block_memory_size ({0}) is neither None nor 0 while dst is not blocks",
                       dst_block_memory_size)
        raise_if_false(len(transfer_configs) > 0, "transfer_configs can not be empty.")
        raise_if_true(self._is_cpu_cache(src_cache), "Only support device cache")
        desc = src_cache.cache_desc
        raise_if_false(desc.num_tensors % 2 == 0, "cache_desc.num_tensors ({0}) is not even", desc.num_tensors)
        layers = desc.num_tensors // _NUM_TENSORS_PER_LAYER
        for config in transfer_configs:
            if config.src_layer_range is None:
                config.src_layer_range = range(0, layers)  # as upstream: the config is completed in place
            rng = config.src_layer_range
            if src_blocks:
                raise_if_false(config.src_batch_index == 0,
                               "Invalid TransferConfig, src_batch_index ({0}) != 0 while src is blocks",
                               config.src_batch_index)
            raise_if_false(0 <= rng.start < rng.stop <= layers, "src_layer_range: {0} out of range, src_layer_num = {1}",
                           rng, layers)
            raise_if_false(len(config.dst_addrs) == len(rng) * _NUM_TENSORS_PER_LAYER,
                           "expect {0} dst_addrs, but len(dst_addrs) = {1}, range = {2}",
                           len(rng) * _NUM_TENSORS_PER_LAYER, len(config.dst_addrs), rng)
        rec = self._live(src_cache)
        raise_if_false(not src_blocks or rec.is_blocks, "src_block_indices need a blocks cache as the source.")
        task = self._transfers().transfer_async(src_cache, layer_synchronizer, list(transfer_configs),
                                                src_block_indices=src_blocks or None,
                                                dst_block_indices=dst_blocks or None,
                                                dst_block_memory_size=dst_block_memory_size)
        return _V1CacheTask(task)

    @staticmethod
    def _block_list(name: str, blocks) -> Optional[list]:
        if blocks is None:
            return None
        check_isinstance(name, blocks, (list, tuple), allow_none=False)
        for i, b in enumerate(blocks):
            check_uint64(f"{name}[{i}]", b)
        return list(blocks)
