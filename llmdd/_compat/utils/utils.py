"""Re-export of :mod:`llmdd.utils.utils` (``llm_datadist.utils.utils``)."""

from ...utils.utils import *  # noqa: F401,F403
from ...utils.utils import __all__  # noqa: F401
