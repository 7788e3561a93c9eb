"""Re-export of :mod:`llmdd.utils.utils` (``llm_datadist.utils.utils``)."""

from llmdd.utils.utils import *  # noqa: F401,F403
from llmdd.utils.utils import __all__  # noqa: F401
