"""Re-export of :mod:`llmdd.utils.log` (``llm_datadist.utils.log``)."""

from llmdd.utils.log import *  # noqa: F401,F403
from llmdd.utils.log import __all__  # noqa: F401
from llmdd.utils.log import logger  # noqa: F401,E402
