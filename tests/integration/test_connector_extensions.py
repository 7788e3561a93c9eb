"""What a framework connector needs (llmdd extensions, docs/hooks.md): a tag per transfer delivered
with the owner's "peer finished reading/writing" event, non-blocking pulls, torch CPU registration.
Every case crosses two real processes over loopback; bytes are compared on the other side."""

from __future__ import annotations

import collections
import json
import os
import sys
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REL = os.path.join(os.path.dirname(HERE), "reliability")
for p in (HERE, REL):
    if p not in sys.path:
        sys.path.insert(0, p)
import _connector_peers as C  # noqa: E402
import _rel_peers as R  # noqa: E402

from llmdd.testing._harness import Cluster  # noqa: E402

pytestmark = pytest.mark.timeout(180)

ENV = {"LLMDD_AUTH_SECRET": None, "LLMDD_FAULTS": None}
PROMPT, DECODER = 1, 2
NT, NB, BS = 2, 8, 4096
SEED = 21


def _pair(cluster, *, transport="tcp", d_kw=None, p_kw=None):
    owner, puller = cluster.spawn("conn_owner", "conn_puller")
    port = owner.call(R.setup, "PROMPT", PROMPT, listen=True, transport=transport, **(p_kw or {}))
    owner.call(R.register_blocks, "src", NT, NB, BS, seed=SEED, key=(PROMPT, 0))
    owner.call(C.record_events)
    puller.call(R.setup, "DECODER", DECODER, transport=transport, **(d_kw or {}))
    puller.call(R.register_blocks, "dst", NT, NB, BS)
    assert puller.call(R.link, [(PROMPT, port)])["status"] == "LLM_SUCCESS"
    return owner, puller, port


# --------------------------------------------------------------------------- tags
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_tags_reach_the_owner_exactly_once_and_in_order_under_8_threads(transport):
    threads, per_thread = 8, 125          # 1,000 tagged pulls over one link
    with Cluster(env=ENV) as cluster:
        owner, puller, _ = _pair(cluster, transport=transport)
        out = puller.call(C.tagged_pulls_in_threads, PROMPT, threads, per_thread, NB, SEED, timeout=150)
        assert out == {"ok": threads * per_thread, "failed": {}, "wrong": 0}, out
        events = owner.call(C.peer_events)
        tags = [e[0] for e in events]
        assert len(tags) == threads * per_thread, len(tags)        # one event per pull: none untagged
        assert len(set(tags)) == len(tags)                          # exactly once
        assert all(e[2] is None and e[3] == DECODER for e in events)
        for t in range(threads):                                    # in order: each thread's pulls are sequential
            mine = [int(tag.split("-")[1]) for tag in tags if tag.startswith(f"t{t}-")]
            assert mine == list(range(per_thread)), (t, mine[:10])
        # the spans name the blocks read: recompute each thread's source blocks
        rng = {t: np.random.default_rng([SEED, t]) for t in range(threads)}
        want = {f"t{t}-{i}": [[int(b), int(b) + 1]] for t in range(threads)
                for i, b in enumerate(rng[t].integers(0, NB, per_thread))}
        assert all(e[1] == want[e[0]] for e in events)


