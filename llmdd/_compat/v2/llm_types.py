"""Re-export of :mod:`llmdd.v2.llm_types` (``llm_datadist.v2.llm_types``)."""

from ...v2.llm_types import *  # noqa: F401,F403
from ...v2.llm_types import __all__  # noqa: F401
