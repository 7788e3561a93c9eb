"""transfer_cache_async between two processes: layer-by-layer release, ordering proofs, results.

The prompt (listener) transfers to the decoder over the link the decoder made.  A gated
``LayerSynchronizer`` in the prompt releases one layer at a time when the test says so; the
test proves by the receiver's bytes and by timestamps (``CLOCK_MONOTONIC`` is system-wide) that
layer ``i`` had arrived before layer ``i + 1`` was released.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

from llmdd import BlocksCacheKey, CacheKeyByIdAndIndex, TransferConfig, TransferWithCacheKeyConfig

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import _dataplane_peers as P  # noqa: E402

ENV = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
TRANSPORTS = ["tcp", "shm"]
PROMPT, DECODER = 1, 2
RA = {"remote_accessible": True}

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def peer_pool():
    pool = P.PeerPool(ENV)
    yield pool
    pool.close()


def _linked(peer_pool, transport, **kw):
    p, d, port = peer_pool.pair(transport, **kw)
    return p, d, port


def _link(d, port):
    assert d.call(P.link, PROMPT, port) == ["LLM_SUCCESS", "LLM_SUCCESS"]


def _release_in_order(p, d, name, layers, landed):
    """Release layers one at a time; before releasing the next, check the bytes of this one landed
    and the next one's did not.  ``landed(layer)`` -> (arrived, next_untouched)."""
    for k, layer in enumerate(layers):
        p.call(P.release_layer, name, layer)
        assert p.call(P.wait_layer_done, name, layer), f"layer {layer} not transferred"
        time.sleep(0.05)  # a transfer that ran ahead of the synchronizer would show now
        arrived, later_untouched = landed(layer, layers[k + 1:])
        assert arrived, f"layer {layer} did not arrive"
        assert later_untouched, f"layers after {layer} arrived before they were released"
    assert p.call(P.async_synchronize, name, 5000) == "LLM_SUCCESS"
    timeline = p.call(P.async_timeline, name)
    done = {layer: transferred for layer, _, transferred in timeline["layer_times"]}
    released = timeline["released_at"]
    for a, b in zip(layers, layers[1:]):
        assert done[a] < released[b], f"layer {a} transferred after layer {b} was released"
        assert released[a] <= done[a]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_blocks_destination_layer_by_layer(peer_pool, transport):
    p, d, port = _linked(peer_pool, transport, prompt_kw=RA, decoder_kw=RA)
    nl, nb, bs = 3, 16, 1024
    p.call(P.register, "src", 2 * nl, [nb, bs], blocks=True, seed=1, key=BlocksCacheKey(PROMPT, 0))
    d.call(P.register, "dst", 2 * nl, [nb, bs], blocks=True, key=BlocksCacheKey(DECODER, 0))
    p.call(P.subscribe)
    _link(d, port)
    src = p.call(P.snapshot, "src").reshape(2 * nl, nb, bs)
    sb, db = [0, 3, 4, 9], [15, 1, 2, 7]
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(DECODER, 0), range(0, nl), range(0, nl))
    p.call(P.start_async, "t", "src", [cfg], src_blocks=sb, dst_blocks=db)
    assert p.call(P.async_synchronize, "t", 100) == "LLM_TIMEOUT", "finished while layer 0 is held"
    assert not d.call(P.snapshot, "dst").any()

    def landed(layer, later):
        dst = d.call(P.snapshot, "dst").reshape(2 * nl, nb, bs)
        t = slice(2 * layer, 2 * layer + 2)
        ok = np.array_equal(dst[t][:, db], src[t][:, sb])
        return ok, all(not dst[2 * x:2 * x + 2].any() for x in later)

    _release_in_order(p, d, "t", list(range(nl)), landed)
    assert p.call(P.async_results, "t") == ["LLM_SUCCESS"]
    # per-layer task transitions were emitted
    layer_events = p.call(P.events, "task", "layer_transferred")
    assert [e["info"]["layer"] for e in layer_events] == list(range(nl))
    assert p.call(P.events, "task", "transfer_succeeded")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cache_destination_by_id_and_index(peer_pool, transport):
    p, d, port = _linked(peer_pool, transport, prompt_kw=RA, decoder_kw=RA)
    nl = 2
    p.call(P.register, "src", 2 * nl, [2, 2048], blocks=False, seed=2)
    dst_id = d.call(P.register, "dst", 2 * nl, [2, 2048], blocks=False)
    _link(d, port)
    src = p.call(P.snapshot, "src").reshape(2 * nl, 2, 2048)
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(DECODER, dst_id, 1), range(0, nl), range(0, nl),
                                     src_batch_index=0)
    p.call(P.start_async, "t", "src", [cfg])

    def landed(layer, later):
        dst = d.call(P.snapshot, "dst").reshape(2 * nl, 2, 2048)
        ok = np.array_equal(dst[2 * layer:2 * layer + 2, 1], src[2 * layer:2 * layer + 2, 0])
        return ok and not dst[:, 0].any(), all(not dst[2 * x:2 * x + 2].any() for x in later)

    _release_in_order(p, d, "t", list(range(nl)), landed)
    assert p.call(P.async_results, "t", 1000) == ["LLM_SUCCESS"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_transfer_config_raw_addresses(peer_pool, transport):
    p, d, port = _linked(peer_pool, transport)  # non remote-accessible mode: TransferConfig
    nl = 3
    p.call(P.register, "src", 2 * nl, [1, 4096], blocks=False, seed=3)
    d.call(P.register, "dst", 2 * nl, [1, 4096], blocks=False)
    _link(d, port)
    src = p.call(P.snapshot, "src")
    layers = range(1, 3)
    addrs = d.call(P.async_transfer_config_addrs, "dst", layers)
    cfg = TransferConfig(DECODER, addrs, layers)
    p.call(P.start_async, "t", "src", [cfg])

    def landed(layer, later):
        dst = d.call(P.snapshot, "dst")
        ok = np.array_equal(dst[2 * layer:2 * layer + 2], src[2 * layer:2 * layer + 2])
        return ok and not dst[0:2].any(), all(not dst[2 * x:2 * x + 2].any() for x in later)

    _release_in_order(p, d, "t", list(layers), landed)
    assert p.call(P.async_results, "t") == ["LLM_SUCCESS"]
    # TransferWithCacheKeyConfig is refused in this mode
    bad = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(DECODER, 1, 0), range(0, 1), range(0, 1))
    with pytest.raises(TypeError):
        p.call(P.start_async, "bad", "src", [bad])


