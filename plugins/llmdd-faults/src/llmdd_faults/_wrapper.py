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
(``deregister`` first fails and drains the wrapper's batches that touch the region). That
worker is :mod:`llmdd_faults._batch`.
"""

from __future__ import annotations

import threading
import time
from typing import ClassVar, Mapping, Optional, Union

import msgspec

from llmdd.abc import Channel, Completion, Endpoint, EndpointDescriptor, RegionDescriptor, Transport, TransportInfo
from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none
from llmdd.lowlevel import (BatchSet, Cancelled, MemRegion, ThreadCompletion, TransportTimeout, as_ops, get_logger, submitted)

from ._batch import SCRATCH_REGION_ID, _Batch
from ._plan import Fault, FaultPlan, current_peer

__all__ = ["FaultyTransport", "FaultyEndpoint", "FaultyChannel", "wrap", "SCRATCH_REGION_ID"]

_log = get_logger("llmdd.faults")

_SCRATCH_BYTES = 4096


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
        return submitted(self._submit, "read", ops, deadline)

    def write(self, ops: np.ndarray, *, deadline: float) -> Completion:
        return submitted(self._submit, "write", ops, deadline)

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
