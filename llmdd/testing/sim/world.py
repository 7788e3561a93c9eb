"""The simulated world: one thread, a fake clock, a FIFO scheduler and the waiting primitives.

A :class:`World` runs everything of every simulated process on the thread that made it:

* **loop callbacks** (``call_soon``, due timers, ready sockets) run on the world's *hub*, one at a
  time, in the order they became runnable;
* **workers** (pool tasks, :meth:`~llmdd._runtime.runtime.Threads.start_worker` workers, and the
  test's own code, which is the main *fiber*) run as greenlets: a fiber runs until it waits on a
  primitive of the world (an event, a lock, a condition, a socket, ``sleep``, a worker's ``join``),
  and then the hub runs whatever else can run.  A fiber whose wait is over (the event was set, the
  lock given back, the deadline passed) is resumed in FIFO order with the rest;
* **time** is a number that moves only when nothing can run: to the next timer or to the deadline
  of a wait, never otherwise.  Nothing sleeps for real.

So a run is a function of its inputs and of the seed of :attr:`World.random` (the world's only
randomness): the same scenario gives the same sequence of steps, which :meth:`World.trace_hash`
sums up (a SHA-256 over every step's time and label).

A wait on the hub itself (a loop callback that blocks, which the real loop forbids) runs the
scheduler inside it, as a fallback.  A wait that nothing can ever end (no timer, no runnable fiber,
no deadline) raises :class:`Stuck` in the test's fiber instead of hanging; a callback, task or worker
that raises is recorded in :attr:`World.failures` (the real loop and pool log and contain it), and a
test asserts that list is empty.
"""

from __future__ import annotations

import collections
import hashlib
import heapq
import itertools
import math
import random
import weakref
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Union

try:
    import greenlet  # type: ignore[import-untyped]
except ImportError as exc:  # pragma: no cover - the extra is part of llmdd[test]
    raise ImportError("llmdd.testing.sim needs the greenlet package: pip install 'llmdd[sim]'") from exc

from llmdd._runtime.runtime import Timer
from llmdd.testing.sim.net import Network, Watchable

if TYPE_CHECKING:
    from llmdd.testing.sim.runtime import SimRuntime

__all__ = ["World", "Stuck", "Fiber"]

#: steps the world may take without its clock moving before it calls the run stuck (a livelock: a ready
#: socket nobody consumes, two workers waking each other for ever)
MAX_STEPS_PER_INSTANT = 2_000_000


class Stuck(AssertionError):
    """A wait that nothing can end, or a world that does not settle (a livelock)."""


class Fiber:
    """One simulated thread of control (a pool worker, a long-lived worker, the test's code)."""

    __slots__ = ("world", "name", "glet", "done", "runtime", "killed", "__weakref__")

    def __init__(self, world: "World", name: str, runtime: Optional[SimRuntime] = None) -> None:
        self.world = world
        self.name = name
        self.glet: Optional[greenlet.greenlet] = None
        self.done = False
        self.runtime = runtime   # the simulated process it belongs to (None: the test's own)
        self.killed = False      # its process crashed: it never runs again

    # threading.Thread's surface (llmdd._runtime.runtime.Worker)
    def join(self, timeout: Optional[float] = None) -> None:
        if self.world.current_fiber() is self:
            raise RuntimeError("cannot join the current worker")
        self.world.block(lambda: self.done, self.world.deadline(timeout), on=self)

    def is_alive(self) -> bool:
        return not self.done

    def __repr__(self) -> str:
        return f"<Fiber {self.name} {'done' if self.done else 'alive'}>"


class _Park:
    """A fiber waiting: resumed when one of the objects it waits on changes or its deadline passes."""

    __slots__ = ("glet", "label", "woken", "observer", "runtime", "timer")

    def __init__(self, glet: greenlet.greenlet, label: str, observer: bool, runtime: Optional[SimRuntime]) -> None:
        self.glet = glet
        self.label = label
        self.woken = False
        self.observer = observer   # waits on the world as a whole (rechecks after every other step)
        self.runtime = runtime     # the process of the waiting fiber (a frozen process resumes nothing)
        self.timer: Optional[Timer] = None   # its deadline


