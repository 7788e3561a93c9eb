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

#: module (dotted, relative to llmdd) -> layer; the first matching prefix wins
LAYERS = [
    ("_lifecycle", "lifecycle"),
    ("_events", "lifecycle"),
    ("_memory", "memory"),
    ("_protocol", "control"),
    ("_ioloop", "control"),
    ("_link_manager", "control"),
    ("_comm_group", "control"),
    ("_ranktable", "control"),
    ("_planner", "data"),
    ("_transfer", "data"),
    ("_peer_input", "data"),
    ("_tasks", "data"),
    ("_owner", "data"),
    ("_port", "port"),
    ("_abc", "seam"),
    ("_datadist", "facade"),
    ("_cache_manager", "facade"),
    ("_cache_manager_remote", "facade"),
    ("_v1", "facade"),
    ("_compat", "facade"),
]

#: arrows that must never exist: (from layer, to layer)
FORBIDDEN = {
    ("memory", "control"), ("memory", "data"), ("memory", "facade"), ("memory", "port"),
    ("data", "facade"),
    ("control", "facade"),
    ("port", "facade"),
    ("lifecycle", "memory"), ("lifecycle", "control"), ("lifecycle", "data"), ("lifecycle", "facade"),
    ("lifecycle", "port"), ("lifecycle", "seam"),
    ("seam", "control"), ("seam", "data"), ("seam", "facade"), ("seam", "memory"),
}

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


def imports_of(path: pathlib.Path, module: str) -> Iterator[tuple[int, str]]:
    """(line, absolute module relative to llmdd, or 'llmdd.x' for absolute imports) of every import."""
    tree = ast.parse(path.read_text(), filename=str(path))
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


def test_every_private_top_level_module_has_a_layer():
    """A new private module must be placed in a layer (else its arrows go unchecked)."""
    unlayered = []
    for path in sorted(PKG.glob("_*.py")):
        name = path.stem
        if name in ("__init__", "__main__"):
            continue
        if layer_of(name) is None and name not in UNLAYERED:
            unlayered.append(name)
    assert unlayered == [], f"place these modules in a layer of tests/unit/test_layers.py: {unlayered}"


#: shared bottom modules (value types, statuses, options, logging, plugins): any layer may import them
UNLAYERED = {"_status", "_types", "_enums", "_config", "_validation", "_log", "_options", "_profiles", "_plugins", "_lazy",
             "_doctor"}


def _violations() -> list[str]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        module = _module_name(path)
        src = layer_of(module)
        if src is None:
            continue
        for line, target in imports_of(path, module):
            dst = layer_of(target)
            if dst is not None and (src, dst) in FORBIDDEN:
                out.append(f"llmdd/{path.relative_to(PKG)}:{line}: {src} -> {dst} ({target})")
    return out


def test_no_forbidden_arrow_between_layers():
    assert _violations() == []


def test_the_checker_sees_a_forbidden_arrow_at_any_depth(tmp_path, monkeypatch):
    """Control: an import of the facade from the memory layer, inside a function, is found."""
    fake = PKG / "_memory" / "_zz_layer_probe.py"
    fake.write_text("def f():\n    from .._datadist import LLMDataDist\n    return LLMDataDist\n")
    try:
        found = _violations()
    finally:
        fake.unlink()
    assert found == ["llmdd/_memory/_zz_layer_probe.py:2: memory -> facade (_datadist.LLMDataDist)"]


def _plugin_private_imports() -> list[str]:
    out = []
    for path in sorted((ROOT / "plugins").glob("*/src/**/*.py")):
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


@pytest.mark.parametrize("line,expected", [("from llmdd._ioloop import IoLoop", True),
                                           ("import llmdd._options", True),
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
    for path in sorted((ROOT / "plugins").glob("*/src/**/*.py")):
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if "HookimplMarker(" in line or "HookspecMarker(" in line:
                out.append(f"{path.relative_to(ROOT)}:{no}")
    return out


def test_plugins_use_llmdd_plugin_hookimpl():
    """One marker for every plugin (llmdd.plugin.hookimpl): a copy would silently register under
    another project name if one were mistyped."""
    assert _own_hook_markers() == []
