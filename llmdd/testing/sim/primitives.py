"""The waiting primitives of a simulated world: ``threading``'s Event, Lock, RLock, Condition and local.

A wait on one of them is a wait of the world (:meth:`~llmdd.testing.sim.world.World.block`): the
waiting fiber parks, the rest of the world runs, and it is resumed in FIFO order when what it waits
on changes or its deadline passes on the world's clock.  A fiber that takes a :class:`SimLock` it
already holds raises :class:`~llmdd.testing.sim.world.Stuck` (a deadlock) instead of hanging.
"""

from __future__ import annotations

import collections
import math
import weakref
from typing import Any, Callable, Optional

import greenlet  # type: ignore[import-untyped]

from llmdd.testing.sim.world import Stuck, World

__all__ = ["SimEvent", "SimLock", "SimRLock", "SimCondition", "SimLocal"]


class SimEvent:
    """``threading.Event`` in the world."""

    __slots__ = ("_world", "_set")

    def __init__(self, world: World) -> None:
        self._world = world
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._world.wake(self)

    def is_set(self) -> bool:
        return self._set

    def clear(self) -> None:
        self._set = False

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._world.block(self.is_set, self._world.deadline(timeout), on=self)


class SimLock:
    """``threading.Lock`` in the world: a contended ``acquire`` lets other fibers run."""

    __slots__ = ("_world", "_owner", "__weakref__")

    def __init__(self, world: World) -> None:
        self._world = world
        self._owner: Optional[greenlet.greenlet] = None   # the holder (a fiber's greenlet, or the hub)

    def _me(self) -> greenlet.greenlet:
        return greenlet.getcurrent()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = self._me()
        if self._owner is None:
            self._owner = me
            return True
        if self._owner is me:
            raise Stuck(f"deadlock: {self._world.current_fiber()} takes a lock it holds")
        if not blocking:
            return False
        if not self._world.block(lambda: self._owner is None, self._world.deadline(timeout), on=self):
            return False
        self._owner = me
        return True

    def release(self) -> None:
        if self._owner is None:
            raise RuntimeError("release unlocked lock")
        self._owner = None
        self._world.wake(self)

    def locked(self) -> bool:
        return self._owner is not None

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    # what SimCondition needs of its lock
    def _release_save(self) -> Optional[int]:
        self.release()
        return None

    def _acquire_restore(self, _state: Optional[int]) -> None:
        self.acquire()

    def _is_owned(self) -> bool:
        return self._owner is self._me()


class SimRLock(SimLock):
    """``threading.RLock`` in the world."""

    __slots__ = ("_count",)

    def __init__(self, world: World) -> None:
        super().__init__(world)
        self._count = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = self._me()
        if self._owner is me:
            self._count += 1
            return True
        if self._owner is not None:
            if not blocking:
                return False
            if not self._world.block(lambda: self._owner is None, self._world.deadline(timeout), on=self):
                return False
        self._owner = me
        self._count = 1
        return True

    def release(self) -> None:
        if self._owner is not self._me():
            raise RuntimeError("cannot release un-acquired lock")
        self._count -= 1
        if self._count == 0:
            self._owner = None
            self._world.wake(self)

    def _release_save(self) -> Optional[int]:
        count, self._count = self._count, 0
        self._owner = None
        self._world.wake(self)
        return count

    def _acquire_restore(self, count: Optional[int]) -> None:
        self.acquire()
        if count is not None:   # always, from this lock's _release_save
            self._count = count


class _Waiting:
    __slots__ = ("notified",)

    def __init__(self) -> None:
        self.notified = False


class SimCondition:
    """``threading.Condition`` in the world (over a :class:`SimLock` or :class:`SimRLock`)."""

    def __init__(self, world: World, lock: Optional[SimLock] = None) -> None:
        self._world = world
        self._lock: SimLock = lock if lock is not None else SimRLock(world)
        self._waiters: collections.deque[_Waiting] = collections.deque()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()

    def wait(self, timeout: Optional[float] = None) -> bool:
        if not self._lock._is_owned():
            raise RuntimeError("cannot wait on un-acquired lock")
        me = _Waiting()
        self._waiters.append(me)
        state = self._lock._release_save()
        try:
            return self._world.block(lambda: me.notified, self._world.deadline(timeout), on=me)
        finally:
            if not me.notified:
                try:
                    self._waiters.remove(me)
                except ValueError:
                    pass
            self._lock._acquire_restore(state)

    def wait_for(self, predicate: Callable[[], Any], timeout: Optional[float] = None) -> Any:
        until = self._world.deadline(timeout)
        result = predicate()
        while not result:
            left = until - self._world.now
            if left <= 0:
                break
            self.wait(None if until == math.inf else left)
            result = predicate()
        return result

    def notify(self, n: int = 1) -> None:
        if not self._lock._is_owned():
            raise RuntimeError("cannot notify on un-acquired lock")
        while self._waiters and n > 0:
            waiting = self._waiters.popleft()
            waiting.notified = True
            self._world.wake(waiting)
            n -= 1

    def notify_all(self) -> None:
        self.notify(len(self._waiters))


class SimLocal:
    """``threading.local`` in the world: attributes private to the running fiber."""

    def __init__(self) -> None:
        object.__setattr__(self, "_per", weakref.WeakKeyDictionary())

    def _mine(self) -> dict:
        per = object.__getattribute__(self, "_per")
        me = greenlet.getcurrent()
        d = per.get(me)
        if d is None:
            d = per[me] = {}
        return d

    def __getattr__(self, name: str) -> Any:
        try:
            return self._mine()[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self._mine()[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self._mine()[name]
        except KeyError:
            raise AttributeError(name) from None