def test_tags_of_bytes_and_str_arrive_as_given_and_bad_tags_are_refused():
    with Cluster(env=ENV) as cluster:
        owner, puller, port = _pair(cluster)
        assert puller.call(R.transfer, "pull_blocks", ("blocks", PROMPT, 0), "dst", [3], [0], tag=b"\x00req-7\xff")[0] \
            == "LLM_SUCCESS"
        assert puller.call(R.transfer, "pull_blocks", ("blocks", PROMPT, 0), "dst", [4, 5], [1, 2], tag="请求-8")[0] \
            == "LLM_SUCCESS"
        assert puller.call(R.transfer, "pull_blocks", ("blocks", PROMPT, 0), "dst", [6], [3])[0] == "LLM_SUCCESS"
        # a tag longer than 256 bytes, or not bytes/str: the contract's errors, before anything moves
        assert puller.call(R.transfer, "pull_blocks", ("blocks", PROMPT, 0), "dst", [0], [4], tag="x" * 257)[0] \
            == "LLM_PARAM_INVALID"
        assert puller.call(R.transfer, "pull_blocks", ("blocks", PROMPT, 0), "dst", [0], [4], tag=7)[0] == "TypeError"
        tagged = [(e[0], e[1]) for e in owner.call(C.peer_events) if e[0] is not None]
        assert tagged == [(b"\x00req-7\xff", [[3, 4]]), ("请求-8", [[4, 6]])]
        got = puller.call(R.snapshot, "dst").reshape(NT, NB, BS)
        want = R.pattern(PROMPT, SEED, NT, NB * BS).reshape(NT, NB, BS)
        np.testing.assert_array_equal(got[:, [0, 1, 2, 3]], want[:, [3, 4, 5, 6]])
        assert (got[:, 4:] == R.POISON).all()


def test_push_tags_arrive_with_peer_finished_writing_on_the_destination_owner():
    with Cluster(env=ENV) as cluster:
        pusher, owner = cluster.spawn("push_src", "push_dst")
        port = owner.call(R.setup, "PROMPT", PROMPT, listen=True, remote_accessible=True)
        owner.call(R.register_blocks, "dst", NT, NB, BS, key=(PROMPT, 5), remote_accessible=True)
        owner.call(C.record_events)
        pusher.call(R.setup, "DECODER", DECODER, remote_accessible=True)
        pusher.call(R.register_blocks, "src", NT, NB, BS, seed=SEED, remote_accessible=True)
        assert pusher.call(R.link, [(PROMPT, port)])["status"] == "LLM_SUCCESS"
        assert pusher.call(C.push_tagged, PROMPT, 5, [1, 2], [6, 7], "push-1") == "LLM_SUCCESS"
        assert pusher.call(C.push_tagged, PROMPT, 5, [0], [0], None) == "LLM_SUCCESS"   # untagged: best effort
        # a tagged push is acknowledged after everything the link carried before it was handled
        assert pusher.call(C.push_tagged, PROMPT, 5, [3], [3], "push-2") == "LLM_SUCCESS"
        events = owner.call(C.peer_events, "peer_written")
        assert [(e[0], e[1], e[2]) for e in events] == [("push-1", [[6, 8]], None), (None, [[0, 1]], None),
                                                       ("push-2", [[3, 4]], None)]
        got = owner.call(R.snapshot, "dst").reshape(NT, NB, BS)
        want = R.pattern(DECODER, SEED, NT, NB * BS).reshape(NT, NB, BS)
        np.testing.assert_array_equal(got[:, [6, 7, 0, 3]], want[:, [1, 2, 0, 3]])
        assert (got[:, [1, 2, 4, 5]] == R.POISON).all()


def test_a_failed_tagged_pull_delivers_one_failure_event_with_its_tag():
    fail = json.dumps({"faults": [{"op": "read", "action": "fail", "error": "Refused", "peer": PROMPT}]})
    with Cluster(env=ENV) as cluster:
        owner, puller, _ = _pair(cluster, d_kw={"faults": fail})
        status = puller.call(R.transfer, "pull_blocks", ("blocks", PROMPT, 0), "dst", [1], [1], tag="will-fail")[0]
        assert status != "LLM_SUCCESS"
        assert puller.call(R.poison_kept, "dst")
        events = owner.call(C.peer_events)
        assert len(events) == 1 and events[0][0] == "will-fail" and events[0][2] == status, (events, status)
        puller.call(R.fault_heal)
        assert puller.call(R.transfer, "pull_blocks", ("blocks", PROMPT, 0), "dst", [1], [1], tag="ok")[0] \
            == "LLM_SUCCESS"
        events = owner.call(C.peer_events)
        assert [e[0] for e in events] == ["will-fail", "ok"] and events[1][2] is None
        # refused before any byte moved (a block past the owner's cache): one failure event, no blocks
        assert puller.call(R.transfer, "pull_blocks", ("blocks", PROMPT, 0), "dst", [NB + 3], [2],
                           tag="refused")[0] == "LLM_PARAM_INVALID"
        events = owner.call(C.peer_events)
        assert [e[:3] for e in events[2:]] == [("refused", [], "LLM_PARAM_INVALID")], events


