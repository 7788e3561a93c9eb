"""Frozen transition events: the one object that feeds hooks, log lines and statistics."""

from __future__ import annotations

import enum
import types
from typing import Any, Mapping, Union

import attrs

from llmdd._lifecycle.tables import Machine

#: what names a resource in its events: a link's peer cluster id, a cache's id, a task's id, a comm
#: group's comm id, the engine's cluster id (ints); a listener's ``kind@host:port`` (a str)
ResourceId = Union[int, str]

__all__ = [
    "TransitionEvent",
    "EVENT_NAMES",
    "EVENT_ENGINE_TRANSITION",
    "EVENT_LINK_TRANSITION",
    "EVENT_COMM_GROUP_TRANSITION",
    "EVENT_CACHE_TRANSITION",
    "EVENT_TASK_TRANSITION",
    "EVENT_LISTENER_TRANSITION",
]

EVENT_ENGINE_TRANSITION = "llmdd.engine.transition"
EVENT_LINK_TRANSITION = "llmdd.link.transition"
EVENT_COMM_GROUP_TRANSITION = "llmdd.comm_group.transition"
EVENT_CACHE_TRANSITION = "llmdd.cache.transition"
EVENT_TASK_TRANSITION = "llmdd.task.transition"
EVENT_LISTENER_TRANSITION = "llmdd.listener.transition"

EVENT_NAMES = {
    Machine.ENGINE: EVENT_ENGINE_TRANSITION,
    Machine.LINK: EVENT_LINK_TRANSITION,
    Machine.COMM_GROUP: EVENT_COMM_GROUP_TRANSITION,
    Machine.CACHE: EVENT_CACHE_TRANSITION,
    Machine.TASK: EVENT_TASK_TRANSITION,
    Machine.LISTENER: EVENT_LISTENER_TRANSITION,
}

_EMPTY: Mapping[str, Any] = types.MappingProxyType({})


def _freeze(info: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if not info:
        return _EMPTY
    return types.MappingProxyType(dict(info))


@attrs.frozen(kw_only=True, slots=True)
class TransitionEvent:
    """One accepted trigger of one lifecycle machine.

    ``info`` carries what matters for the machine: ``peer`` (cluster id),
    ``reason``, ``transport``, ``bytes``, ``layers``, ``cache_id``... Failures
    are transitions too, with ``error`` set.
    """

    machine: Machine
    id: ResourceId
    source: enum.Enum
    dest: enum.Enum
    trigger: str
    error: BaseException | None = None
    at: float
    info: Mapping[str, Any] = attrs.field(default=_EMPTY, converter=_freeze)

    @property
    def name(self) -> str:
        return EVENT_NAMES[self.machine]

    def as_log_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "machine": self.machine.value,
            "id": self.id,
            "source": self.source.value,
            "dest": self.dest.value,
            "trigger": self.trigger,
        }
        if self.error is not None:
            fields["error"] = f"{type(self.error).__name__}: {self.error}"
        fields.update(self.info)
        return fields
