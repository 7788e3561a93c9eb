"""pytest plugin of llmdd (loaded through the ``pytest11`` entry point): fixtures.

* ``pm``: a fresh plugin manager, entry points not loaded, strict (a raising
  subscriber fails the test);
* ``hooks``: the typed :class:`~llmdd._plugins.Hooks` facade over ``pm``;
* ``hook_recorder``: a :class:`~llmdd.testing.HookRecorder` on ``pm``;
* ``log_output``: the ``llmdd`` log lines of the test as dicts
  (:class:`~llmdd.testing.LogOutput`, DEBUG and above).
"""

from __future__ import annotations

from typing import Iterator

import pytest

from .._plugins import Hooks, LLMDDPluginManager, make_plugin_manager
from ._recorder import HookRecorder, LogOutput, capture_log_output

__all__ = ["pm", "hooks", "hook_recorder", "log_output"]


@pytest.fixture
def pm() -> LLMDDPluginManager:
    """A fresh plugin manager: default plugins only, strict."""
    return make_plugin_manager(autoload=False, strict=True)


@pytest.fixture
def hooks(pm: LLMDDPluginManager) -> Hooks:
    """The typed hook facade over ``pm`` (strict)."""
    return Hooks(pm)


@pytest.fixture
def hook_recorder(pm: LLMDDPluginManager) -> Iterator[HookRecorder]:
    """Records every hook call made through ``pm``."""
    with HookRecorder(pm) as recorder:
        yield recorder


@pytest.fixture
def log_output() -> Iterator[LogOutput]:
    """Captures llmdd's log lines (level DEBUG and above) as dicts."""
    with capture_log_output() as output:
        yield output
