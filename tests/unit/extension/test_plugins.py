"""Plugin manager, hook facade, default plugins and entry-point discovery."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap

import pluggy
import pytest

from llmdd import hookspecs
from llmdd._seam.abc import Transport, TransportInfo
from llmdd._lifecycle.machines import Lifecycle
from llmdd._lifecycle.events import TransitionEvent
from llmdd._lifecycle.tables import INITIAL, TABLES, LinkState, Machine
from llmdd._extension.manager import (
    DEFAULT_PLUGINS,
    TRANSITION_HOOKS,
    Hooks,
    LLMDDPluginManager,
    make_plugin_manager,
)
from llmdd.plugin import (
    PROJECT,
    EngineConfig,
    LinkInfo,
    TransportCandidate,
    TransportRegistry,
    hookimpl,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("LLMDD_DISABLE_PLUGIN_AUTOLOAD", "LLMDD_DISABLED_PLUGINS", "LLMDD_TRACE_HOOKS"):
        monkeypatch.delenv(name, raising=False)


class Subscriber:
    def __init__(self):
        self.events = []

    @hookimpl
    def llmdd_link_transition(self, event):
        self.events.append(event)


class Raiser:
    @hookimpl
    def llmdd_link_transition(self, event):
        raise RuntimeError("subscriber bug")


def _fire_link(hooks, *triggers):
    link = Lifecycle(Machine.LINK, hooks.emitter(Machine.LINK)).create(7, peer=8)
    return [link.fire(t) for t in triggers or ("link",)]


# ----------------------------------------------------------------------------- manager


def test_hookspecs_module_lists_every_spec():
    specs = sorted(n for n in dir(hookspecs) if n.startswith("llmdd_"))
    assert sorted(hookspecs.__all__) == specs
    assert set(TRANSITION_HOOKS.values()) <= set(specs)


def test_manager_has_defaults_and_spec_flags(llmdd_pm):
    assert isinstance(llmdd_pm, LLMDDPluginManager)
    assert llmdd_pm.project_name == PROJECT == "llmdd"
    assert [name for name, _ in llmdd_pm.list_name_plugin()] == list(DEFAULT_PLUGINS)
    assert llmdd_pm.hook.llmdd_addhooks.is_historic() and llmdd_pm.hook.llmdd_configure.is_historic()
    assert llmdd_pm.hook.llmdd_select_transport.spec.opts["firstresult"]
    assert llmdd_pm.hook.llmdd_run_transfer.spec.opts["firstresult"]


def test_prefix_is_enforced(llmdd_pm):
    class Unprefixed:
        @hookimpl
        def link_transition(self, event):
            pass

    with pytest.raises(pluggy.PluginValidationError, match="start with 'llmdd_'"):
        llmdd_pm.register(Unprefixed())
    assert llmdd_pm.get_plugin("Unprefixed") is None


def test_specname_may_name_the_hook(llmdd_pm, llmdd_hooks):
    class Named:
        seen = []

        @hookimpl(specname="llmdd_link_transition")
        def on_link(self, event):
            self.seen.append(event)

    llmdd_pm.register(Named())
    _fire_link(llmdd_hooks)
    assert len(Named.seen) == 1


def test_unknown_llmdd_hook_fails_check_pending(llmdd_pm):
    class Typo:
        @hookimpl
        def llmdd_link_transitoin(self, event):
            pass

    llmdd_pm.register(Typo())
    with pytest.raises(pluggy.PluginValidationError, match="unknown hook"):
        llmdd_pm.check_pending()


@pytest.mark.parametrize("opts", [{"wrapper": True}, {"hookwrapper": True}])
def test_notification_hooks_take_no_wrappers(llmdd_pm, opts):
    class Wrapping:
        @hookimpl(**opts)
        def llmdd_task_transition(self, event):
            yield

    with pytest.raises(pluggy.PluginValidationError, match="cannot be a wrapper"):
        llmdd_pm.register(Wrapping())


def test_blocked_argument_and_env(monkeypatch):
    pm = make_plugin_manager(autoload=False, blocked=["llmdd._extension.builtin.log_events"])
    assert not pm.has_plugin("llmdd._extension.builtin.log_events") and pm.is_blocked("llmdd._extension.builtin.log_events")
    _emit, wants = Hooks(pm).live_emitter(Machine.LINK)
    assert not wants(None)  # nobody subscribes: lifecycles build no events (until someone does)

    monkeypatch.setenv("LLMDD_DISABLED_PLUGINS", " llmdd._extension.builtin.select_transport , other ")
    pm = make_plugin_manager(autoload=False)
    assert not pm.has_plugin("llmdd._extension.builtin.select_transport")
    assert pm.is_blocked("other") and pm.has_plugin("llmdd._extension.builtin.log_events")


@pytest.mark.parametrize(("value", "loads"), [(None, True), ("1", False), ("yes", False), ("0", True), ("", True)])
def test_autoload_env_switch(monkeypatch, value, loads):
    calls = []
    monkeypatch.setattr(LLMDDPluginManager, "load_setuptools_entrypoints",
                        lambda self, group, name=None: calls.append(group) or 0)
    if value is not None:
        monkeypatch.setenv("LLMDD_DISABLE_PLUGIN_AUTOLOAD", value)
    make_plugin_manager()
    assert calls == (["llmdd"] if loads else [])
    calls.clear()
    make_plugin_manager(autoload=False)
    assert calls == []


def test_trace_hooks_env_logs_calls(monkeypatch, llmdd_log_output):
    monkeypatch.setenv("LLMDD_TRACE_HOOKS", "1")
    pm = make_plugin_manager(autoload=False)
    _fire_link(Hooks(pm))
    [call] = [c for c in llmdd_log_output.events("llmdd.hooks.call") if c["hook"] == "llmdd_link_transition"]
    assert call["logger"] == "llmdd.hooks" and call["log_level"] == "info"
    assert call["plugins"] == ["llmdd._extension.builtin.log_events"]
    assert [r["hook"] for r in llmdd_log_output.events("llmdd.hooks.returned")] == ["llmdd_addhooks", "llmdd_link_transition"]


def test_addhooks_lets_plugins_add_specs(llmdd_pm):
    spec = pluggy.HookspecMarker("llmdd")

    class ExtraSpecs:
        @spec
        def llmdd_extra(self, value):
            """An extension's own hook."""

    class Extension:
        @hookimpl
        def llmdd_addhooks(self, pluginmanager):
            pluginmanager.add_hookspecs(ExtraSpecs)

        @hookimpl
        def llmdd_extra(self, value):
            return value * 2

    llmdd_pm.register(Extension())
    llmdd_pm.check_pending()
    assert llmdd_pm.hook.llmdd_extra(value=21) == [42]


