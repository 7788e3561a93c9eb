"""The log observer: one canonical line per lifecycle transition.

Each :class:`~llmdd.events.TransitionEvent` becomes one log line named
``llmdd.<machine>.transition`` on the stdlib logger ``llmdd.<machine>``, with the
fields of ``event.as_log_fields()``.  Levels: INFO for engine, link and comm
group; DEBUG for cache and task (they are frequent); WARNING whenever the event
carries an error.  When the logger is not enabled for that level nothing is
built, so subscribing costs one level check per event.

It is an ordinary plugin (``llmdd._extension.builtin.log_events``): block it like any
other to silence or replace it.
"""

from __future__ import annotations

import logging
from typing import Any

from llmdd._base import log as _log
from llmdd._lifecycle.events import TransitionEvent
from llmdd._lifecycle.tables import Machine
from llmdd.plugin import hookimpl

__all__ = [
    "LEVELS",
    "log_event",
    "llmdd_engine_transition",
    "llmdd_link_transition",
    "llmdd_comm_group_transition",
    "llmdd_cache_transition",
    "llmdd_task_transition",
    "llmdd_listener_transition",
]

#: Level of an event without error, per machine.
LEVELS: dict[Machine, int] = {
    Machine.ENGINE: logging.INFO,
    Machine.LINK: logging.INFO,
    Machine.COMM_GROUP: logging.INFO,
    Machine.CACHE: logging.DEBUG,
    Machine.TASK: logging.DEBUG,
    Machine.LISTENER: logging.INFO,
}

_STDLIB = {m: logging.getLogger(f"llmdd.{m.value}") for m in Machine}
_loggers: dict[tuple[Machine, bool], Any] = {}


def _logger(machine: Machine) -> Any:
    key = (machine, _log._native)
    logger = _loggers.get(key)
    if logger is None:
        # bind() once: a concrete bound logger, not a proxy re-assembled per call
        logger = _loggers[key] = _log.get_logger(f"llmdd.{machine.value}").bind()
    return logger


def log_event(event: TransitionEvent) -> None:
    """Write the one log line of ``event`` (if its logger is enabled for the level)."""
    level = logging.WARNING if event.error is not None else LEVELS[event.machine]
    if not _log._native and not _STDLIB[event.machine].isEnabledFor(level):
        return
    _logger(event.machine).log(level, event.name, **event.as_log_fields())


@hookimpl
def llmdd_engine_transition(event: TransitionEvent) -> None:
    log_event(event)


@hookimpl
def llmdd_link_transition(event: TransitionEvent) -> None:
    log_event(event)


@hookimpl
def llmdd_comm_group_transition(event: TransitionEvent) -> None:
    log_event(event)


@hookimpl
def llmdd_cache_transition(event: TransitionEvent) -> None:
    log_event(event)


@hookimpl
def llmdd_task_transition(event: TransitionEvent) -> None:
    log_event(event)


@hookimpl
def llmdd_listener_transition(event: TransitionEvent) -> None:
    log_event(event)
