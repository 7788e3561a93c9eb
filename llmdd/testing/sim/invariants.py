"""The simulator's named invariants: what must hold after every step of a run.

Each check is a function of what the run recorded (:class:`Record`: the workload's calls and their
outcomes, every lifecycle event of every engine, every landing of the sim transport) and returns the
:class:`Violation` objects it found; the runner calls :func:`check_step` after every step and
:func:`check_final` once at the end.  The names (``INVARIANTS``) are what ``llmdd sim`` prints and what
the mutation tests expect to see.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Union

import attrs

from llmdd._lifecycle.tables import ABSORBED, FINAL, INITIAL, TABLES, Machine

if TYPE_CHECKING:
    from llmdd._lifecycle.events import TransitionEvent

__all__ = ["Violation", "Record", "Call", "INVARIANTS", "check_step", "check_final", "BOUND_S"]

#: the scheduling bound a call may take past its deadline: wake-ups, the last message's latency,
#: draining the transport (docs/simulation.md, "The invariants")
BOUND_S = 0.5

INVARIANTS = {
    "call_deadline": "every API call returns by its deadline plus BOUND_S",
    "contract_status": "every API call returns or raises a contract status (LLMException, or TypeError/ValueError "
                       "for an argument of a wrong type or range), never another exception",
    "task_once": "every non-blocking task ends exactly once (its callback once, with a status), and by finalize",
    "bytes_delivered": "a transfer reported successful delivered exactly the owner's bytes of those blocks",
    "no_late_landing": "no byte lands in a destination outside a call that may write it (after it returned, "
                       "failed or was cancelled)",
    "no_success_after_revocation": "no transfer succeeds after unlink, link failure, deregistration, restart or "
                                   "finalize of either side (an old incarnation is never served)",
    "tags_once_in_order": "every tag of a successful tagged pull reaches the owner exactly once, in order per link",
    "lifecycle_paths": "every event sequence of every resource is a path of the lifecycle tables",
    "statistics_agree": "statistics() states agree with the last event of each link",
    "nothing_left": "at finalize nothing is left: links, registrations, tasks, transport endpoints, runtime work",
    "bounded_growth": "no engine's queues or buffers grow without bound under a stalled or hostile peer",
    "engine_failure": "no engine callback, pool task or worker raised (the runtime recorded none)",
    "progress": "the world never livelocks (steps without the clock moving) and no wait is one nothing can end",
}


@attrs.frozen
class Violation:
    invariant: str
    step: int
    detail: str

    def __str__(self) -> str:
        return f"[{self.invariant}] step {self.step}: {self.detail}"


@attrs.define(eq=False)
class Call:
    """One API call of the workload: what was asked, when, by when, and what came back."""

    step: int
    engine: int
    op: str
    args: str
    started: float
    deadline: float          # the latest the call may return (its timeout + every step's, without BOUND_S)
    ended: Optional[float] = None
    status: Optional[str] = None      # LLMStatusCode name, "raised:<Type>", or "ok"
    exception: Optional[BaseException] = None
    result: Any = None       # what the call returned, recorded as it is (any API call's result)


@attrs.define(eq=False)
class Record:
    """What a run recorded so far, and how far each check has read it."""

    calls: list[Call] = attrs.field(factory=list)
    #: (engine, incarnation, event): every lifecycle event of every engine, in order
    events: list[tuple[int, int, TransitionEvent]] = attrs.field(factory=list)
    violations: list[Violation] = attrs.field(factory=list)
    step: int = 0
    _calls_seen: int = 0
    _events_seen: int = 0
    #: (engine, incarnation, machine, id) -> last state seen
    states: dict = attrs.field(factory=dict)

    def add(self, invariant: str, detail: str) -> None:
        assert invariant in INVARIANTS, invariant
        self.violations.append(Violation(invariant, self.step, detail))


_ALLOWED: dict[Machine, set] = {}
_ABSORB: dict[Machine, set] = {}
for _machine, _rows in TABLES.items():
    allowed = set()
    for row in _rows:
        sources = row["source"] if isinstance(row["source"], list) else [row["source"]]
        for src in sources:
            allowed.add((row["trigger"], src, src if row["dest"] == "=" else row["dest"]))
    _ALLOWED[_machine] = allowed
    _ABSORB[_machine] = {(trig, s) for trig, states in ABSORBED.get(_machine, ()) for s in states}


def _check_calls(rec: Record) -> None:
    for call in rec.calls[rec._calls_seen:]:
        if call.ended is None:
            return   # the step is still running it (never the case between steps)
        rec._calls_seen += 1
        if call.ended > call.deadline + BOUND_S:
            rec.add("call_deadline", f"engine {call.engine} {call.op}({call.args}) took "
                    f"{call.ended - call.started:.3f}s, deadline {call.deadline - call.started:.3f}s + {BOUND_S}s")
        exc = call.exception
        if exc is not None and not _contract(exc):
            rec.add("contract_status", f"engine {call.engine} {call.op}({call.args}) raised {type(exc).__name__}: "
                    f"{exc}")


def _contract(exc: BaseException) -> bool:
    from llmdd._base.status import LLMException, LLMStatusCode
    if isinstance(exc, LLMException):
        return isinstance(getattr(exc, "status_code", None), LLMStatusCode)
    return type(exc) in (TypeError, ValueError)


def _check_events(rec: Record) -> None:
    for engine, inc, ev in rec.events[rec._events_seen:]:
        rec._events_seen += 1
        machine = ev.machine
        key = (engine, inc, machine, ev.id)
        prev = rec.states.get(key)
        if prev is None:
            prev = INITIAL[machine]
        if ev.source is not prev:
            # the resource's previous event ended elsewhere: a missing or reordered event
            rec.add("lifecycle_paths", f"engine {engine} {machine.value} {ev.id!r}: {ev.trigger} from "
                    f"{ev.source.value}, but its last state was {prev.value}")
        if (ev.trigger, ev.source, ev.dest) not in _ALLOWED[machine]:
            rec.add("lifecycle_paths", f"engine {engine} {machine.value} {ev.id!r}: ({ev.trigger}, "
                    f"{ev.source.value} -> {ev.dest.value}) is not a row of the table")
        elif prev in FINAL[machine] and machine is not Machine.TASK:
            rec.add("lifecycle_paths", f"engine {engine} {machine.value} {ev.id!r}: {ev.trigger} after the final "
                    f"state {prev.value}")
        rec.states[key] = ev.dest
        # a final link/task/cache is forgotten: its id may be reused by a new resource
        if ev.dest in FINAL[machine] and machine in (Machine.LINK, Machine.CACHE, Machine.TASK, Machine.COMM_GROUP,
                                                     Machine.LISTENER):
            rec.states.pop(key, None)


def check_step(rec: Record, extra: Iterable[Callable[[Record], None]] = ()) -> list[Violation]:
    """Run every per-step check over what was recorded since the last step; return the new violations."""
    before = len(rec.violations)
    _check_calls(rec)
    _check_events(rec)
    for check in extra:
        check(rec)
    return rec.violations[before:]


def check_final(rec: Record, extra: Iterable[Callable[[Record], None]] = ()) -> list[Violation]:
    return check_step(rec, extra)


def state_name(state: Union[enum.Enum, str]) -> str:
    return state.value if isinstance(state, enum.Enum) else str(state)
