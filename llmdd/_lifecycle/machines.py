"""Builds the lifecycle machines from ``tables.py`` and drives them under a lock.

``transitions`` builds every machine from its table (``build_transitions_machine``, also used
for the docs diagrams) and is the definition of what a trigger does: :func:`compile_table`
reads the built machine into a ``(state, trigger) -> dest`` dict, and that dict is the one
driver of every machine kind (a few microseconds per trigger, where a ``transitions`` model
costs ~100 us and a registration per resource).  A test fires every (state, trigger) pair on a
``transitions`` model and on the compiled driver and requires the same outcome.

``Tracked.fire`` is the single place where a state changes and where the one event of that
change is built and handed to ``emit``; an illegal trigger raises :class:`InvalidStateError`.
``Tracked.offer`` is the same for a trigger that may arrive late: a pair the table lists in
``ABSORBED`` changes nothing and returns False; any other illegal pair still raises.
``Tracked.in_(GROUP)`` answers questions about a state with the named groups of ``tables.py``:
no code outside this package compares or assigns a state (``tests/unit/lifecycle/test_state_rule.py``).
"""

from __future__ import annotations

import collections
import enum
import threading
import time
from typing import Any, Callable, Mapping

import attrs
from transitions import Machine as _TMachine

from llmdd._lifecycle.events import ResourceId, TransitionEvent
from llmdd._base.status import InvalidStateError, LLMStatusCode
from llmdd._lifecycle.tables import ABSORBED, FINAL, INITIAL, STATES, TABLES, Machine

__all__ = ["Lifecycle", "Tracked", "LifecycleStatistics", "build_transitions_machine", "compile_table"]

Emit = Callable[[TransitionEvent], None]


def build_transitions_machine(machine: Machine, model: object = "self") -> _TMachine:
    """The one builder of ``transitions`` machines (also used for the docs diagrams)."""
    return _TMachine(
        model=model,
        states=list(STATES[machine]),
        transitions=[dict(t) for t in TABLES[machine]],
        initial=INITIAL[machine],
        auto_transitions=False,
        ignore_invalid_triggers=False,
        send_event=True,
        model_attribute="state",
    )


def compile_table(machine: Machine) -> dict[tuple[enum.Enum, str], enum.Enum]:
    """Compile a ``(state, trigger) -> dest`` dict from the transitions machine of ``machine``."""
    tm = build_transitions_machine(machine, model=None)
    states = STATES[machine]
    table: dict[tuple[enum.Enum, str], enum.Enum] = {}
    for trigger, event in tm.events.items():
        for source_name, transitions in event.transitions.items():
            for tr in transitions:
                if tr.dest is None:   # an internal transition: no table of tables.py has one
                    raise ValueError(f"{machine.value}: trigger {trigger!r} from {source_name!r} has no "
                                     "destination; every transition of a lifecycle table names one")
                table[(states[source_name], trigger)] = states[tr.dest]
    return table


@attrs.frozen(kw_only=True)
class LifecycleStatistics:
    machine: Machine
    live: Mapping[str, int]       # resources per current state
    triggers: Mapping[str, int]   # accepted triggers, counted
    refused: int                  # illegal triggers refused
    absorbed: int = 0             # late triggers absorbed by the table (ABSORBED)
    last_error: str | None


_ABSORBED = object()   # _fire's answer for a late trigger the table absorbs


