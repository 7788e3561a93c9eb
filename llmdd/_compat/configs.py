"""``llm_datadist.configs``."""

from .._config import LLMClusterInfo, LlmConfig, LLMConfig  # noqa: F401
from .._enums import LLMRole  # noqa: F401
