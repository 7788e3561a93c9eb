"""Legacy v1 mode between two processes: vllm-ascend's v0 connector flows run unchanged (through the
``llm_datadist`` alias), bytes compared; deferred free; role violations; link checks; pull_blocks,
layer ranges and transfer_cache_async; bad input gets the same contract errors as cache-manager mode."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import _dataplane_peers as DP  # noqa: E402
import _v1_peers as V  # noqa: E402

from llmdd import BlocksCacheKey, CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType, LLMClusterInfo  # noqa: E402

ENV = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
PROMPT, DECODER = 1, 2
GEOMETRY = (3, 7, 2, 16, 32)  # num_layer, num_tokens, num_heads, head_size, hidden

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def cluster():
    from llmdd.testing import Cluster

    c = Cluster(env=ENV)
    handles = c.spawn("v1p", "v1d")
    yield handles
    c.close()


@pytest.fixture
def pair(cluster):
    """(prompt, decoder, port): v1 engines initialized with the v0 connector's options, not linked."""
    p, d = cluster
    port = p.call(V.v0_prepare_data_dist, "PROMPT", PROMPT)
    d.call(V.v0_prepare_data_dist, "DECODER", DECODER)
    yield p, d, port
    for h in (d, p):
        if h.is_alive():
            h.call(V.finalize)


def _linked(d, port):
    assert d.call(V.v0_link, PROMPT, port) == ["LLM_SUCCESS", "LLM_SUCCESS"]


# ---------------------------------------------------------------------------- the v0 connector flows
def test_v0_connector_flow_pulls_kv_input_and_hidden_by_cache_ids_1_to_4(pair):
    p, d, port = pair
    _linked(d, port)
    sent = p.call(V.v0_send, PROMPT, GEOMETRY, 100)
    assert [sent[m]["cache_id"] for m in (1, 2, 3, 4)] == [1, 2, 3, 4]  # what the D side hard-codes
    got = d.call(V.v0_recv, PROMPT, GEOMETRY)
    for m in (1, 2, 3, 4):
        assert got[m]["digests"] == sent[m]["digests"]
    assert len(got[1]["digests"]) == GEOMETRY[0] and len(got[3]["digests"]) == 1
    assert len(set(got[1]["digests"])) == GEOMETRY[0]  # every layer has its own random bytes
    # pulls by cache id do not consume the keys: the PROMPT still holds its 4 keyed caches
    assert p.call(V.memory_stats)["cache_keys"] == 4
    # the connector names every request with CacheKey(cluster, 0, 1..4): a second request while
    # the first's keys are bound is refused (upstream: a key bound at allocation), and leaves nothing
    again = p.call(V.v0_send, PROMPT, GEOMETRY, 101)
    assert again["error"] == "LLM_PARAM_INVALID" and "already exists" in again["message"]
    assert again["model_id"] == 1
    assert p.call(V.memory_stats)["caches"] == {"allocated": 4}
    # a second receive pulls the same cache ids again: the same bytes (control: still round 0's data)
    assert d.call(V.v0_recv, PROMPT, GEOMETRY) == {m: {"cache_id": 4 + m, "digests": got[m]["digests"]}
                                                    for m in (1, 2, 3, 4)}
    # the replaced receive buffers were garbage-collected and freed (KvCache.__del__), as upstream
    assert d.call(V.memory_stats)["caches"] == {"allocated": 4}
    assert d.call(V.v0_close) == ["LLM_SUCCESS", "LLM_SUCCESS"]


