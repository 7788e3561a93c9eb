"""Regressions of the hardening issue, one named test per finding.

* registration churn on a server while clients link, pull and unlink: no deadlock, every call by
  its deadline, right bytes (the region table and memory manager never call out under a lock);
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import _hardening_peers as H  # noqa: E402
import _rel_peers as R  # noqa: E402

from llmdd.testing._harness import Cluster  # noqa: E402

ENV = {"LLMDD_AUTH_SECRET": None, "LLMDD_FAULTS": None}
PROMPT, DECODER = 1, 2
NT, NB, BS = 2, 8, 4096

#: length of the churn (the whole test stays near 20 s on a 2-core machine)
CHURN_S = 12.0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_registration_churn_while_clients_link_pull_and_unlink_never_deadlocks(transport):
    with Cluster(env=ENV) as cluster:
        server, client = cluster.spawn("churn_server", "churn_client")
        port = server.call(R.setup, "PROMPT", PROMPT, listen=True, transport=transport)
        server.call(R.register_blocks, "src", NT, NB, BS, seed=3, key=(PROMPT, 0))
        client.call(R.setup, "DECODER", DECODER, transport=transport)
        client.call(R.register_blocks, "dst", NT, NB, BS)
        server.call(H.churn_start, NT, NB, BS)
        try:
            out = client.call(H.link_pull_unlink_loop, PROMPT, port, CHURN_S, NT, NB, BS, 3,
                              timeout=CHURN_S + 30)
        finally:
            churn = server.call(H.churn_stop, 10.0, timeout=20)
        assert churn["joined"], f"a register/unregister call on the server never returned: {churn}"
        assert churn["rounds"] > 20, churn
        assert not churn["errors"], churn
        assert not out["over_deadline"], out
        assert out["rounds"] >= 5, out
        assert out["linked"] >= 0.8 * out["rounds"], out
        assert out["pulled"] == out["linked"], out      # the stable cache is never touched by the churn
        assert out["wrong_bytes"] == 0, out
        print(f"churn {transport}: server rounds {churn['rounds']}, client {out}")
        # the server is still healthy afterwards: a fresh link and a verified pull
        res = client.call(H.link_pull_unlink_loop, PROMPT, port, 0.01, NT, NB, BS, 3)
        assert res["pulled"] >= 1 and res["pulled"] == res["linked"] and res["wrong_bytes"] == 0, res


# ---------------------------------------------------------------------------- bounded peer input
from hypothesis import HealthCheck, Phase, given, settings, strategies as st  # noqa: E402

import numpy as np  # noqa: E402

from llmdd import LLMStatusCode  # noqa: E402
from llmdd._protocol import messages as m  # noqa: E402
from llmdd.testing import peer_snapshot  # noqa: E402

BIG = [0, 1, 2, 7, 255, 2**16, 10**9, 2**31 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**64 - 1]
u64 = st.sampled_from(BIG) | st.integers(0, 2**64 - 1)
i64 = st.sampled_from([-1, 0, 1, 2, 3, 10**9, 2**63 - 1, -2**63]) | st.integers(-2**63, 2**63 - 1)
small_ids = st.integers(0, 8)


@st.composite
def spans(draw, max_size=8):
    out = []
    for _ in range(draw(st.integers(0, max_size))):
        a = draw(u64)
        b = draw(st.sampled_from([a, a + 1, 2**64 - 1]) | st.integers(a, 2**64 - 1))
        out.append(m.Span(start=a, stop=min(b, 2**64 - 1)))
    return tuple(out)


@st.composite
def transfer_done(draw, tagged=False):
    tag = draw(st.binary(max_size=m.MAX_TAG_BYTES) if tagged else st.none() | st.binary(max_size=m.MAX_TAG_BYTES))
    return m.TransferDone(cache_id=draw(small_ids | i64), block_spans=draw(spans()),
                          tensors=draw(st.none() | spans(max_size=1).map(lambda t: t[0] if t else None)),
                          failed=draw(st.booleans()), status=draw(st.integers(0, 2**32 - 1)), tag=tag,
                          tag_str=tag is not None and draw(st.booleans()))


junk = st.recursive(st.none() | st.booleans() | u64 | i64 | st.text(max_size=8) | st.binary(max_size=8),
                    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                    max_leaves=12)
arg_values = (junk | st.lists(u64, min_size=2, max_size=2) | st.sampled_from([[0, 10**9], [0, 2**40], [5, 2],
                                                                               [[0, 2**40]] * 3]))
ARG_NAMES = ["id", "model_id", "cache_id", "tensors", "blocks", "failed", "batch_index"]
OPS = ["reserve_key", "consume_key", "engine_info", "link_descriptor", "release_key", "push_done", "no_such_op"]
key_refs = st.one_of(st.builds(m.KeyRef.for_req, u64, i64), st.builds(m.KeyRef.for_prefix, u64, i64),
                     st.builds(m.KeyRef.for_blocks, i64))

post_link_messages = st.one_of(
    st.builds(lambda op, args, rid: m.TransferRequest(request_id=rid, op=op, args=args),
              st.sampled_from(OPS) | st.text(max_size=12),
              st.dictionaries(st.sampled_from(ARG_NAMES) | st.text(max_size=6), arg_values, max_size=6), u64),
    st.builds(lambda k, c, s: m.KeyConsumed(key=k, cache_id=c, tensor_spans=s), key_refs, small_ids | i64, spans()),
    st.builds(lambda i, mid: m.ReleaseKey(id=i, model_id=mid), u64, u64),
    st.builds(lambda entries: m.PushDone(entries=entries), st.lists(transfer_done(), max_size=6).map(tuple)),
    st.builds(lambda rid, push, e: m.TaggedDone(request_id=rid, push=push, entry=e), u64, st.booleans(),
              transfer_done(tagged=True)),
    st.builds(lambda entries: m.ReadDone(entries=entries), st.lists(st.builds(
        lambda c, s: m.ReadDoneEntry.from_spans(cache_id=c, block_spans=s), small_ids | i64, spans()), max_size=6).map(tuple)),
    st.builds(lambda v, f, rem: m.RegionsUpdate(version=v, full=f, removed=rem), u64, st.booleans(),
              st.lists(st.integers(0, 2**32 - 1), max_size=4).map(tuple)),
    st.builds(lambda v, f, rem: m.CacheTableUpdate(version=v, full=f, caches_removed=rem), u64, st.booleans(),
              st.lists(small_ids, max_size=4).map(tuple)),
    st.builds(lambda s, t: m.Keepalive(seq=s, sent_at_ns=t), u64, u64),
    st.builds(lambda s, e, t: m.KeepaliveAck(seq=s, echo_sent_at_ns=e, sent_at_ns=t), u64, u64, u64),
    st.builds(lambda r, c, res: m.TransferReply(request_id=r, status_code=c, result=res), u64, i64,
              st.dictionaries(st.text(max_size=6), junk, max_size=3)),
    st.builds(lambda r, c: m.UnlinkAck(request_id=r, status_code=c), u64, i64),
    st.builds(lambda c, msg, f: m.Error(status_code=c, message=msg, fatal=f), i64, st.text(max_size=20),
              st.booleans()),
)

HOSTILE_MESSAGES = 1000
#: how long the owner may take to finish the threads of links it failed (a loaded 2-core machine)
SETTLE_S = 5.0
BATCH = 5
RSS_BOUND = 32 << 20
#: deadline of the probe request after a batch (the owner answers in milliseconds when it is responsive)
PROBE_S = 2.0


def _reserve(hostile, req_id: int) -> dict:
    out = hostile.peer.call(H.request_raw, PROMPT, "reserve_key", {"id": req_id, "model_id": 0}, PROBE_S)
    assert out["status"] == 0, out
    return out


def _assert_refused_link_failed(hostile, out: dict, violation: str) -> None:
    """A refused request whose violation fails the link.  The owner sends its fatal Error, fails the
    link, then answers; the peer sees one of two outcomes, checked for the one that happened: the
    answer (LLM_PARAM_INVALID naming the violation) came in before the Error failed the link, or
    the Error came first and the request ended LLM_LINK_FAILED.  Either way the link is failed."""
    if out["status"] == LLMStatusCode.LLM_PARAM_INVALID.value:
        assert violation in out["error"], out
    else:
        assert out["status"] == "LLM_LINK_FAILED", out
    assert hostile.peer.call(H.wait_link_failed, PROMPT, PROBE_S) == "failed"


def _relink(hostile) -> None:
    hostile.peer.call(R.unlink, [(PROMPT, hostile.port)], True)
    hostile.warm()


def test_regression_consume_key_naming_a_billion_tensors_is_refused_without_work(hostile):
    """A consume_key request for tensors [0, 10^9] used to build a set of 10^9 ints on the owner
    (MemoryError or 2.4 GiB RSS, the link's reader blocked).  Now: refused with LLM_PARAM_INVALID
    before any work, the link failed (out-of-table indices), the owner's RSS unchanged."""
    _relink(hostile)
    before = hostile.owner.call(peer_snapshot)
    _reserve(hostile, 1)
    out = hostile.peer.call(H.request_raw, PROMPT, "consume_key",
                            {"id": 1, "model_id": 0, "cache_id": 2, "tensors": [0, 10**9]}, PROBE_S)
    _assert_refused_link_failed(hostile, out, "consume_key tensors [0, 1000000000) is outside [0, 2)")
    after = hostile.owner.call(peer_snapshot)
    assert after.rss_bytes - before.rss_bytes < 8 << 20, (before.rss_bytes, after.rss_bytes)
    # the key the hostile peer reserved went back to the table with its link: a good pull still works
    _relink(hostile)
    assert hostile.peer.call(R.allocate, "kvdst", NT, [4, 1024]) > 0
    assert hostile.peer.call(R.transfer, "pull_cache", ("key", PROMPT, 1, 0), "kvdst", 0)[0] == "LLM_SUCCESS"
    got = hostile.peer.call(R.snapshot, "kvdst")
    want = R.pattern(PROMPT, 6, NT, 4 * 1024)
    np.testing.assert_array_equal(got[:, :1024], want[:, :1024])


def test_regression_consume_key_with_a_tensor_range_past_sys_maxsize_is_refused_and_fails_the_link(hostile):
    """A consume_key request for tensors [0, 2^64-1] made the owner take len() of a range past
    sys.maxsize: an OverflowError, answered as an untyped LLM_FAILED, logged as a handler error on
    every such message, the link kept.  Now: refused like any out-of-table range (LLM_PARAM_INVALID
    naming the range, the link failed), and the reserved key goes back with the link (a good pull by
    that key then gets the right bytes)."""
    hostile.owner.call(R.allocate, "kv3", NT, [1, 1024], seed=7, keys=((PROMPT, 3, 0),))
    cache_id = hostile.owner.call(H.cache_id_of, "kv3")
    _relink(hostile)
    _reserve(hostile, 3)
    out = hostile.peer.call(H.request_raw, PROMPT, "consume_key",
                            {"id": 3, "model_id": 0, "cache_id": cache_id, "tensors": [0, 2**64 - 1]}, PROBE_S)
    _assert_refused_link_failed(hostile, out, f"consume_key tensors [0, {2**64 - 1}) is outside [0, {NT})")
    _relink(hostile)
    assert hostile.peer.call(R.allocate, "kvdst3", NT, [1, 1024]) > 0
    assert hostile.peer.call(R.transfer, "pull_cache", ("key", PROMPT, 3, 0), "kvdst3", 0)[0] == "LLM_SUCCESS"
    np.testing.assert_array_equal(hostile.peer.call(R.snapshot, "kvdst3"), R.pattern(PROMPT, 7, NT, 1024))


def test_regression_key_consumed_notice_with_a_2_pow_40_span_is_refused_without_work(hostile):
    """A KeyConsumed notice whose tensor span is [0, 2^40) used to build a Python set of 2^40 ints.
    Now: a fatal Error back to the peer, its link failed, RSS unchanged, the owner serves a new link."""
    _relink(hostile)
    before = hostile.owner.call(peer_snapshot)
    _reserve(hostile, 2)
    msg = m.KeyConsumed(key=m.KeyRef.for_req(2, 0), cache_id=2, tensor_spans=(m.Span(start=0, stop=2**40),))
    hostile.peer.call(H.notify_raw, PROMPT, msg)
    assert hostile.peer.call(H.wait_link_failed, PROMPT, PROBE_S) == "failed"
    after = hostile.owner.call(peer_snapshot)
    assert after.rss_bytes - before.rss_bytes < 8 << 20, (before.rss_bytes, after.rss_bytes)
    _relink(hostile)
    out = hostile.peer.call(H.request_raw, PROMPT, "engine_info", {}, PROBE_S)
    assert out["status"] == 0, out


def test_read_done_spans_outside_the_cache_fail_the_link_and_fire_no_event(hostile):
    """A peer-read notice naming blocks past the cache's end: no event, link failed; one inside it: the
    owner's "peer finished reading" event fires with exactly those spans (control)."""
    _relink(hostile)
    src_id = hostile.owner.call(H.cache_id_of, "src")
    hostile.owner.call(H.record_cache_events)
    good = m.ReadDone(entries=(m.ReadDoneEntry(cache_id=src_id, block_bounds=(1, 3)),))
    hostile.peer.call(H.notify_raw, PROMPT, good)
    assert hostile.peer.call(H.request_raw, PROMPT, "engine_info", {}, PROBE_S)["status"] == 0
    assert hostile.owner.call(H.cache_events, "peer_read") == [(src_id, [[1, 3]])]
    bad = m.ReadDone(entries=(m.ReadDoneEntry(cache_id=src_id, block_bounds=(0, NB + 1)),))
    hostile.peer.call(H.notify_raw, PROMPT, bad)
    assert hostile.peer.call(H.wait_link_failed, PROMPT, PROBE_S) == "failed"
    assert hostile.owner.call(H.cache_events, "peer_read") == [(src_id, [[1, 3]])]
    _relink(hostile)


def test_a_failed_link_is_fenced_its_reserve_key_is_refused_and_a_legitimate_pull_gets_the_key(hostile):
    """Issue 36, item 4: the owner used to keep serving a link it had failed for hostile input.  A
    hostile peer sent garbage (its link FAILED on the owner), then ``reserve_key`` for an
    engine-owned CacheKey: the key was taken, not given back when the peer left, and every
    legitimate decoder's ``pull_cache`` of it got LLM_KV_CACHE_NOT_EXIST.  Now the failed link
    serves nothing and holds nothing: the reserve is refused (LLM_LINK_FAILED), a reservation the
    link made while it was still LINKED went back when it failed, and a legitimate decoder pulls
    both keys with the right bytes.  Control: the same raw request on the LINKED link is granted."""
    hostile.owner.call(R.allocate, "kv45", NT, [2, 1024], seed=9, keys=((PROMPT, 4, 0), (PROMPT, 5, 0)))
    _relink(hostile)
    granted = hostile.peer.call(H.request_ignoring_state, PROMPT, "reserve_key", {"id": 5, "model_id": 0}, PROBE_S)
    assert granted["status"] == 0 and granted["state"] == "linked", granted       # the control
    # garbage the owner refuses by failing the link (a peer-read notice past the cache's end)
    src_id = hostile.owner.call(H.cache_id_of, "src")
    bad = m.ReadDone(entries=(m.ReadDoneEntry(cache_id=src_id, block_bounds=(0, NB + 1)),))
    hostile.peer.call(H.notify_raw, PROMPT, bad)
    assert hostile.owner.call(R.wait_link_state, DECODER, ("failed",), PROBE_S)[0] == "failed"
    refused = hostile.peer.call(H.request_ignoring_state, PROMPT, "reserve_key", {"id": 4, "model_id": 0}, PROBE_S)
    assert refused["status"] == LLMStatusCode.LLM_LINK_FAILED.value, refused
    assert "link is failed" in refused["error"], refused
    assert hostile.owner.call(R.link_states) == {DECODER: "failed"}   # the hostile peer has not left
    # a legitimate decoder (its own process and cluster id) pulls both keys: the right bytes
    legit = hostile.cluster.spawn("legit_decoder")[0]
    try:
        legit.call(R.setup, "DECODER", 3, mem_pool=1 << 20)
        assert legit.call(R.link, [(PROMPT, hostile.port)])["status"] == "LLM_SUCCESS"
        want = R.pattern(PROMPT, 9, NT, 2 * 1024)
        for req_id, batch in ((4, 0), (5, 1)):
            assert legit.call(R.allocate, f"dst{req_id}", NT, [1, 1024]) > 0
            status = legit.call(R.transfer, "pull_cache", ("key", PROMPT, req_id, 0), f"dst{req_id}", 0)[0]
            assert status == "LLM_SUCCESS", (req_id, status)
            np.testing.assert_array_equal(legit.call(R.snapshot, f"dst{req_id}"),
                                          want[:, batch * 1024:(batch + 1) * 1024])
        # the decoder leaves as a decoder does (unlink, then finalize): the owner's link to it ends,
        # so the rig is back to its baseline (one link, to the hostile peer) for the tests after this
        assert legit.call(R.unlink, [(PROMPT, hostile.port)])["status"] == "LLM_SUCCESS"
        assert hostile.owner.call(R.wait_link_state, 3, (None,), PROBE_S)[0] is None
        legit.call(R.finalize)
    finally:
        legit.close()
    _relink(hostile)


class HostileRig:
    def __init__(self) -> None:
        self.cluster = Cluster(env=ENV)
        self.owner, self.peer = self.cluster.spawn("hostile_owner", "hostile_peer")
        self.port = self.owner.call(R.setup, "PROMPT", PROMPT, listen=True, mem_pool=1 << 20)
        self.owner.call(R.register_blocks, "src", NT, NB, BS, seed=5, key=(PROMPT, 0))
        self.owner.call(R.allocate, "kv", NT, [4, 1024], seed=6, keys=((PROMPT, 1, 0), (PROMPT, 2, 0)))
        self.peer.call(R.setup, "DECODER", DECODER, mem_pool=1 << 20)
        self.peer.call(R.register_blocks, "dst", NT, NB, BS)
        self.sent = 0
        self.outcomes: dict = {}
        self.warm()
        self.baseline = self.owner.call(peer_snapshot)
        self.baseline_segments = self.owner.call(H.own_segments)

    def warm(self) -> None:
        """Link, pull verified bytes, and leave the link up (the state the baseline is taken in)."""
        out = self.peer.call(H.link_pull_unlink_loop, PROMPT, self.port, 0.01, NT, NB, BS, 5)
        assert out["pulled"] >= 1 and out["wrong_bytes"] == 0, out
        assert self.peer.call(R.link, [(PROMPT, self.port)])["status"] == "LLM_SUCCESS"

    def close(self) -> None:
        self.cluster.close()


@pytest.fixture(scope="module")
def hostile():
    rig = HostileRig()
    yield rig
    rig.close()


def test_push_done_notice_outside_the_cache_fails_the_link_and_fires_no_event(hostile):
    """A batch of untagged push notices (PushDone) is checked whole against the owner's table: one
    naming blocks past the cache's end fires no event (not even for its good entry) and fails the
    link; an all-good batch fires one "peer finished writing" event per entry (control)."""
    _relink(hostile)
    src_id = hostile.owner.call(H.cache_id_of, "src")
    hostile.owner.call(H.record_cache_events)
    entry = m.TransferDone(cache_id=src_id, block_spans=(m.Span(start=2, stop=4),), tensors=m.Span(start=0, stop=NT))
    hostile.peer.call(H.notify_raw, PROMPT, m.PushDone(entries=(entry, entry)))
    assert hostile.peer.call(H.request_raw, PROMPT, "engine_info", {}, PROBE_S)["status"] == 0
    assert hostile.owner.call(H.cache_events, "peer_written") == [(src_id, [[2, 4]])] * 2
    past = m.TransferDone(cache_id=src_id, block_spans=(m.Span(start=0, stop=NB + 1),))
    hostile.peer.call(H.notify_raw, PROMPT, m.PushDone(entries=(entry, past)))
    assert hostile.peer.call(H.wait_link_failed, PROMPT, PROBE_S) == "failed"
    assert hostile.owner.call(H.cache_events, "peer_written") == [(src_id, [[2, 4]])] * 2


def test_tagged_notice_is_answered_once_and_one_with_tensors_outside_the_cache_fails_the_link(hostile):
    """An acknowledged tagged notice (TaggedDone) fires the owner's event with its tag and answers 0;
    one whose tensor span passes the cache's tensors fires nothing and fails the link.  The owner sends
    its fatal Error, then the refusal's reply; the peer handles the reply on its loop thread and the
    Error on the link's strand, so its wait ends with whichever it handles first: the refusal
    (LLM_PARAM_INVALID, naming the span) or the failed link (LLM_LINK_FAILED)."""
    _relink(hostile)
    src_id = hostile.owner.call(H.cache_id_of, "src")
    hostile.owner.call(H.record_cache_events)
    good = m.TransferDone(cache_id=src_id, block_spans=(m.Span(start=1, stop=2),), tag="req-7".encode(), tag_str=True)
    out = hostile.peer.call(H.ask_raw, PROMPT, m.TaggedDone(request_id=0, push=False, entry=good), PROBE_S)
    assert out["status"] == 0, out
    assert hostile.owner.call(H.cache_event_tags, "peer_read") == [(src_id, "req-7", None)]
    bad = m.TransferDone(cache_id=src_id, tensors=m.Span(start=0, stop=NT + 1), tag=b"req-8")
    out = hostile.peer.call(H.ask_raw, PROMPT, m.TaggedDone(request_id=0, push=True, entry=bad), PROBE_S)
    assert out["state"] == "failed", out
    if out["status"] == LLMStatusCode.LLM_PARAM_INVALID.value:
        assert out["error"] == f"push_done tensors [0, {NT + 1}) is outside [0, {NT})", out
    else:
        assert out["status"] == "LLM_LINK_FAILED" and "went down" in out["error"], out
    assert hostile.owner.call(H.cache_event_tags, "peer_written") == []


@pytest.mark.timeout(300)
@settings(max_examples=HOSTILE_MESSAGES // BATCH, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.generate])  # no shrinking through live processes
@given(batch=st.lists(post_link_messages, min_size=BATCH, max_size=BATCH))
def test_post_link_message_fuzz_owner_stays_responsive(hostile, batch):
    out = hostile.peer.call(H.hostile_send, PROMPT, hostile.port, batch, PROBE_S, timeout=30)
    assert out["relinked"], out                     # the owner always accepts a new link
    hostile.sent += out["sent"]
    # either the owner answered on the same link, or it failed the link (a refused message; the peer
    # sees the failure, the owner refuses the probe with LLM_LINK_FAILED since a failed link serves
    # nothing, or the probe times out if it asked after the failure arrived) and then serves a fresh
    # link at once
    kinds = [type(x).__name__ for x in batch]
    peer_said_fatal = any(isinstance(x, m.Error) and x.fatal for x in batch)
    if out["probe"] == "answered":
        outcome = "answered"
    elif out["state"] == "failed":
        assert out["probe"] in ("failed", "LLM_LINK_FAILED", "LLM_TIMEOUT"), (out, kinds)
        outcome = "owner failed the link"
    else:
        # the hostile peer itself sent a fatal Error: the owner dropped the link as told, and this
        # side learns from the owner's refusal of its probe (a failed link serves nothing) or from
        # its own liveness timeout
        assert peer_said_fatal and out["probe"] in ("LLM_LINK_FAILED", "LLM_TIMEOUT"), (out, kinds)
        outcome = "peer declared the link dead"
    if outcome != "answered":
        assert out["fresh_link"] == "LLM_SUCCESS" and out["fresh_probe"] == "answered", (out, kinds)
    hostile.outcomes[outcome] = hostile.outcomes.get(outcome, 0) + 1


def test_post_link_message_fuzz_owner_resources_back_to_baseline(hostile):
    assert hostile.sent >= HOSTILE_MESSAGES * 0.9, hostile.sent   # the fuzz above really sent them
    # back to the baseline's state (one live link), then: threads and fds as before, RSS bounded
    hostile.peer.call(R.unlink, [(PROMPT, hostile.port)], True)
    hostile.warm()
    base = hostile.baseline
    # a relinked link has new threads and sockets (new idents, new fd numbers): compare counts, polling
    # with a deadline while the failed links' threads finish
    deadline = time.monotonic() + SETTLE_S
    while True:
        after = hostile.owner.call(peer_snapshot)
        if (after.native_threads <= base.native_threads and len(after.fds) <= len(base.fds)) or \
                time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    # the owner's own /dev/shm segments (its pid in the name; a snapshot's ``shm`` lists every
    # process's, so other processes' segments never hide one of the owner's): a relinked link's
    # control segment has a new name, so the count is compared, and the pools by name
    segments = hostile.owner.call(H.own_segments)
    print(f"hostile fuzz: {hostile.sent} messages, outcomes {hostile.outcomes}; owner RSS "
          f"{base.rss_bytes / 2**20:.1f} -> {after.rss_bytes / 2**20:.1f} MiB, threads {base.native_threads} -> "
          f"{after.native_threads}, fds {len(base.fds)} -> {len(after.fds)}, own shm segments "
          f"{len(hostile.baseline_segments)} -> {len(segments)}")
    assert after.native_threads <= base.native_threads, (base.native_threads, after.native_threads)
    kinds = lambda fds: sorted(name.split("[")[0] if name.startswith(("socket:", "pipe:", "anon_inode:")) else name
                               for _, name in fds)
    assert len(after.fds) <= len(base.fds), "\n".join(map(str, (kinds(base.fds), kinds(after.fds))))
    assert after.rss_bytes - base.rss_bytes <= RSS_BOUND, (base.rss_bytes, after.rss_bytes)
    assert len(segments) <= len(hostile.baseline_segments), (hostile.baseline_segments, segments)
    pools = [n for n in segments if "_pool_" in n]
    assert pools == [n for n in hostile.baseline_segments if "_pool_" in n], (hostile.baseline_segments, segments)


# ---------------------------------------------------------------------------- crash leftovers
import subprocess  # noqa: E402

from llmdd._memory.segments import (SCOPE_ENV, find_leftovers, parse_segment_name, pid_namespace,  # noqa: E402
                                    reclaim_leftovers, segment_prefix)

SHM = "/dev/shm"


@pytest.fixture
def shm_scope(monkeypatch):
    """A segment scope of this test's own (LLMDD_SHM_SCOPE, inherited by its engines' processes and
    the doctor): no other llmdd engine on the machine reclaims what the test planted or what its
    SIGKILLed engine left before the test looks, and the test's engines reclaim nothing of theirs."""
    import secrets

    scope = "t" + secrets.token_hex(6)
    monkeypatch.setenv(SCOPE_ENV, scope)
    return scope


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _plant(name: str, *, uid: int | None = None) -> str:
    path = os.path.join(SHM, name)
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    if uid is not None:
        os.chown(path, uid, -1)
    return path


@pytest.mark.timeout(60)
def test_segments_of_a_sigkilled_engine_are_reclaimed_when_an_engine_initializes(shm_scope):
    """A SIGKILLed engine leaves its pool and shm control segments; the next engine's init removes
    exactly those: never a live process's, never another user's, namespace's or scope's, never a
    name without llmdd's form (controls planted beside them survive every engine init of the test)."""
    dead = _dead_pid()
    ns = pid_namespace()
    mine = segment_prefix()
    assert mine == f"llmdd{shm_scope}_"
    planted = {
        "not_llmdd": _plant(f"other_{dead}_{ns}_pool_x"),                     # no llmdd prefix
        "other_ns": _plant(f"{mine}{dead}_{ns + 1}_pool_x"),                  # another pid namespace
        "other_user": _plant(f"{mine}{dead}_{ns}_pool_y", uid=4242),          # another user's
        "bad_form": _plant(f"{mine}{dead}_pool"),                             # not the name form
        "other_scope": _plant(f"llmdd{shm_scope}x_{dead}_{ns}_pool_z"),      # another scope's leftover
    }
    try:
        with Cluster(env=ENV) as cluster:
            victim, live, fresh = cluster.spawn("victim", "live", "fresh")
            port = victim.call(R.setup, "PROMPT", PROMPT, listen=True, transport="shm", mem_pool=1 << 20)
            victim.call(R.register_blocks, "src", NT, NB, BS, seed=1, key=(PROMPT, 0))
            victim.call(R.allocate, "kv", NT, [2, 1024])                      # creates the pool segment
            live.call(R.setup, "DECODER", DECODER, transport="shm", mem_pool=1 << 20)
            live.call(R.register_blocks, "dst", NT, NB, BS)
            live.call(R.allocate, "kv", NT, [2, 1024])
            assert live.call(H.link_and_pull_once, PROMPT, port) == "LLM_SUCCESS"   # shm endpoints open
            victim_segments = victim.call(H.own_segments)
            live_segments = live.call(H.own_segments)
            kinds = {parse_segment_name(n)[2] for n in victim_segments}
            assert {"pool", "shmctl"} <= kinds, victim_segments
            planted["dead_mine"] = _plant(f"{mine}{dead}_{ns}_shmctl_z")     # a leftover of another crash
            victim.kill()
            assert all(os.path.exists(os.path.join(SHM, n)) for n in victim_segments)
            found = {left.name for left in find_leftovers()}
            assert set(victim_segments) | {os.path.basename(planted["dead_mine"])} <= found, found
            # a new engine's init reclaims them
            fresh.call(R.setup, "PROMPT", 3)
            left = set(os.listdir(SHM))
            assert not set(victim_segments) & left, sorted(set(victim_segments) & left)
            assert os.path.basename(planted["dead_mine"]) not in left
            assert set(live_segments) <= left                                # a live process's: kept
            for kind in ("not_llmdd", "other_ns", "other_user", "bad_form", "other_scope"):
                assert os.path.exists(planted[kind]), kind                   # never touched
            assert live.call(H.link_and_pull_once, PROMPT, port) != "LLM_SUCCESS"  # (the victim is gone)
    finally:
        for path in planted.values():
            if os.path.exists(path):
                os.unlink(path)


def test_doctor_lists_leftovers_and_removes_them_only_with_the_flag(tmp_path):
    dead = _dead_pid()
    ns = pid_namespace()
    names = [f"llmdd_{dead}_{ns}_pool_1_ab", f"llmdd_{dead}_{ns}_shmctl_cd"]
    keep = [f"llmdd_{os.getpid()}_{ns}_pool_1_ef", "unrelated_file"]
    for n in names + keep:
        (tmp_path / n).write_bytes(b"x" * 100)
    from llmdd._tools.doctor import check_shm_leftovers

    listed = check_shm_leftovers(False, str(tmp_path))
    assert listed.status == "warn" and sorted(s["name"] for s in listed.details["segments"]) == sorted(names)
    assert all((tmp_path / n).exists() for n in names)                      # listing removes nothing
    removed = check_shm_leftovers(True, str(tmp_path))
    assert removed.status == "ok" and len(removed.details["segments"]) == 2
    assert sorted(os.listdir(tmp_path)) == sorted(keep)
    assert check_shm_leftovers(False, str(tmp_path)).status == "ok"
    assert reclaim_leftovers(str(tmp_path)) == []


def test_doctor_cli_reports_leftovers_before_any_engine_reclaims_them(shm_scope):
    dead = _dead_pid()
    path = _plant(f"{segment_prefix()}{dead}_{pid_namespace()}_pool_9_cli")
    try:
        exe = os.path.join(os.path.dirname(sys.executable), "llmdd")
        out = subprocess.run([exe, "doctor", "--seconds", "0", "--json"], capture_output=True, text=True)
        assert os.path.basename(path) in out.stdout, out.stdout[-2000:]
        assert os.path.exists(path)
        out = subprocess.run([exe, "doctor", "--seconds", "0", "--json", "--reclaim-shm"], capture_output=True,
                             text=True)
        assert os.path.basename(path) in out.stdout and not os.path.exists(path), out.stdout[-2000:]
    finally:
        if os.path.exists(path):
            os.unlink(path)


# ---------------------------------------------------------------------------- typed outcomes
#: after an error, how long the caller's memory is watched for late bytes (a measurement window)
LATE_BYTES_WINDOW_S = 0.3


#: the pull is held this long by a faults-plugin delay before its ops are posted: the window in which the
#: test unregisters the destination (one call to a child: milliseconds; generous for a loaded machine)
HOLD_S = 1.5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_regression_pull_into_a_cache_unregistered_mid_flight_ends_kv_cache_not_exist(transport):
    """The local destination of a pull is unregistered while the pull is held in flight (a faults-plugin
    delay before its ops are posted): the pull ends LLM_KV_CACHE_NOT_EXIST (was LLM_FAILED, "not
    recoverable"), no byte lands in that memory after the call returned, the link stays usable."""
    delay = json.dumps({"faults": [{"op": "read", "action": "delay", "delay": HOLD_S, "peer": PROMPT}]})
    with Cluster(env=ENV) as cluster:
        owner, puller = cluster.spawn("unreg_owner", "unreg_puller")
        port = owner.call(R.setup, "PROMPT", PROMPT, listen=True, transport=transport)
        owner.call(R.register_blocks, "src", NT, NB, BS, seed=8, key=(PROMPT, 0))
        puller.call(R.setup, "DECODER", DECODER, transport=transport, faults=delay, sync_ms=int(2 * HOLD_S * 1000))
        puller.call(R.register_blocks, "dst", NT, NB, BS)
        assert puller.call(R.link, [(PROMPT, port)])["status"] == "LLM_SUCCESS"
        puller.call(R.start_background, "pull", "pull_blocks", ("blocks", PROMPT, 0), "dst",
                    list(range(NB)), list(range(NB)))
        assert puller.call(H.wait_fault_fired, 1, 5.0) == 1          # the pull is held in flight
        unregister_started = puller.call(R.now)
        assert puller.call(R.unregister, "dst") == "LLM_SUCCESS"     # (waits for in-flight ops to drain)
        status, took, ended_at = puller.call(R.join_background, "pull", 10.0)
        assert ended_at > unregister_started, "the hold window was missed: the pull ended before the unregistration"
        assert status == "LLM_KV_CACHE_NOT_EXIST", status
        assert puller.call(H.watch_poison, "dst", LATE_BYTES_WINDOW_S), "bytes landed after the pull returned"
        # the link is fine: register again and pull the right bytes
        assert puller.call(R.link_states)[PROMPT] == "linked", puller.call(R.stats)["links"]
        puller.call(R.register_blocks, "dst", NT, NB, BS)
        assert puller.call(R.transfer, "pull_blocks", ("blocks", PROMPT, 0), "dst", [2, 5], [0, 1])[0] \
            == "LLM_SUCCESS"
        got = puller.call(R.snapshot, "dst").reshape(NT, NB, BS)
        want = R.pattern(PROMPT, 8, NT, NB * BS).reshape(NT, NB, BS)
        np.testing.assert_array_equal(got[:, [0, 1]], want[:, [2, 5]])


@pytest.mark.timeout(60)
def test_regression_repeated_destination_blocks_hold_the_last_listed_source_across_processes():
    """A pull naming one destination block twice was accepted with an unspecified (racy) result.
    Upstream accepts it and copies in list order; llmdd keeps exactly the last listed source."""
    with Cluster(env=ENV) as cluster:
        owner, puller = cluster.spawn("dup_owner", "dup_puller")
        port = owner.call(R.setup, "PROMPT", PROMPT, listen=True)
        owner.call(R.register_blocks, "src", NT, NB, BS, seed=4, key=(PROMPT, 0))
        puller.call(R.setup, "DECODER", DECODER)
        puller.call(R.register_blocks, "dst", NT, NB, BS)
        assert puller.call(R.link, [(PROMPT, port)])["status"] == "LLM_SUCCESS"
        src_blocks, dst_blocks = [1, 6, 2, 3], [4, 4, 0, 4]
        assert puller.call(R.transfer, "pull_blocks", ("blocks", PROMPT, 0), "dst", src_blocks, dst_blocks)[0] \
            == "LLM_SUCCESS"
        got = puller.call(R.snapshot, "dst").reshape(NT, NB, BS)
        want = R.pattern(PROMPT, 4, NT, NB * BS).reshape(NT, NB, BS)
        np.testing.assert_array_equal(got[:, 4], want[:, 3])      # the last pair for block 4
        np.testing.assert_array_equal(got[:, 0], want[:, 2])
        assert (got[:, [1, 2, 3, 5, 6, 7]] == R.POISON).all()
        assert not np.array_equal(got[:, 4], want[:, 1]) and not np.array_equal(got[:, 4], want[:, 6])
