"""``wrap(transport_cls)``: a transport whose endpoints and channels delegate to the inner
transport and consult a :class:`FaultPlan` at each injection point.

Transparency: the wrapper's ``describe()`` is the inner one, so it talks to peers that run
the plain inner transport. A batch on which no fault fires (and whose channel is not
partitioned) is handed to the inner channel as is and its inner completion is returned.

A batch on which a fault fires runs in one worker thread of a
:class:`~llmdd.lowlevel.ThreadCompletion` that applies the faults around the inner
batch(es). The completion's promise holds: its ``abort`` cancels the inner completion in
flight (which drains it) and wakes the worker, and ``done()`` turns true only after the
worker returned, so after ``wait`` reported an error, or ``cancel()`` returned, nothing of
the batch is written into local memory any more. ``corrupt`` writes only on success, before
the completion reports done, under the endpoint lock and only into regions still registered
(``deregister`` first fails and drains the wrapper's batches that touch the region).
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any, ClassVar, Mapping, Optional, Union


from llmdd.lowlevel import get_logger
import msgspec

from llmdd.abc import Channel, Completion, Endpoint, EndpointDescriptor, RegionDescriptor, Transport, TransportInfo
from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none
from llmdd.lowlevel import (BatchSet, Cancelled, DoneCompletion, MemRegion, ThreadCompletion, TransportError,
                            TransportTimeout, as_ops, make_ops)

from ._plan import Fault, FaultPlan, current_peer

__all__ = ["FaultyTransport", "FaultyEndpoint", "FaultyChannel", "wrap", "SCRATCH_REGION_ID"]

_log = get_logger("llmdd.faults")

#: The region id of the wrapper's scratch region (the flipped bytes a ``corrupt`` write sends).
SCRATCH_REGION_ID = 2**32 - 1
_SCRATCH_BYTES = 4096


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


class FaultyTransport(Transport):
    """Base of the classes :func:`wrap` builds; ``inner_cls`` and ``plan`` are class attributes."""

    inner_cls: ClassVar[type[Transport]]
    plan: ClassVar[FaultPlan]

    @classmethod
    def probe(cls) -> TransportInfo:
        info = cls.inner_cls.probe()
        if info is None:
            return TransportInfo(name=cls.name, available=False, reason=f"{cls.inner_cls.name}: probe() gave None")
        return TransportInfo(name=cls.name, available=info.available, reason=info.reason,
                             details={**dict(info.details), "wraps": cls.inner_cls.name})

    def __init__(self, options: Mapping[str, str]) -> None:
        super().__init__(options)
        self.inner = self.inner_cls(options)

    def open_endpoint(self, *, host: str = "127.0.0.1", secret: Union[bytes, None] = None) -> "FaultyEndpoint":
        return FaultyEndpoint(self.inner.open_endpoint(host=host, secret=secret), self.plan)


def wrap(transport_cls: type[Transport], plan: Optional[FaultPlan] = None, *,
         name: Optional[str] = None) -> type[FaultyTransport]:
    """A :class:`Transport` subclass that runs ``transport_cls`` under ``plan``.

    Named ``faults-<inner name>`` by default (``+`` is not allowed in transport names), or
    ``name``: pass the inner name to shadow the inner transport (what ``force=True`` does).
    Its priority is the inner one, one less under its own name (so that the default policy
    prefers the plain transport when both are offered); ``same_host_only`` is the inner one.
    """
    if not (isinstance(transport_cls, type) and issubclass(transport_cls, Transport)):
        raise TypeError(f"wrap() takes a Transport subclass, not {transport_cls!r}")
    inner = transport_cls
    while issubclass(inner, FaultyTransport):  # never stack two plans on one transport
        inner = inner.inner_cls
    new_name = name or f"faults-{inner.name}"
    priority = int(inner.priority) if new_name == inner.name else int(inner.priority) - 1
    return type(f"Faulty{inner.__name__}", (FaultyTransport,), {
        "name": new_name,
        "priority": priority,
        "same_host_only": bool(inner.same_host_only),
        "inner_cls": inner,
        "plan": plan if plan is not None else FaultPlan(),
        "__module__": __name__,
        "__doc__": f"{inner.__name__} under a fault plan (llmdd-faults).",
    })


class FaultyEndpoint(Endpoint):
    """Delegates to the inner endpoint; ``connect`` is an injection point."""

    def __init__(self, inner: Endpoint, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan
        self._lock = threading.Lock()
        self._regions: dict[int, MemRegion] = {}
        self._batches: BatchSet["_Batch"] = BatchSet(threading.Condition(self._lock), what="endpoint")
        self._scratch: Optional[np.ndarray] = None
        self._scratch_lock = threading.Lock()

    def describe(self) -> EndpointDescriptor:
        return self.inner.describe()

    # the inner endpoint's trust boundary is kept whole: its per-link capabilities and its listener
    @property
    def capabilities(self) -> bool:  # type: ignore[override]  # the inner endpoint's ClassVar, read through
        return self.inner.capabilities

    def serve_links_only(self) -> None:
        self.inner.serve_links_only()

    def grant(self, link_id: int, capability: bytes, regions) -> None:
        self.inner.grant(link_id, capability, regions)

    def revoke(self, link_id: int) -> None:
        self.inner.revoke(link_id)

    def on_listener_failed(self, callback) -> None:
        self.inner.on_listener_failed(callback)

    def listen_address(self) -> Optional[tuple[str, int]]:
        return self.inner.listen_address()

    def register(self, region: MemRegion) -> RegionDescriptor:
        desc = self.inner.register(region)
        with self._lock:
            self._regions[region.region_id] = region
        return desc

    def deregister(self, region_id: int) -> None:
        with self._lock:
            self._regions.pop(region_id, None)
            touching = self._batches.matching(lambda b: b.touches(region_id))
        for b in touching:
            b.fail(Cancelled(f"local region {region_id} deregistered"))
        self.inner.deregister(region_id)

    def connect(self, peer: EndpointDescriptor, *, timeout: float) -> "FaultyChannel":
        cluster = current_peer()
        deadline = time.monotonic() + timeout
        for f in self.plan.match("connect", cluster):
            _apply_connect_fault(self.plan, f, peer, deadline)
        inner = self.inner.connect(peer, timeout=max(1e-3, deadline - time.monotonic()))
        return FaultyChannel(self, inner, _payload_map(peer), cluster)

    def close(self) -> None:
        self._batches.close(Cancelled("endpoint closed"))   # fail the batches in flight, drain them
        self.inner.close()

    def statistics(self) -> dict:
        stats = dict(self.inner.statistics())
        stats["faults_fired"] = len(self.plan.fired)
        return stats

    # ------------------------------------------------------------------ internals
    def _track(self, batch: "_Batch") -> None:
        with self._lock:
            closed = self._batches.closed
            if not closed:
                self._batches.add(batch)
            # a deregistration that ran between the batch's planning and this line did not see it:
            # it must not outlive its local memory either (deregister pops, then collects, under _lock)
            gone = [r for r in batch.local_regions if r not in self._regions]
        if closed:
            batch.completion.fail(Cancelled("endpoint closed"))
        elif gone:
            batch.completion.fail(Cancelled(f"local region {gone[0]} deregistered"))

    def _forget(self, batch: "_Batch") -> None:
        self._batches.discard(batch)

    def _scratch_region(self) -> np.ndarray:
        """The (lazily registered, not remote-accessible) region ``corrupt`` writes send from."""
        with self._lock:
            if self._scratch is None:
                buf = np.zeros(_SCRATCH_BYTES, dtype=np.uint8)
                self.inner.register(MemRegion(region_id=SCRATCH_REGION_ID, addr=buf.ctypes.data, size=buf.nbytes,
                                              remote_accessible=False, placement=0))
                self._scratch = buf
            return self._scratch


def _payload_map(peer: EndpointDescriptor) -> dict:
    """The peer descriptor's payload read as a MessagePack map (the built-in transports encode one, with
    the peer's ``pid``), for a kill or stop fault to find whom to signal; ``{}`` for any other payload.
    Nothing else of the payload is read: it stays the transport's own."""
    try:
        got = msgspec.msgpack.decode(peer.payload)
    except (msgspec.DecodeError, TypeError):
        return {}
    return got if isinstance(got, dict) else {}


