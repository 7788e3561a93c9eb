"""Re-export of :mod:`llmdd.configs` (``llm_datadist.configs``)."""

from llmdd.configs import *  # noqa: F401,F403
from llmdd.configs import __all__  # noqa: F401
