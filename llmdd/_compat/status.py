"""``llm_datadist.status``."""

from .._status import (LLMException, LLMStatusCode, Status, code_2_status, handle_llm_status,  # noqa: F401
                       raise_if_false, raise_if_true)
