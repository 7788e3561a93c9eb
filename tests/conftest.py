"""Thin: the fixtures (pm, hooks, hook_recorder, log_output) come from llmdd.testing.pytest_plugin (pytest11)."""
