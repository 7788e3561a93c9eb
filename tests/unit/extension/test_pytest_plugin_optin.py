"""llmdd's pytest plugin is opt-in and its fixtures carry the ``llmdd_`` prefix (issue 24).

Each case runs a throwaway suite in its own pytest process, from a directory outside the
repository (no conftest of ours above it), in the environment llmdd is installed in.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

_SUITE = textwrap.dedent(
    """
    import pytest

    @pytest.fixture
    def pm():
        return "the framework's own pm"

    @pytest.fixture
    def hooks():
        return "the framework's own hooks"

    def test_own_fixtures_are_not_shadowed(pm, hooks):
        assert pm == "the framework's own pm" and hooks == "the framework's own hooks"

    def test_llmdd_fixtures(llmdd_pm, llmdd_hooks, llmdd_hook_recorder, llmdd_log_output):
        from llmdd._extension.manager import Hooks, LLMDDPluginManager
        from llmdd.testing import HookRecorder, LogOutput
        assert isinstance(llmdd_pm, LLMDDPluginManager) and isinstance(llmdd_hooks, Hooks)
        assert isinstance(llmdd_hook_recorder, HookRecorder)
        assert isinstance(llmdd_log_output, LogOutput)
    """
)


def _run_suite(tmp_path, *args):
    (tmp_path / "test_framework.py").write_text(_SUITE)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env.pop("PYTEST_PLUGINS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", *args, "test_framework.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_installing_llmdd_registers_no_pytest_plugin():
    groups = {ep.group for ep in importlib.metadata.distribution("llmdd").entry_points}
    assert "pytest11" not in groups
    assert "console_scripts" in groups


def test_without_opt_in_a_suite_sees_no_llmdd_fixture(tmp_path):
    rc, out = _run_suite(tmp_path)
    # The control: the llmdd_ fixtures are unknown, the suite's own pm/hooks untouched.
    assert rc == 1, out
    assert "PASSED test_framework.py::test_own_fixtures_are_not_shadowed" in out
    assert "fixture 'llmdd_pm' not found" in out
    assert "1 passed, 1 error" in out


def test_opting_in_with_p_gives_prefixed_fixtures_and_keeps_the_suites_own(tmp_path):
    rc, out = _run_suite(tmp_path, "-p", "llmdd.testing.pytest_plugin")
    assert rc == 0, out
    assert "PASSED test_framework.py::test_own_fixtures_are_not_shadowed" in out
    assert "PASSED test_framework.py::test_llmdd_fixtures" in out
    assert "2 passed" in out


def test_opting_in_through_conftest_pytest_plugins(tmp_path):
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["llmdd.testing.pytest_plugin"]\n')
    rc, out = _run_suite(tmp_path)
    assert rc == 0, out
    assert "2 passed" in out
