"""Every concurrency of the engine goes through its runtime (issue 38 point 1), read from the source's AST.

The engine is every module of llmdd's layers (``llmdd/_*`` but the tools, and the public modules at
the package root) and the seam's code for transports that lives in llmdd (``llmdd/_seam``: the kit and
``ThreadCompletion``), plus the simulation's own transport plugin where it exists.  In it, nothing may:

* start a thread or a pool (``threading.Thread`` / ``Timer``, ``_thread``, ``concurrent.futures``,
  ``multiprocessing.pool``, ``asyncio``);
* read a clock or sleep (``time.sleep`` / ``monotonic`` / ``monotonic_ns`` / ``perf_counter``);
* make a waitable primitive or a thread-local of its own (``threading.Event`` / ``Condition`` /
  ``Semaphore`` / ``Barrier`` / ``local``), or ask which thread runs (``current_thread``, ``get_ident``):
  a simulated worker is not a thread, and a wait on a real primitive would stop the one thread that
  runs the whole simulated world.

All of these come from the runtime (``llmdd._runtime.runtime.Threads``).  Plain ``threading.Lock`` /
``RLock`` stay allowed for short critical sections that never wait inside.  The only code allowed the
real primitives is a real runtime's implementation itself (:data:`ALLOWED`): the engine's, and the sim
transport's real clock (the fabric's clock when that transport runs on real engines, as in its
conformance run; on a simulated world it runs on the world's clock).  Not the engine,
so not scanned: ``llmdd/_tools`` (the command-line tools, each a process of its own that drives
engines from outside) and ``llmdd/testing`` (the test harness and the simulator); the wall clock
(``time.time``, a timestamp for people in an event or a failure record) is not a clock of the engine's
behaviour and stays allowed.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "llmdd"

#: the real runtimes: the only code that starts threads, sleeps and reads the monotonic clock (a module,
#: or ``module::Class`` for one class of it); an entry whose file is not in this checkout is not checked
ALLOWED = {"llmdd/_runtime/threads.py", "llmdd/_runtime/ioloop.py",
           "plugins/llmdd-transport-sim/src/llmdd_sim/_fabric.py::RealClock"}

#: not the engine (see the module docstring)
NOT_ENGINE = ("llmdd/_tools/", "llmdd/testing/")

BANNED_NAMES = {
    "threading": {"Thread", "Timer", "Event", "Condition", "Semaphore", "BoundedSemaphore", "Barrier", "local",
                  "current_thread", "get_ident", "get_native_id", "main_thread"},
    "time": {"sleep", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns"},
}
BANNED_MODULES = ("_thread", "concurrent.futures", "multiprocessing.pool", "asyncio")


def engine_sources() -> list[pathlib.Path]:
    paths = [p for p in PKG.rglob("*.py") if not p.relative_to(ROOT).as_posix().startswith(NOT_ENGINE)]
    paths += list((ROOT / "plugins" / "llmdd-transport-sim" / "src").rglob("*.py"))
    return sorted(paths)


def _annotations(tree: ast.AST) -> set[int]:
    """ids of the nodes inside annotations (a type named is not a primitive made)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        notes: list = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            notes = [a.annotation for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if a.annotation]
            notes += [a.annotation for a in (args.vararg, args.kwarg) if a is not None and a.annotation]
            if node.returns is not None:
                notes.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            notes = [node.annotation]
        for note in notes:
            inside.update(id(n) for n in ast.walk(note))
    return inside


def violations_in(source: str, name: str, exempt: frozenset[str] = frozenset()) -> Iterator[str]:
    """The escapes in ``source``, but inside annotations and inside the top-level classes named in ``exempt``."""
    tree = ast.parse(source, filename=name)
    notes = _annotations(tree)
    for cls in tree.body:   # type: ignore[attr-defined]
        if isinstance(cls, ast.ClassDef) and cls.name in exempt:
            notes.update(id(n) for n in ast.walk(cls))
    for node in ast.walk(tree):
        if id(node) in notes:
            continue
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.attr in BANNED_NAMES.get(node.value.id, ()):
                yield f"{name}:{node.lineno}: {node.value.id}.{node.attr}"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if alias.name in BANNED_NAMES.get(node.module, ()):
                    yield f"{name}:{node.lineno}: from {node.module} import {alias.name}"
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and node.level:
                continue
            for module in modules:
                if any(module == b or module.startswith(b + ".") for b in BANNED_MODULES):
                    yield f"{name}:{node.lineno}: import {module}"


def _exempt(rel: str) -> frozenset[str]:
    return frozenset(entry.split("::", 1)[1] for entry in ALLOWED if entry.startswith(rel + "::"))


def violations() -> list[str]:
    out = []
    for path in engine_sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel not in ALLOWED:
            out.extend(violations_in(path.read_text(), rel, _exempt(rel)))
    return out


def test_no_thread_clock_sleep_or_waitable_of_the_engine_outside_the_runtime():
    assert violations() == []


def test_the_allow_list_names_only_the_real_runtime_and_each_entry_needs_it():
    """Each allowed module of llmdd is in the runtime package, and each entry present in this checkout
    would fail the scan without it (an entry that no longer needs the exception goes)."""
    for entry in sorted(ALLOWED):
        rel, _, cls = entry.partition("::")
        assert rel.startswith(("llmdd/_runtime/", "plugins/llmdd-transport-sim/")), entry
        if not (ROOT / rel).exists():
            assert rel.startswith("plugins/"), f"{rel} does not exist"
            continue
        source = (ROOT / rel).read_text()
        assert list(violations_in(source, rel, _exempt(rel) - {cls})), f"{entry} needs no exception any more"


def test_the_scan_sees_each_kind_of_escape():
    """The control: each way around the runtime is found, at any depth, and a type annotation or a plain
    lock is not."""
    source = '''
import threading, time
import concurrent.futures
from threading import Event
from time import monotonic as now

def f(x: threading.Condition) -> "threading.Thread":
    lock = threading.Lock()
    def g():
        threading.Thread(target=print).start()
        time.sleep(1)
    clock = time.monotonic
    with lock:
        return threading.current_thread(), time.time()
'''
    found = [v.split(": ", 1)[1] for v in violations_in(source, "probe.py")]
    exempt = 'class Clock:\n    def now(self):\n        return time.monotonic()\n'
    assert list(violations_in(exempt, "probe.py")) and not list(violations_in(exempt, "probe.py", frozenset({"Clock"})))
    assert sorted(found) == sorted(["import concurrent.futures", "from threading import Event",
                                    "from time import monotonic", "threading.Thread", "time.sleep",
                                    "time.monotonic", "threading.current_thread"])
