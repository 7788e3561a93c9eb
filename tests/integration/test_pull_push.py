"""pull_cache / pull_blocks / push_cache / push_blocks between two engines in two processes.

Each test runs a prompt (owner) and a decoder in harness children over 127.0.0.1, with the
transport forced by the ``llmdd.transport`` option (``tcp`` and ``shm``).  Contents are random
and compared byte for byte on the other side.
"""

from __future__ import annotations

import os
import sys

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

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def peer_pool():
    pool = P.PeerPool(ENV)
    yield pool
    pool.close()


@pytest.fixture
def pair_factory(peer_pool):
    def make(transport, **kw):
        return peer_pool.pair(transport, **kw)

    yield make


def _linked(d, port):
    assert d.call(P.link, PROMPT, port) == ["LLM_SUCCESS", "LLM_SUCCESS"]


def _check_transport(d, transport):
    assert d.call(P.link_info, PROMPT)["transport"] == transport


def test_d2h_pull_needs_a_device_pool_on_the_local_host_side(pair_factory):
    p, d, port = pair_factory("tcp", prompt_kw={"mem_pool": 8 * MiB},
                              decoder_kw={"mem_pool": 8 * MiB, "host_pool": 8 * MiB})
    p.call(P.register, "pb", 2, [4, 4096], blocks=True, seed=5, key=BlocksCacheKey(PROMPT, 0))
    d.call(P.allocate, "dh", 2, [4, 4096], placement="HOST", blocks=True)
    _linked(d, port)
    code, _, _ = d.call(P.cm_status, "pull_blocks", BlocksCacheKey(PROMPT, 0), P.Ref("dh"), [0], [1])
    assert code == "LLM_PARAM_INVALID"
    assert not d.call(P.snapshot, "dh").any()


def test_h2d_pull_blocks_from_a_contiguous_host_cache_is_refused(pair_factory):
    pools = {"mem_pool": 128 * MiB, "host_pool": 8 * MiB}
    p, d, port = pair_factory("tcp", prompt_kw=pools, decoder_kw=pools)
    p.call(P.allocate, "ph", 2, [1, 4 * 4096], seed=9, placement="HOST")
    d.call(P.register, "db", 2, [4, 4096], blocks=True)
    _linked(d, port)
    code, _, _ = d.call(P.cm_status, "pull_blocks", CacheKeyByIdAndIndex(PROMPT, 1, 0), P.Ref("db"), [], [0])
    assert code == "LLM_PARAM_INVALID"
    assert not d.call(P.snapshot, "db").any()


# ------------------------------------------------------------------------------ pull_cache
def test_h2d_pull_needs_a_device_pool_on_the_host_side(pair_factory):
    pools = {"mem_pool": 8 * MiB, "host_pool": 8 * MiB}
    p, d, port = pair_factory("tcp", prompt_kw=pools, decoder_kw=pools)
    p.call(P.allocate, "pc", 2, [1, 4096], seed=3, keys=(CacheKey(PROMPT, 5),), placement="HOST")
    d.call(P.allocate, "dc", 2, [1, 4096], placement="DEVICE")
    _linked(d, port)
    code, _, _ = d.call(P.cm_status, "pull_cache", CacheKey(PROMPT, 5), P.Ref("dc"), 0)
    assert code == "LLM_PARAM_INVALID"
    assert not d.call(P.snapshot, "dc").any()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("placement", ["DEVICE", "HOST"])
