"""llmdd.lowlevel's shared transport books: region registry (pin, cancel, drain), batch sets, error mapping."""

from __future__ import annotations

import concurrent.futures
import errno
import socket
import ssl
import threading
import time

import numpy as np
import pytest

from llmdd.lowlevel import (
    Batch,
    BatchSet,
    Cancelled,
    Corrupt,
    MemRegion,
    PeerGone,
    RegionRegistry,
    RegionTable,
    RegisteredRegion,
    Refused,
    ThreadCompletion,
    TransportTimeout,
    make_ops,
    map_os_error,
)

pytestmark = pytest.mark.timeout(30)


def _region(rid: int, buf: np.ndarray, accessible: bool = True) -> MemRegion:
    return MemRegion(region_id=rid, addr=buf.ctypes.data, size=buf.nbytes, remote_accessible=accessible, placement=0)


def test_region_table_names_a_private_region_as_not_remote_accessible():
    table = RegionTable({1: 64}, private=[2])
    with pytest.raises(Refused, match="remote region 2 is not remote-accessible"):
        table.check(np.array([2]), np.array([0]), np.array([8]), "remote")
    # control: an id the owner never registered is refused as such
    with pytest.raises(Refused, match="remote region 3 is not registered"):
        table.check(np.array([3]), np.array([0]), np.array([8]), "remote")
    # same for a batch past the plain-integer path (vectorised check)
    ids = np.array([1] * 9 + [2])
    with pytest.raises(Refused, match="region 2 is not remote-accessible"):
        table.check(ids, np.zeros(10, np.int64), np.ones(10, np.int64), "remote")


def test_registry_tables_follow_registrations():
    rng = np.random.default_rng(7)
    bufs = {rid: rng.integers(0, 255, size=int(rng.integers(16, 256)), dtype=np.uint8) for rid in (5, 3, 9)}
    reg: RegionRegistry = RegionRegistry(threading.Condition(threading.Lock()))
    with reg.cond:
        for rid, buf in bufs.items():
            reg.add(RegisteredRegion(_region(rid, buf, accessible=rid != 9)))
        with pytest.raises(Refused, match="already registered"):
            reg.add(RegisteredRegion(_region(3, bufs[3])))
    assert reg.ids.tolist() == [3, 5, 9]
    assert reg.addrs.tolist() == [bufs[r].ctypes.data for r in (3, 5, 9)]
    assert len(reg.table) == 3 and len(reg.served) == 2
    with pytest.raises(Refused, match="region 9 is not remote-accessible"):
        reg.served.check(np.array([9]), np.array([0]), np.array([1]), "remote")
    with reg.cond:
        with pytest.raises(Refused, match="out of bounds"):
            reg.pin(make_ops(3, 0, 5, 0, len(bufs[3]) + 1), reg.served, Batch())
    assert all(e.busy == 0 for e in reg.entries.values())   # a refused batch pins nothing