def test_configure_is_historic(llmdd_pm, llmdd_hooks):
    config = EngineConfig(cluster_id=1, role="PROMPT", options={"llm.SyncKvCacheWaitTime": "1000"})
    llmdd_hooks.configure(config)

    class Late:
        seen = []

        @hookimpl
        def llmdd_configure(self, config):
            self.seen.append(config)

    llmdd_pm.register(Late())
    assert Late.seen == [config]
    with pytest.raises(TypeError):
        config.options["x"] = "y"


# ----------------------------------------------------------------------------- notifications


def test_wants_nothing_without_subscribers_and_counts_events():
    pm = make_plugin_manager(autoload=False, blocked=["llmdd._extension.builtin.log_events"])
    hooks = Hooks(pm)
    assert not any(hooks.live_emitter(m)[1](None) for m in Machine)   # no event is built for nobody
    sub = Subscriber()
    pm.register(sub)
    assert hooks.live_emitter(Machine.LINK)[1](None) and not hooks.live_emitter(Machine.TASK)[1](None)
    _fire_link(hooks, "link", "handshake_succeeded")
    assert [e.dest for e in sub.events] == [LinkState.LINKING, LinkState.LINKED]
    assert hooks.statistics().events == {"link": 2}


@pytest.mark.parametrize("raiser_first", [True, False])
@pytest.mark.parametrize("recorded", [False, True], ids=["direct", "monitored"])
def test_raising_subscriber_is_contained(raiser_first, recorded, llmdd_log_output):
    pm = make_plugin_manager(autoload=False)
    hooks = Hooks(pm)
    good = Subscriber()
    for plugin, name in sorted([(Raiser(), "bad"), (good, "good")], key=lambda p: (p[1] != "bad") == raiser_first):
        pm.register(plugin, name=name)
    from llmdd.testing._recorder import HookRecorder

    with HookRecorder(pm) if recorded else _null() as recorder:
        [event] = _fire_link(hooks)
    assert good.events == [event]
    [failure] = llmdd_log_output.events("llmdd.hook.failed")
    assert failure["plugin"] == "bad" and failure["hook"] == "llmdd_link_transition"
    assert failure["log_level"] == "error" and "subscriber bug" in failure["error"]
    stats = hooks.statistics()
    assert stats.failures == 1 and stats.failures_by_plugin == {"bad": 1}
    assert "subscriber bug" in stats.last_failure
    if recorded:
        assert [c.event for c in recorder.getcalls("llmdd_link_transition")] == [event]


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def test_strict_mode_reraises_after_every_subscriber_ran(llmdd_pm, llmdd_hooks):
    good = Subscriber()
    llmdd_pm.register(Raiser(), name="bad")
    llmdd_pm.register(Subscriber(), name="good-before")
    llmdd_pm.register(good, name="good")
    link = Lifecycle(Machine.LINK, llmdd_hooks.emitter(Machine.LINK)).create(7)
    with pytest.raises(RuntimeError, match="subscriber bug"):
        link.fire("link")
    assert len(good.events) == 1 and len(llmdd_pm.get_plugin("good-before").events) == 1
    assert link.state is LinkState.LINKING  # the machine moved; only the observer failed


