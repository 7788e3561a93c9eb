"""No module of llmdd or of a plugin is over 700 lines (issue 37): a module that grows past it is
split by concept (docs/architecture.md, "Layers"), not by size."""

from __future__ import annotations

import pathlib
from typing import Iterable

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_LINES = 700


def _modules() -> list[pathlib.Path]:
    found = sorted((ROOT / "llmdd").rglob("*.py"))
    for src in sorted((ROOT / "plugins").glob("*/src")):
        found += sorted(src.rglob("*.py"))
    return found


def _oversized(paths: Iterable[pathlib.Path], root: pathlib.Path = ROOT, limit: int = MAX_LINES) -> dict[str, int]:
    """Path (relative to ``root``) -> its line count, for every module over ``limit`` lines."""
    out = {}
    for path in paths:
        count = len(path.read_text(encoding="utf-8").splitlines())
        if count > limit:
            out[str(path.relative_to(root))] = count
    return out


def test_every_module_of_llmdd_and_the_plugins_has_at_most_700_lines():
    modules = _modules()
    # the walk reaches both trees: the package, and every plugin's sources
    assert ROOT / "llmdd" / "__init__.py" in modules
    plugin_srcs = {p.relative_to(ROOT).parts[1] for p in modules if p.relative_to(ROOT).parts[0] == "plugins"}
    assert plugin_srcs == {p.parent.name for p in (ROOT / "plugins").glob("*/src")}
    assert _oversized(modules) == {}


def test_the_size_check_catches_a_module_one_line_over(tmp_path):
    at_limit = tmp_path / "at_limit.py"
    over = tmp_path / "over.py"
    at_limit.write_text("x = 1\n" * MAX_LINES)
    over.write_text("x = 1\n" * (MAX_LINES + 1))
    assert _oversized([at_limit, over], root=tmp_path) == {"over.py": MAX_LINES + 1}
