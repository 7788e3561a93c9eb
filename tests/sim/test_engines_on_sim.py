"""Whole llmdd engines on one simulated world, in one thread (issue 38 point 1).

Each engine is an ordinary ``LLMDataDist`` built on a :class:`~llmdd.testing.sim.SimRuntime`
(``llmdd.testing.sim``): link, register blocks, pull, push, unlink and finalize through the public
API, with the world's in-memory ``sim`` transport.  The pulled and pushed bytes (seeded random data)
are compared with the owner's, a scenario run twice gives the same trace hash (another seed: another
hash), nothing is left in the world after finalize, and the protocol's deadlines fall on the fake
clock at exactly the configured time.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from llmdd import (
    BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMConfig, LLMException, LLMRole, LLMStatusCode,
)
from llmdd.testing.sim import SimProcess, World
from llmdd.testing.sim.transport import open_endpoints

pytestmark = pytest.mark.timeout(300)

NUM_BLOCKS, BLOCK_ELEMS, NUM_TENSORS = 8, 64, 2
BASE_PORT = 26000


def _options(listen: str | None) -> dict:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.local_comm_res = ""
    cfg.enable_remote_cache_accessible = True
    if listen:
        cfg.listen_ip_info = listen
    return dict(cfg.generate_options())


class _Engine:
    """One simulated process with a registered blocks cache of seeded random data."""

    def __init__(self, world: World, cluster_id: int, role: LLMRole, rng: np.random.Generator,
                 extra: dict | None = None) -> None:
        self.proc = SimProcess(world, role, cluster_id)
        self.port = BASE_PORT + cluster_id
        self.proc.init({**_options(f"127.0.0.1:{self.port}" if role is LLMRole.PROMPT else None), **(extra or {})})
        self.dd = self.proc.dd
        self.bufs = [rng.standard_normal((NUM_BLOCKS, BLOCK_ELEMS)).astype(np.float32) for _ in range(NUM_TENSORS)]
        desc = CacheDesc(NUM_TENSORS, [NUM_BLOCKS, BLOCK_ELEMS], DataType.DT_FLOAT)
        self.cache = self.dd.cache_manager.register_blocks_cache(desc, [b.ctypes.data for b in self.bufs],
                                                                 BlocksCacheKey(cluster_id, 0))
        self.cluster_id = cluster_id

    def cluster(self, client: "_Engine") -> LLMClusterInfo:
        info = LLMClusterInfo()
        info.remote_cluster_id = self.cluster_id
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", self.port)
        return info

    def blocks(self) -> np.ndarray:
        return np.stack([b.copy() for b in self.bufs])


def _scenario(seed: int, n_prompts: int, n_decoders: int) -> tuple[str, int]:
    """Decoders link to every prompt, pull blocks from each and push blocks back, check the bytes,
    unlink and finalize; returns (trace hash, steps)."""
    world = World(seed)
    rng = np.random.default_rng(seed)
    threads_before = threading.active_count()
    prompts = [_Engine(world, 1 + i, LLMRole.PROMPT, rng) for i in range(n_prompts)]
    decoders = [_Engine(world, 100 + i, LLMRole.DECODER, rng) for i in range(n_decoders)]
    for d in decoders:
        code, codes = d.dd.link_clusters([p.cluster(d) for p in prompts], 5000)
        assert code is LLMStatusCode.LLM_SUCCESS, (d.cluster_id, codes)
    for d in decoders:
        for p in world.random.sample(prompts, len(prompts)):   # each decoder's order of prompts: seeded
            src = [int(b) for b in world.random.sample(range(NUM_BLOCKS), 3)]
            dst = [int(b) for b in world.random.sample(range(NUM_BLOCKS), 3)]
            before = d.blocks()
            d.dd.cache_manager.pull_blocks(BlocksCacheKey(p.cluster_id, 0), d.cache, src_blocks=src, dst_blocks=dst)
            after = d.blocks()
            want = before.copy()
            want[:, dst] = p.blocks()[:, src]
            np.testing.assert_array_equal(after, want)
            # a push of other blocks back into the prompt's cache
            psrc = [int(b) for b in world.random.sample(range(NUM_BLOCKS), 2)]
            pdst = [int(b) for b in world.random.sample(range(NUM_BLOCKS), 2)]
            owner_before = p.blocks()
            d.dd.cache_manager.push_blocks(BlocksCacheKey(p.cluster_id, 0), d.cache, src_blocks=psrc, dst_blocks=pdst)
            owner_want = owner_before.copy()
            owner_want[:, pdst] = d.blocks()[:, psrc]
            np.testing.assert_array_equal(p.blocks(), owner_want)
    for d in world.random.sample(decoders, len(decoders)):   # the order of the unlinks: seeded
        code, codes = d.dd.unlink_clusters([p.cluster(d) for p in prompts], 5000)
        assert code is LLMStatusCode.LLM_SUCCESS, (d.cluster_id, codes)
        assert d.dd.statistics()["links"] == {}
    for e in decoders + prompts:
        e.proc.finalize()
        assert e.proc.runtime.threads() == 0
    world.settle()
    assert world.failures == []
    assert threading.active_count() == threads_before   # no real thread was started
    _assert_nothing_left(world)
    return world.trace_hash(), world.steps


def _assert_nothing_left(world: World) -> None:
    """After every engine finalized: no fiber, timer, watched or open socket, parked wait or endpoint."""
    assert world.leftovers() == {"fibers": 0, "timers": 0, "watched": 0, "sockets": 0, "parked": 0}
    assert open_endpoints(world) == 0


def test_two_engines_pull_and_push_seeded_bytes_on_one_simulated_world():
    trace, steps = _scenario(seed=7, n_prompts=1, n_decoders=1)
    assert len(trace) == 64 and steps > 0


def test_ten_engines_on_one_world_and_the_same_seed_gives_the_same_trace():
    first = _scenario(seed=11, n_prompts=4, n_decoders=6)
    second = _scenario(seed=11, n_prompts=4, n_decoders=6)
    assert first == second
    # the control: another seed (other blocks, pull and unlink orders, so other steps) gives another trace
    assert _scenario(seed=12, n_prompts=4, n_decoders=6)[0] != first[0]


def test_twenty_engines_on_one_world_link_pull_push_unlink_and_leave_nothing():
    trace, steps = _scenario(seed=21, n_prompts=4, n_decoders=16)
    assert len(trace) == 64 and steps > 0


def _pair(seed: int, extra: dict | None = None) -> tuple[World, _Engine, _Engine]:
    world = World(seed)
    rng = np.random.default_rng(seed)
    return world, _Engine(world, 1, LLMRole.PROMPT, rng, extra), _Engine(world, 100, LLMRole.DECODER, rng, extra)


def _finalize(world: World, *engines: _Engine) -> None:
    for e in engines:
        e.proc.finalize()
    world.settle()
    assert world.failures == []
    _assert_nothing_left(world)


@pytest.mark.parametrize("timeout_ms", [700, 2500])
def test_a_frozen_peer_fails_link_clusters_at_exactly_its_timeout_on_the_fake_clock(timeout_ms):
    world, p, d = _pair(seed=5)
    world.freeze(p.proc.runtime)   # as under SIGSTOP: its loop answers nothing
    began = world.now
    code, codes = d.dd.link_clusters([p.cluster(d)], timeout_ms)
    took = world.now - began
    assert code is not LLMStatusCode.LLM_SUCCESS and codes == [LLMStatusCode.LLM_LINK_FAILED], codes
    assert "timed out" in d.dd.statistics()["link_failures"][p.cluster_id]["error"]
    assert took == pytest.approx(timeout_ms / 1000, abs=1e-9)   # the configured deadline, to the nanosecond
    assert d.dd.statistics()["links"] == {}
    # the control: the same call once the peer runs again succeeds, and the bytes move
    world.thaw(p.proc.runtime)
    code, codes = d.dd.link_clusters([p.cluster(d)], timeout_ms)
    assert code is LLMStatusCode.LLM_SUCCESS, codes
    d.dd.cache_manager.pull_blocks(BlocksCacheKey(p.cluster_id, 0), d.cache, src_blocks=[3], dst_blocks=[5])
    np.testing.assert_array_equal(d.blocks()[:, 5], p.blocks()[:, 3])
    code, codes = d.dd.unlink_clusters([p.cluster(d)], 5000)
    assert code is LLMStatusCode.LLM_SUCCESS, codes
    _finalize(world, d, p)


@pytest.mark.parametrize("keepalive_ms,peer_timeout_ms", [(1000, 3000), (250, 1600)])
def test_a_peer_frozen_after_linking_is_lost_at_the_first_keepalive_tick_past_its_timeout(keepalive_ms,
                                                                                          peer_timeout_ms):
    """The decoder hears nothing more from the frozen prompt: its link fails at the first keepalive tick
    (every keepalive_ms from its start) at which the silence exceeds peer_timeout_ms, on the fake clock,
    and not one tick earlier."""
    world, p, d = _pair(seed=23, extra={"llmdd.keepalive_interval_ms": str(keepalive_ms),
                                        "llmdd.peer_timeout_ms": str(peer_timeout_ms)})
    start = world.now
    code, codes = d.dd.link_clusters([p.cluster(d)], 3000)
    assert code is LLMStatusCode.LLM_SUCCESS, codes
    assert world.now == start   # linking took no simulated time: the last message from the prompt is at start
    world.freeze(p.proc.runtime)
    tick, timeout = keepalive_ms / 1000, peer_timeout_ms / 1000
    ticks = int(timeout // tick) + 1   # the first tick at which the silence is more than the timeout
    expected = start + ticks * tick

    def state() -> str:
        return d.dd.statistics()["links"][p.cluster_id]["state"]

    assert world.run_until(lambda: state() == "failed", expected + 10)
    assert world.now == pytest.approx(expected, abs=1e-9), (world.now - start, expected - start)
    world.thaw(p.proc.runtime)
    d.dd.unlink_clusters([p.cluster(d)], 3000, force=True)
    _finalize(world, d, p)


def test_latency_and_loss_delay_the_link_on_the_fake_clock_and_keep_every_byte():
    """Every message takes 10 ms and some are lost (retransmitted 200 ms later): the link takes
    longer on the fake clock than without them, and the pulled bytes are still the owner's."""
    times = []
    for shaped in (False, True):
        world, p, d = _pair(seed=9)
        if shaped:
            world.net.latency = lambda _sock, _n: 0.010
            world.net.loss = 0.2
        began = world.now
        code, codes = d.dd.link_clusters([p.cluster(d)], 5000)
        assert code is LLMStatusCode.LLM_SUCCESS, codes
        times.append(world.now - began)
        src = [int(b) for b in world.random.sample(range(NUM_BLOCKS), 4)]
        d.dd.cache_manager.pull_blocks(BlocksCacheKey(p.cluster_id, 0), d.cache, src_blocks=src,
                                       dst_blocks=[0, 1, 2, 3])
        np.testing.assert_array_equal(d.blocks()[:, :4], p.blocks()[:, src])
        if shaped:
            assert world.net.stats["lost"] > 0
        d.dd.unlink_clusters([p.cluster(d)], 5000)
        _finalize(world, d, p)
    assert times[0] < 0.010 <= times[1]   # the control: no latency, no lost message: no time passes


