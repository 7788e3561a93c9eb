"""Every lifecycle of llmdd, as data.

Theory of operation
-------------------
Each resource with a lifecycle (the engine, a link to one peer cluster, a comm
group built by rank-table ``link()``, a cache, a transfer task) has a state and
changes it only by firing a *trigger* listed here.  API commands are imperative
verbs (``link``, ``cancel``); outcomes seen on the data path are past-tense facts
(``handshake_succeeded``, ``transfer_failed``).

Rule: nothing outside this file decides which state follows which.  The code
that drives a machine asks for a trigger; if the pair (state, trigger) is not in
the table, the trigger is refused with ``InvalidStateError`` and the state is
unchanged.  Every accepted trigger produces exactly one frozen event.

Terminal states (``FINAL``) are sticky: a closed link, a released cache, a
finished task never changes again.  The engine has no final state: it may be
initialized again after ``finalize``.
"""

from __future__ import annotations

import enum

__all__ = [
    "Machine",
    "EngineState",
    "LinkState",
    "CommGroupState",
    "CacheState",
    "TaskState",
    "TABLES",
    "INITIAL",
    "FINAL",
    "STATES",
]


class Machine(str, enum.Enum):
    ENGINE = "engine"
    LINK = "link"
    COMM_GROUP = "comm_group"
    CACHE = "cache"
    TASK = "task"


class EngineState(enum.Enum):
    CREATED = "created"
    INITIALIZED = "initialized"
    FINALIZED = "finalized"


class LinkState(enum.Enum):
    UNLINKED = "unlinked"    # created, nothing exchanged yet
    LINKING = "linking"      # connect + handshake in progress
    LINKED = "linked"        # both sides know each other; transfers allowed
    UNLINKING = "unlinking"  # a non-force unlink is notifying the peer
    FAILED = "failed"        # peer lost, handshake failed or a transfer timed out
    CLOSED = "closed"        # torn down; a relink makes a new link object


class CommGroupState(enum.Enum):
    PREPARING = "preparing"  # members linking / exchanging memory descriptors
    OK = "ok"                # every member's memory is exchanged
    FAILED = "failed"
    UNLINKED = "unlinked"


class CacheState(enum.Enum):
    NEW = "new"
    ALLOCATED = "allocated"              # owned memory drawn from a pool
    REGISTERED = "registered"            # caller's memory, registered
    RELEASE_PENDING = "release_pending"  # deallocated while keys still reference it
    RELEASED = "released"


class TaskState(enum.Enum):
    CREATED = "created"
    WAITING = "waiting"      # waiting for a layer synchronizer to release a layer
    RUNNING = "running"      # bytes are moving (a deadline is running)
    COMPLETED = "completed"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"


# Members of these enums are singletons compared by identity, so hashing them by identity is
# consistent with equality; it is a C slot instead of Enum.__hash__ (a Python call hashing the name),
# which the lifecycle pays several times per transition (table lookup, live counts).
for _states in (EngineState, LinkState, CommGroupState, CacheState, TaskState):
    _states.__hash__ = object.__hash__  # type: ignore[method-assign]
del _states


def _t(trigger: str, source, dest) -> dict:
    return {"trigger": trigger, "source": source, "dest": dest}


E, L, G, C, T = EngineState, LinkState, CommGroupState, CacheState, TaskState

ENGINE_TRANSITIONS = [
    _t("init", [E.CREATED, E.FINALIZED], E.INITIALIZED),
    _t("switch_role", E.INITIALIZED, E.INITIALIZED),
    _t("finalize", E.INITIALIZED, E.FINALIZED),
    # a listener of the engine cannot continue (logged once; the event says which and why)
    _t("listener_failed", E.INITIALIZED, E.INITIALIZED),
]

_LIVE_LINK = [L.UNLINKED, L.LINKING, L.LINKED, L.UNLINKING, L.FAILED]

