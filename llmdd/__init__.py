"""llmdd: a pluggable KV-cache transfer engine, source-compatible with LLM-DataDist."""
