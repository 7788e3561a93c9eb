"""llmdd: an open, pluggable KV-cache transfer engine for disaggregated LLM inference.

Source-compatible with Huawei CANN's ``llm_datadist`` (cache-manager mode), so
client code runs with ``import llmdd as llm_datadist``.  This module re-exports
the public contract only; the code lives in private ``_`` modules.
"""

import os as _os

from llmdd._base.config import LLMClusterInfo as LLMClusterInfo
from llmdd._base.config import LlmConfig as LlmConfig
from llmdd._base.config import LLMConfig as LLMConfig
from llmdd._api.datadist import LLMDataDist as LLMDataDist
from llmdd._base.enums import DataType as DataType
from llmdd._base.enums import LLMRole as LLMRole
from llmdd._base.enums import Memtype as Memtype
from llmdd._base.enums import Placement as Placement
from llmdd._base.enums import RegisterMemStatus as RegisterMemStatus
from llmdd._base.status import LLMException as LLMException
from llmdd._base.status import LLMStatusCode as LLMStatusCode
from llmdd._base.status import Status as Status
from llmdd._base.types import BlocksCacheKey as BlocksCacheKey
from llmdd._base.types import Cache as Cache
from llmdd._base.types import CacheDesc as CacheDesc
from llmdd._base.types import CacheKey as CacheKey
from llmdd._base.types import CacheKeyByIdAndIndex as CacheKeyByIdAndIndex
from llmdd._base.types import CacheTask as CacheTask
from llmdd._base.types import KvCache as KvCache
from llmdd._base.types import LayerSynchronizer as LayerSynchronizer
from llmdd._base.types import MemInfo as MemInfo
from llmdd._base.types import TransferConfig as TransferConfig
from llmdd._base.types import TransferWithCacheKeyConfig as TransferWithCacheKeyConfig
# llmdd extension (not upstream's: outside __all__): what a fenced pull expects (docs/fencing.md)
from llmdd._data.fence import BlockFence as BlockFence

__version__ = "0.1.0"

# upstream sets this at import (only if absent); kept for drop-in compatibility
_os.environ.setdefault("AUTO_USE_UC_MEMORY", "0")

__all__ = [
    "LLMStatusCode", "LLMException", "Status",
    "LLMClusterInfo", "LLMRole", "LlmConfig", "LLMConfig",
    "DataType",
    "KvCache", "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "BlocksCacheKey", "Placement",
    "RegisterMemStatus", "Cache", "LayerSynchronizer", "TransferConfig", "CacheTask",
    "TransferWithCacheKeyConfig", "Memtype", "MemInfo",
    "LLMDataDist",
    "TensorDesc", "Tensor", "KvCacheManager",
]

#: upstream's list of the cache-manager (v2) names; every upstream engine test imports it
v2_list = [
    "LLMClusterInfo", "LLMStatusCode", "LLMException", "LLMRole", "LlmConfig", "LLMConfig", "DataType", "Status",
    "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache", "Cache", "BlocksCacheKey", "LLMDataDist",
    "Placement", "RegisterMemStatus", "LayerSynchronizer", "TransferConfig", "CacheTask",
    "TransferWithCacheKeyConfig", "Memtype", "MemInfo",
]

# upstream's module paths (llm_datadist.status, .configs, .data_type, .utils.*, .v2.*), loaded at
# import as upstream's package loads them, so they are attributes of the package
from llmdd import configs, data_type, status, utils, v2  # noqa: E402,F401

_LEGACY_V1 = ("TensorDesc", "Tensor", "KvCacheManager")


def __getattr__(name: str):
    # as upstream, the legacy v1 names are served lazily (from llmdd's own v1 package, docs/v1.md)
    if name in _LEGACY_V1:
        from llmdd._api import v1 as _v1

        return getattr(_v1, name)
    raise AttributeError(f"Module 'llmdd' has no attribute '{name}'")
