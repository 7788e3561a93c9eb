"""A deterministic simulation of the control plane's runtime: one thread, a fake clock, in-memory sockets.

Used by llmdd's link-protocol unit tests (``tests/unit/control/test_link_pump.py``); private to
llmdd.testing (its surface may change with the control plane's).

:class:`llmdd._runtime.runtime.Runtime` is everything the link manager, its connections and its
listeners ask of the world: the clock, timers, a pool for blocking work, a way to wait, and
sockets.  :class:`SimLoop` implements it over a :class:`World` shared by every engine of a test:

* time is a number that moves only when nothing can run (to the next timer, or to the deadline
  of whatever the test thread waits on); there is no sleep and no thread;
* a pool task, a loop callback, a timer and a ready socket are all steps of one FIFO
  scheduler, so a run is a function of its inputs (the same test, the same steps);
* sockets are byte buffers with the behaviour the code relies on: partial sends against a
  bounded receive buffer, ``BlockingIOError`` when non-blocking, timeouts when blocking, EOF
  after a shutdown, ``ECONNREFUSED`` where nobody listens.  A test can freeze a socket (its owner
  reads nothing: the peer's output backs up) or cut a connection (what is sent is lost, nothing
  is closed: silence).

Waiting (an event's ``wait``, a blocking ``recv``, ``sleep``) runs the scheduler until what is
waited for happened or the deadline passed on the fake clock.  A wait with no deadline that can
never end raises :class:`Stuck` instead of hanging the test; a callback or task that raises is
recorded in :attr:`World.failures` (the real loop logs and contains it), and tests assert that
list is empty.
"""

from __future__ import annotations

import collections
import errno
import heapq
import itertools
import math
import random
import socket
import threading
from typing import Any, Callable, Optional, Union

from llmdd._runtime.runtime import EVENT_READ, EVENT_WRITE, PoolFull, Timer

__all__ = ["World", "SimLoop", "SimSocket", "SimServerSocket", "Stuck"]

#: bytes a simulated socket's receive buffer holds before the sender's send() takes less (or blocks)
RX_CAPACITY = 256 * 1024
#: steps one wait may take: more means a callback keeps a socket ready without consuming it
MAX_STEPS = 200_000


class Stuck(AssertionError):
    """A wait with no deadline that nothing can end, or a scheduler that does not settle."""


class SimEvent:
    """``threading.Event`` on the simulation: ``wait`` runs the world until set or timed out."""

    def __init__(self, world: "World") -> None:
        self._world = world
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def clear(self) -> None:
        self._set = False

    def wait(self, timeout: Optional[float] = None) -> bool:
        until = math.inf if timeout is None else self._world.now + max(0.0, timeout)
        return self._world.run_until(self.is_set, until)


class _SimWorker:
    def __init__(self, name: str, done: "SimEvent") -> None:
        self.name = name
        self._done = done

    def join(self, timeout: Optional[float] = None) -> None:
        self._done.wait(timeout)

    def is_alive(self) -> bool:
        return not self._done.is_set()


class SimPool:
    """A pool whose tasks are scheduler steps (no thread)."""

    def __init__(self, world: "World", name: str) -> None:
        self._world = world
        self.name = name
        self.closed = False

    def submit(self, fn: Callable, *args: Any) -> None:
        if self.closed:
            raise PoolFull(f"pool {self.name} is closed")
        self._world.ready.append((f"{self.name}:{getattr(fn, '__qualname__', fn)!s}", fn, args))

    def threads(self) -> int:
        return 0

    def close(self, timeout: float = 5.0) -> None:
        self.closed = True


