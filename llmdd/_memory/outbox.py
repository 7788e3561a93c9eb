"""Ordered delivery of change records outside every lock of the memory layer.

The memory manager and the region table change under their own locks, but what those changes cause
(lifecycle events to hook subscribers, region notices to transports, table announcements to linked
peers) must never run under those locks: a listener that takes another component's lock while a
thread of that component waits for the memory lock is a deadlock (issue: a server registering caches
while clients link).  So a change is *recorded* under the lock, as a versioned record in this outbox,
and *delivered* after the lock is released.

Delivery rules:

* records are delivered one at a time, in the order they were recorded (their sequence number), by
  whichever thread finds the outbox idle (the *drainer*); no lock is held while a record runs;
* a thread that recorded changes waits, with no lock held, until its last record has been delivered
  (so when ``register_cache`` returns, transports know the region and peers were told, as before);
* a record delivered by the drainer that itself changes the memory tables (a hook subscriber that
  deallocates a cache) does not wait for its own records: they are delivered right after the current
  one, by the same drainer (waiting would wait for itself);
* a record that raises is logged and the outbox goes on: a listener cannot stop delivery.

Lock order: the owner's lock (memory manager, region table) -> ``Outbox._lock``; nothing is called
under ``Outbox._lock``.
"""

from __future__ import annotations

import collections
from typing import Callable, Optional

from llmdd._base.log import get_logger
from llmdd._runtime.runtime import Threads
from llmdd._runtime.threads import SYSTEM

__all__ = ["Outbox"]

_log = get_logger("llmdd.memory")

Record = Callable[[], None]


class Outbox:
    """A sequence of records delivered in order, outside the recorder's locks."""

    def __init__(self, name: str, threads: Optional[Threads] = None) -> None:
        self.name = name
        threads = SYSTEM if threads is None else threads
        self._lock = threads.lock()
        self._idle = threads.condition(self._lock)
        self._me = threads.local()   # .draining: this worker is the drainer
        self._queue: collections.deque[tuple[int, Record]] = collections.deque()
        self._recorded = 0       # sequence number of the last record
        self._delivered = 0      # sequence number of the last record delivered
        self._drainer = False    # a worker is delivering

    @property
    def recorded(self) -> int:
        return self._recorded

    @property
    def delivered(self) -> int:
        return self._delivered

    def record(self, record: Record, *, coalesce: bool = False) -> int:
        """Queue ``record`` (typically under the caller's own lock); returns its sequence number.

        ``coalesce``: when the last queued, undelivered record is this same callable, it stands for
        both (a "tables changed" notice needs to run once after a burst of changes, not per change).
        """
        with self._lock:
            if coalesce and self._queue and self._queue[-1][1] is record:
                return self._queue[-1][0]
            self._recorded += 1
            self._queue.append((self._recorded, record))
            return self._recorded

    def flush(self, upto: int | None = None) -> None:
        """Deliver queued records; return once the record numbered ``upto`` (default: every record
        queued so far) has been delivered.  Call with none of the recorder's locks held."""
        with self._lock:
            target = self._recorded if upto is None else upto
            while True:
                if self._delivered >= target:
                    return
                if not self._drainer:
                    self._drainer = True
                    self._me.draining = True
                    break
                if getattr(self._me, "draining", False):
                    return  # called from a record being delivered: the running drain delivers it
                self._idle.wait()
        try:
            while True:
                with self._lock:
                    if not self._queue:
                        return
                    seq, record = self._queue.popleft()
                try:
                    record()
                except Exception as exc:  # noqa: BLE001 - a listener cannot stop delivery
                    _log.error("llmdd.memory.delivery_failed", outbox=self.name, error=repr(exc))
                with self._lock:
                    self._delivered = seq
                    self._idle.notify_all()
        finally:
            with self._lock:
                self._drainer = False
                self._me.draining = False
                self._idle.notify_all()
