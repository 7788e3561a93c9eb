"""What transports share (public as :mod:`llmdd.lowlevel`): region registry, batch tracking, error mapping.

Every transport keeps the same books, whatever moves its bytes:

* :class:`RegionRegistry`: the endpoint's local regions (one entry each, a subclass of
  :class:`RegisteredRegion` carrying the transport's own fields), the numpy tables a batch is checked
  against (:attr:`~RegionRegistry.table` for every local region, :attr:`~RegionRegistry.served` for the
  remote-accessible ones a peer may name), the pins of the batches in flight and the batches
  themselves, so that :meth:`~RegionRegistry.deregister` can *cancel then drain*: fail every batch
  touching the region, then wait until no pin on it is left (after it returns the transport never
  touches the memory again), and :meth:`~RegionRegistry.close` the same for every region.
* :class:`Batch`: one batch in flight (its local regions, its pins, its abort flag and reason, its
  completion); :meth:`Batch.fail` aborts it and fails its completion, which drains it.
* :class:`BatchSet`: a channel's batches in flight; :meth:`BatchSet.close` is the channel's
  close-drain (refuse new batches, fail those in flight, wait until each has left).
* :func:`map_os_error`: an exception raised while moving bytes, as the typed error the seam reports.

Locking: a registry and a batch set use the condition (and its lock) they are given, normally the
endpoint's or channel's own, so that a transport can update its own state under the same lock.
Methods marked *lock held* expect the caller to hold it; the others take it.  None of them calls a
completion, a listener or the network while holding it.
"""

from __future__ import annotations

import ssl
import threading
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterable, Iterator, Optional, Protocol, TypeVar, Union

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

from llmdd._base.lazy import np  # numpy at its first use: an idle engine needs none

from llmdd._seam.errors import Cancelled, Corrupt, PeerGone, Refused, TransportTimeout

from llmdd._seam.abc import MemRegion
from llmdd._seam.ops import RegionTable, check_ops
from llmdd._base.status import LLMStatusCode, TransportError

__all__ = ["RegisteredRegion", "RegionRegistry", "Batch", "BatchSet", "map_os_error"]


class Failable(Protocol):
    """What is failed when its endpoint closes or deregisters memory it uses: a batch's
    ``completion`` (a :class:`~llmdd._seam.completions.Completion`, a transport's own)."""

    def fail(self, why: TransportError) -> None: ...


class TrackedBatch(Failable, Protocol):
    """What a :class:`RegionRegistry` tracks (:meth:`RegionRegistry.track`): a :class:`Batch`, or a
    transport's completion that says which regions it touches."""

    def touches(self, region_id: int) -> bool: ...


class RegisteredRegion:
    """One local region in a :class:`RegionRegistry`: the :class:`~llmdd.lowlevel.MemRegion` and its
    pin count (``busy``: batches or served requests using its memory now).  Subclass it to keep the
    transport's own per-region state (a memory view, a slot, a registration handle)."""

    __slots__ = ("region", "busy")

    def __init__(self, region: MemRegion) -> None:
        self.region = region
        self.busy = 0

    @property
    def region_id(self) -> int:
        return int(self.region.region_id)

    @property
    def remote_accessible(self) -> bool:
        return bool(self.region.remote_accessible)


class Batch:
    """One batch in flight: the local regions it touches (``regions``), the registry entries it pins
    (``pinned``), whether it was aborted and why (``aborted``, ``why``) and its ``completion`` (set when
    the batch runs asynchronously; anything with ``fail(error)``).

    Subclass it for per-batch transport state and override :meth:`on_abort` to stop its I/O (shut
    its sockets down); a worker checks ``aborted`` between chunks."""

    __slots__ = ("regions", "pinned", "aborted", "why", "completion")

    def __init__(self, regions: Iterable[int] = frozenset()) -> None:
        self.regions: frozenset[int] = frozenset(regions)
        self.pinned: list[RegisteredRegion] = []
        self.aborted = False
        self.why: Optional[TransportError] = None
        self.completion: Optional[Failable] = None

    def abort(self, why: Optional[TransportError] = None) -> None:
        """Mark the batch aborted (the first reason wins) and stop its I/O (:meth:`on_abort`)."""
        if self.why is None:
            self.why = why
        self.aborted = True
        self.on_abort()

    def on_abort(self) -> None:
        """Stop the batch's I/O from any thread (default: nothing; workers check ``aborted``)."""

    def touches(self, region_id: int) -> bool:
        return region_id in self.regions

    def fail(self, why: TransportError) -> None:
        """Abort the batch and fail its completion with ``why``; when a completion is set this returns
        once the batch drained (no byte of it lands any more)."""
        self.abort(why)
        if self.completion is not None:
            self.completion.fail(why)


