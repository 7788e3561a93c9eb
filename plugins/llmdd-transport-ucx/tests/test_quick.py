"""The ucx channel's one-call path of planned small transfers (``UcxChannel.prepare``, issue 21),
between this process and a spawned owner process (``_llmdd_ucx_owner``).

* it moves the planned blocks of every tensor pair, reads and writes, runs of consecutive blocks
  merged into one descriptor, and counts them (``quick_batches``, bytes, ops, requests);
* every case it does not do returns a negative number with no byte moved (the engine then takes the
  ops path): a table changed since the plan on either side, a block out of range, not an exact int,
  a destination twice, the owner's endpoint closed; there is no plan for a region the tables do not
  hold or that is not remote-accessible; calls from several threads while the local table changes
  each move their block or decline;
* a request it posted that fails raises the transport error: the owner killed (PeerGone), the
  deadline passed while the owner cannot serve (TransportTimeout, after the drain), the local region
  deregistered while the request is in flight (Cancelled, deregistration returning after the drain).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

from llmdd.lowlevel import Cancelled, MemRegion, PeerGone, Refused, TransportTimeout, make_ops
from llmdd_ucx import UcxTransport
from llmdd_ucx._quick import LARGE, SHAPE, STALE

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _llmdd_ucx_owner import PRIVATE_RID, SIZE, content, owner_main  # noqa: E402

_INFO = UcxTransport.probe()
pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not _INFO.available, reason=f"ucx transport unavailable: {_INFO.reason}")]

BS = 4096
UNITS = SIZE // BS
PAIRS = [(1, 10), (2, 11)]


class _Pair:
    """This side (local regions 1 and 2 of seeded random content) connected to an owner process."""

    def __init__(self, tls: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, there = ctx.Pipe()
        self.proc = ctx.Process(target=owner_main, args=(there, tls), daemon=True)
        self.proc.start()
        assert self.conn.poll(60), "the owner did not start"
        desc, self.descs, self.pid = self.conn.recv()
        self.ep = UcxTransport({"llmdd.ucx.tls": tls, "llmdd.ucx.control_timeout": 1.0,
                                "llmdd.ucx.drain_timeout": 30.0}).open_endpoint()
        self.bufs = {1: content(1), 2: content(2)}
        for rid, buf in self.bufs.items():
            self.ep.register(MemRegion(region_id=rid, addr=buf.ctypes.data, size=SIZE, remote_accessible=False,
                                       placement=0))
        self.ch = self.ep.connect(desc, timeout=20)
        for rid, d in self.descs.items():
            self.ch.add_remote_region(rid, SIZE, d)

    def remote(self, rid: int) -> np.ndarray:
        self.conn.send(("bytes", rid))
        assert self.conn.poll(30)
        return np.frombuffer(self.conn.recv(), np.uint8)

    def local(self, rid: int) -> np.ndarray:
        return self.bufs[rid].copy()

    def close(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGCONT)
        self.ch.close()
        self.ep.close()
        if self.proc.is_alive():
            try:
                self.conn.send(("close",))
                self.conn.poll(20)
            except OSError:
                pass   # the owner was already leaving (a test closed it): its end of the pipe is gone
        self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


@pytest.fixture
def pair():
    made: list = []

    def make(tls: str = "") -> _Pair:
        p = _Pair(tls)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def _blocks(arr: np.ndarray, blocks) -> np.ndarray:
    return arr.reshape(UNITS, BS)[list(blocks)]


# ------------------------------------------------------------------------------ bytes


def test_fast_pull_moves_every_pairs_blocks_with_runs_merged(pair):
    p = pair()
    src, dst = [3, 4, 5, 40], [10, 11, 12, 0]   # 3..5 -> 10..12 is one run: 2 runs per pair
    before = {rid: p.local(rid) for rid in (1, 2)}
    remote = {rid: p.remote(rid) for rid in (10, 11)}
    for lid, rid in PAIRS:   # the control: the destination blocks do not hold the sources yet
        assert not np.array_equal(_blocks(before[lid], dst), _blocks(remote[rid], src))
    fast = p.ch.prepare(PAIRS, BS, UNITS, UNITS, False, timeout_s=10.0)
    assert fast is not None
    s0 = p.ch.statistics()
    assert fast(src, dst) == len(src) * BS * len(PAIRS)
    s1 = p.ch.statistics()
    assert s1["quick_batches"] - s0["quick_batches"] == 1 and s1["requests"] - s0["requests"] == 1
    assert s1["bytes_read"] - s0["bytes_read"] == len(src) * BS * len(PAIRS)
    assert s1["ops_read"] - s0["ops_read"] == 2 * len(PAIRS)   # runs merged: one descriptor per run and pair
    for lid, rid in PAIRS:
        now = p.local(lid)
        assert np.array_equal(_blocks(now, dst), _blocks(remote[rid], src))
        rest = sorted(set(range(UNITS)) - set(dst))
        assert np.array_equal(_blocks(now, rest), _blocks(before[lid], rest))   # nothing else written
    assert all(np.array_equal(p.remote(rid), remote[rid]) for rid in (10, 11))   # a read leaves the owner alone


def test_fast_push_moves_every_pairs_blocks_to_the_owner(pair):
    p = pair()
    src, dst = [7, 8, 60, 61, 20], [33, 34, 1, 2, 63]
    before = {rid: p.remote(rid) for rid in (10, 11)}
    for lid, rid in PAIRS:
        assert not np.array_equal(_blocks(before[rid], dst), _blocks(p.local(lid), src))
    fast = p.ch.prepare(PAIRS, BS, UNITS, UNITS, True, timeout_s=10.0)
    s0 = p.ch.statistics()
    assert fast(src, dst) == len(src) * BS * len(PAIRS)
    s1 = p.ch.statistics()
    assert s1["quick_batches"] - s0["quick_batches"] == 1
    assert s1["bytes_written"] - s0["bytes_written"] == len(src) * BS * len(PAIRS)
    assert s1["ops_written"] - s0["ops_written"] == 3 * len(PAIRS)
    for lid, rid in PAIRS:
        now = p.remote(rid)
        assert np.array_equal(_blocks(now, dst), _blocks(p.local(lid), src))
        rest = sorted(set(range(UNITS)) - set(dst))
        assert np.array_equal(_blocks(now, rest), _blocks(before[rid], rest))


def test_many_calls_of_one_plan_over_ucx_tcp(pair):
    """The same plan called back to back (UCX over tcp: requests complete after the post)."""
    p = pair("tcp")
    fast = p.ch.prepare([(1, 10)], BS, UNITS, UNITS, False, timeout_s=10.0)
    remote = p.remote(10)
    rng = np.random.default_rng(3)
    pulls = [(int(s), int(d)) for s, d in zip(rng.integers(0, UNITS, 40), rng.permutation(UNITS)[:40])]
    for s, d in pulls:
        assert fast([s], [d]) == BS
    now = p.local(1)
    for s, d in pulls:
        assert np.array_equal(_blocks(now, [d]), _blocks(remote, [s]))
    assert p.ch.statistics()["quick_batches"] == len(pulls)


# ------------------------------------------------------------------------------ declines


def _unchanged(p: _Pair, before: dict, stats: dict) -> None:
    assert all(np.array_equal(p.local(rid), buf) for rid, buf in before.items()), "a declined call moved bytes"
    after = p.ch.statistics()
    assert after["batches"] == stats["batches"] and after["requests"] == stats["requests"]


@pytest.mark.parametrize("src,dst", [
    ([UNITS], [0]), ([0], [UNITS]), ([-1], [0]), ([1, 2], [3, 3]), ([True], [0]), ([np.int64(1)], [0]),
    ([1.0], [0]), ([1, 2], [3]), ([], []), (list(range(17)), list(range(17)))],
    ids=["src-out-of-range", "dst-out-of-range", "negative", "duplicate-dst", "bool", "np.int64", "float",
         "lengths-differ", "empty", "more-than-16"])
def test_blocks_it_does_not_take_are_declined_with_nothing_moved(pair, src, dst):
    p = pair()
    fast = p.ch.prepare(PAIRS, BS, UNITS, UNITS, False, timeout_s=10.0)
    before, stats = {rid: p.local(rid) for rid in (1, 2)}, p.ch.statistics()
    assert fast(src, dst) == SHAPE
    _unchanged(p, before, stats)
    assert fast([1], [2]) == BS * len(PAIRS)   # the plan still works


def test_a_call_larger_than_one_chunk_is_declined(pair):
    p = pair()
    p.ep.cfg["llmdd.ucx.chunk_bytes"] = 2 * BS   # read by prepare
    fast = p.ch.prepare([(1, 10)], BS, UNITS, UNITS, False, timeout_s=10.0)
    before, stats = {1: p.local(1)}, p.ch.statistics()
    assert fast([1, 2, 3], [4, 5, 6]) == LARGE
    _unchanged(p, before, stats)
    assert fast([1, 2], [4, 5]) == 2 * BS


def test_a_plan_declines_once_either_table_changed(pair):
    p = pair()
    fast = p.ch.prepare(PAIRS, BS, UNITS, UNITS, False, timeout_s=10.0)
    before, stats = {rid: p.local(rid) for rid in (1, 2)}, p.ch.statistics()
    extra = np.zeros(BS, np.uint8)
    p.ep.register(MemRegion(region_id=3, addr=extra.ctypes.data, size=BS, remote_accessible=False, placement=0))
    assert fast([1], [2]) == STALE   # the local table changed
    _unchanged(p, before, stats)
    fast = p.ch.prepare(PAIRS, BS, UNITS, UNITS, False, timeout_s=10.0)
    assert fast([1], [2]) == BS * len(PAIRS)
    before, stats = {rid: p.local(rid) for rid in (1, 2)}, p.ch.statistics()
    p.ch.remove_remote_region(PRIVATE_RID)
    assert fast([4], [5]) == STALE   # the remote table changed
    _unchanged(p, before, stats)


def test_no_plan_for_regions_the_tables_do_not_hold_or_cannot_reach(pair):
    p = pair()
    assert p.ch.prepare([(9, 10)], BS, UNITS, UNITS, False, timeout_s=10.0) is None       # local unknown
    assert p.ch.prepare([(1, 99)], BS, UNITS, UNITS, False, timeout_s=10.0) is None       # remote unknown
    assert p.ch.prepare([(1, PRIVATE_RID)], BS, UNITS, UNITS, True, timeout_s=10.0) is None  # not accessible
    assert p.ch.prepare([(1, 10)], BS, UNITS + 1, UNITS, False, timeout_s=10.0) is None   # past the region
    assert p.ch.prepare([], BS, UNITS, UNITS, False, timeout_s=10.0) is None
    assert p.ch.prepare([(1, 10)], BS, UNITS, UNITS, False, timeout_s=10.0) is not None   # the control


def test_a_remote_region_deregistered_by_its_owner_declines_then_has_no_plan(pair):
    p = pair()
    fast = p.ch.prepare(PAIRS, BS, UNITS, UNITS, False, timeout_s=10.0)
    assert fast([1], [2]) == BS * len(PAIRS)
    before, stats = {rid: p.local(rid) for rid in (1, 2)}, p.ch.statistics()
    p.conn.send(("dereg", 10))
    assert p.conn.poll(30) and p.conn.recv()   # returns once this side acknowledged the DRAIN
    assert fast([3], [4]) == STALE
    _unchanged(p, before, stats)
    assert p.ch.prepare(PAIRS, BS, UNITS, UNITS, False, timeout_s=10.0) is None
    c = p.ch.read(make_ops(1, 3 * BS, 10, 4 * BS, BS), deadline=time.monotonic() + 10)   # the ops path refuses
    assert c.wait(10) and isinstance(c.error, Refused), c.error


def test_a_closed_channel_declines(pair):
    p = pair()
    fast = p.ch.prepare(PAIRS, BS, UNITS, UNITS, True, timeout_s=10.0)
    p.ch.close()
    assert fast([1], [2]) == STALE
    assert p.ch.prepare(PAIRS, BS, UNITS, UNITS, True, timeout_s=10.0) is None


def test_an_owner_that_closed_its_endpoint_makes_the_plan_decline(pair):
    """The owner's close sends BYE and returns once this side acknowledged it (the channel marked
    gone first): the plan declines, no new plan is made, the ops path reports the peer gone."""
    p = pair()
    fast = p.ch.prepare(PAIRS, BS, UNITS, UNITS, False, timeout_s=10.0)
    assert fast([1], [2]) == BS * len(PAIRS)
    before, stats = {rid: p.local(rid) for rid in (1, 2)}, p.ch.statistics()
    p.conn.send(("close",))
    assert p.conn.poll(30) and p.conn.recv()
    assert p.ch.statistics()["gone"]
    assert fast([3], [4]) == STALE
    _unchanged(p, before, stats)
    assert p.ch.prepare(PAIRS, BS, UNITS, UNITS, False, timeout_s=10.0) is None
    c = p.ch.read(make_ops(1, 0, 10, 0, BS), deadline=time.monotonic() + 10)
    assert c.wait(10) and isinstance(c.error, PeerGone), c.error


def test_calls_from_several_threads_while_the_local_table_changes(pair):
    """Four threads call one plan back to back while a fifth registers and deregisters an unrelated
    local region: every call moves its block or declines (STALE) with nothing moved, and every
    block a call reported moved holds its source."""
    p = pair()
    remote = p.remote(10)
    spare = np.zeros(BS, np.uint8)
    stop = threading.Event()
    outcomes: dict = {}
    errors: list = []
    counts = {"changes": 0, "stale": 0}

    def churn() -> None:
        while not stop.is_set():
            p.ep.register(MemRegion(region_id=7, addr=spare.ctypes.data, size=BS, remote_accessible=False,
                                    placement=0))
            p.ep.deregister(7)
            counts["changes"] += 2

    def worker(k: int) -> None:
        fast = p.ch.prepare([(1, 10)], BS, UNITS, UNITS, False, timeout_s=10.0)
        dsts = range(k * 16, k * 16 + 16)   # each thread its own destination blocks
        try:
            for i in range(200):
                d = dsts[i % 16]
                s = (7 * i + k) % UNITS
                got = fast([s], [d])
                if got == STALE:
                    counts["stale"] += 1
                    fast = p.ch.prepare([(1, 10)], BS, UNITS, UNITS, False, timeout_s=10.0)
                    continue
                assert got == BS, got
                outcomes[d] = s   # the last source this destination received
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    c = threading.Thread(target=churn, daemon=True)
    workers = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(4)]
    c.start()
    for t in workers:
        t.start()
    for t in workers:
        t.join(60)
    stop.set()
    c.join(30)
    assert not errors, errors
    assert not any(t.is_alive() for t in workers) and not c.is_alive()
    assert counts["changes"] > 0, counts
    assert len(outcomes) == 64
    now = p.local(1)
    for d, s in outcomes.items():
        assert np.array_equal(_blocks(now, [d]), _blocks(remote, [s]))


# ------------------------------------------------------------------------------ failures


def test_a_killed_owner_raises_peer_gone(pair):
    p = pair()
    fast = p.ch.prepare(PAIRS, BS, UNITS, UNITS, False, timeout_s=10.0)
    assert fast([1], [2]) == BS * len(PAIRS)
    p.proc.kill()
    p.proc.join(20)
    with pytest.raises(PeerGone):
        fast([5], [6])
    st = p.ch.statistics()
    assert st["failed"] == 1 and st["quick_batches"] == 2


def _stop_owner_with_a_request_posted(p: _Pair, fast, timeout_s: float):
    """Stop the owner (UCX over tcp: its worker must progress to serve a read), start ``fast`` in a
    thread and return (thread, outcome dict, the batch in flight)."""
    assert fast([0], [0]) == BS   # connection set up while the owner runs
    os.kill(p.pid, signal.SIGSTOP)
    out: dict = {}

    def call() -> None:
        try:
            out["moved"] = fast([9], [8])
        except Exception as exc:  # noqa: BLE001 - the outcome is asserted by the caller
            out["error"] = exc

    t = threading.Thread(target=call, daemon=True)
    t.start()
    end = time.monotonic() + 20
    while not p.ch._batches.active and t.is_alive() and time.monotonic() < end:
        time.sleep(0.001)
    batches = list(p.ch._batches.active)
    assert len(batches) == 1, (batches, out)
    return t, out, batches[0]


def test_a_deadline_passed_with_the_owner_stopped_raises_timeout_after_the_drain(pair):
    """UCX over tcp with the owner stopped (SIGSTOP): the read cannot complete, the deadline passes,
    the batch is failed and drains; the owner continued once the failure began, the request ends,
    the call raises TransportTimeout."""
    p = pair("tcp")
    fast = p.ch.prepare([(1, 10)], BS, UNITS, UNITS, False, timeout_s=0.3)
    t, out, batch = _stop_owner_with_a_request_posted(p, fast, 0.3)
    end = time.monotonic() + 20
    while batch._chunks and t.is_alive() and time.monotonic() < end:   # _fail_locked has begun
        time.sleep(0.001)
    assert not batch._chunks and "moved" not in out
    os.kill(p.pid, signal.SIGCONT)
    t.join(30)
    assert not t.is_alive()
    assert isinstance(out.get("error"), TransportTimeout), out
    assert p.ep.statistics()["stranded_requests"] == 0   # drained, not abandoned
    assert fast([5], [6]) == BS   # the plan still works


def test_a_zero_timeout_raises_timeout_with_nothing_posted(pair):
    p = pair()
    fast = p.ch.prepare([(1, 10)], BS, UNITS, UNITS, False, timeout_s=0.0)
    before = p.local(1)
    with pytest.raises(TransportTimeout):
        fast([1], [2])
    assert np.array_equal(p.local(1), before)


def test_a_local_deregistration_fails_the_request_in_flight_and_waits_for_it(pair):
    p = pair("tcp")
    fast = p.ch.prepare([(1, 10)], BS, UNITS, UNITS, False, timeout_s=30.0)
    t, out, batch = _stop_owner_with_a_request_posted(p, fast, 30.0)
    done = threading.Event()

    def deregister() -> None:
        p.ep.deregister(1)
        done.set()

    d = threading.Thread(target=deregister, daemon=True)
    d.start()
    end = time.monotonic() + 20
    while batch._chunks and time.monotonic() < end:   # the deregistration is failing (draining) it
        time.sleep(0.001)
    assert not batch._chunks and not done.is_set() and "moved" not in out
    os.kill(p.pid, signal.SIGCONT)
    t.join(30)
    d.join(30)
    assert done.is_set()
    assert isinstance(out.get("error"), Cancelled), out
    assert fast([1], [2]) == STALE
