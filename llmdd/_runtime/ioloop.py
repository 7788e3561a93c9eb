"""One I/O loop per engine: a ``selectors`` loop thread, timers, and bounded worker pools.

Why ``selectors`` and not ``asyncio``: the control plane's protocol objects are sans-io
(:mod:`llmdd._protocol`) and the public API is blocking (``link_clusters`` waits, pulls wait),
so the loop only has to turn readiness into calls of those objects.  A selector loop does that
in a few hundred lines with no coroutine colouring of the engine, no event loop that could
clash with an application's own asyncio loop in the same process, and one thread whose every
callback is a plain function call (cheap on the pull path: a reply wakes its waiter straight
from the loop thread).  ``asyncio`` would bring its own scheduling, task objects per
connection and a second threading model for the blocking API to bridge.

Rules of the loop (see docs/architecture.md, "The I/O loop"):

* callbacks run on the loop thread and never block: they read what is ready, feed sans-io
  objects, buffer what to send, arm timers;
* blocking work (transport plugins, hook subscribers, memory manager calls, transfers) runs on
  the :class:`Pool` (a fixed number of threads started on demand) or, when per-resource order
  matters, on a :class:`Strand` (FIFO order on the pool, one task at a time);
* selector registrations change on the loop thread only (other threads go through
  :meth:`IoLoop.call_soon`);
* a callback that raises is logged and contained; if the loop itself cannot continue (the
  selector fails), every ``on_dead`` callback is told once and the loop thread ends.

The loop is also the control plane's one source of time, waiting and sockets (the seam
:class:`~llmdd._runtime.runtime.Runtime`):
the link manager, its connections and listeners read the clock with :meth:`IoLoop.monotonic`,
wait on :meth:`IoLoop.event` objects, pause with :meth:`IoLoop.sleep` and open sockets with
:meth:`IoLoop.create_connection` / :meth:`IoLoop.create_server`, never with ``time``,
``threading`` or ``socket`` directly.  The engine runs on this class; the link protocol's unit
tests run the same code on a deterministic simulation of it (one thread, a fake clock, in-memory
sockets: ``llmdd/testing/_linksim.py``), like asyncio's loop is the one seam of its time and I/O.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import selectors
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from llmdd._base.log import get_logger
from llmdd._runtime.runtime import EVENT_READ, Executor, Timer
from llmdd._runtime.threads import Pool, Strand, SystemThreads

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike

__all__ = ["IoLoop", "Pool", "Strand"]

_log = get_logger("llmdd.io")


class IoLoop(SystemThreads):
    """The loop thread of one engine (or one transport endpoint); its time, waiting and workers are
    :class:`SystemThreads` (real threads and ``time.monotonic``)."""

    def __init__(self, name: str, *, workers: int = 8) -> None:
        self.name = name
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, EVENT_READ, self._on_wake)
        self._lock = threading.Lock()
        self._calls: collections.deque = collections.deque()
        self._timers: list = []
        self._tseq = itertools.count()
        self._woken = False
        self._stopping = False
        self.dead: Optional[BaseException] = None
        self._on_dead: list[Callable[[BaseException], None]] = []
        self.pool: Executor = Pool(workers, f"{name}-work")
        self._thread = threading.Thread(target=self._run, name=f"llmdd-io-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ sockets (any thread)
    @staticmethod
    def create_connection(address: tuple[str, int], timeout: float) -> socket.socket:
        return socket.create_connection(address, timeout=timeout)

    @staticmethod
    def create_server(address: tuple[str, int], backlog: int) -> socket.socket:
        return socket.create_server(address, backlog=backlog, reuse_port=False)

    # ------------------------------------------------------------------ scheduling (any thread)
    def in_loop(self) -> bool:
        """True on the loop thread, and on any thread once the loop thread has ended (then nothing
        else drives the selector)."""
        t = self._thread
        return threading.current_thread() is t or not t.is_alive()

    def call_soon(self, fn: Callable, *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread (from any thread; FIFO).  Once the loop has stopped,
        ``fn`` runs at once on the calling thread (closing a socket late still closes it)."""
        if self.dead is not None or (self._stopping and not self._thread.is_alive()):
            self._call(fn, *args)
            return
        with self._lock:
            self._calls.append((fn, args))
            wake = not self._woken
            self._woken = True
        if wake:
            self._wake()

    def call_later(self, delay: float, fn: Callable, *args: Any) -> Timer:
        """Run ``fn(*args)`` on the loop thread after ``delay`` seconds; ``Timer.cancel()`` stops it."""
        timer = Timer(time.monotonic() + max(0.0, delay), fn, args)
        with self._lock:
            earliest = not self._timers or timer.when < self._timers[0][0]
            heapq.heappush(self._timers, (timer.when, next(self._tseq), timer))
            wake = earliest and not self._woken and not self.in_loop()
            if wake:
                self._woken = True
        if wake:
            self._wake()
        return timer

    def on_dead(self, callback: Callable[[BaseException], None]) -> None:
        self._on_dead.append(callback)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, InterruptedError):
            pass  # a wake-up is already pending
        except OSError:
            pass  # closing

    # ------------------------------------------------------------------ registrations (loop thread)
    def set_events(self, fileobj: FileDescriptorLike, events: int, handler: Optional[Callable[[int], None]]) -> None:
        """Watch ``fileobj`` for ``events`` (0 = stop watching, ``handler`` None); ``handler(mask)`` runs
        on readiness."""
        if events and handler is None:
            raise ValueError("set_events: a handler is needed to watch for events")
        if not self.in_loop():
            self.call_soon(self.set_events, fileobj, events, handler)
            return
        try:
            key = self._sel.get_key(fileobj)
        except (KeyError, ValueError):
            key = None
        except RuntimeError:   # the selector is closed (the loop has ended): nothing to watch any more
            return
        try:
            if not events:
                if key is not None:
                    self._sel.unregister(fileobj)
            elif key is None:
                self._sel.register(fileobj, events, handler)
            elif key.events != events or key.data != handler:
                self._sel.modify(fileobj, events, handler)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:  # a closed socket or selector
            _log.debug("llmdd.io.register_failed", loop=self.name, error=repr(exc))

    def forget(self, fileobj: FileDescriptorLike) -> None:
        """Stop watching ``fileobj`` (safe from any thread, safe if already closed)."""
        self.set_events(fileobj, 0, None)

    def watched(self) -> int:
        watched = self._sel.get_map()
        return 0 if watched is None else max(0, len(watched) - 1)

    # ------------------------------------------------------------------ the loop
    def _on_wake(self, _mask: int) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _run(self) -> None:
        try:
            while not self._stopping:
                timeout = self._next_timeout()
                events = self._sel.select(timeout)
                for key, mask in events:
                    self._call(key.data, mask)
                self._run_timers()
                self._run_calls()
        except BaseException as exc:  # noqa: BLE001 - the selector itself failed: the loop cannot continue
            if self._stopping:
                return
            self.dead = exc
            _log.error("llmdd.io.loop_dead", loop=self.name, error=repr(exc))
            for cb in list(self._on_dead):
                try:
                    cb(exc)
                except BaseException as cb_exc:  # noqa: BLE001
                    _log.error("llmdd.io.on_dead_failed", loop=self.name, error=repr(cb_exc))
            self._run_calls()   # what was queued (closing sockets) still happens; later calls run inline

    def _call(self, fn: Callable, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - a callback bug never stops the loop
            _log.error("llmdd.io.callback_failed", loop=self.name,
                       callback=getattr(fn, "__qualname__", repr(fn)), error=repr(exc))

    def _next_timeout(self) -> Optional[float]:
        with self._lock:
            self._woken = False
            if self._calls:
                return 0.0
            while self._timers and self._timers[0][2].cancelled:
                heapq.heappop(self._timers)
            if not self._timers:
                return None
            return max(0.0, self._timers[0][0] - time.monotonic())

    def _run_timers(self) -> None:
        now = time.monotonic()
        due = []
        with self._lock:
            while self._timers and self._timers[0][0] <= now:
                due.append(heapq.heappop(self._timers)[2])
        for timer in due:
            if not timer.cancelled:
                timer.cancelled = True
                self._call(timer.fn, *timer.args)

    def _run_calls(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, collections.deque()
        for fn, args in calls:
            self._call(fn, *args)

    # ------------------------------------------------------------------ shutdown
    def threads(self) -> int:
        """Threads this loop owns now (the loop thread plus live pool workers)."""
        return int(self._thread.is_alive()) + self.pool.threads()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop and its pool.  Sockets still registered stay open (their owners close them)."""
        if self._stopping:
            return
        self._stopping = True
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            self._run_calls()   # what was queued before the stop (closing sockets) still happens
        self.pool.close(timeout)
        try:
            self._sel.close()
        except (OSError, ValueError):
            pass
        for s in (self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass
