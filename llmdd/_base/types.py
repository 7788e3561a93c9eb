"""Data classes of the llm_datadist v2 contract (docs/concepts.md; upstream's: hicann/hixl
``docs/zh/api/python/``).

These keep upstream's shape: plain, mutable Python classes with validating
constructors, read-only properties and (where the contract lists them)
validating setters.  Equality follows what the objects are:

* the keys (``CacheKey``, ``CacheKeyByIdAndIndex``, ``BlocksCacheKey``) and
  ``MemInfo`` have no setters, so they compare and hash **by value** (clients use
  keys as dict keys);
* everything with setters or in-place mutation (``CacheDesc.update_dim``,
  ``CacheDesc._is_blocks``, ``Cache._tensor_addrs``, the transfer configs) keeps
  identity equality and identity hashing, as upstream, so a hash never changes
  under a dict.

Exceptions follow the contract: a wrong type is ``TypeError``, an integer out
of its range is ``ValueError``, a semantic violation is
``LLMException(LLM_PARAM_INVALID)``.  Where upstream lets ``None`` slip through
a type check into a later crash (``data_type``, ``placement``, ``MemInfo`` and
``BlocksCacheKey`` fields, ``create_cpu_cache`` arguments), llmdd raises the
``TypeError`` up front.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, List, Optional, Protocol, Sequence, Tuple, Union, cast, runtime_checkable

from llmdd._base.enums import DTYPE_ITEMSIZE, DataType, Memtype, Placement
from llmdd._base.log import get_logger
from llmdd._base.status import LLMException, LLMStatusCode, raise_if_false, raise_if_true
from llmdd._base.validation import (
    INVALID_ID,
    check_int32,
    check_int64,
    check_isinstance,
    check_list_int64,
    check_list_uint64,
    check_uint32,
    check_uint64,
)

__all__ = [
    "CacheDesc",
    "Cache",
    "KvCache",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "BlocksCacheKey",
    "MemInfo",
    "LayerSynchronizer",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
    "CacheTask",
    "check_layer_range",
    "check_cache_key",
    "cache_key_index",
    "is_valid_id",
    "is_invalid_id",
]

_log = get_logger("llmdd.types")

_INT64_MAX = 2**63 - 1


def is_invalid_id(req_id_or_prefix_id: int) -> bool:
    """An id is invalid when negative or the ``2**64-1`` sentinel."""
    return req_id_or_prefix_id < 0 or req_id_or_prefix_id == INVALID_ID


def is_valid_id(req_id_or_prefix_id: int) -> bool:
    """``0 <= id < 2**64-1``."""
    return not is_invalid_id(req_id_or_prefix_id)


# --------------------------------------------------------------------- CacheDesc


class CacheDesc:
    """Description of a cache: ``num_tensors`` tensors of one ``shape`` and ``data_type``.

    ``size`` is the byte size of ONE tensor (``prod(shape) * itemsize``), computed
    on first use and cached until :meth:`update_dim`.  ``batch_size`` is
    ``shape[batch_dim_index]`` taken at construction (``update_dim`` does not
    change it, as upstream).  ``shape`` returns the very object passed in.
    """

    def __init__(self,
                 num_tensors: int,
                 shape: Union[Tuple[int, ...], List[int]],
                 data_type: DataType,
                 placement: Placement = Placement.DEVICE,
                 batch_dim_index: int = 0,
                 seq_len_dim_index: int = -1,
                 kv_tensor_format: Optional[str] = None) -> None:
        check_uint32("num_tensors", num_tensors)
        check_isinstance("shape", shape, [tuple, list], int, allow_none=False)
        check_isinstance("data_type", data_type, DataType, allow_none=False)
        check_isinstance("placement", placement, Placement, allow_none=False)
        check_isinstance("batch_dim_index", batch_dim_index, int, allow_none=False)
        check_int32("seq_len_dim_index", seq_len_dim_index)
        check_isinstance("kv_tensor_format", kv_tensor_format, str)
        raise_if_false(0 <= batch_dim_index < len(shape),
                       "batch_dim_index {0} out of range, [0, {1})", batch_dim_index, len(shape))
        raise_if_false(seq_len_dim_index == -1 or 0 <= seq_len_dim_index < len(shape),
                       "seq_len_dim_index {0} is invalid, should be -1 or in range [0, {1})",
                       seq_len_dim_index, len(shape))
        check_list_int64("shape", shape)
        self._num_tensors = num_tensors
        self._shape = shape
        self._data_type = data_type
        self._placement = placement
        self._batch_dim = batch_dim_index
        self._batch_size = shape[batch_dim_index]
        self._seq_len_dim_index = seq_len_dim_index
        self._kv_tensor_format = kv_tensor_format
        self._size = -1
        self._is_blocks = False

    def __repr__(self) -> str:
        return (f"CacheDesc(num_tensors={self._num_tensors}, "
                f"shape={self._shape}, "
                f"data_type={self._data_type}, "
                f"placement={self._placement}, "
                f"batch_dim_index={self._batch_dim}, "
                f"seq_len_dim_index={self._seq_len_dim_index},"
                f"kv_tensor_format={self._kv_tensor_format})")

    @property
    def num_tensors(self) -> int:
        return self._num_tensors

    @property
    def shape(self) -> Union[Tuple[int, ...], List[int]]:
        return self._shape

    @property
    def data_type(self) -> DataType:
        return self._data_type

    @property
    def placement(self) -> Placement:
        return self._placement

    @property
    def batch_dim(self) -> int:
        return self._batch_dim

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def seq_len_dim_index(self) -> int:
        return self._seq_len_dim_index

    @property
    def kv_tensor_format(self) -> Optional[str]:
        return self._kv_tensor_format

    @property
    def size(self) -> int:
        """Bytes of one tensor; ``LLMException`` for DT_STRING, negative dims or int64 overflow."""
        if self._size == -1:
            self._size = self._calc_tensor_size()
        return self._size

    def _calc_tensor_size(self) -> int:
        itemsize = DTYPE_ITEMSIZE.get(self._data_type)
        if itemsize is not None and all(dim >= 0 for dim in self._shape):
            size = math.prod(self._shape) * itemsize
        else:
            size = -1
        if not 0 <= size <= _INT64_MAX:
            raise LLMException(f"Failed to calc tensor size, shape = {self._shape}, data_type = {self._data_type}",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        return size

    def update_dim(self, dim_index: int, dim_value: int) -> None:
        """Set ``shape[dim_index] = dim_value`` in place (the caller's list) and drop the size cache."""
        check_isinstance("dim_index", dim_index, int, allow_none=False)
        check_isinstance("dim_value", dim_value, int, allow_none=False)
        shape = self._shape
        if isinstance(shape, tuple):  # upstream's behaviour: a tuple shape cannot be updated in place
            raise TypeError("'tuple' object does not support item assignment")
        shape[dim_index] = dim_value
        self._size = -1


# ------------------------------------------------------------------ Cache, KvCache


class Cache:
    """A registered or allocated cache (returned by the cache manager; users should not build one).

    ``tensor_addrs`` is one address per tensor.  ``per_device_tensor_addrs`` is a
    compatible superset of upstream's v2 ``Cache`` (``[tensor_addrs]``, the v1
    ``KvCache`` shape).  The cache manager may set ``_tensor_addrs`` and
    ``_valid`` (deallocation empties the addresses and invalidates the cache).
    """

    def __init__(self,
                 cache_id: int,
                 cache_desc: CacheDesc,
                 tensor_addrs: List[int],
                 cache_manager: Any = None,
                 is_registered: bool = False,
                 is_blocks_cache: bool = False) -> None:
        check_int64("cache_id", cache_id)
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._tensor_addrs = tensor_addrs
        self._valid = True
        self._cache_manager = cache_manager
        self._is_registered = is_registered
        self._is_blocks_cache = is_blocks_cache

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: List[int]) -> "Cache":
        """A HOST blocks cache over caller-owned memory (cache_id -1), for ``swap_blocks``."""
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("addrs", addrs, list, int, allow_none=False)
        raise_if_false(cache_desc.placement == Placement.HOST, "cache_desc placement must be HOST")
        raise_if_false(cache_desc.num_tensors == len(addrs),
                       "cache_desc num_tensors:{0} not equal addrs num:{1}", cache_desc.num_tensors, len(addrs))
        return cls(-1, cache_desc, addrs, None, False, True)

    @property
    def cache_id(self) -> int:
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        return self._cache_desc

    @property
    def tensor_addrs(self) -> List[int]:
        return self._tensor_addrs

    @property
    def per_device_tensor_addrs(self) -> List[List[int]]:
        return [self._tensor_addrs]

    @property
    def is_blocks_cache(self) -> bool:
        return self._is_blocks_cache

    def __str__(self) -> str:
        return (f"Cache(cache_id = {self._cache_id}, device_tensor_addrs = {len(self._tensor_addrs)}, "
                f"is_blocks_cache = {self._is_blocks_cache})")

    __repr__ = __str__


