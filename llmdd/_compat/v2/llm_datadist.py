"""Re-export of :mod:`llmdd.v2.llm_datadist` (``llm_datadist.v2.llm_datadist``)."""

from llmdd.v2.llm_datadist import *  # noqa: F401,F403
from llmdd.v2.llm_datadist import __all__  # noqa: F401
from llmdd.v2.llm_datadist import _shutdown_handler  # noqa: F401,E402
