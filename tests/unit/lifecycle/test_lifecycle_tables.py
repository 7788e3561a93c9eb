"""Every (machine, state, trigger) pair of tables.py, on both drivers (h11 test_state style)."""

from __future__ import annotations

import collections
import importlib.util
import time
from pathlib import Path

import pytest

from llmdd._lifecycle.events import TransitionEvent
from transitions import MachineError

from llmdd._lifecycle.machines import Lifecycle, build_transitions_machine, compile_table
from llmdd._lifecycle.tables import FINAL, INITIAL, STATES, TABLES, Machine, TaskState
from llmdd._base.status import InvalidStateError

ROOT = Path(__file__).resolve().parents[3]


def _triggers(machine):
    seen = []
    for t in TABLES[machine]:
        if t["trigger"] not in seen:
            seen.append(t["trigger"])
    return seen


def _expected(machine):
    """(state, trigger) -> dest read straight from the table data (not through compile_table)."""
    out = {}
    for t in TABLES[machine]:
        sources = t["source"] if isinstance(t["source"], list) else [t["source"]]
        for source in sources:
            assert (source, t["trigger"]) not in out, f"duplicate pair {source} {t['trigger']}"
            out[(source, t["trigger"])] = source if t["dest"] == "=" else t["dest"]
    return out


EXPECTED = {m: _expected(m) for m in Machine}


def _paths(machine):
    """Shortest trigger path from the initial state to every reachable state."""
    paths = {INITIAL[machine]: []}
    queue = collections.deque([INITIAL[machine]])
    while queue:
        state = queue.popleft()
        for (source, trigger), dest in EXPECTED[machine].items():
            if source is state and dest not in paths:
                paths[dest] = paths[state] + [trigger]
                queue.append(dest)
    return paths


PATHS = {m: _paths(m) for m in Machine}

PAIRS = [
    pytest.param(m, s, trig, id=f"{m.value}-{s.value}-{trig}")
    for m in Machine for s in STATES[m] for trig in _triggers(m)
]

def _tracked_in(machine, state):
    events: list[TransitionEvent] = []
    lifecycle = Lifecycle(machine, events.append)
    tracked = lifecycle.create("r1", origin="test")
    for trigger in PATHS[machine][state]:
        tracked.fire(trigger)
    assert tracked.state is state
    events.clear()
    return lifecycle, tracked, events


@pytest.mark.parametrize("machine", list(Machine), ids=lambda m: m.value)
def test_every_state_is_reachable(machine):
    assert set(PATHS[machine]) == set(STATES[machine])


@pytest.mark.parametrize("machine", list(Machine), ids=lambda m: m.value)
def test_compiled_table_is_the_table(machine):
    assert compile_table(machine) == EXPECTED[machine]


@pytest.mark.parametrize(("machine", "state", "trigger"), PAIRS)
def test_transitions_and_the_compiled_driver_agree_on_every_pair(machine, state, trigger):
    """The one driver (the compiled dict) does what the transitions machine built from the same
    table does: the same destination, or both refuse."""
    model = type("Model", (), {})()
    build_transitions_machine(machine, model=model)
    for step in PATHS[machine][state]:
        model.trigger(step)
    assert model.state is state
    try:
        model.trigger(trigger)
    except MachineError:
        assert (state, trigger) not in compile_table(machine)
        assert model.state is state
        return
    assert model.state is compile_table(machine)[(state, trigger)]


@pytest.mark.parametrize(("machine", "state", "trigger"), PAIRS)
def test_pair(machine, state, trigger):
    lifecycle, tracked, events = _tracked_in(machine, state)
    dest = EXPECTED[machine].get((state, trigger))
    if dest is None:
        refused = lifecycle.statistics().refused
        with pytest.raises(InvalidStateError):
            tracked.fire(trigger, detail=1)
        assert tracked.state is state
        assert events == []
        assert lifecycle.statistics().refused == refused + 1
        assert not tracked.can(trigger)
        return
    before = time.time()
    returned = tracked.fire(trigger, detail=1)
    assert tracked.state is dest
    assert events == [returned]
    [event] = events
    assert (event.machine, event.id, event.source, event.dest, event.trigger, event.error) == (
        machine, "r1", state, dest, trigger, None)
    assert dict(event.info) == {"origin": "test", "detail": 1}
    assert before <= event.at <= time.time()
    assert tracked.is_final is (dest in FINAL[machine])


@pytest.mark.parametrize("machine", list(Machine), ids=lambda m: m.value)
def test_error_travels_in_the_event(machine):
    (source, trigger), dest = next(iter(EXPECTED[machine].items()))
    _, tracked, events = _tracked_in(machine, source)
    error = TimeoutError("peer silent")
    tracked.fire(trigger, error=error)
    assert events[0].error is error
    assert events[0].as_log_fields()["error"] == "TimeoutError: peer silent"