def test_subscriber_changes_are_seen(llmdd_pm, llmdd_hooks):
    emit = llmdd_hooks.emitter(Machine.LINK)
    link = Lifecycle(Machine.LINK, emit).create(1)
    link.fire("link")
    late = Subscriber()
    llmdd_pm.register(late)
    link.fire("handshake_succeeded")
    llmdd_pm.unregister(late)
    link.fire("unlink")
    assert [e.trigger for e in late.events] == ["handshake_succeeded"]


def test_facade_methods_reach_their_hooks(llmdd_pm, llmdd_hooks, llmdd_hook_recorder):
    events = {
        machine: TransitionEvent(machine=machine, id=1, source=INITIAL[machine], dest=INITIAL[machine],
                                 trigger=TABLES[machine][0]["trigger"], at=0.0)
        for machine in Machine
    }
    llmdd_hooks.engine_transition(events[Machine.ENGINE])
    llmdd_hooks.link_transition(events[Machine.LINK])
    llmdd_hooks.comm_group_transition(events[Machine.COMM_GROUP])
    llmdd_hooks.cache_transition(events[Machine.CACHE])
    llmdd_hooks.task_transition(events[Machine.TASK])
    llmdd_hooks.listener_transition(events[Machine.LISTENER])
    for machine in Machine:
        assert llmdd_hook_recorder.events(machine) == [events[machine]]
    assert llmdd_hook_recorder.events() == [events[m] for m in Machine]


# ----------------------------------------------------------------------------- transports


class FakeTransport(Transport):
    name = "fake"
    priority = 10
    probes = 0

    @classmethod
    def probe(cls):
        cls.probes += 1
        return TransportInfo(name=cls.name, available=True)

    def open_endpoint(self, *, host="127.0.0.1", secret=None):
        raise AssertionError("not opened in these tests")


class OtherFake(FakeTransport):
    pass


class SameHost(FakeTransport):
    name = "samehost"
    priority = 50
    same_host_only = True


class Broken(FakeTransport):
    name = "broken"

    @classmethod
    def probe(cls):
        raise OSError("no device")


