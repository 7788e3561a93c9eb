"""push_cache / push_blocks default layer ranges, as upstream computes them, across two processes.

Upstream defaults both ranges to ``range(0, num_tensors // tensor_num_per_layer)`` and pushes
layer by layer; a cache with fewer tensors than ``tensor_num_per_layer`` has no whole layer, the
range is empty, nothing is sent and nothing is raised.  Explicit ranges are checked as upstream's
``check_layer_range`` does (step 1, ``0 <= start < stop``).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from llmdd import BlocksCacheKey, CacheKeyByIdAndIndex

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import _dataplane_peers as P  # noqa: E402

ENV = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
PROMPT, DECODER = 1, 2
RA = {"remote_accessible": True}

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def peer_pool():
    pool = P.PeerPool(ENV)
    yield pool
    pool.close()


def _linked(d, port):
    assert d.call(P.link, PROMPT, port) == ["LLM_SUCCESS", "LLM_SUCCESS"]


def test_push_cache_one_tensor_default_ranges_sends_nothing(peer_pool):
    p, d, port = peer_pool.pair("tcp", prompt_kw=RA, decoder_kw=RA)
    dst_id = p.call(P.register, "dst", 1, [2, 256], blocks=False)
    d.call(P.register, "src", 1, [2, 256], blocks=False, seed=31)
    p.call(P.subscribe)
    _linked(d, port)
    key = CacheKeyByIdAndIndex(PROMPT, dst_id, 0)
    assert d.call(P.cm_status, "push_cache", key, P.Ref("src"))[0] == "LLM_SUCCESS"
    assert not p.call(P.snapshot, "dst").any()
    # a push that does send (one tensor per layer) is the first write the owner ever sees
    d.call(P.cm, "push_cache", key, P.Ref("src"), tensor_num_per_layer=1)
    written = p.call(P.wait_events, "cache", "peer_written", 1)
    assert len(written) == 1 and written[0]["info"]["tensors"] == [0, 1]
    src = d.call(P.snapshot, "src").reshape(1, 2, 256)
    dst = p.call(P.snapshot, "dst").reshape(1, 2, 256)
    assert np.array_equal(dst[:, 0], src[:, 0]) and not dst[:, 1].any()


def test_push_blocks_three_tensors_four_per_layer_sends_nothing(peer_pool):
    p, d, port = peer_pool.pair("tcp", prompt_kw=RA, decoder_kw=RA)
    p.call(P.register, "dst", 3, [4, 128], blocks=True, key=BlocksCacheKey(PROMPT, 0))
    d.call(P.register, "src", 3, [4, 128], blocks=True, seed=32)
    p.call(P.subscribe)
    _linked(d, port)
    status = d.call(P.cm_status, "push_blocks", BlocksCacheKey(PROMPT, 0), P.Ref("src"), [0, 1], [2, 3],
                    tensor_num_per_layer=4)
    assert status[0] == "LLM_SUCCESS"
    assert not p.call(P.snapshot, "dst").any()
    d.call(P.cm, "push_blocks", BlocksCacheKey(PROMPT, 0), P.Ref("src"), [0, 1], [2, 3], tensor_num_per_layer=3)
    written = p.call(P.wait_events, "cache", "peer_written", 1)
    assert len(written) == 1 and written[0]["info"]["blocks"] == [[2, 4]]
    src = d.call(P.snapshot, "src").reshape(3, 4, 128)
    dst = p.call(P.snapshot, "dst").reshape(3, 4, 128)
    assert np.array_equal(dst[:, 2:4], src[:, 0:2]) and not dst[:, 0:2].any()


def test_empty_default_range_needs_no_link(peer_pool):
    # upstream's loop never runs, so not even the link is looked up
    p, d, port = peer_pool.pair("tcp", prompt_kw=RA, decoder_kw=RA)
    d.call(P.register, "src", 1, [2, 64], blocks=False, seed=33)
    d.call(P.register, "bsrc", 1, [2, 64], blocks=True, seed=34)
    assert d.call(P.cm_status, "push_cache", CacheKeyByIdAndIndex(PROMPT, 1, 0), P.Ref("src"))[0] == "LLM_SUCCESS"
    assert d.call(P.cm_status, "push_blocks", BlocksCacheKey(PROMPT, 0), P.Ref("bsrc"), [0], [1])[0] == "LLM_SUCCESS"
    # control: a non-empty range on the same unlinked engine does look the link up
    code = d.call(P.cm_status, "push_cache", CacheKeyByIdAndIndex(PROMPT, 1, 0), P.Ref("src"),
                  tensor_num_per_layer=1)[0]
    assert code == "LLM_NOT_YET_LINK"


@pytest.mark.parametrize("src_range, dst_range", [
    (range(0, 0), None), (None, range(1, 1)), (range(0, 2, 2), range(0, 1)), (range(0, 1), None),
])
def test_explicit_ranges_checked_as_upstream(peer_pool, src_range, dst_range):
    p, d, port = peer_pool.pair("tcp", prompt_kw=RA, decoder_kw=RA)
    dst_id = p.call(P.register, "dst", 1, [2, 64], blocks=False)
    d.call(P.register, "src", 1, [2, 64], blocks=False, seed=35)
    _linked(d, port)
    # (0, 1) with the default range of a 1-tensor cache (empty): the lengths differ
    code = d.call(P.cm_status, "push_cache", CacheKeyByIdAndIndex(PROMPT, dst_id, 0), P.Ref("src"), 0,
                  src_range, dst_range)[0]
    assert code == "LLM_PARAM_INVALID"
    assert not p.call(P.snapshot, "dst").any()
