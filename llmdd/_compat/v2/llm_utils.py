"""Re-export of :mod:`llmdd.v2.llm_utils` (``llm_datadist.v2.llm_utils``)."""

from llmdd.v2.llm_utils import *  # noqa: F401,F403
from llmdd.v2.llm_utils import __all__  # noqa: F401
