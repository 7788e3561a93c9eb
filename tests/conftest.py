"""Thin: the fixtures (llmdd_pm, llmdd_hooks, llmdd_hook_recorder, llmdd_log_output) come from
llmdd.testing.pytest_plugin, loaded by the root conftest.py (the plugin is opt-in)."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _sweep_segments_of_killed_engines():
    """Many tests SIGKILL engine processes on purpose; their shared-memory segments outlive them
    (nothing may unlink another process's segments while it lives).  After the session, remove the
    llmdd segments whose creating process is gone, so repeated runs do not fill /dev/shm."""
    yield
    from llmdd._memory.backend import sweep_orphan_segments

    sweep_orphan_segments()
