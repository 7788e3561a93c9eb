"""The contained hook dispatch (llmdd/_extension/dispatch.py) against pluggy's own call loop.

llmdd calls the notification hooks itself so that a raising subscriber cannot stop the others;
these tests check that it calls exactly what pluggy would, in pluggy's order, with pluggy's
arguments, under pluggy's tracers, and that the only difference is the containment (pluggy's loop,
the control, stops at the first raise).  The fast paths ask what a subscriber declares
(``llmdd_wants``, ``llmdd_passthrough``), never its plugin name.
"""

from __future__ import annotations

import logging
import random

import pluggy
import pytest

from llmdd import hookspecs
from llmdd._extension.dispatch import PASSTHROUGH, WANTS, declare_passthrough, declare_wants
from llmdd._extension.manager import Hooks, LLMDDPluginManager, make_plugin_manager
from llmdd._lifecycle.events import TransitionEvent
from llmdd._lifecycle.tables import LinkState, Machine
from llmdd.plugin import PROJECT, hookimpl

LOG_OBSERVER = "llmdd._extension.builtin.log_events"
RUN_TRANSFER = "llmdd._extension.builtin.run_transfer"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("LLMDD_DISABLE_PLUGIN_AUTOLOAD", "LLMDD_DISABLED_PLUGINS", "LLMDD_TRACE_HOOKS"):
        monkeypatch.delenv(name, raising=False)


def _event(seed: int) -> TransitionEvent:
    return TransitionEvent(machine=Machine.LINK, id=seed, source=LinkState.LINKING, dest=LinkState.LINKED,
                           trigger="handshake_succeeded", error=None, at=float(seed), info={"peer": seed + 1})


def _plugin(index: int, opts: dict, calls: list, raises: bool):
    """A plugin whose link subscriber records (its index, the event it got), then raises if asked."""

    class Plugin:
        @hookimpl(**opts)
        def llmdd_link_transition(self, event):
            calls.append((index, event))
            if raises:
                raise RuntimeError(f"subscriber {index} fails")

    return Plugin()


def _population(seed: int):
    """Seeded subscribers: (index, opts, raises), in registration order."""
    rng = random.Random(seed)
    kinds = [{}, {"tryfirst": True}, {"trylast": True}]
    return [(i, rng.choice(kinds), rng.random() < 0.4) for i in rng.sample(range(40), rng.randint(5, 12))]


def _managers(population, *, pluggy_raises: bool):
    """llmdd's manager and a plain pluggy manager holding the same subscribers, registered in the same
    order under the same names; pluggy's keep their raise only when ``pluggy_raises``."""
    ours_calls: list = []
    ref_calls: list = []
    ours = LLMDDPluginManager()
    ours.add_hookspecs(hookspecs)
    ref = pluggy.PluginManager(PROJECT)
    ref.add_hookspecs(hookspecs)
    for index, opts, raises in population:
        ours.register(_plugin(index, opts, ours_calls, raises), name=f"p{index}")
        ref.register(_plugin(index, opts, ref_calls, raises and pluggy_raises), name=f"p{index}")
    return ours, ours_calls, ref, ref_calls


@pytest.mark.parametrize("seed", [3, 17, 2024, 90210])
def test_calls_every_subscriber_in_pluggys_order_and_contains_each_failure(seed, caplog):
    population = _population(seed)
    ours, ours_calls, ref, ref_calls = _managers(population, pluggy_raises=False)
    hooks = Hooks(ours)
    event = _event(seed)

    ref.hook.llmdd_link_transition(event=event)        # pluggy's own loop, nobody raising
    with caplog.at_level(logging.ERROR, logger="llmdd.plugins"):
        hooks.link_transition(event)                    # llmdd's loop, some raising

    assert ours_calls == ref_calls                      # the same subscribers, the same order, the same event
    assert len(ours_calls) == len(population)
    assert all(got is event for _, got in ours_calls)
    raising = sorted(f"p{i}" for i, _, raises in population if raises)
    stats = hooks.statistics()
    assert stats.failures == len(raising)
    assert sorted(stats.failures_by_plugin) == raising
    logged = [r for r in caplog.records if "llmdd.hook.failed" in r.getMessage()]
    assert len(logged) == len(raising)


@pytest.mark.parametrize("seed", [17, 2024])
def test_control_pluggys_own_loop_stops_at_the_first_raise(seed):
    population = _population(seed)
    raising = {i for i, _, raises in population if raises}
    _, _, full, full_calls = _managers(population, pluggy_raises=False)
    full.hook.llmdd_link_transition(event=_event(seed))
    order = [i for i, _ in full_calls]
    first = next(k for k, i in enumerate(order) if i in raising)
    assert first < len(order) - 1, "the seed must draw a raising subscriber that is not called last"

    _ours, _, ref, ref_calls = _managers(population, pluggy_raises=True)
    with pytest.raises(RuntimeError, match=f"subscriber {order[first]} fails"):
        ref.hook.llmdd_link_transition(event=_event(seed))
    assert [i for i, _ in ref_calls] == order[:first + 1]     # the rest never ran: containment is llmdd's


