"""Type checking (issue 17, point 6): llmdd/ and every plugin package have no type error.

mypy, configured in pyproject.toml ([tool.mypy]: the packages checked, the plugin source paths), over
all of them must report no error.  .ci/run runs the same check through scripts/typecheck.sh; this
test keeps it in the default suite.  A control proves the check sees llmdd's own types (a
mis-resolved import would turn them into Any and let every error through).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("mypy", reason="mypy is in llmdd's test extra: pip install -e '.[test]'")

ROOT = pathlib.Path(__file__).resolve().parents[2]

def _mypy(tmp_path: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(tmp_path / "mypy-cache"), "--follow-imports", "silent", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=110)


def test_llmdd_and_every_plugin_have_no_type_error(tmp_path):
    r = _mypy(tmp_path)   # the packages of [tool.mypy]
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


def test_the_configuration_checks_llmdd_and_every_plugin():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    plugins = sorted(p for p in (ROOT / "plugins").iterdir() if (p / "src").is_dir())
    packages = sorted(d.name for p in plugins for d in (p / "src").iterdir() if (d / "__init__.py").is_file())
    assert len(plugins) >= 6 and len(packages) == len(plugins), (plugins, packages)
    # a plugin package left out of [tool.mypy] would go unchecked
    assert sorted(config["packages"]) == sorted(["llmdd", *packages])
    assert sorted(pathlib.PurePath(p).parts[-2] for p in config["mypy_path"][1:]) == [p.name for p in plugins]


def test_the_package_says_it_is_typed():
    assert (ROOT / "llmdd" / "py.typed").is_file()
    assert '"py.typed"' in (ROOT / "pyproject.toml").read_text()
