"""Public test support for llmdd users and plugin authors."""
