"""Every state change is decided by the tables (docs/lifecycle.md, docs/architecture.md).

Read from the source's AST, not grepped: outside the package that defines a state machine, no
code compares a state, assigns one, or asks ``can(trigger)`` before firing.  Drivers fire a
trigger (an illegal one raises), offer a late one (the table absorbs it or it raises), and ask
questions with the named groups of ``llmdd/_lifecycle/tables.py`` (``tracked.in_(GROUP)``).

The handshake (``llmdd/_protocol/handshake.py``) is a sans-io protocol machine of its own: its
states are compared there only, and its users read ``finished``/``refused``/``authenticated``.

Nor does a driver keep a state of its own beside a table's: a boolean flag, or a set or map of ids,
named like a state or a trigger of the tables (``self._closing = set()``: "as if UNLINKING";
``self._unlinking = True``) is a second owner of that state.  The few flags of that shape that are
not copies of a table's state are listed below with the reason.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Iterator

import pytest

from llmdd._lifecycle import tables

ROOT = pathlib.Path(__file__).resolve().parents[3]

#: state enum -> the package (path prefix under the repository) that may compare and assign it
OWNERS = {
    "EngineState": "llmdd/_lifecycle/", "LinkState": "llmdd/_lifecycle/", "CommGroupState": "llmdd/_lifecycle/",
    "CacheState": "llmdd/_lifecycle/", "TaskState": "llmdd/_lifecycle/", "ListenerState": "llmdd/_lifecycle/",
    "HandshakeState": "llmdd/_protocol/handshake.py",
}
LIFECYCLE = "llmdd/_lifecycle/"

#: the packages that drive the machines (a flag of theirs named like a state would be a second owner)
DRIVERS = ("llmdd/_api/", "llmdd/_control/", "llmdd/_data/", "llmdd/_engine/", "llmdd/_memory/",
           "llmdd/_extension/", "cpp/python/")

#: (file, attribute) -> why this state-like flag is not a copy of a table's state
FLAGS = {
    ("llmdd/_api/cache_manager.py", "_initialized"):
        "a manager outlives its engine's incarnation: once that engine is finalized the manager stays dead, "
        "also after the same LLMDataDist is initialized again (which makes a new manager)",
    ("llmdd/_api/v1/kv_cache_manager.py", "_initialized"): "as the cache manager's, for the v1 KvCacheManager",
    ("llmdd/_control/table.py", "_linking"):
        "remote cluster ids with a link_clusters call in progress, before any link record exists (a dial "
        "reserves the id so that two calls do not dial the same peer)",
    ("llmdd/_control/table.py", "_accepting"):
        "peers whose incoming connection is being accepted, before its link record exists (their waiters)",
    ("llmdd/_control/comm_group.py", "linked"):
        "which members of a rank-table group were linked by the group's own setup (its progress, not the links' "
        "states: a link's state is asked of the link table)",
    ("cpp/python/llmdd_cpp_bridge.py", "_starting"):
        "the C API's guard against two concurrent initialize calls, before the engine (and its machine) exists",
    ("cpp/python/llmdd_cpp_bridge.py", "_switch_role"): "the llm.EnableSwitchRole option, not a state",
    **{(path, "_closed"): "the part's own teardown (it refuses work once finalize closed it); the engine's "
                          "parts are not resources of the tables, the engine is (FINALIZED)"
       for path in ("llmdd/_control/connection.py", "llmdd/_control/manager.py", "llmdd/_data/engine.py",
                    "llmdd/_data/notices.py", "llmdd/_memory/backend.py", "llmdd/_memory/manager.py")},
}


def _state_words() -> frozenset[str]:
    """Every state and trigger name of the tables, with the trigger's -ing and -ed forms."""
    words = {state.value for states in tables.STATES.values() for state in states}
    for transitions in tables.TABLES.values():
        for row in transitions:
            trigger = row["trigger"]
            stem = trigger[:-1] if trigger.endswith("e") else trigger
            words |= {trigger, stem + "ing", stem + "ed"}
    return frozenset(words)


STATE_WORDS = _state_words()


def _holds_a_flag(value: ast.AST) -> bool:
    """``True``/``False``, or an empty set or map (``set()``, ``{}``, ``dict()``) to keep ids in."""
    if isinstance(value, ast.Constant):
        return isinstance(value.value, bool)
    if isinstance(value, ast.Dict) and not value.keys:
        return True
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in ("set", "dict") \
        and not value.args


def flag_violations(tree: ast.AST, rel: str) -> list[str]:
    """State-like flags ``rel`` keeps: an attribute named like a state or trigger set to a boolean or an
    empty set/map, unless :data:`FLAGS` says why it is none."""
    if not rel.startswith(DRIVERS):
        return []
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None or not _holds_a_flag(node.value):
            continue
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
            if not isinstance(target, ast.Attribute):
                continue
            name = target.attr.lstrip("_")
            name = name[3:] if name.startswith("is_") else name
            if name in STATE_WORDS and (rel, target.attr) not in FLAGS:
                out.append(f"{rel}:{node.lineno}: keeps a state of its own: {ast.unparse(node)[:90]}")
    return out


