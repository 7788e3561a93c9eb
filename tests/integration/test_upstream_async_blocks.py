"""transfer_cache_async from a blocks cache with no block indices, across two processes.

Upstream's layer-wise job picks its path from the destination block list alone: none means
cache to cache, whatever kind the source is.  A blocks cache counts there as a cache of one
batch slot whose stride is one block, so each tensor of a transferred layer sends its first
block to the start of the destination tensor.  The official ``transfer_cache_async`` sample
(blocks cache, ``BlocksCacheKey``, ranges (0, 1)) and upstream's remote-cache-accessible tests
(by key and by id) do exactly this; here the bytes are compared on the receiving side.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from llmdd import BlocksCacheKey, CacheKeyByIdAndIndex, TransferWithCacheKeyConfig

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import _dataplane_peers as P  # noqa: E402
import _upstream_peers as U  # noqa: E402

ENV = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
PROMPT, DECODER = 1, 2
RA = {"remote_accessible": True}

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def peer_pool():
    pool = P.PeerPool(ENV)
    yield pool
    pool.close()


def _pair(peer_pool, transport):
    """Both listen, as in the official sample; the prompt (the sender) links to the decoder."""
    p, d, _ = peer_pool.pair(transport, prompt_kw=RA, decoder_kw={**RA, "listen": True})
    return p, d, d.call(U.statistics_listen)[1]


def _run(p, d, decoder_port, configs, layers, **blocks):
    assert p.call(P.link, DECODER, decoder_port) == ["LLM_SUCCESS", "LLM_SUCCESS"]
    p.call(P.start_async, "t", "src", configs, **blocks)
    for layer in layers:
        p.call(P.release_layer, "t", layer)
    code = p.call(P.async_synchronize, "t", 10000)
    return code, p.call(P.async_results, "t", 1000)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_official_sample_blocks_key_no_indices(peer_pool, transport):
    # the sample: 2 tensors of [3 blocks, 10 floats], BlocksCacheKey(decoder, 0), layers (0, 1) -> (0, 1)
    p, d, port = _pair(peer_pool, transport)
    nb, bs = 3, 40
    p.call(P.register, "src", 2, [nb, 10], blocks=True, seed=11, key=BlocksCacheKey(PROMPT, 0), dtype="DT_FLOAT")
    d.call(P.register, "dst", 2, [nb, 10], blocks=True, key=BlocksCacheKey(DECODER, 0), dtype="DT_FLOAT")
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(DECODER, 0), range(0, 1), range(0, 1))
    code, results = _run(p, d, port, [cfg], [0])
    assert (code, results) == ("LLM_SUCCESS", ["LLM_SUCCESS"])
    src = p.call(P.snapshot, "src").reshape(2, nb, bs)
    dst = d.call(P.snapshot, "dst").reshape(2, nb, bs)
    assert src[:, 1:].any(), "control: the blocks that must not travel hold data"
    assert np.array_equal(dst[:, 0], src[:, 0])          # one stride (a block) per tensor
    assert not dst[:, 1:].any()                          # nothing past the first block
    assert not np.array_equal(dst, src)


@pytest.mark.parametrize("transport", ["tcp"])
def test_blocks_source_by_id_and_layer_offset(peer_pool, transport):
    # upstream's by-id test: a blocks source, CacheKeyByIdAndIndex of a blocks destination, no indices;
    # here with 2 layers and src layer 1 -> dst layer 0
    p, d, port = _pair(peer_pool, transport)
    nb, bs = 4, 64
    p.call(P.register, "src", 4, [nb, bs], blocks=True, seed=12)
    dst_id = d.call(P.register, "dst", 4, [nb, bs], blocks=True)
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(DECODER, dst_id, 0), range(1, 2), range(0, 1))
    code, results = _run(p, d, port, [cfg], [1])
    assert (code, results) == ("LLM_SUCCESS", ["LLM_SUCCESS"])
    src = p.call(P.snapshot, "src").reshape(4, nb, bs)
    dst = d.call(P.snapshot, "dst").reshape(4, nb, bs)
    assert np.array_equal(dst[0:2, 0], src[2:4, 0])
    assert not dst[0:2, 1:].any() and not dst[2:4].any()


@pytest.mark.parametrize("transport", ["tcp"])
def test_blocks_source_empty_index_lists_count_as_none(peer_pool, transport):
    p, d, port = _pair(peer_pool, transport)
    nb, bs = 2, 32
    p.call(P.register, "src", 2, [nb, bs], blocks=True, seed=13, key=BlocksCacheKey(PROMPT, 0))
    d.call(P.register, "dst", 2, [nb, bs], blocks=True, key=BlocksCacheKey(DECODER, 0))
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(DECODER, 0), range(0, 1), range(0, 1))
    code, results = _run(p, d, port, [cfg], [0], src_blocks=[], dst_blocks=[])
    assert (code, results) == ("LLM_SUCCESS", ["LLM_SUCCESS"])
    src = p.call(P.snapshot, "src").reshape(2, nb, bs)
    dst = d.call(P.snapshot, "dst").reshape(2, nb, bs)
    assert np.array_equal(dst[:, 0], src[:, 0]) and not dst[:, 1].any()


@pytest.mark.parametrize("transport", ["tcp"])
def test_contiguous_source_into_blocks_destination_without_indices(peer_pool, transport):
    # the path does not depend on the destination kind either: a batch slot lands at the tensor start
    p, d, port = _pair(peer_pool, transport)
    p.call(P.register, "src", 2, [2, 96], blocks=False, seed=14)
    d.call(P.register, "dst", 2, [4, 48], blocks=True, key=BlocksCacheKey(DECODER, 0))
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(DECODER, 0), range(0, 1), range(0, 1))
    code, results = _run(p, d, port, [cfg], [0])
    assert (code, results) == ("LLM_SUCCESS", ["LLM_SUCCESS"])
    src = p.call(P.snapshot, "src").reshape(2, 2, 96)
    dst = d.call(P.snapshot, "dst").reshape(2, 192)
    assert np.array_equal(dst[:, :96], src[:, 0]) and not dst[:, 96:].any()


@pytest.mark.parametrize("transport", ["tcp"])
def test_batch_index_beyond_a_blocks_destination_fails_the_config(peer_pool, transport):
    # a blocks cache has one batch slot: batch_index 1 is out of range there (upstream: LLM_PARAM_INVALID)
    p, d, port = _pair(peer_pool, transport)
    p.call(P.register, "src", 2, [2, 32], blocks=True, seed=15)
    dst_id = d.call(P.register, "dst", 2, [2, 32], blocks=True)
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(DECODER, dst_id, 1), range(0, 1), range(0, 1))
    code, results = _run(p, d, port, [cfg], [0])
    assert (code, results) == ("LLM_PARAM_INVALID", ["LLM_PARAM_INVALID"])
    assert not d.call(P.snapshot, "dst").any()


@pytest.mark.parametrize("transport", ["tcp"])
def test_slot_larger_than_destination_tensor_is_refused(peer_pool, transport):
    # llmdd bounds the copy by the destination tensor (docs/deviations.md): nothing is written
    p, d, port = _pair(peer_pool, transport)
    p.call(P.register, "src", 2, [1, 256], blocks=False, seed=16)
    d.call(P.register, "dst", 2, [2, 64], blocks=True, key=BlocksCacheKey(DECODER, 0))
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(DECODER, 0), range(0, 1), range(0, 1))
    code, results = _run(p, d, port, [cfg], [0])
    assert (code, results) == ("LLM_PARAM_INVALID", ["LLM_PARAM_INVALID"])
    assert not d.call(P.snapshot, "dst").any()


@pytest.mark.parametrize("key_kind", ["blocks_key", "by_id"])
def test_upstream_remote_cache_tests_with_allocated_blocks_caches(peer_pool, key_kind):
    # upstream's test_transfer_cache_with_cache_key / _with_cache_id: CacheDesc(2, [2, 8], DT_INT8),
    # both caches from allocate_blocks_cache, layers (0, 1) -> (0, 1), no block indices
    pools = {**RA, "mem_pool": 1 << 20}
    p, d, _ = peer_pool.pair("tcp", prompt_kw=pools, decoder_kw={**pools, "listen": True})
    dport = d.call(U.statistics_listen)[1]
    p.call(P.allocate, "src", 2, [2, 8], blocks=True, seed=17)
    dst_id = d.call(P.allocate, "dst", 2, [2, 8], blocks=True, key=BlocksCacheKey(DECODER, 0))
    d.call(P.fill, "dst", 0)
    key = BlocksCacheKey(cluster_id=DECODER, model_id=0) if key_kind == "blocks_key" else \
        CacheKeyByIdAndIndex(cluster_id=DECODER, cache_id=dst_id)
    code, results = _run(p, d, dport, [TransferWithCacheKeyConfig(key, range(0, 1), range(0, 1))], [0])
    assert (code, results) == ("LLM_SUCCESS", ["LLM_SUCCESS"])
    src = p.call(P.snapshot, "src").reshape(2, 2, 8)
    dst = d.call(P.snapshot, "dst").reshape(2, 2, 8)
    assert src[:, 1].any(), "control: the block that must not travel holds data"
    assert np.array_equal(dst[:, 0], src[:, 0]) and not dst[:, 1].any()