@pytest.mark.parametrize("transport", ["tcp"])
def test_refusing_synchronizer_fails_its_configs_only(peer_pool, transport):
    p, d, port = _linked(peer_pool, transport, prompt_kw=RA, decoder_kw=RA)
    nl, nb, bs = 4, 8, 512
    p.call(P.register, "src", 2 * nl, [nb, bs], blocks=True, seed=4, key=BlocksCacheKey(PROMPT, 0))
    d.call(P.register, "dst", 2 * nl, [nb, bs], blocks=True, key=BlocksCacheKey(DECODER, 0))
    _link(d, port)
    # config 0: layers 0-1 (completes), config 1: layers 1-2 (refused at layer 1), config 2: layer 3
    cfgs = [TransferWithCacheKeyConfig(BlocksCacheKey(DECODER, 0), range(0, 2), range(0, 2)),
            TransferWithCacheKeyConfig(BlocksCacheKey(DECODER, 0), range(1, 3), range(1, 3)),
            TransferWithCacheKeyConfig(BlocksCacheKey(DECODER, 0), range(3, 4), range(3, 4))]
    p.call(P.subscribe)
    p.call(P.start_async, "t", "src", cfgs, refuse=(1,), src_blocks=[1, 2], dst_blocks=[3, 4])
    p.call(P.release_layer, "t", 0)
    assert p.call(P.wait_layer_done, "t", 0)
    p.call(P.release_layer, "t", 1)
    assert p.call(P.async_synchronize, "t", 5000) == "LLM_PARAM_INVALID"
    # layer 1 was refused: configs 0 and 1 both transfer it and fail; config 2 never started
    assert p.call(P.async_results, "t") == ["LLM_PARAM_INVALID", "LLM_PARAM_INVALID", None]
    src = p.call(P.snapshot, "src").reshape(2 * nl, nb, bs)
    dst = d.call(P.snapshot, "dst").reshape(2 * nl, nb, bs)
    assert np.array_equal(dst[0:2][:, [3, 4]], src[0:2][:, [1, 2]])
    assert not dst[2:].any(), "a refused layer was transferred"
    assert p.call(P.events, "task", "synchronizer_refused")


