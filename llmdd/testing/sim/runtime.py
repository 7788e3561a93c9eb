""":class:`SimRuntime`: the engine's :class:`~llmdd._runtime.runtime.Runtime` on a simulated :class:`World`.

One :class:`SimRuntime` is one simulated process's runtime (what :class:`~llmdd._runtime.ioloop.IoLoop`
is to a real engine): its loop callbacks and timers run on the world's hub, its pool tasks and
workers are fibers of the world, its clock is the world's, its sockets are the world's in-memory
sockets.  Every runtime of a world shares the one thread, clock and scheduler, so many engines run
side by side deterministically.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any, Callable, Optional

from llmdd._runtime.runtime import PoolFull, Timer
from llmdd.testing.sim import net
from llmdd.testing.sim.primitives import SimCondition, SimEvent, SimLocal, SimLock, SimRLock
from llmdd.testing.sim.world import Fiber, World

__all__ = ["SimRuntime", "SimPool"]


class SimPool:
    """The bounded worker pool (:class:`~llmdd._runtime.threads.Pool`) in the world: at most ``size``
    worker fibers, started on demand, taking queued tasks in FIFO order; a worker ends when the
    queue is empty."""

    def __init__(self, world: World, size: int, name: str, runtime: Optional[SimRuntime] = None) -> None:
        self._world = world
        self.size = max(1, int(size))
        self.name = name
        self._runtime = runtime
        self._tasks: collections.deque = collections.deque()
        self._workers: list[Fiber] = []
        self._seq = itertools.count(1)
        self._starting = 0   # workers started that have not yet taken a task
        self.closed = False

    def submit(self, fn: Callable, *args: Any) -> None:
        if self.closed:
            raise PoolFull(f"pool {self.name} is closed")
        self._tasks.append((fn, args))
        if len(self._workers) < self.size and self._starting < len(self._tasks):
            self._starting += 1
            worker = self._world.spawn(f"{self.name}-{next(self._seq)}", self._work, runtime=self._runtime)
            self._workers.append(worker)

    def _work(self) -> None:
        me = self._world.current_fiber()
        self._starting -= 1
        try:
            while self._tasks:
                fn, args = self._tasks.popleft()
                try:
                    fn(*args)
                except Exception as exc:  # noqa: BLE001 - the real pool logs and contains it; the test asserts
                    self._world.failures.append((f"{self.name}:{getattr(fn, '__qualname__', fn)!s}", exc))
        finally:
            if me in self._workers:
                self._workers.remove(me)

    def threads(self) -> int:
        return len(self._workers)

    def close(self, timeout: Optional[float] = 5.0) -> None:
        self.closed = True
        me = self._world.current_fiber()
        until = self._world.deadline(timeout)
        for worker in list(self._workers):
            if worker is not me:
                self._world.block(_done_of(worker), until, on=worker)


def _done_of(worker: Fiber) -> Callable[[], bool]:
    return lambda: worker.done


class SimRuntime:
    """One simulated process's runtime (:class:`~llmdd._runtime.runtime.Runtime`) on ``world``.

    ``process`` names the simulated process (what the network's partitions and stalls name; it stays
    the same across restarts), ``incarnation`` counts its lives (1 first; ``name`` is ``process``,
    then ``process#2``, ...).  :meth:`crash` ends this life at once; a restart is a new
    :class:`SimRuntime` of the same process with the next incarnation."""

    def __init__(self, world: World, name: str, *, workers: int = 8, incarnation: int = 1) -> None:
        self.world = world
        self.process = name
        self.incarnation = incarnation
        self.name = name if incarnation == 1 else f"{name}#{incarnation}"
        self.frozen = False
        self.crashed = False
        self.held: list = []   # what became runnable while frozen (World.thaw queues it)
        self._sockets: list = []   # every socket and listener it opened or accepted
        self.pool = SimPool(world, workers, f"{self.name}-work", self)
        self.dead: Optional[BaseException] = None
        self._on_dead: list[Callable[[BaseException], None]] = []
        self._mine: set[net.Watchable] = set()
        self._workers: list[Fiber] = []
        self._pools: list[SimPool] = [self.pool]
        self.closed = False

    # ------------------------------------------------------------------ time, randomness, waiting, workers
    def monotonic(self) -> float:
        return self.world.now

    def monotonic_ns(self) -> int:
        return int(round(self.world.now * 1e9))

    def sleep(self, seconds: float) -> None:
        self.world.block(lambda: False, self.world.now + max(0.0, seconds))

    def random(self) -> float:
        return self.world.random.random()

    def event(self) -> SimEvent:
        return SimEvent(self.world)

    def lock(self) -> SimLock:
        return SimLock(self.world)

    def rlock(self) -> SimRLock:
        return SimRLock(self.world)

    def condition(self, lock: Optional[SimLock] = None) -> SimCondition:
        return SimCondition(self.world, lock)

    def local(self) -> SimLocal:
        return SimLocal()

    def start_worker(self, name: str, fn: Callable, *args: Any) -> Fiber:
        worker = self.world.spawn(f"{self.name}:{name}", fn, *args, runtime=self)
        self._workers.append(worker)
        return worker

    def make_pool(self, size: int, name: str) -> SimPool:
        pool = SimPool(self.world, size, f"{self.name}:{name}", self)
        self._pools.append(pool)
        return pool

    # ------------------------------------------------------------------ sockets
    def create_connection(self, address: tuple[str, int], timeout: float) -> net.SimSocket:
        sock = net.connect(self.world, address, timeout, self.process)
        self._sockets.append(sock)
        return sock

    def create_server(self, address: tuple[str, int], backlog: int) -> net.SimServerSocket:
        server = net.listen(self.world, address, backlog, self.process)
        server.owner = self
        self._sockets.append(server)
        return server

    # ------------------------------------------------------------------ the loop
    def in_loop(self) -> bool:
        """True while one of this runtime's loop callbacks runs (on the world's hub), and once it is closed."""
        return self.closed or (self.world.on_hub() and self.world.running is self)

    def call_soon(self, fn: Callable, *args: Any) -> None:
        if self.closed:   # as the real loop once stopped: it runs at once on the calling thread
            fn(*args)
            return
        self.world.call_soon(f"{self.name}:{getattr(fn, '__qualname__', fn)!s}", fn, args, self)

    def call_later(self, delay: float, fn: Callable, *args: Any) -> Timer:
        return self.world.call_later(delay, self._timer, (fn, args), self)

    def _timer(self, fn: Callable, args: tuple) -> None:
        if not self.closed:   # a stopped loop runs no timer
            fn(*args)

    def on_dead(self, callback: Callable[[BaseException], None]) -> None:
        self._on_dead.append(callback)

    def set_events(self, fileobj: net.Watchable, events: int, handler: Optional[Callable[[int], None]]) -> None:
        if events and handler is None:
            raise ValueError("set_events: a handler is needed to watch for events")
        if self.closed:
            return
        if events:
            self._mine.add(fileobj)
        self.world.watch(fileobj, events, handler, self)

    def forget(self, fileobj: net.Watchable) -> None:
        self.world.unwatch(fileobj)

    def watched(self) -> int:
        return self.world.watched_by(self._mine)

    def threads(self) -> int:
        """Fibers this runtime owns now (its pools' workers and its long-lived workers)."""
        return sum(p.threads() for p in self._pools) + sum(1 for w in self._workers if not w.done)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop (its sockets stay open: their owners close them) and its pool."""
        if self.closed:
            return
        self.closed = True
        for fileobj in list(self._mine):
            self.world.unwatch(fileobj)
        self.pool.close(timeout)

    def crash(self) -> None:
        """The process dies now (as under SIGKILL): none of its fibers, callbacks or timers runs again
        (a fiber's ``finally`` blocks run once and cannot wait), the kernel closes its sockets (its
        peers read EOF after what was on the wire), and the world's :attr:`~World.crash_hooks` drop
        what plugins keep for it.  Its engine object is left as it is: nothing may call it again."""
        if self.crashed:
            return
        self.crashed = True
        self.closed = True
        self.frozen = False
        self.held.clear()
        for fiber in self.world.fibers_of(self):
            self.world.kill(fiber)
        self.world.drop(self)
        for fileobj in list(self._mine):
            self.world.unwatch(fileobj)
        for sock in self._sockets:
            sock.close()
        for hook in list(self.world.crash_hooks):
            hook(self)
        self.world.wake_always()

    def __repr__(self) -> str:
        return f"<SimRuntime {self.name}{' closed' if self.closed else ''}>"
