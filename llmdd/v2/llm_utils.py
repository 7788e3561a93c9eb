"""``llm_datadist.v2.llm_utils``: helpers of the cache-manager mode.

What upstream keeps here and llmdd provides: cache-description helpers (``clone_cache_desc``,
``verify_cache_shape``, ``to_data_type``, ``calc_tensor_size``, ``CacheDescParser``), id
predicates, the tuple packers of descriptions and keys, ``TransferCacheParameters``,
``layer_range_to_tensor_indices`` and ``parse_listen_ip_info``.

Not provided: ``TransferCacheJob``, ``TransferAsyncThread`` and the module-level
``transfer_cache_async``.  Upstream uses them to drive its native wrapper's
``transfer_cache_v2`` with packed tuples, layer by layer; llmdd has no such native function
and its layer-wise transfer is ``CacheManager.transfer_cache_async`` (docs/deviations.md).
Reaching for them raises ``AttributeError`` saying so.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple, Union

from llmdd._base.enums import DTYPE_ITEMSIZE, DataType, Placement
from llmdd._base.status import LLMException, LLMStatusCode, raise_if_false, raise_if_true
from llmdd._base.types import (BlocksCacheKey, Cache, CacheDesc, CacheKey, CacheKeyByIdAndIndex, KvCache, MemInfo,
                      TransferConfig, TransferWithCacheKeyConfig, is_invalid_id, is_valid_id)
from llmdd._base.validation import check_isinstance, check_uint32
from llmdd.utils import log

__all__ = ["clone_cache_desc", "verify_cache_shape", "to_data_type", "is_invalid_id", "is_valid_id",
           "calc_tensor_size", "CacheDescParser", "pack_cache_desc", "pack_cache_key", "pack_cache_key_by_id",
           "pack_block_cache_key", "pack_mem_info", "TransferCacheParameters", "layer_range_to_tensor_indices",
           "parse_listen_ip_info"]

_INVALID_ID = 2**64 - 1
_INT64_MAX = 2**63 - 1
_NUM_TENSORS_PER_LAYER = 2
_NATIVE_ONLY = ("TransferCacheJob", "TransferAsyncThread", "transfer_cache_async")


def clone_cache_desc(cache_desc: CacheDesc) -> CacheDesc:
    """A new ``CacheDesc`` equal to ``cache_desc``, with its own copy of the shape."""
    return CacheDesc(cache_desc.num_tensors, cache_desc.shape[:], cache_desc.data_type, cache_desc.placement,
                     cache_desc.batch_dim, cache_desc.seq_len_dim_index, cache_desc.kv_tensor_format)


def verify_cache_shape(shape: List[int]) -> None:
    """A cache shape has at least one dimension, none of them 0, and none below -1 (dynamic)."""
    raise_if_false(len(shape) > 0, "scalar is not supported")
    raise_if_false(0 not in shape, f"empty dimension is not supported, shape = {shape}")
    for dim in shape:
        if dim < -1:
            # upstream raises this one without a status code (the exception's default)
            raise LLMException(f"dim {dim} is not supported, shape = {shape}")


def to_data_type(data_type_str: str) -> DataType:
    """The ``DataType`` whose numeric value, as text, is ``data_type_str`` (e.g. ``"1"``)."""
    for dtype in DataType:
        if str(dtype.value) == data_type_str:
            return dtype
    raise LLMException(f"unsupported dtype: {data_type_str}", status_code=LLMStatusCode.LLM_PARAM_INVALID)


def calc_tensor_size(shape: List[int], data_type: DataType) -> int:
    """Bytes of one tensor of ``shape`` and ``data_type``; LLM_PARAM_INVALID when it has none
    (a dynamic ``-1`` dimension, ``DT_STRING``, or more than 2**63-1 bytes)."""
    itemsize = DTYPE_ITEMSIZE.get(data_type)
    size = -1
    if itemsize is not None and all(isinstance(d, int) and d >= 0 for d in shape):
        size = itemsize
        for dim in shape:
            size *= dim
        if size > _INT64_MAX:
            size = -1
    raise_if_false(size >= 0, "Failed to calc tensor size, shape = {0}, data_type = {1}", shape, data_type)
    return size


class CacheDescParser:
    """Builds a ``CacheDesc`` from the legacy ``llm.RefInput*`` options."""

    @staticmethod
    def parse_by_options(options: Dict[str, str]) -> CacheDesc:
        raise_if_false("llm.RefInputShapes" in options, "llm.RefInputShapes not set")
        shapes = options["llm.RefInputShapes"].split(";")
        raise_if_false(len(set(shapes)) == 1,
                       f"zero or multiple different shapes is not supported, llm.RefInputShapes = {shapes}")
        raise_if_false("llm.RefInputDtypes" in options, "llm.RefInputDtypes not set")
        dtypes = options["llm.RefInputDtypes"].split(";")
        raise_if_false(len(set(dtypes)) == 1,
                       f"zero or multiple different data types is not supported, llm.RefInputDtypes = {dtypes}")
        raise_if_false(len(shapes) == len(dtypes),
                       f"kv_shapes num ({len(shapes)}) mismatches that of kv_data_type ({len(dtypes)})")
        shape = [int(dim) for dim in shapes[0].split(",")]
        verify_cache_shape(shape)
        if "llm.RefInputSeqLenDimIndex" in options:
            seq_dim = int(options["llm.RefInputSeqLenDimIndex"])
            raise_if_false(0 <= seq_dim < len(shape),
                           f"seq_len_dim_index ({seq_dim}) out of range, kv_shape = {shape}")
        elif -1 in shape[1:]:
            dynamic = shape[1:].count(-1)
            raise_if_false(dynamic == 1, f"can only have one dynamic dim apart from batch_dim(0), "
                                         f"but got {dynamic}, shape = {shape}")
            seq_dim = shape[1:].index(-1) + 1
        else:
            seq_dim = -1
        desc = CacheDesc(len(shapes), shape, to_data_type(dtypes[0]), Placement.DEVICE, 0, seq_dim,
                         options.get("llm.kvTensorFormat", None))
        log.info(f"parse cache_desc from option, value = {desc}")
        return desc


# ------------------------------------------------------------------ tuple packers (upstream's wire to its
# native layer; kept for code that builds those tuples itself)

def pack_cache_desc(cache_desc: CacheDesc) -> Tuple[int, int, int, Union[Tuple[int, ...], List[int]], int, bool]:
    """``(num_tensors, data_type value, seq_len_dim_index, shape, placement value, is_blocks)``."""
    return (cache_desc.num_tensors, cache_desc.data_type.value, cache_desc.seq_len_dim_index, cache_desc.shape,
            cache_desc.placement.value, cache_desc._is_blocks)


def pack_cache_key(cache_key: CacheKey) -> Tuple[int, int, int, int, int, int, bool]:
    """``(cluster, cache_id -1, batch 0, req_id, prefix_id, model_id, False)``."""
    return (cache_key.prompt_cluster_id, -1, 0, cache_key.req_id, cache_key.prefix_id, cache_key.model_id, False)


def pack_cache_key_by_id(cache_key: CacheKeyByIdAndIndex) -> Tuple[int, int, int, int, int, int, bool]:
    """``(cluster, cache_id, batch_index, no req, no prefix, model 0, False)``."""
    return (cache_key.cluster_id, cache_key.cache_id, cache_key.batch_index, _INVALID_ID, _INVALID_ID, 0, False)


def pack_block_cache_key(cache_key: BlocksCacheKey) -> Tuple[int, int, int, int, int, int, bool]:
    """``(cluster, cache_id -1, batch 0, no req, no prefix, model_id, True)``."""
    return (cache_key.prompt_cluster_id, -1, 0, _INVALID_ID, _INVALID_ID, cache_key.model_id, True)


def pack_mem_info(mem_info: MemInfo) -> Tuple[int, int, int]:
    """``(mem_type value, addr, size)``."""
    return (mem_info.mem_type.value, mem_info.addr, mem_info.size)


@dataclasses.dataclass
class TransferCacheParameters:
    """The arguments of one layer-wise transfer, grouped."""

    src_cache: Union[Cache, KvCache]
    transfer_configs: Union[List[Union[TransferConfig, TransferWithCacheKeyConfig]],
                            Tuple[Union[TransferConfig, TransferWithCacheKeyConfig], ...]]
    src_block_indices: Optional[List[int]] = None
    dst_block_indices: Optional[List[int]] = None
    dst_block_memory_size: Optional[int] = None


def layer_range_to_tensor_indices(src_layer_range: Optional[range], dst_layer_range: Optional[range],
                                  tensor_num_per_layer: int = _NUM_TENSORS_PER_LAYER) -> Tuple[List[int], List[int]]:
    """The tensor indices covered by two layer ranges (``None`` or empty: no indices).

    Ranges must have step 1 and start at ``>= 0``; their first and last layer must be uint32.
    """
    check_isinstance("src_layer_range", src_layer_range, range)
    check_isinstance("dst_layer_range", dst_layer_range, range)
    raise_if_true(src_layer_range is not None and src_layer_range.step != 1,
                  "param check failed, src_layer_range step must be 1.")
    raise_if_true(dst_layer_range is not None and dst_layer_range.step != 1,
                  "param check failed, dst_layer_range step must be 1.")

    def tensors(name: str, layers: Optional[range]) -> List[int]:
        if layers is None or len(layers) == 0:
            return []
        raise_if_true(layers[0] < 0, "{0} is invalid, the start value:{1} is < 0", name, layers[0])
        check_uint32(name, layers[0])
        check_uint32(name, layers[-1])
        first = layers[0] * tensor_num_per_layer
        return list(range(first, first + len(layers) * tensor_num_per_layer))

    return tensors("src_layer_range", src_layer_range), tensors("dst_layer_range", dst_layer_range)


def parse_listen_ip_info(listen_ip_info: str) -> Tuple[str, int]:
    """``"ip:port"`` -> ``(ip, port)``; exactly one ``:`` (LLM_PARAM_INVALID otherwise), the port
    converted with ``int`` (``ValueError`` when it is not a number)."""
    check_isinstance("listen_ip_info", listen_ip_info, [str])
    parts = listen_ip_info.split(":")
    raise_if_false(len(parts) == 2, f'llm.listenIpInfo "{listen_ip_info}" is invalid, format should be "ip:port"')
    return parts[0], int(parts[1])


def __getattr__(name: str):
    if name in _NATIVE_ONLY:
        raise AttributeError(f"llm_datadist.v2.llm_utils.{name} drives upstream's native transfer_cache_v2, which "
                             f"llmdd does not have; use CacheManager.transfer_cache_async")
    raise AttributeError(f"module {__name__} has no attribute {name}")
