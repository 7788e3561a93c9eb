"""The small-transfer path over tcp (issue 21) through the public API, between two engine processes.

A blocking ``pull_blocks`` / ``push_blocks`` with a ``BlocksCacheKey``, no tag and a few int blocks takes
the tcp channel's one-call path (``TcpChannel.prepare``): its ``quick_batches`` counter grows by one per
call and the bytes land (seeded random, compared on the other side); the same call with a tag takes the
full path (the control: the counter stays); a failure of a transfer the one-call path started gives the
contract's status code.
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

ENV = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
PROMPT, DECODER = 1, 2
KW = {"remote_accessible": True}
#: what a transfer to a dead owner may end with (as tests/integration/test_transfer_failures.py)
PEER_FAILURES = {"LLM_LINK_FAILED", "LLM_TIMEOUT", "LLM_WAIT_PROCESS_TIMEOUT", "LLM_NOT_YET_LINK"}

pytestmark = pytest.mark.timeout(90)


def tcp_channel(state: dict, remote: int) -> dict:
    """(child side) The statistics of this engine's tcp channel to ``remote``."""
    link = state["dd"].cache_manager._transfers._lm.get(remote)
    return dict(link.channel.statistics())


@pytest.fixture(scope="module")
def peer_pool():
    pool = P.PeerPool(ENV)
    yield pool
    pool.close()


def _linked_pair(peer_pool):
    p, d, port = peer_pool.pair("tcp", prompt_kw=KW, decoder_kw=KW)
    assert d.call(P.link, PROMPT, port) == ["LLM_SUCCESS", "LLM_SUCCESS"]
    return p, d, port


def test_small_pulls_and_pushes_over_tcp_take_the_one_call_path(peer_pool):
    p, d, _ = _linked_pair(peer_pool)
    nl, nb, bs = 2, 16, 8192
    p.call(P.register, "src", nl, [nb, bs], blocks=True, seed=301, key=BlocksCacheKey(PROMPT, 0))
    p.call(P.register, "sink", nl, [nb, bs], blocks=True, key=BlocksCacheKey(PROMPT, 1))
    d.call(P.register, "dst", nl, [nb, bs], blocks=True)
    d.call(P.register, "out", nl, [nb, bs], blocks=True, seed=302)
    first = d.call(tcp_channel, PROMPT)
    rng = np.random.default_rng(11)
    pairs = [(int(s), int(t)) for s, t in zip(rng.integers(0, nb, 10), rng.permutation(nb)[:10])]
    assert d.call(S.pull_many, PROMPT, 0, "dst", pairs, nl) == len(pairs)
    mid = d.call(tcp_channel, PROMPT)
    assert mid["quick_batches"] - first["quick_batches"] == len(pairs)
    assert mid["bytes_read"] - first["bytes_read"] == len(pairs) * nl * bs
    src = p.call(P.snapshot, "src").reshape(nl, nb, bs)
    dst = d.call(P.snapshot, "dst").reshape(nl, nb, bs)
    for s, t in pairs:
        assert np.array_equal(dst[:, t], src[:, s])
    assert not dst[:, sorted(set(range(nb)) - {t for _, t in pairs})].any()
    # several blocks in one call (runs merged), then pushes
    key = BlocksCacheKey(PROMPT, 0)
    kw = {"src_layer_range": range(0, nl), "dst_layer_range": range(0, nl), "tensor_num_per_layer": 1}
    assert d.call(S.outcome, "pull_blocks", key, "@dst", [2, 3, 4, 9], [12, 13, 14, 0], **kw) == "LLM_SUCCESS"
    dst = d.call(P.snapshot, "dst").reshape(nl, nb, bs)
    assert np.array_equal(dst[:, [12, 13, 14, 0]], src[:, [2, 3, 4, 9]])
    pushes = [(3, 5), (4, 6), (0, 15)]
    assert d.call(S.push_many, PROMPT, 1, "out", pushes, nl) == len(pushes)
    after = d.call(tcp_channel, PROMPT)
    assert after["quick_batches"] - mid["quick_batches"] == 1 + len(pushes)
    out = d.call(P.snapshot, "out").reshape(nl, nb, bs)
    sink = p.call(P.snapshot, "sink").reshape(nl, nb, bs)
    for s, t in pushes:
        assert np.array_equal(sink[:, t], out[:, s])
    assert not sink[:, sorted(set(range(nb)) - {t for _, t in pushes})].any()
    # the control: the same call with a tag takes the full path (the counter stays), bytes right
    d.call(P.fill, "dst", 0)
    assert d.call(S.outcome, "pull_blocks", key, "@dst", [1], [2], tag=b"full", **kw) == "LLM_SUCCESS"
    tagged = d.call(tcp_channel, PROMPT)
    assert tagged["quick_batches"] == after["quick_batches"]
    assert tagged["bytes_read"] - after["bytes_read"] == nl * bs
    assert np.array_equal(d.call(P.snapshot, "dst").reshape(nl, nb, bs)[:, 2], src[:, 1])


def test_a_small_pull_from_a_killed_owner_fails_with_the_contracts_status(peer_pool):
    p, d, _ = _linked_pair(peer_pool)
    nl, nb, bs = 1, 8, 4096
    p.call(P.register, "src", nl, [nb, bs], blocks=True, seed=311, key=BlocksCacheKey(PROMPT, 0))
    d.call(P.register, "dst", nl, [nb, bs], blocks=True)
    before = d.call(tcp_channel, PROMPT)["quick_batches"]
    assert d.call(S.pull_many, PROMPT, 0, "dst", [(1, 1)], nl) == 1   # the control: it worked
    assert d.call(tcp_channel, PROMPT)["quick_batches"] == before + 1
    p.kill()
    key = BlocksCacheKey(PROMPT, 0)
    kw = {"src_layer_range": range(0, nl), "dst_layer_range": range(0, nl), "tensor_num_per_layer": 1}
    status = d.call(S.outcome, "pull_blocks", key, "@dst", [2], [2], **kw)
    assert status in PEER_FAILURES, status
    assert not d.call(P.snapshot, "dst").reshape(nl, nb, bs)[:, 2].any()
    peer_pool.discard()
