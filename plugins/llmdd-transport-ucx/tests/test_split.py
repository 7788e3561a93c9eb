"""A large ucx batch split across the endpoint's posting threads (``llmdd.ucx.threads``,
``llmdd.ucx.split_min_bytes``; :mod:`llmdd_ucx._lanes`), between this process and a spawned owner
process (``_llmdd_ucx_owner``, regions of seeded random bytes):

* a pull of random 64 KiB blocks and a push of one large op are split (counted in ``split_batches``,
  one batch, its bytes and ops counted once), every byte checked on the other side;
* the controls: a batch below the threshold is not split, and with ``threads=1`` nothing is (no
  posting thread, NIXL's strict mode as before);
* a failure in one part fails the whole batch with that part's error, the other parts are failed
  and drained, no NIXL request is released while in flight, and the channel works afterwards;
* an agent that cannot be made with several workers (RW mode) is made with one: no split, bytes move;
* deregistering the local region during a split pull fails it (Cancelled) and the deregistration
  returns with no request of it in flight.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time

import numpy as np
import pytest

from llmdd.lowlevel import Cancelled, MemRegion, coalesce_ops, make_ops
from llmdd_ucx import UcxTransport
from llmdd_ucx._lanes import PostThreads, split_bounds

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _llmdd_ucx_owner import content, owner_main  # noqa: E402

_INFO = UcxTransport.probe()
pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not _INFO.available, reason=f"ucx transport unavailable: {_INFO.reason}")]

MiB = 1 << 20
SIZE = 16 * MiB
BLK = 64 << 10


class _Pair:
    """This side (local region 1, seeded random content) connected to an owner process (10, 11)."""

    def __init__(self, tls: str = "", **opts) -> None:
        ctx = mp.get_context("spawn")
        self.conn, there = ctx.Pipe()
        self.proc = ctx.Process(target=owner_main, args=(there, tls, SIZE), daemon=True)
        self.proc.start()
        assert self.conn.poll(60), "the owner did not start"
        desc, descs, _pid = self.conn.recv()
        self.ep = UcxTransport({"llmdd.ucx.tls": tls, "llmdd.ucx.control_timeout": 2.0, **opts}).open_endpoint()
        self.buf = content(1, SIZE)
        self.ep.register(MemRegion(region_id=1, addr=self.buf.ctypes.data, size=SIZE, remote_accessible=False,
                                   placement=0))
        self.ch = self.ep.connect(desc, timeout=20)
        for rid in (10, 11):
            self.ch.add_remote_region(rid, SIZE, descs[rid])

    def owner_bytes(self, rid: int) -> np.ndarray:
        self.conn.send(("bytes", rid))
        assert self.conn.poll(30)
        return np.frombuffer(self.conn.recv(), np.uint8)

    def close(self) -> None:
        try:
            self.ch.close()
            self.ep.close()
        finally:
            if self.proc.is_alive():
                try:
                    self.conn.send(("close",))
                    self.conn.poll(20)
                except OSError:
                    pass   # the owner was already leaving: its end of the pipe is gone
            self.proc.join(20)
            if self.proc.is_alive():
                self.proc.kill()


def _random_blocks(seed: int, nbytes: int) -> tuple:
    rng = np.random.default_rng(seed)
    n = nbytes // BLK
    return rng.permutation(SIZE // BLK)[:n], rng.permutation(SIZE // BLK)[:n]


def test_split_bounds_cut_by_bytes_into_nonempty_runs():
    lens = np.full(1025, BLK, np.uint64)
    cuts = split_bounds(lens, 2)
    assert cuts[0] == 0 and cuts[-1] == 1025 and len(cuts) == 3
    sums = [int(lens[a:b].sum()) for a, b in zip(cuts, cuts[1:])]
    assert abs(sums[0] - sums[1]) <= BLK
    assert split_bounds(np.array([5], np.uint64), 4) == [0, 1]           # one descriptor: one run
    assert split_bounds(np.array([1, 1, 1], np.uint64), 8) == [0, 1, 2, 3]


def test_a_large_pull_and_push_are_split_and_move_the_right_bytes():
    p = _Pair()
    try:
        assert p.ep.statistics()["post_threads"] == 2   # the default: two posting threads
        lb, rb = _random_blocks(3, 12 * MiB)
        ops = make_ops(1, lb * BLK, 10, rb * BLK, BLK)
        c = p.ch.read(ops, deadline=time.monotonic() + 60)
        assert c.wait(60) and c.error is None, c.error
        src = p.owner_bytes(10).reshape(-1, BLK)
        assert np.array_equal(p.buf.reshape(-1, BLK)[lb], src[rb]), "the split pull moved wrong bytes"
        st = p.ch.statistics()
        assert st["split_batches"] == 1 and st["batches"] == 1, st
        # counted once, as an unsplit batch is: its bytes and its ops after coalescing
        assert st["bytes_read"] == 12 * MiB and st["ops_read"] == len(coalesce_ops(ops)), st
        # one 10 MiB op pushed: cut into parts too
        c = p.ch.write(make_ops(1, 0, 11, 1 * MiB, 10 * MiB), deadline=time.monotonic() + 60)
        assert c.wait(60) and c.error is None, c.error
        sink = p.owner_bytes(11)
        assert np.array_equal(sink[1 * MiB:11 * MiB], p.buf[:10 * MiB]), "the split push moved wrong bytes"
        assert np.array_equal(sink[:1 * MiB], content(11, SIZE)[:1 * MiB]), "the push wrote outside its op"
        st = p.ch.statistics()
        assert st["split_batches"] == 2 and st["bytes_written"] == 10 * MiB and st["failed"] == 0, st
        # control: below llmdd.ucx.split_min_bytes (8 MiB) a batch is not split
        lb, rb = _random_blocks(4, 4 * MiB)
        c = p.ch.read(make_ops(1, lb * BLK, 10, rb * BLK, BLK), deadline=time.monotonic() + 60)
        assert c.wait(60) and c.error is None, c.error
        assert np.array_equal(p.buf.reshape(-1, BLK)[lb], src[rb])
        assert p.ch.statistics()["split_batches"] == 2
    finally:
        p.close()


def test_with_one_thread_nothing_is_split():
    p = _Pair(**{"llmdd.ucx.threads": 1})
    try:
        assert p.ep.statistics()["post_threads"] == 0
        lb, rb = _random_blocks(5, 12 * MiB)
        c = p.ch.read(make_ops(1, lb * BLK, 10, rb * BLK, BLK), deadline=time.monotonic() + 60)
        assert c.wait(60) and c.error is None, c.error
        src = p.owner_bytes(10).reshape(-1, BLK)
        assert np.array_equal(p.buf.reshape(-1, BLK)[lb], src[rb])
        st = p.ch.statistics()
        assert st["split_batches"] == 0 and st["batches"] == 1 and st["bytes_read"] == 12 * MiB, st
    finally:
        p.close()


class _Recorder:
    """Wraps an agent: records each request's last known state, refuses to release one in flight,
    and (``fail_at``) raises on the n-th request it is asked to make."""

    def __init__(self, agent, fail_at: int = 0, after: "threading.Event | None" = None) -> None:
        self._agent = agent
        self._fail_at = fail_at
        self._after = after   # the failure waits for this (another part posted)
        self.posted = threading.Event()
        self._made = 0
        self.lock = threading.Lock()
        self.state: dict = {}
        self.released_in_flight: list = []
        self.released = 0

    def __getattr__(self, name):
        return getattr(self._agent, name)

    def initialize_xfer(self, *a, **kw):
        self._made += 1
        if self._made == self._fail_at:
            assert self._after is None or self._after.wait(30)
            raise RuntimeError("injected failure making request %d" % self._made)
        return self._agent.initialize_xfer(*a, **kw)

    def transfer(self, h):
        st = self._agent.transfer(h)
        with self.lock:
            self.state[id(h)] = st
        self.posted.set()
        return st

    def check_xfer_state(self, h):
        st = self._agent.check_xfer_state(h)
        with self.lock:
            self.state[id(h)] = st
        return st

    def release_xfer_handle(self, h):
        with self.lock:
            if self.state.get(id(h)) == "PROC":
                self.released_in_flight.append(id(h))
            self.released += 1
        return self._agent.release_xfer_handle(h)


def _wrap_parts(monkeypatch, wrap) -> None:
    """Give the i-th part queued from now on the agent ``wrap(i, agent)`` (set before it is posted)."""
    real = PostThreads.submit
    count = [0]

    def submit(self, part):
        part._agent = wrap(count[0], part._agent)
        count[0] += 1
        real(self, part)
    monkeypatch.setattr(PostThreads, "submit", submit)


def test_a_failure_in_one_part_fails_the_batch_and_drains_the_other(monkeypatch):
    # over UCX's tcp transport requests stay in flight after the post: the other part is drained
    p = _Pair("tcp", **{"llmdd.ucx.chunk_bytes": 1 * MiB, "llmdd.ucx.inflight": 1, "llmdd.ucx.drain_timeout": 30.0})
    try:
        posted_1 = threading.Event()
        made: list = []

        def wrap(i, agent):
            if i == 0:   # part 0 fails making its second request, once part 1 has posted one
                rec = _Recorder(agent, fail_at=2, after=posted_1)
            else:
                rec = _Recorder(agent)
                if i == 1:
                    rec.posted = posted_1
            made.append(rec)
            return rec
        _wrap_parts(monkeypatch, wrap)
        lb, rb = _random_blocks(6, 12 * MiB)
        c = p.ch.read(make_ops(1, lb * BLK, 10, rb * BLK, BLK), deadline=time.monotonic() + 60)
        assert c.wait(60)
        assert c.error is not None and "injected failure" in str(c.error), c.error
        assert len(c.parts) == 8   # 4 parts per posting thread
        assert all(part.finished for part in c.parts)
        assert all(not part._posted for part in c.parts), "a request was left in flight"
        assert made[1].released > 0, "part 1 posted nothing"
        for r in made:
            assert r.released_in_flight == [], "a request was released while in flight"
        st = p.ch.statistics()
        assert st["split_batches"] == 1 and st["failed"] == 1 and st["bytes_read"] == 0, st
        assert p.ep.statistics()["stranded_requests"] == 0
        monkeypatch.undo()
        # control: the channel still moves the right bytes
        c = p.ch.read(make_ops(1, lb * BLK, 10, rb * BLK, BLK), deadline=time.monotonic() + 60)
        assert c.wait(60) and c.error is None, c.error
        src = p.owner_bytes(10).reshape(-1, BLK)
        assert np.array_equal(p.buf.reshape(-1, BLK)[lb], src[rb])
    finally:
        p.close()


def test_deregistering_the_local_region_fails_a_split_pull_and_drains_it(monkeypatch):
    p = _Pair("tcp", **{"llmdd.ucx.chunk_bytes": 1 * MiB, "llmdd.ucx.inflight": 1, "llmdd.ucx.drain_timeout": 30.0})
    try:
        made: list = []

        def wrap(i, agent):
            made.append(_Recorder(agent))
            return made[-1]
        _wrap_parts(monkeypatch, wrap)
        lb, rb = _random_blocks(7, 16 * MiB)
        c = p.ch.read(make_ops(1, lb * BLK, 10, rb * BLK, BLK), deadline=time.monotonic() + 60)
        assert made[0].posted.wait(30)   # a request of the batch is posted (16 requests of 1 MiB each part, over tcp)
        p.ep.deregister(1)
        # deregister returned: every part is over and nothing of it is in flight
        assert all(part.finished and not part._posted for part in c.parts)
        for r in made:
            assert r.released_in_flight == []
        assert c.wait(5)
        assert isinstance(c.error, Cancelled), c.error
        st = p.ch.statistics()
        assert st["failed"] == 1 and st["split_batches"] == 1 and st["bytes_read"] == 0, st
    finally:
        p.close()


def test_an_agent_refusing_several_workers_falls_back_to_one_thread(monkeypatch):
    from llmdd_ucx._endpoint import UcxEndpoint
    real = UcxEndpoint._make_agent
    asked: list = []

    def make_agent(self, api, threads):
        asked.append(threads)
        if threads > 1:   # as a UCX without multi-thread support would
            raise RuntimeError("injected: no multi-thread UCX")
        return real(self, api, threads)
    monkeypatch.setattr(UcxEndpoint, "_make_agent", make_agent)
    p = _Pair()
    try:
        assert asked == [2, 1], asked
        assert p.ep.statistics()["post_threads"] == 0
        lb, rb = _random_blocks(8, 12 * MiB)
        c = p.ch.read(make_ops(1, lb * BLK, 10, rb * BLK, BLK), deadline=time.monotonic() + 60)
        assert c.wait(60) and c.error is None, c.error
        src = p.owner_bytes(10).reshape(-1, BLK)
        assert np.array_equal(p.buf.reshape(-1, BLK)[lb], src[rb])
        assert p.ch.statistics()["split_batches"] == 0
    finally:
        p.close()
