"""Re-export of :mod:`llmdd.status` (``llm_datadist.status``)."""

from ..status import *  # noqa: F401,F403
from ..status import __all__  # noqa: F401