@pytest.mark.parametrize(
    ("machine", "state"),
    [pytest.param(m, s, id=f"{m.value}-{s.value}") for m in Machine for s in sorted(FINAL[m], key=str)])
def test_final_states_are_sticky(machine, state):
    _, tracked, events = _tracked_in(machine, state)
    for trigger in _triggers(machine):
        with pytest.raises(InvalidStateError):
            tracked.fire(trigger)
    assert tracked.state is state
    assert events == []


def test_engine_has_no_final_state_and_reinitializes():
    lifecycle = Lifecycle(Machine.ENGINE)
    engine = lifecycle.create(1)
    for trigger in ("init", "finalize", "init", "finalize"):
        engine.fire(trigger)
    assert FINAL[Machine.ENGINE] == frozenset()


def test_every_machine_runs_on_the_one_compiled_driver():
    """One driver per machine: no transitions machine runs beside the compiled table."""
    for machine in Machine:
        lifecycle = Lifecycle(machine)
        assert not hasattr(lifecycle, "_tmachine")
        assert lifecycle._table == compile_table(machine)


def test_without_subscriber_no_event_is_built():
    tracked = Lifecycle(Machine.TASK, None).create(1)
    assert tracked.fire("start") is None
    assert tracked.state is TaskState.RUNNING


def test_lifecycle_doc_is_current():
    spec = importlib.util.spec_from_file_location("gen_diagrams", ROOT / "docs" / "_tools" / "gen_diagrams.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    current = (ROOT / "docs" / "lifecycle.md").read_text(encoding="utf-8")
    assert current == module.render(), "docs/lifecycle.md is stale: run python docs/_tools/gen_diagrams.py"


# -- late triggers: offered, absorbed where the table says so, raising everywhere else -----------
from llmdd._lifecycle.tables import ABSORBED, LinkState  # noqa: E402

ABSORBED_PAIRS = {(m, s, trig) for m in Machine for trig, states in ABSORBED[m] for s in states}


@pytest.mark.parametrize(("machine", "state", "trigger"), PAIRS)
def test_offer_pair(machine, state, trigger):
    """``offer``: a transition fires as ``fire`` does; an absorbed pair changes nothing and emits
    nothing; any other illegal pair raises and is counted as refused."""
    lifecycle, tracked, events = _tracked_in(machine, state)
    dest = EXPECTED[machine].get((state, trigger))
    before = lifecycle.statistics()
    if dest is not None:
        assert (machine, state, trigger) not in ABSORBED_PAIRS
        assert tracked.offer(trigger, detail=1) is True
        assert tracked.state is dest and len(events) == 1
        return
    if (machine, state, trigger) in ABSORBED_PAIRS:
        assert tracked.offer(trigger, detail=1) is False
        after = lifecycle.statistics()
        assert (after.absorbed, after.refused) == (before.absorbed + 1, before.refused)
        with pytest.raises(InvalidStateError):   # fire never absorbs: a driver must mean "late"
            tracked.fire(trigger)
    else:
        with pytest.raises(InvalidStateError):
            tracked.offer(trigger, detail=1)
        assert lifecycle.statistics().refused == before.refused + 1
    assert tracked.state is state and events == []


def test_every_absorbed_pair_names_a_real_state_and_trigger():
    for machine in Machine:
        triggers = set(_triggers(machine))
        for trigger, states in ABSORBED[machine]:
            assert trigger in triggers, (machine, trigger)
            assert all(s in STATES[machine] for s in states), (machine, trigger)


def test_offer_first_takes_the_first_trigger_the_table_allows():
    lifecycle, tracked, events = _tracked_in(Machine.LINK, LinkState.FAILED)
    # unlink_succeeded does not apply to a failed link: the fallback closes it
    assert tracked.offer_first(("unlink_succeeded", "force_unlink"), reason="x") is True
    assert tracked.state is LinkState.CLOSED and [e.trigger for e in events] == ["force_unlink"]
    # closed: both are absorbed
    assert tracked.offer_first(("unlink_succeeded", "force_unlink")) is False
    # none applies and none is absorbed: raises (control)
    lifecycle, tracked, events = _tracked_in(Machine.LINK, LinkState.UNLINKED)
    with pytest.raises(InvalidStateError):
        tracked.offer_first(("unlink_succeeded", "handshake_succeeded"))
    assert tracked.state is LinkState.UNLINKED and events == []


def test_on_accept_runs_before_the_state_is_visible_and_only_when_accepted():
    lifecycle, tracked, _ = _tracked_in(Machine.LINK, LinkState.LINKED)
    seen = []
    tracked.offer("peer_lost", on_accept=lambda: seen.append(tracked.state))
    assert seen == [LinkState.LINKED] and tracked.state is LinkState.FAILED
    tracked.offer("peer_lost", on_accept=lambda: seen.append("late"))   # absorbed: not run
    assert seen == [LinkState.LINKED]