class KvCache:
    """v1-style cache (exported for compatibility): one address list per device.

    As upstream, a still-valid ``KvCache`` whose manager is initialised is
    deallocated when garbage-collected; errors there are logged, never raised.
    """

    def __init__(self,
                 cache_id: int,
                 cache_desc: CacheDesc,
                 per_device_tensor_addrs: List[List[int]],
                 kv_cache_manager: Any = None) -> None:
        self._valid = False
        self._kv_cache_manager = None
        check_int64("cache_id", cache_id)
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._per_device_tensor_addrs = per_device_tensor_addrs
        self._kv_cache_manager = kv_cache_manager
        self._valid = True

    def __del__(self) -> None:
        manager = self._kv_cache_manager
        if not self._valid or manager is None:
            return
        try:
            if manager.is_initialized():
                manager.deallocate_cache(self)
        except Exception as exc:  # never raise from a finaliser
            _log.warning("llmdd.cache.auto_deallocate_failed", cache_id=self._cache_id, error=str(exc))

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: Union[List[int], List[List[int]]]) -> "KvCache":
        """A HOST cache over caller-owned memory (cache_id -1); ``addrs`` flat or per device."""
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        raise_if_false(cache_desc.placement == Placement.HOST, "cache_desc placement must be HOST")
        check_isinstance("addrs", addrs, list, allow_none=False)
        raise_if_false(len(addrs) > 0, "addrs length should be bigger than zero.")
        first_type = list if isinstance(addrs[0], list) else int
        for addr in addrs:
            check_isinstance("the internal element of addrs", addr, [list, int], allow_none=False)
            raise_if_false(isinstance(addr, first_type),
                           "the type of the internal element of addrs should be consistent.")
            if isinstance(addr, list):
                check_isinstance("the internal element of addrs", addr, list, int)
                raise_if_false(cache_desc.num_tensors == len(addr),
                               "cache_desc num_tensors:{0} should be equal to size of the internal element "
                               "of addrs:{1}", cache_desc.num_tensors, len(addr))
        if first_type is int:
            raise_if_false(cache_desc.num_tensors == len(addrs),
                           "cache_desc num_tensors:{0} should be equal to size of addrs:{1}",
                           cache_desc.num_tensors, len(addrs))
            # cast: every element was checked to be of first_type, int here
            return cls(-1, cache_desc, [cast(List[int], addrs)], None)
        # cast: every element was checked to be of first_type, list (of ints) here
        return cls(-1, cache_desc, cast(List[List[int]], addrs), None)

    @property
    def cache_id(self) -> int:
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        return self._cache_desc

    @property
    def per_device_tensor_addrs(self) -> List[List[int]]:
        return self._per_device_tensor_addrs

    def __str__(self) -> str:
        return f"KvCache(cache_id = {self._cache_id}, num_devices = {len(self._per_device_tensor_addrs)})"

    __repr__ = __str__