def _apply_connect_fault(plan: FaultPlan, f: Fault, peer: EndpointDescriptor, deadline: float) -> None:
    never = lambda: False  # noqa: E731 - connect has no abort but its timeout
    if f.action == "delay":
        until = time.monotonic() + f.delay
        plan.block(min(until, deadline), aborted=never)
        if until > deadline:
            raise TransportTimeout(f"connect delayed by {f.delay:.3f} s past its timeout (fault {f.label})")
    elif f.action == "drop":
        plan.block(deadline, aborted=never)
        raise TransportTimeout(f"connect dropped (fault {f.label})")
    elif f.action == "partition":
        gen = plan.heal_generation
        if plan.block(deadline, aborted=never, released=lambda: plan.heal_generation != gen) == "deadline":
            raise TransportTimeout(f"connect partitioned (fault {f.label})")
    elif f.action == "fail":
        raise f.error_type(f"connect failed (fault {f.label})")
    elif f.action in ("kill_peer", "stall_peer"):
        plan.signal_peer(f, _payload_map(peer))


class FaultyChannel(Channel):
    """Delegates to the inner channel; ``read`` / ``write`` and their completions are injection points."""

    def __init__(self, endpoint: FaultyEndpoint, inner: Channel, peer_desc: dict, peer: Optional[int]) -> None:
        self.endpoint = endpoint
        self.inner = inner
        self.plan = endpoint.plan
        self.peer_desc = peer_desc
        #: The peer cluster id (from the engine's link events or :func:`peer_scope`), or None.
        self.peer = peer
        self._lock = threading.Lock()
        self._partition_gen: Optional[int] = None
        self._batches: BatchSet[_Batch] = BatchSet(threading.Condition(self._lock))
        self._fired = 0

    def add_remote_region(self, region_id: int, size: int, desc: RegionDescriptor) -> None:
        self.inner.add_remote_region(region_id, size, desc)

    def remove_remote_region(self, region_id: int) -> None:
        self.inner.remove_remote_region(region_id)

    def read(self, ops: np.ndarray, *, deadline: float) -> Completion:
        # the seam's one refusal path: a refusal or failure is the completion's error, never raised
        try:
            return self._submit("read", ops, deadline)
        except TransportError as exc:
            return DoneCompletion(exc)

    def write(self, ops: np.ndarray, *, deadline: float) -> Completion:
        try:
            return self._submit("write", ops, deadline)
        except TransportError as exc:
            return DoneCompletion(exc)

    def close(self) -> None:
        self._batches.close(Cancelled("channel closed"))   # fail the batches in flight, drain them
        self.inner.close()

    def statistics(self) -> dict:
        stats = dict(self.inner.statistics())
        stats["faults_fired"] = self._fired
        stats["partitioned"] = self.partitioned
        return stats

    # ------------------------------------------------------------------ partitions
    @property
    def partitioned(self) -> bool:
        with self._lock:
            return self._partition_gen is not None and self._partition_gen == self.plan.heal_generation

    def partition(self, generation: Optional[int] = None) -> None:
        """Partition the channel until the heal that follows heal generation ``generation`` (default:
        the current one).  A batch passes the generation it read before its fault fired, so a heal
        that came after the fault was recorded (a test waits for the record, then heals) releases it
        even when the batch's worker reaches this line only after the heal; a newer partition of the
        channel is never undone by an older one."""
        gen = self.plan.heal_generation if generation is None else generation
        with self._lock:
            if self._partition_gen is None or gen > self._partition_gen:
                self._partition_gen = gen

    # ------------------------------------------------------------------ batches
    def _submit(self, kind: str, ops: np.ndarray, deadline: float) -> Completion:
        ops = as_ops(ops)
        heal_gen = self.plan.heal_generation   # read before the faults fire (and are recorded)
        faults = self.plan.match(kind, self.peer) + self.plan.match("complete", self.peer)
        if not faults and not self.partitioned:
            return getattr(self.inner, kind)(ops, deadline=deadline)
        self._fired += len(faults)
        batch = _Batch(self, kind, ops, deadline, faults, heal_gen)
        batch.completion = ThreadCompletion([batch.run], deadline=deadline, abort=batch.abort,
                                            on_done=lambda _c: batch.forget(), name=f"llmdd-faults-{kind}")
        # a close that ran between this batch's planning (its fault already in the fired record a
        # test waits on) and this line did not see it: fail it as close would have, instead of letting
        # it hold a partition until its deadline after its channel is gone
        with self._lock:
            closed = self._batches.closed
            if not closed and not batch.completion.done():
                self._batches.add(batch)
        if closed:
            batch.completion.fail(Cancelled("channel closed"))
        self.endpoint._track(batch)
        if batch.completion.done():
            batch.forget()
        return batch.completion


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
