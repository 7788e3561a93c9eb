"""Fenced pulls (llmdd._data.fence, docs/fencing.md) across two processes, per transport.

The race: a decoder's pull of four blocks is held by its fault plan (the faults plugin's
``partition`` of the first read batch: not posted until healed), the owner meanwhile fences those
blocks and overwrites them with new seeded random bytes (their next user), then the read goes on and
copies the new bytes.  Fenced, the pull fails with ``LLM_KV_CACHE_NOT_EXIST`` and the owner sees its
tag with a failure, never a success.  The control runs the same race without a fence: the pull
reports success with the new (wrong) bytes, which shows the race is real and the check is what
catches it.  A fence after a completed pull leaves that pull's success (and bytes) alone, and a
later pull expecting the old generations fails without any stall (a late read).
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
import _fence_peers as F  # noqa: E402

try:
    from llmdd_ucx import UcxTransport
    _UCX = UcxTransport.probe()
    _UCX_OK, _UCX_WHY = _UCX.available, _UCX.reason
except ImportError as exc:  # pragma: no cover - the plugin is not installed
    _UCX_OK, _UCX_WHY = False, str(exc)

ENV = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
TRANSPORTS = ["shm", "tcp", pytest.param("ucx", marks=pytest.mark.skipif(not _UCX_OK,
                                                                         reason=f"ucx unavailable: {_UCX_WHY}"))]
PROMPT, DECODER = 1, 2
KEY = BlocksCacheKey(PROMPT, 0)
NT, NB, BS = 4, 16, 4096              # 4 tensors x 16 blocks x 4 KiB
SRC, DST = [2, 3, 4, 9], [0, 1, 2, 3]
#: sync_kv_timeout of both engines: the held read must not reach it while the test drives the owner
SYNC_MS = 20000
WAIT_S = SYNC_MS / 1000 + 10          # a pull ends by its deadline (plus the check's round trip)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def peer_pool():
    pool = P.PeerPool(ENV)
    yield pool
    pool.close()


def _pair(pool, transport: str, *, stall_read: bool):
    kw = {"sync_ms": SYNC_MS, "remote_accessible": transport == "ucx"}
    p, d, port = pool.pair(transport, prompt_kw=kw, decoder_kw=kw)
    d.call(F.setup_stalled_decoder, DECODER, transport=transport, sync_ms=SYNC_MS, stall_read=stall_read,
           remote_accessible=transport == "ucx", timeout=None)
    p.call(P.register, "src", NT, [NB, BS], blocks=True, seed=11, key=KEY)
    p.call(P.subscribe)
    d.call(P.register, "dst", NT, [NB, BS], blocks=True)
    d.call(P.fill, "dst", 0xA5)
    assert d.call(P.link, PROMPT, port) == ["LLM_SUCCESS", "LLM_SUCCESS"]
    assert d.call(P.link_info, PROMPT)["transport"] == transport
    return p, d


def _blocks(snapshot: np.ndarray, blocks: list) -> np.ndarray:
    return snapshot.reshape(NT, NB, BS)[:, blocks]


def _race(pool, transport: str, *, fenced: bool, tag: str) -> tuple:
    """The held pull, the owner's fence and reuse meanwhile; (outcome, old bytes, new bytes, pulled bytes,
    the owner's read events)."""
    p, d = _pair(pool, transport, stall_read=True)
    old = _blocks(p.call(P.snapshot, "src"), SRC)
    fence = p.call(F.block_fence, "src", SRC) if fenced else None
    d.call(F.start_pull, "race", KEY, "dst", SRC, DST, fence, tag)
    assert d.call(F.wait_stalled, SYNC_MS / 1000, timeout=WAIT_S) == 1, "the read was not held"
    p.call(F.fence_blocks, "src", SRC)                      # handed back: fenced first, then reused
    p.call(F.reuse_blocks, "src", NB, SRC, 12)
    new = _blocks(p.call(P.snapshot, "src"), SRC)
    d.call(F.heal)
    out = d.call(F.join_pull, "race", WAIT_S, timeout=WAIT_S + 5)
    pulled = _blocks(d.call(P.snapshot, "dst"), DST)
    p.call(P.wait_events, "cache", "peer_read", 1, WAIT_S, timeout=WAIT_S + 5)
    return out, old, new, pulled, p.call(F.owner_read_events)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_pull_whose_blocks_are_fenced_while_it_is_held_fails_typed_and_reports_no_success(peer_pool, transport):
    try:
        out, old, new, pulled, events = _race(peer_pool, transport, fenced=True, tag="req-fenced")
        assert out["status"] == "LLM_KV_CACHE_NOT_EXIST", out
        assert "handed the blocks back" in out["message"]
        assert not np.array_equal(old, new)
        # the late read did copy the next user's bytes: the check, not luck, failed the pull
        assert np.array_equal(pulled, new)
        assert events == [("req-fenced", True)], "the owner must see the tag's failure and no success"
    finally:
        peer_pool.discard()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_control_the_same_race_unfenced_reports_success_with_wrong_bytes(peer_pool, transport):
    try:
        out, old, new, pulled, events = _race(peer_pool, transport, fenced=False, tag="req-plain")
        assert out["status"] == "LLM_SUCCESS", out
        assert np.array_equal(pulled, new) and not np.array_equal(pulled, old), "the race did not happen"
        assert events == [("req-plain", False)]
    finally:
        peer_pool.discard()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_fence_after_a_completed_pull_keeps_its_success_and_fails_a_late_one(peer_pool, transport):
    try:
        p, d = _pair(peer_pool, transport, stall_read=False)
        old = _blocks(p.call(P.snapshot, "src"), SRC)
        fence = p.call(F.block_fence, "src", SRC)
        assert fence["generations"] == [0, 0, 0, 0]
        d.call(F.start_pull, "first", KEY, "dst", SRC, DST, fence, "req-1")
        assert d.call(F.join_pull, "first", WAIT_S, timeout=WAIT_S + 5)["status"] == "LLM_SUCCESS"
        p.call(F.fence_blocks, "src", SRC[:2])             # the read was acknowledged: hand back
        assert np.array_equal(_blocks(d.call(P.snapshot, "dst"), DST), old)
        later = p.call(F.block_fence, "src", SRC)
        assert later["epoch"] == fence["epoch"] and later["generations"] == [1, 1, 0, 0]
        # a late pull with the old expectation fails (no stall: the check alone), bytes not to be used
        d.call(F.start_pull, "late", KEY, "dst", SRC, DST, fence, "req-2")
        assert d.call(F.join_pull, "late", WAIT_S, timeout=WAIT_S + 5)["status"] == "LLM_KV_CACHE_NOT_EXIST"
        # only the unfenced blocks, expected as they are: success
        d.call(F.start_pull, "rest", KEY, "dst", SRC[2:], DST[2:], {"epoch": fence["epoch"],
                                                                   "generations": [0, 0]}, "req-3")
        assert d.call(F.join_pull, "rest", WAIT_S, timeout=WAIT_S + 5)["status"] == "LLM_SUCCESS"
        # another epoch (another registration) never passes
        d.call(F.start_pull, "epoch", KEY, "dst", SRC, DST, {"epoch": fence["epoch"] ^ 1,
                                                             "generations": later["generations"]}, None)
        assert d.call(F.join_pull, "epoch", WAIT_S, timeout=WAIT_S + 5)["status"] == "LLM_KV_CACHE_NOT_EXIST"
        p.call(P.wait_events, "cache", "peer_read", 3, WAIT_S, timeout=WAIT_S + 5)
        assert p.call(F.owner_read_events) == [("req-1", False), ("req-2", True), ("req-3", False)]
    finally:
        peer_pool.discard()


def test_notes_reach_the_owner_as_one_peer_note_event(peer_pool):
    try:
        p, d = _pair(peer_pool, "tcp", stall_read=False)
        assert d.call(F.notify, KEY, ["renew:req-1", "abort:req-2"]) == "LLM_SUCCESS"
        p.call(P.wait_events, "cache", "peer_note", 1, 10.0, timeout=15)
        assert p.call(F.note_events) == [(DECODER, ["renew:req-1", "abort:req-2"])]
        assert d.call(F.notify, BlocksCacheKey(PROMPT, 5), ["x"]) == "LLM_KV_CACHE_NOT_EXIST"
    finally:
        peer_pool.discard()
