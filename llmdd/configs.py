"""``llm_datadist.configs``: roles, cluster descriptions, the option builder and ``trans_str_ip``."""

from llmdd._base.config import LLMClusterInfo, LlmConfig, LLMConfig, trans_str_ip
from llmdd._base.enums import LLMRole

__all__ = ["LLMRole", "trans_str_ip", "LLMClusterInfo", "LlmConfig", "LLMConfig"]
