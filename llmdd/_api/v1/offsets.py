"""``pull_cache`` with ``src_cache_offset`` / ``dst_cache_offset`` (v1 kwargs), on the engine's pull.

Upstream's semantics (``hicann/ge`` ffdcbc9f7496, ``dflow/udf/built_in/llm_common/cache_manager.cpp``):
``length = size`` or, for ``size == -1``, the rest of the destination slot
(``dst_stride - dst_cache_offset``); bytes ``[src_cache_offset, +length)`` of the source slot land
at ``[dst_cache_offset, +length)`` of destination slot ``batch_index``, for every tensor pulled;
``dst_cache_offset + length`` beyond the destination slot is ``LLM_PARAM_INVALID``.

The data plane pulls slot prefixes (``[0, size)`` of a slot into ``[0, size)`` of a slot).  With both
offsets 0 that is the request itself.  Otherwise llmdd pulls ``[0, src_cache_offset + length)`` of
the source slot into a staging cache from the engine's pool (``LLM_DEVICE_OUT_OF_MEMORY``, v1's
memory status, when the pool cannot hold it), then copies the requested range locally, bounds-checked, and frees the staging
cache: a slower path (a cache allocation announced to linked peers, and an extra local copy).
The key protocol is the engine's: a pull by ``CacheKey`` consumes the key once the bytes are here.
"""

from __future__ import annotations

from typing import Any, Optional

from llmdd._base.enums import DataType, Placement
from llmdd._memory.copy import execute, slot_copy_ops
from llmdd._data.planner import tensor_range
from llmdd._base.status import LLMException, LLMStatusCode, raise_if_false
from llmdd._base.types import Cache, CacheDesc

__all__ = ["allocate_device", "pull_with_offsets"]


def allocate_device(memory: Any, desc: CacheDesc, **kwargs: Any) -> Any:
    """A v1 allocation from the engine's DEVICE pool.  Exhaustion is v1's status
    ``LLM_DEVICE_OUT_OF_MEMORY`` (upstream v1's UDF code 14, ``hicann/ge`` ``llm_flow_service.cc:613``,
    ``llm_datadist_v1.h:55``, ``llm_datadist_v1/status.py:83``), not the pool's ``LLM_OUT_OF_MEMORY``,
    which upstream's user guide gives to cache-manager mode only."""
    try:
        return memory.allocate_cache(desc, **kwargs)
    except LLMException as exc:
        if exc.status_code is not LLMStatusCode.LLM_OUT_OF_MEMORY:
            raise
        raise LLMException(str(exc), status_code=LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY) from exc


def pull_with_offsets(memory: Any, transfers: Any, key: Any, rec: Any, *, batch_index: int, size: int,
                      src_offset: int, dst_offset: int, src_layer_range: Optional[range],
                      dst_layer_range: Optional[range], tnpl: int) -> None:
    """Pull with byte offsets into slot ``batch_index`` of the local record ``rec`` (a live non-blocks cache)."""
    stride = rec.stride
    raise_if_false(dst_offset < stride, "[pull_cache] dst_cache_offset ({0}) must be less than the batch stride ({1})",
                   dst_offset, stride)
    length = stride - dst_offset if size == -1 else size
    raise_if_false(dst_offset + length <= stride,
                   "[pull_cache] dst_cache_offset ({0}) or size ({1}) is invalid, cache batch stride ({2})",
                   dst_offset, length, stride)
    if src_offset == 0 and dst_offset == 0:  # both slot starts: the engine's pull of ``length`` bytes is exact
        view = Cache(rec.cache_id, rec.desc, list(rec.addrs), None, False, False)
        transfers.pull(key, view, kind="pull_cache", batch_index=batch_index, size=length,
                       src_layer_range=src_layer_range, dst_layer_range=dst_layer_range, tnpl=tnpl)
        return
    dst_tensors = tensor_range(dst_layer_range, len(rec.addrs), tnpl)
    staged = src_offset + length
    desc = CacheDesc(len(rec.addrs), [1, staged], DataType.DT_UINT8, Placement.DEVICE)
    staging = allocate_device(memory, desc, is_blocks=False)  # LLM_DEVICE_OUT_OF_MEMORY beyond the pool
    try:
        view = Cache(staging.cache_id, desc, list(staging.addrs), None, False, False)
        # the engine's pull checks the source side: src_offset + length within a source slot
        transfers.pull(key, view, kind="pull_cache", batch_index=0, size=staged,
                       src_layer_range=src_layer_range, dst_layer_range=dst_layer_range, tnpl=tnpl)
        src_bases = [staging.addrs[t] for t in dst_tensors]
        dst_bases = [rec.addrs[t] for t in dst_tensors]
        ops = slot_copy_ops(src_bases, dst_bases, src_offset, batch_index * stride + dst_offset, length)
        execute(ops, src_bounds=staging.bounds(), dst_bounds=rec.bounds())
    finally:
        memory.deallocate_cache(staging.cache_id)