# -------------------------------------------------------------------------- keys


def _gather_params(args: tuple, kwargs: dict, positional: Sequence[str]) -> dict:
    """Upstream's ``*args/**kwargs`` parsing: positional values override same-named keywords."""
    raise_if_false(len(args) + len(kwargs) <= len(positional), "Param num is over limit")
    params = dict(kwargs)
    for name, value in zip(positional, args):
        params[name] = value
    return params


class CacheKey:
    """Key of a cache batch slot on the prompt side: ``(cluster_id, req_id, model_id, prefix_id)``.

    ``CacheKey(cluster_id, req_id, model_id=0, prefix_id=2**64-1)`` positionally, or
    by keyword with ``prompt_cluster_id`` as an alias of ``cluster_id``.  The
    padding key has ``req_id == 2**64-1``.  Equal and hashed by value.
    """

    __slots__ = ("_cluster_id", "_req_id", "_model_id", "_prefix_id")

    def __init__(self, *args: int, **kwargs: int) -> None:
        params = _gather_params(args, kwargs, ("cluster_id", "req_id", "model_id", "prefix_id"))
        raise_if_false("prompt_cluster_id" in params or "cluster_id" in params,
                       "Param prompt_cluster_id or cluster_id is required")
        raise_if_false("req_id" in params, "Param req_id is required")
        for name in params:
            raise_if_false(name in ("prompt_cluster_id", "cluster_id", "req_id", "model_id", "prefix_id"),
                           "Unsupported param:{0}", name)
        cluster_id = params["cluster_id"] if "cluster_id" in params else params["prompt_cluster_id"]
        req_id = params["req_id"]
        model_id = params.get("model_id", 0)
        prefix_id = params.get("prefix_id", INVALID_ID)
        check_uint64("cluster_id", cluster_id)
        check_uint64("req_id", req_id)
        check_uint64("model_id", model_id)
        check_uint64("prefix_id", prefix_id)
        # bools pass the int checks as upstream; kept as the plain ints they stand for
        self._cluster_id = int(cluster_id)
        self._req_id = int(req_id)
        self._model_id = int(model_id)
        self._prefix_id = int(prefix_id)

    @property
    def prompt_cluster_id(self) -> int:
        return self._cluster_id

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def req_id(self) -> int:
        return self._req_id

    @property
    def model_id(self) -> int:
        return self._model_id

    @property
    def prefix_id(self) -> int:
        return self._prefix_id

    def _astuple(self) -> Tuple[int, int, int, int]:
        return (self._cluster_id, self._req_id, self._model_id, self._prefix_id)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._astuple() == other._astuple()

    def __hash__(self) -> int:
        return hash((CacheKey, self._astuple()))

    def __repr__(self) -> str:
        return (f"CacheKey(cluster_id={self._cluster_id}, req_id={self._req_id}, "
                f"prefix_id={self._prefix_id}, model_id={self._model_id})")


