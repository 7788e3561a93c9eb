"""``llm_datadist.utils.log``: upstream's logger name, without upstream's handler (see docs/deviations.md)."""

import logging

logger = logging.getLogger("LLM_DATADIST")
