"""Typed control-plane messages of llmdd (value types only; the wire format lives in ``codec``, the
bounds and construction checks every message runs in ``wire``).

Every message is a frozen ``msgspec.Struct`` (keyword-only, encoded as a MessagePack array of its
fields in declaration order).  The field annotations carry the ranges and lengths the wire may
hold (u8/u16/u32/u64/i64, bounded byte strings and lists): the codec's typed decoder checks them in
C while it parses, so a decoded frame that breaks one is a ``ProtocolError``, never a half-built
object.  Nothing here is ever pickled.

Construction checks.  ``msgspec`` constructors do not check types, so every message and building
block runs the same checks in ``__post_init__`` (types, ranges, lengths, descriptor dicts, the
cross-field rules), converting lists to tuples and ints to their enum: an instance that constructs
is an instance that encodes.  Three hot building blocks are exempt, because ``__post_init__`` also
runs for every decoded object and a peer-read notice carries thousands of them: :class:`Span`,
:class:`ReadDoneEntry` and :class:`ReadDone` are checked on decode by the typed decoder only, and a
span's order (``start <= stop``) together with its position is checked by the owner against its
own cache table (``llmdd._data.peer_input.peer_range``) before any work, like every number a peer sends.
The engine builds those three from its own validated block lists.

Message families
----------------
* handshake: :class:`Hello`, :class:`AuthChallenge`, :class:`AuthResponse`, :class:`Welcome`,
  :class:`Refuse` (driven by ``handshake.ClientHandshake`` / ``ServerHandshake``);
* descriptor tables: :class:`RegionsUpdate` (memory registrations a peer may address) and
  :class:`CacheTableUpdate` (caches inside those regions and the lookup keys bound to them),
  both versioned (see ``tables.DescriptorTables``);
* liveness: :class:`Keepalive` / :class:`KeepaliveAck`;
* link teardown: :class:`UnlinkRequest` / :class:`UnlinkAck`;
* owner notifications: :class:`ReadDone` (batched "I finished reading these blocks"),
  :class:`KeyConsumed` (a pulled ``CacheKey`` the owner must remove), :class:`ReleaseKey` (a reserved
  ``CacheKey`` the puller gave up on), :class:`PushDone` (batched untagged pushes ended) and
  :class:`TaggedDone` (a tagged transfer ended, acknowledged), each carrying :class:`TransferDone`;
* generic request/response: :class:`TransferRequest` / :class:`TransferReply`, and :class:`Error`.

Transport descriptors (:class:`TransportDescriptor`, in ``TransportOffer.descriptor`` and
``RegionDescriptor.transports``) are typed: the transport's name, the version of its payload format
and the payload, opaque bytes of at most :data:`MAX_DESCRIPTOR_PAYLOAD`; the control plane's own
facts about an offer (offered ``deferred``, the link's ``capability``) are fields of the offer.
Descriptor dicts (request bodies, host namespaces) hold str, int (-2**63 .. 2**64-1), bytes, bool, float, None, list and dict with str keys, nested at
most :data:`MAX_DESCRIPTOR_DEPTH` deep (the top-level dict counts as 1).  Lists decode as ``list``
(tuples encode as lists).  ``msgspec.structs.replace`` is the way to derive a modified message.
"""

from __future__ import annotations

import enum
import os
from typing import Annotated, Any, Iterable, Optional, Union

import msgspec
from msgspec import Meta
from msgspec.structs import force_setattr

from llmdd._base.enums import LLMRole, Placement
from llmdd._protocol.wire import (
    I64 as I64,
    I64_MAX as I64_MAX,
    I64_MIN as I64_MIN,
    INCARNATION_SIZE as INCARNATION_SIZE,
    MAC_SIZE as MAC_SIZE,
    MAX_COUNT as MAX_COUNT,
    MAX_DESCRIPTOR_DEPTH as MAX_DESCRIPTOR_DEPTH,
    MAX_NAME as MAX_NAME,
    MAX_NOTICE_BATCH as MAX_NOTICE_BATCH,
    MAX_TAG_BYTES as MAX_TAG_BYTES,
    MAX_TEXT as MAX_TEXT,
    NONCE_MAX_SIZE as NONCE_MAX_SIZE,
    NONCE_MIN_SIZE as NONCE_MIN_SIZE,
    U8 as U8,
    U8_MAX as U8_MAX,
    U16 as U16,
    U16_MAX as U16_MAX,
    U32 as U32,
    U32_MAX as U32_MAX,
    U64 as U64,
    U64_MAX as U64_MAX,
    Checked,
    Descriptor,
    Incarnation,
    InvalidMessage,
    InvalidMessageType,
    Mac,
    Name,
    Nonce,
    Text,
    Wire,
    descriptor_dicts as descriptor_dicts,
)
from llmdd._seam.abc import MAX_CAPABILITY_BYTES, MAX_PAYLOAD_BYTES, MAX_TRANSPORT_NAME, MIN_CAPABILITY_BYTES

