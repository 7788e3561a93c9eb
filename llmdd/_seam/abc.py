"""The transport seam: what every transport plugin implements, and nothing more.

Theory of operation
-------------------
A transport moves bytes between *registered regions*, one-sided, the way RDMA does:

* ``Transport`` is a class a plugin registers; ``probe()`` says whether it can run here.
* ``Transport.open_endpoint()`` gives an ``Endpoint``: it registers local regions
  (``register`` returns a per-region descriptor the peer needs), describes itself for the
  link handshake (``describe``) and connects to a peer endpoint (``connect``).
* A ``Channel`` performs batched ``read(ops)`` (remote -> local, a pull) and ``write(ops)``
  (local -> remote, a push). ``ops`` is always a numpy array of :data:`OP_DTYPE`; no
  per-op Python object crosses the seam.
* Each batch returns a ``Completion`` (``done``, ``wait``, ``error``, ``cancel``).

The promise of a ``Completion`` (docs/concepts.md, "What done means"): once ``wait``
returned with an error, or once ``cancel()`` returned, no byte of that batch is written into
local memory any more: the transport drains or kills its I/O first (sockets shut down and
worker threads joined for the tcp transport).

Deadlines are absolute ``time.monotonic()`` values. Errors are typed, subclasses of
:class:`llmdd._base.status.TransportError` carrying upstream status codes.
"""

from __future__ import annotations

import abc
import functools
import threading
import time
from typing import Any, Callable, ClassVar, Iterable, Mapping, Sequence, Union

import attrs

from llmdd._base.lazy import np, numpy_constants, when_numpy_loaded
from llmdd._base.log import get_logger
from llmdd._base.status import LLMStatusCode, TransportError

__all__ = [
    "OP_DTYPE",
    "MemRegion",
    "TransportInfo",
    "TransportTimeout",
    "PeerGone",
    "Refused",
    "Corrupt",
    "Cancelled",
    "Transport",
    "Endpoint",
    "Channel",
    "Completion",
    "ThreadCompletion",
    "DoneCompletion",
    "RegionTable",
    "check_ops",
    "make_ops",
    "coalesce_ops",
    "split_ops",
    "as_ops",
    "CAPABILITY_KEY",
    "CAPABILITY_BYTES",
]

_log = get_logger("llmdd.abc")

#: One op of a batch: (local region, offset, remote region, offset, length), packed (a numpy
#: dtype, defined when numpy is first used: see llmdd._base.lazy).
OP_DTYPE: Any


@when_numpy_loaded
def _define_dtypes(numpy: Any) -> None:
    global OP_DTYPE
    OP_DTYPE = numpy.dtype([
        ("local_region", "<u4"),
        ("local_offset", "<u8"),
        ("remote_region", "<u4"),
        ("remote_offset", "<u8"),
        ("length", "<u8"),
    ])


__getattr__ = numpy_constants(globals(), "OP_DTYPE")


# --------------------------------------------------------------------------- value types


@attrs.frozen(kw_only=True)
class MemRegion:
    """A registered range of memory. ``addr`` is an integer address (``arr.ctypes.data``)."""

    region_id: int = attrs.field(validator=[attrs.validators.instance_of(int), attrs.validators.ge(0),
                                            attrs.validators.lt(2**32)])
    addr: int = attrs.field(validator=[attrs.validators.instance_of(int), attrs.validators.ge(0)])
    size: int = attrs.field(validator=[attrs.validators.instance_of(int), attrs.validators.ge(0)])
    remote_accessible: bool = attrs.field(validator=attrs.validators.instance_of(bool))
    placement: int = attrs.field(converter=int)
    shm_name: Union[str, None] = attrs.field(default=None)
    shm_offset: int = attrs.field(default=0, validator=attrs.validators.ge(0))


@attrs.frozen(kw_only=True)
class TransportInfo:
    """What ``Transport.probe()`` found: can it run here, and if not, why."""

    name: str
    available: bool
    reason: str = ""
    details: Mapping[str, Any] = attrs.field(factory=dict)


# --------------------------------------------------------------------------- errors


class _TypedTransportError(TransportError):
    default_status: ClassVar[LLMStatusCode] = LLMStatusCode.LLM_FAILED

    def __init__(self, *args: Any, status_code: Union[LLMStatusCode, None] = None) -> None:
        super().__init__(*args, status_code=status_code if status_code is not None else self.default_status)


