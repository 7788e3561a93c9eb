"""docs/compat.md (cache-manager section) and docs/deviations.md stay honest: every public name
upstream's package defines has a row under its module, every row names at least one test, and
every test named exists (``file::test`` resolved against the tests tree)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _load_names():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_compat_names", Path(__file__).with_name(
        "test_compat_public_names.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.UPSTREAM_MODULES, module.NOT_PROVIDED


UPSTREAM_MODULES, NOT_PROVIDED = _load_names()
PREFIX = {"TU": "tests/unit", "TI": "tests/integration", "TP": "tests/test_public_api.py"}
REF = re.compile(r"`(TU|TI|TP|tests)(/[\w/.]*?\.py)?::(test_\w+)`")

LLMDATADIST_METHODS = ["init", "link", "unlink", "query_register_mem_status", "cache_manager", "finalize",
                       "check_link_status", "link_clusters", "unlink_clusters", "switch_role", "kv_cache_manager",
                       "cluster_id"]
CACHE_MANAGER_METHODS = ["check_cache_key", "allocate_blocks_cache", "allocate_cache", "copy_blocks", "copy_cache",
                         "deallocate_blocks_cache", "deallocate_cache", "pull_blocks", "pull_cache", "register_cache",
                         "register_blocks_cache", "unregister_cache", "remove_cache_key", "remap_registered_memory",
                         "set_is_call_linked", "swap_blocks", "transfer_cache_async", "push_cache", "push_blocks"]


def _section(text: str, start: str, end: str) -> str:
    assert start in text, start
    return text.split(start, 1)[1].split(end, 1)[0]


def _compat_v2() -> str:
    text = (ROOT / "docs" / "compat.md").read_text(encoding="utf-8")
    return _section(text, "## Cache-manager (v2) mode and the package", "\n## ")


def _subsections(section: str) -> dict:
    parts = re.split(r"^### `llm_datadist((?:\.[\w.]+)?)`.*$", section, flags=re.M)
    return {parts[i].lstrip("."): parts[i + 1] for i in range(1, len(parts), 2)}


def _rows(text: str) -> list:
    return [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| ---")
            and not line.startswith("| upstream name") and not line.startswith("| topic")]


def _defined(path: Path) -> set:
    return set(re.findall(r"^def (test_\w+)", path.read_text(encoding="utf-8"), re.M))


def _resolve(prefix: str, rel: str | None) -> Path:
    if prefix == "TP":
        return ROOT / PREFIX["TP"]
    base = ROOT / PREFIX.get(prefix, "tests")
    return base / (rel or "").lstrip("/")


def _check_refs(row: str, column: str) -> int:
    refs = REF.findall(column)
    assert refs, f"row names no test: {row}"
    for prefix, rel, name in refs:
        path = _resolve(prefix, rel)
        assert path.is_file(), (row, str(path))
        assert name in _defined(path), (row, f"{path.relative_to(ROOT)}::{name}")
    return len(refs)


def test_every_v2_row_names_tests_that_exist():
    rows = _rows(_compat_v2())
    assert len(rows) >= 80
    for row in rows:
        _check_refs(row, row.rsplit("|", 2)[1])


@pytest.mark.parametrize("path", sorted(UPSTREAM_MODULES))
def test_every_upstream_name_has_a_row_under_its_module(path):
    subs = _subsections(_compat_v2())
    assert path in subs, f"no subsection for llm_datadist.{path}"
    names_column = " ".join(row.split("|")[1] for row in _rows(subs[path]))
    expected = list(UPSTREAM_MODULES[path]) + NOT_PROVIDED.get(path, [])
    if path == "v2.cache_manager":
        expected += CACHE_MANAGER_METHODS
    if path == "v2.llm_datadist":
        expected += LLMDATADIST_METHODS
    header_class = {"v2.cache_manager": "CacheManager"}.get(path)   # that subsection is the class
    missing = [n for n in expected if n != header_class
               and not re.search(rf"`[^`]*\b{re.escape(n)}\b[^`]*`", names_column)]
    assert not missing, missing


def test_package_subsection_lists_v2_list():
    subs = _subsections(_compat_v2())
    assert "`v2_list`" in subs[""]


def test_every_deviation_names_its_reason_and_a_test_that_exists():
    text = (ROOT / "docs" / "deviations.md").read_text(encoding="utf-8")
    rows = _rows(text)
    assert len(rows) >= 8
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        assert len(cells) == 5, row
        topic, upstream, ours, why, tests = cells
        assert topic and upstream and ours and why, f"deviation without its reason: {row}"
        _check_refs(row, tests)
