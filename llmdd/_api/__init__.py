"""The llm_datadist facade: LLMDataDist, CacheManager and the legacy v1 mode, thin over the engine."""
