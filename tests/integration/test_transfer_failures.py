"""Failures of the data path: a killed owner, a stalled owner, bad arguments, no link, no cache.

Every wait is bounded; after a failed pull the destination is refilled with a sentinel and must
stay untouched (no transport writes into the caller's memory after the call returned).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

from llmdd import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import _dataplane_peers as P  # noqa: E402

ENV = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
TRANSPORTS = ["tcp", "shm"]
PROMPT, DECODER = 1, 2
MiB = 1 << 20
#: statuses a pull may fail with when its peer dies or stops answering
PEER_FAILURES = {"LLM_LINK_FAILED", "LLM_TIMEOUT", "LLM_WAIT_PROCESS_TIMEOUT", "LLM_NOT_YET_LINK"}

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def peer_pool():
    pool = P.PeerPool(ENV)
    yield pool
    pool.close()


def _link(d, port):
    assert d.call(P.link, PROMPT, port) == ["LLM_SUCCESS", "LLM_SUCCESS"]


# ------------------------------------------------------------------------------ killed owner
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_owner_killed_mid_transfer(peer_pool, transport, tmp_path):
    sync_ms = 2000
    p, d, port = peer_pool.pair(transport, prompt_kw={"sync_ms": sync_ms}, decoder_kw={"sync_ms": sync_ms})
    try:
        nt, nb, bs = 64, 32, 16384  # 32 MiB per pull
        p.call(P.register, "src", nt, [nb, bs], blocks=True, seed=1, key=BlocksCacheKey(PROMPT, 0))
        d.call(P.register, "dst", nt, [nb, bs], blocks=True)
        _link(d, port)
        blocks = list(range(nb))
        progress = tmp_path / "first_pull_done"
        fut = d.call_async(P.pull_until_error, "pull_blocks", (BlocksCacheKey(PROMPT, 0), P.Ref("dst"),
                                                                blocks, blocks[::-1]), {}, 20.0, str(progress))
        deadline = time.monotonic() + 15.0          # one pull completed: the next ones are in flight
        while not progress.exists() and time.monotonic() < deadline and not fut.done():
            time.sleep(0.01)
        assert progress.exists(), "no pull completed before the kill"
        killed_at = time.monotonic()
        p.kill()
        result = fut.result(timeout=sync_ms / 1000 + 15)
        assert result["ok"] >= 1, "no pull completed before the kill"
        assert result["status"] in PEER_FAILURES, result
        assert result["ended"] - killed_at <= sync_ms / 1000 + 2.0, "the failed pull outlived its deadline"
        assert result["sentinel_kept"], "the destination was written after the pull had failed"
        # later pulls fail fast with a typed status
        status, took, _ = d.call(P.cm_status, "pull_blocks", BlocksCacheKey(PROMPT, 0), P.Ref("dst"), [0], [0])
        assert status in PEER_FAILURES and took < 1.0
    finally:
        peer_pool.discard()


# ------------------------------------------------------------------------------ stalled owner
@pytest.mark.parametrize("transport,what", [("tcp", "blocks"), ("tcp", "cache_key"), ("shm", "cache_key")])
def test_stalled_owner_times_out_then_relink_works(peer_pool, transport, what):
    sync_ms = 800
    kw = {"sync_ms": sync_ms, "mem_pool": 8 * MiB, "extra": {"llmdd.peer_timeout_ms": "30000"}}
    p, d, port = peer_pool.pair(transport, prompt_kw=kw, decoder_kw=kw)
    try:
        p.call(P.register, "src", 4, [16, 4096], blocks=True, seed=2, key=BlocksCacheKey(PROMPT, 0))
        keys = (CacheKey(PROMPT, 1), CacheKey(PROMPT, 2))
        p.call(P.allocate, "pc", 4, [2, 4096], seed=3, keys=keys)
        d.call(P.register, "dst", 4, [16, 4096], blocks=True)
        d.call(P.allocate, "dc", 4, [1, 4096])
        _link(d, port)
        if what == "blocks":
            args, dst = ("pull_blocks", BlocksCacheKey(PROMPT, 0), P.Ref("dst"), [1, 2], [3, 4]), "dst"
        else:
            args, dst = ("pull_cache", keys[0], P.Ref("dc"), 0), "dc"
        p.stall()
        try:
            status, took, _ = d.call(P.cm_status, *args, timeout=sync_ms / 1000 + 10)
            assert status == "LLM_TIMEOUT"
            assert sync_ms / 1000 - 0.05 <= took <= sync_ms / 1000 + 1.0
            assert d.call(P.link_state, PROMPT) == "failed"
            status, took, _ = d.call(P.cm_status, *args)
            assert status in ("LLM_TIMEOUT", "LLM_LINK_FAILED") and took < 0.2, (status, took)
            d.call(P.fill, dst, 0xA5)
        finally:
            p.resume()
        # the force unlink closes the failed link's control connection; the owner handles what it had
        # queued on that link (the timed-out request, the puller's ReleaseKey) on the link's strand before
        # the close, and its link ends only then, its data connections revoked: once the owner's link is
        # down, whatever it had queued has run (was: a 0.5 s sleep), and it must not have reached the
        # caller's memory.  The relink then meets no stale link on the owner.
        assert d.call(P.unlink, PROMPT, port, True)[0] == "LLM_SUCCESS"
        gone = (None, "failed", "closed")
        assert p.call(P.wait_link_state, DECODER, gone, 20.0, timeout=30) in gone
        assert (d.call(P.snapshot, dst) == 0xA5).all(), "a timed-out pull wrote after it returned"
        _link(d, port)
        # the owner's side is set up too before the pull (link_clusters returns on the puller's side)
        assert p.call(P.wait_link_state, DECODER, ("linked",), 20.0, timeout=30) == "linked"
        d.call(P.cm, *args)
        if what == "blocks":
            src = p.call(P.snapshot, "src").reshape(4, 16, 4096)
            assert np.array_equal(d.call(P.snapshot, "dst").reshape(4, 16, 4096)[:, [3, 4]], src[:, [1, 2]])
        else:  # the timed-out pull did not consume the key
            src = p.call(P.snapshot, "pc").reshape(4, 2, 4096)
            assert np.array_equal(d.call(P.snapshot, "dc").reshape(4, 4096), src[:, 0])
    finally:
        peer_pool.discard()


# ------------------------------------------------------------------------------ bad arguments
@pytest.fixture
def linked_blocks(peer_pool):
    p, d, port = peer_pool.pair("tcp", prompt_kw={"mem_pool": 8 * MiB}, decoder_kw={"mem_pool": 8 * MiB})
    p.call(P.register, "src", 4, [8, 1024], blocks=True, seed=4, key=BlocksCacheKey(PROMPT, 0))
    src_id = p.call(P.register, "reg", 4, [2, 2048], blocks=False, seed=5)
    p.call(P.allocate, "pc", 4, [2, 2048], seed=6, keys=(CacheKey(PROMPT, 1),))
    d.call(P.register, "dst", 4, [8, 1024], blocks=True)
    d.call(P.register, "dc", 4, [2, 2048], blocks=False)
    d.call(P.register, "dc3", 3, [2, 2048], blocks=False)
    _link(d, port)
    for name in ("dst", "dc", "dc3"):
        d.call(P.fill, name, 0xA5)
    return p, d, src_id


BK = BlocksCacheKey(PROMPT, 0)


def _bad_calls(src_id):
    ids = CacheKeyByIdAndIndex(PROMPT, src_id, 0)
    return [
        # (expected, method, args, kwargs)
        ("LLM_PARAM_INVALID", "pull_blocks", (BK, P.Ref("dst"), [8], [0]), {}),  # src block out of range
        ("LLM_PARAM_INVALID", "pull_blocks", (BK, P.Ref("dst"), [0, 1], [7, 8]), {}),  # dst block out of range
        ("LLM_PARAM_INVALID", "pull_blocks", (BK, P.Ref("dst"), [0, 1], [0]), {}),  # lengths differ
        ("LLM_PARAM_INVALID", "pull_blocks", (BK, P.Ref("dst"), [], [0]), {}),  # blocks key needs src blocks
        ("LLM_PARAM_INVALID", "pull_blocks", (BK, P.Ref("dst"), [0], []), {}),  # empty dst blocks
        ("TypeError", "pull_blocks", (BK, P.Ref("dst"), [np.int64(0)], [0]), {}),  # numpy scalar
        ("ValueError", "pull_blocks", (BK, P.Ref("dst"), [-1], [0]), {}),
        ("LLM_PARAM_INVALID", "pull_blocks", (BK, P.Ref("dst"), [0], [0]),
         {"src_layer_range": range(2, 3), "dst_layer_range": range(0, 1)}),  # 2 layers only
        ("LLM_PARAM_INVALID", "pull_blocks", (BK, P.Ref("dst"), [0], [0]),
         {"src_layer_range": range(0, 2), "dst_layer_range": range(0, 1)}),  # lengths differ
        ("LLM_PARAM_INVALID", "pull_blocks", (BK, P.Ref("dst"), [0], [0]),
         {"src_layer_range": range(0, 1), "dst_layer_range": range(0, 1), "tensor_num_per_layer": 3}),
        ("LLM_PARAM_INVALID", "pull_blocks", (BK, P.Ref("dst"), [0], [0]), {"tensor_num_per_layer": 0}),
        ("LLM_PARAM_INVALID", "pull_blocks", (ids, P.Ref("dst"), [], [0, 1, 2, 3, 4]), {}),  # > one slot
        ("LLM_PARAM_INVALID", "pull_cache", (ids, P.Ref("dst"), 0), {}),  # blocks cache as pull_cache dst
        ("LLM_PARAM_INVALID", "pull_cache", (CacheKeyByIdAndIndex(PROMPT, src_id, 2), P.Ref("dc"), 0), {}),
        ("LLM_PARAM_INVALID", "pull_cache", (ids, P.Ref("dc"), 2), {}),  # dst batch index
        ("ValueError", "pull_cache", (ids, P.Ref("dc"), -1), {}),
        ("LLM_PARAM_INVALID", "pull_cache", (ids, P.Ref("dc"), 0, 2049), {}),  # size > stride
        ("LLM_PARAM_INVALID", "pull_cache", (ids, P.Ref("dc"), 0, 0), {}),
        ("LLM_PARAM_INVALID", "pull_cache", (ids, P.Ref("dc3"), 0), {}),  # tensor counts differ
        ("LLM_PARAM_INVALID", "pull_cache", (ids, P.Ref("dc"), 0),
         {"src_layer_range": range(0, 3), "dst_layer_range": range(0, 3)}),
        ("LLM_PARAM_INVALID", "pull_cache", (ids, P.Ref("dc"), 0), {"src_layer_range": range(0, 2, 2),
                                                                     "dst_layer_range": range(0, 1)}),
        ("TypeError", "pull_cache", (ids, P.Ref("dc"), 0), {"src_layer_range": (0, 1)}),
        ("LLM_PARAM_INVALID", "pull_cache", (ids, P.Ref("dc"), 0), {"bogus": 1}),
        ("LLM_PARAM_INVALID", "pull_cache", (CacheKey(PROMPT, 1), P.Ref("dc3"), 0), {}),
    ]


def test_bad_arguments_are_refused_and_write_nothing(linked_blocks):
    p, d, src_id = linked_blocks
    got = [d.call(P.cm_status, method, *args, **kwargs)[0] for _, method, args, kwargs in _bad_calls(src_id)]
    assert got == [c[0] for c in _bad_calls(src_id)]
    for name in ("dst", "dc", "dc3"):
        assert (d.call(P.snapshot, name) == 0xA5).all(), f"a refused pull wrote into {name}"
    # a refused CacheKey pull puts the key back: the correct pull still works and consumes it
    d.call(P.cm, "pull_cache", CacheKey(PROMPT, 1), P.Ref("dc"), 1)
    src = p.call(P.snapshot, "pc").reshape(4, 2, 2048)
    assert np.array_equal(d.call(P.snapshot, "dc").reshape(4, 2, 2048)[:, 1], src[:, 0])
    assert d.call(P.cm_status, "pull_cache", CacheKey(PROMPT, 1), P.Ref("dc"), 0)[0] == "LLM_KV_CACHE_NOT_EXIST"


def test_unknown_remote_cache_and_unlinked_cluster(linked_blocks):
    p, d, src_id = linked_blocks
    assert d.call(P.cm_status, "pull_cache", CacheKeyByIdAndIndex(PROMPT, 999, 0), P.Ref("dc"), 0)[0] == \
        "LLM_KV_CACHE_NOT_EXIST"
    assert d.call(P.cm_status, "pull_blocks", BlocksCacheKey(PROMPT, 5), P.Ref("dst"), [0], [0])[0] == \
        "LLM_KV_CACHE_NOT_EXIST"
    assert d.call(P.cm_status, "pull_cache", CacheKey(PROMPT, 12345), P.Ref("dc"), 0)[0] == \
        "LLM_KV_CACHE_NOT_EXIST"
    for key in (BlocksCacheKey(77, 0), CacheKeyByIdAndIndex(77, src_id, 0), CacheKey(77, 1)):
        method, args = (("pull_blocks", (key, P.Ref("dst"), [0], [0])) if isinstance(key, BlocksCacheKey)
                        else ("pull_cache", (key, P.Ref("dc"), 0)))
        assert d.call(P.cm_status, method, *args)[0] == "LLM_NOT_YET_LINK", key
    # after a clean unlink the cluster is not linked any more
    assert d.call(P.unlink, PROMPT, None)[0] == "LLM_SUCCESS"
    assert d.call(P.cm_status, "pull_blocks", BK, P.Ref("dst"), [0], [0])[0] == "LLM_NOT_YET_LINK"
    for name in ("dst", "dc"):
        assert (d.call(P.snapshot, name) == 0xA5).all()