class TransportTimeout(_TypedTransportError):
    """The batch did not finish by its deadline (upstream: ``LLM_TIMEOUT``)."""

    default_status = LLMStatusCode.LLM_TIMEOUT


class PeerGone(_TypedTransportError):
    """The peer closed, crashed or became unreachable (upstream: ``LLM_LINK_FAILED``)."""

    default_status = LLMStatusCode.LLM_LINK_FAILED


class Refused(_TypedTransportError):
    """An op names a region or range that its owner does not grant; nothing was moved.

    Status ``LLM_PARAM_INVALID``: a transport sees regions and byte ranges, not caches.
    A refused op is a bad address in the request (a block index or offset out of range,
    a region that is not registered or not remote-accessible), which is what upstream
    reports as ``LLM_PARAM_INVALID`` for a bad block index. ``LLM_KV_CACHE_NOT_EXIST``
    belongs to the cache layer above, which knows cache ids and keys and maps a missing
    cache to it before any op is built. Callers may still pass another ``status_code``
    (e.g. ``LLM_LINK_FAILED`` for a failed authentication).
    """

    default_status = LLMStatusCode.LLM_PARAM_INVALID


class Corrupt(_TypedTransportError):
    """The peer sent something that breaks the protocol (upstream: ``LLM_FAILED``)."""

    default_status = LLMStatusCode.LLM_FAILED


class Cancelled(_TypedTransportError):
    """The batch was cancelled (``cancel()``, channel or endpoint closed, region deregistered).

    Upstream has no "cancelled" code; ``LLM_FAILED`` is what its engine reports for an
    interrupted transfer.
    """

    default_status = LLMStatusCode.LLM_FAILED


# --------------------------------------------------------------------------- op helpers


#: batches of at most this many ops are checked with plain Python integers
_SMALL_BATCH = 8


class RegionTable:
    """An immutable snapshot ``region_id -> size`` kept as sorted numpy arrays.

    Endpoints rebuild it on register/deregister (rare) so that validating a batch is a few
    vectorised numpy calls, whatever its length.
    """

    __slots__ = ("ids", "sizes", "by_id", "private")

    def __init__(self, sizes: Union[Mapping[int, Any], Iterable[tuple[int, Any]]] = (), *,
                 private: Sequence[int] = ()) -> None:
        items = sorted((int(k), int(v.size if hasattr(v, "size") else v)) for k, v in dict(sizes).items())
        self.ids = np.fromiter((k for k, _ in items), dtype=np.int64, count=len(items))
        self.sizes = np.fromiter((v for _, v in items), dtype=np.uint64, count=len(items))
        #: the same table as a dict, for batches of a few ops (no numpy fixed costs)
        self.by_id = dict(items)
        #: ids registered by the owner but not remote-accessible: refused as such, not as "not registered"
        self.private = frozenset(int(k) for k in private)

    def _missing(self, side: str, rid: int) -> Refused:
        """The one refusal for an op naming a region outside this table."""
        if rid in self.private:
            return Refused(f"{side} region {rid} is not remote-accessible")
        return Refused(f"{side} region {rid} is not registered")

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, region_id: object) -> bool:
        i = int(np.searchsorted(self.ids, region_id))
        return i < len(self.ids) and int(self.ids[i]) == region_id

    def check(self, ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, side: str) -> None:
        """Raise :class:`Refused` unless every ``(id, offset, length)`` lies inside its region."""
        n = len(ids)
        if not n:
            return
        if n <= _SMALL_BATCH:
            # plain integer compares: same checks, same messages, without numpy's per-call costs
            by_id = self.by_id
            for i, (rid, off, ln) in enumerate(zip(ids.tolist(), offsets.tolist(), lengths.tolist())):
                size = by_id.get(rid)
                if size is None:
                    raise self._missing(side, rid)
                if off < 0 or ln < 0 or off > size or ln > size - off:
                    raise Refused(f"{side} op {i} out of bounds: region {rid} offset {off % 2**64} "
                                  f"length {ln % 2**64} size {size}")
            return
        ids = ids.astype(np.int64, copy=False)
        if not len(self.ids):
            raise self._missing(side, int(ids[0]))
        pos = np.searchsorted(self.ids, ids)
        np.minimum(pos, len(self.ids) - 1, out=pos)
        found = self.ids[pos] == ids
        if not found.all():
            raise self._missing(side, int(ids[np.argmin(found)]))
        size = self.sizes[pos]
        offsets = offsets.astype(np.uint64, copy=False)
        lengths = lengths.astype(np.uint64, copy=False)
        inside = offsets <= size
        # size - offsets is only evaluated (and only meaningful) where offsets <= size
        ok = inside & (lengths <= np.where(inside, size - np.minimum(offsets, size), 0))
        if not ok.all():
            i = int(np.argmin(ok))
            raise Refused(f"{side} op {i} out of bounds: region {int(ids[i])} offset {int(offsets[i])} "
                          f"length {int(lengths[i])} size {int(size[i])}")


