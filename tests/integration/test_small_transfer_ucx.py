"""The small-transfer path of pull_blocks / push_blocks over ucx (issue 21) across two processes.

Two llmdd engines linked over the ucx transport: a small blocking ``pull_blocks`` / ``push_blocks``
(a ``BlocksCacheKey``, no tag, a few int blocks) is one call of the ucx channel's one-call path
(``UcxChannel.prepare``): its ``quick_batches`` counter grows by one per call and the bytes land
(compared on the other side); the same call with a tag takes the ops path (the control).  A failure
of a request the one-call path posted gets the contract's status: the owner killed is
``LLM_LINK_FAILED``, as on the ops path.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from llmdd import BlocksCacheKey

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import _dataplane_peers as P  # noqa: E402
import _small_peers as S  # noqa: E402

try:
    from llmdd_ucx import UcxTransport
    _INFO = UcxTransport.probe()
    _WHY = _INFO.reason
    _OK = _INFO.available
except ImportError as exc:  # pragma: no cover - the plugin is not installed
    _OK, _WHY = False, str(exc)

ENV = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
PROMPT, DECODER = 1, 2
KW = {"remote_accessible": True}

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(not _OK, reason=f"ucx transport unavailable: {_WHY}")]


@pytest.fixture(scope="module")
def peer_pool():
    pool = P.PeerPool(ENV)
    yield pool
    pool.close()


def ucx_channel(state: dict, remote: int) -> dict:
    """(child) The transport of the link to ``remote`` and its channel's statistics; the channel is
    kept in ``state`` so that its counters stay readable after the link went down."""
    link = state["dd"].cache_manager._transfers._lm.get(remote)
    if link is not None and link.channel is not None:
        state["ucx_channel"] = link.channel
    ch = state["ucx_channel"]
    return {"transport": type(ch).__module__.split(".")[0], "stats": dict(ch.statistics())}


def _linked_pair(peer_pool, nl: int, nb: int, bs: int, seed_p: int, seed_d: int) -> tuple:
    p, d, port = peer_pool.pair("ucx", prompt_kw=KW, decoder_kw=KW)
    p.call(P.register, "kv", nl, [nb, bs], blocks=True, seed=seed_p, key=BlocksCacheKey(PROMPT, 0))
    d.call(P.register, "kv", nl, [nb, bs], blocks=True, seed=seed_d, key=BlocksCacheKey(DECODER, 0))
    assert d.call(P.link, PROMPT, port) == ["LLM_SUCCESS", "LLM_SUCCESS"]
    first = d.call(ucx_channel, PROMPT)
    assert first["transport"] == "llmdd_ucx", first
    return p, d, first["stats"]


def test_small_pulls_and_pushes_over_ucx_take_the_one_call_path(peer_pool):
    nl, nb, bs = 2, 16, 8192
    p, d, s0 = _linked_pair(peer_pool, nl, nb, bs, 301, 302)
    src0 = p.call(P.snapshot, "kv").reshape(nl, nb, bs)
    dst0 = d.call(P.snapshot, "kv").reshape(nl, nb, bs)
    rng = np.random.default_rng(9)
    pulls = [(int(s), int(t)) for s, t in zip(rng.integers(0, nb, 10), rng.permutation(nb)[:10])]
    for s, t in pulls:   # the control: the destination does not hold the source yet
        assert not np.array_equal(dst0[:, t], src0[:, s])
    assert d.call(S.pull_many, PROMPT, 0, "kv", pulls, nl) == len(pulls)
    s1 = d.call(ucx_channel, PROMPT)["stats"]
    assert s1["quick_batches"] - s0["quick_batches"] == len(pulls)
    assert s1["bytes_read"] - s0["bytes_read"] == len(pulls) * nl * bs
    dst1 = d.call(P.snapshot, "kv").reshape(nl, nb, bs)
    for s, t in pulls:
        assert np.array_equal(dst1[:, t], src0[:, s])
    untouched = sorted(set(range(nb)) - {t for _, t in pulls})
    assert np.array_equal(dst1[:, untouched], dst0[:, untouched])

    # a tagged call takes the ops path (the control): the one-call counter stays
    key = BlocksCacheKey(PROMPT, 0)
    kw = {"src_layer_range": range(0, nl), "dst_layer_range": range(0, nl), "tensor_num_per_layer": 1}
    assert d.call(S.outcome, "pull_blocks", key, "@kv", [1], [2], tag=b"full", **kw) == "LLM_SUCCESS"
    s2 = d.call(ucx_channel, PROMPT)["stats"]
    assert s2["quick_batches"] == s1["quick_batches"] and s2["bytes_read"] - s1["bytes_read"] == nl * bs

    # pushes: the prompt's blocks receive the decoder's (its blocks now partly pulled ones)
    pushes = [(int(s), int(t)) for s, t in zip(rng.integers(0, nb, 8), rng.permutation(nb)[:8])]
    src_d = d.call(P.snapshot, "kv").reshape(nl, nb, bs)
    assert d.call(S.push_many, PROMPT, 0, "kv", pushes, nl) == len(pushes)
    s3 = d.call(ucx_channel, PROMPT)["stats"]
    assert s3["quick_batches"] - s2["quick_batches"] == len(pushes)
    assert s3["bytes_written"] - s2["bytes_written"] == len(pushes) * nl * bs
    dst_p = p.call(P.snapshot, "kv").reshape(nl, nb, bs)
    for s, t in pushes:
        assert np.array_equal(dst_p[:, t], src_d[:, s])
    untouched = sorted(set(range(nb)) - {t for _, t in pushes})
    assert np.array_equal(dst_p[:, untouched], src0[:, untouched])


def test_a_multi_block_pull_is_one_call_with_runs_merged(peer_pool):
    nl, nb, bs = 3, 32, 4096
    p, d, s0 = _linked_pair(peer_pool, nl, nb, bs, 311, 312)
    src, dst = [4, 5, 6, 7, 20, 1], [10, 11, 12, 13, 0, 30]   # three runs
    key = BlocksCacheKey(PROMPT, 0)
    kw = {"src_layer_range": range(0, nl), "dst_layer_range": range(0, nl), "tensor_num_per_layer": 1}
    assert d.call(S.outcome, "pull_blocks", key, "@kv", src, dst, **kw) == "LLM_SUCCESS"
    s1 = d.call(ucx_channel, PROMPT)["stats"]
    assert s1["quick_batches"] - s0["quick_batches"] == 1 and s1["requests"] - s0["requests"] == 1
    assert s1["ops_read"] - s0["ops_read"] == 3 * nl
    srcp = p.call(P.snapshot, "kv").reshape(nl, nb, bs)
    got = d.call(P.snapshot, "kv").reshape(nl, nb, bs)
    assert np.array_equal(got[:, dst], srcp[:, src])


def pull_in_thread(state: dict, remote: int, src: list, dst: list, layers: int, limit_s: float) -> bool:
    """(child) Start a ``pull_blocks`` of ``src`` -> ``dst`` in a thread (outcome kept in ``state``) and
    return once its request is posted (the channel's request counter grew): True, or False when the
    call ended first or nothing was posted within ``limit_s``."""
    import threading
    import time

    ch = state["ucx_channel"]
    posted = ch.statistics()["requests"]
    kw = {"src_layer_range": range(layers), "dst_layer_range": range(layers), "tensor_num_per_layer": 1}
    args = (BlocksCacheKey(remote, 0), state["caches"]["kv"], src, dst)

    def run() -> None:
        state["pull_outcome"] = S.outcome(state, "pull_blocks", *args, **kw)

    t = threading.Thread(target=run, daemon=True)
    state["pull_thread"] = t
    t.start()
    end = time.monotonic() + limit_s
    while ch.statistics()["requests"] == posted and t.is_alive() and time.monotonic() < end:
        time.sleep(0.001)
    return ch.statistics()["requests"] > posted and t.is_alive()


def pull_outcome(state: dict, limit_s: float) -> str:
    """(child) The outcome of the pull :func:`pull_in_thread` started, once it ended (``limit_s``)."""
    state["pull_thread"].join(limit_s)
    return state.get("pull_outcome", "still running")


def test_a_killed_owner_fails_a_small_pull_in_flight_with_link_failed(peer_pool):
    """UCX over tcp (the owner's worker must progress to serve a read): the owner is stopped, a small
    pull posts its one-call request, the owner is killed: the call gets LLM_LINK_FAILED, reported
    by the one-call path (its batch counted failed, no ops-path batch)."""
    nl, nb, bs = 1, 16, 8192
    tcp = {"extra": {"llmdd.ucx.tls": "tcp", "llmdd.ucx.drain_timeout": 20.0}}
    p, d, port = peer_pool.pair("ucx", prompt_kw={**KW, **tcp}, decoder_kw={**KW, **tcp})
    try:
        p.call(P.register, "kv", nl, [nb, bs], blocks=True, seed=321, key=BlocksCacheKey(PROMPT, 0))
        d.call(P.register, "kv", nl, [nb, bs], blocks=True, seed=322, key=BlocksCacheKey(DECODER, 0))
        assert d.call(P.link, PROMPT, port) == ["LLM_SUCCESS", "LLM_SUCCESS"]
        s0 = d.call(ucx_channel, PROMPT)["stats"]
        assert d.call(S.pull_many, PROMPT, 0, "kv", [(1, 2)], nl) == 1   # the control: it moves while the owner runs
        s1 = d.call(ucx_channel, PROMPT)["stats"]
        assert s1["quick_batches"] - s0["quick_batches"] == 1 and s1["failed"] == s0["failed"]
        p.stall()
        assert d.call(pull_in_thread, PROMPT, [3], [4], nl, 20.0), "the pull did not post a request in time"
        p.kill()
        assert d.call(pull_outcome, 60.0, timeout=90.0) == "LLM_LINK_FAILED"
        s2 = d.call(ucx_channel, PROMPT)["stats"]
        assert s2["quick_batches"] - s1["quick_batches"] == 1 and s2["failed"] - s1["failed"] == 1, s2
        assert s2["batches"] - s1["batches"] == 1, s2
    finally:
        peer_pool.discard()