__all__ = [
    "U8_MAX",
    "U16_MAX",
    "U32_MAX",
    "U64_MAX",
    "I64_MIN",
    "I64_MAX",
    "INCARNATION_SIZE",
    "NONCE_MIN_SIZE",
    "NONCE_MAX_SIZE",
    "MAC_SIZE",
    "MAX_COUNT",
    "MAX_NAME",
    "MAX_TEXT",
    "MAX_DESCRIPTOR_DEPTH",
    "MAX_TAG_BYTES",
    "MAX_NOTICE_BATCH",
    "KeyKind",
    "HostIdentity",
    "TransportDescriptor",
    "TransportOffer",
    "RegionDescriptor",
    "KeyRef",
    "KeyEntry",
    "CacheEntry",
    "Span",
    "ReadDoneEntry",
    "Hello",
    "AuthChallenge",
    "AuthResponse",
    "Welcome",
    "Refuse",
    "RegionsUpdate",
    "CacheTableUpdate",
    "Keepalive",
    "KeepaliveAck",
    "UnlinkRequest",
    "UnlinkAck",
    "ReadDone",
    "KeyConsumed",
    "ReleaseKey",
    "TransferDone",
    "PushDone",
    "TaggedDone",
    "TransferRequest",
    "TransferReply",
    "Error",
    "Message",
    "MESSAGE_CLASSES",
    "descriptor_dicts",
]


MAX_DESCRIPTOR_PAYLOAD = MAX_PAYLOAD_BYTES   # bytes of one transport descriptor's payload (llmdd.abc)
MAX_REGION_TRANSPORTS = 64   # per-transport descriptors of one region
TransportName = Annotated[str, Meta(min_length=1, max_length=MAX_TRANSPORT_NAME)]
Payload = Annotated[bytes, Meta(max_length=MAX_DESCRIPTOR_PAYLOAD)]
Capability = Annotated[bytes, Meta(min_length=MIN_CAPABILITY_BYTES, max_length=MAX_CAPABILITY_BYTES)]

# --------------------------------------------------------------------------- building blocks

class KeyKind(enum.IntEnum):
    """Which kind of lookup key a :class:`KeyRef` is (wire: u8)."""

    REQ = 1      # CacheKey(cluster, req_id, model_id) with prefix_id invalid
    PREFIX = 2   # CacheKey(cluster, req_id=invalid, model_id, prefix_id)
    BLOCKS = 3   # BlocksCacheKey(cluster, model_id)


_BLOCKS = KeyKind.BLOCKS  # (a module constant: an enum attribute lookup costs more than the check)