def _as_table(regions: Union[RegionTable, Mapping[int, Any]]) -> RegionTable:
    return regions if isinstance(regions, RegionTable) else RegionTable(regions)


def as_ops(ops: Any) -> np.ndarray:
    """Return ``ops`` as a 1-d C-contiguous array of :data:`OP_DTYPE` (no copy when it already is)."""
    if type(ops) is np.ndarray and ops.dtype is OP_DTYPE and ops.ndim == 1 and ops.flags.c_contiguous:
        return ops
    arr = np.asarray(ops)
    if arr.dtype != OP_DTYPE:
        raise Refused(f"ops must be a numpy array of OP_DTYPE, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr.reshape(-1))


def check_ops(ops: Any, local_regions: Union[RegionTable, Mapping[int, Any]],
              remote_regions: Union[RegionTable, Mapping[int, Any]]) -> np.ndarray:
    """Validate every op against both sides' region bounds before a byte moves.

    ``local_regions`` / ``remote_regions`` map region id -> size (an int or anything with
    ``.size``, e.g. a :class:`MemRegion`), or are :class:`RegionTable` snapshots.
    Returns the ops as a contiguous :data:`OP_DTYPE` array; raises :class:`Refused`.
    """
    arr = as_ops(ops)
    _as_table(local_regions).check(arr["local_region"], arr["local_offset"], arr["length"], "local")
    _as_table(remote_regions).check(arr["remote_region"], arr["remote_offset"], arr["length"], "remote")
    return arr


def make_ops(local_region: Any, local_offset: Any, remote_region: Any, remote_offset: Any,
             length: Any) -> np.ndarray:
    """Build an :data:`OP_DTYPE` array from scalars or arrays (broadcast)."""
    cols = np.broadcast_arrays(*(np.asarray(x) for x in
                                 (local_region, local_offset, remote_region, remote_offset, length)))
    out = np.empty(cols[0].size, dtype=OP_DTYPE)
    for name, col in zip(OP_DTYPE.names, cols):
        out[name] = col.reshape(-1)
    return out


def coalesce_ops(ops: np.ndarray, *, sort: bool = True) -> np.ndarray:
    """Merge ops that continue each other on both sides into one op (vectorised).

    With ``sort`` the batch is first ordered by (remote region, remote offset, local region,
    local offset): ops of a batch are unordered, and block tables that are runs on both
    sides then merge into a few large ops. Zero-length ops are dropped.
    """
    ops = ops[ops["length"] > 0]
    if len(ops) < 2:
        return np.ascontiguousarray(ops)
    if sort:
        order = np.lexsort((ops["local_offset"], ops["local_region"], ops["remote_offset"], ops["remote_region"]))
        ops = ops[order]
    lr, lo, rr, ro, ln = (ops[n] for n in ("local_region", "local_offset", "remote_region", "remote_offset", "length"))
    cont = ((lr[1:] == lr[:-1]) & (rr[1:] == rr[:-1])
            & (lo[:-1] + ln[:-1] == lo[1:]) & (ro[:-1] + ln[:-1] == ro[1:]))
    if not cont.any():
        return np.ascontiguousarray(ops)
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    out = ops[starts].copy()
    out["length"] = np.add.reduceat(ln, starts)
    return out


def split_ops(ops: np.ndarray, parts: int) -> list[np.ndarray]:
    """Split ``ops`` into at most ``parts`` consecutive slices of about equal bytes."""
    if parts <= 1 or len(ops) < 2:
        return [ops]
    ends = np.cumsum(ops["length"], dtype=np.uint64)
    total = int(ends[-1])
    cuts = np.searchsorted(ends, [total * k // parts for k in range(1, parts)], side="left") + 1
    cuts = np.unique(np.clip(cuts, 1, len(ops) - 1))
    return [p for p in np.split(ops, cuts) if len(p)]


# --------------------------------------------------------------------------- completions


class Completion(abc.ABC):
    """The outcome of one batch: ``done()``, ``wait(timeout)``, ``error``, ``cancel()``."""

    @abc.abstractmethod
    def done(self) -> bool:
        """True once the batch finished, with or without an error."""

    @abc.abstractmethod
    def wait(self, timeout: Union[float, None] = None) -> bool:
        """Block up to ``timeout`` seconds (``None``: until done); return ``done()``.

        A batch never outlives its deadline: when the deadline passes during ``wait``,
        the batch is failed with :class:`TransportTimeout` and drained before ``wait`` returns.
        """

    @property
    @abc.abstractmethod
    def error(self) -> Union[TransportError, None]:
        """The error of a finished batch, ``None`` while running or after success."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Stop the batch; when this returns no byte of it is written any more. No-op when done."""


class DoneCompletion(Completion):
    """An already finished batch (synchronous transports, inline small batches)."""

    __slots__ = ("_error",)

    def __init__(self, error: Union[TransportError, None] = None) -> None:
        self._error = error

    def done(self) -> bool:
        return True

    def wait(self, timeout: Union[float, None] = None) -> bool:
        return True

    @property
    def error(self) -> Union[TransportError, None]:
        return self._error

    def cancel(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"<DoneCompletion error={self._error!r}>"


def _wrap_error(exc: BaseException) -> TransportError:
    if isinstance(exc, TransportError):
        return exc
    if isinstance(exc, (ConnectionError, EOFError)):  # reset, broken pipe, refused, aborted
        return PeerGone(f"peer connection lost: {exc!r}")
    if isinstance(exc, (TimeoutError,)):
        return TransportTimeout(f"transport worker timed out: {exc!r}")
    return Corrupt(f"transport worker failed: {exc!r}")


class ThreadCompletion(Completion):
    """A batch run by one or more workers; reusable by any transport.

    ``workers`` are callables, each run in its own daemon thread, or, with ``pool``, the first in
    the thread that calls :meth:`start` and the others handed to ``pool(fn)`` (a persistent thread
    pool's submit: no thread start per batch).  ``abort`` must make every worker return promptly
    (shut its sockets down, set a flag it checks between chunks); it is called once, on the first
    worker error, on :meth:`cancel`, and when ``deadline`` passes during :meth:`wait`.  ``on_done``
    runs once, after every worker has returned and before ``done()`` turns true (release resources
    there; :attr:`recorded_error` is the batch's error then).  The first error wins, except that an
    error set by :meth:`fail` (cancel, deadline, deregistration) wins over what the aborted workers
    raise.  A worker's exception becomes a typed error through ``map_error`` (default: a
    :class:`~llmdd.lowlevel.TransportError` as it is, a lost connection :class:`PeerGone`, a timeout
    :class:`TransportTimeout`, anything else :class:`Corrupt`); an interrupt (``KeyboardInterrupt``)
    fails the batch :class:`Cancelled` and, in the caller's own part, goes on.  With ``start=False``
    nothing runs before :meth:`start` (publish the completion first, e.g. where a concurrent
    deregistration finds it).
    """

    def __init__(self, workers: Sequence[Callable[[], None]], *, deadline: Union[float, None] = None,
                 abort: Union[Callable[[], None], None] = None,
                 on_done: Union[Callable[["ThreadCompletion"], object], None] = None,
                 name: str = "llmdd-io",
                 pool: Union[Callable[[Callable[[], None]], Any], None] = None,
                 map_error: Union[Callable[[BaseException], TransportError], None] = None,
                 start: bool = True) -> None:
        self._deadline = deadline
        self._abort = abort
        self._on_done = on_done
        self._name = name
        self._pool = pool
        self._map_error = map_error if map_error is not None else _wrap_error
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: Union[TransportError, None] = None
        self._forced: Union[TransportError, None] = None
        self._aborted = False
        self._pending = len(workers)
        self._workers: list = list(workers)
        self._threads: list[threading.Thread] = []
        self._runners: set[int] = set()   # pool mode: idents of the threads running a part now
        if start:
            self.start()

    def start(self) -> "ThreadCompletion":
        """Run the workers (once); returns self, which may already be done (pool mode)."""
        workers, self._workers = self._workers, []
        if not workers:
            if self._pending == 0 and not self._done.is_set():
                self._finish()
            return self
        if self._pool is None:
            self._threads = [threading.Thread(target=self._run, args=(w,), name=f"{self._name}-{i}", daemon=True)
                             for i, w in enumerate(workers)]
            for t in self._threads:
                t.start()
            return self
        for w in workers[1:]:
            self._pool(functools.partial(self._run, w))
        self._run(workers[0], inline=True)
        return self

    @property
    def recorded_error(self) -> Union[TransportError, None]:
        """The error recorded so far (what ``error`` will be; readable in ``on_done``)."""
        return self._error

    # worker side
    def _run(self, work: Callable[[], None], inline: bool = False) -> None:
        me = threading.get_ident()
        if self._pool is not None:
            with self._lock:
                self._runners.add(me)
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - every failure becomes the batch's error
            if isinstance(exc, Exception):
                self._record(self._map_error(exc))
            else:
                self._record(Cancelled(f"interrupted: {exc!r}"))
                if inline:
                    raise
        finally:
            with self._lock:
                self._runners.discard(me)
                self._pending -= 1
                last = self._pending == 0
            if last:
                self._finish()

    def _record(self, err: TransportError) -> None:
        with self._lock:
            if self._error is None:
                self._error = err
        self._do_abort()

    def _do_abort(self) -> None:
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
        if self._abort is not None:
            try:
                self._abort()
            except Exception as exc:  # noqa: BLE001
                _log.warning("llmdd.transport.abort_failed", error=repr(exc))

    def _finish(self) -> None:
        with self._lock:
            if self._forced is not None:
                self._error = self._forced
        if self._on_done is not None:
            try:
                self._on_done(self)
            except Exception as exc:  # noqa: BLE001
                _log.warning("llmdd.transport.on_done_failed", error=repr(exc))
        self._done.set()

    # caller side
    def fail(self, err: TransportError) -> None:
        """Fail the batch with ``err`` (unless already done), abort and drain it."""
        with self._lock:
            if self._done.is_set():
                return
            if self._forced is None and self._error is None:
                self._forced = err
        self._do_abort()
        self._join()

    def _join(self) -> None:
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join()
        if me in self._threads:
            return
        with self._lock:
            if me.ident in self._runners:
                return   # a part failing its own batch: the others drain, it returns
        self._done.wait()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Union[float, None] = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        while not self._done.is_set():
            now = time.monotonic()
            limits = [t for t in (end, self._deadline) if t is not None]
            until = min(limits) if limits else None
            if until is not None and now >= until:
                if self._deadline is not None and now >= self._deadline:
                    self.fail(TransportTimeout("batch missed its deadline"))
                    return True
                return False
            self._done.wait(None if until is None else until - now)
        return True

    @property
    def error(self) -> Union[TransportError, None]:
        return self._error if self._done.is_set() else None

    def cancel(self) -> None:
        if not self._done.is_set():
            self.fail(Cancelled("batch cancelled"))

    def __repr__(self) -> str:
        state = "done" if self._done.is_set() else "running"
        return f"<ThreadCompletion {state} error={self.error!r}>"


# --------------------------------------------------------------------------- the seam


class Channel(abc.ABC):
    """A connection from a local endpoint to one peer endpoint."""

    @abc.abstractmethod
    def add_remote_region(self, region_id: int, size: int, desc: Mapping[str, Any]) -> None:
        """Learn a peer region from the descriptor its owner's ``Endpoint.register`` returned."""

    @abc.abstractmethod
    def remove_remote_region(self, region_id: int) -> None:
        """Forget a peer region; later ops naming it are refused locally."""

    @abc.abstractmethod
    def read(self, ops: np.ndarray, *, deadline: float) -> Completion:
        """Pull: copy ``remote -> local`` for every op. Raises :class:`Refused` for ops that fail
        :func:`check_ops`; other failures arrive through the completion."""

    @abc.abstractmethod
    def write(self, ops: np.ndarray, *, deadline: float) -> Completion:
        """Push: copy ``local -> remote`` for every op (same error rules as :meth:`read`)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Cancel batches in flight and release the connection; idempotent."""

    @abc.abstractmethod
    def statistics(self) -> dict:
        """Counters: bytes/ops read and written, batches, failures, last error."""


class Endpoint(abc.ABC):
    """One local attachment point of a transport: registrations, a listener, channels."""

    @abc.abstractmethod
    def describe(self) -> dict:
        """JSON-able (str/int/bool/bytes/list/dict) description sent in the link handshake."""

    @abc.abstractmethod
    def register(self, region: MemRegion) -> dict:
        """Register a local region; return the descriptor a peer passes to ``add_remote_region``."""

    @abc.abstractmethod
    def deregister(self, region_id: int) -> None:
        """Forget a region. Ops in flight touching it are failed and drained first: after this
        returns the transport never touches the memory again."""

    @abc.abstractmethod
    def connect(self, peer: Mapping[str, Any], *, timeout: float) -> Channel:
        """Open a channel to the endpoint that ``peer`` (its ``describe()``) names."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close channels, stop serving, drain everything; idempotent."""

    @abc.abstractmethod
    def statistics(self) -> dict:
        """Counters: bytes/ops served, requests refused, last error."""

    # -------------------------------------------------------------- per-link capabilities
    #: True when this endpoint serves a data connection only to a peer that presents a capability
    #: granted with :meth:`grant` (the tcp transport).  The link manager then mints one capability
    #: per link and incarnation, grants it here, and sends it to the peer inside this endpoint's
    #: descriptor under :data:`CAPABILITY_KEY`; the peer's ``connect`` finds it there.  False (the
    #: default): the transport has another trust boundary (docs/transports.md) and these calls are
    #: no-ops.
    capabilities: ClassVar[bool] = False

    def serve_links_only(self) -> None:
        """Serve from now on only connections that present a capability granted with :meth:`grant`.

        Without this call an endpoint that has ``capabilities`` serves the holders of its own
        ``describe()`` (tools and tests wiring two endpoints directly); the link manager calls it
        right after opening the endpoint, before a region is registered."""

    def grant(self, link_id: int, capability: bytes, regions: Union[Sequence[int], None]) -> None:
        """Let the holder of ``capability`` open data connections, for the link ``link_id``, and
        reach the remote-accessible regions in ``regions`` only (``None``: every one).  Called again
        with the same ``link_id`` it replaces the region set; a ``link_id`` already revoked stays
        revoked (the call is ignored)."""

    def revoke(self, link_id: int) -> None:
        """End the grant of ``link_id``: its capability opens nothing more, its data connections are
        closed, and when this returns no request of theirs touches memory any more. Idempotent."""

    # -------------------------------------------------------------- a listener that cannot continue
    def on_listener_failed(self, callback: Callable[[str], None]) -> None:
        """Have ``callback(error)`` called once if this endpoint's own listener (a data port) cannot
        continue: it then accepts nothing more.  The call comes from the endpoint's own thread and
        must not block.  The link manager then records it (engine trigger ``listener_failed``,
        ``llmdd doctor``), fails the links over this endpoint typed and opens a fresh one for the
        next link.  Default: never called (an endpoint without a listener of its own)."""


#: the key under which a descriptor exchanged in the link handshake carries the capability that its
#: owner granted to that link (see :attr:`Endpoint.capabilities`)
CAPABILITY_KEY = "capability"
#: bytes in a capability (256 bits from :mod:`secrets`)
CAPABILITY_BYTES = 32


class Transport(abc.ABC):
    """A transport plugin's class. ``name`` is unique; higher ``priority`` is preferred."""

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 0
    same_host_only: ClassVar[bool] = False
    #: True when endpoints opened with a ``secret`` serve only peers that prove the same secret (the
    #: conformance suite's ``check_authentication`` then requires it); False when the transport's trust
    #: boundary is elsewhere (same host and user: shm) and a secret is accepted without effect.
    authenticates: ClassVar[bool] = False

    @classmethod
    @abc.abstractmethod
    def probe(cls) -> TransportInfo:
        """Say whether this transport can run here, and why not. Never raises."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self.options: Mapping[str, str] = dict(options)

    @abc.abstractmethod
    def open_endpoint(self, *, host: str = "127.0.0.1", secret: Union[bytes, None] = None) -> Endpoint:
        """Open an endpoint bound to ``host`` only; ``secret`` makes peers authenticate."""