def test_simple_pipe_flow_defers_free_until_the_decoder_pulled(pair):
    p, d, port = pair
    _linked(d, port)
    shape = [1, 5, 8, 16]
    for round_, req in enumerate(["req-a", "req-b", "req-c"]):
        sent = {m: p.call(V.pipe_send_tensor, PROMPT, req, m, shape, 10 * round_ + m) for m in (1, 2, 3)}
        for m in (1, 2, 3):
            assert sent[m]["addrs_after"] == []
        # deallocated right after allocate, yet kept for the decoder by its key
        assert p.call(V.memory_stats)["caches"] == {"release_pending": 3}
        for m in (1, 2, 3):
            got = d.call(V.pipe_recv_tensor, PROMPT, req, m, shape)
            assert got == {"digest": sent[m]["digest"]}
        # the pull consumed each key before returning, which freed the deferred caches
        assert p.call(V.memory_stats)["caches"] == {}
        assert p.call(V.memory_stats)["pools"]["DEVICE"]["used_bytes"] == 0
        # the decoder keeps only this round's three buffers (the previous round's were deallocated)
        assert d.call(V.memory_stats)["caches"] == {"allocated": 3}
    # control: a key that was consumed is gone (the pipe's except-path sees LLM_KV_CACHE_NOT_EXIST)
    again = d.call(V.pipe_recv_tensor, PROMPT, "req-c", 1, shape)
    assert again == {"error": "LLMException", "status": "LLM_KV_CACHE_NOT_EXIST"}
    assert d.call(V.v0_close) == ["LLM_SUCCESS", "LLM_SUCCESS"]


def test_concurrent_pulls_by_key_from_threads_each_get_their_bytes_once(pair):
    p, d, port = pair
    _linked(d, port)
    shape = [1, 6, 4, 32]
    items = [(f"req-{i}", m) for i in range(4) for m in (1, 2, 3)]
    sent = {f"{r}/{m}": p.call(V.pipe_send_tensor, PROMPT, r, m, shape, 1000 + 10 * i + m)["digest"]
            for i, (r, m) in enumerate(items)}
    assert len(set(sent.values())) == len(items)
    assert p.call(V.memory_stats)["caches"] == {"release_pending": len(items)}
    # every key twice, interleaved, from 4 threads: each key's bytes arrive exactly once (the owner
    # reserves a key for one puller), the other pull of it finds no key
    got = d.call(V.threaded_pipe_recv, PROMPT, items + items, shape)
    by_key: dict = {}
    for name, result in got:
        by_key.setdefault(name, []).append(result)
    assert set(by_key) == set(sent)
    for name, results in by_key.items():
        assert sorted(results) == sorted([sent[name], "LLM_KV_CACHE_NOT_EXIST"]), (name, results)
    assert p.call(V.memory_stats)["caches"] == {}
    assert d.call(V.memory_stats)["caches"] == {}


def test_remove_cache_key_frees_a_deferred_cache_and_the_decoder_cannot_pull_it(pair):
    p, d, port = pair
    _linked(d, port)
    shape = [1, 3, 4, 8]
    p.call(V.pipe_send_tensor, PROMPT, "gone", 1, shape, 7)
    assert p.call(V.memory_stats)["caches"] == {"release_pending": 1}
    key = CacheKey(PROMPT, V._int32_hash("gone"), 1)
    assert p.call(V.km_call, "remove_cache_key", key) == ("ok", None)
    assert p.call(V.memory_stats)["caches"] == {}
    got = d.call(V.pipe_recv_tensor, PROMPT, "gone", 1, shape)
    assert got == {"error": "LLMException", "status": "LLM_KV_CACHE_NOT_EXIST"}


