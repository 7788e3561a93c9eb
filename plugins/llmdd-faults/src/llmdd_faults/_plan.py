"""The fault plan: which faults exist, which call each one fires on, and what fired.

A :class:`Fault` is a frozen value; a :class:`FaultPlan` owns the mutable state around a
sequence of them (per-fault call and fire counters, a seeded RNG, the ``fired`` record, the
heal generation that releases partitions, the stalled pids that ``heal`` resumes).

Matching: every call of an injection point (``op``) for a peer counts once for each fault
with that ``op`` whose ``peer`` is ``None`` or equal to the call's peer.  A fault fires on
its ``nth`` matching call and on the following ones until it fired ``count`` times
(``count=None``: every time); with ``probability < 1`` each eligible call fires only when
the plan's seeded RNG says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import attrs

from llmdd.lowlevel import get_logger
from llmdd.lowlevel import Cancelled, Corrupt, PeerGone, Refused, TransportError, TransportTimeout

__all__ = [
    "OPS",
    "ACTIONS",
    "POINTS",
    "ERRORS",
    "Fault",
    "Fired",
    "FaultPlan",
    "peer_scope",
    "current_peer",
]

_log = get_logger("llmdd.faults")

#: Injection points: ``connect`` (Endpoint.connect), ``read`` / ``write`` (posting a batch),
#: ``complete`` (a batch's completion, read or write) and ``task`` (a whole engine task).
OPS = ("connect", "read", "write", "complete", "task", "control")
ACTIONS = ("drop", "delay", "truncate", "corrupt", "fail", "kill_peer", "stall_peer", "partition")
POINTS = ("before_post", "mid_transfer", "before_completion")

#: The error types a ``fail`` / ``truncate`` fault may raise, by name (the JSON form).
ERRORS: Mapping[str, type[TransportError]] = {
    cls.__name__: cls for cls in (TransportTimeout, PeerGone, Refused, Corrupt, Cancelled)
}

_ALLOWED: Mapping[str, frozenset] = {
    "connect": frozenset({"drop", "delay", "fail", "kill_peer", "stall_peer", "partition"}),
    "read": frozenset(ACTIONS),
    "write": frozenset(ACTIONS),
    "complete": frozenset({"drop", "delay", "fail", "corrupt", "kill_peer", "stall_peer", "partition"}),
    "task": frozenset({"delay", "fail", "kill_peer", "stall_peer"}),
    "control": frozenset({"drop"}),
}


def _to_error(value: Any) -> Optional[type[TransportError]]:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return ERRORS[value]
        except KeyError:
            raise ValueError(f"unknown error {value!r}; one of {sorted(ERRORS)}") from None
    if isinstance(value, type) and issubclass(value, TransportError):
        return value
    raise TypeError(f"error must be a TransportError subclass or its name, got {value!r}")


def _optional_int(value: Any) -> Optional[int]:
    return None if value is None else int(value)


#: Fault.count's default, typed Optional so that attrs' field() types that field Optional[int] (as its
#: validator) rather than int (as the literal 1)
_DEFAULT_COUNT: Optional[int] = 1


@attrs.frozen
class Fault:
    """One fault: *what* happens (``action``) at *which* injection point (``op``), on *which* call.

    :ivar op: ``"connect"``, ``"read"``, ``"write"``, ``"complete"``, ``"task"`` or ``"control"`` (a
        received control message of an established link; action ``"drop"`` only: the message is
        never handled, as if the network lost it).
    :ivar action: ``"drop"`` (never completes: only the deadline or a cancel ends it),
        ``"delay"`` (``delay`` seconds), ``"truncate"`` (move the first ``nbytes`` bytes, then
        fail with ``error``, default :class:`Corrupt`), ``"corrupt"`` (flip ``nbytes`` bytes,
        default 1, in the destination of a *successful* batch), ``"fail"`` (fail with
        ``error``, default :class:`TransportTimeout`), ``"kill_peer"`` / ``"stall_peer"``
        (SIGKILL / SIGSTOP the peer process at ``point``), ``"partition"`` (this and every
        later op on the channel hang until :meth:`FaultPlan.heal`).
    :ivar nth: the first matching call it fires on (1 = the first).
    :ivar count: how many times it fires (``None``: on every matching call from ``nth`` on).
    :ivar peer: the peer cluster id it targets, or ``None`` for any peer.
    :ivar probability: the chance that an eligible call fires it (drawn from the plan's seeded RNG).
    :ivar delay: seconds, for ``"delay"``.
    :ivar nbytes: bytes moved before a ``"truncate"``, or bytes flipped by ``"corrupt"``.
    :ivar error: the :class:`~llmdd._base.status.TransportError` type (or its name) of ``"fail"`` / ``"truncate"``.
    :ivar point: when ``kill_peer`` / ``stall_peer`` act: ``"before_post"``, ``"mid_transfer"``
        (after the first half of the bytes moved) or ``"before_completion"``.
    :ivar pid: the process to signal; ``None``: the ``pid`` the peer endpoint's ``describe()`` gives.
    :ivar name: a label for ``fired`` records and logs.
    :ivar message: for ``"control"``: which messages it matches: a type name (``"TransferReply"``)
        or ``type:op`` (``"TransferRequest:reserve_key"``, ``"TaggedDone:read_done"``); empty: every message.
    """

    op: str = attrs.field(validator=attrs.validators.in_(OPS))
    action: str = attrs.field(validator=attrs.validators.in_(ACTIONS))
    nth: int = attrs.field(default=1, kw_only=True, converter=int, validator=attrs.validators.ge(1))
    count: Optional[int] = attrs.field(default=_DEFAULT_COUNT, kw_only=True, converter=_optional_int,
                                       validator=attrs.validators.optional(attrs.validators.ge(1)))
    peer: Optional[int] = attrs.field(default=None, kw_only=True, converter=_optional_int)
    probability: float = attrs.field(default=1.0, kw_only=True, converter=float,
                                     validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)])
    delay: float = attrs.field(default=0.0, kw_only=True, converter=float, validator=attrs.validators.ge(0.0))
    nbytes: Optional[int] = attrs.field(default=None, kw_only=True, converter=_optional_int,
                                        validator=attrs.validators.optional(attrs.validators.ge(0)))
    error: Optional[type[TransportError]] = attrs.field(default=None, kw_only=True, converter=_to_error)
    point: str = attrs.field(default="before_post", kw_only=True, validator=attrs.validators.in_(POINTS))
    pid: Optional[int] = attrs.field(default=None, kw_only=True, converter=_optional_int)
    name: str = attrs.field(default="", kw_only=True, converter=str)
    message: str = attrs.field(default="", kw_only=True, converter=str)

    def __attrs_post_init__(self) -> None:
        if self.action not in _ALLOWED[self.op]:
            raise ValueError(f"action {self.action!r} is not available at op {self.op!r}; "
                             f"one of {sorted(_ALLOWED[self.op])}")
        if self.action == "corrupt" and self.nbytes is not None and not 1 <= self.nbytes <= 4096:
            raise ValueError("corrupt flips 1 to 4096 bytes")
        if self.point == "mid_transfer" and self.op not in ("read", "write"):
            raise ValueError(f"point 'mid_transfer' is not available at op {self.op!r}")

    @property
    def error_type(self) -> type[TransportError]:
        """The error this fault raises (``error`` or the action's default)."""
        if self.error is not None:
            return self.error
        return Corrupt if self.action == "truncate" else TransportTimeout

    @property
    def label(self) -> str:
        return self.name or f"{self.op}:{self.action}"

    def to_dict(self) -> dict:
        """The JSON form (what ``LLMDD_FAULTS`` holds); defaults are left out."""
        out: dict[str, Any] = {}
        for field in attrs.fields(Fault):
            value = getattr(self, field.name)
            if field.default is not attrs.NOTHING and value == field.default:
                continue
            out[field.name] = value.__name__ if field.name == "error" else value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Fault":
        data = dict(data)
        unknown = set(data) - {f.name for f in attrs.fields(Fault)}
        if unknown:
            raise ValueError(f"unknown fault fields {sorted(unknown)}")
        return cls(data.pop("op"), data.pop("action"), **data)


@attrs.frozen(kw_only=True)
class Fired:
    """One firing: the fault, its index in the plan, the op and peer of the call it acted on."""

    fault: Fault
    index: int
    op: str
    peer: Optional[int]
    call: int            # the matching call number (1-based) of this fault
    at: float            # time.time()
    monotonic: float     # time.monotonic()

    def to_dict(self) -> dict:
        return {"fault": self.fault.to_dict(), "index": self.index, "op": self.op, "peer": self.peer,
                "call": self.call, "at": self.at, "monotonic": self.monotonic}


_local = threading.local()


def current_peer() -> Optional[int]:
    """The peer cluster id the current thread links with, as the engine's link events said."""
    return getattr(_local, "peer", None)


def _set_current_peer(peer: Optional[int]) -> None:
    _local.peer = peer


@contextlib.contextmanager
def peer_scope(cluster_id: Optional[int]) -> Iterator[None]:
    """Channels connected inside are attributed to ``cluster_id`` (for ``Fault.peer``).

    The engine does this itself (link events name the peer just before the channel is
    connected, on the same thread); tests that drive endpoints directly use this.
    """
    old = current_peer()
    _set_current_peer(cluster_id)
    try:
        yield
    finally:
        _set_current_peer(old)


class FaultPlan:
    """A sequence of :class:`Fault` with the state that decides when each fires.

    ``FaultPlan([Fault("read", "drop", nth=2)], seed=0)``.  Thread-safe.  ``log_path``
    (or the ``LLMDD_FAULTS_LOG`` environment variable for plans read from ``LLMDD_FAULTS``)
    appends one JSON line per firing, for drills where the process cannot be asked.
    """

    def __init__(self, faults: Sequence[Fault] = (), *, seed: int = 0, log_path: Optional[str] = None) -> None:
        faults = tuple(faults)
        for f in faults:
            if not isinstance(f, Fault):
                raise TypeError(f"a FaultPlan holds Fault objects, got {f!r}")
        self.faults: tuple[Fault, ...] = faults
        self.seed = int(seed)
        self.log_path = log_path
        self._cond = threading.Condition()
        self._rng = random.Random(self.seed)
        self._calls = [0] * len(faults)
        self._fires = [0] * len(faults)
        self._fired: list[Fired] = []
        self._heal_generation = 0
        self._stalled: set[int] = set()

    # ------------------------------------------------------------------ JSON
    @classmethod
    def from_json(cls, text: Union[str, bytes], *, log_path: Optional[str] = None) -> "FaultPlan":
        """Parse ``[{fault}, ...]`` or ``{"seed": n, "faults": [...]}``."""
        data = json.loads(text)
        seed = 0
        if isinstance(data, dict):
            unknown = set(data) - {"seed", "faults"}
            if unknown:
                raise ValueError(f"unknown plan fields {sorted(unknown)}")
            seed = int(data.get("seed", 0))
            data = data.get("faults", [])
        if not isinstance(data, list):
            raise ValueError("a plan is a list of faults or {'seed': n, 'faults': [...]}")
        return cls([Fault.from_dict(d) for d in data], seed=seed, log_path=log_path)

    def to_json(self) -> str:
        return json.dumps({"seed": self.seed, "faults": [f.to_dict() for f in self.faults]})

    # ------------------------------------------------------------------ matching
    def match(self, op: str, peer: Optional[int] = None, message: str = "") -> list[Fault]:
        """Count one call of ``op`` for ``peer`` (and, for ``control``, ``message``); return the
        faults that fire on it (plan order)."""
        out: list[Fault] = []
        records: list[Fired] = []
        with self._cond:
            for i, f in enumerate(self.faults):
                if f.op != op or (f.peer is not None and f.peer != peer):
                    continue
                if f.message and not (message == f.message or message.startswith(f.message + ":")):
                    continue
                self._calls[i] += 1
                if self._calls[i] < f.nth or (f.count is not None and self._fires[i] >= f.count):
                    continue
                if f.probability < 1.0 and self._rng.random() >= f.probability:
                    continue
                self._fires[i] += 1
                out.append(f)
                rec = Fired(fault=f, index=i, op=op, peer=peer, call=self._calls[i], at=time.time(),
                            monotonic=time.monotonic())
                self._fired.append(rec)
                records.append(rec)
        for rec in records:
            _log.warning("llmdd.faults.fired", fault=rec.fault.label, op=op, peer=peer, call=rec.call)
            self._append_log(rec)
        return out

    def _append_log(self, rec: Fired) -> None:
        if not self.log_path:
            return
        try:
            with open(self.log_path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"pid": os.getpid(), **rec.to_dict()}) + "\n")
        except OSError as exc:
            _log.warning("llmdd.faults.log_failed", path=self.log_path, error=str(exc))

    def rand_below(self, n: int) -> int:
        """A draw from the plan's seeded RNG in ``range(n)`` (corrupt positions)."""
        with self._cond:
            return self._rng.randrange(n)

    @property
    def fired(self) -> list[Fired]:
        """What fired so far, in order (a copy)."""
        with self._cond:
            return list(self._fired)

    def fired_count(self, op: Optional[str] = None, action: Optional[str] = None) -> int:
        return sum(1 for r in self.fired if (op is None or r.op == op)
                   and (action is None or r.fault.action == action))

    def reset(self) -> None:
        """Heal, then forget counters and ``fired`` and reseed the RNG: the plan starts over."""
        self.heal()
        with self._cond:
            self._rng = random.Random(self.seed)
            self._calls = [0] * len(self.faults)
            self._fires = [0] * len(self.faults)
            self._fired.clear()

    # ------------------------------------------------------------------ partitions and stalls
    @property
    def heal_generation(self) -> int:
        with self._cond:
            return self._heal_generation

    def heal(self) -> None:
        """End every partition (hung ops go on) and SIGCONT every process a ``stall_peer`` stopped."""
        with self._cond:
            self._heal_generation += 1
            stalled, self._stalled = self._stalled, set()
            self._cond.notify_all()
        for pid in stalled:
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass

    def wake(self) -> None:
        """Wake blocked ops so that they re-check their own abort flag."""
        with self._cond:
            self._cond.notify_all()

    def block(self, until: Optional[float], *, aborted: Callable[[], bool],
              released: Callable[[], bool] = lambda: False) -> str:
        """Block until ``released()`` (``"released"``), ``aborted()`` (``"aborted"``) or the monotonic
        time ``until`` (``"deadline"``); woken by :meth:`heal` and :meth:`wake`."""
        with self._cond:
            while True:
                if aborted():
                    return "aborted"
                if released():
                    return "released"
                now = time.monotonic()
                if until is not None and now >= until:
                    return "deadline"
                self._cond.wait(None if until is None else until - now)

    def signal_peer(self, fault: Fault, peer_desc: Optional[Mapping[str, Any]]) -> None:
        """Send SIGKILL / SIGSTOP for ``fault`` to its pid or the peer's described pid."""
        pid = fault.pid if fault.pid is not None else (peer_desc or {}).get("pid")
        sig = signal.SIGKILL if fault.action == "kill_peer" else signal.SIGSTOP
        if not isinstance(pid, int) or pid <= 0:
            _log.warning("llmdd.faults.no_pid", fault=fault.label)
            return
        if pid == os.getpid():
            _log.warning("llmdd.faults.own_pid", fault=fault.label, pid=pid)
            return
        try:
            os.kill(pid, sig)
        except OSError as exc:
            _log.warning("llmdd.faults.signal_failed", fault=fault.label, pid=pid, error=str(exc))
            return
        if sig == signal.SIGSTOP:
            with self._cond:
                self._stalled.add(pid)
        _log.warning("llmdd.faults.signalled", fault=fault.label, pid=pid, signal=sig.name)

    def __repr__(self) -> str:
        return f"<FaultPlan {len(self.faults)} faults, {len(self.fired)} fired>"
