"""Re-export of :mod:`llmdd.configs` (``llm_datadist.configs``)."""

from ..configs import *  # noqa: F401,F403
from ..configs import __all__  # noqa: F401
