"""``llm_datadist.v2.llm_datadist``: the engine class and its exit handler."""

from llmdd._api.datadist import LLMDataDist, _shutdown_handler  # noqa: F401  (clients import _shutdown_handler)

__all__ = ["LLMDataDist"]
