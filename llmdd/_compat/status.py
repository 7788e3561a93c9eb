"""Re-export of :mod:`llmdd.status` (``llm_datadist.status``)."""

from llmdd.status import *  # noqa: F401,F403
from llmdd.status import __all__  # noqa: F401
