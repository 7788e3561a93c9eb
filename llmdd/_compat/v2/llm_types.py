"""``llm_datadist.v2.llm_types``."""

from ..._enums import Memtype, Placement, PushType, RegisterMemStatus, int_to_mem_status_dict  # noqa: F401
from ..._types import (BlocksCacheKey, Cache, CacheDesc, CacheKey, CacheKeyByIdAndIndex, CacheTask,  # noqa: F401
                       KvCache, LayerSynchronizer, MemInfo, TransferConfig, TransferWithCacheKeyConfig)