_B = TypeVar("_B")


class BatchSet(Generic[_B]):
    """A channel's batches in flight, and its close-drain.

    ``add`` refuses (:class:`~llmdd.lowlevel.Cancelled`) once the set is closed; ``discard`` wakes a
    draining :meth:`close`.  ``busy`` counts batches that are not tracked as objects (short native
    calls); :meth:`enter` / :meth:`leave` maintain it.  Items need ``fail(error)``."""

    def __init__(self, cond: threading.Condition, *, what: str = "channel") -> None:
        self.cond = cond   # the transport's own (its runtime's), over the lock its channel's state uses
        self.active: set[_B] = set()
        self.busy = 0
        self.closed = False
        self._what = what

    def __len__(self) -> int:
        return len(self.active)

    def __iter__(self) -> Iterator[_B]:
        return iter(list(self.active))

    def add(self, batch: _B) -> None:
        """Track ``batch`` (lock held); :class:`Cancelled` once closed."""
        if self.closed:
            raise Cancelled(f"{self._what} closed")
        self.active.add(batch)

    def discard(self, batch: _B) -> None:
        """Forget ``batch`` (takes the lock) and wake a draining :meth:`close`."""
        with self.cond:
            self.discard_locked(batch)

    def discard_locked(self, batch: _B) -> None:
        """:meth:`discard` with the lock held (only a :meth:`close` waits, once the set is closed)."""
        self.active.discard(batch)
        if self.closed:
            self.cond.notify_all()

    def enter(self) -> None:
        """One untracked batch starts (lock held); :class:`Cancelled` once closed."""
        if self.closed:
            raise Cancelled(f"{self._what} closed")
        self.busy += 1

    def leave(self) -> None:
        """One untracked batch ended (lock held); wakes a draining :meth:`close`."""
        self.busy -= 1
        if self.closed:
            self.cond.notify_all()

    def matching(self, pred: Callable[[_B], bool]) -> list[_B]:
        """The batches for which ``pred`` holds (lock held)."""
        return [b for b in self.active if pred(b)]

    def close(self, why: Optional[TransportError] = None) -> bool:
        """Refuse new batches, fail those in flight with ``why`` (default :class:`Cancelled`) and wait
        until every one has left; ``False`` (and nothing done) when already closed.  Takes the lock;
        fails the batches without it."""
        with self.cond:
            if self.closed:
                return False
            self.closed = True
            batches = list(self.active)
        err = why if why is not None else Cancelled(f"{self._what} closed")
        for b in batches:
            b.fail(err)  # type: ignore[attr-defined]  # items are Batch or Completion objects with fail()
        with self.cond:
            while self.active or self.busy:
                self.cond.wait()
        return True


_E = TypeVar("_E", bound=RegisteredRegion)