# ---------------------------------------------------------------------------- role violations across a link
def test_role_violations_between_linked_engines(pair):
    p, d, port = pair
    _linked(d, port)
    p.call(V.allocate, "pk", 2, [1, 64], keys=(CacheKey(PROMPT, 1),), seed=1)
    p.call(V.allocate, "pb", 2, [4, 64], blocks=True, blocks_key=BlocksCacheKey(PROMPT, 0), seed=2)
    d.call(V.allocate, "dk", 2, [1, 64])
    d.call(V.allocate, "db", 2, [4, 64], blocks=True)

    def refused(handle, method, *args, fn):
        out = handle.call(V.km_call, method, *args)
        assert out[:3] == ("error", "LLMException", "LLM_PARAM_INVALID"), out
        assert f"[{fn}] is not supported by LLMRole." in out[3]

    # the PROMPT cannot pull (even from the linked decoder's caches), the DECODER cannot push or remove keys
    refused(p, "pull_cache", CacheKeyByIdAndIndex(DECODER, 1), ("buf", "pk"), fn="pull_cache")
    refused(p, "pull_blocks", BlocksCacheKey(DECODER, 0), ("buf", "pb"), [0], [1], fn="pull_blocks")
    refused(p, "check_link_status", DECODER, fn="check_link_status")
    refused(d, "remove_cache_key", CacheKey(PROMPT, 1), fn="remove_cache_key")
    out = d.call(V.km_call, "allocate_cache", None)
    assert out[:2] == ("error", "TypeError")
    out = d.call(V.km_call, "allocate_cache", CacheDesc(1, [1, 8], DataType.DT_UINT8), [CacheKey(DECODER, 3)])
    assert out == ("error", "LLMException", "LLM_PARAM_INVALID", "cache_keys is not supported by DECODER")
    # only the decoder links: the prompt's link_clusters answers with a status instead of raising
    info = LLMClusterInfo()
    info.remote_cluster_id = DECODER
    info.append_remote_ip_info("127.0.0.1", port)
    assert p.call(V.km_call, "link_clusters", [info], 2000) == ("ok", ["LLM_PARAM_INVALID", []])
    # the pulls the roles allow still work after the refusals, bytes equal
    assert d.call(V.km_call, "pull_cache", CacheKey(PROMPT, 1), ("buf", "dk")) == ("ok", None)
    assert np.array_equal(d.call(V.snapshot, "dk"), p.call(V.snapshot, "pk"))
    assert d.call(V.km_call, "pull_blocks", BlocksCacheKey(PROMPT, 0), ("buf", "db"), [3, 0], [1, 2]) == ("ok", None)
    pb, db = p.call(V.snapshot, "pb").reshape(2, 4, 64), d.call(V.snapshot, "db").reshape(2, 4, 64)
    assert np.array_equal(db[:, 1], pb[:, 3]) and np.array_equal(db[:, 2], pb[:, 0])
    assert not np.array_equal(db[:, 0], pb[:, 0])  # block 0 of the decoder was not written (control)


# ---------------------------------------------------------------------------- link status
def test_check_link_status_follows_the_link(pair):
    p, d, port = pair
    out = d.call(V.km_call, "check_link_status", PROMPT)
    assert out[:3] == ("error", "LLMException", "LLM_NOT_YET_LINK")
    _linked(d, port)
    assert d.call(V.km_call, "check_link_status", PROMPT) == ("ok", None)
    out = d.call(V.km_call, "check_link_status", PROMPT + 100)
    assert out[:3] == ("error", "LLMException", "LLM_NOT_YET_LINK")
    assert d.call(V.v0_close) == ["LLM_SUCCESS", "LLM_SUCCESS"]
    out = d.call(V.km_call, "check_link_status", PROMPT)
    assert out[:3] == ("error", "LLMException", "LLM_NOT_YET_LINK")
    _linked(d, port)  # relink after unlink
    assert d.call(V.km_call, "check_link_status", PROMPT) == ("ok", None)


def test_the_prompt_may_unlink_too(pair):
    p, d, port = pair
    _linked(d, port)
    assert p.call(V.link_count) == 1
    info = LLMClusterInfo()
    info.remote_cluster_id = DECODER
    assert p.call(V.km_call, "unlink_clusters", [info], 3000, True) == ("ok", ["LLM_SUCCESS", ["LLM_SUCCESS"]])
    assert p.call(V.link_count) == 0
    # a force unlink closes the prompt's side: the decoder sees its link fail, and check_link_status says so
    assert d.call(_wait_link_not_linked, PROMPT) == "failed"
    out = d.call(V.km_call, "check_link_status", PROMPT)
    assert out[:3] == ("error", "LLMException", "LLM_LINK_FAILED"), out


def test_check_link_status_after_the_prompt_went_away():
    from llmdd.testing import Cluster

    with Cluster(env=ENV) as c:
        p, d = c.spawn("v1p-gone", "v1d-gone")
        port = p.call(V.v0_prepare_data_dist, "PROMPT", PROMPT)
        d.call(V.v0_prepare_data_dist, "DECODER", DECODER, sync_ms=1000)
        _linked(d, port)
        assert d.call(V.km_call, "check_link_status", PROMPT) == ("ok", None)
        p.kill()
        # the control connection closes with the process: the link fails, and the check says so
        state = d.call(_wait_link_not_linked, PROMPT)
        assert state == "failed"
        out = d.call(V.km_call, "check_link_status", PROMPT)
        assert out[:2] == ("error", "LLMException") and out[2] == "LLM_LINK_FAILED", out
        d.call(V.finalize)


