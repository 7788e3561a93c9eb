"""``llm_datadist.v2.llm_types``: the cache-manager mode's value types."""

from llmdd._base.enums import Memtype, Placement, PushType, RegisterMemStatus, int_to_mem_status_dict
from llmdd._base.types import (BlocksCacheKey, Cache, CacheDesc, CacheKey, CacheKeyByIdAndIndex, CacheTask, KvCache,
                      LayerSynchronizer, MemInfo, TransferConfig, TransferWithCacheKeyConfig, check_layer_range)

__all__ = ["PushType", "RegisterMemStatus", "Memtype", "MemInfo", "int_to_mem_status_dict", "Placement",
           "CacheDesc", "Cache", "BlocksCacheKey", "CacheKey", "CacheKeyByIdAndIndex", "KvCache",
           "LayerSynchronizer", "check_layer_range", "TransferWithCacheKeyConfig", "TransferConfig", "CacheTask"]
