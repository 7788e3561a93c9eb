"""Re-export of :mod:`llmdd.v2.config` (``llm_datadist.v2.config``)."""

from llmdd.v2.config import *  # noqa: F401,F403
from llmdd.v2.config import __all__  # noqa: F401
