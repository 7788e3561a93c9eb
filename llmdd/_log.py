"""Logging shim: structlog loggers wrapped over the standard ``logging`` module.

The library never configures logging (no handlers, no ``structlog.configure``).
``logging.getLogger("llmdd")`` carries a ``NullHandler`` only, as libraries should.
Applications that run structlog themselves call :func:`enable_native_structlog`.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

__all__ = ["get_logger", "enable_native_structlog", "enable_upstream_logging"]

logging.getLogger("llmdd").addHandler(logging.NullHandler())

_native = False


def _render(_logger: Any, _name: str, event_dict: dict) -> tuple[tuple, dict]:
    """Render ``event k=v ...`` as the message; the fields travel in ``extra`` too."""
    event = event_dict.pop("event", "")
    fields = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in event_dict.items())
    msg = f"{event} {fields}" if fields else str(event)
    return (msg,), {"extra": {"llmdd": dict(event_dict, event=event)}}


_PROCESSORS = [
    structlog.stdlib.filter_by_level,
    structlog.contextvars.merge_contextvars,
    _render,
]


def get_logger(name: str = "llmdd", **initial: Any):
    """Return a bound structlog logger over ``logging.getLogger(name)``."""
    if _native:
        return structlog.get_logger(name, **initial)
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=_PROCESSORS,
        wrapper_class=structlog.stdlib.BoundLogger,
        **initial,
    )


def enable_native_structlog() -> None:
    """Make llmdd loggers created from now on use the application's structlog configuration."""
    global _native
    _native = True


def enable_upstream_logging() -> logging.Logger:
    """Opt-in helper reproducing upstream's ``LLM_DATADIST`` stdout logging.

    Upstream attaches a stdout handler at import with a level from
    ``ASCEND_GLOBAL_LOG_LEVEL`` ("0" DEBUG .. "3" ERROR, default ERROR).  llmdd
    never does that by itself; an application that wants it calls this.
    """
    import os
    import sys

    levels = {"0": logging.DEBUG, "1": logging.INFO, "2": logging.WARNING, "3": logging.ERROR}
    level = levels.get(os.environ.get("ASCEND_GLOBAL_LOG_LEVEL", "3"), logging.ERROR)
    logger = logging.getLogger("llmdd")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(
        "[%(levelname)s] %(name)s(%(process)d,%(processName)s):%(asctime)s.%(msecs)03d "
        "[%(filename)s:%(lineno)d]%(thread)d %(funcName)s: %(message)s", "%Y-%m-%d-%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level)
    return logger
