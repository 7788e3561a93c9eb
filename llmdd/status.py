"""``llm_datadist.status``: status codes, the contract's exception and the status helpers."""

from llmdd._base.status import (LLMException, LLMStatusCode, Status, code_2_status, handle_llm_status, raise_if_false,
                      raise_if_true)

__all__ = ["LLMStatusCode", "LLMException", "Status", "code_2_status", "handle_llm_status", "raise_if_false",
           "raise_if_true"]