class CacheKeyByIdAndIndex:
    """Addresses one batch slot of a remote cache by ``(cluster_id, cache_id, batch_index)``.

    Equal and hashed by value.
    """

    __slots__ = ("_cluster_id", "_cache_id", "_batch_index")

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        check_uint64("cluster_id", cluster_id)
        check_int64("cache_id", cache_id)
        check_uint32("batch_index", batch_index)
        self._cluster_id = int(cluster_id)
        self._cache_id = int(cache_id)
        self._batch_index = int(batch_index)

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def cache_id(self) -> int:
        return self._cache_id

    @property
    def batch_index(self) -> int:
        return self._batch_index

    @property
    def req_id(self) -> int:
        """Always the invalid id (upstream keeps this attribute too)."""
        return INVALID_ID

    def _astuple(self) -> Tuple[int, int, int]:
        return (self._cluster_id, self._cache_id, self._batch_index)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._astuple() == other._astuple()

    def __hash__(self) -> int:
        return hash((CacheKeyByIdAndIndex, self._astuple()))

    def __repr__(self) -> str:
        return (f"CacheKeyByIdAndIndex(cluster_id={self._cluster_id}, cache_id={self._cache_id}, "
                f"batch_index={self._batch_index})")


class BlocksCacheKey:
    """Key of a blocks cache: ``(cluster_id, model_id)``; any ints (no range check, as upstream).

    ``repr`` keeps the keyword used (``cluster_id`` or ``prompt_cluster_id``);
    equality and hashing ignore it.
    """

    __slots__ = ("_cluster_id", "_model_id", "_cluster_id_key")

    def __init__(self, *args: int, **kwargs: int) -> None:
        params = _gather_params(args, kwargs, ("cluster_id", "model_id"))
        raise_if_false("prompt_cluster_id" in params or "cluster_id" in params,
                       "Param prompt_cluster_id or cluster_id is required")
        for name in params:
            raise_if_false(name in ("prompt_cluster_id", "cluster_id", "model_id"), "Unsupported param:{0}", name)
        self._cluster_id_key = "cluster_id" if "cluster_id" in params else "prompt_cluster_id"
        self._cluster_id = params[self._cluster_id_key]
        self._model_id = params.get("model_id", 0)
        check_isinstance("cluster_id", self._cluster_id, int, extra_fmt="The first param ", allow_none=False)
        check_isinstance("model_id", self._model_id, int, extra_fmt="The second param ", allow_none=False)
        self._cluster_id, self._model_id = int(self._cluster_id), int(self._model_id)

    @property
    def prompt_cluster_id(self) -> int:
        return self._cluster_id

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def model_id(self) -> int:
        return self._model_id

    def _astuple(self) -> Tuple[int, int]:
        return (self._cluster_id, self._model_id)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._astuple() == other._astuple()

    def __hash__(self) -> int:
        return hash((BlocksCacheKey, self._astuple()))

    def __repr__(self) -> str:
        return f"BlocksCacheKey({self._cluster_id_key}={self._cluster_id}, model_id={self._model_id})"


