"""The engine's I/O loop (llmdd._control.ioloop): timers, cross-thread calls, readiness, bounded pools, strands."""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest

from llmdd._control.ioloop import EVENT_READ, IoLoop, Pool, PoolFull, Strand

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def loop():
    lp = IoLoop("test", workers=3)
    yield lp
    lp.close()


def _wait(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_timers_fire_in_deadline_order_and_cancelled_ones_never(loop):
    rng = random.Random(7)
    fired = []
    done = threading.Event()
    delays = [rng.uniform(0.0, 0.2) for _ in range(40)]
    cancelled = set(rng.sample(range(40), 10))
    timers: list = []

    def schedule():
        # on the loop thread: no timer can fire before every one is set and the cancelled ones are
        # cancelled (from another thread, a short one fired first when the machine was busy)
        timers.extend(loop.call_later(d, fired.append, i) for i, d in enumerate(delays))
        for i in cancelled:
            timers[i].cancel()
        loop.call_later(0.3, done.set)

    loop.call_soon(schedule)
    assert done.wait(5.0)
    assert len(timers) == 40
    # the order of the deadlines the loop computed (each delay counted from its own call_later; a tie
    # keeps the order of scheduling), not of the delays alone: time passes between two call_later
    expected = [i for i in sorted(range(40), key=lambda i: (timers[i].when, i)) if i not in cancelled]
    assert fired == expected


def test_call_soon_runs_on_the_loop_thread_in_order(loop):
    seen = []
    done = threading.Event()

    def record(i):
        seen.append((i, loop.in_loop()))

    threads = [threading.Thread(target=lambda k=k: [loop.call_soon(record, (k, j)) for j in range(50)])
               for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5.0)
    loop.call_soon(done.set)
    assert done.wait(5.0)
    assert all(on_loop for _, on_loop in seen) and len(seen) == 200
    for k in range(4):  # per producing thread, FIFO
        assert [j for (kk, j), _ in seen if kk == k] == list(range(50))


def test_a_callback_that_raises_does_not_stop_the_loop(loop):
    done = threading.Event()
    loop.call_soon(lambda: 1 / 0)
    loop.call_soon(done.set)
    assert done.wait(5.0)
    assert loop.dead is None


def test_readiness_of_a_socket_calls_its_handler(loop):
    a, b = socket.socketpair()
    a.setblocking(False)
    got = []
    done = threading.Event()

    def on_ready(mask):
        data = a.recv(100)
        got.append((mask & EVENT_READ, data))
        if len(b"".join(d for _, d in got)) >= 6:
            loop.forget(a)
            done.set()

    loop.set_events(a, EVENT_READ, on_ready)
    b.sendall(b"abc")
    b.sendall(b"def")
    assert done.wait(5.0)
    assert b"".join(d for _, d in got) == b"abcdef"
    a.close()
    b.close()


def test_pool_never_runs_more_threads_than_its_size():
    pool = Pool(3, "t")
    running, peak = [0], [0]
    lock = threading.Lock()
    release = threading.Event()
    done = threading.Semaphore(0)

    def task():
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        release.wait(5.0)
        with lock:
            running[0] -= 1
        done.release()

    for _ in range(20):
        pool.submit(task)
    assert _wait(lambda: running[0] == 3)
    assert pool.threads() == 3
    release.set()
    for _ in range(20):
        assert done.acquire(timeout=5.0)
    assert peak[0] == 3 and pool.threads() <= 3
    pool.close()
    assert pool.threads() == 0


def test_pool_refuses_work_when_no_worker_can_start_then_recovers(monkeypatch):
    pool = Pool(2, "t")
    real = Pool._start_worker
    failing = [True]

    def start(self):
        if failing[0]:
            raise RuntimeError("can't start new thread")
        return real(self)

    monkeypatch.setattr(Pool, "_start_worker", start)
    with pytest.raises(PoolFull):
        pool.submit(lambda: None)
    assert pool.start_failures == 1
    failing[0] = False
    ran = threading.Event()
    pool.submit(ran.set)
    assert ran.wait(5.0)
    pool.close()


def test_strand_keeps_order_across_a_shared_pool():
    pool = Pool(4, "t")
    strands = [Strand(pool) for _ in range(5)]
    seen = {i: [] for i in range(5)}
    left = threading.Semaphore(0)
    rng = random.Random(3)

    def task(i, j):
        time.sleep(rng.random() * 0.001)
        seen[i].append(j)
        left.release()

    for j in range(40):
        for i, s in enumerate(strands):
            s.submit(task, i, j)
    for _ in range(200):
        assert left.acquire(timeout=5.0)
    assert all(seen[i] == list(range(40)) for i in range(5))
    assert all(s.idle() for s in strands)
    pool.close()


def test_close_runs_what_was_queued_and_later_calls_run_inline():
    lp = IoLoop("closing", workers=1)
    a, b = socket.socketpair()
    lp.call_soon(a.close)
    lp.close()
    assert a.fileno() == -1
    lp.call_soon(b.close)   # the loop is gone: runs here
    assert b.fileno() == -1
    assert lp.threads() == 0
