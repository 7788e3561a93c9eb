"""Value types, enums, status codes, options, profiles and logging: the bottom layer (imports nothing of llmdd)."""
