"""The real runtime's threads, time and waiting: :class:`SystemThreads`, and the bounded worker
:class:`Pool` and FIFO :class:`Strand` every runtime's parts use.

:class:`SystemThreads` is :class:`~llmdd._runtime.runtime.Threads` over ``threading`` and ``time``:
what :class:`~llmdd._runtime.ioloop.IoLoop` inherits, and what a part with no loop of its own
(:data:`SYSTEM`) is handed.  It is the only place of the engine that starts a thread, sleeps or reads
``time.monotonic`` (besides the loop thread itself).
"""

from __future__ import annotations

import collections
import itertools
import random
import threading
import time
from typing import Any, Callable, Optional

from llmdd._base.log import get_logger
from llmdd._runtime.runtime import Condition, Executor, Lock, PoolFull, Waiter, Worker

__all__ = ["SystemThreads", "SYSTEM", "Pool", "Strand"]

_log = get_logger("llmdd.io")


class Pool:
    """A bounded set of worker threads (started on demand, at most ``size``, ended after
    :attr:`IDLE_S` without work) and a FIFO queue.

    ``submit`` raises :class:`PoolFull` when a task cannot be queued: the pool is closed, or it
    needs a new worker and the thread cannot be started (a pids limit) while no worker runs;
    the caller refuses the one piece of work and goes on.  Idle workers wait for tasks; the
    thread count never exceeds ``size`` whatever the number of links or connections.
    """

    #: an idle worker ends after this long without work (the pool shrinks back to nothing when idle)
    IDLE_S = 1.0

    def __init__(self, size: int, name: str) -> None:
        self.size = max(1, int(size))
        self.name = name
        self._cond = threading.Condition(threading.Lock())
        self._tasks: collections.deque = collections.deque()
        self._workers: list[threading.Thread] = []
        self._idle = 0
        self._closed = False
        self._seq = itertools.count(1)
        self.start_failures = 0

    def _start_worker(self) -> threading.Thread:
        """Start one worker thread (a seam the tests patch to simulate a pids limit)."""
        t = threading.Thread(target=self._work, name=f"llmdd-{self.name}-{next(self._seq)}", daemon=True)
        t.start()
        return t

    def submit(self, fn: Callable, *args: Any) -> None:
        with self._cond:
            if self._closed:
                raise PoolFull(f"pool {self.name} is closed")
            need = self._idle <= len(self._tasks) and len(self._workers) < self.size
            alive = len(self._workers)
            self._tasks.append((fn, args))
            self._cond.notify()
        if not need:
            return
        try:
            t = self._start_worker()
        except RuntimeError as exc:  # "can't start new thread"
            with self._cond:
                self.start_failures += 1
                if alive:
                    return  # queued: a running worker takes it
                try:
                    self._tasks.remove((fn, args))
                except ValueError:
                    return  # already taken
            raise PoolFull(f"cannot start a worker thread for {self.name}: {exc}") from None
        with self._cond:
            self._workers.append(t)

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                while not self._tasks and not self._closed:
                    self._idle += 1
                    woken = self._cond.wait(self.IDLE_S)
                    self._idle -= 1
                    if not woken and not self._tasks:
                        break   # idle for a while: retire
                if not self._tasks:
                    try:
                        self._workers.remove(me)
                    except ValueError:
                        pass
                    return
                fn, args = self._tasks.popleft()
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - a task bug never kills a worker
                _log.error("llmdd.io.task_failed", pool=self.name, task=getattr(fn, "__qualname__", repr(fn)),
                           error=repr(exc))

    def threads(self) -> int:
        with self._cond:
            return len(self._workers)

    def close(self, timeout: Optional[float] = 5.0) -> None:
        with self._cond:
            self._closed = True
            workers = list(self._workers)
            self._cond.notify_all()
        me = threading.current_thread()
        end = None if timeout is None else time.monotonic() + timeout
        for t in workers:
            if t is not me:
                t.join(None if end is None else max(0.0, end - time.monotonic()))


class Strand:
    """Tasks of one resource (a link), run one at a time in submission order on a :class:`Pool`."""

    __slots__ = ("_pool", "_lock", "_queue", "_running")

    def __init__(self, pool: Executor) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._queue: collections.deque = collections.deque()
        self._running = False

    def submit(self, fn: Callable, *args: Any) -> None:
        with self._lock:
            self._queue.append((fn, args))
            if self._running:
                return
            self._running = True
        try:
            self._pool.submit(self._drain)
        except PoolFull:
            with self._lock:
                self._running = False
                self._queue.clear()
            raise

    def idle(self) -> bool:
        """Nothing queued or running (exact when read by the only thread that submits)."""
        return not self._running and not self._queue

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                fn, args = self._queue.popleft()
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001
                _log.error("llmdd.io.task_failed", pool=self._pool.name,
                           task=getattr(fn, "__qualname__", repr(fn)), error=repr(exc))


class SystemThreads:
    """:class:`~llmdd._runtime.runtime.Threads` over real threads and ``time.monotonic``."""

    @staticmethod
    def monotonic() -> float:
        return time.monotonic()

    @staticmethod
    def monotonic_ns() -> int:
        return time.monotonic_ns()

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(max(0.0, seconds))

    @staticmethod
    def random() -> float:
        return random.random()

    @staticmethod
    def event() -> Waiter:
        return threading.Event()

    @staticmethod
    def lock() -> Lock:
        return threading.Lock()

    @staticmethod
    def rlock() -> Lock:
        return threading.RLock()

    @staticmethod
    def condition(lock: Optional[Lock] = None) -> Condition:
        return threading.Condition(lock)   # type: ignore[arg-type]

    @staticmethod
    def local() -> Any:
        return threading.local()

    @staticmethod
    def start_worker(name: str, fn: Callable, *args: Any) -> Worker:
        t = threading.Thread(target=fn, args=args, name=name, daemon=True)
        t.start()
        return t

    @staticmethod
    def make_pool(size: int, name: str) -> Executor:
        return Pool(size, name)


#: the real threads, for parts built without a runtime of their own (tools, a transport's helpers)
SYSTEM = SystemThreads()
