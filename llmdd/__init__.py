"""llmdd: an open, pluggable KV-cache transfer engine for disaggregated LLM inference.

Source-compatible with Huawei CANN's ``llm_datadist`` (cache-manager mode), so
client code runs with ``import llmdd as llm_datadist``.  This module re-exports
the public contract only; the code lives in private ``_`` modules.
"""

import os as _os

from ._config import LLMClusterInfo as LLMClusterInfo
from ._config import LlmConfig as LlmConfig
from ._config import LLMConfig as LLMConfig
from ._datadist import LLMDataDist as LLMDataDist
from ._enums import DataType as DataType
from ._enums import LLMRole as LLMRole
from ._enums import Memtype as Memtype
from ._enums import Placement as Placement
from ._enums import RegisterMemStatus as RegisterMemStatus
from ._status import LLMException as LLMException
from ._status import LLMStatusCode as LLMStatusCode
from ._status import Status as Status
from ._types import BlocksCacheKey as BlocksCacheKey
from ._types import Cache as Cache
from ._types import CacheDesc as CacheDesc
from ._types import CacheKey as CacheKey
from ._types import CacheKeyByIdAndIndex as CacheKeyByIdAndIndex
from ._types import CacheTask as CacheTask
from ._types import KvCache as KvCache
from ._types import LayerSynchronizer as LayerSynchronizer
from ._types import MemInfo as MemInfo
from ._types import TransferConfig as TransferConfig
from ._types import TransferWithCacheKeyConfig as TransferWithCacheKeyConfig

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
from . import configs, data_type, status, utils, v2  # noqa: E402,F401

_LEGACY_V1 = ("TensorDesc", "Tensor", "KvCacheManager")


def __getattr__(name: str):
    # as upstream, the legacy v1 names are served lazily (from llmdd's own v1 package, docs/v1.md)
    if name in _LEGACY_V1:
        from . import _v1

        return getattr(_v1, name)
    raise AttributeError(f"Module 'llmdd' has no attribute '{name}'")
