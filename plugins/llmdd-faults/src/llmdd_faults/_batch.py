"""One faulty batch: the worker that applies a plan's transfer and completion faults around the inner
channel's batch(es) -- delay, drop, partition, fail, truncate and mid-transfer cuts, peer signals, and
``corrupt`` (flipping bytes in local memory on a read, sending flipped copies from the scratch region on a
write). The batch runs in a :class:`~llmdd.lowlevel.ThreadCompletion`'s worker; its ``abort`` cancels the
inner completion in flight, so nothing of the batch lands after the completion reported."""

from __future__ import annotations

import ctypes
import threading
import time
from typing import TYPE_CHECKING, Any, Optional

from llmdd.abc import Completion
from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none
from llmdd.lowlevel import Cancelled, ThreadCompletion, TransportError, TransportTimeout, make_ops

from ._plan import Fault

if TYPE_CHECKING:  # annotations only: the channel creates its batches
    from ._wrapper import FaultyChannel

#: The region id of the wrapper's scratch region (the flipped bytes a ``corrupt`` write sends).
SCRATCH_REGION_ID = 2**32 - 1


def _cut(ops: np.ndarray, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Split ``ops`` into the ops of its first ``nbytes`` bytes and the ops of the rest."""
    lengths = ops["length"].astype(np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    nbytes = max(0, min(int(nbytes), int(ends[-1]) if len(ends) else 0))
    head = ops[starts < nbytes].copy()
    if len(head):
        head["length"][-1] = nbytes - int(starts[len(head) - 1])
    tail = ops[ends > nbytes].copy()
    if len(tail):
        skip = nbytes - int(starts[len(ops) - len(tail)])
        if skip > 0:
            tail["local_offset"][0] += skip
            tail["remote_offset"][0] += skip
            tail["length"][0] -= skip
    return head[head["length"] > 0], tail[tail["length"] > 0]


class _Batch:
    """One faulty batch: the worker that applies the faults around the inner batch(es)."""

    completion: ThreadCompletion

    def __init__(self, channel: FaultyChannel, kind: str, ops: np.ndarray, deadline: float,
                 faults: list[Fault], heal_gen: int) -> None:
        self.channel = channel
        self.plan = channel.plan
        self.kind = kind
        self.ops = ops
        self.deadline = deadline
        self.faults = faults
        self.heal_gen = heal_gen
        self.local_regions = frozenset(int(r) for r in np.unique(ops["local_region"]))
        self._lock = threading.Lock()
        self._aborted = False
        self._inner: Optional[Completion] = None

    def touches(self, region_id: int) -> bool:
        return region_id in self.local_regions

    def fail(self, why: TransportError) -> None:
        self.completion.fail(why)

    def forget(self) -> None:
        self.channel._batches.discard(self)
        self.channel.endpoint._forget(self)

    # ------------------------------------------------------------------ abort (caller side)
    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            inner = self._inner
        if inner is not None:
            inner.cancel()  # drains: no byte of it lands after this returns
        self.plan.wake()

    def aborted(self) -> bool:
        with self._lock:
            return self._aborted

    # ------------------------------------------------------------------ the worker
    def _check(self) -> None:
        if self.aborted():
            raise Cancelled("batch aborted")
        if time.monotonic() >= self.deadline:
            raise TransportTimeout("batch missed its deadline (fault injected)")

    def _hold(self, why: str, released: Any = None) -> None:
        """Block until released (partition healed) or the deadline / an abort ends the batch."""
        how = self.plan.block(self.deadline, aborted=self.aborted,
                              released=released if released is not None else (lambda: False))
        if how == "aborted":
            raise Cancelled(f"batch aborted while {why}")
        if how == "deadline":
            raise TransportTimeout(f"batch missed its deadline: {why}")

    def _delay(self, f: Fault) -> None:
        until = time.monotonic() + f.delay
        how = self.plan.block(min(until, self.deadline), aborted=self.aborted)
        if how == "aborted":
            raise Cancelled("batch aborted during an injected delay")
        if until > self.deadline:
            raise TransportTimeout(f"batch missed its deadline: delayed {f.delay:.3f} s (fault {f.label})")

    def _hold_partition(self) -> None:
        ch = self.channel
        if ch.partitioned:
            self._hold("the channel is partitioned", released=lambda: not ch.partitioned)

    def _post(self, ops: np.ndarray) -> None:
        """Post ``ops`` on the inner channel and wait for them (abort cancels them)."""
        self._check()
        if not len(ops):
            return
        inner = getattr(self.channel.inner, self.kind)(ops, deadline=self.deadline)
        with self._lock:
            self._inner = inner
            aborted = self._aborted
        if aborted:
            inner.cancel()
            raise Cancelled("batch aborted")
        if not inner.wait(max(0.0, self.deadline - time.monotonic())):
            inner.cancel()
            raise TransportTimeout("batch missed its deadline")
        with self._lock:
            self._inner = None
        if inner.error is not None:
            raise inner.error
        self._check()

    def run(self) -> None:
        transfer = [f for f in self.faults if f.op == self.kind]
        complete = [f for f in self.faults if f.op == "complete"]
        peer = self.channel.peer_desc
        # before the post
        truncate: Optional[Fault] = None
        mid: list[Fault] = []
        before_completion: list[Fault] = []
        for f in transfer:
            if f.action == "delay":
                self._delay(f)
            elif f.action == "partition":
                self.channel.partition(self.heal_gen)
            elif f.action == "drop":
                self._hold(f"dropped (fault {f.label})")
            elif f.action == "fail":
                raise f.error_type(f"{self.kind} failed (fault {f.label})")
            elif f.action == "truncate":
                truncate = truncate or f
            elif f.action in ("kill_peer", "stall_peer"):
                if f.point == "before_post":
                    self.plan.signal_peer(f, peer)
                elif f.point == "mid_transfer":
                    mid.append(f)
                else:
                    before_completion.append(f)
        self._hold_partition()
        # the transfer
        ops = self.ops
        total = int(ops["length"].sum()) if len(ops) else 0
        if truncate is not None:
            moved = min(total, truncate.nbytes or 0)
            ops, _ = _cut(ops, moved)
        if mid:
            head, tail = _cut(ops, (int(ops["length"].sum()) if len(ops) else 0) // 2)
            self._post(head)
            for f in mid:
                self.plan.signal_peer(f, peer)
            self._post(tail)
        else:
            self._post(ops)
        for f in before_completion:
            self.plan.signal_peer(f, peer)
        if truncate is not None:
            raise truncate.error_type(f"{self.kind} truncated after {truncate.nbytes or 0} of {total} bytes "
                                      f"(fault {truncate.label})")
        # the completion
        for f in complete:
            if f.action == "delay":
                self._delay(f)
            elif f.action == "partition":
                self.channel.partition(self.heal_gen)
                self._hold_partition()
            elif f.action == "drop":
                self._hold(f"completion dropped (fault {f.label})")
            elif f.action == "fail":
                raise f.error_type(f"{self.kind} completion failed (fault {f.label})")
            elif f.action in ("kill_peer", "stall_peer"):
                self.plan.signal_peer(f, peer)
        corrupt = [f for f in self.faults if f.action == "corrupt"]
        if corrupt and len(self.ops):
            nbytes = max(f.nbytes or 1 for f in corrupt)
            self._corrupt(nbytes)

    # ------------------------------------------------------------------ corrupt
    def _positions(self, nbytes: int) -> list[tuple[int, int]]:
        """``nbytes`` distinct (op index, byte within op) positions drawn from the plan RNG."""
        lengths = self.ops["length"].astype(np.int64)
        ends = np.cumsum(lengths)
        total = int(ends[-1])
        picks: set[int] = set()
        want = min(nbytes, total)
        while len(picks) < want:
            picks.add(self.plan.rand_below(total))
        out = []
        for p in sorted(picks):
            i = int(np.searchsorted(ends, p, side="right"))
            out.append((i, p - int(ends[i] - lengths[i])))
        return out

    def _corrupt(self, nbytes: int) -> None:
        self._check()
        positions = self._positions(nbytes)
        ep = self.channel.endpoint
        if self.kind == "read":
            with ep._lock:  # deregister pops the region under this lock before it drains us
                if self.aborted():
                    raise Cancelled("batch aborted")
                for i, delta in positions:
                    op = self.ops[i]
                    region = ep._regions.get(int(op["local_region"]))
                    if region is None:
                        raise Cancelled("local region deregistered")
                    cell = ctypes.c_ubyte.from_address(region.addr + int(op["local_offset"]) + delta)
                    cell.value ^= 0xFF
            return
        # write: send flipped copies of the source bytes over the same ops' destinations
        with ep._scratch_lock:
            scratch = ep._scratch_region()
            with ep._lock:
                for k, (i, delta) in enumerate(positions):
                    op = self.ops[i]
                    region = ep._regions.get(int(op["local_region"]))
                    if region is None:
                        raise Cancelled("local region deregistered")
                    scratch[k] = ctypes.c_ubyte.from_address(region.addr + int(op["local_offset"]) + delta).value ^ 0xFF
            rr = [int(self.ops[i]["remote_region"]) for i, _ in positions]
            ro = [int(self.ops[i]["remote_offset"]) + delta for i, delta in positions]
            self._post(make_ops(SCRATCH_REGION_ID, np.arange(len(positions)), rr, ro, 1))
