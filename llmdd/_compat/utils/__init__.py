"""``llm_datadist.utils``."""