def _sources() -> Iterator[pathlib.Path]:
    yield from sorted((ROOT / "llmdd").rglob("*.py"))
    for src in sorted((ROOT / "plugins").glob("*/src")):
        yield from sorted(src.rglob("*.py"))
    yield from sorted((ROOT / "cpp" / "python").rglob("*.py"))


def _enum_member(node: ast.AST) -> str | None:
    """``LinkState.LINKED`` (or ``m.LinkState.LINKED``) -> "LinkState"."""
    if isinstance(node, ast.Attribute) and node.attr.isupper():
        base = node.value
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
        if name in OWNERS:
            return name
    return None


def _state_read(node: ast.AST) -> bool:
    """``x.state`` or ``x.state.value`` / ``x.state.name``."""
    if isinstance(node, ast.Attribute):
        if node.attr == "state":
            return True
        if node.attr in ("value", "name") and isinstance(node.value, ast.Attribute) and node.value.attr == "state":
            return True
    return False


def violations(tree: ast.AST, rel: str) -> list[str]:
    """Comparisons and assignments of a state, and ``.can(...)`` calls, that ``rel`` may not make."""
    out = []
    in_lifecycle = rel.startswith(LIFECYCLE)

    def owner_ok(enum_name: str) -> bool:
        return rel.startswith(OWNERS[enum_name])

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op in operands:
                for sub in ast.walk(op):
                    name = _enum_member(sub)
                    if name is not None and not owner_ok(name):
                        out.append(f"{rel}:{node.lineno}: compares {name}: {ast.unparse(node)[:90]}")
                        break
            if not in_lifecycle and not rel.startswith(OWNERS["HandshakeState"]) \
                    and any(_state_read(op) for op in operands):
                out.append(f"{rel}:{node.lineno}: compares a state: {ast.unparse(node)[:90]}")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for sub in (target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]):
                    if isinstance(sub, ast.Attribute) and sub.attr == "state" and not in_lifecycle \
                            and not rel.startswith(OWNERS["HandshakeState"]):
                        out.append(f"{rel}:{node.lineno}: assigns a state: {ast.unparse(node)[:90]}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "can" \
                and not in_lifecycle:
            out.append(f"{rel}:{node.lineno}: asks can() before firing: {ast.unparse(node)[:90]}")
    return out


def test_no_driver_keeps_a_state_like_flag_beside_the_tables():
    found = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        found += flag_violations(ast.parse(path.read_text(encoding="utf-8")), rel)
    assert not found, "a state kept beside the tables:\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    "self._closing: set[int] = set()",
    "self._unlinking = True",
    "self.is_linked = False",
    "link.cancelled = True",
    "self._finalized = {}",
])
def test_state_like_flags_that_must_fail(source):
    assert flag_violations(ast.parse(source), "llmdd/_data/busy.py"), source


@pytest.mark.parametrize("source,rel", [
    ("self._closing = set()", "llmdd/_runtime/ioloop.py"),         # not a driver of the tables
    ("self._closed = True", "llmdd/_data/engine.py"),              # listed in FLAGS, with its reason
    ("self._link_went = True", "llmdd/_data/tasks.py"),            # not a state's name
    ("self._closing = [1]", "llmdd/_data/busy.py"),                # not a flag's shape
])
def test_what_a_driver_may_keep(source, rel):
    assert not flag_violations(ast.parse(source), rel), source


def test_every_listed_flag_still_exists():
    """FLAGS lists only flags the code has (a stale entry would hide a new flag of that name)."""
    seen = set()
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Attribute):
                        seen.add((rel, target.attr))
    assert sorted(set(FLAGS) - seen) == []


def test_no_state_is_compared_or_assigned_outside_its_machine():
    found = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        found += violations(ast.parse(path.read_text(encoding="utf-8")), rel)
    assert not found, "state decided outside the tables:\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    "if link.state is LinkState.LINKED: pass",
    "ok = rec.state in (CacheState.ALLOCATED, CacheState.REGISTERED)",
    "done = task.state.value == 'completed'",
    "listener.state = ListenerState.FAILED",
    "a, link.state = 1, None",
    "if group.fsm.can('unlink'): group.fsm.fire('unlink')",
    "while hs.state not in (HandshakeState.ESTABLISHED,): pass",
    "x = m.LinkState.FAILED == y",
])
def test_controls_that_must_fail(source):
    assert violations(ast.parse(source), "llmdd/_control/manager.py"), source


@pytest.mark.parametrize("source", [
    "if link.fsm.in_(LINK_IN_USE): pass",
    "link.fsm.offer('peer_lost', error=exc)",
    "print(link.state.value)",
    "name = LinkState.LINKED.value",
])
def test_what_drivers_may_do(source):
    assert not violations(ast.parse(source), "llmdd/_control/manager.py"), source


def test_the_lifecycle_package_and_the_handshake_may_compare_their_own_states():
    assert not violations(ast.parse("ok = self.state in (LinkState.LINKED,)"), "llmdd/_lifecycle/machines.py")
    assert not violations(ast.parse("ok = self._state is HandshakeState.REFUSED"), "llmdd/_protocol/handshake.py")
    assert violations(ast.parse("ok = link.state is LinkState.LINKED"), "llmdd/_protocol/handshake.py")