def check_cache_key(cache_key: CacheKey) -> None:
    """Exactly one of ``req_id`` / ``prefix_id`` must be valid (``0 <= id < 2**64-1``).

    ``LLMException(LLM_PARAM_INVALID)`` otherwise (``CacheManager.check_cache_key``).
    """
    req_id, prefix_id = cache_key.req_id, cache_key.prefix_id
    raise_if_true(is_invalid_id(req_id) and is_invalid_id(prefix_id),
                  "one of req id and prefix id should contain valid value:[0, 2**64-1), "
                  "req id:{0},prefix id{1}.", req_id, prefix_id)
    raise_if_true(is_valid_id(req_id) and is_valid_id(prefix_id),
                  "only one of req id and prefix id should contain valid value:[0, 2**64-1), "
                  "req id:{0}, prefix id{1}.", req_id, prefix_id)


def cache_key_index(cache_key: Union[CacheKey, BlocksCacheKey]) -> Tuple[int, int]:
    """The engine's lookup index of a key on the side that registered it.

    ``CacheKey`` -> ``(prefix_id, model_id)`` when ``prefix_id != 2**64-1``, else
    ``(req_id, model_id)``; ``BlocksCacheKey`` -> ``(2**64-1, model_id)`` (one
    blocks cache per model_id).  The key's cluster id is not part of the index.
    ``CacheKeyByIdAndIndex`` addresses a cache by id and has no index (TypeError).
    """
    if isinstance(cache_key, CacheKey):
        if cache_key.prefix_id != INVALID_ID:
            return (cache_key.prefix_id, cache_key.model_id)
        return (cache_key.req_id, cache_key.model_id)
    if isinstance(cache_key, BlocksCacheKey):
        return (INVALID_ID, cache_key.model_id)
    raise TypeError(f"cache_key only support ['CacheKey', 'BlocksCacheKey'], but got {type(cache_key)}.")


# ----------------------------------------------------------------------- MemInfo


class MemInfo:
    """A memory range for ``remap_registered_memory``.  Equal and hashed by value."""

    __slots__ = ("_mem_type", "_addr", "_size")

    def __init__(self, mem_type: Memtype, addr: int, size: int) -> None:
        check_isinstance("mem_type", mem_type, Memtype, allow_none=False)
        check_isinstance("addr", addr, int, allow_none=False)
        check_isinstance("size", size, int, allow_none=False)
        self._mem_type = mem_type
        self._addr = addr
        self._size = size

    @property
    def mem_type(self) -> Memtype:
        return self._mem_type

    @property
    def addr(self) -> int:
        return self._addr

    @property
    def size(self) -> int:
        return self._size

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return (self._mem_type, self._addr, self._size) == \
            (other._mem_type, other._addr, other._size)

    def __hash__(self) -> int:
        return hash((MemInfo, self._mem_type, self._addr, self._size))

    def __str__(self) -> str:
        return f"MemInfo(mem_type={self._mem_type}, addr={self._addr}, size={self._size})"

    __repr__ = __str__


# ---------------------------------------------------------- transfer (async) API


class LayerSynchronizer(ABC):
    """Tells ``transfer_cache_async`` when a layer's KV is ready to send."""

    @abstractmethod
    def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        """Block until layer ``layer_index`` is computed; ``False`` fails that layer's transfers.

        Called from the transfer thread with ``timeout_in_millis=None``.
        """


def check_layer_range(name: str, layer_range: Optional[range], allow_none: bool = True) -> None:
    """``range`` with step 1 and ``0 <= start < stop``; None passes when ``allow_none``."""
    if layer_range is None and allow_none:
        return
    _checked_layer_range(name, layer_range)


def _checked_layer_range(name: str, layer_range: Optional[range]) -> range:
    """:func:`check_layer_range` with ``allow_none=False``, returning the range it accepted."""
    check_isinstance(name, layer_range, range, allow_none=False)
    checked = cast(range, layer_range)  # cast: check_isinstance raised unless it is a range
    raise_if_false(checked.step == 1, "check {0}.step == 1 failed", name)
    raise_if_false(0 <= checked.start < checked.stop,
                   "check 0 <= range.start < range.stop failed, {0} = {1}", name, checked)
    return checked


