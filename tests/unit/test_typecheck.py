"""Type checking (issue 17, point 6): the packages already clean stay clean.

mypy, configured in pyproject.toml ([tool.mypy]), over the packages listed in ``CLEAN`` must report
no error (their imports are followed for types, their errors not reported: ``--follow-imports
silent``).  The rest of llmdd/ and plugins/ is measured by scripts/typecheck.sh until it reaches
zero and .ci/run runs that instead.  A control proves the check sees llmdd's own types (a
mis-resolved import would turn them into Any and let every error through).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("mypy", reason="mypy is in llmdd's test extra: pip install -e '.[test]'")

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: packages with no mypy error; a package joins when its last error is fixed
CLEAN = ("llmdd._control", "llmdd._lifecycle", "llmdd._api", "llmdd._tools", "llmdd._engine",
         "llmdd._seam", "llmdd._extension", "llmdd.testing", "llmdd.v2", "llmdd.compat", "llmdd.plugin",
         "llmdd._memory", "llmdd._data", "llmdd._base", "llmdd_faults", "llmdd_ucx", "llmdd_shm", "llmdd_tcp", "llmdd_vllm")


def _mypy(tmp_path: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(tmp_path / "mypy-cache"), "--follow-imports", "silent", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=110)


def test_the_clean_packages_have_no_type_error(tmp_path):
    r = _mypy(tmp_path, *(a for pkg in CLEAN for a in ("-p", pkg)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success: no issues found" in r.stdout, r.stdout


def test_control_a_type_error_against_llmdd_types_fails_the_check(tmp_path):
    bad = tmp_path / "uses_llmdd_wrongly.py"
    bad.write_text(
        "from llmdd._control.link import Link\n"
        "from llmdd._engine.core import EngineCore\n"
        "\n"
        "\n"
        "def transport_id(link: Link) -> int:\n"
        "    return link.transport\n"          # a str
        "\n"
        "\n"
        "def drop(core: EngineCore) -> None:\n"
        "    core.link_manager = None\n")      # never Optional
    r = _mypy(tmp_path, str(bad))
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{bad.name}:6: error: Incompatible return value type" in r.stdout, r.stdout
    assert f"{bad.name}:10: error: Incompatible types in assignment" in r.stdout, r.stdout
    assert "Found 2 errors in 1 file" in r.stdout, r.stdout


def test_the_package_says_it_is_typed():
    assert (ROOT / "llmdd" / "py.typed").is_file()
    assert '"py.typed"' in (ROOT / "pyproject.toml").read_text()