def _wait_link_not_linked(state: dict, remote: int, timeout: float = 10.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entry = state["dd"].statistics()["links"].get(remote)
        if entry is None or entry["state"] != "linked":
            return None if entry is None else entry["state"]
        time.sleep(0.01)
    return "linked"


# ---------------------------------------------------------------------------- switch_role
def test_switch_role_swaps_prompt_and_decoder_and_data_flows_the_other_way(cluster):
    p, d = cluster
    switch = {"llm.EnableSwitchRole": "1"}
    port = p.call(V.v0_prepare_data_dist, "PROMPT", PROMPT, extra=switch)
    d.call(V.v0_prepare_data_dist, "DECODER", DECODER, extra=switch)
    _linked(d, port)
    # links first: refused on both sides
    out, _ = p.call(V.switch_role, "DECODER")
    assert out[:3] == ("error", "LLMException", "LLM_EXIST_LINK")
    # the same role again, and PROMPT without a listen address, are parameter errors
    out, _ = p.call(V.switch_role, "PROMPT", "127.0.0.1:0")
    assert out[:3] == ("error", "LLMException", "LLM_PARAM_INVALID") and "role not changed" in out[3]
    assert d.call(V.v0_close) == ["LLM_SUCCESS", "LLM_SUCCESS"]
    assert p.call(V.wait_link_count, 0) == 0  # the server side goes when the client's unlink reaches it
    out, _ = d.call(V.switch_role, "PROMPT")
    assert out[:3] == ("error", "LLMException", "LLM_PARAM_INVALID") and "llm.listenIpInfo" in out[3]
    # swap: the old prompt stops listening, the old decoder listens
    out, old_port = p.call(V.switch_role, "DECODER")
    assert out == ("ok", None) and old_port is None
    out, new_port = d.call(V.switch_role, "PROMPT", "127.0.0.1:0")
    assert out == ("ok", None) and new_port
    # the roles' rules follow the switch: the new prompt keys caches, the new decoder pulls them
    sent = d.call(V.pipe_send_tensor, DECODER, "swapped", 1, [1, 4, 4, 8], 77)
    assert p.call(V.v0_link, DECODER, new_port) == ["LLM_SUCCESS", "LLM_SUCCESS"]
    assert p.call(V.pipe_recv_tensor, DECODER, "swapped", 1, [1, 4, 4, 8]) == {"digest": sent["digest"]}
    assert d.call(V.memory_stats)["caches"] == {}  # deferred free on the new prompt after the pull
    assert p.call(V.v0_close) == ["LLM_SUCCESS", "LLM_SUCCESS"]


def test_switch_role_needs_enable_switch_role(pair):
    p, d, port = pair
    out, still = p.call(V.switch_role, "DECODER")
    assert out[:3] == ("error", "LLMException", "LLM_FEATURE_NOT_ENABLED")
    assert still == port  # nothing changed: still listening


# ---------------------------------------------------------------------------- layer ranges, async transfer
def test_layer_range_pull_writes_only_the_named_layers(pair):
    p, d, port = pair
    _linked(d, port)
    p.call(V.allocate, "src", 6, [2, 128], keys=(CacheKey(PROMPT, 5), CacheKey(PROMPT, 6)), seed=21)
    d.call(V.allocate, "dst", 6, [1, 128], seed=22)
    before = d.call(V.snapshot, "dst")
    out = d.call(V.km_call, "pull_cache", CacheKey(PROMPT, 6), ("buf", "dst"), 0,
                 src_layer_range=range(1, 3), dst_layer_range=range(0, 2))
    assert out == ("ok", None)
    src, dst = p.call(V.snapshot, "src").reshape(6, 2, 128), d.call(V.snapshot, "dst")
    assert np.array_equal(dst[0:4], src[2:6, 1])  # layers 1..2 of slot 1 -> layers 0..1
    assert np.array_equal(dst[4:6], before[4:6])  # layer 2 untouched (control)


def test_transfer_cache_async_pushes_every_layer_to_the_decoders_addresses(pair):
    p, d, port = pair
    p.call(V.allocate, "src", 4, [1, 256], seed=31)
    # allocated before linking: the handshake hands the decoder's memory table to the prompt
    info = d.call(V.allocate, "dst", 4, [1, 256], seed=32)
    _linked(d, port)
    # the prompt pushes over the link the decoder made, to raw addresses (TransferConfig)
    out = p.call(V.transfer_async, "src", DECODER, info["addrs"])
    assert out == {"status": "LLM_SUCCESS", "results": ["LLM_SUCCESS"], "layers": [0, 1], "range": [0, 2]}
    assert np.array_equal(d.call(V.snapshot, "dst"), p.call(V.snapshot, "src"))


def test_v1_cache_task_reports_wait_process_timeout_until_done(pair):
    p, d, port = pair
    p.call(V.allocate, "src", 4, [2, 128], seed=51)
    dst = d.call(V.allocate, "dst", 4, [3, 128], seed=52)
    info = d.call(V.allocate, "raw", 4, [1, 128], seed=53)
    _linked(d, port)
    # two TransferConfigs (upstream's v1 takes no other kind): slot 2 of the decoder's "dst", and "raw"
    slot2 = [a + 2 * 128 for a in dst["addrs"]]
    p.call(V.start_gated_transfer, "src", [("addrs", DECODER, slot2), ("addrs", DECODER, info["addrs"])])
    # the layers are held: v1's code for an unfinished task (v2 answers LLM_TIMEOUT)
    assert p.call(V.gated_status, 50) == {"sync": "LLM_WAIT_PROCESS_TIMEOUT",
                                          "results": ["LLM_WAIT_PROCESS_TIMEOUT"] * 2}
    before = d.call(V.snapshot, "dst").reshape(4, 3, 128)
    p.call(V.open_gate)
    assert p.call(V.gated_status, 10000) == {"sync": "LLM_SUCCESS", "results": ["LLM_SUCCESS"] * 2}
    src = p.call(V.snapshot, "src").reshape(4, 2, 128)
    got = d.call(V.snapshot, "dst").reshape(4, 3, 128)
    assert np.array_equal(got[:, 2], src[:, 0])  # src batch 0 -> dst slot 2's addresses
    assert np.array_equal(got[:, :2], before[:, :2])  # the other slots untouched (control)
    assert np.array_equal(d.call(V.snapshot, "raw").reshape(4, 128), src[:, 0])


def test_pull_cache_with_offsets_moves_exactly_the_named_byte_range(pair):
    p, d, port = pair
    _linked(d, port)
    p.call(V.allocate, "src", 4, [2, 256], keys=(CacheKey(PROMPT, 1), CacheKey(PROMPT, 2)), seed=41)
    d.call(V.allocate, "dst", 4, [2, 256], seed=42)
    src = p.call(V.snapshot, "src").reshape(4, 2, 256)
    want = d.call(V.snapshot, "dst").reshape(4, 2, 256)
    # by id: slot 1 bytes [32, 132) -> slot 1 bytes [64, 164), every tensor
    out = d.call(V.km_call, "pull_cache", CacheKeyByIdAndIndex(PROMPT, 1, 1), ("buf", "dst"), 1, 100,
                 src_cache_offset=32, dst_cache_offset=64)
    assert out == ("ok", None)
    want[:, 1, 64:164] = src[:, 1, 32:132]
    assert np.array_equal(d.call(V.snapshot, "dst").reshape(4, 2, 256), want)
    # by key, size -1 (the rest of the dst slot), layer by layer: the key stays on the prompt until
    # every layer was pulled (the engine's layer-wise rule), then it is consumed
    out = d.call(V.km_call, "pull_cache", CacheKey(PROMPT, 1), ("buf", "dst"), 0,
                 src_cache_offset=16, dst_cache_offset=200, src_layer_range=range(1, 2), dst_layer_range=range(0, 1))
    assert out == ("ok", None)
    want[0:2, 0, 200:256] = src[2:4, 0, 16:72]
    assert np.array_equal(d.call(V.snapshot, "dst").reshape(4, 2, 256), want)
    assert p.call(V.memory_stats)["cache_keys"] == 2
    out = d.call(V.km_call, "pull_cache", CacheKey(PROMPT, 1), ("buf", "dst"), 0,
                 src_cache_offset=16, dst_cache_offset=200, src_layer_range=range(0, 1), dst_layer_range=range(1, 2))
    assert out == ("ok", None)
    want[2:4, 0, 200:256] = src[0:2, 0, 16:72]
    assert np.array_equal(d.call(V.snapshot, "dst").reshape(4, 2, 256), want)
    assert p.call(V.memory_stats)["cache_keys"] == 1
    # only one of the two offsets given: the other is 0
    out = d.call(V.km_call, "pull_cache", CacheKeyByIdAndIndex(PROMPT, 1, 0), ("buf", "dst"), 1, 8,
                 dst_cache_offset=8)
    assert out == ("ok", None)
    want[:, 1, 8:16] = src[:, 0, 0:8]
    assert np.array_equal(d.call(V.snapshot, "dst").reshape(4, 2, 256), want)
    # both offsets 0 (the pull itself, no staging): the first 50 bytes of slot 0 into slot 1
    out = d.call(V.km_call, "pull_cache", CacheKeyByIdAndIndex(PROMPT, 1, 0), ("buf", "dst"), 1, 50,
                 src_cache_offset=0, dst_cache_offset=0)
    assert out == ("ok", None)
    want[:, 1, 0:50] = src[:, 0, 0:50]
    assert np.array_equal(d.call(V.snapshot, "dst").reshape(4, 2, 256), want)
    # out of a slot on either side: refused, nothing moved, the staging memory given back
    for kwargs, size in [({"src_cache_offset": 200}, -1), ({"dst_cache_offset": 250}, 10),
                         ({"dst_cache_offset": 256}, -1), ({"src_cache_offset": 250}, 10),
                         ({"src_cache_offset": 0, "dst_cache_offset": 0}, 257)]:
        out = d.call(V.km_call, "pull_cache", CacheKeyByIdAndIndex(PROMPT, 1, 0), ("buf", "dst"), 0, size, **kwargs)
        assert out[:3] == ("error", "LLMException", "LLM_PARAM_INVALID"), (kwargs, out)
    assert np.array_equal(d.call(V.snapshot, "dst").reshape(4, 2, 256), want)
    assert d.call(V.memory_stats)["caches"] == {"allocated": 1}


# ---------------------------------------------------------------------------- the same errors as v2
def _v1_pair(p, d):
    port = p.call(V.v0_prepare_data_dist, "PROMPT", PROMPT)
    d.call(V.v0_prepare_data_dist, "DECODER", DECODER)
    _linked(d, port)
    p.call(V.allocate, "src", 2, [2, 64], keys=(CacheKey(PROMPT, 1),), seed=1)
    p.call(V.allocate, "srcb", 2, [4, 64], blocks=True, blocks_key=BlocksCacheKey(PROMPT, 0), seed=2)
    d.call(V.allocate, "dst", 2, [1, 64])
    d.call(V.allocate, "dstb", 2, [4, 64], blocks=True)


def _v2_pair(p, d):
    MiB = 1 << 20
    port = p.call(DP.setup, "PROMPT", PROMPT, listen=True, mem_pool=4 * MiB)
    d.call(DP.setup, "DECODER", DECODER, mem_pool=4 * MiB)
    assert d.call(DP.link, PROMPT, port) == ["LLM_SUCCESS", "LLM_SUCCESS"]
    p.call(DP.allocate, "src", 2, [2, 64], seed=1, key=CacheKey(PROMPT, 1))
    p.call(DP.allocate, "srcb", 2, [4, 64], seed=2, blocks=True, key=BlocksCacheKey(PROMPT, 0))
    d.call(DP.allocate, "dst", 2, [1, 64])
    d.call(DP.allocate, "dstb", 2, [4, 64], blocks=True)


#: (method, args, kwargs): bad pulls both modes define with the same signature
BAD_PULLS = [
    ("pull_cache", (CacheKey(PROMPT, 77), "dst"), {}),                        # unknown key
    ("pull_cache", (CacheKeyByIdAndIndex(PROMPT, 99), "dst"), {}),            # unknown cache id
    ("pull_cache", (CacheKeyByIdAndIndex(PROMPT, 1, 2), "dst"), {}),          # remote batch index out of range
    ("pull_cache", (CacheKeyByIdAndIndex(PROMPT, 1, 0), "dst", 1), {}),       # local batch index out of range
    ("pull_cache", (CacheKeyByIdAndIndex(PROMPT, 1, 0), "dst", 0, 65), {}),   # size beyond a slot
    ("pull_cache", (CacheKeyByIdAndIndex(PROMPT, 1, 0), "dst", 0, 0), {}),    # size 0
    ("pull_cache", (CacheKeyByIdAndIndex(PROMPT, 1, 0), "dst", -1), {}),      # batch index not uint32
    ("pull_cache", (CacheKeyByIdAndIndex(PROMPT + 5, 1, 0), "dst"), {}),      # cluster not linked
    ("pull_cache", (CacheKeyByIdAndIndex(PROMPT, 1, 0), "dst"), {"src_layer_range": range(0, 2)}),  # 1 layer only
    ("pull_cache", (CacheKeyByIdAndIndex(PROMPT, 1, 0), "dst"), {"tensor_num_per_layer": 0}),
    ("pull_cache", (CacheKey(PROMPT, req_id=2**64 - 1), "dst"), {}),          # neither req nor prefix id
    ("pull_blocks", (BlocksCacheKey(PROMPT, 0), "dstb", [4], [0]), {}),       # remote block out of range
    ("pull_blocks", (BlocksCacheKey(PROMPT, 0), "dstb", [0], [4]), {}),       # local block out of range
    ("pull_blocks", (BlocksCacheKey(PROMPT, 0), "dstb", [0, 1], [0]), {}),    # lengths differ
    ("pull_blocks", (BlocksCacheKey(PROMPT, 3), "dstb", [0], [0]), {}),       # unknown model id
    ("pull_blocks", (BlocksCacheKey(PROMPT, 0), "dstb", [-1], [0]), {}),      # not uint64
]


def _v1_outcome(d, method, args, kwargs):
    """The status name of an LLMException, else the exception type name (as the v2 helper reports)."""
    args = tuple(("buf", a) if isinstance(a, str) else a for a in args)
    out = d.call(V.km_call, method, *args, **kwargs)
    assert out[0] == "error", (method, args, out)
    return out[2] if out[1] == "LLMException" else out[1]


def _v2_outcome(d, method, args, kwargs):
    args = tuple(DP.Ref(a) if isinstance(a, str) else a for a in args)
    return d.call(DP.cm_status, method, *args, **kwargs)[0]


def test_bad_input_gets_the_same_contract_errors_as_cache_manager_mode(cluster):
    p, d = cluster
    _v2_pair(p, d)
    v2 = [_v2_outcome(d, m, a, k) for m, a, k in BAD_PULLS]
    d.call(DP.finalize)
    p.call(DP.finalize)
    _v1_pair(p, d)
    v1 = [_v1_outcome(d, m, a, k) for m, a, k in BAD_PULLS]
    assert "LLM_SUCCESS" not in v2
    assert v1 == v2, [(c[0], c[1], a, b) for c, a, b in zip(BAD_PULLS, v1, v2) if a != b]
    # the pulls that were refused moved nothing: the decoder's caches are still all zero
    assert not d.call(V.snapshot, "dst").any() and not d.call(V.snapshot, "dstb").any()
    # control: a good pull in the same engines works
    assert d.call(V.km_call, "pull_cache", CacheKeyByIdAndIndex(PROMPT, 1, 1), ("buf", "dst")) == ("ok", None)
    assert np.array_equal(d.call(V.snapshot, "dst")[:, :64], p.call(V.snapshot, "src")[:, 64:])
