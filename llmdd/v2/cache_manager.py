"""``llm_datadist.v2.cache_manager``: the cache manager class (obtained from ``LLMDataDist.cache_manager``)."""

from llmdd._api.cache_manager import CacheManager

__all__ = ["CacheManager"]
