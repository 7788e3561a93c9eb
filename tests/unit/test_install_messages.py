"""The install scripts say what each long step installs and what to expect, then how long it took
(scripts/_venv.sh's ``llmdd_step``, used by demo.sh, test.sh, test_cpp.sh and test_vllm.sh)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bash(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"set -euo pipefail; . scripts/_venv.sh; {script}"], cwd=ROOT,
                          capture_output=True, text=True)


def test_a_step_says_what_it_installs_before_and_its_time_after():
    out = _bash('llmdd_step "installing X: about 5 MB, a few seconds" printf "the command ran\\n"')
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "llmdd: installing X: about 5 MB, a few seconds ..."
    assert lines[1] == "the command ran"
    assert re.fullmatch(r"llmdd:   done in \d+ s", lines[2]), lines


def test_a_failed_step_fails_without_saying_done_even_where_errexit_is_off():
    out = _bash('llmdd_step "installing Y" false || echo "fallback with $?"')   # test.sh's torch fallback
    assert out.stdout.splitlines() == ["llmdd: installing Y ...", "fallback with 1"], out.stdout
    out = _bash('llmdd_step "installing Z" false; echo "not reached"')            # errexit: the script stops
    assert out.returncode == 1 and "not reached" not in out.stdout and "done in" not in out.stdout, out.stdout


@pytest.mark.parametrize("script", ["scripts/_venv.sh", "scripts/test.sh", "scripts/test_cpp.sh",
                                    "scripts/test_vllm.sh"])
def test_every_long_install_goes_through_a_step_that_names_its_size_and_time(script):
    text = open(os.path.join(ROOT, script)).read()
    installs = [ln for ln in text.splitlines() if "pip install" in ln and "--upgrade pip" not in ln
                and not ln.lstrip().startswith("#")]
    assert installs, script
    steps = re.findall(r'llmdd_step "([^"]*)"', text)
    assert steps, script
    sizes = re.findall(r'size="([^"]*)"', text)     # _venv.sh: the size depends on the extras
    assert all(re.search(r"\d+ MB", size) for size in sizes), sizes
    for what in steps:
        if "upgrading pip" in what:
            continue
        assert re.search(r"\d+(\.\d+)? (MB|GB)", what) or ("$size" in what and sizes), what   # a size
        assert re.search(r"\d+ ?s\b|minute|seconds", what), what                  # a time
