"""Comm groups (rank-table ``link()``) across real processes on 127.0.0.1.

Members whose ``device_ip`` is an address of this host meet through the same-host rendezvous
(``LLMDD_RENDEZVOUS_DIR``, one directory per test here); see ``llmdd/_base/ranktable.py``.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

import numpy as np
import pytest

from llmdd.testing._harness import Cluster

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peers as P  # noqa: E402  (children load it from its file: see the harness)

pytestmark = pytest.mark.timeout(60)

#: link_total_time of the missing-member case (seconds)
LINK_TOTAL_S = 2
#: how late after link_total_time a comm group that cannot come up may read FAILED: the group's
#: deadline check plus the 20 ms poll of ``group_wait`` and the harness round trips, on a loaded
#: 2-core box.  A documented constant, not an environment knob; raising it hides a slow failure path
FAILED_SLACK_S = 1.5


def rank_table_v10(n: int) -> str:
    devices = [{"device_id": str(i), "device_ip": "127.0.0.1", "rank_id": str(i)} for i in range(n)]
    return json.dumps({"version": "1.0", "server_count": "1",
                       "server_list": [{"server_id": "127.0.0.1", "device": devices}], "status": "completed"})


def rank_table_v12(n: int) -> str:
    devices = [{"device_id": str(i), "device_ip": "127.0.0.1", "super_device_id": str(100 + i), "rank_id": str(i)}
               for i in range(n)]
    return json.dumps({"version": "1.2", "server_count": "1",
                       "server_list": [{"server_id": "127.0.0.1", "device": devices}],
                       "super_pod_list": [{"super_pod_id": "0", "server_list": [{"server_id": "127.0.0.1"}]}],
                       "status": "completed"})


def _env(tmp_path) -> dict:
    return {"LLMDD_AUTH_SECRET": None, "LLMDD_RENDEZVOUS_DIR": str(tmp_path / "rendezvous")}


def test_two_groups_of_four_link_concurrently_and_every_pair_transfers(tmp_path):
    groups = {
        "group-a": ([501, 502, 503, 504], rank_table_v10(4)),
        "group-b": ([601, 602, 603, 604], rank_table_v12(4)),
    }
    with Cluster(env=_env(tmp_path)) as c:
        names = [f"m{cid}" for ids, _ in groups.values() for cid in ids]
        handles = dict(zip(names, c.spawn(*names)))
        starts = [handles[f"m{cid}"].call_async(P.start, "PROMPT" if rank == 0 else "DECODER", cid, seed=cid,
                                                local_comm_res=False)
                  for ids, _ in groups.values() for rank, cid in enumerate(ids)]
        for fut in starts:   # engine init is CPU-bound (8 at once): waited while the peer lives, the
            fut.result(None)  # test's timeout bounds it; the protocol steps below keep their deadlines
        # every member of both groups calls link() at the same time
        futures = {}
        for comm_name, (ids, table) in groups.items():
            rank_info = {cid: rank for rank, cid in enumerate(ids)}
            for cid in ids:
                futures[cid] = handles[f"m{cid}"].call_async(P.group_link, comm_name, rank_info, table)
        comm_ids = {cid: f.result(30.0) for cid, f in futures.items()}
        assert set(comm_ids.values()) == {1}      # comm ids start at 1, per engine
        waits = {cid: handles[f"m{cid}"].call_async(P.group_wait, comm_ids[cid], 10.0) for cid in comm_ids}
        for cid, fut in waits.items():
            status, took = fut.result(15.0)
            assert status == "OK", (cid, status, took)

        for comm_name, (ids, _) in groups.items():
            for a, b in itertools.permutations(ids, 2):
                h = handles[f"m{a}"]
                assert h.call(P.link_states)[b] == "linked"
                # block 0 of every member is never written: it still holds the member's own pattern
                assert h.call(P.pull, b, [0], [3])[0] == "LLM_SUCCESS", (a, b)
                np.testing.assert_array_equal(h.call(P.blocks)[:, 3], P.pattern(b, b)[:, 0])
            # nothing links across groups
            other = [cid for cid in comm_ids if cid not in ids]
            assert not set(handles[f"m{ids[0]}"].call(P.link_states)) & set(other)

        # unlink: everyone at once
        unlinks = {cid: handles[f"m{cid}"].call_async(P.group_unlink, comm_ids[cid]) for cid in comm_ids}
        for cid, fut in unlinks.items():
            assert fut.result(15.0) is None, cid
        deadline = time.monotonic() + 5.0
        for cid in comm_ids:
            h = handles[f"m{cid}"]
            while h.call(P.link_states) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert h.call(P.link_states) == {}, cid
            assert h.call(P.group_status, comm_ids[cid]) == "LLM_PARAM_INVALID"   # the comm id is gone
        assert not os.listdir(tmp_path / "rendezvous")  # published addresses were removed


def test_group_with_a_missing_member_fails_after_link_total_time(tmp_path):
    ids = [701, 702, 703]          # rank 2 never shows up
    table = rank_table_v10(3)
    rank_info = {cid: rank for rank, cid in enumerate(ids)}
    with Cluster(env=_env(tmp_path)) as c:
        present = c.spawn("m701", "m702")
        for h, cid in zip(present, ids):
            h.call(P.start, "DECODER", cid, seed=cid, local_comm_res=False, link_total_time=LINK_TOTAL_S)
        futures = [h.call_async(P.group_link, "lonely", rank_info, table) for h in present]
        comm_ids = [f.result(10.0) for f in futures]
        waits = [h.call_async(P.group_wait, cid, 8.0) for h, cid in zip(present, comm_ids)]
        for fut in waits:
            status, took = fut.result(12.0)
            assert status == "FAILED"
            assert LINK_TOTAL_S - 0.5 <= took <= LINK_TOTAL_S + FAILED_SLACK_S, took
        events = present[0].call(P.events, "comm_group")
        assert events and events[-1]["dest"] == "failed" and events[-1]["error"], events
        # it stays FAILED, and unlink cleans it up on both present members
        assert present[1].call(P.group_status, comm_ids[1]) == "FAILED"
        for h, cid in zip(present, comm_ids):
            assert h.call(P.group_unlink, cid) is None
        deadline = time.monotonic() + 5.0
        for h in present:
            while h.call(P.link_states) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert h.call(P.link_states) == {}


def test_a_second_group_over_the_same_pair_never_affects_the_first(tmp_path):
    """Both engines call ``link("link", ...)`` then ``link("link2", ...)`` with the same members and
    poll ``query_register_mem_status`` of both every millisecond: both groups reach OK on both sides
    and no poll ever reads FAILED, in every trial.  Upstream gives each ``link()`` its own
    communicator and status (hicann/hixl ``comm_link_manager.cc:332-383, 428-446``); llmdd shares the
    pair's one link between the groups, each holding it, so group 2 never replaces group 1's link
    (before: group 1 FAILED in 8 of 8 trials).  Then upstream's ``test_remote_cache_accessible.py:84-95``
    flow: ``unlink(1)`` raises nothing, and group 2 stays OK and carries transfers (bytes compared),
    until its own unlink ends the link."""
    ids = [801, 802]
    table = rank_table_v10(2)
    rank_info = {cid: rank for rank, cid in enumerate(ids)}
    with Cluster(env=_env(tmp_path)) as c:
        lo, hi = c.spawn("m801", "m802")
        for h, cid in ((lo, 801), (hi, 802)):
            h.call(P.start, "PROMPT" if cid == 801 else "DECODER", cid, seed=cid, local_comm_res=False)
        for trial in range(4):
            futures = [h.call_async(P.groups_polled, ["link", "link2"], rank_info, table) for h in (lo, hi)]
            results = [f.result(30.0) for f in futures]
            for h, res in zip((lo, hi), results):
                first, second = res["ids"]
                assert second == first + 1, res
                assert res["final"] == {first: "OK", second: "OK"}, (trial, res)
                assert all("FAILED" not in seen for seen in res["seen"].values()), (trial, res)
            first_lo, second_lo = results[0]["ids"]
            first_hi, second_hi = results[1]["ids"]
            # one link for the pair (one handshake per trial on each side), used by both groups
            assert lo.call(P.link_states) == {802: "linked"} and hi.call(P.link_states) == {801: "linked"}
            assert [e["trigger"] for e in lo.call(P.events)].count("handshake_succeeded") == trial + 1
            # upstream's flow: unlink group 1 (both members); group 2 is untouched and still transfers
            assert lo.call(P.group_unlink, first_lo) is None and hi.call(P.group_unlink, first_hi) is None
            assert lo.call(P.group_status, second_lo) == "OK" and hi.call(P.group_status, second_hi) == "OK"
            assert lo.call(P.group_status, first_lo) == "LLM_PARAM_INVALID"   # group 1's comm id is gone
            src = lo.call(P.blocks)
            assert not np.array_equal(hi.call(P.blocks)[:, 1], src[:, 2])   # the control: differ before
            assert hi.call(P.pull, 801, [2], [1])[0] == "LLM_SUCCESS"
            np.testing.assert_array_equal(hi.call(P.blocks)[:, 1], src[:, 2])
            hi.call(P.restore)   # the next trial's control starts from the seeded pattern again
            # group 2's unlink by both members ends the link on both sides
            assert lo.call(P.group_unlink, second_lo) is None and hi.call(P.group_unlink, second_hi) is None
            for h, peer in ((lo, 802), (hi, 801)):
                state, _ = h.call(P.wait_link_state, peer, (None,), 5.0)
                assert state is None, (trial, state)
            assert "failed" not in [e["dest"] for e in lo.call(P.events) + hi.call(P.events)]
        assert not os.listdir(tmp_path / "rendezvous")


def _stale_seen_or_settled(h, comm_id: int, deadline_s: float) -> tuple:
    """Poll member ``h`` until it logged a stale rendezvous entry or its group left PREPARING
    (whichever first; the deadline only bounds a hang): (stale entry logged, group status)."""
    deadline = time.monotonic() + deadline_s
    while True:
        stale = any("llmdd.comm_group.stale_entry" in line for line in h.call(P.logs))
        status = h.call(P.group_status, comm_id)
        if stale or status != "PREPARING" or time.monotonic() >= deadline:
            return stale, status
        time.sleep(0.02)


def test_a_member_killed_before_cleanup_leaves_a_stale_entry_the_restarted_group_ignores(tmp_path):
    """A member SIGKILLed after publishing its rendezvous entry (as vLLM's shutdown kills workers)
    leaves the file behind.  The next group with the same comm name and rank table reads it, sees
    its writer is gone, and waits for the restarted member's entry instead of connecting to the dead
    address: both sides reach OK and a pull moves the seeded bytes.  Before the entry named its
    incarnation (pid and start time), the higher rank connected to the dead port and its group was
    FAILED at once (the control: on that code, with the check of the entry's pid left out since its
    entry had none, this test reads FAILED at the PREPARING assertion below)."""
    ids = [901, 902]
    table = rank_table_v10(2)
    rank_info = {cid: rank for rank, cid in enumerate(ids)}
    rdv = tmp_path / "rendezvous"
    with Cluster(env=_env(tmp_path)) as c:
        (old,) = c.spawn("old901")
        old.call(P.start, "PROMPT", 901, seed=1, local_comm_res=False)
        old.call(P.group_link, "restarted", rank_info, table)   # link() publishes before it returns
        (entry,) = os.listdir(rdv)
        assert entry.endswith("-0")
        stale_text = (rdv / entry).read_text()
        assert int(stale_text.split()[1]) == old.pid
        old.kill()
        assert old.exitcode == -9
        assert (rdv / entry).read_text() == stale_text          # left behind: no exit handler ran

        hi, lo = c.spawn("m902", "m901")
        hi.call(P.start, "DECODER", 902, seed=2, local_comm_res=False)
        lo.call(P.start, "PROMPT", 901, seed=3, local_comm_res=False)
        hi.call(P.capture_logs)
        hi_id = hi.call(P.group_link, "restarted", rank_info, table)
        # rank 1 reads rank 0's entry first: the stale one, since the new rank 0 has not linked yet
        stale, status = _stale_seen_or_settled(hi, hi_id, 10.0)
        assert status == "PREPARING" and stale, (status, stale, hi.call(P.logs))
        lo_id = lo.call(P.group_link, "restarted", rank_info, table)
        waits = [h.call_async(P.group_wait, cid, 10.0) for h, cid in ((hi, hi_id), (lo, lo_id))]
        for fut in waits:
            status, took = fut.result(15.0)
            assert status == "OK", (status, took)
        new_text = (rdv / entry).read_text()
        assert int(new_text.split()[1]) == lo.pid and new_text != stale_text   # replaced by the new writer
        assert hi.call(P.link_states) == {901: "linked"} and lo.call(P.link_states) == {902: "linked"}

        src = lo.call(P.blocks)
        np.testing.assert_array_equal(src, P.pattern(901, 3))
        assert not np.array_equal(hi.call(P.blocks)[:, 1], src[:, 2])   # the control: differ before
        assert hi.call(P.pull, 901, [2], [1])[0] == "LLM_SUCCESS"
        np.testing.assert_array_equal(hi.call(P.blocks)[:, 1], src[:, 2])

        assert hi.call(P.group_unlink, hi_id) is None and lo.call(P.group_unlink, lo_id) is None
        assert not os.listdir(rdv)
