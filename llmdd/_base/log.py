"""Logging shim: structlog loggers wrapped over the standard ``logging`` module.

The library never configures logging (no handlers, no ``structlog.configure``).
``logging.getLogger("llmdd")`` carries a ``NullHandler`` only, as libraries should.
Applications that run structlog themselves call :func:`enable_native_structlog`.

structlog is imported at the first log call whose level is enabled, not at import: ``import
structlog`` loads asyncio, ssl, colorama and more (about 8 MiB of an idle engine's RSS, issue 22),
and an idle engine under the default WARNING level logs nothing.  :func:`get_logger` hands out a
small proxy that checks the stdlib logger's level first (as the ``filter_by_level`` processor
would) and builds the structlog logger once, when a line is actually written.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["get_logger", "enable_native_structlog", "enable_upstream_logging"]

logging.getLogger("llmdd").addHandler(logging.NullHandler())

_native = False


def _render(_logger: Any, _name: str, event_dict: dict) -> tuple[tuple, dict]:
    """Render ``event k=v ...`` as the message; the fields travel in ``extra`` too."""
    event = event_dict.pop("event", "")
    fields = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in event_dict.items())
    msg = f"{event} {fields}" if fields else str(event)
    return (msg,), {"extra": {"llmdd": dict(event_dict, event=event)}}


_PROCESSORS: list = []


def _structlog_logger(name: str, initial: dict, native: bool) -> Any:
    import structlog  # deferred to the first enabled log call (see the module docstring)

    if native:
        return structlog.get_logger(name, **initial)
    if not _PROCESSORS:
        _PROCESSORS[:] = [structlog.stdlib.filter_by_level, structlog.contextvars.merge_contextvars, _render]
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=_PROCESSORS,
        wrapper_class=structlog.stdlib.BoundLogger,
        **initial,
    )


class _Logger:
    """The structlog logger of one name, built at its first enabled call (see the module docstring)."""

    __slots__ = ("_name", "_initial", "_native", "_std", "_real")

    def __init__(self, name: str, initial: dict, native: bool) -> None:
        self._name, self._initial, self._native = name, initial, native
        self._std = logging.getLogger(name)
        self._real: Any = None

    def _logger(self) -> Any:
        real = self._real
        if real is None:
            real = self._real = _structlog_logger(self._name, self._initial, self._native)
        return real

    def _on(self, level: int) -> bool:
        return self._native or self._std.isEnabledFor(level)

    def debug(self, event: Any = None, *args: Any, **kw: Any) -> Any:
        if self._on(logging.DEBUG):
            return self._logger().debug(event, *args, **kw)
        return None

    def info(self, event: Any = None, *args: Any, **kw: Any) -> Any:
        if self._on(logging.INFO):
            return self._logger().info(event, *args, **kw)
        return None

    def warning(self, event: Any = None, *args: Any, **kw: Any) -> Any:
        if self._on(logging.WARNING):
            return self._logger().warning(event, *args, **kw)
        return None

    warn = warning

    def error(self, event: Any = None, *args: Any, **kw: Any) -> Any:
        if self._on(logging.ERROR):
            return self._logger().error(event, *args, **kw)
        return None

    def exception(self, event: Any = None, *args: Any, **kw: Any) -> Any:
        if self._on(logging.ERROR):
            return self._logger().exception(event, *args, **kw)
        return None

    def critical(self, event: Any = None, *args: Any, **kw: Any) -> Any:
        if self._on(logging.CRITICAL):
            return self._logger().critical(event, *args, **kw)
        return None

    def log(self, level: int, event: Any = None, *args: Any, **kw: Any) -> Any:
        if self._on(level):
            return self._logger().log(level, event, *args, **kw)
        return None

    # binding stays lazy too: an endpoint or a link binds its fields when it is made, and that must
    # not load structlog (it cost each side's first link about 0.2 s)
    def bind(self, **kw: Any) -> "_Logger":
        return _Logger(self._name, {**self._initial, **kw}, self._native)

    def new(self, **kw: Any) -> "_Logger":
        return _Logger(self._name, dict(kw), self._native)

    def unbind(self, *keys: str) -> "_Logger":
        missing = [k for k in keys if k not in self._initial]
        if missing:
            raise KeyError(missing[0])
        return self.try_unbind(*keys)

    def try_unbind(self, *keys: str) -> "_Logger":
        return _Logger(self._name, {k: v for k, v in self._initial.items() if k not in keys}, self._native)

    def __getattr__(self, attr: str) -> Any:  # anything else: the structlog logger's own
        return getattr(self._logger(), attr)


def get_logger(name: str = "llmdd", **initial: Any):
    """Return a bound structlog logger over ``logging.getLogger(name)`` (built at its first enabled call)."""
    return _Logger(name, initial, _native)


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
