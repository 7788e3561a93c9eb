"""``CacheManager``'s remote operations (spec section 7): argument checks, then the data plane.

They need the data plane (``_transfer.TransferEngine``), which the engine attaches as
``cache_manager._transfers``; a cache manager without one refuses them.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple, TypeGuard, Union

from llmdd._base.enums import Placement
from llmdd._data.fence import BlockFence
from llmdd._data.owner import MAX_NOTES
from llmdd._protocol.messages import MAX_TAG_BYTES
from llmdd._base.status import LLMException, LLMStatusCode, raise_if_false, raise_if_true
from llmdd._base.types import (BlocksCacheKey, Cache, CacheKey, CacheKeyByIdAndIndex, CacheTask, LayerSynchronizer,
                     TransferConfig, TransferWithCacheKeyConfig, check_cache_key, check_layer_range)
from llmdd._base.validation import check_int64, check_isinstance, check_uint32, check_uint64

__all__ = ["RemoteOperations"]

_NUM_TENSORS_PER_LAYER = 2


_PULL_KWARGS = ("src_layer_range", "dst_layer_range", "tensor_num_per_layer")
_PULL_KWARG_SET = frozenset(_PULL_KWARGS)


def _check_pull_kwargs(kwargs: dict) -> tuple:
    for name in kwargs:
        raise_if_false(name in _PULL_KWARGS, "Unsupported param:{}", name)
    src_range = kwargs.get("src_layer_range")
    dst_range = kwargs.get("dst_layer_range")
    tnpl = kwargs.get("tensor_num_per_layer", _NUM_TENSORS_PER_LAYER)
    check_isinstance("src_layer_range", src_range, range)
    check_isinstance("dst_layer_range", dst_range, range)
    check_uint32("tensor_num_per_layer", tnpl)
    raise_if_false(tnpl > 0, "tensor_num_per_layer must be > 0, but got {}.", tnpl)
    return src_range, dst_range, int(tnpl)


def _check_blocks(name: str, blocks) -> list:
    check_isinstance(name, blocks, (list, tuple), allow_none=False)
    for i, b in enumerate(blocks):
        check_uint64(f"{name}[{i}]", b)
    return [int(b) for b in blocks]  # a bool passes as upstream and travels as the int it stands for


_U64_MAX = 2**64 - 1
_U32_MAX = 2**32 - 1


def _plain_blocks(src_blocks, dst_blocks) -> bool:
    """True when both block lists are what the small-transfer path takes without further checks:
    a list or tuple each, of equal non-zero length (at most 16), of ``int`` (not bool) in uint64."""
    ts, td = type(src_blocks), type(dst_blocks)
    if (ts is not list and ts is not tuple) or (td is not list and td is not tuple):
        return False
    n = len(dst_blocks)
    if not 0 < n <= 16 or len(src_blocks) != n:
        return False
    top = _U64_MAX
    for b in src_blocks:
        if type(b) is not int or b < 0 or b > top:
            return False
    for b in dst_blocks:
        if type(b) is not int or b < 0 or b > top:
            return False
    return True


def _plain_layers(layers: object) -> TypeGuard[range]:
    """A layer range that :func:`check_layer_range` accepts, given explicitly (push's defaults
    depend on the cache: the full path computes them)."""
    return type(layers) is range and layers.step == 1 and 0 <= layers.start < layers.stop


def _quick_engine(self, key, cache):
    """The data plane when a blocks call may take the small-transfer path: an initialized manager
    with a data plane, a ``BlocksCacheKey`` and a blocks ``Cache`` of exactly those types; else None
    (the full checks then run and raise what the contract says)."""
    if type(key) is not BlocksCacheKey or type(cache) is not Cache or not cache.is_blocks_cache:
        return None
    if not self._initialized:
        return None
    return getattr(self, "_transfers", None)


def _check_tag(tag) -> Optional[tuple]:
    """An llmdd extension: the opaque tag of a transfer (bytes or str, at most 256 bytes in UTF-8),
    delivered to the owner with that transfer's "peer finished reading/writing" event."""
    if tag is None:
        return None
    if isinstance(tag, str):
        data, is_str = tag.encode("utf-8"), True
    elif isinstance(tag, (bytes, bytearray, memoryview)):
        data, is_str = bytes(tag), False
    else:
        raise TypeError(f"tag only support ['bytes', 'str'], but got {type(tag)}")
    raise_if_false(len(data) <= MAX_TAG_BYTES, "tag must be at most {} bytes, but got {}.", MAX_TAG_BYTES, len(data))
    return data, is_str


