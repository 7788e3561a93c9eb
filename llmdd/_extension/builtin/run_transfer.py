"""The default ``llmdd_run_transfer``: run the task (``trylast``, so wrappers go around it).

It declares itself a pass-through (``llmdd_passthrough``, :mod:`llmdd._extension.dispatch`): while it
is the only implementation, a task's transfer runs without the hook call."""

from __future__ import annotations

from typing import Any, Callable

from llmdd._extension.dispatch import declare_passthrough
from llmdd.plugin import hookimpl

__all__ = ["llmdd_run_transfer"]


@hookimpl(trylast=True)
def llmdd_run_transfer(task: object, run: Callable[[], Any]) -> Any:
    return run()


declare_passthrough(llmdd_run_transfer)
