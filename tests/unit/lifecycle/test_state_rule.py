"""Every state change is decided by the tables (docs/lifecycle.md, docs/architecture.md).

Read from the source's AST, not grepped: outside the package that defines a state machine, no
code compares a state, assigns one, or asks ``can(trigger)`` before firing.  Drivers fire a
trigger (an illegal one raises), offer a late one (the table absorbs it or it raises), and ask
questions with the named groups of ``llmdd/_lifecycle/tables.py`` (``tracked.in_(GROUP)``).

The handshake (``llmdd/_protocol/handshake.py``) is a sans-io protocol machine of its own: its
states are compared there only, and its users read ``finished``/``refused``/``authenticated``.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]

#: state enum -> the package (path prefix under the repository) that may compare and assign it
OWNERS = {
    "EngineState": "llmdd/_lifecycle/", "LinkState": "llmdd/_lifecycle/", "CommGroupState": "llmdd/_lifecycle/",
    "CacheState": "llmdd/_lifecycle/", "TaskState": "llmdd/_lifecycle/", "ListenerState": "llmdd/_lifecycle/",
    "HandshakeState": "llmdd/_protocol/handshake.py",
}
LIFECYCLE = "llmdd/_lifecycle/"


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