@pytest.mark.timeout(120)
def test_puller_killed_mid_way_leaves_no_duplicate_and_no_unread_tag(tmp_path):
    """A decoder pulling tagged blocks from 8 threads is SIGKILLed mid-way: the owner's tags are
    unique, every one was issued, and every pull the decoder saw succeed was delivered (acknowledged
    before the call returned)."""
    log = tmp_path / "done.txt"
    with Cluster(env=ENV) as cluster:
        owner, puller, _ = _pair(cluster)
        fut = puller.call_async(C.tagged_pulls_in_threads, PROMPT, 8, 2000, NB, SEED, str(log))
        # let a few hundred pulls complete, then kill (the log is the decoder's own record)
        deadline = __import__("time").monotonic() + 60
        while (not log.exists() or sum(1 for _ in open(log)) < 200) and __import__("time").monotonic() < deadline:
            __import__("time").sleep(0.02)
        puller.kill()
        del fut
        done = [line.split()[0] for line in open(log)]
        assert len(done) >= 200
        events = owner.call(C.peer_events)
        tags = [e[0] for e in events]
        assert len(tags) == len(set(tags))                          # no duplicate
        assert set(done) <= set(tags)                               # acknowledged before success returned
        assert all(tag.startswith("t") and int(tag.split("-")[0][1:]) < 8 for tag in tags)
        assert len(tags) - len(done) <= 8                           # at most one in flight per thread


def test_pull_cache_and_pull_cache_async_deliver_their_tags_once():
    """pull_cache by CacheKey (reserve, read, consume) and pull_cache_async by id, both tagged: the owner
    gets each tag once with its "peer finished reading"; a second pull of the consumed key reads
    nothing and delivers no tag."""
    with Cluster(env=ENV) as cluster:
        owner, puller = cluster.spawn("pc_owner", "pc_puller")
        port = owner.call(R.setup, "PROMPT", PROMPT, listen=True, mem_pool=1 << 20)
        cid = owner.call(R.allocate, "kv", NT, [2, BS], seed=SEED, keys=((PROMPT, 1, 0), (PROMPT, 2, 0)))
        owner.call(C.record_events)
        puller.call(R.setup, "DECODER", DECODER, mem_pool=1 << 20)
        puller.call(R.allocate, "dst", NT, [2, BS])
        assert puller.call(R.link, [(PROMPT, port)])["status"] == "LLM_SUCCESS"
        assert puller.call(R.transfer, "pull_cache", ("key", PROMPT, 1, 0), "dst", 0, tag="pc-key")[0] \
            == "LLM_SUCCESS"
        out = puller.call(C.pull_cache_async_once, ("id", PROMPT, cid, 1), "dst", 1, b"pc-async", 10_000)
        assert out == {"status": "LLM_SUCCESS", "again": ["LLM_SUCCESS"], "callbacks": ["LLM_SUCCESS"]}, out
        assert puller.call(R.transfer, "pull_cache", ("key", PROMPT, 1, 0), "dst", 0, tag="gone")[0] \
            == "LLM_KV_CACHE_NOT_EXIST"
        assert owner.call(C.peer_events) == [("pc-key", [], None, DECODER), (b"pc-async", [], None, DECODER)]
        np.testing.assert_array_equal(puller.call(R.snapshot, "dst"), owner.call(R.snapshot, "kv"))


