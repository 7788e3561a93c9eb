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

One module per concept: :mod:`.cache` (the cache descriptions and ``MemInfo``), :mod:`.keys` (the
cache keys), :mod:`.transfer` (the layer-wise transfer configs and ``CacheTask``).  This package
gathers them under the one name the rest of llmdd imports.
"""

from llmdd._base.types.cache import Cache, CacheDesc, KvCache, MemInfo
from llmdd._base.types.keys import (BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex, cache_key_index, check_cache_key,
                                    is_invalid_id, is_valid_id)
from llmdd._base.types.transfer import (CacheTask, LayerSynchronizer, TransferConfig, TransferWithCacheKeyConfig,
                                        check_layer_range)


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
