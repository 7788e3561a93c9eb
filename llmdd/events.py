"""Public: the transition events subscribers receive and their names."""

from llmdd._lifecycle.events import (
    EVENT_CACHE_TRANSITION as EVENT_CACHE_TRANSITION,
    EVENT_COMM_GROUP_TRANSITION as EVENT_COMM_GROUP_TRANSITION,
    EVENT_ENGINE_TRANSITION as EVENT_ENGINE_TRANSITION,
    EVENT_LINK_TRANSITION as EVENT_LINK_TRANSITION,
    EVENT_TASK_TRANSITION as EVENT_TASK_TRANSITION,
    EVENT_LISTENER_TRANSITION as EVENT_LISTENER_TRANSITION,
    TransitionEvent as TransitionEvent,
)
from llmdd._lifecycle.tables import (
    CacheState as CacheState,
    CommGroupState as CommGroupState,
    EngineState as EngineState,
    LinkState as LinkState,
    ListenerState as ListenerState,
    Machine as Machine,
    TaskState as TaskState,
)

__all__ = [
    "TransitionEvent", "Machine", "EngineState", "LinkState", "CommGroupState", "CacheState", "TaskState",
    "ListenerState", "EVENT_ENGINE_TRANSITION", "EVENT_LINK_TRANSITION", "EVENT_COMM_GROUP_TRANSITION",
    "EVENT_CACHE_TRANSITION", "EVENT_TASK_TRANSITION", "EVENT_LISTENER_TRANSITION",
]