class TransferConfig:
    """Destination of ``transfer_cache_async`` given by raw addresses (non remote-accessible mode).

    ``dst_addrs`` holds 2 addresses per transferred layer.  ``dst_layer_range``
    is a plain public attribute (upstream), ``None`` by default.
    """

    def __init__(self,
                 dst_cluster_id: int,
                 dst_addrs: List[int],
                 src_layer_range: Optional[range] = None,
                 src_batch_index: int = 0) -> None:
        self._check_dst_cluster_id(dst_cluster_id)
        self._check_dst_addrs(dst_addrs)
        check_layer_range("src_layer_range", src_layer_range)
        self._check_src_batch_index(src_batch_index)
        self._dst_cluster_id = int(dst_cluster_id)
        self._dst_addrs = dst_addrs
        self._src_layer_range = src_layer_range
        self._src_batch_index = int(src_batch_index)
        self.dst_layer_range: Optional[range] = None

    @staticmethod
    def _check_dst_cluster_id(dst_cluster_id: int) -> None:
        check_uint64("dst_cluster_id", dst_cluster_id)

    @staticmethod
    def _check_dst_addrs(dst_addrs: List[int]) -> None:
        check_isinstance("dst_addrs", dst_addrs, [list, tuple], int, allow_none=False)
        check_list_uint64("dst_addrs", dst_addrs)

    @staticmethod
    def _check_src_batch_index(src_batch_index: int) -> None:
        check_uint32("src_batch_index", src_batch_index)

    @property
    def dst_cluster_id(self) -> int:
        return self._dst_cluster_id

    @dst_cluster_id.setter
    def dst_cluster_id(self, cluster_id: int) -> None:
        self._check_dst_cluster_id(cluster_id)
        self._dst_cluster_id = cluster_id

    @property
    def dst_addrs(self) -> List[int]:
        return self._dst_addrs

    @dst_addrs.setter
    def dst_addrs(self, dst_addrs: List[int]) -> None:
        self._check_dst_addrs(dst_addrs)
        self._dst_addrs = dst_addrs

    @property
    def src_layer_range(self) -> Optional[range]:
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, layer_range: Optional[range]) -> None:
        check_layer_range("src_layer_range", layer_range)
        self._src_layer_range = layer_range

    @property
    def src_batch_index(self) -> int:
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, batch_index: int) -> None:
        self._check_src_batch_index(batch_index)
        self._src_batch_index = int(batch_index)

    def __repr__(self) -> str:
        return (f"TransferConfig(dst_cluster_id={self._dst_cluster_id},"
                f" dst_addrs={self._dst_addrs},"
                f" src_layer_range={self._src_layer_range},"
                f" src_batch_index={self._src_batch_index})")


