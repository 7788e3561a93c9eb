"""The log observer: one canonical line per lifecycle transition.

Each :class:`~llmdd.events.TransitionEvent` becomes one log line named
``llmdd.<machine>.transition`` on the stdlib logger ``llmdd.<machine>``, with the
fields of ``event.as_log_fields()``.  Levels: INFO for engine, link and comm
group; DEBUG for cache and task (they are frequent); WARNING whenever the event
carries an error.  When the logger is not enabled for that level nothing is
built, so subscribing costs one level check per event; the observer declares that
rule to the engine (``llmdd_wants``, :mod:`llmdd._extension.dispatch`), so a lifecycle builds no
event object while the logger is off.

It is an ordinary plugin (``llmdd._extension.builtin.log_events``): block it like any
other to silence or replace it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from llmdd._base import log as _log
from llmdd._extension.dispatch import declare_wants
from llmdd._lifecycle.events import TransitionEvent
from llmdd._lifecycle.tables import Machine
from llmdd.plugin import hookimpl

__all__ = [
    "LEVELS",
    "log_event",
    "wants_of",
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


def wants_of(machine: Machine) -> Callable[[Any], bool]:
    """``wants(error)``: would :func:`log_event` write a line for an event of ``machine`` (with
    ``error`` or without)?  The same rule as :func:`log_event`'s, one level check."""
    logger = _STDLIB[machine]
    level = LEVELS[machine]

    def wants(error: Optional[BaseException]) -> bool:
        return _log._native or logger.isEnabledFor(logging.WARNING if error is not None else level)

    return wants


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


def _declare() -> None:
    """Declare what this observer wants to the engine: a lifecycle builds no event while its logger is off."""
    for machine, impl in ((Machine.ENGINE, llmdd_engine_transition), (Machine.LINK, llmdd_link_transition),
                          (Machine.COMM_GROUP, llmdd_comm_group_transition), (Machine.CACHE, llmdd_cache_transition),
                          (Machine.TASK, llmdd_task_transition), (Machine.LISTENER, llmdd_listener_transition)):
        declare_wants(impl, wants_of(machine))


_declare()
