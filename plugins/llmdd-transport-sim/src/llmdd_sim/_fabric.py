"""The fabric: the clock the transport runs on, the simulated processes it connects, and its faults.

A :class:`Fabric` is what every endpoint of the ``sim`` transport in one Python process shares: a
:class:`Clock` (time, timers, waiting), a seeded :class:`random.Random`, the latency and fault
settings of the transport (:class:`TransportFaults`) and the state of the simulated processes
(alive with an incarnation, frozen, reachable from each other).  Two clocks exist:

* the cluster simulator's (``llmdd.testing.sim``): one thread, a simulated clock that moves only when
  nothing can run; every landing of a batch is a timer of that world, so a seed decides a whole run;
* :class:`RealClock`: real time and one timer thread, so that the transport runs the conformance suite
  (``llmdd.testing.check_transport``), which drives it from real threads on ``time.monotonic()``.

Fabrics are installed by name (:func:`install`); an endpoint finds its fabric by the engine option
``llmdd.sim.fabric`` (default ``"default"``) and names its simulated process with
``llmdd.sim.process``.
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
from typing import Any, Callable, Optional, Protocol, Union

import attrs

__all__ = ["Clock", "RealClock", "Fabric", "TransportFaults", "install", "uninstall", "fabric", "installed"]


class Handle(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """Time, timers and waiting, as the transport needs them (deadlines are this clock's values)."""

    def now(self) -> float: ...

    def call_later(self, delay: float, fn: Callable[..., None], *args: Any) -> Handle: ...

    def run_until(self, pred: Callable[[], bool], until: float, key: Any = None) -> bool:
        """Wait (run the simulation, or block) until ``pred()`` or the clock reaches ``until``;
        return ``pred()``.  ``key``: what ``pred`` depends on; :meth:`notify` names it when it changes."""
        ...

    def notify(self, key: Any) -> None:
        """``key`` changed (a batch finished): wake whoever waits on it."""
        ...


class _Timer:
    __slots__ = ("when", "fn", "args", "cancelled")

    def __init__(self, when: float, fn: Callable[..., None], args: tuple) -> None:
        self.when, self.fn, self.args, self.cancelled = when, fn, args, False

    def cancel(self) -> None:
        self.cancelled = True


class RealClock:
    """Real time (``time.monotonic()``) and one daemon timer thread, started on the first timer.

    Timer callbacks run on that thread holding :attr:`lock`; :meth:`run_until` waits on the same
    lock's condition, woken after every callback."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._cv = threading.Condition(self.lock)
        self._heap: list = []
        self._seq = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False

    def now(self) -> float:
        return time.monotonic()

    def call_later(self, delay: float, fn: Callable[..., None], *args: Any) -> _Timer:
        timer = _Timer(time.monotonic() + max(0.0, delay), fn, args)
        with self._cv:
            heapq.heappush(self._heap, (timer.when, next(self._seq), timer))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="llmdd-sim-clock", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return timer

    def notify(self, key: Any) -> None:
        with self._cv:
            self._cv.notify_all()

    def run_until(self, pred: Callable[[], bool], until: float, key: Any = None) -> bool:
        with self._cv:
            while not pred():
                left = until - time.monotonic()
                if left <= 0:
                    return bool(pred())
                self._cv.wait(left)
            return True

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(5.0)

    def _run(self) -> None:
        with self._cv:
            while not self._stopped:
                now = time.monotonic()
                while self._heap and (self._heap[0][2].cancelled or self._heap[0][0] <= now):
                    _, _, timer = heapq.heappop(self._heap)
                    if not timer.cancelled:
                        timer.cancelled = True
                        timer.fn(*timer.args)
                self._cv.notify_all()
                self._cv.wait(None if not self._heap else max(0.0, self._heap[0][0] - time.monotonic()))


@attrs.define
class TransportFaults:
    """The transport's own latency and faults; probabilities are per batch, drawn from the fabric's rng.

    ``fail``: the batch fails (:class:`~llmdd.lowlevel.PeerGone` or :class:`~llmdd.lowlevel.Corrupt`)
    and nothing lands; ``late``: it lands after its deadline (the deadline fails it first, so it lands
    nowhere); ``partial``: a prefix of its ops lands, then it fails (the seam allows bytes of a failed
    batch to have landed before the error is reported, never after); ``duplicate``: its landing is
    delivered a second time, later (the transport must drop it: the batch is done)."""

    latency_s: float = 20e-6
    jitter_s: float = 20e-6
    bytes_per_s: float = 20e9
    fail: float = 0.0
    late: float = 0.0
    partial: float = 0.0
    duplicate: float = 0.0


class Fabric:
    """The shared state of every ``sim`` endpoint of one simulation (see the module docstring)."""

    def __init__(self, clock: Union[Clock, None] = None, *, seed: int = 0, name: str = "default",
                 faults: Union[TransportFaults, None] = None, lock: Any = None) -> None:
        self.clock: Clock
        self.lock: Any
        if clock is None:   # real time: the timer thread's callbacks and the waiters share its lock
            real = RealClock()
            self.clock, self.lock = real, real.lock
        else:
            self.clock, self.lock = clock, lock if lock is not None else threading.RLock()
        self.name = name
        self.rng = random.Random(seed)
        self.faults = faults if faults is not None else TransportFaults()
        self.endpoints: dict[int, Any] = {}
        self._ids = itertools.count(1)
        self.incarnations: dict[str, int] = {}
        self.frozen: set[str] = set()
        #: ``reachable(a, b)``: whether process ``a`` reaches ``b`` now (a partition says no)
        self.reachable: Callable[[str, str], bool] = lambda a, b: True
        self._parked: dict[str, list] = {}
        #: ``observer(kind, batch_id, detail)`` sees every landing and every fault (the simulator's oracle
        #: and trace); called under :attr:`lock`, must not block
        self.observers: list[Callable[[str, int, Any], None]] = []
        self.stats: dict[str, int] = {"batches": 0, "landed": 0, "dropped_after_done": 0, "faults": 0}

    def next_id(self) -> int:
        return next(self._ids)

    def now(self) -> float:
        return self.clock.now()

    def emit(self, kind: str, batch_id: int, detail: Any = None) -> None:
        for observer in self.observers:
            observer(kind, batch_id, detail)

    # ------------------------------------------------------------------ processes
    def incarnation(self, process: str) -> int:
        return self.incarnations.setdefault(process, 1)

    def crash(self, process: str) -> None:
        """The process dies: its endpoints vanish at once (all their state is lost), what it had in
        flight lands nowhere, and a later endpoint of the same name is a new incarnation."""
        with self.lock:
            self.incarnations[process] = self.incarnation(process) + 1
            self._parked.pop(process, None)
            self.frozen.discard(process)
            for ep in [ep for ep in self.endpoints.values() if ep.process == process]:
                ep.die()

    def freeze(self, process: str) -> None:
        """The process stops (as under SIGSTOP): it serves nothing until :meth:`thaw`."""
        with self.lock:
            self.frozen.add(process)

    def thaw(self, process: str) -> None:
        with self.lock:
            self.frozen.discard(process)
            for fn, args in self._parked.pop(process, []):
                self.clock.call_later(0.0, fn, *args)

    def park(self, process: str, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` when ``process`` thaws (it is frozen now)."""
        self._parked.setdefault(process, []).append((fn, args))

    # ------------------------------------------------------------------ draws
    def latency(self, nbytes: int) -> float:
        f = self.faults
        return f.latency_s + self.rng.random() * f.jitter_s + nbytes / f.bytes_per_s

    def draw(self) -> Optional[str]:
        """The transport fault of one batch, or None."""
        f = self.faults
        if not (f.fail or f.late or f.partial or f.duplicate):
            return None
        x = self.rng.random()
        for kind, p in (("fail", f.fail), ("late", f.late), ("partial", f.partial), ("duplicate", f.duplicate)):
            if x < p:
                return kind
            x -= p
        return None


_FABRICS: dict[str, Fabric] = {}
_REG_LOCK = threading.Lock()


def install(f: Fabric) -> Fabric:
    """Make ``f`` the fabric of endpoints whose engine option ``llmdd.sim.fabric`` names it."""
    with _REG_LOCK:
        _FABRICS[f.name] = f
    return f


def uninstall(name: str = "default") -> None:
    with _REG_LOCK:
        f = _FABRICS.pop(name, None)
    if f is not None and isinstance(f.clock, RealClock):
        f.clock.stop()


def fabric(name: str = "default") -> Optional[Fabric]:
    return _FABRICS.get(name)


def installed() -> bool:
    return bool(_FABRICS)
