"""The transport seam: what every transport plugin implements, and nothing more.

Theory of operation
-------------------
A transport moves bytes between *registered regions*, one-sided, the way RDMA does:

* ``Transport`` is a class a plugin registers; ``probe()`` says whether it can run here.
* ``Transport.open_endpoint()`` gives an ``Endpoint``: it registers local regions
  (``register`` returns the :class:`RegionDescriptor` a peer needs), describes itself for the
  link handshake (``describe``: an :class:`EndpointDescriptor`) and connects to a peer endpoint
  (``connect``).  A descriptor is a frozen value: the transport's name, the version of its own
  payload format and the payload, opaque bytes to llmdd, at most :data:`MAX_PAYLOAD_BYTES`
  (each transport encodes its own, e.g. :func:`llmdd.lowlevel.encode_payload`).  A transport
  refuses (:class:`Refused`) a descriptor of another transport or of a newer version than it
  reads (:meth:`EndpointDescriptor.payload_for`).  What the control plane adds is typed too:
  the capability it granted a link travels as :attr:`EndpointDescriptor.capability`.
* A ``Channel`` performs batched ``read(ops)`` (remote -> local, a pull) and ``write(ops)``
  (local -> remote, a push). ``ops`` is always a numpy array of :data:`OP_DTYPE`; no
  per-op Python object crosses the seam.
* Each batch returns a ``Completion`` (``done``, ``wait``, ``error``, ``cancel``).
* Optionally, ``Channel.prepare()`` gives a *prepared transfer*: one call that moves a few blocks of
  a shape the engine planned once (which local and remote region each tensor pair uses, the block
  size, the two caches' block counts, the direction).  The engine's pull and push try it first and
  take the batch path above whenever it declines (the default: no prepared path).

The contract of a batch, stated once (the :class:`Channel` and :class:`Completion` docstrings and
docs/writing-a-transport.md refer here):

* **One refusal path.**  ``read()`` and ``write()`` never raise a ``TransportError``: every refusal
  (ops that are not :data:`OP_DTYPE`, a region not registered, not granted or out of bounds, a
  closed channel or endpoint, a deadline already past) and every failure is reported by the returned
  completion's ``error``, and a refused batch moves nothing.
* **The deadline is the transport's.**  A batch finishes by the deadline it was given: when it
  passes, the transport fails the batch with :class:`TransportTimeout` and drains it, at the latest
  inside ``wait`` (``wait()`` without a timeout therefore returns by the deadline plus the drain).
  The caller waits on the completion; it adds no deadline arithmetic of its own.
* **Nothing lands after an error** (docs/concepts.md, "What done means"): once ``wait`` returned with
  an error, or once ``cancel()`` returned, no byte of that batch is written into local memory any
  more: the transport drains or kills its I/O first (sockets shut down and worker threads joined for
  the tcp transport).

Deadlines are absolute values of the engine's runtime clock: ``time.monotonic()`` in a real
process, the simulated clock under ``llmdd.testing.sim`` (where only a transport of the
simulation runs). Errors are typed, subclasses of
:class:`llmdd._base.status.TransportError` carrying upstream status codes.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Optional, Sequence, Union

import attrs

from llmdd._base.backing import SharedSegment
from llmdd._base.status import TransportError
from llmdd._seam.errors import Refused

if TYPE_CHECKING:
    from llmdd._base.lazy import np

__all__ = [
    "MemRegion",
    "SharedSegment",
    "TransportInfo",
    "EndpointDescriptor",
    "RegionDescriptor",
    "MAX_PAYLOAD_BYTES",
    "Transport",
    "Endpoint",
    "Channel",
    "Completion",
    "PreparedTransfer",
    "CAPABILITY_BYTES",
]


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
    #: where the range also lives, as the memory layer states it (``None``: nowhere else); a
    #: same-host transport may map that segment, any other transport ignores it
    backing: Union[SharedSegment, None] = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(SharedSegment)))


@attrs.frozen(kw_only=True)
class TransportInfo:
    """What ``Transport.probe()`` found: can it run here, and if not, why."""

    name: str
    available: bool
    reason: str = ""
    details: Mapping[str, Any] = attrs.field(factory=dict)


#: the most payload bytes a descriptor carries: checked when a descriptor is built, so a peer's
#: descriptor is bounded before any work proportional to its size (decoding, mapping)
MAX_PAYLOAD_BYTES = 64 * 1024
#: the longest transport name
MAX_TRANSPORT_NAME = 64
#: bytes in a capability (256 bits from :mod:`secrets`)
CAPABILITY_BYTES = 32


def _u32(_inst: object, attribute: attrs.Attribute, value: Any) -> None:
    if type(value) is not int or not 0 <= value < 2**32:
        raise Refused(f"descriptor {attribute.name} must be an int in [0, 2**32), got {value!r}")


def _name(_inst: object, attribute: attrs.Attribute, value: Any) -> None:
    if type(value) is not str or not 0 < len(value) <= MAX_TRANSPORT_NAME:
        raise Refused(f"descriptor {attribute.name} must be a str of 1..{MAX_TRANSPORT_NAME} characters, "
                      f"got {value!r:.80}")


def _payload(_inst: object, attribute: attrs.Attribute, value: Any) -> None:
    if type(value) is not bytes:
        raise Refused(f"descriptor payload must be bytes, got {type(value).__name__}")
    if len(value) > MAX_PAYLOAD_BYTES:
        raise Refused(f"descriptor payload of {len(value)} bytes exceeds {MAX_PAYLOAD_BYTES}")


#: the shortest and longest capability a descriptor carries (the link manager mints CAPABILITY_BYTES)
MIN_CAPABILITY_BYTES, MAX_CAPABILITY_BYTES = 16, 64


def _capability(_inst: object, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (type(value) is not bytes
                              or not MIN_CAPABILITY_BYTES <= len(value) <= MAX_CAPABILITY_BYTES):
        raise Refused(f"a capability is bytes, {MIN_CAPABILITY_BYTES}..{MAX_CAPABILITY_BYTES} long")


@attrs.frozen(kw_only=True)
class _Descriptor:
    transport: str = attrs.field(validator=_name)
    version: int = attrs.field(validator=_u32)
    payload: bytes = attrs.field(validator=_payload, repr=lambda p: f"<{len(p)} bytes>")

    def payload_for(self, transport: str, version: int) -> bytes:
        """The payload, once this descriptor is found to be ``transport``'s and of a version it reads
        (``version`` or older); raises :class:`Refused` with the reason otherwise."""
        if self.transport != transport:
            raise Refused(f"a {self.transport!r} descriptor given to the {transport!r} transport")
        if self.version > version:
            raise Refused(f"{transport} descriptor version {self.version} is newer than this side reads "
                          f"(at most {version})")
        return self.payload


@attrs.frozen(kw_only=True)
class EndpointDescriptor(_Descriptor):
    """What ``Endpoint.describe()`` returns and ``Endpoint.connect()`` takes: how to reach an endpoint.

    ``transport``, ``version`` and ``payload`` are the transport's own (the payload is opaque to
    llmdd).  ``capability`` is the data-port capability the holder presents (see
    :attr:`Endpoint.capabilities`): the link manager adds the one the endpoint's owner granted to
    the link before the peer connects; an endpoint with capabilities that does not serve links only
    puts its own in ``describe()`` (tools and tests wiring endpoints directly); otherwise ``None``.
    Its repr never shows it."""

    capability: Union[bytes, None] = attrs.field(default=None, validator=_capability, repr=False)


@attrs.frozen(kw_only=True)
class RegionDescriptor(_Descriptor):
    """What ``Endpoint.register()`` returns and ``Channel.add_remote_region()`` takes: how a peer
    reaches one region (the transport's own encoding, opaque to llmdd)."""


# --------------------------------------------------------------------------- completions


class Completion(abc.ABC):
    """The outcome of one batch: ``done()``, ``wait(timeout)``, ``error``, ``cancel()``.

    Its semantics are the seam's batch contract (this module's docstring): the only way a batch's
    refusal or failure is reported, finished by the batch's deadline, nothing landing after an error."""

    @abc.abstractmethod
    def done(self) -> bool:
        """True once the batch finished, with or without an error."""

    @abc.abstractmethod
    def wait(self, timeout: Union[float, None] = None) -> bool:
        """Block up to ``timeout`` seconds (``None``: until done, which is by the batch's deadline);
        return ``done()``.  When the deadline passes during ``wait`` the batch is failed with
        :class:`TransportTimeout` and drained before ``wait`` returns."""

    @property
    @abc.abstractmethod
    def error(self) -> Union[TransportError, None]:
        """The error of a finished batch, ``None`` while running or after success."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Stop the batch; when this returns no byte of it is written any more. No-op when done."""


# --------------------------------------------------------------------------- the seam

#: What :meth:`Channel.prepare` returns: ``f(src_blocks, dst_blocks) -> int`` moves those blocks (lists of
#: ints, equally long; ``src_blocks`` of the source cache: the remote one for a pull, the local one for a
#: push) of the prepared shape in one call and returns the bytes moved; or a negative number when it did
#: not do the transfer (declined: the engine then moves the same blocks on the batch path, which does the
#: transfer or reports the error as the contract says; a transfer declined because its tables went stale
#: moves nothing); or it raises the ``TransportError`` of a transfer it started and that failed, by the
#: ``timeout_s`` it was prepared with after the call at the latest, with nothing landing after it raised
#: (as a batch's error).
PreparedTransfer = Callable[[Sequence[int], Sequence[int]], int]


class Channel(abc.ABC):
    """A connection from a local endpoint to one peer endpoint."""

    @abc.abstractmethod
    def add_remote_region(self, region_id: int, size: int, desc: RegionDescriptor) -> None:
        """Learn a peer region from the descriptor its owner's ``Endpoint.register`` returned."""

    @abc.abstractmethod
    def remove_remote_region(self, region_id: int) -> None:
        """Forget a peer region; later ops naming it are refused locally."""

    @abc.abstractmethod
    def read(self, ops: np.ndarray, *, deadline: float) -> Completion:
        """Pull: copy ``remote -> local`` for every op, by ``deadline`` (absolute ``time.monotonic()``).
        Never raises a ``TransportError``: a refusal (ops failing :func:`check_ops`, a closed channel...)
        and any failure are the completion's ``error`` (the batch contract, this module's docstring)."""

    @abc.abstractmethod
    def write(self, ops: np.ndarray, *, deadline: float) -> Completion:
        """Push: copy ``local -> remote`` for every op (same contract as :meth:`read`)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Cancel batches in flight and release the connection; idempotent."""

    @abc.abstractmethod
    def statistics(self) -> dict:
        """Counters: bytes/ops read and written, batches, failures, last error."""

    # -------------------------------------------------------------- the prepared path (optional)
    def prepare(self, pairs: Sequence[tuple[int, int]], block_bytes: int, src_units: int, dst_units: int,
                push: bool, *, timeout_s: float) -> Optional[PreparedTransfer]:
        """A :data:`PreparedTransfer` for one shape of small block transfers, or ``None``: no prepared
        path for it (the default: a transport without one, a fault-injecting wrapper; or a shape the
        transport cannot take), and the engine moves every such call with :meth:`read` / :meth:`write`.

        The shape: ``pairs`` are the (local region id, remote region id) of each tensor pair, in the
        planner's order; ``block_bytes`` the bytes of one block of one tensor; block ``b`` of a pair
        lies at offset ``b * block_bytes`` of both regions; the source cache has ``src_units`` blocks,
        the destination ``dst_units``; ``push`` True writes local -> remote (the local side is the
        source), False reads remote -> local.  Each call of the result has ``timeout_s`` to finish.

        The result is resolved against the tables of now and must decline (return a negative number,
        nothing moved) once a region it names was deregistered or removed, the channel or endpoint
        closed, or a block lies outside its cache: the engine keeps it while its own view of both
        sides' tables is unchanged and calls :meth:`prepare` again when it declined.  It is called
        under the link's transfer turn (one blocking transfer per link at a time), never concurrently
        for one link; docs/writing-a-transport.md, "A prepared path"."""
        return None


class Endpoint(abc.ABC):
    """One local attachment point of a transport: registrations, a listener, channels."""

    @abc.abstractmethod
    def describe(self) -> EndpointDescriptor:
        """This endpoint's descriptor, sent in the link handshake (its ``capability`` is ``None``)."""

    @abc.abstractmethod
    def register(self, region: MemRegion) -> RegionDescriptor:
        """Register a local region; return the descriptor a peer passes to ``add_remote_region``."""

    @abc.abstractmethod
    def deregister(self, region_id: int) -> None:
        """Forget a region. Ops in flight touching it are failed and drained first: after this
        returns the transport never touches the memory again."""

    @abc.abstractmethod
    def connect(self, peer: EndpointDescriptor, *, timeout: float) -> Channel:
        """Open a channel to the endpoint that ``peer`` (its ``describe()``, with the capability the
        peer granted when it has ``capabilities``) names; :class:`Refused` for a foreign or newer
        descriptor."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close channels, stop serving, drain everything; idempotent."""

    @abc.abstractmethod
    def statistics(self) -> dict:
        """Counters: bytes/ops served, requests refused, last error."""

    # -------------------------------------------------------------- per-link capabilities
    #: True when this endpoint serves a data connection only to a peer that presents a capability
    #: granted with :meth:`grant` (the tcp transport).  The link manager then mints one capability
    #: per link and incarnation, grants it here, and sends it to the peer beside this endpoint's
    #: descriptor; the peer's ``connect`` finds it in :attr:`EndpointDescriptor.capability`.  False (the
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
    def listen_address(self) -> Union[tuple[str, int], None]:
        """The ``(host, port)`` this endpoint's own listener (a data port) serves, for the engine's
        records and ``llmdd doctor``; ``None`` (the default) for an endpoint without one."""
        return None

    def on_listener_failed(self, callback: Callable[[str], None]) -> None:
        """Have ``callback(error)`` called once if this endpoint's own listener (a data port) cannot
        continue: it then accepts nothing more.  The call comes from the endpoint's own thread and
        must not block.  The link manager then records it (engine trigger ``listener_failed``,
        ``llmdd doctor``), fails the links over this endpoint typed and opens a fresh one for the
        next link.  Default: never called (an endpoint without a listener of its own)."""




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

