"""``llm_datadist.v2.cache_manager``."""

from ..._cache_manager import CacheManager  # noqa: F401