def _check_callback(callback) -> None:
    raise_if_false(callback is None or callable(callback), "callback must be callable or None.")


def _check_size(size) -> None:
    check_int64("size", size)
    raise_if_false(size == -1 or size > 0, "size must be -1 or > 0, but got {}.", size)


def _transfers(self):
    self._check_is_inited()
    engine = getattr(self, "_transfers", None)
    if engine is None:
        raise LLMException("the data plane is not available", status_code=LLMStatusCode.LLM_FAILED)
    return engine


def _default_layers(cache: Cache, tnpl: int, src_range, dst_range) -> tuple:
    """Upstream's defaults: every whole layer, ``range(0, num_tensors // tnpl)`` (empty when the
    cache has fewer tensors than a layer: the push then sends nothing)."""
    check_layer_range("src_layer_range", src_range)
    check_layer_range("dst_layer_range", dst_range)
    layers = cache.cache_desc.num_tensors // tnpl
    src_range = range(0, layers) if src_range is None else src_range
    dst_range = range(0, layers) if dst_range is None else dst_range
    check_isinstance("src_layer_range", src_range, range, allow_none=False)
    check_isinstance("dst_layer_range", dst_range, range, allow_none=False)
    raise_if_false(len(src_range) == len(dst_range),
                   "src_layer_range and dst_layer_range must have the same length, but got {} and {}.",
                   len(src_range), len(dst_range))
    return src_range, dst_range


