"""The default ``llmdd_run_transfer``: run the task (``trylast``, so wrappers go around it)."""

from __future__ import annotations

from typing import Any, Callable

from llmdd.plugin import hookimpl

__all__ = ["llmdd_run_transfer"]


@hookimpl(trylast=True)
def llmdd_run_transfer(task: Any, run: Callable[[], Any]) -> Any:
    return run()
