"""llmdd's log lines in vLLM's log (the library configures no logging; the connector routes it)."""

from __future__ import annotations

import logging

__all__ = ["ToVllmLog", "route_llmdd_log"]


class ToVllmLog(logging.Handler):
    """Hands the records of llmdd's loggers (``llmdd.*``: the library configures no logging, its
    ``llmdd`` logger carries a NullHandler only) to vLLM's logger ``vllm.llmdd``, whose handlers
    (vLLM's logging configuration) write them with vLLM's own lines."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("vllm.llmdd")
        if target.isEnabledFor(record.levelno):
            target.handle(record)


def route_llmdd_log() -> None:
    """Once per process: llmdd's log into vLLM's (a link failure's ``llmdd.link.failed`` line with
    its reason, engine and link transitions).  llmdd's logger follows vLLM's level unless the
    application set one."""
    lib = logging.getLogger("llmdd")
    if any(isinstance(h, ToVllmLog) for h in lib.handlers):
        return
    if lib.level == logging.NOTSET:
        lib.setLevel(logging.getLogger("vllm").getEffectiveLevel())
    lib.addHandler(ToVllmLog())
