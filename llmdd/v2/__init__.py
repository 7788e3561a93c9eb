"""``llm_datadist.v2``: the cache-manager mode's modules, by upstream's paths."""

from llmdd.v2 import cache_manager, config, llm_datadist, llm_types, llm_utils  # noqa: F401