class Absent(FakeTransport):
    name = "absent"
    priority = 99

    @classmethod
    def probe(cls):
        return TransportInfo(name="absent", available=False, reason="library missing")


def test_registry_rules():
    registry = TransportRegistry()
    assert registry(FakeTransport) is FakeTransport
    registry.register(FakeTransport)  # same class again: no-op
    with pytest.raises(ValueError, match="already registered"):
        registry(OtherFake)
    registry(OtherFake, replace=True)
    assert registry.get("fake") is OtherFake
    with pytest.raises(KeyError, match="registered: fake"):
        registry.get("nope")
    for bad in (FakeTransport(options={}), type("NoName", (FakeTransport,), {"name": ""}),
                type("Plain", (), {"name": "plain"}), Transport):
        with pytest.raises(TypeError):
            registry(bad)


def test_registry_probes_once_and_orders_by_priority():
    FakeTransport.probes = 0
    registry = TransportRegistry()
    for cls in (FakeTransport, SameHost, Broken, Absent):
        registry(cls)
    assert registry.names() == ("absent", "samehost", "broken", "fake")  # priority, then name
    assert [i.name for i in registry.available()] == ["samehost", "fake"]
    registry.available()
    assert FakeTransport.probes == 1
    broken = registry.probe("broken")
    assert not broken.available and "no device" in broken.reason
    assert registry.probe("absent").reason == "library missing"
    assert [c.name for c in registry.candidates()] == ["samehost", "fake"]
    [cand] = registry.candidates(peer_transports=["fake", "ucx"])
    assert (cand.name, cand.priority, cand.same_host_only, cand.info.available) == ("fake", 10, False, True)


def test_register_transports_hook_is_contained(llmdd_log_output):
    pm = make_plugin_manager(autoload=False)

    class Good:
        @hookimpl
        def llmdd_register_transports(self, register):
            register(FakeTransport)

    class Bad:
        @hookimpl
        def llmdd_register_transports(self, register):
            register(OtherFake)  # name taken without replace=True

    pm.register(Good(), name="good")
    pm.register(Bad(), name="bad")  # LIFO: runs first, so "fake" is free for it
    registry = Hooks(pm).register_transports()
    assert registry.get("fake") is OtherFake
    [failure] = llmdd_log_output.events("llmdd.hook.failed")
    assert failure["plugin"] == "good" and "already registered" in failure["error"]
    with pytest.raises(ValueError):
        Hooks(pm, strict=True).register_transports()


def _cand(name, priority, same_host_only=False):
    return TransportCandidate(name=name, priority=priority, same_host_only=same_host_only,
                              info=TransportInfo(name=name, available=True))


SHM, UCX, TCP = _cand("shm", 100, True), _cand("ucx", 50), _cand("tcp", 10)


@pytest.mark.parametrize(("same_host", "forced", "candidates", "expected"), [
    (True, None, (SHM, UCX, TCP), "shm"),
    (True, None, (UCX, TCP), "ucx"),
    (False, None, (SHM, UCX, TCP), "ucx"),
    (False, None, (SHM,), None),
    (False, None, (), None),
    (True, "tcp", (SHM, UCX, TCP), "tcp"),
    (False, "hccs", (SHM, UCX, TCP), None),
])
def test_default_selection_policy(llmdd_hooks, same_host, forced, candidates, expected):
    link = LinkInfo(local_cluster_id=1, peer_cluster_id=2, same_host=same_host, forced=forced,
                    peer_transports=[c.name for c in candidates])
    assert llmdd_hooks.select_transport(link, candidates) == expected


def test_tryfirst_policy_overrides_default(llmdd_pm, llmdd_hooks):
    class Vendor:
        @hookimpl(tryfirst=True)
        def llmdd_select_transport(self, link, candidates):
            if link.peer_cluster_id == 99:
                return None  # let the default decide
            return "tcp" if any(c.name == "tcp" for c in candidates) else None

    llmdd_pm.register(Vendor())
    link = LinkInfo(local_cluster_id=1, peer_cluster_id=2, same_host=True)
    assert llmdd_hooks.select_transport(link, (SHM, TCP)) == "tcp"
    assert llmdd_hooks.select_transport(LinkInfo(local_cluster_id=1, peer_cluster_id=99, same_host=True),
                                  (SHM, TCP)) == "shm"