@pytest.mark.parametrize("seed", [5, 41])
def test_strict_mode_reraises_the_first_failure_in_call_order_after_every_subscriber_ran(seed):
    population = _population(seed)
    ours, ours_calls, ref, ref_calls = _managers(population, pluggy_raises=False)
    ref.hook.llmdd_link_transition(event=_event(seed))
    first = next(i for i, _ in ref_calls if any(j == i and raises for j, _, raises in population))
    with pytest.raises(RuntimeError, match=f"subscriber {first} fails"):
        Hooks(ours, strict=True).link_transition(_event(seed))
    assert [i for i, _ in ours_calls] == [i for i, _ in ref_calls]


def test_tracers_see_one_call_with_pluggys_implementations_as_for_pluggys_loop():
    population = _population(11)
    ours, _, ref, _ = _managers(population, pluggy_raises=False)
    seen: dict = {"ours": [], "ref": []}

    def tracer(key):
        def before(name, impls, kwargs):
            seen[key].append(("before", name, [i.plugin_name for i in impls], dict(kwargs)))

        def after(outcome, name, impls, kwargs):
            seen[key].append(("after", name, outcome.exception is None))
        return before, after

    ours.add_hookcall_monitoring(*tracer("ours"))
    ref.add_hookcall_monitoring(*tracer("ref"))
    event = _event(11)
    Hooks(ours).link_transition(event)
    ref.hook.llmdd_link_transition(event=event)
    assert seen["ours"] == seen["ref"]
    assert seen["ours"][0][2] == [i.plugin_name for i in ref.hook.llmdd_link_transition.get_hookimpls()]


# ----------------------------------------------------------------------------- declarations, not names


class Undeclared:
    """A subscriber that declares nothing: it is called for every event, whatever its name."""

    @hookimpl
    def llmdd_link_transition(self, event):
        pass


def Declared(answer: bool):
    """A subscriber that declares it wants every event (``answer``) or none."""

    class Subscriber:
        @hookimpl
        def llmdd_link_transition(self, event):
            pass

    declare_wants(Subscriber.llmdd_link_transition, lambda error: answer)
    return Subscriber()


@pytest.fixture
def link_logger():
    logger = logging.getLogger("llmdd.link")
    level = logger.level
    yield logger
    logger.setLevel(level)


def test_wants_follows_the_declaration_not_the_plugin_name(link_logger):
    # the built-in log observer under a name of its own: it still declares its logger's level
    pm = make_plugin_manager(autoload=False, blocked=[LOG_OBSERVER])
    import llmdd._extension.builtin.log_events as log_events
    pm.register(log_events, name="renamed-observer")
    _emit, wants = Hooks(pm).live_emitter(Machine.LINK)
    link_logger.setLevel(logging.WARNING)
    assert not wants(None) and wants(RuntimeError("x"))   # INFO off, WARNING on
    link_logger.setLevel(logging.INFO)
    assert wants(None)

    # control: an undeclared subscriber registered under the log observer's own name is called for all
    pm = LLMDDPluginManager()
    pm.add_hookspecs(hookspecs)
    pm.register(Undeclared(), name=LOG_OBSERVER)
    _emit, wants = Hooks(pm).live_emitter(Machine.LINK)
    link_logger.setLevel(logging.WARNING)
    assert wants(None)


def test_wants_is_the_or_of_declared_predicates_and_decided_per_generation():
    pm = LLMDDPluginManager()
    pm.add_hookspecs(hookspecs)
    _emit, wants = Hooks(pm).live_emitter(Machine.LINK)
    assert not wants(None)                    # nobody
    no = Declared(False)
    pm.register(no, name="no")
    assert not wants(None)
    yes = Declared(True)
    pm.register(yes, name="yes")
    assert wants(None)
    pm.unregister(yes)
    assert not wants(None)
    pm.register(Undeclared(), name="undeclared")
    assert wants(None)


class Passthrough:
    @hookimpl
    def llmdd_run_transfer(self, task, run):
        return run()


declare_passthrough(Passthrough.llmdd_run_transfer)


class Intercepting:
    @hookimpl
    def llmdd_run_transfer(self, task, run):
        return run()


def test_runs_transfers_directly_follows_the_declaration_not_the_plugin_name():
    pm = make_plugin_manager(autoload=False)
    assert Hooks(pm).runs_transfers_directly()                  # the built-in default declares itself
    assert getattr(pm.get_plugin(RUN_TRANSFER).llmdd_run_transfer, PASSTHROUGH) is True

    pm = make_plugin_manager(autoload=False, blocked=[RUN_TRANSFER])
    pm.register(Passthrough(), name="another-name")
    hooks = Hooks(pm)
    assert hooks.runs_transfers_directly()
    pm.register(Intercepting(), name="interceptor")
    assert not hooks.runs_transfers_directly()                  # one undeclared implementation intercepts

    # control: an undeclared implementation under the default's own name is not taken for it
    pm = LLMDDPluginManager()
    pm.add_hookspecs(hookspecs)
    pm.register(Intercepting(), name=RUN_TRANSFER)
    assert not Hooks(pm).runs_transfers_directly()
    assert not hasattr(Intercepting.llmdd_run_transfer, WANTS)
