"""``llmdd demo`` end to end: real prompt and decoder processes, checked against a reference.

Each test runs ``python -m llmdd demo --quick ...`` in a subprocess (as a user would) and
reads its report.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from llmdd._tools.demo.report import MISMATCH_LINE, VERIFIED_LINE

#: each test's bound (pytest-timeout), no shorter deadline on the CPU-bound demo subprocess (issue 41)
pytestmark = pytest.mark.timeout(120)


def _demo(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.pop("LLMDD_DEMO_CORRUPT_KV", None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "llmdd", "demo", "--quick", *args], capture_output=True,
                          text=True, env=full_env)


def _explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-4000:]}"


def test_quick_pull_matches_reference_bit_for_bit():
    proc = _demo()
    assert proc.returncode == 0, _explain(proc)
    out = proc.stdout
    assert VERIFIED_LINE in out
    assert re.search(r"check decoder 1: KV 16\.0 MiB bit-identical; tokens identical \(8/8\)", out), out
    # the report names the transport and why, the bytes and bandwidth, and the hook's events
    assert re.search(r"transport (shm|tcp): \S", out), out
    assert re.search(r"moved 16\.0 MiB \(16777216 B\) in .* -> [0-9.]+ GB/s", out), out
    assert re.search(r"= prefill .* \+ transfer \(pull_blocks\) .* \+ first decode step", out), out
    assert "link events in order:" in out and "(handshake_succeeded)" in out
    assert re.search(r"decoder 1: .*task\.transfer_succeeded x1", out), out


def test_one_flipped_byte_of_pulled_kv_is_reported_and_fails():
    proc = _demo(env={"LLMDD_DEMO_CORRUPT_KV": "1"})
    assert proc.returncode != 0, _explain(proc)
    out = proc.stdout
    assert MISMATCH_LINE in out and VERIFIED_LINE not in out, _explain(proc)
    assert "self-test: flipped byte 3 of layer 0 K, token 128" in out
    assert re.search(r"check decoder 1: KV differs in 1 byte\(s\), first at layer 0 K, token 128, head 0, "
                     r"dim 0, byte 3", out), out


def test_push_mode_layer_by_layer_matches_reference():
    proc = _demo("--mode", "push")
    assert proc.returncode == 0, _explain(proc)
    out = proc.stdout
    assert VERIFIED_LINE in out
    assert "pushed layer by layer with transfer_cache_async" in out and "task LLM_SUCCESS" in out
    assert re.search(r"prompt: .*task\.layer_transferred x8", out), out


def test_killed_prompt_mid_transfer_is_reported_then_recovered():
    proc = _demo("--faults", "kill")
    assert proc.returncode == 0, _explain(proc)
    out = proc.stdout
    assert re.search(r"fault: SIGKILL to the prompt .* after layers 0\.\.3 were pulled", out), out
    assert re.search(r"decoder 1: pull_blocks\(layers 4\.\.7\) raised LLMException "
                     r"status_code=LLM_(LINK_FAILED|NOT_YET_LINK|TIMEOUT)", out), out
    assert "unlink_clusters(force=True)" in out and "recovered: yes" in out
    assert out.rstrip().endswith(VERIFIED_LINE), out