def test_policy_answer_must_be_a_candidate(llmdd_log_output):
    class Wrong:
        @hookimpl(tryfirst=True)
        def llmdd_select_transport(self, link, candidates):
            return "nonexistent"

    link = LinkInfo(local_cluster_id=1, peer_cluster_id=2, same_host=False)
    pm = make_plugin_manager(autoload=False)
    pm.register(Wrong())
    assert Hooks(pm).select_transport(link, (TCP,)) is None
    assert llmdd_log_output.events("llmdd.hook.invalid_result")
    with pytest.raises(ValueError, match="nonexistent"):
        Hooks(pm, strict=True).select_transport(link, (TCP,))


# ----------------------------------------------------------------------------- run_transfer


def test_run_transfer_default_runs_the_task(llmdd_hooks):
    assert llmdd_hooks.run_transfer("task-1", lambda: "done") == "done"


def test_run_transfer_wrapper_sees_whole_task(llmdd_pm, llmdd_hooks, llmdd_hook_recorder):
    seen = []

    class Timer:
        @hookimpl(wrapper=True)
        def llmdd_run_transfer(self, task, run):
            seen.append(("before", task))
            result = yield
            seen.append(("after", result))
            return result

    llmdd_pm.register(Timer())
    assert llmdd_hooks.run_transfer("t", lambda: 5) == 5
    assert seen == [("before", "t"), ("after", 5)]
    [call] = llmdd_hook_recorder.getcalls("llmdd_run_transfer")
    assert call.task == "t"


def test_run_transfer_errors_propagate_and_faults_can_be_injected(llmdd_pm, llmdd_hooks):
    class Fault:
        @hookimpl(wrapper=True)
        def llmdd_run_transfer(self, task, run):
            if task == "doomed":
                raise TimeoutError("injected")
            return (yield)

    llmdd_pm.register(Fault())
    ran = []
    with pytest.raises(TimeoutError, match="injected"):
        llmdd_hooks.run_transfer("doomed", lambda: ran.append(1))
    assert ran == []
    with pytest.raises(ZeroDivisionError):
        llmdd_hooks.run_transfer("t", lambda: 1 / 0)


def test_run_transfer_runs_once_and_without_default():
    calls = []

    class Observer:
        @hookimpl
        def llmdd_run_transfer(self, task, run):
            run()  # runs it, answers nothing: the default must not run it again
            return None

    pm = make_plugin_manager(autoload=False)
    pm.register(Observer())
    assert Hooks(pm).run_transfer("t", lambda: calls.append(1) or "r") == "r"
    assert calls == [1]
    pm = make_plugin_manager(autoload=False, blocked=["llmdd._extension.builtin.run_transfer"])
    assert Hooks(pm).run_transfer("t", lambda: "still runs") == "still runs"


def test_run_transfer_can_be_replaced(llmdd_pm, llmdd_hooks):
    class Replace:
        @hookimpl(tryfirst=True)
        def llmdd_run_transfer(self, task, run):
            return "simulated"

    llmdd_pm.register(Replace())
    assert llmdd_hooks.run_transfer("t", lambda: pytest.fail("must not run")) == "simulated"


# ----------------------------------------------------------------------------- entry points (the proof)

_PLUGIN = '''
from llmdd.plugin import hookimpl

seen = []


@hookimpl
def llmdd_link_transition(event):
    seen.append(event)
'''

