"""Re-export of :mod:`llmdd.utils.log` (``llm_datadist.utils.log``)."""

from ...utils.log import *  # noqa: F401,F403
from ...utils.log import __all__  # noqa: F401
from ...utils.log import logger  # noqa: F401,E402