class RegionRegistry(Generic[_E]):
    """An endpoint's local regions, their tables and pins, and its batches in flight.

    ``entries`` maps region id to its entry.  After every change the registry rebuilds, from the
    entries: :attr:`table` (every local region: what a batch's local side is checked against),
    :attr:`served` (the remote-accessible ones; a peer naming another registered region is refused with
    "is not remote-accessible"), :attr:`ids` / :attr:`addrs` (sorted numpy arrays, for turning op
    region ids into addresses with ``np.searchsorted``) and then calls ``on_rebuild(registry)``."""

    def __init__(self, cond: threading.Condition, *,
                 on_rebuild: Optional[Callable[["RegionRegistry[_E]"], None]] = None) -> None:
        self.cond = cond   # the transport's own (its runtime's), over the lock its endpoint's state uses
        self.entries: dict[int, _E] = {}
        self.batches: set[TrackedBatch] = set()
        self.closed = False
        #: calls waiting on :attr:`cond`: :meth:`deregister` / :meth:`close`, and a transport's own
        #: waits on it, which count themselves here (:meth:`unpin_locked` and a transport whose other
        #: pins end notify :attr:`cond` only while this is non-zero)
        self.waiting = 0
        self._on_rebuild = on_rebuild
        self.table = RegionTable()
        self.served = RegionTable()
        self.ids = np.empty(0, np.int64)
        self.addrs = np.empty(0, np.uint64)

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, region_id: int) -> Optional[_E]:
        return self.entries.get(region_id)

    def __contains__(self, region_id: object) -> bool:
        return region_id in self.entries

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.entries))

    def items(self) -> list[tuple[int, _E]]:
        """``(region id, entry)`` pairs, a snapshot (read as a dict of the registered regions)."""
        return list(self.entries.items())

    def values(self) -> list[_E]:
        return list(self.entries.values())

    # ------------------------------------------------------------------ registration (lock held)

    def add(self, entry: _E) -> None:
        """Register ``entry`` (lock held): :class:`Cancelled` when closed, :class:`Refused` for an id in use."""
        if self.closed:
            raise Cancelled("endpoint is closed")
        rid = entry.region_id
        if rid in self.entries:
            raise Refused(f"region {rid} is already registered")
        self.entries[rid] = entry
        self.rebuild()

    def check_new(self, region_id: int) -> None:
        """Raise as :meth:`add` would, before the transport spends resources on ``region_id`` (lock held)."""
        if self.closed:
            raise Cancelled("endpoint is closed")
        if region_id in self.entries:
            raise Refused(f"region {region_id} is already registered")

    def rebuild(self) -> None:
        """Rebuild the tables from the entries (lock held)."""
        items = sorted(self.entries.items())
        sizes = {k: e.region.size for k, e in items}
        self.table = RegionTable(sizes)
        self.served = RegionTable({k: s for k, s in sizes.items() if self.entries[k].remote_accessible},
                                  private=[k for k, e in items if not e.remote_accessible])
        n = len(items)
        self.ids = np.fromiter((k for k, _ in items), np.int64, n)
        self.addrs = np.fromiter((e.region.addr for _, e in items), np.uint64, n)
        if self._on_rebuild is not None:
            self._on_rebuild(self)

    # ------------------------------------------------------------------ batches and pins

    def pin(self, ops: ArrayLike, remote: Union[RegionTable, dict], batch: Batch) -> np.ndarray:
        """Check ``ops`` (local side against :attr:`table`, remote side against ``remote``), then pin
        ``batch``'s local regions and track it (lock held).  Returns the ops as an ``OP_DTYPE`` array;
        :class:`Refused` (nothing pinned) when an op is out of bounds, :class:`Cancelled` when closed.
        ``batch.regions`` is set from the ops."""
        if self.closed:
            raise Cancelled("endpoint is closed")
        arr = check_ops(ops, self.table, remote)
        local = arr["local_region"]
        batch.regions = frozenset(local.tolist() if len(arr) <= 8 else np.unique(local).tolist())
        self.pin_entries(batch, batch.regions)
        self.batches.add(batch)
        return arr

    def pin_entries(self, holder: Batch, region_ids: Iterable[int]) -> None:
        """Pin the entries of ``region_ids`` for ``holder`` (lock held; every id must be registered)."""
        pinned = holder.pinned
        for r in region_ids:
            e = self.entries[r]
            e.busy += 1
            pinned.append(e)

    def unpin(self, batch: Batch) -> None:
        """``batch`` ended: drop its pins and stop tracking it (takes the lock; wakes drains).  An entry
        that was deregistered meanwhile is still counted down: its drain waits on it."""
        with self.cond:
            self.unpin_locked(batch)

    def unpin_locked(self, batch: Batch) -> None:
        """:meth:`unpin` with the lock held.  Wakes :attr:`cond`'s waiters only while :attr:`waiting`
        counts some: a transport that waits on :attr:`cond` for a reason of its own counts itself
        there while it waits, as :meth:`deregister` and :meth:`close` do."""
        self.batches.discard(batch)
        for e in batch.pinned:
            e.busy -= 1
        batch.pinned = []
        if self.waiting:
            self.cond.notify_all()

    def track(self, batch: TrackedBatch) -> None:
        """Track a batch that pins nothing (lock held), so that deregistration and close fail it;
        it needs ``touches(region_id)`` and ``fail(error)``."""
        if self.closed:
            raise Cancelled("endpoint is closed")
        self.batches.add(batch)

    def untrack(self, batch: TrackedBatch) -> None:
        with self.cond:
            self.batches.discard(batch)
            self.cond.notify_all()

    # ------------------------------------------------------------------ cancel, then drain

    def deregister(self, region_id: int, *, locked: Optional[Callable[[_E], Any]] = None,
                   also_wait: Optional[Callable[[], bool]] = None) -> Optional[_E]:
        """Forget ``region_id``: fail the batches touching it (:class:`Cancelled`), then wait until no
        pin on it is left and ``also_wait()`` (checked under the lock) is false.  ``locked(entry)`` runs
        under the lock right after the entry left the tables (stop serving it there).  Returns the
        entry, or ``None`` when it was not registered.  Takes the lock; never holds it while failing."""
        with self.cond:
            entry = self.entries.pop(region_id, None)
            if entry is None:
                return None
            self.rebuild()
            if locked is not None:
                locked(entry)
            touching = [b for b in self.batches if b.touches(region_id)]
        why = Cancelled(f"local region {region_id} was deregistered")
        for b in touching:
            b.fail(why)
        self._wait(lambda: entry.busy > 0 or (also_wait is not None and also_wait()))
        return entry

    def close(self, *, locked: Optional[Callable[[], Any]] = None,
              also_wait: Optional[Callable[[], bool]] = None) -> bool:
        """Refuse new registrations and batches, fail every batch in flight (:class:`Cancelled`), then
        wait until no entry is pinned and ``also_wait()`` is false.  ``False`` when already closed."""
        with self.cond:
            if self.closed:
                return False
            self.closed = True
            if locked is not None:
                locked()
            batches = list(self.batches)
        why = Cancelled("endpoint closed")
        for b in batches:
            b.fail(why)
        self._wait(lambda: any(e.busy for e in self.entries.values()) or
                   (also_wait is not None and also_wait()))
        return True

    def _wait(self, pending: Callable[[], bool]) -> None:
        with self.cond:
            self.waiting += 1
            try:
                while pending():
                    self.cond.wait()
            finally:
                self.waiting -= 1