class SimSocket:
    """One end of an in-memory stream connection."""

    _fds = itertools.count(10_000)

    def __init__(self, world: "World", local: tuple[str, int], remote: tuple[str, int]) -> None:
        self._world = world
        self.local = local
        self.remote = remote
        self.peer: Optional[SimSocket] = None
        self.rx = bytearray()
        self.eof = False            # the peer shut its sending side (or closed)
        self.closed = False
        self.timeout: Optional[float] = None   # None blocking, 0.0 non-blocking, else a timeout
        self.frozen = False         # its owner's loop reads nothing (the peer's output backs up)
        self.capacity = RX_CAPACITY   # what its receive buffer holds before the peer's sends take less
        self.cut = False            # a partition: what this end sends is lost
        self.sent = 0
        self.eof_sent = False       # this end shut its sending side
        self._fd = next(self._fds)

    # socket API the control plane uses
    def fileno(self) -> int:
        return -1 if self.closed else self._fd

    def setblocking(self, flag: bool) -> None:
        self.timeout = None if flag else 0.0

    def settimeout(self, value: Optional[float]) -> None:
        self.timeout = value

    def setsockopt(self, *args: Any) -> None:
        pass

    def getsockname(self) -> tuple[str, int]:
        return self.local

    def getpeername(self) -> tuple[str, int]:
        return self.remote

    def _room(self) -> int:
        peer = self.peer
        if peer is None or peer.closed:
            return 0
        return max(0, peer.capacity - len(peer.rx))

    def send(self, data: Any) -> int:
        if self.closed:
            raise OSError(errno.EBADF, "Bad file descriptor")
        peer = self.peer
        if peer is None or peer.closed or self.eof_sent:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")
        if self._room() == 0:
            if self.timeout == 0.0:
                raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
            until = math.inf if self.timeout is None else self._world.now + self.timeout
            if not self._world.run_until(lambda: self._room() > 0 or peer.closed, until):
                raise socket.timeout("timed out")
            if peer.closed:
                raise BrokenPipeError(errno.EPIPE, "Broken pipe")
        view = memoryview(data).cast("B")
        n = min(len(view), self._room())
        if not self.cut:
            peer.rx += view[:n]
        self.sent += n
        return n

    def sendall(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            n = self.send(view)
            view = view[n:]

    def recv(self, size: int) -> bytes:
        if self.closed:
            raise OSError(errno.EBADF, "Bad file descriptor")
        if not self.rx and not self.eof:
            if self.timeout == 0.0:
                raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
            until = math.inf if self.timeout is None else self._world.now + self.timeout
            if not self._world.run_until(lambda: bool(self.rx) or self.eof or self.closed, until):
                raise socket.timeout("timed out")
            if self.closed:
                raise OSError(errno.EBADF, "Bad file descriptor")
        data = bytes(self.rx[:size])
        del self.rx[:size]
        return data

    def shutdown(self, how: int) -> None:
        if self.closed:
            raise OSError(errno.EBADF, "Bad file descriptor")
        self.eof_sent = True
        if self.peer is not None:
            self.peer.eof = True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.rx.clear()
        if self.peer is not None:
            self.peer.eof = True
        self._world.unwatch(self)

    # the simulation's readiness
    def sim_ready(self) -> int:
        if self.closed:
            return 0
        mask = 0
        if (self.rx or self.eof) and not self.frozen:
            mask |= EVENT_READ
        if self._room() > 0 or self.peer is None or self.peer.closed:
            mask |= EVENT_WRITE
        return mask


class SimServerSocket:
    """A listening socket: :meth:`World.connect` queues connections, ``accept`` takes them."""

    def __init__(self, world: "World", address: tuple[str, int], backlog: int) -> None:
        self._world = world
        self.address = address
        self.backlog_max = max(1, backlog)
        self.backlog: collections.deque = collections.deque()
        self.closed = False
        self.timeout: Optional[float] = None

    def fileno(self) -> int:
        return -1 if self.closed else 1

    def setblocking(self, flag: bool) -> None:
        self.timeout = None if flag else 0.0

    def getsockname(self) -> tuple[str, int]:
        return self.address

    def accept(self) -> tuple[SimSocket, tuple[str, int]]:
        if self.closed:
            raise OSError(errno.EBADF, "Bad file descriptor")
        if not self.backlog:
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        sock = self.backlog.popleft()
        return sock, sock.remote

    def shutdown(self, how: int) -> None:
        if self.closed:
            raise OSError(errno.EBADF, "Bad file descriptor")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._world.servers.pop(self.address, None)
        for sock in self.backlog:   # never accepted: the clients see the connection reset
            sock.close()
        self.backlog.clear()
        self._world.unwatch(self)

    def sim_ready(self) -> int:
        return EVENT_READ if self.backlog and not self.closed else 0


class World:
    """The scheduler, the clock and the network every :class:`SimLoop` of a test shares."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.random = random.Random(0)
        self.ready: collections.deque = collections.deque()     # (label, fn, args)
        self._timers: list = []
        self._tseq = itertools.count()
        self._watch: dict[Any, tuple[int, Callable[[int], None]]] = {}
        self.servers: dict[tuple[str, int], SimServerSocket] = {}
        self._ports = itertools.count(40_000)
        self.failures: list[tuple[str, BaseException]] = []
        self.steps = 0
        self.connections: list[tuple[SimSocket, SimSocket]] = []   # (client end, server end), in order

    def loop(self, name: str) -> "SimLoop":
        return SimLoop(self, name)

    # ------------------------------------------------------------------ scheduling
    def call_later(self, delay: float, fn: Callable, args: tuple) -> Timer:
        timer = Timer(self.now + max(0.0, delay), fn, args)
        heapq.heappush(self._timers, (timer.when, next(self._tseq), timer))
        return timer

    def watch(self, fileobj: Any, events: int, handler: Optional[Callable[[int], None]]) -> None:
        if events and handler is not None and not getattr(fileobj, "closed", False):
            self._watch[fileobj] = (events, handler)
        else:
            self._watch.pop(fileobj, None)

    def unwatch(self, fileobj: Any) -> None:
        self._watch.pop(fileobj, None)

    def watched_by(self, fileobjs: Any) -> int:
        return sum(1 for f in self._watch if f in fileobjs)

    def _call(self, label: str, fn: Callable, args: tuple) -> None:
        self.steps += 1
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - the real loop and pool log and contain it; the test asserts
            self.failures.append((label, exc))

    def step(self) -> bool:
        """Run one thing that can run now (a queued call or task, then a ready socket)."""
        if self.ready:
            label, fn, args = self.ready.popleft()
            self._call(label, fn, args)
            return True
        for fileobj, (events, handler) in list(self._watch.items()):
            mask = fileobj.sim_ready() & events
            if mask:
                self._call(f"ready:{getattr(handler, '__qualname__', handler)!s}", handler, (mask,))
                return True
        return False

    def next_timer(self) -> Optional[Timer]:
        while self._timers and self._timers[0][2].cancelled:
            heapq.heappop(self._timers)
        return self._timers[0][2] if self._timers else None

    def run_until(self, pred: Callable[[], Any], until: float) -> bool:
        """Run steps and timers until ``pred()`` or the clock reaches ``until``; returns ``pred()``."""
        steps = 0
        while True:
            if pred():
                return True
            steps += 1
            if steps > MAX_STEPS:
                raise Stuck(f"{MAX_STEPS} steps without settling (a ready socket nobody consumes?)")
            if self.step():
                continue
            timer = self.next_timer()
            if timer is None or timer.when > until:
                if until == math.inf:
                    raise Stuck("waiting with no deadline for something nothing can do")
                self.now = max(self.now, until)
                return bool(pred())
            heapq.heappop(self._timers)
            self.now = max(self.now, timer.when)
            timer.cancelled = True
            self._call(f"timer:{getattr(timer.fn, '__qualname__', timer.fn)!s}", timer.fn, timer.args)

    def run(self, seconds: float = 0.0) -> None:
        """Let ``seconds`` pass on the fake clock, running everything due meanwhile."""
        self.run_until(lambda: False, self.now + seconds)

    def settle(self) -> None:
        """Run everything runnable now, without moving the clock."""
        self.run_until(lambda: False, self.now)

    # ------------------------------------------------------------------ network
    def listen(self, address: tuple[str, int], backlog: int) -> SimServerSocket:
        host, port = address
        if port == 0:
            port = next(self._ports)
            while (host, port) in self.servers:
                port = next(self._ports)
        if (host, port) in self.servers:
            raise OSError(errno.EADDRINUSE, "Address already in use")
        server = SimServerSocket(self, (host, port), backlog)
        self.servers[(host, port)] = server
        return server

    def connect(self, address: tuple[str, int], timeout: Optional[float]) -> SimSocket:
        server = self.servers.get((address[0], int(address[1])))
        if server is None or server.closed:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        local = ("127.0.0.1", next(self._ports))
        client = SimSocket(self, local, server.address)
        accepted = SimSocket(self, server.address, local)
        client.peer, accepted.peer = accepted, client
        client.settimeout(timeout)
        server.backlog.append(accepted)
        self.connections.append((client, accepted))
        return client


class SimLoop:
    """One engine's view of the :class:`World`: the :class:`~llmdd._runtime.runtime.Runtime` it runs on."""

    def __init__(self, world: World, name: str) -> None:
        self.world = world
        self.name = name
        self.pool = SimPool(world, f"{name}-work")
        self.dead: Optional[BaseException] = None
        self._on_dead: list[Callable[[BaseException], None]] = []
        self._mine: set = set()
        self.closed = False

    def monotonic(self) -> float:
        return self.world.now

    def monotonic_ns(self) -> int:
        return int(round(self.world.now * 1e9))

    def sleep(self, seconds: float) -> None:
        self.world.run(max(0.0, seconds))

    def event(self) -> SimEvent:
        return SimEvent(self.world)

    def random(self) -> float:
        return self.world.random.random()

    @staticmethod
    def lock() -> Any:
        return threading.Lock()   # one thread: a lock is never contended across a wait here

    @staticmethod
    def rlock() -> Any:
        return threading.RLock()

    @staticmethod
    def condition(lock: Optional[Union[threading.Lock, threading.RLock]] = None) -> threading.Condition:
        return threading.Condition(lock)

    @staticmethod
    def local() -> Any:
        return threading.local()

    def start_worker(self, name: str, fn: Callable, *args: Any) -> Any:
        """A worker as one scheduler step (a wait inside it runs the scheduler, nested)."""
        done = SimEvent(self.world)

        def run() -> None:
            try:
                fn(*args)
            finally:
                done.set()

        self.world.ready.append((f"{self.name}:{name}", run, ()))
        return _SimWorker(name, done)

    def make_pool(self, size: int, name: str) -> SimPool:
        return SimPool(self.world, name)

    def create_connection(self, address: tuple[str, int], timeout: float) -> SimSocket:
        return self.world.connect(address, timeout)

    def create_server(self, address: tuple[str, int], backlog: int) -> SimServerSocket:
        return self.world.listen(address, backlog)

    def in_loop(self) -> bool:
        return True   # one thread: every caller is on "the loop"

    def call_soon(self, fn: Callable, *args: Any) -> None:
        self.world.ready.append((f"{self.name}:soon", fn, args))

    def call_later(self, delay: float, fn: Callable, *args: Any) -> Timer:
        return self.world.call_later(delay, fn, args)

    def on_dead(self, callback: Callable[[BaseException], None]) -> None:
        self._on_dead.append(callback)

    def set_events(self, fileobj: Any, events: int, handler: Optional[Callable[[int], None]]) -> None:
        if events and handler is None:
            raise ValueError("set_events: a handler is needed to watch for events")
        self._mine.add(fileobj)
        self.world.watch(fileobj, events, handler)

    def forget(self, fileobj: Any) -> None:
        self.world.unwatch(fileobj)

    def watched(self) -> int:
        return self.world.watched_by(self._mine)

    def threads(self) -> int:
        return 0

    def close(self, timeout: float = 5.0) -> None:
        self.closed = True
        self.pool.close()
