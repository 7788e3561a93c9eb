"""``llm_datadist.v2.llm_datadist``."""

from ..._datadist import LLMDataDist, _shutdown_handler  # noqa: F401
