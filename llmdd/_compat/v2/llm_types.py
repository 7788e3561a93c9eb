"""Re-export of :mod:`llmdd.v2.llm_types` (``llm_datadist.v2.llm_types``)."""

from llmdd.v2.llm_types import *  # noqa: F401,F403
from llmdd.v2.llm_types import __all__  # noqa: F401