@pytest.mark.parametrize("transport", ["tcp"])
def test_refused_last_layer_leaves_finished_configs_successful(peer_pool, transport):
    p, d, port = _linked(peer_pool, transport, prompt_kw=RA, decoder_kw=RA)
    p.call(P.register, "src", 4, [4, 256], blocks=True, seed=5, key=BlocksCacheKey(PROMPT, 0))
    d.call(P.register, "dst", 4, [4, 256], blocks=True, key=BlocksCacheKey(DECODER, 0))
    _link(d, port)
    cfgs = [TransferWithCacheKeyConfig(BlocksCacheKey(DECODER, 0), range(0, 1), range(0, 1)),
            TransferWithCacheKeyConfig(BlocksCacheKey(DECODER, 0), range(1, 2), range(1, 2))]
    p.call(P.start_async, "t", "src", cfgs, refuse=(1,), src_blocks=[0], dst_blocks=[0])
    p.call(P.release_layer, "t", 0)
    p.call(P.release_layer, "t", 1)
    assert p.call(P.async_results, "t", 5000) == ["LLM_SUCCESS", "LLM_PARAM_INVALID"]
    assert p.call(P.async_synchronize, "t") == "LLM_PARAM_INVALID"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_link_busy_while_an_async_task_runs(peer_pool, transport):
    p, d, port = _linked(peer_pool, transport, prompt_kw=RA, decoder_kw=RA)
    p.call(P.register, "src", 4, [4, 256], blocks=True, seed=6, key=BlocksCacheKey(PROMPT, 0))
    p.call(P.register, "pdst", 4, [4, 256], blocks=True)
    d.call(P.register, "dst", 4, [4, 256], blocks=True, seed=7, key=BlocksCacheKey(DECODER, 0))
    _link(d, port)
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(DECODER, 0), range(0, 2), range(0, 2))
    p.call(P.start_async, "t", "src", [cfg], src_blocks=[0], dst_blocks=[1])
    # a pull on the same link while layer 0 is held
    status = p.call(P.cm_status, "pull_blocks", BlocksCacheKey(DECODER, 0), P.Ref("pdst"), [2], [2])
    assert status[0] == "LLM_LINK_BUSY"
    assert not p.call(P.snapshot, "pdst").any()
    # a second async task on the same link as well
    with pytest.raises(Exception) as info:
        p.call(P.start_async, "t2", "src", [cfg], src_blocks=[0], dst_blocks=[1])
    assert info.value.status_code.name == "LLM_LINK_BUSY"
    assert p.call(P.async_synchronize, "t", 50) == "LLM_TIMEOUT"
    assert p.call(P.async_results, "t", 50) == ["LLM_TIMEOUT"]
    p.call(P.release_layer, "t", 0)
    p.call(P.release_layer, "t", 1)
    assert p.call(P.async_synchronize, "t", 5000) == "LLM_SUCCESS"
    # the link is free again
    p.call(P.cm, "pull_blocks", BlocksCacheKey(DECODER, 0), P.Ref("pdst"), [2], [2])
    src = d.call(P.snapshot, "dst").reshape(4, 4, 256)
    assert np.array_equal(p.call(P.snapshot, "pdst").reshape(4, 4, 256)[:, 2], src[:, 2])