def _read_first_line(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.readline().strip()
    except OSError:
        return ""


class HostIdentity(Checked, frozen=True, kw_only=True):
    """Who and where a process is, so a peer can tell "same host, same user" without IPs.

    Two processes on 127.0.0.1 in different containers share no boot_id/namespace guarantee,
    so same-host decisions use :meth:`same_host` / :meth:`same_ipc_domain`, never addresses.
    This is a hint for transport choice; a same-host transport still proves access itself.
    """

    boot_id: Name = ""
    machine_id: Name = ""
    uid: I64 = -1
    pid: I64 = 0
    namespaces: Descriptor = {}  # e.g. {"ipc": "ipc:[4026531839]"} (msgspec copies a mutable default)

    @classmethod
    def local(cls) -> "HostIdentity":
        """Identity of this process (Linux /proc; empty strings where unavailable)."""
        namespaces = {}
        for ns in ("ipc", "mnt", "pid", "net", "user"):
            try:
                namespaces[ns] = os.readlink(f"/proc/self/ns/{ns}")
            except OSError:
                pass
        return cls(
            boot_id=_read_first_line("/proc/sys/kernel/random/boot_id"),
            machine_id=_read_first_line("/etc/machine-id"),
            uid=os.getuid() if hasattr(os, "getuid") else -1,
            pid=os.getpid(),
            namespaces=namespaces,
        )

    def same_host(self, other: "HostIdentity") -> bool:
        """Same kernel boot and same machine id (both known)."""
        return bool(self.boot_id) and self.boot_id == other.boot_id and self.machine_id == other.machine_id

    def same_ipc_domain(self, other: "HostIdentity") -> bool:
        """Same host, same user, same IPC and mount namespaces: shared memory can be attached."""
        if not self.same_host(other) or self.uid != other.uid:
            return False
        for ns in ("ipc", "mnt"):
            mine = self.namespaces.get(ns)
            if not mine or mine != other.namespaces.get(ns):
                return False
        return True


class TransportDescriptor(Checked, frozen=True, kw_only=True):
    """A transport's descriptor of an endpoint or a region, as the wire carries it: the transport's
    name, the version of its payload format and the payload (the transport's own bytes, opaque to the
    control plane; :class:`llmdd.abc.EndpointDescriptor` / :class:`llmdd.abc.RegionDescriptor` on the
    seam's side)."""

    transport: TransportName
    version: U32 = 0
    payload: Payload = b""

    def __repr__(self) -> str:
        return f"TransportDescriptor(transport={self.transport!r}, version={self.version}, payload=<{len(self.payload)} bytes>)"


class TransportOffer(Checked, frozen=True, kw_only=True):
    """One transport a side can use: its endpoint's descriptor, or ``deferred`` (offered by name
    only: not probed, no endpoint opened; the descriptor follows in a ``link_descriptor`` request
    when the server picks it), and the data-port ``capability`` the offering side granted the link
    (transports with per-link capabilities; never shown by repr)."""

    name: TransportName
    descriptor: Optional[TransportDescriptor] = None
    deferred: bool = False
    capability: Optional[Capability] = None

    def _check(self) -> None:
        if self.deferred != (self.descriptor is None):
            raise InvalidMessage(f"transport offer {self.name!r}: a descriptor exactly when not deferred")
        if self.descriptor is not None and self.descriptor.transport != self.name:
            raise InvalidMessage(f"transport offer {self.name!r} carries a {self.descriptor.transport!r} descriptor")

    def __repr__(self) -> str:
        cap = "None" if self.capability is None else "<redacted>"
        return (f"TransportOffer(name={self.name!r}, descriptor={self.descriptor!r}, deferred={self.deferred}, "
                f"capability={cap})")


class RegionDescriptor(Checked, frozen=True, kw_only=True):
    """A memory registration a peer may address (a pool segment or a registered tensor)."""

    region_id: U32
    cache_id: I64  # owning cache, or -1 for a pool segment
    addr: U64
    size: U64
    placement: Placement = Placement.HOST
    remote_accessible: bool = True
    # one descriptor per transport the owner registered the region with (distinct transport names)
    transports: Annotated[tuple[TransportDescriptor, ...], Meta(max_length=MAX_REGION_TRANSPORTS)] = ()

    def _check(self) -> None:
        if len({d.transport for d in self.transports}) != len(self.transports):
            raise InvalidMessage(f"region {self.region_id}: two descriptors of one transport")

    def transport(self, name: str) -> Optional[TransportDescriptor]:
        """The descriptor of transport ``name``, or None."""
        for d in self.transports:
            if d.transport == name:
                return d
        return None

    @property
    def end(self) -> int:
        return self.addr + self.size

    def contains(self, addr: int, length: int) -> bool:
        """Whether ``[addr, addr + length)`` lies inside this region (overflow-safe: Python ints)."""
        return length >= 0 and self.addr <= addr and addr + length <= self.addr + self.size


class KeyRef(Wire, frozen=True, kw_only=True, gc=False):
    """A lookup key as the owner indexes it; the owner's cluster id is implied by the link.

    Hot (one per keyed entry of a peer-read notice): construction converts ``kind`` to
    :class:`KeyKind` and checks the BLOCKS rule only; the typed decoder checks the ranges of a
    peer's key, and the encoder (every message but ReadDone) re-checks a local one."""

    kind: KeyKind
    model_id: int = 0   # -2**63 .. 2**64-1
    id: U64 = 0         # req_id or prefix_id; 0 for BLOCKS

    def __post_init__(self) -> None:
        kind = self.kind
        if kind.__class__ is not KeyKind:
            if isinstance(kind, bool) or not isinstance(kind, int):
                raise InvalidMessageType(f"kind must be a KeyKind, got {type(kind).__name__}")
            try:
                kind = KeyKind(kind)
            except ValueError:
                raise InvalidMessage(f"kind: {kind} is not a KeyKind") from None
            force_setattr(self, "kind", kind)
        if self.id and kind is _BLOCKS:
            raise InvalidMessage("a BLOCKS key carries no req/prefix id (id must be 0)")

    @classmethod
    def for_req(cls, req_id: int, model_id: int = 0) -> "KeyRef":
        return cls(kind=KeyKind.REQ, id=req_id, model_id=model_id)

    @classmethod
    def for_prefix(cls, prefix_id: int, model_id: int = 0) -> "KeyRef":
        return cls(kind=KeyKind.PREFIX, id=prefix_id, model_id=model_id)

    @classmethod
    def for_blocks(cls, model_id: int = 0) -> "KeyRef":
        return cls(kind=KeyKind.BLOCKS, model_id=model_id)


class KeyEntry(Checked, frozen=True, kw_only=True):
    """``key`` resolves to batch ``batch_index`` of cache ``cache_id`` (BLOCKS keys: the whole cache)."""

    key: KeyRef
    cache_id: I64
    batch_index: U32 = 0


class CacheEntry(Checked, frozen=True, kw_only=True):
    """Layout of one remote cache: one address per tensor, each ``tensor_size`` bytes.

    ``shape`` is the per-tensor shape (``shape[0]`` = batch size, or number of blocks when
    ``is_blocks``); ``data_type`` is the ``DataType`` value.  The addresses lie inside regions
    announced by :class:`RegionsUpdate`; a puller checks that before touching them.
    """

    cache_id: I64
    addrs: Annotated[tuple[U64, ...], Meta(max_length=MAX_COUNT)]
    tensor_size: U64
    shape: Annotated[tuple[I64, ...], Meta(max_length=64)]
    data_type: U16 = 0
    placement: Placement = Placement.HOST
    is_blocks: bool = False


class Span(Wire, frozen=True, kw_only=True, gc=False):
    """Half-open index range ``[start, stop)`` (blocks, tensors).

    Hot: no construction check (see the module docstring); the owner checks ``start <= stop``
    and both against its table when it uses a peer's span."""

    start: U64
    stop: U64

    def __len__(self) -> int:
        return self.stop - self.start


class ReadDoneEntry(Wire, frozen=True, kw_only=True, gc=False):
    """A peer finished reading ``cache_id``: the batch of ``key`` (if any) and/or these blocks.

    ``block_bounds`` holds the block spans flattened, ``(start0, stop0, start1, stop1, ...)``: a
    notice of 256 entries x 8 spans decodes about twice as fast as with one :class:`Span` object per
    span, the notice being the control path's bulk message (issue 22, target 4;
    bench/control_codec.py).  :meth:`from_spans` builds an entry from spans, :attr:`block_spans`
    gives them back.  The owner checks that the count is even and every span's order and position
    against its own table (``llmdd._data.peer_input.peer_bounds``)."""

    cache_id: I64
    key: Optional[KeyRef] = None
    block_bounds: Annotated[tuple[U64, ...], Meta(max_length=2 * MAX_COUNT)] = ()

    @classmethod
    def from_spans(cls, *, cache_id: int, key: Optional[KeyRef] = None, block_spans: Iterable[range] = ()) -> "ReadDoneEntry":
        return cls(cache_id=cache_id, key=key, block_bounds=tuple(x for s in block_spans for x in (s.start, s.stop)))

    @property
    def block_spans(self) -> tuple:
        """The spans as :class:`Span` objects (a trailing odd bound, which the owner refuses, is left out)."""
        b = self.block_bounds
        return tuple(Span(start=b[i], stop=b[i + 1]) for i in range(0, len(b) - 1, 2))


# --------------------------------------------------------------------------- handshake messages

class Hello(Checked, frozen=True, kw_only=True):
    """Client's opening message: versions, identity, transports offered, auth nonce."""

    min_version: U16
    max_version: U16
    cluster_id: U64
    incarnation: Incarnation
    role: LLMRole
    transports: Annotated[tuple[TransportOffer, ...], Meta(max_length=256)] = ()
    host: HostIdentity = msgspec.field(default_factory=HostIdentity)
    nonce: Nonce

    def _check(self) -> None:
        if self.max_version < self.min_version:
            raise InvalidMessage(f"max_version {self.max_version} < min_version {self.min_version}")


class AuthChallenge(Checked, frozen=True, kw_only=True):
    """Server demands proof of the shared secret; carries its nonce and incarnation (nothing else)."""

    nonce: Nonce
    incarnation: Incarnation


class AuthResponse(Checked, frozen=True, kw_only=True):
    """Client's HMAC-SHA256 over both nonces, both incarnations and its Hello."""

    mac: Mac


class Welcome(Checked, frozen=True, kw_only=True):
    """Server accepts: negotiated version, its identity, the chosen transport.

    ``proof`` is the server's HMAC (mutual authentication) when a challenge took place, else b"".
    """

    version: U16
    cluster_id: U64
    incarnation: Incarnation
    role: LLMRole
    transport: TransportOffer
    host: HostIdentity = msgspec.field(default_factory=HostIdentity)
    proof: Annotated[bytes, Meta(max_length=MAC_SIZE)] = b""

    def _check(self) -> None:
        if len(self.proof) not in (0, MAC_SIZE):
            raise InvalidMessage(f"proof must be empty or {MAC_SIZE} bytes")


class Refuse(Checked, frozen=True, kw_only=True):
    """Either side ends the handshake: an ``LLMStatusCode`` value and a reason (no secrets, no tables)."""

    status_code: I64
    reason: Text = ""


# --------------------------------------------------------------------------- descriptor tables

class RegionsUpdate(Checked, frozen=True, kw_only=True):
    """Versioned update of the sender's region table.

    ``full=True`` replaces the table (any version newer than the last); a delta must carry
    exactly ``last + 1``.  Removals apply before additions.
    """

    version: U64
    full: bool = False
    added: Annotated[tuple[RegionDescriptor, ...], Meta(max_length=MAX_COUNT)] = ()
    removed: Annotated[tuple[U32, ...], Meta(max_length=MAX_COUNT)] = ()


class CacheTableUpdate(Checked, frozen=True, kw_only=True):
    """Versioned update of the sender's cache layouts and key index (same version rules as regions).

    The puller resolves ``CacheKeyByIdAndIndex`` through ``caches`` (by cache_id), ``CacheKey``
    through a REQ/PREFIX :class:`KeyEntry` and ``BlocksCacheKey`` through a BLOCKS entry.
    """

    version: U64
    full: bool = False
    caches_added: Annotated[tuple[CacheEntry, ...], Meta(max_length=MAX_COUNT)] = ()
    caches_removed: Annotated[tuple[I64, ...], Meta(max_length=MAX_COUNT)] = ()
    keys_added: Annotated[tuple[KeyEntry, ...], Meta(max_length=MAX_COUNT)] = ()
    keys_removed: Annotated[tuple[KeyRef, ...], Meta(max_length=MAX_COUNT)] = ()


# --------------------------------------------------------------------------- liveness, teardown

class Keepalive(Checked, frozen=True, kw_only=True):
    seq: U64
    sent_at_ns: U64  # sender's monotonic clock


class KeepaliveAck(Checked, frozen=True, kw_only=True):
    seq: U64
    echo_sent_at_ns: U64  # the Keepalive's sent_at_ns (RTT on the sender)
    sent_at_ns: U64       # acker's monotonic clock


class UnlinkRequest(Checked, frozen=True, kw_only=True):
    request_id: U64
    force: bool = False
    reason: Text = ""


class UnlinkAck(Checked, frozen=True, kw_only=True):
    request_id: U64
    status_code: I64 = 0


# --------------------------------------------------------------------------- owner notifications

class ReadDone(Wire, frozen=True, kw_only=True, gc=False):
    """Batched: the sender finished reading these caches/blocks (the owner may free them)."""

    entries: Annotated[tuple[ReadDoneEntry, ...], Meta(max_length=MAX_COUNT)] = ()


class KeyConsumed(Checked, frozen=True, kw_only=True):
    """A ``CacheKey`` was pulled: the owner removes it once every tensor span has been read."""

    key: KeyRef
    cache_id: I64
    tensor_spans: Annotated[tuple[Span, ...], Meta(max_length=MAX_COUNT)] = ()


class ReleaseKey(Checked, frozen=True, kw_only=True):
    """A puller gave up on a ``CacheKey`` it reserved: the owner puts the key back (one-way).

    ``id`` and ``model_id`` are the key's lookup index on the owner (``req_id`` or ``prefix_id``,
    and ``model_id``); a release of a key this link does not hold is benign and changes nothing."""

    id: U64
    model_id: U64


class TransferDone(Checked, frozen=True, kw_only=True):
    """One transfer of a peer on one of the owner's caches ended: the owner's "peer finished
    reading" (pull) or "peer finished writing" (push) cache event, once per transfer.

    ``block_spans`` and ``tensors`` are checked by the owner against that cache's own table before
    any work (``llmdd._data.peer_input``); ``tag`` is the transfer's opaque tag (``tag_str``: it was given
    as text), absent for an untagged transfer."""

    cache_id: I64
    block_spans: Annotated[tuple[Span, ...], Meta(max_length=MAX_COUNT)] = ()
    tensors: Optional[Span] = None
    failed: bool = False
    status: U32 = 0
    tag: Optional[Annotated[bytes, Meta(max_length=MAX_TAG_BYTES)]] = None
    tag_str: bool = False

    def _check(self) -> None:
        if self.tag is None and self.tag_str:
            raise InvalidMessage("tag_str without a tag")


class PushDone(Checked, frozen=True, kw_only=True):
    """Untagged pushes ended (one-way, batched in push order): one "peer finished writing" event each."""

    entries: Annotated[tuple[TransferDone, ...], Meta(max_length=MAX_NOTICE_BATCH)]


class TaggedDone(Checked, frozen=True, kw_only=True):
    """A tagged transfer ended (acknowledged by a :class:`TransferReply` with the same ``request_id``):
    the owner fires its cache event with the tag once; ``push`` tells a push from a pull."""

    request_id: U64
    push: bool
    entry: TransferDone

    def _check(self) -> None:
        if self.entry.tag is None:
            raise InvalidMessage("a TaggedDone needs a tagged entry")

    @property
    def op(self) -> str:
        """``"push_done"`` or ``"read_done"`` (how hooks and fault plans name it: ``TaggedDone:read_done``)."""
        return "push_done" if self.push else "read_done"


# --------------------------------------------------------------------------- generic envelope

class TransferRequest(Checked, frozen=True, kw_only=True):
    """An operation needing the owner's help (e.g. a mediated tcp op, a push notification)."""

    request_id: U64
    op: Name
    args: Descriptor = {}


class TransferReply(Checked, frozen=True, kw_only=True):
    request_id: U64
    status_code: I64 = 0
    result: Descriptor = {}


class Error(Checked, frozen=True, kw_only=True):
    """The sender hit an error it wants the peer to know about; ``fatal`` closes the link."""

    status_code: I64
    message: Text = ""
    fatal: bool = False


Message = Union[
    Hello, AuthChallenge, AuthResponse, Welcome, Refuse, RegionsUpdate, CacheTableUpdate,
    Keepalive, KeepaliveAck, UnlinkRequest, UnlinkAck, ReadDone, KeyConsumed, ReleaseKey, PushDone,
    TaggedDone, TransferRequest, TransferReply, Error,
]

MESSAGE_CLASSES = (
    Hello, AuthChallenge, AuthResponse, Welcome, Refuse, RegionsUpdate, CacheTableUpdate,
    Keepalive, KeepaliveAck, UnlinkRequest, UnlinkAck, ReadDone, KeyConsumed, ReleaseKey, PushDone,
    TaggedDone, TransferRequest, TransferReply, Error,
)
