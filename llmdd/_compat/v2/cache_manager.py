"""Re-export of :mod:`llmdd.v2.cache_manager` (``llm_datadist.v2.cache_manager``)."""

from llmdd.v2.cache_manager import *  # noqa: F401,F403
from llmdd.v2.cache_manager import __all__  # noqa: F401