class Tracked:
    """One resource's state, driven only through :meth:`fire`."""

    __slots__ = ("machine", "id", "info", "_lifecycle", "state", "__dict__")

    def __init__(self, lifecycle: "Lifecycle", resource_id: ResourceId, info: dict[str, Any]) -> None:
        self.machine = lifecycle.machine
        self.id = resource_id
        self.info = info
        self._lifecycle = lifecycle
        self.state = lifecycle._initial

    @property
    def is_final(self) -> bool:
        return self.state in FINAL[self.machine]

    def can(self, trigger: str) -> bool:
        """Whether ``trigger`` would change this resource now (for reports and tests: a driver
        fires or offers, it never asks first)."""
        return (self.state, trigger) in self._lifecycle._table

    def in_(self, group: frozenset) -> bool:
        """Whether the state is in ``group``, one of the named groups of ``tables.py``."""
        return self.state in group

    @property
    def name(self) -> str:
        """The state's name (``state.value``), for reports and messages."""
        return self.state.value

    def offer(self, trigger: str, *, error: BaseException | None = None,
              defer: Callable[[Callable[[], None]], Any] | None = None,
              on_accept: Callable[[], None] | None = None, **info: Any) -> bool:
        """Fire a trigger that may arrive after the resource moved on: True when it fired, False
        when the table absorbs it in the current state (``ABSORBED``: no change, no event);
        any other illegal pair raises :class:`InvalidStateError` as :meth:`fire` does."""
        return self._fire((trigger,), error, defer, on_accept, info, absorb=True) is not _ABSORBED

    def offer_first(self, triggers: tuple[str, ...], *, error: BaseException | None = None,
                    **info: Any) -> bool:
        """Fire the first of ``triggers`` the table allows in the current state (a teardown's
        preference: the wanted trigger, else a fallback), chosen and fired under one lock; False
        when the table absorbs them all instead; :class:`InvalidStateError` when none applies."""
        return self._fire(triggers, error, None, None, info, absorb=True) is not _ABSORBED

    def fire(self, trigger: str, *, error: BaseException | None = None,
             defer: Callable[[Callable[[], None]], Any] | None = None,
             on_accept: Callable[[], None] | None = None, **info: Any) -> TransitionEvent | None:
        """Fire ``trigger``; raise :class:`InvalidStateError` (state unchanged) if illegal.

        Returns the event, or None when the lifecycle has no subscriber (the
        event is then never built).  With ``defer``, the state changes now but the event is handed
        to subscribers later: ``defer(deliver)`` receives a callable that emits it (a caller that
        holds a lock records it in its outbox and delivers once the lock is released).
        ``on_accept()`` runs once the trigger is accepted, before the new state is visible (for
        a record's fields that must never be seen behind its state: a plain setter, no I/O).
        """
        return self._fire((trigger,), error, defer, on_accept, info, absorb=False)

    def _fire(self, triggers: tuple[str, ...], error: BaseException | None,
              defer: Callable[[Callable[[], None]], Any] | None, on_accept: Callable[[], None] | None,
              info: dict, *, absorb: bool) -> Any:
        lc = self._lifecycle
        fast = lc._fast
        with lc._stats_lock:   # the state and the statistics together (one lock per transition)
            source = self.state
            for trigger in triggers:   # the first trigger that changes something, else the last one
                hit = fast.get((source, trigger))
                if hit is not None and hit[0] is not None:
                    break
            if hit is not None and hit[0] is None:   # an ABSORBED pair
                if absorb:
                    lc._absorbed += 1
                    return _ABSORBED
                hit = None
            if hit is not None:
                dest, final = hit
                if on_accept is not None:
                    on_accept()
                self.state = dest
                lc._triggers[trigger] += 1
                if source is not dest:
                    live = lc._live
                    live[source] -= 1
                    if not final:
                        live[dest] += 1
                if error is not None:
                    lc._last_error = f"{type(error).__name__}: {error}"
            else:
                lc._refused += 1
        if hit is None:
            raise InvalidStateError(
                f"{self.machine.value} {self.id!r}: trigger {trigger!r} is not allowed in state "
                f"{source.value!r}", status_code=LLMStatusCode.LLM_FAILED)
        wants = lc._wants
        emit = lc._emit
        if emit is None or (wants is not None and not wants(error)):
            return None  # nobody listens now: no event is built (a later subscriber gets later ones)
        return self._emit(emit, source, dest, trigger, error, defer, info)

    def _emit(self, emit: Emit, source: enum.Enum, dest: enum.Enum, trigger: str, error: BaseException | None,
              defer: Callable[[Callable[[], None]], Any] | None, info: dict) -> TransitionEvent:
        event = TransitionEvent(
            machine=self.machine, id=self.id, source=source, dest=dest, trigger=trigger,
            error=error, at=time.time(), info={**self.info, **info} if info else self.info)
        if defer is not None:
            defer(lambda: emit(event))
        else:
            emit(event)
        return event

    def __repr__(self) -> str:
        return f"<{self.machine.value} {self.id!r} {self.state.value}>"