_SCRIPT = '''
import json
import llmdd_demo_plugin
from llmdd._lifecycle.machines import Lifecycle
from llmdd._lifecycle.tables import Machine
from llmdd._extension.manager import Hooks, make_plugin_manager

pm = make_plugin_manager()
hooks = Hooks(pm)
link = Lifecycle(Machine.LINK, hooks.emitter(Machine.LINK)).create(1, peer=2)
link.fire("link")
link.fire("handshake_succeeded")
print(json.dumps({
    "registered": pm.has_plugin("demo"),
    "is_module": pm.get_plugin("demo") is llmdd_demo_plugin,
    "distributions": [d.metadata["Name"] for _, d in pm.list_plugin_distinfo()],
    "seen": [[e.trigger, e.dest.value, e.info["peer"]] for e in llmdd_demo_plugin.seen],
}))
'''


def _install_demo_distribution(root):
    (root / "llmdd_demo_plugin.py").write_text(_PLUGIN)
    dist_info = root / "llmdd_demo_plugin-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: llmdd-demo-plugin\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[llmdd]\ndemo = llmdd_demo_plugin\n")


def _run_demo(root, **env):
    # keep other installed llmdd plugins out of the proof: block them by name
    others = sorted({ep.name for ep in importlib.metadata.entry_points(group="llmdd")} - {"demo"})
    environ = {k: v for k, v in os.environ.items() if not k.startswith("LLMDD_")}
    environ.update(PYTHONPATH=str(root), LLMDD_DISABLED_PLUGINS=",".join(others), **env)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_SCRIPT)], env=environ, cwd=root,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_entry_point_plugin_is_discovered_in_a_fresh_process(tmp_path):
    _install_demo_distribution(tmp_path)
    found = _run_demo(tmp_path)
    assert found["registered"] and found["is_module"]
    assert "llmdd-demo-plugin" in found["distributions"]
    assert found["seen"] == [["link", "linking", 2], ["handshake_succeeded", "linked", 2]]

    off = _run_demo(tmp_path, LLMDD_DISABLE_PLUGIN_AUTOLOAD="1")
    assert not off["registered"] and off["seen"] == [] and off["distributions"] == []


# ------------------------------------------------------------------ late subscribers


