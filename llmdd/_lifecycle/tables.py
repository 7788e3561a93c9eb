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

Some triggers may legitimately arrive after their resource has moved on: a peer loss reported
for a link that an unlink already closed, a cancel for a task that has just finished.  Those
pairs are listed here too, in ``ABSORBED``: the driver offers such a trigger
(``Tracked.offer``), the table absorbs it (no state change, no event, counted), and every
other illegal pair still raises.  No driver decides by itself to skip a trigger.

Terminal states (``FINAL``) are sticky: a closed link, a released cache, a
finished task never changes again.  The engine has no final state: it may be
initialized again after ``finalize``.
"""

from __future__ import annotations

import enum

__all__ = [
    "Machine", "EngineState", "ListenerState", "LinkState", "CommGroupState", "CacheState", "TaskState",
    "TABLES", "INITIAL", "FINAL", "STATES", "ABSORBED",
    # the named groups of states (Tracked.in_)
    "LINK_SETTING_UP", "LINK_IN_USE", "LINK_UP", "LINK_RELEASED", "LINK_UNLINKING", "LINK_FAILED", "LINK_BUSY", "LINK_PROCESSING",
    "LINK_DOWN", "LINK_KEEPS_ALIVE", "LINK_SERVES", "LINK_CLAIMABLE", "LINK_REPORTED", "CACHE_HOLDS_MEMORY", "CACHE_RELEASE_PENDING",
    "ENGINE_UP", "LISTENER_OPEN", "GROUP_PREPARING", "GROUP_OK",
]


class Machine(str, enum.Enum):
    ENGINE = "engine"
    LINK = "link"
    COMM_GROUP = "comm_group"
    CACHE = "cache"
    TASK = "task"
    LISTENER = "listener"


class EngineState(enum.Enum):
    CREATED = "created"
    INITIALIZED = "initialized"
    FINALIZED = "finalized"


class LinkState(enum.Enum):
    UNLINKED = "unlinked"    # created, nothing exchanged yet
    LINKING = "linking"      # connect + handshake in progress
    LINKED = "linked"        # both sides know each other; transfers allowed
    UNLINKING = "unlinking"  # a non-force unlink is notifying the peer
    # this side gave back its last hold while the peer still holds the link (a mutual link unlinked
    # by one side): up, served and kept alive for the peer, not used by this side's transfers
    RELEASED = "released"
    FAILED = "failed"        # peer lost, handshake failed or a transfer timed out
    CLOSED = "closed"        # torn down; a relink makes a new link object


class ListenerState(enum.Enum):
    LISTENING = "listening"
    FAILED = "failed"      # cannot continue: logged once, an engine event, links to it fail
    CLOSED = "closed"


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
for _states in (EngineState, LinkState, CommGroupState, CacheState, TaskState, ListenerState):
    # reason: replacing a method of a class is what this loop is for, and mypy refuses any method assignment
    _states.__hash__ = object.__hash__  # type: ignore[method-assign]
del _states


def _t(trigger: str, source, dest) -> dict:
    return {"trigger": trigger, "source": source, "dest": dest}


E, L, G, C, T, N = EngineState, LinkState, CommGroupState, CacheState, TaskState, ListenerState

ENGINE_TRANSITIONS = [
    _t("init", [E.CREATED, E.FINALIZED], E.INITIALIZED),
    _t("switch_role", E.INITIALIZED, E.INITIALIZED),
    _t("finalize", E.INITIALIZED, E.FINALIZED),
    # a listener of the engine cannot continue (logged once; the event says which and why)
    _t("listener_failed", E.INITIALIZED, E.INITIALIZED),
]

_LIVE_LINK = [L.UNLINKED, L.LINKING, L.LINKED, L.UNLINKING, L.RELEASED, L.FAILED]

LINK_TRANSITIONS = [
    _t("link", L.UNLINKED, L.LINKING),
    _t("accept", L.UNLINKED, L.LINKING),  # server side of a handshake
    _t("handshake_succeeded", L.LINKING, L.LINKED),
    _t("handshake_failed", L.LINKING, L.FAILED),
    _t("peer_lost", [L.LINKING, L.LINKED, L.UNLINKING, L.RELEASED], L.FAILED),
    _t("transfer_timed_out", L.LINKED, L.FAILED),
    _t("regions_updated", L.LINKED, L.LINKED),
    _t("regions_updated", L.RELEASED, L.RELEASED),
    _t("unlink", L.LINKED, L.UNLINKING),
    _t("unlink_succeeded", L.UNLINKING, L.CLOSED),
    # the peer still holds the link (it linked to this side too, or a comm group of its uses it):
    # only this side's hold went, the link stays up for the peer
    _t("unlink_kept", L.UNLINKING, L.RELEASED),
    # a hold of this side again (its link_clusters, a comm group): its transfers may use it
    _t("hold", L.RELEASED, L.LINKED),
    _t("unlink_failed", L.UNLINKING, L.FAILED),
    _t("peer_unlinked", [L.LINKED, L.UNLINKING, L.RELEASED, L.FAILED], L.CLOSED),
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
    _t("peer_note", [C.ALLOCATED, C.REGISTERED, C.RELEASE_PENDING], "="),     # a peer's notes about the cache
    _t("remapped", [C.ALLOCATED, C.REGISTERED], "="),
    _t("deallocate", C.ALLOCATED, C.RELEASED),
    _t("defer_release", C.ALLOCATED, C.RELEASE_PENDING),
    _t("keys_released", C.RELEASE_PENDING, C.RELEASED),
    _t("unregister", C.REGISTERED, C.RELEASED),
    _t("finalize", [C.ALLOCATED, C.REGISTERED, C.RELEASE_PENDING], C.RELEASED),
]

_OPEN_TASK = [T.CREATED, T.WAITING, T.RUNNING]
_DONE_TASK = [T.COMPLETED, T.FAILED, T.TIMED_OUT, T.CANCELLED]

TASK_TRANSITIONS = [
    _t("start", [T.CREATED, T.WAITING], T.RUNNING),
    _t("wait_layer", [T.CREATED, T.RUNNING], T.WAITING),
    _t("transfer_succeeded", T.RUNNING, T.COMPLETED),
    _t("transfer_failed", _OPEN_TASK, T.FAILED),
    _t("synchronizer_refused", T.WAITING, T.FAILED),
    _t("deadline_expired", [T.RUNNING, T.CREATED], T.TIMED_OUT),
    _t("cancel", _OPEN_TASK, T.CANCELLED),
    # a queued task (a non-blocking pull waiting for a pull worker) withdrawn before it started: its
    # link went down, or the engine is finalized
    _t("withdraw", T.CREATED, T.CANCELLED),
    # per-layer progress of a task is an event on the task machine, not a state
    _t("layer_transferred", T.RUNNING, "="),
]

# a listening socket of the engine (the control port, a comm group's port, a transport's data port)
LISTENER_TRANSITIONS = [
    _t("fail", N.LISTENING, N.FAILED),    # accept() failed for good, or the I/O loop died
    _t("close", N.LISTENING, N.CLOSED),
]

#: every machine's transitions, fixed once built (tuples: nothing adds a row later)
TABLES = {
    Machine.ENGINE: tuple(ENGINE_TRANSITIONS),
    Machine.LINK: tuple(LINK_TRANSITIONS),
    Machine.COMM_GROUP: tuple(COMM_GROUP_TRANSITIONS),
    Machine.CACHE: tuple(CACHE_TRANSITIONS),
    Machine.TASK: tuple(TASK_TRANSITIONS),
    Machine.LISTENER: tuple(LISTENER_TRANSITIONS),
}

STATES = {
    Machine.ENGINE: EngineState,
    Machine.LINK: LinkState,
    Machine.COMM_GROUP: CommGroupState,
    Machine.CACHE: CacheState,
    Machine.TASK: TaskState,
    Machine.LISTENER: ListenerState,
}

INITIAL = {
    Machine.ENGINE: E.CREATED,
    Machine.LINK: L.UNLINKED,
    Machine.COMM_GROUP: G.PREPARING,
    Machine.CACHE: C.NEW,
    Machine.TASK: T.CREATED,
    Machine.LISTENER: N.LISTENING,
}

FINAL = {
    Machine.ENGINE: frozenset(),
    Machine.LINK: frozenset({L.CLOSED}),
    Machine.COMM_GROUP: frozenset({G.UNLINKED}),
    Machine.CACHE: frozenset({C.RELEASED}),
    Machine.TASK: frozenset(_DONE_TASK),
    Machine.LISTENER: frozenset({N.FAILED, N.CLOSED}),
}


#: (trigger, states) pairs a driver may offer late: absorbed (no change, no event), never an error.
#: Each row says why the trigger can arrive after its resource moved on.
ABSORBED = {
    Machine.ENGINE: (
        # a listener failed while the engine was finalizing (or before its first init finished)
        ("listener_failed", (E.CREATED, E.FINALIZED)),
    ),
    Machine.LINK: (
        # the loss, a transfer's timeout or a failed unlink notice is seen after the link already
        # failed or was closed by another thread (keepalive, data plane, unlink, finalize)
        ("peer_lost", (L.UNLINKED, L.FAILED, L.CLOSED)),
        # (UNLINKING, RELEASED: a transfer's deadline seen after this side's unlink began; the unlink
        # started only once no transfer held the link, so it is a step of one that ended already)
        ("transfer_timed_out", (L.UNLINKING, L.RELEASED, L.FAILED, L.CLOSED)),
        ("handshake_failed", (L.FAILED, L.CLOSED)),
        # teardown of a link another thread closed already
        ("force_unlink", (L.CLOSED,)),
        ("finalize", (L.CLOSED,)),
        ("peer_unlinked", (L.CLOSED,)),
        ("unlink_succeeded", (L.CLOSED,)),
        # an unanswered unlink whose link the peer's own unlink closed first (both sides unlinking at
        # once: each answers the other's request and closes), or whose peer was lost meanwhile
        ("unlink_failed", (L.FAILED, L.CLOSED)),
        # the peer answered that it keeps the link, but its own unlink (or a loss) ended it first
        ("unlink_kept", (L.FAILED, L.CLOSED)),
        # a hold taken again on a released link that a loss or a teardown ended meanwhile
        ("hold", (L.FAILED, L.CLOSED)),
    ),
    Machine.COMM_GROUP: (
        # the group was unlinked (or the engine finalized) while its members were still linking
        ("prepare_failed", (G.UNLINKED,)),
        ("unlink", (G.UNLINKED,)),
        ("finalize", (G.UNLINKED,)),
    ),
    Machine.CACHE: (
        # a peer's notice, a remap or a finalize for a cache released meanwhile (notices are one-way)
        ("peer_read", (C.RELEASED,)),
        ("peer_written", (C.RELEASED,)),
        ("peer_note", (C.RELEASED,)),
        ("keys_changed", (C.RELEASED,)),
        ("remapped", (C.RELEASE_PENDING, C.RELEASED)),
        ("finalize", (C.NEW, C.RELEASED)),
    ),
    Machine.TASK: (
        # a cancel or a failure that arrives after the task ended (it finished first)
        ("cancel", tuple(_DONE_TASK)),
        ("transfer_failed", tuple(_DONE_TASK)),
        # a queued task is withdrawn after a worker started it (or it finished): the worker ends it
        ("withdraw", (T.RUNNING, *_DONE_TASK)),
        # a worker picks up a queued task that was withdrawn meanwhile
        ("start", (T.CANCELLED,)),
    ),
    Machine.LISTENER: (
        # the listener failed or was closed already (close after a failure; the loop's death)
        ("fail", (N.FAILED, N.CLOSED)),
        ("close", (N.FAILED, N.CLOSED)),
    ),
}

# ------------------------------------------------------------------------------------------
# Named groups of states: the only place states are grouped.  Drivers ask a resource
# ``tracked.in_(GROUP)``; no code outside this package compares or assigns a state.

#: a link being set up (the handshake or the table exchange runs)
LINK_SETTING_UP = frozenset({L.LINKING})
#: links that carry this side's transfers
LINK_IN_USE = frozenset({L.LINKED})
#: links that are up with their peer: in use here, or released by this side and kept by the peer
LINK_UP = frozenset({L.LINKED, L.RELEASED})
#: released by this side, kept by the peer (served, not used here; a new link_clusters holds it again)
LINK_RELEASED = frozenset({L.RELEASED})
#: the state statistics report for a link: its own, but a RELEASED link is reported LINKED (it is
#: linked with its peer; statistics' ``released`` says this side let it go), as before the state existed
LINK_REPORTED = {**{state: state.value for state in LinkState}, L.RELEASED: L.LINKED.value}
#: a non-force unlink is waiting for the peer's acknowledgement
LINK_UNLINKING = frozenset({L.UNLINKING})
#: failed: the peer must be relinked (a new link may replace it)
LINK_FAILED = frozenset({L.FAILED})
#: a call finds work in progress on the link (LLM_PROCESSING_LINK)
LINK_BUSY = frozenset({L.LINKING, L.UNLINKING})
#: not linked yet or in a change of state: a second link_clusters is told it is processing
LINK_PROCESSING = frozenset({L.UNLINKED, L.LINKING, L.UNLINKING})
#: links that are gone for transfers (a relink is needed)
LINK_DOWN = frozenset({L.FAILED, L.CLOSED})
#: links the keepalive watches (the peer is expected to answer)
LINK_KEEPS_ALIVE = frozenset({L.LINKED, L.UNLINKING, L.RELEASED})
#: links whose peer's requests and notices are served (anything else is fenced: not served, not
#: recorded).  LINKING is served on the client side only: the server is LINKED before its tables
#: leave, so it may ask before the client's own setup finished (``Link.serves_peer``)
LINK_SERVES = frozenset({L.LINKED, L.UNLINKING, L.RELEASED})
#: a link the peer started that this side's link_clusters may claim
LINK_CLAIMABLE = frozenset({L.LINKING, L.LINKED, L.RELEASED})
#: caches whose memory is still held (allocated or registered, not being released)
CACHE_HOLDS_MEMORY = frozenset({C.ALLOCATED, C.REGISTERED})
#: a cache deallocated while keys still reference it
CACHE_RELEASE_PENDING = frozenset({C.RELEASE_PENDING})
#: engine initialized (between init and finalize)
ENGINE_UP = frozenset({E.INITIALIZED})
#: the listener accepts
LISTENER_OPEN = frozenset({N.LISTENING})
#: comm group states for query_register_mem_status
GROUP_PREPARING = frozenset({G.PREPARING})
GROUP_OK = frozenset({G.OK})

