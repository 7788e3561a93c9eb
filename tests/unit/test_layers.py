"""The layers' import arrows (docs/architecture.md, "Layers"), read from the source's AST.

Each module of llmdd belongs to one layer; an import from a module of one layer into a module of a
layer it must never reach fails here, whether the import sits at the top of the module or inside a
function (an import inside a function is still an arrow).  The transports under plugins/ may import
only llmdd's public modules, as a vendor's would.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Iterator, Optional

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "llmdd"

#: package (dotted, relative to llmdd) -> layer; the first matching prefix wins.  The tree is the map:
#: one private package per layer (docs/architecture.md, "Layers").
LAYERS = [
    ("_base", "base"),            # value types, enums, status codes, options, profiles, logging
    ("_lifecycle", "lifecycle"),  # the tables, the one driver, the events
    ("_memory", "memory"),        # pools, segments, regions, cache records
    ("_seam", "seam"),            # the transport seam
    ("_extension", "extension"),  # the plugin manager and the built-in hook implementations
    ("_control", "control"),      # the control plane: protocol, I/O loop, links
    ("_data.port", "port"),       # the typed port between the control and the data plane
    ("_data", "data"),            # the data plane: planner, transfer engine, owner side, tasks
    ("_engine", "engine"),        # the composition root
    ("_api", "facade"),           # the llm_datadist facade and the legacy v1 mode
    ("_tools", "tools"),          # cli, doctor, bench, demo
]

_ORDER = ["base", "lifecycle", "memory", "seam", "extension", "control", "port", "data", "engine", "facade", "tools"]

#: arrows that must never exist: (from layer, to layer).  The bottom imports nothing above it; no layer
#: imports the facade, the engine or the tools; the lifecycle never reaches its drivers; the seam and
#: memory never reach the planes; the planes reach each other only through the port.
FORBIDDEN = {
    *{("base", other) for other in _ORDER if other != "base"},
    *{(layer, "facade") for layer in _ORDER if layer not in ("facade", "tools")},
    *{(layer, "engine") for layer in _ORDER if layer not in ("engine", "facade", "tools")},
    *{(layer, "tools") for layer in _ORDER if layer != "tools"},
    ("lifecycle", "memory"), ("lifecycle", "control"), ("lifecycle", "data"), ("lifecycle", "port"),
    ("lifecycle", "seam"), ("lifecycle", "extension"),
    ("memory", "control"), ("memory", "data"), ("memory", "port"), ("memory", "extension"),
    ("seam", "control"), ("seam", "data"), ("seam", "memory"), ("seam", "port"), ("seam", "extension"),
    ("seam", "lifecycle"),
    ("extension", "control"), ("extension", "data"), ("extension", "memory"), ("extension", "port"),
    ("data", "control"),          # except the wire's message types, below
}

#: the one crossing allowed from the data plane into the control package: the protocol's message types
#: (notices are messages of their own); everything else goes through the port
ALLOWED = {("data", "_control.protocol")}

#: llmdd's public modules a transport plugin may import (everything else of llmdd is private)
PUBLIC = {"llmdd", "llmdd.abc", "llmdd.lowlevel", "llmdd.plugin", "llmdd.events", "llmdd.status", "llmdd.testing",
          "llmdd.hookspecs"}


def layer_of(module: str) -> Optional[str]:
    """The layer of ``module`` (dotted, relative to llmdd: ``_memory.pool``), None when unlayered."""
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return None


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def imports_of(path: pathlib.Path, module: str, within: Optional[ast.AST] = None) -> Iterator[tuple[int, str]]:
    """(line, absolute module relative to llmdd, or 'llmdd.x' for absolute imports) of every import
    (of the whole module, or only those under the node ``within``)."""
    tree = within if within is not None else ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "llmdd" or alias.name.startswith("llmdd."):
                    yield node.lineno, alias.name[len("llmdd."):] if alias.name != "llmdd" else ""
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if node.module and (node.module == "llmdd" or node.module.startswith("llmdd.")):
                    target = node.module[len("llmdd."):] if node.module != "llmdd" else ""
                    for alias in node.names:
                        yield node.lineno, f"{target}.{alias.name}" if target else alias.name
                continue
            anchor = base[: len(base) - (node.level - 1)] if node.level > 1 else base
            target = ".".join([*anchor, node.module] if node.module else anchor)
            for alias in node.names:
                yield node.lineno, f"{target}.{alias.name}" if target else alias.name


def test_every_private_module_is_in_a_layer_package():
    """No private module sits at the package root: each lives in its layer's package (else its arrows
    go unchecked and the tree stops being the map)."""
    loose = sorted(p.name for p in PKG.glob("_*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert loose == [], f"move these modules into a layer package: {loose}"
    unlayered = sorted(p.name for p in PKG.glob("_*") if p.is_dir() and p.name != "__pycache__"
                       and layer_of(p.name) is None)
    assert unlayered == [], f"give these packages a layer in tests/unit/test_layers.py: {unlayered}"


def _violations() -> list[str]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        module = _module_name(path)
        src = layer_of(module)
        if src is None:
            continue
        for line, target in imports_of(path, module):
            dst = layer_of(target)
            if any(src == a and (target == b or target.startswith(b + ".")) for a, b in ALLOWED):
                continue
            if dst is not None and (src, dst) in FORBIDDEN:
                out.append(f"llmdd/{path.relative_to(PKG)}:{line}: {src} -> {dst} ({target})")
    return out


def test_no_forbidden_arrow_between_layers():
    assert _violations() == []


def test_the_checker_sees_a_forbidden_arrow_at_any_depth(tmp_path, monkeypatch):
    """Control: an import of the facade from the memory layer, inside a function, is found."""
    fake = PKG / "_memory" / "_zz_layer_probe.py"
    fake.write_text("def f():\n    from .._api.datadist import LLMDataDist\n    return LLMDataDist\n")
    try:
        found = _violations()
    finally:
        fake.unlink()
    assert found == ["llmdd/_memory/_zz_layer_probe.py:2: memory -> facade (_api.datadist.LLMDataDist)"]


def _plugin_sources() -> list[pathlib.Path]:
    """The plugins' sources, and the example transport's (docs/writing-a-transport.md: public API only)."""
    return sorted([*(ROOT / "plugins").glob("*/src/**/*.py"), *(ROOT / "examples").glob("transport_*/**/*.py")])


def _plugin_private_imports() -> list[str]:
    out = []
    for path in _plugin_sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                if (name == "llmdd" or name.startswith("llmdd.")) and name not in PUBLIC:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    return out


def test_transport_plugins_import_only_public_llmdd_modules():
    assert _plugin_private_imports() == []


@pytest.mark.parametrize("line,expected", [("from llmdd._control.ioloop import IoLoop", True),
                                           ("import llmdd._base.options", True),
                                           ("from llmdd.lowlevel import IoLoop", False)])
def test_the_plugin_checker_tells_private_from_public(tmp_path, monkeypatch, line, expected):
    """Control for the plugin rule: a private import in a plugin source file is reported."""
    src = ROOT / "plugins" / "llmdd-transport-tcp" / "src" / "llmdd_tcp" / "_zz_probe.py"
    src.write_text(line + "\n")
    try:
        found = _plugin_private_imports()
    finally:
        src.unlink()
    assert any("_zz_probe.py" in f for f in found) is expected


def _own_hook_markers() -> list[str]:
    """Plugin sources that build their own pluggy markers instead of using llmdd.plugin.hookimpl."""
    out = []
    for path in _plugin_sources():
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if "HookimplMarker(" in line or "HookspecMarker(" in line:
                out.append(f"{path.relative_to(ROOT)}:{no}")
    return out


def test_plugins_use_llmdd_plugin_hookimpl():
    """One marker for every plugin (llmdd.plugin.hookimpl): a copy would silently register under
    another project name if one were mistyped."""
    assert _own_hook_markers() == []


#: imports of llmdd modules inside a function body that are not there to dodge a cycle, each with its
#: reason; any other one fails below (issue 16: "no import inside a function to dodge a cycle")
DEFERRED_IMPORTS = {
    # upstream serves the legacy v1 names lazily from ``import llm_datadist`` (docs/v1.md)
    ("__init__.py", "_api"),
    # OP_DTYPE is a numpy dtype and numpy loads on first use (llmdd._base.lazy, issue 22's idle RSS)
    ("lowlevel.py", "_seam"),
}


def _function_imports(path: pathlib.Path) -> Iterator[tuple[int, str]]:
    module = _module_name(path)
    for fn in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from imports_of(path, module, within=fn)


def test_no_llmdd_import_inside_a_function_outside_the_tools():
    """The library's modules import each other at the top: an import inside a function hides an
    arrow (or a cycle) from the reader.  The CLI's tools load their subcommands lazily (the CLI
    starts without numpy or the engine) and are exempt; the two deferred imports above say why."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith(("_tools/", "testing/")):
            continue
        for line, target in _function_imports(path):
            top = target.split(".")[0]
            if (rel, top) in DEFERRED_IMPORTS:
                continue
            found.append(f"llmdd/{rel}:{line} imports llmdd.{target}")
    assert found == [], "\n".join(found)