def test_push_cache_tag_arrives_with_peer_finished_writing():
    with Cluster(env=ENV) as cluster:
        pusher, owner = cluster.spawn("pcache_src", "pcache_dst")
        port = owner.call(R.setup, "PROMPT", PROMPT, listen=True, remote_accessible=True, mem_pool=1 << 20)
        cid = owner.call(R.allocate, "dst", NT, [2, BS])
        owner.call(C.record_events)
        pusher.call(R.setup, "DECODER", DECODER, remote_accessible=True, mem_pool=1 << 20)
        pusher.call(R.allocate, "src", NT, [2, BS], seed=SEED)
        assert pusher.call(R.link, [(PROMPT, port)])["status"] == "LLM_SUCCESS"
        assert pusher.call(R.transfer, "push_cache", ("id", PROMPT, cid, 1), "src", 0, tag="pcache-1")[0] \
            == "LLM_SUCCESS"
        assert owner.call(C.peer_events, "peer_written") == [("pcache-1", [], None, DECODER)]
        got = owner.call(R.snapshot, "dst").reshape(NT, 2, BS)
        want = R.pattern(DECODER, SEED, NT, 2 * BS).reshape(NT, 2, BS)
        np.testing.assert_array_equal(got[:, 1], want[:, 0])
        assert (got[:, 0] == R.POISON).all()


@pytest.mark.timeout(150)
def test_owner_killed_mid_way_fails_the_pulls_typed_without_duplicate_or_unacknowledged_tags(tmp_path):
    """The owner of the blocks is SIGKILLed while a decoder pulls tagged blocks from 8 threads: every
    later pull fails with a typed status (none hangs, none reports bytes it did not get), the owner
    fired each tag at most once, and every pull the decoder saw succeed had its tag fired first."""
    owner_log, done_log = tmp_path / "owner.txt", tmp_path / "done.txt"
    with Cluster(env=ENV) as cluster:
        owner, puller, _ = _pair(cluster)
        owner.call(C.record_events_to_file, str(owner_log))
        fut = puller.call_async(C.tagged_pulls_in_threads, PROMPT, 8, 2000, NB, SEED, str(done_log))
        deadline = time.monotonic() + 60     # a bounded wait for progress (the owner's own record)
        while (not owner_log.exists() or sum(1 for _ in open(owner_log)) < 200) and time.monotonic() < deadline:
            time.sleep(0.02)
        owner.kill()
        out = fut.result(timeout=120)
        fired = [line.split() for line in open(owner_log)]
        done = [line.split()[0] for line in open(done_log)]
        assert out["wrong"] == 0 and out["ok"] == len(done) >= 200, out
        assert out["failed"] and set(out["failed"]) <= {"LLM_LINK_FAILED", "LLM_TIMEOUT"}, out["failed"]
        assert out["ok"] + sum(out["failed"].values()) == 8 * 2000
        tags = [t for t, _ in fired]
        assert len(tags) == len(set(tags))                          # no duplicate
        assert all(st == "ok" for _, st in fired)                    # no failure was ever reported as read
        assert set(done) <= set(tags)                               # acknowledged before success returned


# --------------------------------------------------------------------------- non-blocking pulls
def test_non_blocking_pulls_overlap_and_call_back_once_each():
    # the first read is held 1.5 s (one transfer per link at a time), so every pull submitted before
    # it ends is in flight at once on that link
    hold = json.dumps({"faults": [{"op": "read", "action": "delay", "delay": 1.5, "peer": PROMPT, "nth": 1,
                                   "count": 1}]})
    with Cluster(env=ENV) as cluster:
        owner, puller, _ = _pair(cluster, d_kw={"faults": hold, "sync_ms": 6000})
        jobs = [([i % NB], [i % NB], f"a{i}") for i in range(32)]
        out = puller.call(C.async_pulls, PROMPT, jobs, 20_000, timeout=60)
        assert out["submit_s"] < 1.5, out["submit_s"]                 # submitting never waited for a pull
        assert out["in_flight_after_submit"] == 32, out               # 32 pulls in flight on one link
        assert out["results"] == ["LLM_SUCCESS"] * 32 and out["again"] == ["LLM_SUCCESS"] * 32, out
        assert out["callbacks"] == {i: ["LLM_SUCCESS"] for i in range(32)}, out["callbacks"]
        got = puller.call(R.snapshot, "dst")
        np.testing.assert_array_equal(got, R.pattern(PROMPT, SEED, NT, NB * BS))
        tags = sorted(e[0] for e in owner.call(C.peer_events))
        assert tags == sorted(f"a{i}" for i in range(32))