def map_os_error(exc: BaseException, *, what: str = "connection failed",
                 peer_alive: Optional[Callable[[], bool]] = None) -> TransportError:
    """The typed error for an exception raised while moving bytes.

    A :class:`~llmdd.lowlevel.TransportError` stays what it is, except that with ``peer_alive`` a
    failure other than a timeout or refusal becomes :class:`PeerGone` when the peer process is gone;
    a TLS failure other than an end of stream (a certificate the other side does not accept, a peer
    that does not speak TLS) is a :class:`Refused` with ``LLM_LINK_FAILED``; a socket timeout
    (``EAGAIN`` under ``SO_RCVTIMEO``, :class:`TimeoutError`) is :class:`TransportTimeout`; any other
    :class:`OSError` or :class:`EOFError` is :class:`PeerGone` (``what: error``); anything else is
    :class:`Corrupt`."""
    if isinstance(exc, TransportError):
        if (peer_alive is not None and not isinstance(exc, (PeerGone, Refused, TransportTimeout))
                and not peer_alive()):
            return PeerGone(f"peer process is gone ({exc})")
        return exc
    if isinstance(exc, ssl.SSLError) and not isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError,
                                                               ssl.SSLWantReadError, ssl.SSLWantWriteError)):
        return Refused(f"TLS on the data connection failed: {exc}", status_code=LLMStatusCode.LLM_LINK_FAILED)
    if isinstance(exc, (BlockingIOError, TimeoutError)):
        return TransportTimeout(f"socket timed out: {exc}")
    if isinstance(exc, (OSError, EOFError)):
        return PeerGone(f"{what}: {exc}")
    return Corrupt(f"unexpected failure: {exc!r}")