def test_pull_cache_by_cache_key(pair_factory, transport, placement):
    pools = {"mem_pool": 8 * MiB, "host_pool": 8 * MiB}
    # an H2D pull needs a device pool of at least 100 MB on the host-cache side (contract);
    # pools are created on first use, so configuring it costs nothing here
    prompt_pools = dict(pools, mem_pool=128 * MiB) if placement == "HOST" else pools
    p, d, port = pair_factory(transport, prompt_kw=prompt_pools, decoder_kw=pools)
    # 4 tensors (2 layers), batch 3, 4 KiB per slot; keys: req ids 10, 11 and a prefix key
    keys = (CacheKey(PROMPT, 10), CacheKey(PROMPT, 11, 0), CacheKey(PROMPT, 2**64 - 1, 0, 77))
    p.call(P.allocate, "pc", 4, [3, 4096], seed=11, keys=keys, placement=placement)
    d.call(P.allocate, "dc", 4, [2, 4096], placement="DEVICE")
    _linked(d, port)
    _check_transport(d, transport)
    src = p.call(P.snapshot, "pc").reshape(4, 3, 4096)
    d.call(P.cm, "pull_cache", CacheKey(PROMPT, 10), P.Ref("dc"), 1)  # slot 0 -> dst batch 1
    d.call(P.cm, "pull_cache", CacheKey(prompt_cluster_id=PROMPT, req_id=2**64 - 1, prefix_id=77),
           P.Ref("dc"), batch_index=0)  # slot 2 (prefix key) -> dst batch 0
    dst = d.call(P.snapshot, "dc").reshape(4, 2, 4096)
    assert np.array_equal(dst[:, 1], src[:, 0])
    assert np.array_equal(dst[:, 0], src[:, 2])
    # size: only the first 1000 bytes of each tensor's slot move
    d.call(P.fill, "dc", 0)
    d.call(P.cm, "pull_cache", CacheKey(PROMPT, 11), P.Ref("dc"), 0, 1000)
    dst = d.call(P.snapshot, "dc").reshape(4, 2, 4096)
    assert np.array_equal(dst[:, 0, :1000], src[:, 1, :1000])
    assert not dst[:, 0, 1000:].any() and not dst[:, 1].any()
    # every key was consumed by its pull
    for key in keys:
        assert d.call(P.cm_status, "pull_cache", key, P.Ref("dc"), 0)[0] == "LLM_KV_CACHE_NOT_EXIST"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pull_cache_by_id_index_layers_and_tensor_num(pair_factory, transport):
    p, d, port = pair_factory(transport)
    # registered caches: 6 tensors, batch 2 x 2 KiB
    src_id = p.call(P.register, "src", 6, [2, 2048], blocks=False, seed=5)
    d.call(P.register, "dst", 6, [2, 2048], blocks=False)
    _linked(d, port)
    src = p.call(P.snapshot, "src").reshape(6, 2, 2048)
    # whole cache, batch slot 1 -> 0
    d.call(P.cm, "pull_cache", CacheKeyByIdAndIndex(PROMPT, src_id, 1), P.Ref("dst"), 0)
    dst = d.call(P.snapshot, "dst").reshape(6, 2, 2048)
    assert np.array_equal(dst[:, 0], src[:, 1]) and not dst[:, 1].any()
    # layer ranges, 2 tensors per layer: src layer 2 (tensors 4, 5) -> dst layer 0 (tensors 0, 1)
    d.call(P.fill, "dst", 0)
    d.call(P.cm, "pull_cache", CacheKeyByIdAndIndex(PROMPT, src_id, 0), P.Ref("dst"), 1,
           src_layer_range=range(2, 3), dst_layer_range=range(0, 1))
    dst = d.call(P.snapshot, "dst").reshape(6, 2, 2048)
    assert np.array_equal(dst[0:2, 1], src[4:6, 0])
    assert not dst[2:].any() and not dst[:, 0].any()
    # tensor_num_per_layer=3: src layer 1 (tensors 3..5) -> dst layer 0 (tensors 0..2), 512 bytes
    d.call(P.fill, "dst", 0)
    d.call(P.cm, "pull_cache", CacheKeyByIdAndIndex(PROMPT, src_id, 1), P.Ref("dst"), 0, 512,
           src_layer_range=range(1, 2), dst_layer_range=range(0, 1), tensor_num_per_layer=3)
    dst = d.call(P.snapshot, "dst").reshape(6, 2, 2048)
    assert np.array_equal(dst[0:3, 0, :512], src[3:6, 1, :512])
    assert not dst[0:3, 0, 512:].any() and not dst[3:].any() and not dst[:, 1].any()
    # ids are never consumed
    d.call(P.cm, "pull_cache", CacheKeyByIdAndIndex(PROMPT, src_id, 1), P.Ref("dst"), 0)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_layer_wise_pulls_consume_the_key_after_all_layers(pair_factory, transport):
    pool = {"mem_pool": 8 * MiB}
    p, d, port = pair_factory(transport, prompt_kw=pool, decoder_kw=pool)
    key = CacheKey(PROMPT, 5)
    p.call(P.allocate, "pc", 6, [1, 4096], seed=3, keys=(key,))
    d.call(P.allocate, "dc", 6, [1, 4096])
    _linked(d, port)
    src = p.call(P.snapshot, "pc")
    for layer in (2, 0):
        d.call(P.cm, "pull_cache", key, P.Ref("dc"), 0, src_layer_range=range(layer, layer + 1),
               dst_layer_range=range(layer, layer + 1))
    assert p.call(P.memory_stats)["cache_keys"] == 1, "key consumed before every layer was pulled"
    # pulling layer 0 again does not complete the coverage either
    d.call(P.cm, "pull_cache", key, P.Ref("dc"), 0, src_layer_range=range(0, 1), dst_layer_range=range(0, 1))
    assert p.call(P.memory_stats)["cache_keys"] == 1
    d.call(P.cm, "pull_cache", key, P.Ref("dc"), 0, src_layer_range=range(1, 2), dst_layer_range=range(1, 2))
    assert np.array_equal(d.call(P.snapshot, "dc"), src)
    assert p.call(P.wait_memory, ("cache_keys",), 0) == 0
    assert d.call(P.cm_status, "pull_cache", key, P.Ref("dc"), 0)[0] == "LLM_KV_CACHE_NOT_EXIST"


