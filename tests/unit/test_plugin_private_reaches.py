"""Inside each transport plugin, modules talk through public names (issue 37, item 5).

A *private reach* is a use, in one module of a plugin's package, of a private name (``_x``: one leading
underscore, not ``__dunder__``, not ``_sunder_``) that the plugin defines, when the using code does not own
it:

* ``obj._x`` where ``obj`` is not ``self`` / ``cls``, unless the class around the access defines ``_x`` and
  no other module of the package does (another instance of the same class); otherwise it is another
  object's private member (the endpoint's lock read by a channel, a counter of the channel bumped by a
  plan, a sibling module's private function called as ``mod._x``);
* ``from .sibling import _x`` (a private name of another module).

The plugin's own modules are named ``_x`` (private to the package, not to a module): importing them is
not a reach (an attribute of the same name, ``ch._cma``, still is).  What "defines" means: a module-level name, a class attribute or method, an attribute
assigned as ``self._x = ...``, or a ``__slots__`` entry, in any module of the package.  Names the plugin
does not define (the standard library's, a C extension's) are not counted here.

The target is no reach in any plugin; :data:`ALLOWED` lists the exceptions, each with its reason.

And no import cycle between a plugin's modules (:func:`import_graph`): every import of a sibling counts,
``from . import x``, ``from .x import y``, absolute ones of the package, in a function or under ``if
TYPE_CHECKING:`` alike (an annotation-only import back to the caller is still a cycle of concepts: a
module names what it needs of its caller as a ``Protocol`` of its own instead).
"""

from __future__ import annotations

import ast
import pathlib
from collections import Counter

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "plugins"
PLUGINS = {
    "shm": ROOT / "llmdd-transport-shm" / "src" / "llmdd_shm",
    "tcp": ROOT / "llmdd-transport-tcp" / "src" / "llmdd_tcp",
    "ucx": ROOT / "llmdd-transport-ucx" / "src" / "llmdd_ucx",
}

#: (plugin, module file, private name) -> why the reach stays
ALLOWED: dict[tuple[str, str, str], str] = {}


def _private(name: str) -> bool:
    return (name.startswith("_") and not name.startswith("__") and not (len(name) > 2 and name.endswith("_")))


def _self_attrs(cls: ast.ClassDef) -> set[str]:
    """Names a class defines: its methods and class attributes, ``self._x = ...`` and ``__slots__``."""
    out: set[str] = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    out.add(t.id)
                    if t.id == "__slots__" and node.value is not None:
                        for elt in getattr(node.value, "elts", []):
                            if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                                out.add(elt.value)
    for node in ast.walk(cls):
        targets: list = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                        and sub.value.id in ("self", "cls")):
                    out.add(sub.attr)
    return out


def _module_names(tree: ast.Module) -> set[str]:
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Name):
                        out.add(sub.id)
    return out