class World:
    """The scheduler, the clock, the seeded randomness and the network every simulated process shares."""

    def __init__(self, seed: int = 0, *, start: float = 1000.0, keep_log: bool = False) -> None:
        self.seed = seed
        self.random = random.Random(seed)
        self.now = start
        self.ready: collections.deque = collections.deque()     # (label, fn, args): run on the hub
        self._timers: list = []
        self._tseq = itertools.count()
        self._watch: dict[Any, tuple[int, Callable[[int], None]]] = {}
        #: watched sockets whose readiness may have changed since they were last found not ready (an
        #: ordered set): only these are checked, so a step costs nothing per idle socket
        self._maybe: dict[Any, None] = {}
        self._parked: dict[Any, list[_Park]] = {}                # what a fiber waits on -> its parked fibers
        self.failures: list[tuple[str, BaseException]] = []
        self.steps = 0
        self._instant_steps = 0
        self._trace = hashlib.sha256()
        self.log: Optional[list[str]] = [] if keep_log else None
        self._fibers: "weakref.WeakKeyDictionary[greenlet.greenlet, Fiber]" = weakref.WeakKeyDictionary()
        self._main = greenlet.getcurrent()
        self._fibers[self._main] = Fiber(self, "main")
        self._hub: Optional[greenlet.greenlet] = None
        self._live: dict[Fiber, None] = {}   # fibers spawned and not yet over, in spawn order
        self.net = Network(self)      # the simulated network and its faults
        self.running: Optional[SimRuntime] = None      # the runtime whose callback runs on the hub now
        self.shared: dict[str, Any] = {}   # what plugins of the world keep per world (the sim transport's books)
        #: called with a process's runtime when it crashes (after its fibers, timers and sockets are gone):
        #: what a plugin keeps per process (a transport's endpoints) is dropped here
        self.crash_hooks: list[Callable[[SimRuntime], None]] = []
        self._observer_resumed = False

    @property
    def servers(self) -> dict:
        """The listeners by address (``world.net.servers``)."""
        return self.net.servers

    @property
    def connections(self) -> list:
        """Every connection made, (client end, server end), in order (``world.net.connections``)."""
        return self.net.connections

    # ------------------------------------------------------------------ the trace
    def _record(self, label: str) -> None:
        self.steps += 1
        line = f"{self.now:.9f} {label}"
        self._trace.update(line.encode())
        self._trace.update(b"\n")
        if self.log is not None:
            self.log.append(line)

    def trace_hash(self) -> str:
        """A SHA-256 (64 hex digits) over every step so far: its time and label."""
        return self._trace.copy().hexdigest()

    # ------------------------------------------------------------------ fibers
    def current_fiber(self) -> Optional[Fiber]:
        return self._fibers.get(greenlet.getcurrent())

    def fibers(self) -> list[Fiber]:
        """The fibers spawned and not yet over (the test's own main fiber is not one)."""
        return list(self._live)

    def fibers_of(self, runtime: SimRuntime) -> list[Fiber]:
        """The live fibers of ``runtime``'s process, in spawn order."""
        return [f for f in self._live if f.runtime is runtime]

    def current_runtime(self) -> Optional[SimRuntime]:
        """The simulated process running now: the runtime of the loop callback on the hub, or of the
        running fiber (None: the test's own code)."""
        if self.on_hub():
            return self.running
        fiber = self._fibers.get(greenlet.getcurrent())
        return None if fiber is None else fiber.runtime

    def on_hub(self) -> bool:
        return self._hub is not None and greenlet.getcurrent() is self._hub

    def spawn(self, name: str, fn: Callable, *args: Any, on_error: Optional[Callable[[BaseException], None]] = None,
              runtime: Optional[SimRuntime] = None) -> Fiber:
        """Start ``fn(*args)`` as a fiber (it first runs when the scheduler reaches it, FIFO)."""
        fiber = Fiber(self, name, runtime)
        self._live[fiber] = None

        def body() -> None:
            try:
                fn(*args)
            except greenlet.GreenletExit:
                pass
            except BaseException as exc:  # noqa: BLE001 - a worker's failure is the test's to see
                if on_error is not None:
                    on_error(exc)
                else:
                    self.failures.append((name, exc))
            finally:
                fiber.done = True
                self._live.pop(fiber, None)
                self.wake(fiber)

        def start() -> None:
            if fiber.killed:
                fiber.done = True
                self._live.pop(fiber, None)
                return
            glet = greenlet.greenlet(body, parent=self._ensure_hub())
            fiber.glet = glet
            self._fibers[glet] = fiber
            glet.switch()

        self.ready.append((f"start:{name}", start, (), runtime))
        return fiber

    def _ensure_hub(self) -> greenlet.greenlet:
        if self._hub is None or self._hub.dead:
            self._hub = greenlet.greenlet(self._hub_loop, parent=self._main)
        return self._hub

    # ------------------------------------------------------------------ waiting
    def deadline(self, timeout: Optional[float]) -> float:
        """The absolute time of a wait of ``timeout`` seconds (None or negative: no deadline)."""
        if timeout is None or timeout < 0:
            return math.inf
        return self.now + timeout

    def block(self, pred: Callable[[], Any], until: float, *,
              on: Union[Hashable, list[Hashable], None] = None) -> bool:
        """Wait until ``pred()`` or the clock reaches ``until``; returns ``pred()``.

        ``on`` names what ``pred`` depends on (an object, or an iterable of objects, that call
        :meth:`wake` when they change): the fiber is resumed then, and at ``until``.  Without ``on``
        the fiber is resumed at ``until`` only (a sleep)."""
        if pred():
            return True
        if self.on_hub():
            return self._run_here(pred, until)
        glet = greenlet.getcurrent()
        fiber = self._fibers.get(glet)
        if fiber is not None and fiber.killed:
            raise greenlet.GreenletExit()   # its process crashed: a finally block that waits ends here
        label = f"resume:{fiber.name if fiber is not None else '?'}"
        runtime = None if fiber is None else fiber.runtime
        keys: tuple = () if on is None else (tuple(on) if isinstance(on, (list, tuple)) else (on,))
        while True:
            if self.now >= until:
                return bool(pred())
            park = _Park(glet, label, _Always in keys, runtime)
            for key in keys:
                self._parked.setdefault(key, []).append(park)
            timer = None
            if until != math.inf:
                timer = park.timer = self._push_timer(until, self._wake_park, (park,))
            self._ensure_hub().switch()
            # resumed by the hub: a key changed or the deadline passed
            if timer is not None:
                timer.cancelled = True
            for key in keys:
                waiting = self._parked.get(key)
                if waiting is not None:
                    try:
                        waiting.remove(park)
                    except ValueError:
                        pass
                    if not waiting:
                        del self._parked[key]
            if pred():
                return True

    def wake(self, key: Hashable) -> None:
        """``key`` changed: the fibers waiting on it are resumed (in the order they began to wait).

        A socket that changes (bytes or EOF arrived, bytes read, closed, unfrozen) wakes itself: then
        it and its peer (whose room to send depends on this end's buffer) are checked for readiness."""
        if key in self._watch:
            self._maybe[key] = None
        peer = getattr(key, "peer", None)
        if peer is not None and peer in self._watch:
            self._maybe[peer] = None
        waiting = self._parked.pop(key, None)
        if waiting:
            for park in waiting:
                self._wake_park(park)

    def _wake_park(self, park: _Park) -> None:
        if park.woken:
            return
        park.woken = True
        self.ready.append((park.label, self._resume, (park,), park.runtime))

    def _resume(self, park: _Park) -> None:
        if park.observer:
            self._observer_resumed = True
        if not park.glet.dead:
            park.glet.switch()

    # ------------------------------------------------------------------ the scheduler
    def _push_timer(self, when: float, fn: Callable, args: tuple, runtime: Optional[SimRuntime] = None) -> Timer:
        timer = Timer(when, fn, args)
        heapq.heappush(self._timers, (when, next(self._tseq), timer, runtime))
        return timer

    def call_later(self, delay: float, fn: Callable, args: tuple, runtime: Optional[SimRuntime] = None) -> Timer:
        return self._push_timer(self.now + max(0.0, delay), fn, args, runtime)

    def call_soon(self, label: str, fn: Callable, args: tuple, runtime: Optional[SimRuntime] = None) -> None:
        self.ready.append((label, fn, args, runtime))

    def watch(self, fileobj: Watchable, events: int, handler: Optional[Callable[[int], None]],
              runtime: Optional[SimRuntime] = None) -> None:
        if events and handler is not None and not getattr(fileobj, "closed", False):
            self._watch[fileobj] = (events, handler, runtime)   # type: ignore[assignment]
            self._maybe[fileobj] = None
        else:
            self._watch.pop(fileobj, None)

    def unwatch(self, fileobj: Watchable) -> None:
        self._watch.pop(fileobj, None)

    def recheck(self, fileobj: Watchable) -> None:
        """Check ``fileobj``'s readiness again (something it depends on changed without waking it)."""
        if fileobj in self._watch:
            self._maybe[fileobj] = None

    def watched_by(self, fileobjs: Iterable[Watchable]) -> int:
        return sum(1 for f in self._watch if f in fileobjs)

    def _call(self, label: str, fn: Callable, args: tuple, runtime: Optional[SimRuntime]) -> None:
        if runtime is not None and runtime.frozen:
            runtime.held.append((label, fn, args, runtime))   # runs when the process is thawed
            return
        if runtime is not None and runtime.crashed:
            return   # its process is gone: nothing of it runs again
        self._record(label if runtime is None or label.startswith(runtime.name) else f"{runtime.name}:{label}")
        previous, self.running = self.running, runtime
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - the real loop logs and contains it; the test asserts
            self.failures.append((label, exc))
        finally:
            self.running = previous

    def _step(self) -> bool:
        """Run one thing that can run now (a queued call, a resumed or new fiber, then a ready socket)."""
        if self.ready:
            label, fn, args, runtime = self.ready.popleft()
            self._call(label, fn, args, runtime)
            return True
        maybe = self._maybe
        while maybe:
            fileobj = next(iter(maybe))
            del maybe[fileobj]
            entry = self._watch.get(fileobj)
            if entry is None:
                continue
            events, handler, runtime = entry   # type: ignore[misc]
            if runtime is not None and runtime.frozen:
                continue   # checked again when it is thawed
            mask = fileobj.sim_ready() & events
            if mask:
                maybe[fileobj] = None   # readiness is level-triggered: checked again, after the others
                self._call(f"ready:{getattr(handler, '__qualname__', handler)!s}", handler, (mask,), runtime)
                return True
        return False

    def next_timer(self) -> Optional[Timer]:
        while self._timers and self._timers[0][2].cancelled:
            heapq.heappop(self._timers)
        return self._timers[0][2] if self._timers else None

    def _advance(self, until: float) -> bool:
        """Nothing can run now: move the clock to the next timer (not past ``until``) and run it;
        False when there is none before ``until``."""
        timer = self.next_timer()
        if timer is None or timer.when > until:
            return False
        _when, _seq, timer, runtime = heapq.heappop(self._timers)
        if timer.when > self.now:
            self.now = timer.when
            self._instant_steps = 0
        timer.cancelled = True
        self._call(f"timer:{getattr(timer.fn, '__qualname__', timer.fn)!s}", timer.fn, timer.args, runtime)
        return True

    def _count_instant(self) -> None:
        self._instant_steps += 1
        if self._instant_steps > MAX_STEPS_PER_INSTANT:
            raise Stuck(f"{MAX_STEPS_PER_INSTANT} steps without the clock moving (a ready socket nobody "
                        "consumes, or workers waking each other for ever)")

    def _hub_loop(self) -> None:
        while True:
            self._count_instant()
            self._observer_resumed = False
            if self._step():
                if not self._observer_resumed and _Always in self._parked:
                    self.wake(_Always)
                continue
            if self._advance(self.now):   # a timer due at this instant
                if _Always in self._parked:
                    self.wake(_Always)
                continue
            if _Idle in self._parked:   # nothing can run at this instant: settle() is over
                self.wake(_Idle)
                continue
            if self._advance(math.inf):
                if _Always in self._parked:
                    self.wake(_Always)
                continue
            # nothing can ever run again: the test's fiber waits for something that cannot happen
            self._main.throw(Stuck("waiting with no deadline for something nothing can do"))

    def _run_here(self, pred: Callable[[], Any], until: float) -> bool:
        """The scheduler run inside a wait on the hub (a loop callback that blocks)."""
        while True:
            if pred():
                return True
            self._count_instant()
            if self._step():
                continue
            if not self._advance(until):
                if until == math.inf:
                    raise Stuck("a loop callback waits with no deadline for something nothing can do")
                self.now = max(self.now, until)
                return bool(pred())

    # ------------------------------------------------------------------ driving the world from the test
    def run_until(self, pred: Callable[[], Any], until: float = math.inf) -> bool:
        """Run the world until ``pred()`` or the clock reaches ``until``; returns ``pred()``."""
        return self.block(pred, until, on=_Always)

    def run(self, seconds: float = 0.0) -> None:
        """Let ``seconds`` pass on the fake clock, running everything due meanwhile."""
        self.block(lambda: False, self.now + max(0.0, seconds))
        self.settle()

    def settle(self) -> None:
        """Run everything runnable now, without moving the clock."""
        self.block(self._idle_now, math.inf, on=_Idle)

    def _idle_now(self) -> bool:
        if self.ready:
            return False
        for fileobj in list(self._maybe):
            entry = self._watch.get(fileobj)
            if entry is not None:
                events, _handler, runtime = entry   # type: ignore[misc]
                if (runtime is None or not runtime.frozen) and fileobj.sim_ready() & events:
                    return False
            del self._maybe[fileobj]
        timer = self.next_timer()
        return timer is None or timer.when > self.now

    def wake_always(self) -> None:
        """Resume the fibers that wait on the world as a whole (:meth:`run_until`, :meth:`settle`)."""
        self.wake(_Always)

    def leftovers(self) -> dict:
        """What is still alive in the world: live fibers, armed timers, watched sockets, open sockets and
        listeners, parked waits.  All 0 once every engine of the world finalized and the world settled."""
        timers = sum(1 for _when, _seq, t, _rt in self._timers if not t.cancelled)
        return {"fibers": len(self._live), "timers": timers, "watched": len(self._watch),
                "sockets": self.net.open_sockets(), "parked": sum(len(v) for v in self._parked.values())}

    # ------------------------------------------------------------------ process faults
    def freeze(self, runtime: SimRuntime) -> None:
        """Stop ``runtime``'s process (as under SIGSTOP): none of its callbacks, timers, ready sockets
        or fibers runs until :meth:`thaw`; the network still delivers to its sockets."""
        runtime.frozen = True

    def thaw(self, runtime: SimRuntime) -> None:
        """Let a frozen process run again: what became runnable meanwhile runs, in its order."""
        if not runtime.frozen:
            return
        runtime.frozen = False
        held, runtime.held = runtime.held, []
        self.ready.extend(held)
        for fileobj, entry in self._watch.items():
            if entry[2] is runtime:   # type: ignore[misc]
                self._maybe[fileobj] = None
        self.wake_always()

    def kill(self, fiber: Fiber) -> None:
        """End ``fiber`` for good (its process crashed): it is resumed once with ``GreenletExit``, so
        only ``finally`` blocks run, and none of them can wait."""
        fiber.killed = True
        glet = fiber.glet
        if glet is None or glet.dead or fiber.done:
            fiber.done = True
            self._live.pop(fiber, None)
            return   # not started (it never will) or over
        if glet is greenlet.getcurrent():
            raise RuntimeError("a fiber cannot kill itself")
        for key, parks in list(self._parked.items()):   # its waits end with it
            left = []
            for park in parks:
                if park.glet is not glet:
                    left.append(park)
                elif park.timer is not None:
                    park.timer.cancel()
            if left:
                self._parked[key] = left
            else:
                del self._parked[key]
        glet.parent = greenlet.getcurrent()   # come back here, not to the hub
        glet.throw(greenlet.GreenletExit())

    def drop(self, runtime: SimRuntime) -> None:
        """Forget every timer and queued call of ``runtime``'s process (it crashed)."""
        for _when, _seq, timer, rt in self._timers:
            if rt is runtime:
                timer.cancelled = True
        self.ready = collections.deque(entry for entry in self.ready if entry[3] is not runtime)


class _AlwaysKey:
    """The key of waits that recheck after every step (:meth:`World.run_until`)."""

    def __repr__(self) -> str:
        return "<every step>"


_Always = _AlwaysKey()
_Idle = _AlwaysKey()   # the key of settle(): woken when nothing can run at this instant