def test_a_partition_times_the_link_out_and_after_the_heal_it_links():
    world, p, d = _pair(seed=13)
    world.net.partition([p.proc.runtime.process], [d.proc.runtime.process])
    began = world.now
    code, codes = d.dd.link_clusters([p.cluster(d)], 1500)
    assert codes == [LLMStatusCode.LLM_LINK_FAILED], codes
    assert world.now - began == pytest.approx(1.5, abs=1e-9)
    world.net.heal()
    code, codes = d.dd.link_clusters([p.cluster(d)], 1500)
    assert code is LLMStatusCode.LLM_SUCCESS, codes
    d.dd.unlink_clusters([p.cluster(d)], 5000)
    _finalize(world, d, p)


def test_a_crashed_peer_restarts_as_a_new_incarnation_and_serves_its_new_bytes():
    world, p, d = _pair(seed=17)
    code, codes = d.dd.link_clusters([p.cluster(d)], 3000)
    assert code is LLMStatusCode.LLM_SUCCESS, codes
    d.dd.cache_manager.pull_blocks(BlocksCacheKey(p.cluster_id, 0), d.cache, src_blocks=[1], dst_blocks=[1])
    old = p.proc.runtime
    p.proc.crash()
    assert old.crashed and world.fibers_of(old) == [] and open_endpoints(world) == 1   # the decoder's
    # the new incarnation: a new engine on the same port, its blocks cache of new seeded bytes
    rng = np.random.default_rng(99)
    p.proc.restart()
    assert p.proc.incarnation == 2 and p.proc.runtime.name == "e1#2"
    p.dd = p.proc.dd
    p.bufs = [rng.standard_normal((NUM_BLOCKS, BLOCK_ELEMS)).astype(np.float32) for _ in range(NUM_TENSORS)]
    desc = CacheDesc(NUM_TENSORS, [NUM_BLOCKS, BLOCK_ELEMS], DataType.DT_FLOAT)
    p.cache = p.dd.cache_manager.register_blocks_cache(desc, [b.ctypes.data for b in p.bufs], BlocksCacheKey(1, 0))
    # the decoder learns the old one is gone (its connection closed) and links to the new one
    world.run(0.0)
    assert d.dd.statistics()["links"][p.cluster_id]["state"] == "failed"
    with pytest.raises(LLMException) as failed:   # never served by the old incarnation, nor the new one unlinked
        d.dd.cache_manager.pull_blocks(BlocksCacheKey(p.cluster_id, 0), d.cache, src_blocks=[6], dst_blocks=[0])
    assert failed.value.status_code is LLMStatusCode.LLM_LINK_FAILED, failed.value
    code, codes = d.dd.unlink_clusters([p.cluster(d)], 3000, force=True)
    assert code is LLMStatusCode.LLM_SUCCESS and d.dd.statistics()["links"] == {}, codes
    code, codes = d.dd.link_clusters([p.cluster(d)], 3000)
    assert code is LLMStatusCode.LLM_SUCCESS, codes
    d.dd.cache_manager.pull_blocks(BlocksCacheKey(p.cluster_id, 0), d.cache, src_blocks=[6, 2], dst_blocks=[0, 7])
    np.testing.assert_array_equal(d.blocks()[:, [0, 7]], p.blocks()[:, [6, 2]])
    d.dd.unlink_clusters([p.cluster(d)], 5000)
    _finalize(world, d, p)
