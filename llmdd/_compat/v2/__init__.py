"""Re-export of :mod:`llmdd.v2` (``llm_datadist.v2``)."""
