"""The legacy v1 (non cache-manager) surface of ``llm_datadist``, served on llmdd's engine.

``LLMDataDist.init`` selects it when the options enable neither ``llm.EnableCacheManager`` nor
``llm.LocalCommRes``; ``LLMDataDist.kv_cache_manager`` then returns a :class:`KvCacheManager`.
See docs/v1.md.
"""

from llmdd._api.v1.kv_cache_manager import KvCacheManager as KvCacheManager
from llmdd._api.v1.tensor import Tensor as Tensor
from llmdd._api.v1.tensor import TensorDesc as TensorDesc

__all__ = ["KvCacheManager", "Tensor", "TensorDesc"]
