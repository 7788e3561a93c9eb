"""pytest plugin of llmdd: fixtures for plugin authors and llmdd's own tests.

Opt-in: installing llmdd registers nothing with pytest (no ``pytest11`` entry point), so a
framework's own test suite never sees these fixtures unless it asks for them, with either

* ``pytest_plugins = ["llmdd.testing.pytest_plugin"]`` in the root ``conftest.py``, or
* ``-p llmdd.testing.pytest_plugin`` on the command line or in ``addopts``.

Every fixture carries the ``llmdd_`` prefix, so none shadows a fixture of the suite loading it:

* ``llmdd_pm``: a fresh plugin manager, entry points not loaded, strict (a raising
  subscriber fails the test);
* ``llmdd_hooks``: the typed :class:`~llmdd._extension.manager.Hooks` facade over ``llmdd_pm``;
* ``llmdd_hook_recorder``: a :class:`~llmdd.testing.HookRecorder` on ``llmdd_pm``;
* ``llmdd_log_output``: the ``llmdd`` log lines of the test as dicts
  (:class:`~llmdd.testing.LogOutput`, DEBUG and above).
"""

from __future__ import annotations

from typing import Iterator

import pytest

from llmdd._extension.manager import Hooks, LLMDDPluginManager, make_plugin_manager
from llmdd.testing._recorder import HookRecorder, LogOutput, capture_log_output

__all__ = ["llmdd_pm", "llmdd_hooks", "llmdd_hook_recorder", "llmdd_log_output"]


@pytest.fixture
def llmdd_pm() -> LLMDDPluginManager:
    """A fresh plugin manager: default plugins only, strict."""
    return make_plugin_manager(autoload=False, strict=True)


@pytest.fixture
def llmdd_hooks(llmdd_pm: LLMDDPluginManager) -> Hooks:
    """The typed hook facade over ``llmdd_pm`` (strict)."""
    return Hooks(llmdd_pm)


@pytest.fixture
def llmdd_hook_recorder(llmdd_pm: LLMDDPluginManager) -> Iterator[HookRecorder]:
    """Records every hook call made through ``llmdd_pm``."""
    with HookRecorder(llmdd_pm) as recorder:
        yield recorder


@pytest.fixture
def llmdd_log_output() -> Iterator[LogOutput]:
    """Captures llmdd's log lines (level DEBUG and above) as dicts."""
    with capture_log_output() as output:
        yield output
