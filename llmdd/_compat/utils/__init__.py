"""Re-export of :mod:`llmdd.utils` (``llm_datadist.utils``)."""