def test_non_blocking_pulls_queued_behind_an_unlink_end_link_failed_and_a_slow_one_times_out():
    delay = json.dumps({"faults": [{"op": "read", "action": "delay", "delay": 1.2, "peer": PROMPT}]})
    with Cluster(env=ENV) as cluster:
        owner, puller, port = _pair(cluster, d_kw={"faults": delay, "sync_ms": 800})
        jobs = [([i % NB], [i % NB], f"c{i}") for i in range(12)]
        puller.call(C.start_async_pulls, PROMPT, jobs)
        # the first ones are held by the delay past sync_kv_timeout: LLM_TIMEOUT, and the link fails
        # (contract); the rest, still queued, end with the link's typed status
        statuses = puller.call(C.finish_async_pulls, 20_000, timeout=40)
        counts = collections.Counter(statuses)
        # the first pull holds the link past the deadline: LLM_TIMEOUT, and the link fails (contract);
        # the others, as their blocking calls would: the link stayed busy for sync_kv_timeout
        # (LLM_LINK_BUSY), or they met the failed link (its status, LLM_TIMEOUT, or LLM_LINK_FAILED
        # when cancelled while still queued)
        assert statuses[0] == "LLM_TIMEOUT", statuses
        assert set(counts) <= {"LLM_TIMEOUT", "LLM_LINK_FAILED", "LLM_LINK_BUSY"}, counts
        assert "LLM_SUCCESS" not in counts
        assert puller.call(R.poison_kept, "dst")                   # no byte of a failed pull landed
        # relinked, non-blocking pulls work again
        assert puller.call(R.unlink, [(PROMPT, port)], True)["status"] == "LLM_SUCCESS"
        assert puller.call(R.link, [(PROMPT, port)])["status"] == "LLM_SUCCESS"
        out = puller.call(C.async_pulls, PROMPT, [([5], [5], "after")], 10_000, timeout=30)
        assert out["results"] == ["LLM_SUCCESS"] and out["callbacks"] == {0: ["LLM_SUCCESS"]}, out


def test_non_blocking_pulls_cut_by_a_force_unlink_end_link_failed_and_the_relinked_link_serves_new_ones():
    """12 tagged non-blocking pulls, the first held 2 s by a delayed read: a force unlink cancels the
    queued ones and cuts the running one (LLM_LINK_FAILED each, none succeeds, nothing lands, no tag
    reaches the owner); a relink right away serves a new pull (its tag alone arrives)."""
    hold = json.dumps({"faults": [{"op": "read", "action": "delay", "delay": 2.0, "peer": PROMPT, "nth": 1,
                                   "count": 1}]})
    with Cluster(env=ENV) as cluster:
        owner, puller, port = _pair(cluster, d_kw={"faults": hold, "sync_ms": 6000})
        jobs = [([i % NB], [i % NB], f"u{i}") for i in range(12)]
        out = puller.call(C.unlink_relink_under_async_pulls, PROMPT, port, jobs, ([5], [5], "after"), 20_000,
                          timeout=60)
        assert out["unlink"] == "LLM_SUCCESS" and out["link"] == "LLM_SUCCESS", out
        assert out["statuses"] == ["LLM_LINK_FAILED"] * 12, out["statuses"]
        assert out["after"] == "LLM_SUCCESS", out
        assert [e[0] for e in owner.call(C.peer_events) if e[2] is None] == ["after"]
        got = puller.call(R.snapshot, "dst").reshape(NT, NB, BS)
        want = R.pattern(PROMPT, SEED, NT, NB * BS).reshape(NT, NB, BS)
        np.testing.assert_array_equal(got[:, 5], want[:, 5])
        assert (got[:, [0, 1, 2, 3, 4, 6, 7]] == R.POISON).all()


