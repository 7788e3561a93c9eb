"""The library logs, it never configures logging; one line per transition."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest

from llmdd._lifecycle.events import TransitionEvent
from llmdd._lifecycle.machines import Lifecycle
from llmdd._lifecycle.tables import Machine
from llmdd._extension.manager import Hooks, make_plugin_manager

_SCRIPT = '''
import json, logging, structlog

def refuse(name):
    def call(*args, **kwargs):
        raise AssertionError(f"the library called {name}")
    return call

logging.basicConfig = refuse("logging.basicConfig")
structlog.configure = refuse("structlog.configure")
structlog.configure_once = refuse("structlog.configure_once")
root_before = list(logging.getLogger().handlers)

import llmdd, llmdd.plugin, llmdd.hookspecs
from llmdd._lifecycle.machines import Lifecycle
from llmdd._lifecycle.tables import Machine
from llmdd._extension.manager import Hooks, make_plugin_manager

hooks = Hooks(make_plugin_manager(autoload=False))
for machine, triggers in [(Machine.LINK, ["link", "handshake_failed"]), (Machine.TASK, ["start"])]:
    tracked = Lifecycle(machine, hooks.emitter(machine)).create(1)
    for t in triggers:
        tracked.fire(t, error=RuntimeError("x") if t == "handshake_failed" else None)

handlers = {name: [type(h).__name__ for h in logger.handlers]
            for name, logger in logging.root.manager.loggerDict.items()
            if isinstance(logger, logging.Logger) and logger.handlers and name.split(".")[0] == "llmdd"}
print(json.dumps({
    "handlers": handlers,
    "root_unchanged": logging.getLogger().handlers == root_before,
    "llmdd_level": logging.getLogger("llmdd").level,
    "structlog_configured": structlog.is_configured(),
}))
'''


def test_library_never_configures_logging():
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found == {"handlers": {"llmdd": ["NullHandler"]}, "root_unchanged": True,
                     "llmdd_level": logging.NOTSET, "structlog_configured": False}
    # the NullHandler keeps logging's last-resort handler from printing the WARNING line
    assert proc.stdout.count("\n") == 1 and proc.stderr == ""


def _lifecycle(machine, hooks):
    return Lifecycle(machine, hooks.emitter(machine))


def test_one_line_per_transition_with_its_fields(llmdd_hooks, llmdd_log_output):
    link = _lifecycle(Machine.LINK, llmdd_hooks).create(7, peer=8)
    link.fire("link", transport="tcp")
    link.fire("handshake_succeeded")
    assert llmdd_log_output.events("llmdd.link.transition") == [
        {"event": "llmdd.link.transition", "machine": "link", "id": 7, "source": "unlinked",
         "dest": "linking", "trigger": "link", "peer": 8, "transport": "tcp",
         "log_level": "info", "logger": "llmdd.link"},
        {"event": "llmdd.link.transition", "machine": "link", "id": 7, "source": "linking",
         "dest": "linked", "trigger": "handshake_succeeded", "peer": 8,
         "log_level": "info", "logger": "llmdd.link"},
    ]
    assert [e for e in llmdd_log_output.entries if e["event"].startswith("llmdd.link")] == \
        llmdd_log_output.events("llmdd.link.transition")


@pytest.mark.parametrize(("machine", "trigger", "level"), [
    (Machine.ENGINE, "init", "info"),
    (Machine.LINK, "link", "info"),
    (Machine.COMM_GROUP, "members_ready", "info"),
    (Machine.CACHE, "allocate", "debug"),
    (Machine.TASK, "start", "debug"),
])
def test_levels_per_machine(llmdd_hooks, llmdd_log_output, machine, trigger, level):
    _lifecycle(machine, llmdd_hooks).create(1).fire(trigger)
    [entry] = llmdd_log_output.events(f"llmdd.{machine.value}.transition")
    assert entry["log_level"] == level and entry["logger"] == f"llmdd.{machine.value}"


def test_failures_log_a_warning_with_the_error(llmdd_hooks, llmdd_log_output):
    task = _lifecycle(Machine.TASK, llmdd_hooks).create("t1", peer=3)
    task.fire("start", bytes=65536)
    task.fire("transfer_failed", error=TimeoutError("deadline"))
    [started, failed] = llmdd_log_output.events("llmdd.task.transition")
    assert started["log_level"] == "debug" and started["bytes"] == 65536 and "error" not in started
    assert failed == {"event": "llmdd.task.transition", "machine": "task", "id": "t1", "source": "running",
                      "dest": "failed", "trigger": "transfer_failed", "error": "TimeoutError: deadline",
                      "peer": 3, "log_level": "warning", "logger": "llmdd.task"}


def test_disabled_level_builds_nothing(llmdd_hooks, monkeypatch, llmdd_log_output):
    logging.getLogger("llmdd").setLevel(logging.INFO)  # llmdd_log_output restores it
    calls = []
    original = TransitionEvent.as_log_fields
    monkeypatch.setattr(TransitionEvent, "as_log_fields", lambda self: calls.append(self) or original(self))
    task = _lifecycle(Machine.TASK, llmdd_hooks).create(1)
    task.fire("start")
    task.fire("transfer_succeeded")
    assert calls == [] and llmdd_log_output.events("llmdd.task.transition") == []
    _lifecycle(Machine.LINK, llmdd_hooks).create(1).fire("link")
    assert len(calls) == 1 and len(llmdd_log_output.events("llmdd.link.transition")) == 1


def test_log_observer_is_an_ordinary_plugin(llmdd_log_output):
    hooks = Hooks(make_plugin_manager(autoload=False, blocked=["llmdd._extension.builtin.log_events"]))
    assert not hooks.live_emitter(Machine.LINK)[1](None)   # nobody listens
    Lifecycle(Machine.LINK, hooks.emitter(Machine.LINK)).create(1).fire("link")
    assert llmdd_log_output.events("llmdd.link.transition") == []


def test_no_line_per_event_of_the_hook_machinery(llmdd_hooks, llmdd_log_output):
    task = _lifecycle(Machine.TASK, llmdd_hooks).create(1)
    task.fire("start")
    for _ in range(100):
        task.fire("layer_transferred")
    task.fire("transfer_succeeded")
    assert len(llmdd_log_output.entries) == len(llmdd_log_output.events("llmdd.task.transition")) == 102


def test_binding_a_logger_does_not_load_structlog_and_keeps_its_fields():
    """bind/new/unbind stay lazy (an endpoint binds at creation: loading structlog there cost each
    side's first link ~0.2 s); the fields still reach the line when one is written."""
    import subprocess
    import sys

    code = (
        "import logging, sys\n"
        "from llmdd._base.log import get_logger\n"
        "log = get_logger('llmdd.t', a=1).bind(b=2).new(c=3).bind(d=4).try_unbind('c')\n"
        "log.info('quiet')\n"
        "assert 'structlog' not in sys.modules, 'bind loaded structlog'\n"
        "try:\n"
        "    log.unbind('zz')\n"
        "    raise SystemExit('unbind of a missing key must raise KeyError')\n"
        "except KeyError:\n"
        "    pass\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
        "log.info('shown', e=5)\n"
        "assert 'structlog' in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "shown d=4 e=5", out.stdout