def _two_step_path(machine):
    """Two triggers fired one after the other from the machine's initial state (the second from a
    state that is not final)."""
    from llmdd._lifecycle.machines import compile_table
    from llmdd._lifecycle.tables import FINAL

    table = compile_table(machine)
    start = INITIAL[machine]
    for (state, first), mid in sorted(table.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        if state != start or mid in FINAL[machine]:
            continue
        for (state2, second), _dest in sorted(table.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            if state2 == mid:
                return first, second
    return None   # every first step ends in a final state (the listener machine)


class _AllTransitions:
    """Records every transition event of every machine."""

    def __init__(self):
        self.seen = []

    @hookimpl
    def llmdd_engine_transition(self, event):
        self.seen.append(("engine", event.trigger))

    @hookimpl
    def llmdd_link_transition(self, event):
        self.seen.append(("link", event.trigger))

    @hookimpl
    def llmdd_comm_group_transition(self, event):
        self.seen.append(("comm_group", event.trigger))

    @hookimpl
    def llmdd_cache_transition(self, event):
        self.seen.append(("cache", event.trigger))

    @hookimpl
    def llmdd_task_transition(self, event):
        self.seen.append(("task", event.trigger))

    @hookimpl
    def llmdd_listener_transition(self, event):
        self.seen.append(("listener", event.trigger))


@pytest.mark.parametrize("how", ["live_emitter", "emitter"])
@pytest.mark.parametrize("machine", list(Machine), ids=lambda m: m.value)
@pytest.mark.parametrize("observer", ["log observer", "no log observer"])
def test_a_subscriber_added_at_any_time_gets_every_later_event(machine, how, observer):
    """Lifecycles built before the subscriber exists (with or without the built-in log observer,
    through either emitter) deliver every event after its registration to it, none before."""
    from llmdd._lifecycle.machines import Lifecycle

    blocked = ["llmdd._extension.builtin.log_events"] if observer == "no log observer" else []
    pm = make_plugin_manager(autoload=False, blocked=blocked, strict=True)
    hooks = Hooks(pm)
    if how == "live_emitter":
        emit, wants = hooks.live_emitter(machine)
        lc = Lifecycle(machine, emit, wants=wants)
    else:
        lc = Lifecycle(machine, hooks.emitter(machine))
    path = _two_step_path(machine)
    if path is None:   # one step ends the resource: the step before and the one after on two resources
        first = second = TABLES[machine][0]["trigger"]
        lc.create(0).fire(first)              # nobody subscribes yet
        tracked = lc.create(1)
    else:
        first, second = path
        tracked = lc.create(1)
        tracked.fire(first)                   # nobody subscribes yet
    sub = _AllTransitions()
    pm.register(sub, name="late")
    tracked.fire(second)
    assert sub.seen == [(machine.value, second)]
    # control: after it left, it gets nothing more
    pm.unregister(name="late")
    lc.create(2).fire(first)
    assert sub.seen == [(machine.value, second)]


def test_a_subscriber_added_after_init_gets_the_engines_later_events(monkeypatch):
    """On an engine whose plugin manager has no transition subscriber at all (log observer blocked):
    a subscriber added after init gets the finalize transition."""
    from llmdd import LLMConfig, LLMDataDist, LLMRole

    monkeypatch.setenv("LLMDD_DISABLED_PLUGINS", "llmdd._extension.builtin.log_events")
    dd = LLMDataDist(LLMRole.PROMPT, 7)
    cfg = LLMConfig()
    cfg.enable_cache_manager = True
    dd.init(cfg.generate_options())
    sub = _AllTransitions()
    try:
        dd.add_plugin(sub, name="late")
    finally:
        dd.finalize()
    assert ("engine", "finalize") in sub.seen, sub.seen


def test_tracers_see_notifications_through_public_pluggy_api():
    """A tracer installed with add_hookcall_monitoring sees a contained notification as one call with
    every subscriber and its outcome (no private pluggy API), and stops seeing it once undone."""
    pm = make_plugin_manager(autoload=False, strict=False)
    hooks = Hooks(pm)
    sub = _AllTransitions()
    pm.register(sub, name="sub")
    calls = []
    undo = pm.add_hookcall_monitoring(
        lambda name, impls, kwargs: calls.append(("before", name, sorted(i.plugin_name for i in impls))),
        lambda outcome, name, impls, kwargs: calls.append(("after", name, outcome.exception is None)))
    from llmdd._lifecycle.machines import Lifecycle

    lc = Lifecycle(Machine.LINK, hooks.emitter(Machine.LINK))
    first, _ = _two_step_path(Machine.LINK)
    lc.create(1).fire(first)
    assert ("before", "llmdd_link_transition", sorted(["sub", "llmdd._extension.builtin.log_events"])) in calls
    assert ("after", "llmdd_link_transition", True) in calls
    assert sub.seen == [("link", first)]
    undo()
    assert not pm.monitored
    calls.clear()
    lc.create(2).fire(first)
    assert calls == [] and sub.seen == [("link", first)] * 2


def test_run_transfer_hands_plugins_a_read_only_task_view(llmdd_pm, llmdd_hooks):
    """llmdd_run_transfer sees a frozen TransferTask built from the engine's task, never the task itself
    (a plugin cannot fire its lifecycle)."""
    import attrs

    from llmdd.plugin import TransferTask

    seen = []

    class Spy:
        @hookimpl(wrapper=True)
        def llmdd_run_transfer(self, task, run):
            seen.append(task)
            return (yield)

    llmdd_pm.register(Spy())
    tracked = Lifecycle(Machine.TASK).create(41, kind="pull_blocks", peer=3)
    assert llmdd_hooks.run_transfer(tracked, lambda: "ok") == "ok"
    [view] = seen
    assert type(view) is TransferTask and view == TransferTask(id=41, kind="pull_blocks", peer=3,
                                                               info={"kind": "pull_blocks", "peer": 3})
    assert not hasattr(view, "fire")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        view.kind = "other"
    with pytest.raises(TypeError):
        view.info["kind"] = "other"
    assert tracked.info["kind"] == "pull_blocks"   # the engine's own task is untouched