def test_cuda_tensor_stand_ins_are_refused_at_registration_without_reading_their_address():
    """Without torch: objects with a CUDA tensor's interface (device.type 'cuda', or is_cuda) are
    refused with LLM_PARAM_INVALID naming cuda, before data_ptr() is read; nothing is registered."""
    with Cluster(env=ENV) as cluster:
        (peer,) = cluster.spawn("cuda_standin")
        peer.call(R.setup, "DECODER", DECODER)
        results = peer.call(C.register_cuda_stand_ins)
        assert len(results) == 4
        for kind, mixed, status, message, ptr_calls, unchanged in results:
            assert status == "LLM_PARAM_INVALID" and "cuda" in message, (kind, mixed, status, message)
            assert ptr_calls == 0 and unchanged, (kind, mixed, ptr_calls, unchanged)


def test_non_blocking_pull_with_bad_arguments_raises_at_once():
    with Cluster(env=ENV) as cluster:
        owner, puller, _ = _pair(cluster)
        assert puller.call(C.async_bad, PROMPT) == ["LLM_PARAM_INVALID", "LLM_PARAM_INVALID", "TypeError",
                                                    "LLM_NOT_YET_LINK"]


# --------------------------------------------------------------------------- torch
def test_torch_cpu_tensors_registered_in_place_and_pulled_into():
    pytest.importorskip("torch", reason="torch is not installed (scripts/test.sh installs torch==2.13.0+cpu "
                                        "where the package index serves it)")
    with Cluster(env=ENV) as cluster:
        owner, puller = cluster.spawn("torch_owner", "torch_puller")
        port = owner.call(R.setup, "PROMPT", PROMPT, listen=True)
        owner.call(C.register_torch_layers, "src", 4, NB, BS, seed=SEED, key=(PROMPT, 0), shared=True)
        puller.call(R.setup, "DECODER", DECODER)
        puller.call(C.register_torch_layers, "dst", 4, NB, BS, shared=True)
        assert puller.call(R.link, [(PROMPT, port)])["status"] == "LLM_SUCCESS"
        assert puller.call(R.transfer, "pull_blocks", ("blocks", PROMPT, 0), "dst", [7, 0, 3], [0, 1, 2])[0] \
            == "LLM_SUCCESS"
        got = puller.call(R.snapshot, "dst").reshape(4, NB, BS)
        want = R.pattern(PROMPT, SEED, 4, NB * BS).reshape(4, NB, BS)
        np.testing.assert_array_equal(got[:, [0, 1, 2]], want[:, [7, 0, 3]])
        assert (got[:, 3:] == R.POISON).all()
        for kind, needle in (("small", "needs"), ("strided", "non-contiguous"), ("cuda_like", "cuda")):
            res = puller.call(C.register_bad_tensor, kind)
            assert res.startswith("LLM_PARAM_INVALID") and needle in res, (kind, res)


def test_non_blocking_pulls_cut_by_finalize_end_with_a_typed_status():
    delay = json.dumps({"faults": [{"op": "read", "action": "delay", "delay": 0.5, "peer": PROMPT}]})
    with Cluster(env=ENV) as cluster:
        owner, puller, _ = _pair(cluster, d_kw={"faults": delay, "sync_ms": 3000})
        jobs = [([i % NB], [i % NB], f"f{i}") for i in range(12)]
        statuses = puller.call(C.finalize_under_async_pulls, PROMPT, jobs, 10_000, timeout=40)
        counts = collections.Counter(statuses)
        # still queued: LLM_ENGINE_FINALIZED; running when the links went: the link's typed status;
        # a pull that completed before the teardown: LLM_SUCCESS (its bytes are in place)
        assert counts["LLM_ENGINE_FINALIZED"] >= 1, counts
        assert set(counts) <= {"LLM_ENGINE_FINALIZED", "LLM_LINK_FAILED", "LLM_SUCCESS"}, counts
        assert "LLM_TIMEOUT" not in counts                          # none waited out its deadline
        # the owner holds a success tag only of pulls that returned success (acknowledged before)
        tags = {e[0] for e in owner.call(C.peer_events) if e[2] is None}
        assert tags == {f"f{i}" for i, st in enumerate(statuses) if st == "LLM_SUCCESS"}, (tags, statuses)