LINK_TRANSITIONS = [
    _t("link", L.UNLINKED, L.LINKING),
    _t("accept", L.UNLINKED, L.LINKING),  # server side of a handshake
    _t("handshake_succeeded", L.LINKING, L.LINKED),
    _t("handshake_failed", L.LINKING, L.FAILED),
    _t("peer_lost", [L.LINKING, L.LINKED, L.UNLINKING], L.FAILED),
    _t("transfer_timed_out", L.LINKED, L.FAILED),
    _t("regions_updated", L.LINKED, L.LINKED),
    _t("unlink", L.LINKED, L.UNLINKING),
    _t("unlink_succeeded", L.UNLINKING, L.CLOSED),
    _t("unlink_failed", L.UNLINKING, L.FAILED),
    _t("peer_unlinked", [L.LINKED, L.UNLINKING, L.FAILED], L.CLOSED),
    _t("force_unlink", _LIVE_LINK, L.CLOSED),
    _t("finalize", _LIVE_LINK, L.CLOSED),
]

COMM_GROUP_TRANSITIONS = [
    _t("members_ready", G.PREPARING, G.OK),
    _t("prepare_failed", G.PREPARING, G.FAILED),
    _t("member_lost", [G.PREPARING, G.OK], G.FAILED),
    _t("unlink", [G.PREPARING, G.OK, G.FAILED], G.UNLINKED),
    _t("finalize", [G.PREPARING, G.OK, G.FAILED], G.UNLINKED),
]

CACHE_TRANSITIONS = [
    _t("allocate", C.NEW, C.ALLOCATED),
    _t("register", C.NEW, C.REGISTERED),
    _t("keys_changed", [C.ALLOCATED, C.REGISTERED, C.RELEASE_PENDING], "="),
    _t("peer_read", [C.ALLOCATED, C.REGISTERED, C.RELEASE_PENDING], "="),     # a peer finished reading
    _t("peer_written", [C.ALLOCATED, C.REGISTERED, C.RELEASE_PENDING], "="),  # a peer's push landed (or failed)
    _t("remapped", [C.ALLOCATED, C.REGISTERED], "="),
    _t("deallocate", C.ALLOCATED, C.RELEASED),
    _t("defer_release", C.ALLOCATED, C.RELEASE_PENDING),
    _t("keys_released", C.RELEASE_PENDING, C.RELEASED),
    _t("unregister", C.REGISTERED, C.RELEASED),
    _t("finalize", [C.ALLOCATED, C.REGISTERED, C.RELEASE_PENDING], C.RELEASED),
]

_OPEN_TASK = [T.CREATED, T.WAITING, T.RUNNING]

TASK_TRANSITIONS = [
    _t("start", [T.CREATED, T.WAITING], T.RUNNING),
    _t("wait_layer", [T.CREATED, T.RUNNING], T.WAITING),
    _t("transfer_succeeded", T.RUNNING, T.COMPLETED),
    _t("transfer_failed", _OPEN_TASK, T.FAILED),
    _t("synchronizer_refused", T.WAITING, T.FAILED),
    _t("deadline_expired", [T.RUNNING, T.CREATED], T.TIMED_OUT),
    _t("cancel", _OPEN_TASK, T.CANCELLED),
    # per-layer progress of a task is an event on the task machine, not a state
    _t("layer_transferred", T.RUNNING, "="),
]

#: every machine's transitions, fixed once built (tuples: nothing adds a row later)
TABLES = {
    Machine.ENGINE: tuple(ENGINE_TRANSITIONS),
    Machine.LINK: tuple(LINK_TRANSITIONS),
    Machine.COMM_GROUP: tuple(COMM_GROUP_TRANSITIONS),
    Machine.CACHE: tuple(CACHE_TRANSITIONS),
    Machine.TASK: tuple(TASK_TRANSITIONS),
}

STATES = {
    Machine.ENGINE: EngineState,
    Machine.LINK: LinkState,
    Machine.COMM_GROUP: CommGroupState,
    Machine.CACHE: CacheState,
    Machine.TASK: TaskState,
}

INITIAL = {
    Machine.ENGINE: E.CREATED,
    Machine.LINK: L.UNLINKED,
    Machine.COMM_GROUP: G.PREPARING,
    Machine.CACHE: C.NEW,
    Machine.TASK: T.CREATED,
}

FINAL = {
    Machine.ENGINE: frozenset(),
    Machine.LINK: frozenset({L.CLOSED}),
    Machine.COMM_GROUP: frozenset({G.UNLINKED}),
    Machine.CACHE: frozenset({C.RELEASED}),
    Machine.TASK: frozenset({T.COMPLETED, T.FAILED, T.TIMED_OUT, T.CANCELLED}),
}

