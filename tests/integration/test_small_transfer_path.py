"""The small-transfer path of pull_blocks / push_blocks (issue 21) across two processes.

A blocking ``pull_blocks`` / ``push_blocks`` with a ``BlocksCacheKey``, no tag and a few int blocks
takes the engine's small-transfer path (a plan kept per call shape, notices queued for the
flusher).  These tests check that it keeps the full path's contract: the bytes (compared on the
other side), one owner event per transfer in order, the same status for every bad argument (the
same call with a tag takes the full path: the control), and plans that follow the peer's tables.
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
TRANSPORTS = ["tcp", "shm"]
KW = {"remote_accessible": True}

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def peer_pool():
    pool = P.PeerPool(ENV)
    yield pool
    pool.close()


def _pair(peer_pool, transport):
    p, d, port = peer_pool.pair(transport, prompt_kw=KW, decoder_kw=KW)
    return p, d, port


def _linked(d, port):
    assert d.call(P.link, PROMPT, port) == ["LLM_SUCCESS", "LLM_SUCCESS"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_back_to_back_pushes_each_fire_one_peer_written_event_in_order(peer_pool, transport):
    p, d, port = _pair(peer_pool, transport)
    nl, nb, bs = 2, 64, 2048
    dst_id = p.call(P.register, "dst", nl, [nb, bs], blocks=True, key=BlocksCacheKey(PROMPT, 0))
    d.call(P.register, "src", nl, [nb, bs], blocks=True, seed=211, key=BlocksCacheKey(DECODER, 0))
    p.call(P.subscribe)
    _linked(d, port)
    rng = np.random.default_rng(5)
    pairs = [(int(s), int(t)) for s, t in zip(rng.integers(0, nb, 64), rng.integers(0, nb, 64))]
    assert d.call(S.push_many, PROMPT, 0, "src", pairs, nl) == len(pairs)
    written = p.call(P.wait_events, "cache", "peer_written", len(pairs), 20.0)
    assert len(written) == len(pairs), f"{len(written)} peer_written events for {len(pairs)} pushes"
    assert [ev["info"]["blocks"] for ev in written] == [[[t, t + 1]] for _, t in pairs]
    assert all(ev["id"] == dst_id and ev["info"]["peer"] == DECODER and not ev["error"]
               and ev["info"]["tensors"] == [0, nl] for ev in written)
    src = d.call(P.snapshot, "src").reshape(nl, nb, bs)
    dst = p.call(P.snapshot, "dst").reshape(nl, nb, bs)
    last = {t: s for s, t in pairs}   # a destination pushed twice holds its last source
    for t, s in last.items():
        assert np.array_equal(dst[:, t], src[:, s])
    untouched = sorted(set(range(nb)) - set(last))
    assert not dst[:, untouched].any()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_back_to_back_pulls_each_fire_one_peer_read_event(peer_pool, transport):
    p, d, port = _pair(peer_pool, transport)
    nl, nb, bs = 2, 32, 4096
    src_id = p.call(P.register, "src", nl, [nb, bs], blocks=True, seed=223, key=BlocksCacheKey(PROMPT, 0))
    d.call(P.register, "dst", nl, [nb, bs], blocks=True)
    p.call(P.subscribe)
    _linked(d, port)
    rng = np.random.default_rng(6)
    pairs = [(int(s), int(t)) for s, t in zip(rng.integers(0, nb, nb), rng.permutation(nb))]
    assert d.call(S.pull_many, PROMPT, 0, "dst", pairs, nl) == len(pairs)
    read = p.call(P.wait_events, "cache", "peer_read", len(pairs), 20.0)
    assert [ev["info"]["blocks"] for ev in read] == [[[s, s + 1]] for s, _ in pairs]
    assert all(ev["id"] == src_id and ev["info"]["peer"] == DECODER for ev in read)
    src = p.call(P.snapshot, "src").reshape(nl, nb, bs)
    dst = d.call(P.snapshot, "dst").reshape(nl, nb, bs)
    for s, t in pairs:
        assert np.array_equal(dst[:, t], src[:, s])


# (method, src blocks, dst blocks, keyword arguments) that the contract refuses
_PULL_BAD = [
    ([True], [0], {}),                       # a bool block passes upstream's check as 1, both ways
    ([-1], [0], {}),
    ([0], [2**64], {}),
    ([0, 1], [0], {}),
    ([], [], {}),
    ([0], [99], {}),                         # out of the destination's blocks
    ([99], [0], {}),                         # out of the source's blocks
    ([0], [0], {"src_layer_range": range(0, 2, 2), "dst_layer_range": range(0, 1)}),
    ([0], [0], {"src_layer_range": range(0, 1), "dst_layer_range": range(1, 0)}),
    ([0], [0], {"src_layer_range": range(0, 3), "dst_layer_range": range(0, 3)}),
    ([0], [0], {"tensor_num_per_layer": 0}),
    ([0], [0], {"tensor_num_per_layer": True}),   # passes as 1, both ways
    ([0], [0], {"tensor_num_per_layer": 3}),
    ([0], [0], {"bogus": 1}),
    ([0.0], [0], {}),
    ((0,), (1,), {}),                        # tuples are fine
]


@pytest.mark.parametrize("transport", ["shm"])
def test_pull_blocks_bad_arguments_get_the_full_paths_status(peer_pool, transport):
    p, d, port = _pair(peer_pool, transport)
    nl, nb, bs = 2, 8, 1024
    p.call(P.register, "src", nl, [nb, bs], blocks=True, seed=227, key=BlocksCacheKey(PROMPT, 0))
    d.call(P.register, "dst", nl, [nb, bs], blocks=True)
    _linked(d, port)
    key = BlocksCacheKey(PROMPT, 0)
    base = {"src_layer_range": range(0, 1), "dst_layer_range": range(0, 1), "tensor_num_per_layer": 2}
    # a good call first, so that the shape's plan is kept when the bad ones come
    assert d.call(S.outcome, "pull_blocks", key, "@dst", [1], [2], **base) == "LLM_SUCCESS"
    assert d.call(S.plans) == 1
    seen = []
    for src, dst, kw in _PULL_BAD:
        args = {**base, **kw}
        quick = d.call(S.outcome, "pull_blocks", key, "@dst", src, dst, **args)
        full = d.call(S.outcome, "pull_blocks", key, "@dst", src, dst, tag=b"full-path", **args)
        assert quick == full, f"{src}, {dst}, {kw}: {quick} without a tag, {full} with one"
        seen.append(quick)
    # a bool block and a bool tensor_num_per_layer pass as the ints they stand for (as upstream), tuples are
    # lists: every other call is refused
    assert [bad for got, bad in zip(seen, _PULL_BAD) if got == "LLM_SUCCESS"] == [
        ([True], [0], {}), ([0], [0], {"tensor_num_per_layer": True}), ((0,), (1,), {})]
    assert "LLM_PARAM_INVALID" in seen and "TypeError" in seen


@pytest.mark.parametrize("transport", ["shm"])
def test_push_blocks_bad_arguments_get_the_full_paths_status(peer_pool, transport):
    p, d, port = _pair(peer_pool, transport)
    nl, nb, bs = 2, 8, 1024
    p.call(P.register, "dst", nl, [nb, bs], blocks=True, key=BlocksCacheKey(PROMPT, 0))
    d.call(P.register, "src", nl, [nb, bs], blocks=True, seed=229, key=BlocksCacheKey(DECODER, 0))
    _linked(d, port)
    key = BlocksCacheKey(PROMPT, 0)
    assert d.call(S.outcome, "push_blocks", key, "@src", [1], [2], range(0, 1), range(0, 1), 2) == "LLM_SUCCESS"
    bad = [([-1], [0], range(0, 1), range(0, 1), 2), ([0], [99], range(0, 1), range(0, 1), 2),
           ([0], [0], range(0, 2, 2), range(0, 1), 2), ([0], [0], range(0, 1), range(0, 2), 2),
           ([0], [0], range(0, 1), range(0, 1), 0), ([0], [0], range(0, 1), range(0, 1), 3),
           ([0], [0], range(0, 3), range(0, 3), 1), ([True], [1], range(0, 1), range(0, 1), 2)]
    seen = []
    for args in bad:
        quick = d.call(S.outcome, "push_blocks", key, "@src", *args)
        full = d.call(S.outcome, "push_blocks", key, "@src", *args, tag="full-path")
        assert quick == full, f"{args}: {quick} without a tag, {full} with one"
        seen.append(quick)
    assert seen.count("LLM_SUCCESS") == 1 and "LLM_PARAM_INVALID" in seen


@pytest.mark.parametrize("transport", ["shm"])
def test_kept_plan_follows_a_reregistered_remote_cache(peer_pool, transport):
    p, d, port = _pair(peer_pool, transport)
    nl, nb, bs = 2, 16, 2048
    p.call(P.register, "a", nl, [nb, bs], blocks=True, seed=233, key=BlocksCacheKey(PROMPT, 0))
    d.call(P.register, "dst", nl, [nb, bs], blocks=True)
    _linked(d, port)
    assert d.call(S.pull_many, PROMPT, 0, "dst", [(3, 4)], nl) == 1
    first = p.call(P.snapshot, "a").reshape(nl, nb, bs)
    assert np.array_equal(d.call(P.snapshot, "dst").reshape(nl, nb, bs)[:, 4], first[:, 3])
    # the owner replaces the cache behind the key: fewer blocks, other bytes
    p.call(S.unregister, "a")
    p.call(P.register, "b", nl, [nb // 2, bs], blocks=True, seed=239, key=BlocksCacheKey(PROMPT, 0))
    second = p.call(P.snapshot, "b").reshape(nl, nb // 2, bs)
    assert not np.array_equal(first[:, 3], second[:, 3])
    wanted = second[:, 3]

    def pulled_new() -> bool:
        status = d.call(S.outcome, "pull_blocks", BlocksCacheKey(PROMPT, 0), "@dst", [3], [4],
                        src_layer_range=range(nl), dst_layer_range=range(nl), tensor_num_per_layer=1)
        return status == "LLM_SUCCESS" and np.array_equal(d.call(P.snapshot, "dst").reshape(nl, nb, bs)[:, 4], wanted)

    # the table update travels asynchronously: poll (bounded) until the pull sees the new cache
    import time
    deadline = time.monotonic() + 10
    while not pulled_new():
        assert time.monotonic() < deadline, "the pull never saw the re-registered cache"
        time.sleep(0.01)
    # block 12 existed in the old cache only: refused now, nothing lands
    d.call(P.fill, "dst", 0)
    status = d.call(S.outcome, "pull_blocks", BlocksCacheKey(PROMPT, 0), "@dst", [12], [5],
                    src_layer_range=range(nl), dst_layer_range=range(nl), tensor_num_per_layer=1)
    assert status == "LLM_PARAM_INVALID"
    assert not d.call(P.snapshot, "dst").any()


@pytest.mark.parametrize("transport", ["shm"])
def test_a_subscriber_registered_after_init_gets_the_later_task_events(peer_pool, transport):
    p, d, port = _pair(peer_pool, transport)
    nl, nb, bs = 1, 8, 1024
    p.call(P.register, "src", nl, [nb, bs], blocks=True, seed=241, key=BlocksCacheKey(PROMPT, 0))
    d.call(P.register, "dst", nl, [nb, bs], blocks=True)
    _linked(d, port)
    assert d.call(S.pull_many, PROMPT, 0, "dst", [(1, 1), (2, 2)], nl) == 2   # nobody listens yet
    d.call(P.subscribe)
    assert d.call(S.pull_many, PROMPT, 0, "dst", [(3, 3)], nl) == 1
    events = d.call(P.events, "task")
    assert [e["trigger"] for e in events] == ["start", "transfer_succeeded"]
    assert all(e["info"]["kind"] == "pull_blocks" and e["info"]["bytes"] == bs and e["info"]["peer"] == PROMPT
               for e in events)
    assert events[0]["id"] == events[1]["id"]


def test_small_transfers_over_shm_take_the_one_call_path(peer_pool):
    """With the C extension (required where LLMDD_REQUIRE_NATIVE=1: CI), a small pull_blocks /
    push_blocks over shm is one call of the channel's quick path: its counter grows by one per call
    and the bytes land; the same calls with a tag (the full path, the control) leave it alone."""
    p, d, port = _pair(peer_pool, "shm")
    nl, nb, bs = 2, 16, 8192
    p.call(P.register, "src", nl, [nb, bs], blocks=True, seed=241, key=BlocksCacheKey(PROMPT, 0))
    d.call(P.register, "dst", nl, [nb, bs], blocks=True)
    _linked(d, port)
    first = d.call(S.shm_channel, PROMPT)
    if not first["native"]:
        assert os.environ.get("LLMDD_REQUIRE_NATIVE") != "1", "the shm C path silently fell back in a child"
        pytest.skip("the shm C extension is not active here")
    rng = np.random.default_rng(7)
    pairs = [(int(s), int(t)) for s, t in zip(rng.integers(0, nb, 12), rng.permutation(nb)[:12])]
    assert d.call(S.pull_many, PROMPT, 0, "dst", pairs, nl) == len(pairs)
    mid = d.call(S.shm_channel, PROMPT)["stats"]
    assert mid["quick_batches"] - first["stats"].get("quick_batches", 0) == len(pairs)
    assert mid["bytes_read"] - first["stats"]["bytes_read"] == len(pairs) * nl * bs
    src = p.call(P.snapshot, "src").reshape(nl, nb, bs)
    dst = d.call(P.snapshot, "dst").reshape(nl, nb, bs)
    for s, t in pairs:
        assert np.array_equal(dst[:, t], src[:, s])
    key = BlocksCacheKey(PROMPT, 0)
    kw = {"src_layer_range": range(0, nl), "dst_layer_range": range(0, nl), "tensor_num_per_layer": 1}
    assert d.call(S.outcome, "pull_blocks", key, "@dst", [1], [2], tag=b"full", **kw) == "LLM_SUCCESS"
    after = d.call(S.shm_channel, PROMPT)["stats"]
    assert after["quick_batches"] == mid["quick_batches"]
    assert after["bytes_read"] - mid["bytes_read"] == nl * bs
    assert d.call(S.outcome, "pull_blocks", key, "@dst", [1], [2], **kw) == "LLM_SUCCESS"
    assert d.call(S.shm_channel, PROMPT)["stats"]["quick_batches"] == mid["quick_batches"] + 1


def test_a_task_listener_gets_every_event_and_unwatched_tasks_are_still_counted(peer_pool):
    """Unwatched small transfers take the one-call path and still count their task transitions
    (start, transfer_succeeded) in the lifecycle statistics; once a task listener is registered they
    take the ops path, so that every event is built (one start and one succeeded per call)."""
    p, d, port = _pair(peer_pool, "shm")
    nl, nb, bs = 1, 8, 4096
    p.call(P.register, "src", nl, [nb, bs], blocks=True, seed=251, key=BlocksCacheKey(PROMPT, 0))
    d.call(P.register, "dst", nl, [nb, bs], blocks=True)
    _linked(d, port)
    native = d.call(S.shm_channel, PROMPT)["native"]
    pairs = [(1, 2), (3, 4), (5, 6)]
    t0, q0 = d.call(S.task_triggers), d.call(S.shm_channel, PROMPT)["stats"].get("quick_batches", 0)
    assert d.call(S.pull_many, PROMPT, 0, "dst", pairs, nl) == 3
    t1, q1 = d.call(S.task_triggers), d.call(S.shm_channel, PROMPT)["stats"].get("quick_batches", 0)
    for trig in ("start", "transfer_succeeded"):
        assert t1.get(trig, 0) - t0.get(trig, 0) == 3, (t0, t1)
    assert q1 - q0 == (3 if native else 0)
    d.call(P.subscribe)
    assert d.call(S.pull_many, PROMPT, 0, "dst", [(7, 0), (2, 1)], nl) == 2
    evs = [e for e in d.call(P.events, "task") if e["trigger"] in ("start", "transfer_succeeded")]
    assert [e["trigger"] for e in evs] == ["start", "transfer_succeeded"] * 2, evs
    assert d.call(S.shm_channel, PROMPT)["stats"].get("quick_batches", 0) == q1   # the ops path ran
    t2 = d.call(S.task_triggers)
    assert t2["transfer_succeeded"] - t1["transfer_succeeded"] == 2
    dst = d.call(P.snapshot, "dst").reshape(nl, nb, bs)
    src = p.call(P.snapshot, "src").reshape(nl, nb, bs)
    for s, t in pairs + [(7, 0), (2, 1)]:
        assert np.array_equal(dst[:, t], src[:, s])
