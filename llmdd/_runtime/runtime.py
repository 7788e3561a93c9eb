"""The runtime seam: what the layers above need of time, timers, waiting, threads and sockets.

:class:`Runtime` is the one source of all of them for the whole engine (the composition root hands
it to every part): the real one is :class:`llmdd._runtime.ioloop.IoLoop` (its thread, time and waiting
primitives are :class:`llmdd._runtime.threads.SystemThreads`); a deterministic simulation of it,
:class:`llmdd.testing.sim.SimRuntime`, runs whole engines on one thread and a fake clock and needs
nothing of this package but this module.  Nothing here starts a thread or opens a socket of its own.

Rules for the code above (checked by ``tests/unit/test_runtime_seam.py``): no ``threading.Thread``,
``threading.Event`` / ``Condition`` / ``local``, ``time.sleep`` / ``time.monotonic`` or thread-pool
executor outside this package; a wait that may block goes through a primitive the runtime made
(:meth:`Threads.event`, :meth:`Threads.lock`, :meth:`Threads.condition`, a socket of
:meth:`Runtime.create_connection`), so a simulation can run something else meanwhile; a long-lived
worker (:meth:`Threads.start_worker`) waits only on such primitives.  Plain ``threading.Lock`` /
``RLock`` stay allowed for short critical sections that never wait inside (the project's lock rule:
no lock held while calling listeners, plugins or the network).
"""

from __future__ import annotations

import selectors
import socket
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike

__all__ = ["run_concurrently", "Runtime", "Threads", "Executor", "Waiter", "Lock", "Condition", "Worker", "Timer", "PoolFull",
           "EVENT_READ", "EVENT_WRITE"]

EVENT_READ = selectors.EVENT_READ
EVENT_WRITE = selectors.EVENT_WRITE


class Waiter(Protocol):
    """A one-shot flag a thread can wait on (``threading.Event``'s surface)."""

    def set(self) -> None: ...

    def is_set(self) -> bool: ...

    def wait(self, timeout: Optional[float] = None) -> bool: ...


class Lock(Protocol):
    """A mutual-exclusion lock (``threading.Lock``'s surface) whose ``acquire`` may wait by a timeout."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool: ...

    def release(self) -> None: ...

    def __enter__(self) -> bool: ...

    def __exit__(self, *exc: Any) -> None: ...


class Condition(Protocol):
    """A condition variable over a lock (``threading.Condition``'s surface)."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool: ...

    def release(self) -> None: ...

    def __enter__(self) -> bool: ...

    def __exit__(self, *exc: Any) -> None: ...

    def wait(self, timeout: Optional[float] = None) -> bool: ...

    def notify(self, n: int = 1) -> None: ...

    def notify_all(self) -> None: ...


class Worker(Protocol):
    """A long-lived worker started by :meth:`Threads.start_worker` (``threading.Thread``'s surface)."""

    name: str

    def join(self, timeout: Optional[float] = None) -> None: ...

    def is_alive(self) -> bool: ...


class Executor(Protocol):
    """Where blocking work runs (a :class:`Pool`); :class:`Strand` orders tasks on one."""

    name: str

    def submit(self, fn: Callable, *args: Any) -> None: ...

    def threads(self) -> int: ...

    def close(self, timeout: Optional[float] = 5.0) -> None:
        """Take no more tasks, let the queued ones run, and wait up to ``timeout`` seconds (``None``:
        without a limit) for the workers to end."""


class Threads(Protocol):
    """Time, waiting and workers: what every part of the engine may need, and what a part with no
    I/O of its own is handed (:class:`~llmdd._runtime.threads.SystemThreads` for real threads).

    Every blocking wait of the engine is a wait on something made here, so that a simulation (one
    thread, a fake clock) can run the rest of the world while a worker waits: a long-lived worker
    is a function that loops over such waits (it ends when what it waits on says so)."""

    def monotonic(self) -> float:
        """The clock of every deadline (seconds; ``time.monotonic()`` on the real runtime)."""

    def monotonic_ns(self) -> int: ...

    def sleep(self, seconds: float) -> None: ...

    def random(self) -> float:
        """A number in [0, 1) for jitter (the seeded generator of the world in a simulation)."""

    def event(self) -> Waiter: ...

    def lock(self) -> Lock: ...

    def rlock(self) -> Lock:
        """A lock its holder may take again (``threading.RLock``)."""

    def condition(self, lock: Optional[Lock] = None) -> Condition: ...

    def local(self) -> Any:
        """An object whose attributes are private to the running worker (``threading.local``)."""

    def start_worker(self, name: str, fn: Callable, *args: Any) -> Worker:
        """Run ``fn(*args)`` as a long-lived worker of its own (a daemon thread on the real runtime)."""

    def make_pool(self, size: int, name: str) -> Executor: ...


class Runtime(Threads, Protocol):
    """What the engine needs of time, threads, waiting and sockets: :class:`IoLoop` for real,
    :class:`llmdd.testing.sim.SimRuntime` in the deterministic simulation."""

    name: str
    pool: Executor
    dead: Optional[BaseException]

    def create_connection(self, address: tuple[str, int], timeout: float) -> socket.socket: ...

    def create_server(self, address: tuple[str, int], backlog: int) -> socket.socket: ...

    def in_loop(self) -> bool: ...

    def call_soon(self, fn: Callable, *args: Any) -> None: ...

    def call_later(self, delay: float, fn: Callable, *args: Any) -> "Timer": ...

    def on_dead(self, callback: Callable[[BaseException], None]) -> None: ...

    def set_events(self, fileobj: FileDescriptorLike, events: int,
                   handler: Optional[Callable[[int], None]]) -> None: ...

    def forget(self, fileobj: FileDescriptorLike) -> None: ...

    def watched(self) -> int: ...

    def threads(self) -> int: ...

    def close(self, timeout: float = 5.0) -> None: ...


class PoolFull(RuntimeError):
    """A task could not be queued (the pool is closed or a worker thread could not start)."""


class Timer:
    __slots__ = ("when", "fn", "args", "cancelled")

    def __init__(self, when: float, fn: Callable, args: tuple) -> None:
        self.when = when
        self.fn = fn
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def run_concurrently(threads: Threads, fn: Callable[[Any], Any], items: Sequence[Any], *, width: int,
                     name: str) -> list:
    """``[fn(item) for item in items]`` with up to ``width`` of the calls running at once, each on a
    worker of ``threads`` (:meth:`Threads.start_worker`); returns once every call returned, the
    results in the order of ``items``, and raises the first item's exception if a call raised."""
    items = list(items)
    n = len(items)
    outcome: list = [None] * n
    if n == 0:
        return []
    lock = threads.lock()
    state = [0]   # the next item to take

    def work() -> None:
        while True:
            with lock:
                i = state[0]
                if i >= n:
                    return
                state[0] = i + 1
            try:
                outcome[i] = (True, fn(items[i]))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                outcome[i] = (False, exc)

    workers = [threads.start_worker(f"{name}-{k}", work) for k in range(min(max(1, width), n))]
    for w in workers:
        w.join()
    results = []
    for ok, value in outcome:
        if not ok:
            raise value
        results.append(value)
    return results