class TransferWithCacheKeyConfig:
    """Destination of ``transfer_cache_async`` given by key (remote-accessible mode).

    Both layer ranges are mandatory and of equal length; a ``BlocksCacheKey``
    destination requires ``src_batch_index == 0``.  ``dst_cluster_id`` is a public
    attribute equal to ``cache_key.cluster_id`` (kept in step by the
    ``cache_key`` setter).
    """

    def __init__(self,
                 cache_key: Union[BlocksCacheKey, CacheKeyByIdAndIndex],
                 src_layer_range: Optional[range] = None,
                 dst_layer_range: Optional[range] = None,
                 src_batch_index: int = 0) -> None:
        check_isinstance("cache_key", cache_key, [BlocksCacheKey, CacheKeyByIdAndIndex], allow_none=False)
        src_layer_range = _checked_layer_range("src_layer_range", src_layer_range)
        dst_layer_range = _checked_layer_range("dst_layer_range", dst_layer_range)
        raise_if_false(len(src_layer_range) == len(dst_layer_range),
                       "src_layer_range size should be equal to dst_layer_range size")
        check_uint32("src_batch_index", src_batch_index)
        raise_if_true(isinstance(cache_key, BlocksCacheKey) and src_batch_index != 0,
                      "src_batch_index should be 0 when cache_key is BlocksCacheKey.")
        self._cache_key = cache_key
        self._src_layer_range = src_layer_range
        self._dst_layer_range = dst_layer_range
        self._src_batch_index = int(src_batch_index)
        self.dst_cluster_id: int = cache_key.cluster_id

    @property
    def cache_key(self) -> Union[BlocksCacheKey, CacheKeyByIdAndIndex]:
        return self._cache_key

    @cache_key.setter
    def cache_key(self, cache_key: Union[BlocksCacheKey, CacheKeyByIdAndIndex]) -> None:
        check_isinstance("cache_key", cache_key, [BlocksCacheKey, CacheKeyByIdAndIndex], allow_none=False)
        self._cache_key = cache_key
        self.dst_cluster_id = cache_key.cluster_id

    @property
    def src_layer_range(self) -> range:
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, src_layer_range: range) -> None:
        self._src_layer_range = _checked_layer_range("src_layer_range", src_layer_range)

    @property
    def dst_layer_range(self) -> range:
        return self._dst_layer_range

    @dst_layer_range.setter
    def dst_layer_range(self, dst_layer_range: range) -> None:
        self._dst_layer_range = _checked_layer_range("dst_layer_range", dst_layer_range)

    @property
    def src_batch_index(self) -> int:
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, src_batch_index: int) -> None:
        raise_if_true(isinstance(self._cache_key, BlocksCacheKey) and src_batch_index != 0,
                      "src_batch_index should be 0 when cache_key is BlocksCacheKey.")
        check_uint32("src_batch_index", src_batch_index)
        self._src_batch_index = int(src_batch_index)

    def __repr__(self) -> str:
        return (f"TransferWithCacheKeyConfig(cache_key={self._cache_key},"
                f" src_layer_range={self._src_layer_range},"
                f" dst_layer_range={self._dst_layer_range},"
                f" src_batch_index={self._src_batch_index})")


@runtime_checkable
class _AsyncTaskLike(Protocol):
    """What ``CacheTask`` needs from the engine's asynchronous transfer task.

    * ``wait(timeout_s)``: block up to ``timeout_s`` seconds (``None``: forever)
      and return whether the task has finished.
    * ``results()``: one entry per transfer config, in config order; ``None`` for a
      config whose layers never started.  Callable at any time (the length is
      the number of configs even while running).  A task that died on an
      internal error reports that as a failure status in its results.
    """

    def wait(self, timeout_s: Optional[float]) -> bool: ...

    def results(self) -> List[Optional[LLMStatusCode]]: ...


def _timeout_seconds(timeout_in_millis: Optional[int]) -> Optional[float]:
    if timeout_in_millis is None:
        return None
    check_uint32("timeout_in_millis", timeout_in_millis)
    return timeout_in_millis / 1000


class CacheTask:
    """Handle of a ``transfer_cache_async`` call.

    Neither method raises on timeout (upstream behaviour): ``synchronize``
    returns ``LLM_TIMEOUT`` and ``get_results`` returns ``[LLM_TIMEOUT] * n``
    when the task has not finished within ``timeout_in_millis`` (uint32 ms;
    ``None`` waits forever; a wrong type is ``TypeError``, out of range
    ``ValueError``).  A finished task can be asked again and gives the same answer.
    """

    def __init__(self, transfer_async_task: _AsyncTaskLike) -> None:
        self._transfer_async_task = transfer_async_task

    def synchronize(self, timeout_in_millis: Optional[int] = None) -> LLMStatusCode:
        """Wait; the first non-success result, ``LLM_SUCCESS``, or ``LLM_TIMEOUT`` if unfinished.

        ``None`` results (configs whose layers never started) are skipped.
        """
        timeout_s = _timeout_seconds(timeout_in_millis)
        if not self._transfer_async_task.wait(timeout_s):
            return LLMStatusCode.LLM_TIMEOUT
        for ret in self._transfer_async_task.results():
            if ret is not None and ret != LLMStatusCode.LLM_SUCCESS:
                return ret
        return LLMStatusCode.LLM_SUCCESS

    def get_results(self, timeout_in_millis: Optional[int] = None) -> List[Optional[LLMStatusCode]]:
        """Wait; one status per transfer config (``None`` where nothing started).

        If the task has not finished within the timeout, every entry is ``LLM_TIMEOUT``.
        """
        timeout_s = _timeout_seconds(timeout_in_millis)
        if not self._transfer_async_task.wait(timeout_s):
            return [LLMStatusCode.LLM_TIMEOUT] * len(self._transfer_async_task.results())
        return list(self._transfer_async_task.results())

    def __repr__(self) -> str:
        return f"CacheTask({self._transfer_async_task!r})"
