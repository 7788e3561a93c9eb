"""``llm_datadist.v2``."""