# --------------------------------------------------------------------------- lost control messages
def _tagged(puller, src, dst, tag):
    return puller.call(R.transfer, "pull_blocks", ("blocks", PROMPT, 0), "dst", [src], [dst], tag=tag)[0]


def test_a_dropped_tag_notice_fails_the_pull_typed_and_the_owner_never_sees_that_tag():
    """The faults plugin on the owner drops the 3rd tagged "finished reading" notice as if the network
    lost it: that pull ends LLM_TIMEOUT by its deadline (the owner never acknowledged), the link fails,
    the owner has no event for that tag; after a relink every tag arrives once, in order."""
    drop = json.dumps({"faults": [{"op": "control", "action": "drop", "message": "TaggedDone:read_done",
                                   "nth": 3, "peer": DECODER}]})
    with Cluster(env=ENV) as cluster:
        owner, puller, port = _pair(cluster, p_kw={"faults": drop}, d_kw={"sync_ms": 800})
        assert [_tagged(puller, i, i, f"d{i}") for i in range(2)] == ["LLM_SUCCESS"] * 2
        status, took, _ = puller.call(R.transfer, "pull_blocks", ("blocks", PROMPT, 0), "dst", [2], [2], tag="d2")
        assert status == "LLM_TIMEOUT" and took <= 0.8 + 0.5, (status, took)
        assert puller.call(R.link_states)[PROMPT] == "failed"
        assert owner.call(R.fault_fired) == [("control", "drop")]
        assert puller.call(R.unlink, [(PROMPT, port)], True)["status"] == "LLM_SUCCESS"
        assert puller.call(R.link, [(PROMPT, port)])["status"] == "LLM_SUCCESS"
        assert [_tagged(puller, i, i, f"d{i}") for i in range(3, 6)] == ["LLM_SUCCESS"] * 3
        tags = [e[0] for e in owner.call(C.peer_events)]
        assert tags == ["d0", "d1", "d3", "d4", "d5"], tags
        got = puller.call(R.snapshot, "dst").reshape(NT, NB, BS)
        want = R.pattern(PROMPT, SEED, NT, NB * BS).reshape(NT, NB, BS)
        np.testing.assert_array_equal(got[:, :6], want[:, :6])       # d2's bytes were read before the loss


def test_a_dropped_acknowledgement_reports_timeout_but_the_owner_saw_the_tag_once():
    """The faults plugin on the puller drops the owner's acknowledgement of one tag: the owner fired
    its event (the bytes were read), exactly once; the puller reports LLM_TIMEOUT and its link fails."""
    drop = json.dumps({"faults": [{"op": "control", "action": "drop", "message": "TransferReply", "nth": 2,
                                   "peer": PROMPT}]})
    with Cluster(env=ENV) as cluster:
        owner, puller, port = _pair(cluster, d_kw={"faults": drop, "sync_ms": 800})
        assert _tagged(puller, 0, 0, "k0") == "LLM_SUCCESS"
        assert _tagged(puller, 1, 1, "k1") == "LLM_TIMEOUT"
        assert puller.call(R.fault_fired) == [("control", "drop")]
        assert puller.call(R.link_states)[PROMPT] == "failed"
        assert [e[0] for e in owner.call(C.peer_events)] == ["k0", "k1"]
        got = puller.call(R.snapshot, "dst").reshape(NT, NB, BS)
        want = R.pattern(PROMPT, SEED, NT, NB * BS).reshape(NT, NB, BS)
        np.testing.assert_array_equal(got[:, :2], want[:, :2])