class RemoteOperations:
    """Mixin of ``CacheManager``: pulls, pushes and the layer-wise async transfer."""

    _enable_remote_cache_accessible: bool   # the host's option (CacheManager.__init__)

    def pull_cache(self, cache_key: Union[CacheKey, CacheKeyByIdAndIndex], cache: Cache,
                   batch_index: int = 0, size: int = -1, *, tag: Optional[Union[bytes, str]] = None,
                   **kwargs) -> None:
        """Pull a remote cache (by ``CacheKey`` or ``CacheKeyByIdAndIndex``) into a local non-blocks cache.

        ``tag`` (llmdd extension, keyword only): delivered to the owner with this pull's "peer
        finished reading" event (acknowledged before the call returns)."""
        self._prepare_pull_cache(cache_key, cache, batch_index, size, tag, kwargs)[1]()

    def pull_cache_async(self, cache_key: Union[CacheKey, CacheKeyByIdAndIndex], cache: Cache,
                         batch_index: int = 0, size: int = -1, *, tag: Optional[Union[bytes, str]] = None,
                         callback: Optional[Callable[[LLMStatusCode], None]] = None, **kwargs) -> CacheTask:
        """llmdd extension: :meth:`pull_cache` without blocking the caller; returns a ``CacheTask``
        (``synchronize`` / ``get_results``; one result) and calls ``callback(status)`` once when done.
        Arguments are checked at once (a bad one raises here, as for the blocking call)."""
        _check_callback(callback)
        engine, run = self._prepare_pull_cache(cache_key, cache, batch_index, size, tag, kwargs)
        return CacheTask(engine.submit_pull(cache_key.cluster_id, run, callback, kind="pull_cache_async"))

    def _prepare_pull_cache(self, cache_key, cache, batch_index, size, tag, kwargs) -> tuple:
        engine = _transfers(self)
        if self._enable_remote_cache_accessible:
            check_isinstance("cache_key", cache_key, CacheKeyByIdAndIndex, allow_none=False)
        else:
            check_isinstance("cache_key", cache_key, (CacheKey, CacheKeyByIdAndIndex), allow_none=False)
        check_isinstance("cache", cache, Cache, allow_none=False)
        raise_if_true(cache.is_blocks_cache, "pull_cache does not support a blocks cache, use pull_blocks.")
        check_uint32("batch_index", batch_index)
        _check_size(size)
        src_range, dst_range, tnpl = _check_pull_kwargs(kwargs)
        wire_tag = _check_tag(tag)
        if isinstance(cache_key, CacheKey):
            check_cache_key(cache_key)

        def run() -> None:
            engine.pull(cache_key, cache, kind="pull_cache", batch_index=int(batch_index), size=int(size),
                        src_layer_range=src_range, dst_layer_range=dst_range, tnpl=tnpl, tag=wire_tag)
        return engine, run

    def pull_blocks(self, src_cache_key: Union[CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey],
                    dst_cache: Cache, src_blocks: Optional[Union[Tuple[int, ...], List[int]]] = (),
                    dst_blocks: Union[Tuple[int, ...], List[int]] = (), *, tag: Optional[Union[bytes, str]] = None,
                    fence: Optional[BlockFence] = None, **kwargs) -> None:
        """Pull remote blocks (or a contiguous remote batch slot) into blocks of a local blocks cache.

        ``tag`` (llmdd extension, keyword only): delivered to the owner with this pull's "peer
        finished reading" event (acknowledged before the call returns).  ``fence`` (llmdd
        extension, keyword only; a :class:`BlockFence` from the owner's :meth:`block_fence`): the
        pull succeeds only if the owner has not fenced those blocks before its check after the
        copy, else it fails with ``LLM_KV_CACHE_NOT_EXIST`` (docs/fencing.md)."""
        if tag is None and fence is None and len(kwargs) <= 3:
            # the small-transfer path: arguments that pass every check below as they are
            engine = _quick_engine(self, src_cache_key, dst_cache)
            if engine is not None and _plain_blocks(src_blocks, dst_blocks):
                src_range = kwargs.get("src_layer_range")
                dst_range = kwargs.get("dst_layer_range")
                tnpl = kwargs.get("tensor_num_per_layer", _NUM_TENSORS_PER_LAYER)
                if ((src_range is None or type(src_range) is range) and (dst_range is None or type(dst_range) is range)
                        and type(tnpl) is int and 0 < tnpl <= _U32_MAX
                        and kwargs.keys() <= _PULL_KWARG_SET):
                    engine.pull(src_cache_key, dst_cache, kind="pull_blocks", src_blocks=src_blocks,
                                dst_blocks=dst_blocks, src_layer_range=src_range, dst_layer_range=dst_range, tnpl=tnpl)
                    return
        self._prepare_pull_blocks(src_cache_key, dst_cache, src_blocks, dst_blocks, tag, kwargs, fence)[1]()

    def pull_blocks_async(self, src_cache_key: Union[CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey],
                          dst_cache: Cache, src_blocks: Optional[Union[Tuple[int, ...], List[int]]] = (),
                          dst_blocks: Union[Tuple[int, ...], List[int]] = (), *, tag: Optional[Union[bytes, str]] = None,
                          callback: Optional[Callable[[LLMStatusCode], None]] = None,
                          fence: Optional[BlockFence] = None, **kwargs) -> CacheTask:
        """llmdd extension: :meth:`pull_blocks` without blocking the caller; returns a ``CacheTask``
        (``synchronize`` / ``get_results``; one result) and calls ``callback(status)`` once when done.
        Many may be in flight per link; arguments are checked at once (a bad one raises here)."""
        _check_callback(callback)
        engine, run = self._prepare_pull_blocks(src_cache_key, dst_cache, src_blocks, dst_blocks, tag, kwargs, fence)
        return CacheTask(engine.submit_pull(src_cache_key.cluster_id, run, callback, kind="pull_blocks_async"))

    # ------------------------------------------------------------------ fences and notes (llmdd extensions)
    def notify_owner(self, cache_key: BlocksCacheKey, notes: Union[Tuple[Union[bytes, str], ...],
                                                                 List[Union[bytes, str]]]) -> None:
        """llmdd extension, reader side: deliver ``notes`` (1 to 1024 texts or byte strings of at most
        256 bytes each) to the owner of ``cache_key`` (a linked cluster), where they fire one
        ``peer_note`` cache event on that cache (``info["notes"]``, ``info["peer"]``); returns when the
        owner handled them (sync_kv_timeout: ``LLM_TIMEOUT``).  ``LLM_KV_CACHE_NOT_EXIST`` when the
        owner's cache is gone."""
        engine = _transfers(self)
        check_isinstance("cache_key", cache_key, BlocksCacheKey, allow_none=False)
        check_isinstance("notes", notes, (list, tuple), allow_none=False)
        raise_if_false(0 < len(notes) <= MAX_NOTES, "notes must hold 1 to {} notes, but got {}.", MAX_NOTES,
                       len(notes))
        wire = []
        for note in notes:
            data = _check_tag(note)
            raise_if_true(data is None, "a note must be bytes or str")
            wire.append(note if isinstance(note, str) else bytes(note))
        engine.notify_owner(cache_key, wire)

    def _prepare_pull_blocks(self, src_cache_key, dst_cache, src_blocks, dst_blocks, tag, kwargs,
                             fence: Optional[BlockFence] = None) -> tuple:
        engine = _transfers(self)
        check_isinstance("src_cache_key", src_cache_key, (CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey),
                         allow_none=False)
        check_isinstance("dst_cache", dst_cache, Cache, allow_none=False)
        raise_if_false(dst_cache.is_blocks_cache, "dst_cache must be a blocks cache.")
        src_list = _check_blocks("src_blocks", () if src_blocks is None else src_blocks)
        dst_list = _check_blocks("dst_blocks", dst_blocks)
        raise_if_false(len(dst_list) > 0, "dst_blocks can not be empty.")
        if isinstance(src_cache_key, BlocksCacheKey):
            raise_if_false(len(src_list) > 0, "src_blocks can not be empty when src_cache_key is a BlocksCacheKey.")
            raise_if_false(len(src_list) == len(dst_list),
                           "src_blocks and dst_blocks must have the same length, but got {} and {}.",
                           len(src_list), len(dst_list))
        else:
            raise_if_false(len(src_list) == 0, "src_blocks must be empty when pulling from a non-blocks cache key.")
        src_range, dst_range, tnpl = _check_pull_kwargs(kwargs)
        wire_tag = _check_tag(tag)
        if isinstance(src_cache_key, CacheKey):
            check_cache_key(src_cache_key)
        check_isinstance("fence", fence, BlockFence)
        if fence is not None:
            raise_if_false(len(fence.generations) == len(src_list),
                           "fence must name one generation per source block, but got {} for {}.",
                           len(fence.generations), len(src_list))

        def run() -> None:
            engine.pull(src_cache_key, dst_cache, kind="pull_blocks", src_blocks=src_list or None,
                        dst_blocks=dst_list, src_layer_range=src_range, dst_layer_range=dst_range, tnpl=tnpl,
                        tag=wire_tag, fence=fence)
        return engine, run

    def push_cache(self, dst_cache_key: CacheKeyByIdAndIndex, src_cache: Cache,
                   src_batch_index: int = 0, src_layer_range: Optional[range] = None,
                   dst_layer_range: Optional[range] = None,
                   size: int = -1, tensor_num_per_layer: int = _NUM_TENSORS_PER_LAYER, *,
                   tag: Optional[Union[bytes, str]] = None) -> None:
        """Push a local non-blocks cache into a remote cache addressed by id and batch index.

        ``tag`` (llmdd extension, keyword only): delivered to the owner with this push's "peer
        finished writing" event (acknowledged before the call returns)."""
        engine = _transfers(self)
        raise_if_false(self._enable_remote_cache_accessible,
                       "push_cache requires enable_remote_cache_accessible to be True.")
        check_isinstance("dst_cache_key", dst_cache_key, CacheKeyByIdAndIndex, allow_none=False)
        check_isinstance("src_cache", src_cache, Cache, allow_none=False)
        raise_if_true(src_cache.is_blocks_cache, "push_cache does not support a blocks cache, use push_blocks.")
        check_uint32("src_batch_index", src_batch_index)
        check_int64("size", size)
        raise_if_false(size == -1, "push_cache only supports size -1, but got {}.", size)
        check_uint32("tensor_num_per_layer", tensor_num_per_layer)
        raise_if_false(tensor_num_per_layer > 0, "tensor_num_per_layer must be > 0.")
        src_range, dst_range = _default_layers(src_cache, tensor_num_per_layer, src_layer_range, dst_layer_range)
        if not src_range:
            return
        wire_tag = _check_tag(tag)
        engine.push(dst_cache_key, src_cache, kind="push_cache", src_batch_index=int(src_batch_index),
                    src_layer_range=src_range, dst_layer_range=dst_range, tnpl=int(tensor_num_per_layer),
                    tag=wire_tag)

    def push_blocks(self, dst_cache_key: BlocksCacheKey, src_cache: Cache,
                    src_blocks: Optional[Union[Tuple[int, ...], List[int]]] = (),
                    dst_blocks: Union[Tuple[int, ...], List[int]] = (), src_layer_range: Optional[range] = None,
                    dst_layer_range: Optional[range] = None, tensor_num_per_layer: int = _NUM_TENSORS_PER_LAYER, *,
                    tag: Optional[Union[bytes, str]] = None) -> None:
        """Push blocks of a local blocks cache into blocks of a remote blocks cache.

        ``tag`` (llmdd extension, keyword only): delivered to the owner with this push's "peer
        finished writing" event (acknowledged before the call returns)."""
        if (tag is None and type(tensor_num_per_layer) is int and 0 < tensor_num_per_layer <= _U32_MAX
                and _plain_layers(src_layer_range) and _plain_layers(dst_layer_range)
                and len(src_layer_range) == len(dst_layer_range) and self._enable_remote_cache_accessible):
            # the small-transfer path: arguments that pass every check below as they are
            engine = _quick_engine(self, dst_cache_key, src_cache)
            if engine is not None and _plain_blocks(src_blocks, dst_blocks):
                engine.push(dst_cache_key, src_cache, kind="push_blocks", src_blocks=src_blocks, dst_blocks=dst_blocks,
                            src_layer_range=src_layer_range, dst_layer_range=dst_layer_range,
                            tnpl=tensor_num_per_layer)
                return
        engine = _transfers(self)
        raise_if_false(self._enable_remote_cache_accessible,
                       "push_blocks requires enable_remote_cache_accessible to be True.")
        check_isinstance("dst_cache_key", dst_cache_key, (BlocksCacheKey, CacheKeyByIdAndIndex), allow_none=False)
        check_isinstance("src_cache", src_cache, Cache, allow_none=False)
        raise_if_false(src_cache.is_blocks_cache, "src_cache must be a blocks cache.")
        src_list = _check_blocks("src_blocks", () if src_blocks is None else src_blocks)
        dst_list = _check_blocks("dst_blocks", dst_blocks)
        raise_if_false(len(dst_list) > 0, "dst_blocks can not be empty.")
        raise_if_false(len(src_list) == len(dst_list),
                       "src_blocks and dst_blocks must have the same length, but got {} and {}.",
                       len(src_list), len(dst_list))
        check_uint32("tensor_num_per_layer", tensor_num_per_layer)
        raise_if_false(tensor_num_per_layer > 0, "tensor_num_per_layer must be > 0.")
        src_range, dst_range = _default_layers(src_cache, tensor_num_per_layer, src_layer_range, dst_layer_range)
        if not src_range:
            return
        wire_tag = _check_tag(tag)
        engine.push(dst_cache_key, src_cache, kind="push_blocks", src_blocks=src_list, dst_blocks=dst_list,
                    src_layer_range=src_range, dst_layer_range=dst_range, tnpl=int(tensor_num_per_layer),
                    tag=wire_tag)

    def transfer_cache_async(self, src_cache: Cache, layer_synchronizer: LayerSynchronizer,
                             transfer_configs: Union[List[Union[TransferConfig, TransferWithCacheKeyConfig]],
                                                     Tuple[Union[TransferConfig, TransferWithCacheKeyConfig]]],
                             src_block_indices: Optional[Union[List[int], Tuple[int, ...]]] = None,
                             dst_block_indices: Optional[Union[List[int], Tuple[int, ...]]] = None,
                             dst_block_memory_size: Optional[int] = None) -> CacheTask:
        """Transfer layer by layer as ``layer_synchronizer`` releases each layer; returns a ``CacheTask``."""
        engine = _transfers(self)
        check_isinstance("src_cache", src_cache, Cache, allow_none=False)
        check_isinstance("layer_synchronizer", layer_synchronizer, LayerSynchronizer, allow_none=False)
        raise_if_true(src_cache.cache_desc.placement == Placement.HOST,
                      "transfer_cache_async does not support a source cache in host memory.")
        config_cls = TransferWithCacheKeyConfig if self._enable_remote_cache_accessible else TransferConfig
        check_isinstance("transfer_configs", transfer_configs, (list, tuple), inner_class=config_cls,
                         extra_fmt="While enable_remote_cache_accessible is True, "
                         if self._enable_remote_cache_accessible else "", allow_none=False)
        raise_if_false(len(transfer_configs) > 0, "transfer_configs can not be empty.")
        raise_if_false(src_cache.cache_desc.num_tensors % 2 == 0,
                       "transfer_cache_async needs an even number of tensors (2 per layer), but got {}.",
                       src_cache.cache_desc.num_tensors)
        # an empty block list counts as none (upstream tests the lists' truth): with no dst blocks the
        # transfer is cache to cache whatever kind the source cache is
        src_blocks = None if src_block_indices is None else _check_blocks("src_block_indices", src_block_indices)
        dst_blocks = None if dst_block_indices is None else _check_blocks("dst_block_indices", dst_block_indices)
        src_blocks = src_blocks or None
        dst_blocks = dst_blocks or None
        if dst_block_memory_size is not None:
            check_uint64("dst_block_memory_size", dst_block_memory_size)
        raise_if_true(src_blocks is not None and dst_blocks is None,
                      "transfer from a blocks cache to a non-blocks cache is not supported.")
        if src_blocks is not None:
            raise_if_false(dst_blocks is not None and len(src_blocks) == len(dst_blocks),
                           "src_block_indices and dst_block_indices must have the same length.")
        elif dst_blocks is not None:
            raise_if_false(bool(dst_block_memory_size),
                           "dst_block_memory_size is required to transfer a cache into blocks.")
        else:
            raise_if_false(dst_block_memory_size in (None, 0),
                           "dst_block_memory_size must be None or 0 for a non-blocks destination.")
        layers = src_cache.cache_desc.num_tensors // 2
        for config in transfer_configs:
            rng = config.src_layer_range
            raise_if_true(src_blocks is not None and config.src_batch_index != 0,
                          "src_batch_index ({}) must be 0 when the source is blocks.", config.src_batch_index)
            if rng is not None:
                raise_if_false(rng.stop <= layers, "src_layer_range {} exceeds the {} layers of the cache.", rng, layers)
            if isinstance(config, TransferConfig):
                count = len(rng) if rng is not None else layers
                raise_if_false(len(config.dst_addrs) == 2 * count,
                               "dst_addrs must hold 2 addresses per transferred layer ({}), but got {}.",
                               2 * count, len(config.dst_addrs))
            else:
                raise_if_true(isinstance(config.cache_key, BlocksCacheKey) and config.src_batch_index != 0,
                              "src_batch_index must be 0 with a BlocksCacheKey.")
        task = engine.transfer_async(src_cache, layer_synchronizer, list(transfer_configs),
                                     src_block_indices=src_blocks, dst_block_indices=dst_blocks,
                                     dst_block_memory_size=None if dst_block_memory_size is None
                                     else int(dst_block_memory_size))
        return CacheTask(task)