def test_deregister_cancels_then_drains_the_batches_touching_the_region():
    rng = np.random.default_rng(11)
    src = rng.integers(0, 255, size=1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    other = np.zeros(64, np.uint8)
    reg: RegionRegistry = RegionRegistry(threading.Condition(threading.Lock()))
    with reg.cond:
        reg.add(RegisteredRegion(_region(1, dst)))
        reg.add(RegisteredRegion(_region(2, other)))
    copied = []
    started = threading.Event()

    def worker(batch: Batch) -> None:
        # copies chunk by chunk until aborted: a transport's worker checks ``aborted`` between chunks
        started.set()
        for i in range(0, len(src), 64):
            if batch.aborted:
                raise Cancelled("aborted")
            dst[i:i + 64] = src[i:i + 64]
            copied.append(i)
            time.sleep(0.001)

    def run(rid: int) -> Batch:
        batch = Batch()
        with reg.cond:
            reg.pin(make_ops(rid, 0, 0, 0, 8), {0: 8}, batch)
        batch.completion = ThreadCompletion([lambda: worker(batch)], deadline=time.monotonic() + 20,
                                            abort=batch.abort, on_done=lambda _c: reg.unpin(batch))
        return batch

    batch = run(1)
    assert started.wait(5)
    # control: deregistering another region leaves the batch running
    reg.deregister(2)
    assert not batch.completion.done() and not batch.aborted
    reg.deregister(1)
    # when deregister returned the batch was failed, drained and unpinned: no byte lands any more
    assert batch.completion.done() and isinstance(batch.completion.error, Cancelled)
    assert "deregistered" in str(batch.completion.error)
    assert batch.pinned == [] and not reg.batches
    n = len(copied)
    snapshot = dst.copy()
    time.sleep(0.05)
    assert len(copied) == n and np.array_equal(dst, snapshot)
    assert 0 < n < len(src) // 64   # it really was stopped part way
    assert reg.deregister(1) is None


def test_batch_set_close_refuses_new_batches_and_waits_for_those_in_flight():
    bs: BatchSet = BatchSet(threading.Condition(threading.Lock()))
    left = []

    class Slow:
        def fail(self, why: Exception) -> None:
            # leaves the set a little later, from another thread (as an on_done would)
            def later() -> None:
                time.sleep(0.05)
                left.append(why)
                bs.discard(self)
            threading.Thread(target=later, daemon=True).start()

    with bs.cond:
        for _ in range(3):
            bs.add(Slow())
        bs.enter()
    threading.Timer(0.1, lambda: (bs.cond.acquire(), bs.leave(), bs.cond.release())).start()
    t0 = time.monotonic()
    assert bs.close()
    assert len(left) == 3 and all(isinstance(w, Cancelled) for w in left)
    assert len(bs) == 0 and bs.busy == 0 and time.monotonic() - t0 >= 0.09
    with bs.cond, pytest.raises(Cancelled):
        bs.add(Slow())
    assert not bs.close()   # idempotent


@pytest.mark.parametrize("exc, kind", [
    (ConnectionResetError(errno.ECONNRESET, "reset"), PeerGone),
    (BrokenPipeError(errno.EPIPE, "pipe"), PeerGone),
    (OSError(errno.EBADF, "bad fd"), PeerGone),
    (EOFError("eof"), PeerGone),
    (BlockingIOError(errno.EAGAIN, "again"), TransportTimeout),
    (socket.timeout("timed out"), TransportTimeout),
    (ssl.SSLError(1, "certificate unknown"), Refused),
    (ssl.SSLEOFError(8, "eof"), PeerGone),
    (ValueError("bug"), Corrupt),
])
def test_map_os_error(exc, kind):
    err = map_os_error(exc)
    assert type(err) is kind, (exc, err)


def test_map_os_error_keeps_typed_errors_unless_the_peer_is_gone():
    err = Corrupt("bad frame")
    assert map_os_error(err) is err
    assert map_os_error(err, peer_alive=lambda: True) is err
    assert isinstance(map_os_error(err, peer_alive=lambda: False), PeerGone)
    t = TransportTimeout("late")
    assert map_os_error(t, peer_alive=lambda: False) is t   # a timeout stays a timeout


def test_thread_completion_on_a_pool_runs_the_first_part_inline():
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        where = []
        me = threading.get_ident()
        done = []
        parts = [lambda i=i: where.append((i, threading.get_ident())) for i in range(3)]
        c = ThreadCompletion(parts, deadline=time.monotonic() + 10, pool=pool.submit,
                             on_done=lambda c: done.append(c.recorded_error), start=False)
        assert not where
        c.start()
        assert c.wait(5) and c.error is None and done == [None]
        assert sorted(i for i, _ in where) == [0, 1, 2]
        assert dict(where)[0] == me and dict(where)[1] != me
        # a failing part fails the batch, typed, and the abort runs once
        aborts = []

        def bad() -> None:
            raise ConnectionResetError("reset")
        c2 = ThreadCompletion([bad, lambda: time.sleep(0.01)], deadline=time.monotonic() + 10, pool=pool.submit,
                              abort=lambda: aborts.append(1))
        assert c2.wait(5) and isinstance(c2.error, PeerGone) and aborts == [1]
    finally:
        pool.shutdown(wait=True)


def test_submitted_turns_a_raised_transport_error_into_the_completions_error():
    from llmdd.lowlevel import DoneCompletion, Refused, submitted

    ok = DoneCompletion(None)
    assert submitted(lambda a, b: ok if (a, b) == (1, 2) else None, 1, 2) is ok   # passes its arguments
    refusal = Refused("region 7 is not registered")

    def refuse(*_args):
        raise refusal

    completion = submitted(refuse, 1, 2)
    assert completion.done() and completion.error is refusal
    # control: anything that is not a TransportError is a bug and propagates
    with pytest.raises(ZeroDivisionError):
        submitted(lambda: 1 // 0)