class Lifecycle:
    """All resources of one machine kind in one engine."""

    def __init__(self, machine: Machine, emit: Emit | None = None, *,
                 wants: Callable[[BaseException | None], bool] | None = None) -> None:
        self.machine = machine
        self._emit = emit
        #: ``wants(error)``: whether an event has a listener now (None: always build and emit)
        self._wants = wants
        self._final = FINAL[machine]
        self._table = compile_table(machine)
        self._initial = INITIAL[machine]
        #: (state, trigger) -> (dest, dest is final): the table as the hot path reads it
        self._fast: dict[tuple[enum.Enum, str], tuple[Any, bool]] = {
            k: (dest, dest in self._final) for k, dest in self._table.items()}
        for trigger, states in ABSORBED[machine]:
            for state in states:
                if (state, trigger) in self._fast:
                    raise ValueError(f"{machine.value}: ({state.value}, {trigger}) is both a transition and absorbed")
                self._fast[(state, trigger)] = (None, False)
        self._stats_lock = threading.Lock()
        self._live: collections.Counter[enum.Enum] = collections.Counter()
        self._triggers: collections.Counter[str] = collections.Counter()
        self._refused = 0
        self._absorbed = 0
        self._last_error: str | None = None
        self._quiet_paths: dict[tuple[str, ...], int] = {}   # triggers -> resources counted by count_quiet

    def create(self, resource_id: ResourceId, **info: Any) -> Tracked:
        tracked = Tracked(self, resource_id, info)
        with self._stats_lock:
            self._live[tracked.state] += 1
        return tracked

    # ---- resources nobody watches (the small-transfer path, issue 21)
    def quiet(self) -> bool:
        """True when no listener wants this machine's events now (then :meth:`count_quiet` may stand
        for a resource's create and fires)."""
        wants = self._wants
        return self._emit is None or (wants is not None and not wants(None))

    def count_quiet(self, triggers: tuple[str, ...]) -> None:
        """Count a resource created and driven through ``triggers`` from the initial state to a final
        one, as :meth:`create` and each :meth:`Tracked.fire` would (no event: see :meth:`quiet`)."""
        if triggers not in self._quiet_paths:
            state = self._initial
            for trigger in triggers:
                hit = self._fast.get((state, trigger))
                if hit is None or hit[0] is None:   # illegal, or absorbed (no change): not a path
                    raise InvalidStateError(f"{self.machine.value}: {triggers!r} is not a path from "
                                            f"{self._initial.value!r}", status_code=LLMStatusCode.LLM_FAILED)
                state = hit[0]
            if state not in self._final:
                raise InvalidStateError(f"{self.machine.value}: {triggers!r} does not end in a final state",
                                        status_code=LLMStatusCode.LLM_FAILED)
            with self._stats_lock:
                self._quiet_paths.setdefault(triggers, 0)
        with self._stats_lock:   # counted into _triggers by statistics()
            self._quiet_paths[triggers] += 1

    def _trigger_counts(self) -> dict[str, int]:
        counts = collections.Counter(self._triggers)
        for triggers, n in self._quiet_paths.items():
            for trigger in triggers:
                counts[trigger] += n
        return dict(counts)

    def statistics(self) -> LifecycleStatistics:
        with self._stats_lock:
            return LifecycleStatistics(
                machine=self.machine,
                live={s.value: n for s, n in self._live.items() if n},
                triggers=self._trigger_counts(),
                refused=self._refused,
                absorbed=self._absorbed,
                last_error=self._last_error,
            )
