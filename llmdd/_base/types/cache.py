"""The cache descriptions of the llm_datadist v2 contract (docs/concepts.md): ``CacheDesc``, ``Cache``,
``KvCache`` and ``MemInfo``.

``CacheDesc``, ``Cache`` and ``KvCache`` keep identity equality and hashing (they have setters or
change in place: ``CacheDesc.update_dim``, ``CacheDesc._is_blocks``, ``Cache._tensor_addrs``), as
upstream, so a hash never changes under a dict; ``MemInfo`` has no setters and compares by value.
"""

from __future__ import annotations

import math
from typing import List, Optional, Protocol, Tuple, Union, cast

from llmdd._base.enums import DTYPE_ITEMSIZE, DataType, Memtype, Placement
from llmdd._base.log import get_logger
from llmdd._base.status import LLMException, LLMStatusCode, raise_if_false
from llmdd._base.validation import check_int32, check_int64, check_isinstance, check_list_int64, check_uint32

__all__ = ["CacheDesc", "Cache", "KvCache", "MemInfo"]

_log = get_logger("llmdd.types")

_INT64_MAX = 2**63 - 1

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
                 cache_manager: Optional[object] = None,   # upstream's signature; kept, never called
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


class KvCacheOwner(Protocol):
    """What a :class:`KvCache` needs of the v1 cache manager that made it (its finaliser
    deallocates it there)."""

    def is_initialized(self) -> bool: ...

    def deallocate_cache(self, cache: KvCache) -> None: ...


class KvCache:
    """v1-style cache (exported for compatibility): one address list per device.

    As upstream, a still-valid ``KvCache`` whose manager is initialised is
    deallocated when garbage-collected; errors there are logged, never raised.
    """

    def __init__(self,
                 cache_id: int,
                 cache_desc: CacheDesc,
                 per_device_tensor_addrs: List[List[int]],
                 kv_cache_manager: Optional[KvCacheOwner] = None) -> None:
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
