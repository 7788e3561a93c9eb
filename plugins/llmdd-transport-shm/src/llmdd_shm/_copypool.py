"""The persistent copy threads that every shm channel of this process shares (:class:`_CopyPool`)."""

from __future__ import annotations

import os
import queue
import threading
from typing import Callable


class _CopyPool:
    """Persistent copy threads shared by every shm channel of this process.

    A split batch hands its parts after the first to these threads and copies the first part in
    the caller's thread, so a pull on two cores runs two copying threads (the caller and one
    helper) and starts no thread: starting two threads per batch cost 5-25 ms per GiB under load
    (``Thread.start`` waits until the new thread runs).  A thread is added when every existing one
    is busy (concurrent batches), up to ``_POOL_MAX``; beyond that parts queue, bounded by their
    batch's deadline.  Threads are daemons that wait on the queue while idle (no CPU)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._threads: list = []
        self._idle = 0
        self._pid = os.getpid()

    def after_fork(self) -> None:
        """In a forked child: the parent's threads do not exist here, and its lock may be held."""
        self._lock = threading.Lock()
        self._reset()

    def submit(self, work: Callable[[], None]) -> None:
        with self._lock:
            if self._pid != os.getpid():  # forked without the at-fork hook (os.fork from C)
                self._reset()
            if self._idle:
                self._idle -= 1
            elif len(self._threads) < _POOL_MAX:
                t = threading.Thread(target=self._loop, name=f"llmdd-shm-copy-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            self._q.put(work)

    def _loop(self) -> None:
        q = self._q
        while True:
            work = q.get()
            try:
                work()
            except BaseException:  # noqa: BLE001 - a part records its own error; nothing may kill the thread
                pass
            work = None
            with self._lock:
                self._idle += 1

    def threads(self) -> int:
        with self._lock:
            return len(self._threads) if self._pid == os.getpid() else 0


_POOL_MAX = 16
copy_pool = _CopyPool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=copy_pool.after_fork)