def reaches(pkg: pathlib.Path) -> list[tuple[str, int, str]]:
    """Every private reach in the package at ``pkg``: ``(module file, line, name)``."""
    trees = {p.name: ast.parse(p.read_text(), str(p)) for p in sorted(pkg.glob("*.py"))}
    modules = {p.stem for p in pkg.iterdir() if p.suffix in (".py", ".so", ".c")} | {
        p.name.split(".")[0] for p in pkg.glob("*.so")}
    defined: set[str] = set()
    by_module: dict[str, set[str]] = {}
    for fname, tree in trees.items():
        mine = _module_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                mine |= _self_attrs(node)
        by_module[fname] = mine
        defined |= mine
    defined = {n for n in defined if _private(n)}
    names = defined - modules   # a sibling module imported by its name is no reach
    found: list[tuple[str, int, str]] = []
    for fname, tree in trees.items():
        # a name some other module defines too is never "owned" (``endpoint._cfg`` read in a channel class
        # that has a ``_cfg`` of its own is still the endpoint's)
        elsewhere = set().union(*(names_ for m, names_ in by_module.items() if m != fname))

        def visit(node: ast.AST, owned: frozenset) -> None:
            if isinstance(node, ast.ClassDef):
                owned = owned | (_self_attrs(node) - elsewhere)
            if isinstance(node, ast.ImportFrom) and node.level >= 1:
                for alias in node.names:
                    if alias.name in names:
                        found.append((fname, node.lineno, alias.name))
            if (isinstance(node, ast.Attribute) and node.attr in defined and node.attr not in owned
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append((fname, node.lineno, node.attr))
            for child in ast.iter_child_nodes(node):
                visit(child, owned)

        visit(tree, frozenset())
    return found


def counts() -> dict[str, int]:
    return {name: len([r for r in reaches(pkg) if (name, r[0], r[2]) not in ALLOWED]) for name, pkg in PLUGINS.items()}


@pytest.mark.parametrize("plugin", sorted(PLUGINS))
def test_no_private_reaches(plugin: str) -> None:
    found = [r for r in reaches(PLUGINS[plugin]) if (plugin, r[0], r[2]) not in ALLOWED]
    by_module = Counter(f"{m}:{n}" for m, _, n in found)
    print(f"{plugin}: {len(found)} private reaches", dict(by_module.most_common()))
    assert not found, (f"{plugin}: {len(found)} cross-module private reaches (module:name -> count): "
                       f"{dict(by_module.most_common())}")


def test_allow_list_is_live() -> None:
    """Every allowed reach still exists (an entry for a reach that went is removed with it)."""
    live = {(name, m, n) for name, pkg in PLUGINS.items() for m, _, n in reaches(pkg)}
    assert set(ALLOWED) <= live, sorted(set(ALLOWED) - live)


def test_checker_finds_a_planted_reach(tmp_path: pathlib.Path) -> None:
    """The control: a package with each kind of reach, and the accesses that are not reaches."""
    (tmp_path / "_a.py").write_text(
        "_HIDDEN = 1\n"
        "class A:\n"
        "    def __init__(self):\n"
        "        self._lock = None\n"
        "        self.public = 0\n"
        "    def same(self, other: 'A'):\n"
        "        return other._lock, self._lock\n")
    (tmp_path / "_b.py").write_text(
        "from . import _a\n"
        "from ._a import _HIDDEN, A\n"
        "def f(a: A):\n"
        "    return a._lock, a.public, _a._HIDDEN, a.__class__, a._fields_\n")
    got = sorted((m, n) for m, _, n in reaches(tmp_path))
    assert got == [("_b.py", "_HIDDEN"), ("_b.py", "_HIDDEN"), ("_b.py", "_lock")]


def import_graph(pkg: pathlib.Path) -> dict[str, set[str]]:
    """``module -> the sibling modules it imports`` for the package at ``pkg`` (module names without
    ``.py``; ``__init__`` for names taken from the package itself)."""
    name = pkg.name
    # C extensions too, built (.so) or not yet (their .c source)
    mods = {p.stem for p in pkg.glob("*.py")} | {p.name.split(".")[0] for p in (*pkg.glob("*.so"), *pkg.glob("*.c"))}
    graph: dict[str, set[str]] = {}
    for path in sorted(pkg.glob("*.py")):
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level > 1 or (node.level == 0 and (node.module or "").split(".")[0] != name):
                    continue
                parts = (node.module or "").split(".")
                rest = parts if node.level == 1 else parts[1:]   # relative: .x ; absolute: pkg.x
                if rest and rest[0]:
                    out.add(rest[0] if rest[0] in mods else "__init__")
                else:   # from . import a, b (or from pkg import a): a sibling module, else a name of __init__
                    out |= {a.name if a.name in mods else "__init__" for a in node.names}
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == name:
                        out.add(parts[1] if len(parts) > 1 and parts[1] in mods else "__init__")
        out.discard(path.stem)
        graph[path.stem] = out & (mods | {"__init__"})
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: each strongly connected set of more than one module (sorted)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


@pytest.mark.parametrize("plugin", sorted(PLUGINS))
def test_no_import_cycles(plugin: str) -> None:
    graph = import_graph(PLUGINS[plugin])
    assert len(graph) > 5 and graph["__init__"], graph   # the package was read
    assert not cycles(graph), f"{plugin}: import cycles between modules: {cycles(graph)}"


def test_cycle_check_finds_planted_cycles(tmp_path: pathlib.Path) -> None:
    """The control: a runtime cycle, an annotation-only one (under TYPE_CHECKING), one through an import
    inside a function and one through the package's own name are each found; a chain is not a cycle."""
    pkg = tmp_path / "llmdd_planted"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from ._a import A\n")
    (pkg / "_a.py").write_text("from . import _b\nclass A: pass\n")
    (pkg / "_b.py").write_text("from ._a import A\n")                                  # _a <-> _b
    (pkg / "_c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._d import D\n")
    (pkg / "_d.py").write_text("from ._c import TYPE_CHECKING\nclass D: pass\n")     # _c <-> _d
    (pkg / "_e.py").write_text("def f():\n    from ._f import g\n    return g\n")
    (pkg / "_f.py").write_text("import llmdd_planted._e\ndef g(): pass\n")            # _e <-> _f
    (pkg / "_g.py").write_text("from llmdd_planted import A\n")                         # _g -> __init__ -> _a
    (pkg / "_h.py").write_text("from . import _g\n")                                    # a chain, no cycle
    graph = import_graph(pkg)
    assert graph["_g"] == {"__init__"} and graph["_h"] == {"_g"}
    assert cycles(graph) == [["_a", "_b"], ["_c", "_d"], ["_e", "_f"]]
    (pkg / "_a.py").write_text("from . import _g\nclass A: pass\n")                    # __init__ -> _a -> _g -> __init__
    assert ["__init__", "_a", "_g"] in cycles(import_graph(pkg))
