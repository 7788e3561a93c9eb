"""The runtime seam: what the layers above need of time, timers, waiting, threads and sockets.

:class:`Runtime` is the one source of all of them for the control plane (and what the engine's parts
are handed): the real one is :class:`llmdd._runtime.ioloop.IoLoop`; the link protocol's unit tests run the
same code on a deterministic simulation (``llmdd/testing/_linksim.py``), which needs nothing of this
package but this module.  Nothing here starts a thread or opens a socket.
"""

from __future__ import annotations

import selectors
import socket
from typing import Any, Callable, Optional, Protocol

__all__ = ["Runtime", "Executor", "Waiter", "Timer", "PoolFull", "EVENT_READ", "EVENT_WRITE"]

EVENT_READ = selectors.EVENT_READ
EVENT_WRITE = selectors.EVENT_WRITE


class Waiter(Protocol):
    """A one-shot flag a thread can wait on (``threading.Event``'s surface)."""

    def set(self) -> None: ...

    def is_set(self) -> bool: ...

    def wait(self, timeout: Optional[float] = None) -> bool: ...


class Executor(Protocol):
    """Where blocking work runs (a :class:`Pool`); :class:`Strand` orders tasks on one."""

    name: str

    def submit(self, fn: Callable, *args: Any) -> None: ...

    def threads(self) -> int: ...

    def close(self, timeout: float = 5.0) -> None: ...


class Runtime(Protocol):
    """What the control plane needs of time, threads, waiting and sockets: :class:`IoLoop` here,
    a deterministic simulation in the link protocol's unit tests."""

    name: str
    pool: Executor
    dead: Optional[BaseException]

    def monotonic(self) -> float: ...

    def monotonic_ns(self) -> int: ...

    def sleep(self, seconds: float) -> None: ...

    def event(self) -> Waiter: ...

    def make_pool(self, size: int, name: str) -> Executor: ...

    def create_connection(self, address: tuple[str, int], timeout: float) -> socket.socket: ...

    def create_server(self, address: tuple[str, int], backlog: int) -> socket.socket: ...

    def in_loop(self) -> bool: ...

    def call_soon(self, fn: Callable, *args: Any) -> None: ...

    def call_later(self, delay: float, fn: Callable, *args: Any) -> "Timer": ...

    def on_dead(self, callback: Callable[[BaseException], None]) -> None: ...

    def set_events(self, fileobj: Any, events: int, handler: Optional[Callable[[int], None]]) -> None: ...

    def forget(self, fileobj: Any) -> None: ...

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