def _pool_used(p, placement="DEVICE"):
    return p.call(P.memory_stats)["pools"][placement]["used_bytes"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_deallocate_before_pull_defers_the_free(pair_factory, transport):
    pool = {"mem_pool": 8 * MiB}
    p, d, port = pair_factory(transport, prompt_kw=pool, decoder_kw=pool)
    d.call(P.allocate, "dc", 2, [1, 8192])
    p.call(P.allocate, "warm", 2, [1, 8192])  # creates the pool
    p.call(P.deallocate, "warm")
    baseline = _pool_used(p)
    k1, k2 = CacheKey(PROMPT, 1), CacheKey(PROMPT, 2)
    p.call(P.allocate, "pc", 2, [2, 8192], seed=9, keys=(k1, k2))
    src = p.call(P.snapshot, "pc").reshape(2, 2, 8192)
    p.call(P.deallocate, "pc")  # simple_pipe style: deallocate right after filling
    assert _pool_used(p) > baseline, "freed while keys still reference the cache"
    _linked(d, port)
    d.call(P.cm, "pull_cache", k1, P.Ref("dc"), 0)
    assert np.array_equal(d.call(P.snapshot, "dc").reshape(2, 8192), src[:, 0])
    assert _pool_used(p) > baseline, "freed while key 2 still references the cache"
    d.call(P.cm, "pull_cache", k2, P.Ref("dc"), 0)
    assert np.array_equal(d.call(P.snapshot, "dc").reshape(2, 8192), src[:, 1])
    assert p.call(P.wait_memory, ("pools", "DEVICE", "used_bytes"), baseline) == baseline
    assert d.call(P.cm_status, "pull_cache", k2, P.Ref("dc"), 0)[0] == "LLM_KV_CACHE_NOT_EXIST"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_remove_cache_key_makes_the_pull_fail(pair_factory, transport):
    pool = {"mem_pool": 8 * MiB}
    p, d, port = pair_factory(transport, prompt_kw=pool, decoder_kw=pool)
    key, key2 = CacheKey(PROMPT, 42, 3), CacheKey(PROMPT, 43, 0)
    p.call(P.allocate, "pc", 2, [1, 4096], seed=1, keys=(key,))
    p.call(P.allocate, "pc2", 2, [1, 4096], seed=2, keys=(key2,))
    d.call(P.allocate, "dc", 2, [1, 4096])
    _linked(d, port)
    p.call(P.remove_key, key)
    assert d.call(P.cm_status, "pull_cache", key, P.Ref("dc"), 0)[0] == "LLM_KV_CACHE_NOT_EXIST"
    assert not d.call(P.snapshot, "dc").any()
    # the wrong model_id is another key
    assert d.call(P.cm_status, "pull_cache", CacheKey(PROMPT, 43, 1), P.Ref("dc"), 0)[0] == \
        "LLM_KV_CACHE_NOT_EXIST"
    d.call(P.cm, "pull_cache", key2, P.Ref("dc"), 0)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_remote_accessible_mode_requires_id_keys(pair_factory, transport):
    kw = {"remote_accessible": True}
    p, d, port = pair_factory(transport, prompt_kw=kw, decoder_kw=kw)
    src_id = p.call(P.register, "src", 2, [1, 4096], blocks=False, seed=4)
    d.call(P.register, "dst", 2, [1, 4096], blocks=False)
    _linked(d, port)
    assert d.call(P.cm_status, "pull_cache", CacheKey(PROMPT, 1), P.Ref("dst"), 0)[0] == "TypeError"
    d.call(P.cm, "pull_cache", CacheKeyByIdAndIndex(PROMPT, src_id, 0), P.Ref("dst"), 0)
    assert np.array_equal(d.call(P.snapshot, "dst"), p.call(P.snapshot, "src"))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_vllm_ascend_v0_cache_ids_from_one(pair_factory, transport):
    pool = {"mem_pool": 16 * MiB}
    p, d, port = pair_factory(transport, prompt_kw=pool, decoder_kw=pool)
    # P allocates K, V, input, hidden first: their cache ids are 1..4
    shapes = [(2, [1, 64, 8]), (2, [1, 64, 8]), (1, [1, 64]), (1, [1, 256])]
    ids = [p.call(P.allocate, f"p{i}", n, shape, seed=100 + i, keys=(CacheKey(PROMPT, 0, i + 1),))
           for i, (n, shape) in enumerate(shapes)]
    assert ids == [1, 2, 3, 4]
    for i, (n, shape) in enumerate(shapes):
        d.call(P.allocate, f"d{i}", n, shape)
    _linked(d, port)
    for i in range(4):
        d.call(P.cm, "pull_cache", CacheKeyByIdAndIndex(PROMPT, i + 1, 0), P.Ref(f"d{i}"), 0)
        assert np.array_equal(d.call(P.snapshot, f"d{i}"), p.call(P.snapshot, f"p{i}"))


@pytest.mark.parametrize("transport", ["tcp"])
def test_cache_allocated_after_link_is_pullable(pair_factory, transport):
    pool = {"mem_pool": 8 * MiB}
    p, d, port = pair_factory(transport, prompt_kw=pool, decoder_kw=pool)
    p.call(P.allocate, "pc", 2, [1, 4096], seed=1)  # the pool (and its region) exists before link
    d.call(P.allocate, "dc", 2, [1, 4096])
    _linked(d, port)
    key = CacheKey(PROMPT, 44)
    p.call(P.allocate, "late", 2, [1, 4096], seed=3, keys=(key,))
    d.call(P.cm, "pull_cache", key, P.Ref("dc"), 0)
    assert np.array_equal(d.call(P.snapshot, "dc"), p.call(P.snapshot, "late"))


# ------------------------------------------------------------------------------ pull_blocks
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pull_blocks_random_tables_64_tensors(pair_factory, transport):
    p, d, port = pair_factory(transport)
    nt, nb, bs = 64, 32, 1024
    p.call(P.register, "src", nt, [nb, bs], blocks=True, seed=21, key=BlocksCacheKey(PROMPT, 0))
    d.call(P.register, "dst", nt, [nb, bs], blocks=True)
    _linked(d, port)
    src = p.call(P.snapshot, "src").reshape(nt, nb, bs)
    rng = np.random.default_rng(0)
    for count in (1, 7, nb):
        s = rng.permutation(nb)[:count].tolist()
        t = rng.permutation(nb)[:count].tolist()
        d.call(P.fill, "dst", 0)
        d.call(P.cm, "pull_blocks", BlocksCacheKey(cluster_id=PROMPT), P.Ref("dst"), s, t)  # vllm-ascend style
        dst = d.call(P.snapshot, "dst").reshape(nt, nb, bs)
        assert np.array_equal(dst[:, t], src[:, s])
        untouched = np.setdiff1d(np.arange(nb), t)
        assert not dst[:, untouched].any()
    # layer ranges with blocks: src layer 5 -> dst layer 1, one tensor per layer
    d.call(P.fill, "dst", 0)
    d.call(P.cm, "pull_blocks", BlocksCacheKey(PROMPT, 0), P.Ref("dst"), (3, 4), (10, 11),
           src_layer_range=range(5, 6), dst_layer_range=range(1, 2), tensor_num_per_layer=1)
    dst = d.call(P.snapshot, "dst").reshape(nt, nb, bs)
    assert np.array_equal(dst[1, [10, 11]], src[5, [3, 4]])
    dst[1, [10, 11]] = 0
    assert not dst.any()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pull_blocks_contiguous_to_blocks(pair_factory, transport):
    pool = {"mem_pool": 8 * MiB}
    p, d, port = pair_factory(transport, prompt_kw=pool, decoder_kw=pool)
    key = CacheKey(PROMPT, 9)
    # a 2-slot prompt cache of 4 tensors, 4 KiB per slot = 4 blocks of 1 KiB
    p.call(P.allocate, "pc", 4, [2, 4096], seed=31, keys=(key,))
    reg_id = p.call(P.register, "reg", 4, [2, 4096], blocks=False, seed=32)
    d.call(P.register, "dst", 4, [16, 1024], blocks=True)
    _linked(d, port)
    src = p.call(P.snapshot, "pc").reshape(4, 2, 4, 1024)
    dst_blocks = [7, 2, 9, 0]
    d.call(P.cm, "pull_blocks", key, P.Ref("dst"), [], dst_blocks)
    dst = d.call(P.snapshot, "dst").reshape(4, 16, 1024)
    assert np.array_equal(dst[:, dst_blocks], src[:, 0])
    assert d.call(P.cm_status, "pull_blocks", key, P.Ref("dst"), [], dst_blocks)[0] == "LLM_KV_CACHE_NOT_EXIST"
    # by id and index, slot 1, only 3 blocks
    reg = p.call(P.snapshot, "reg").reshape(4, 2, 4, 1024)
    d.call(P.cm, "pull_blocks", CacheKeyByIdAndIndex(PROMPT, reg_id, 1), P.Ref("dst"), src_blocks=[],
           dst_blocks=[15, 14, 13])
    dst = d.call(P.snapshot, "dst").reshape(4, 16, 1024)
    assert np.array_equal(dst[:, [15, 14, 13]], reg[:, 1, :3])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pull_blocks_mla_two_model_ids(pair_factory, transport):
    p, d, port = pair_factory(transport)
    # MLA: k_normed (one tensor per layer, 512-byte rows) and k_pe (64-byte rows), 4 layers
    p.call(P.register, "kn", 4, [16, 512], blocks=True, seed=41, key=BlocksCacheKey(PROMPT, 0))
    p.call(P.register, "kp", 4, [16, 64], blocks=True, seed=42, key=BlocksCacheKey(PROMPT, 1))
    d.call(P.register, "kn", 4, [16, 512], blocks=True)
    d.call(P.register, "kp", 4, [16, 64], blocks=True)
    _linked(d, port)
    s, t = [1, 2, 3, 8], [4, 5, 6, 0]
    d.call(P.cm, "pull_blocks", BlocksCacheKey(cluster_id=PROMPT, model_id=0), P.Ref("kn"), s, t)
    d.call(P.cm, "pull_blocks", BlocksCacheKey(cluster_id=PROMPT, model_id=1), P.Ref("kp"), s, t)
    for name, bs in (("kn", 512), ("kp", 64)):
        src = p.call(P.snapshot, name).reshape(4, 16, bs)
        dst = d.call(P.snapshot, name).reshape(4, 16, bs)
        assert np.array_equal(dst[:, t], src[:, s]), name
    # a model id nobody registered
    assert d.call(P.cm_status, "pull_blocks", BlocksCacheKey(PROMPT, 2), P.Ref("kn"), s, t)[0] == \
        "LLM_KV_CACHE_NOT_EXIST"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_concurrent_pulls_from_threads_on_one_link(pair_factory, transport):
    p, d, port = pair_factory(transport)
    nt, nb, bs = 8, 64, 2048
    p.call(P.register, "src", nt, [nb, bs], blocks=True, seed=51, key=BlocksCacheKey(PROMPT, 0))
    d.call(P.register, "dst", nt, [nb, bs], blocks=True)
    _linked(d, port)
    rng = np.random.default_rng(1)
    perm = rng.permutation(nb)
    jobs, tables = [], []
    for i in range(8):  # 8 threads, disjoint destination blocks
        s = rng.permutation(nb)[:8].tolist()
        t = perm[i * 8:(i + 1) * 8].tolist()
        tables.append((s, t))
        jobs.append(("pull_blocks", (BlocksCacheKey(PROMPT, 0), P.Ref("dst"), s, t), {}))
    assert d.call(P.threaded_pulls, jobs, timeout=30) == ["LLM_SUCCESS"] * 8
    src = p.call(P.snapshot, "src").reshape(nt, nb, bs)
    dst = d.call(P.snapshot, "dst").reshape(nt, nb, bs)
    for s, t in tables:
        assert np.array_equal(dst[:, t], src[:, s])


# ------------------------------------------------------------------------------ push + events
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_push_blocks_sglang_style_and_peer_written(pair_factory, transport):
    kw = {"remote_accessible": True}
    p, d, port = pair_factory(transport, prompt_kw=kw, decoder_kw=kw)
    nl, nb, bs = 3, 16, 1024
    dst_id = p.call(P.register, "dst", nl, [nb, bs], blocks=True, key=BlocksCacheKey(PROMPT, 0))
    d.call(P.register, "src", nl, [nb, bs], blocks=True, seed=61, key=BlocksCacheKey(DECODER, 0))
    p.call(P.subscribe)
    _linked(d, port)
    # push from the decoder into the prompt's blocks (the linking side pushes, as in push_blocks_sample)
    src_blocks, dst_blocks = [0, 1, 5], [9, 2, 3]
    d.call(P.cm, "push_blocks", BlocksCacheKey(PROMPT, 0), P.Ref("src"), src_blocks, dst_blocks, range(nl),
           range(nl), 1)
    src = d.call(P.snapshot, "src").reshape(nl, nb, bs)
    dst = p.call(P.snapshot, "dst").reshape(nl, nb, bs)
    assert np.array_equal(dst[:, dst_blocks], src[:, src_blocks])
    written = p.call(P.wait_events, "cache", "peer_written")
    assert written, "the receiver saw no peer_written event"
    ev = written[-1]
    assert ev["id"] == dst_id and ev["info"]["peer"] == DECODER and not ev["error"]
    assert ev["info"]["blocks"] == [[2, 4], [9, 10]]
    # layer subset: src layer 2 -> dst layer 0
    d.call(P.cm, "push_blocks", BlocksCacheKey(PROMPT, 0), P.Ref("src"), [4], [15], range(2, 3), range(0, 1), 1)
    dst = p.call(P.snapshot, "dst").reshape(nl, nb, bs)
    assert np.array_equal(dst[0, 15], src[2, 4]) and not dst[1:, 15].any()
    written = p.call(P.wait_events, "cache", "peer_written", 2)
    assert written[-1]["info"]["tensors"] == [0, 1]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_push_cache_and_peer_written(pair_factory, transport):
    kw = {"remote_accessible": True}
    p, d, port = pair_factory(transport, prompt_kw=kw, decoder_kw=kw)
    dst_id = p.call(P.register, "dst", 4, [2, 4096], blocks=False)
    d.call(P.register, "src", 4, [2, 4096], blocks=False, seed=71)
    p.call(P.subscribe)
    _linked(d, port)
    d.call(P.cm, "push_cache", CacheKeyByIdAndIndex(cluster_id=PROMPT, cache_id=dst_id, batch_index=1),
           P.Ref("src"), src_batch_index=0)
    src = d.call(P.snapshot, "src").reshape(4, 2, 4096)
    dst = p.call(P.snapshot, "dst").reshape(4, 2, 4096)
    assert np.array_equal(dst[:, 1], src[:, 0]) and not dst[:, 0].any()
    ev = p.call(P.wait_events, "cache", "peer_written")[-1]
    assert ev["id"] == dst_id and ev["info"]["peer"] == DECODER and ev["info"]["tensors"] == [0, 4]
    # one layer, positional
    d.call(P.cm, "push_cache", CacheKeyByIdAndIndex(PROMPT, dst_id, 0), P.Ref("src"), 1, range(1, 2),
           range(1, 2))
    dst = p.call(P.snapshot, "dst").reshape(4, 2, 4096)
    assert np.array_equal(dst[2:4, 0], src[2:4, 1]) and not dst[0:2, 0].any()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_owner_sees_peer_read_naming_the_blocks(pair_factory, transport):
    p, d, port = pair_factory(transport)
    src_id = p.call(P.register, "src", 2, [32, 512], blocks=True, seed=81, key=BlocksCacheKey(PROMPT, 0))
    d.call(P.register, "dst", 2, [32, 512], blocks=True)
    p.call(P.subscribe)
    _linked(d, port)
    d.call(P.cm, "pull_blocks", BlocksCacheKey(PROMPT, 0), P.Ref("dst"), [5, 6, 7, 20], [0, 1, 2, 3])
    read = p.call(P.wait_events, "cache", "peer_read")
    assert read, "the owner saw no peer_read event"
    ev = read[-1]
    assert ev["id"] == src_id and ev["info"]["peer"] == DECODER
    assert ev["info"]["blocks"] == [[5, 8], [20, 21]]
