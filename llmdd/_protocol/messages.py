"""Typed control-plane messages of llmdd (value types only; the wire format lives in ``codec``).

Every message is a frozen attrs class whose validators enforce the ranges the codec can carry
(u8/u16/u32/u64/i64, bounded byte strings), so an instance that constructs is an instance that
encodes, and a decoded frame that fails a validator is a ``ProtocolError``, never a half-built
object.  Nothing here is ever pickled.

Message families
----------------
* handshake: :class:`Hello`, :class:`AuthChallenge`, :class:`AuthResponse`, :class:`Welcome`,
  :class:`Refuse` (driven by ``handshake.ClientHandshake`` / ``ServerHandshake``);
* descriptor tables: :class:`RegionsUpdate` (memory registrations a peer may address) and
  :class:`CacheTableUpdate` (caches inside those regions and the lookup keys bound to them),
  both versioned (see ``handshake.PeerTables``);
* liveness: :class:`Keepalive` / :class:`KeepaliveAck`;
* link teardown: :class:`UnlinkRequest` / :class:`UnlinkAck`;
* owner notifications: :class:`ReadDone` (batched "I finished reading these blocks"),
  :class:`KeyConsumed` (a pulled ``CacheKey`` the owner must remove);
* generic request/response: :class:`TransferRequest` / :class:`TransferReply`, and :class:`Error`.

Descriptor dicts (``TransportOffer.descriptor``, ``RegionDescriptor.transports``, request bodies)
hold str, int (-2**63 .. 2**64-1), bytes, bool, float, None, list and dict with str keys; the
codec bounds their depth, counts and lengths.  Lists decode as ``list`` (tuples encode as lists).
"""

from __future__ import annotations

import enum
import os
from typing import Any, Optional, Union

import attrs

from .._enums import LLMRole, Placement

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
    "KeyKind",
    "HostIdentity",
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
    "TransferRequest",
    "TransferReply",
    "Error",
    "Message",
    "MESSAGE_CLASSES",
]

U8_MAX = 2**8 - 1
U16_MAX = 2**16 - 1
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
I64_MIN = -(2**63)
I64_MAX = 2**63 - 1

INCARNATION_SIZE = 16
NONCE_MIN_SIZE = 16
NONCE_MAX_SIZE = 64
MAC_SIZE = 32  # HMAC-SHA256


# --------------------------------------------------------------------------- validators

def _int_in(lo: int, hi: int):
    def check(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{attribute.name} must be an int, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise ValueError(f"{attribute.name} out of range [{lo}, {hi}]: {value}")

    return check


_u8 = _int_in(0, U8_MAX)
_u16 = _int_in(0, U16_MAX)
_u32 = _int_in(0, U32_MAX)
_u64 = _int_in(0, U64_MAX)
_i64 = _int_in(I64_MIN, I64_MAX)
_any64 = _int_in(I64_MIN, U64_MAX)  # BlocksCacheKey.model_id is only checked to be an int upstream


def _bytes_len(lo: int, hi: int):
    def check(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, bytes):
            raise TypeError(f"{attribute.name} must be bytes, got {type(value).__name__}")
        if not lo <= len(value) <= hi:
            raise ValueError(f"{attribute.name} must be {lo}..{hi} bytes long, got {len(value)}")

    return check


def _str_dict(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, dict):
        raise TypeError(f"{attribute.name} must be a dict, got {type(value).__name__}")
    for k in value:
        if not isinstance(k, str):
            raise TypeError(f"{attribute.name} keys must be str, got {type(k).__name__}")


def _tuple_of(cls: type, elem_check=None):
    member = attrs.validators.instance_of(cls) if elem_check is None else elem_check
    return attrs.validators.deep_iterable(member_validator=member,
                                          iterable_validator=attrs.validators.instance_of(tuple))


_str = attrs.validators.instance_of(str)
_bool = attrs.validators.instance_of(bool)
_float = attrs.validators.instance_of(float)


# --------------------------------------------------------------------------- building blocks

class KeyKind(enum.IntEnum):
    """Which kind of lookup key a :class:`KeyRef` is (wire: u8)."""

    REQ = 1      # CacheKey(cluster, req_id, model_id) with prefix_id invalid
    PREFIX = 2   # CacheKey(cluster, req_id=invalid, model_id, prefix_id)
    BLOCKS = 3   # BlocksCacheKey(cluster, model_id)


def _read_first_line(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.readline().strip()
    except OSError:
        return ""


@attrs.frozen(kw_only=True)
class HostIdentity:
    """Who and where a process is, so a peer can tell "same host, same user" without IPs.

    Two processes on 127.0.0.1 in different containers share no boot_id/namespace guarantee,
    so same-host decisions use :meth:`same_host` / :meth:`same_ipc_domain`, never addresses.
    This is a hint for transport choice; a same-host transport still proves access itself.
    """

    boot_id: str = attrs.field(default="", validator=_str)
    machine_id: str = attrs.field(default="", validator=_str)
    uid: int = attrs.field(default=-1, validator=_i64)
    pid: int = attrs.field(default=0, validator=_i64)
    namespaces: dict = attrs.field(factory=dict, validator=_str_dict)  # e.g. {"ipc": "ipc:[4026531839]"}

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


def _redacted(descriptor: dict) -> str:
    """A descriptor's repr without the data-port capability it may carry (llmdd.abc.CAPABILITY_KEY)."""
    return repr({k: ("<redacted>" if k == "capability" else v) for k, v in descriptor.items()})


@attrs.frozen(kw_only=True)
class TransportOffer:
    """One transport a side can use, with what the peer needs to reach it (address, segment...)."""

    name: str = attrs.field(validator=_str)
    descriptor: dict = attrs.field(factory=dict, validator=_str_dict, repr=_redacted)


@attrs.frozen(kw_only=True)
class RegionDescriptor:
    """A memory registration a peer may address (a pool segment or a registered tensor)."""

    region_id: int = attrs.field(validator=_u32)
    cache_id: int = attrs.field(validator=_i64)  # owning cache, or -1 for a pool segment
    addr: int = attrs.field(validator=_u64)
    size: int = attrs.field(validator=_u64)
    placement: Placement = attrs.field(converter=Placement, default=Placement.HOST)
    remote_accessible: bool = attrs.field(default=True, validator=_bool)
    transports: dict = attrs.field(factory=dict, validator=_str_dict)  # per-transport descriptor

    @property
    def end(self) -> int:
        return self.addr + self.size

    def contains(self, addr: int, length: int) -> bool:
        """Whether ``[addr, addr + length)`` lies inside this region (overflow-safe: Python ints)."""
        return length >= 0 and self.addr <= addr and addr + length <= self.addr + self.size


@attrs.frozen(kw_only=True)
class KeyRef:
    """A lookup key as the owner indexes it; the owner's cluster id is implied by the link."""

    kind: KeyKind = attrs.field(converter=KeyKind)
    model_id: int = attrs.field(default=0, validator=_any64)
    id: int = attrs.field(default=0, validator=_u64)  # req_id or prefix_id; 0 for BLOCKS

    @classmethod
    def for_req(cls, req_id: int, model_id: int = 0) -> "KeyRef":
        return cls(kind=KeyKind.REQ, id=req_id, model_id=model_id)

    @classmethod
    def for_prefix(cls, prefix_id: int, model_id: int = 0) -> "KeyRef":
        return cls(kind=KeyKind.PREFIX, id=prefix_id, model_id=model_id)

    @classmethod
    def for_blocks(cls, model_id: int = 0) -> "KeyRef":
        return cls(kind=KeyKind.BLOCKS, model_id=model_id)

    @id.validator
    def _check_id(self, _attribute: attrs.Attribute, value: int) -> None:
        if self.kind is KeyKind.BLOCKS and value != 0:
            raise ValueError("a BLOCKS key carries no req/prefix id (id must be 0)")


@attrs.frozen(kw_only=True)
class KeyEntry:
    """``key`` resolves to batch ``batch_index`` of cache ``cache_id`` (BLOCKS keys: the whole cache)."""

    key: KeyRef = attrs.field(validator=attrs.validators.instance_of(KeyRef))
    cache_id: int = attrs.field(validator=_i64)
    batch_index: int = attrs.field(default=0, validator=_u32)


@attrs.frozen(kw_only=True)
class CacheEntry:
    """Layout of one remote cache: one address per tensor, each ``tensor_size`` bytes.

    ``shape`` is the per-tensor shape (``shape[0]`` = batch size, or number of blocks when
    ``is_blocks``); ``data_type`` is the ``DataType`` value.  The addresses lie inside regions
    announced by :class:`RegionsUpdate`; a puller checks that before touching them.
    """

    cache_id: int = attrs.field(validator=_i64)
    addrs: tuple = attrs.field(converter=tuple, validator=_tuple_of(int, _u64))
    tensor_size: int = attrs.field(validator=_u64)
    shape: tuple = attrs.field(converter=tuple, validator=_tuple_of(int, _i64))
    data_type: int = attrs.field(default=0, validator=_u16)
    placement: Placement = attrs.field(converter=Placement, default=Placement.HOST)
    is_blocks: bool = attrs.field(default=False, validator=_bool)


@attrs.frozen(kw_only=True)
class Span:
    """Half-open index range ``[start, stop)`` (blocks, tensors)."""

    start: int = attrs.field(validator=_u64)
    stop: int = attrs.field(validator=_u64)

    @stop.validator
    def _check_stop(self, _attribute: attrs.Attribute, value: int) -> None:
        if value < self.start:
            raise ValueError(f"span stop {value} < start {self.start}")

    def __len__(self) -> int:
        return self.stop - self.start


@attrs.frozen(kw_only=True)
class ReadDoneEntry:
    """A peer finished reading ``cache_id``: the batch of ``key`` (if any) and/or these block spans."""

    cache_id: int = attrs.field(validator=_i64)
    key: Optional[KeyRef] = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(KeyRef)))
    block_spans: tuple = attrs.field(default=(), converter=tuple, validator=_tuple_of(Span))


# --------------------------------------------------------------------------- handshake messages

def _role_converter(value: Any) -> LLMRole:
    return LLMRole(value)


@attrs.frozen(kw_only=True)
class Hello:
    """Client's opening message: versions, identity, transports offered, auth nonce."""

    min_version: int = attrs.field(validator=_u16)
    max_version: int = attrs.field(validator=_u16)
    cluster_id: int = attrs.field(validator=_u64)
    incarnation: bytes = attrs.field(validator=_bytes_len(INCARNATION_SIZE, INCARNATION_SIZE))
    role: LLMRole = attrs.field(converter=_role_converter)
    transports: tuple = attrs.field(default=(), converter=tuple, validator=_tuple_of(TransportOffer))
    host: HostIdentity = attrs.field(factory=HostIdentity, validator=attrs.validators.instance_of(HostIdentity))
    nonce: bytes = attrs.field(validator=_bytes_len(NONCE_MIN_SIZE, NONCE_MAX_SIZE))

    @max_version.validator
    def _check_range(self, _attribute: attrs.Attribute, value: int) -> None:
        if value < self.min_version:
            raise ValueError(f"max_version {value} < min_version {self.min_version}")


@attrs.frozen(kw_only=True)
class AuthChallenge:
    """Server demands proof of the shared secret; carries its nonce and incarnation (nothing else)."""

    nonce: bytes = attrs.field(validator=_bytes_len(NONCE_MIN_SIZE, NONCE_MAX_SIZE))
    incarnation: bytes = attrs.field(validator=_bytes_len(INCARNATION_SIZE, INCARNATION_SIZE))


@attrs.frozen(kw_only=True)
class AuthResponse:
    """Client's HMAC-SHA256 over both nonces, both incarnations and its Hello."""

    mac: bytes = attrs.field(validator=_bytes_len(MAC_SIZE, MAC_SIZE))


@attrs.frozen(kw_only=True)
class Welcome:
    """Server accepts: negotiated version, its identity, the chosen transport.

    ``proof`` is the server's HMAC (mutual authentication) when a challenge took place, else b"".
    """

    version: int = attrs.field(validator=_u16)
    cluster_id: int = attrs.field(validator=_u64)
    incarnation: bytes = attrs.field(validator=_bytes_len(INCARNATION_SIZE, INCARNATION_SIZE))
    role: LLMRole = attrs.field(converter=_role_converter)
    transport: TransportOffer = attrs.field(validator=attrs.validators.instance_of(TransportOffer))
    host: HostIdentity = attrs.field(factory=HostIdentity, validator=attrs.validators.instance_of(HostIdentity))
    proof: bytes = attrs.field(default=b"", validator=_bytes_len(0, MAC_SIZE))

    @proof.validator
    def _check_proof(self, _attribute: attrs.Attribute, value: bytes) -> None:
        if len(value) not in (0, MAC_SIZE):
            raise ValueError(f"proof must be empty or {MAC_SIZE} bytes")


@attrs.frozen(kw_only=True)
class Refuse:
    """Either side ends the handshake: an ``LLMStatusCode`` value and a reason (no secrets, no tables)."""

    status_code: int = attrs.field(validator=_i64)
    reason: str = attrs.field(default="", validator=_str)


# --------------------------------------------------------------------------- descriptor tables

@attrs.frozen(kw_only=True)
class RegionsUpdate:
    """Versioned update of the sender's region table.

    ``full=True`` replaces the table (any version newer than the last); a delta must carry
    exactly ``last + 1``.  Removals apply before additions.
    """

    version: int = attrs.field(validator=_u64)
    full: bool = attrs.field(default=False, validator=_bool)
    added: tuple = attrs.field(default=(), converter=tuple, validator=_tuple_of(RegionDescriptor))
    removed: tuple = attrs.field(default=(), converter=tuple, validator=_tuple_of(int, _u32))


@attrs.frozen(kw_only=True)
class CacheTableUpdate:
    """Versioned update of the sender's cache layouts and key index (same version rules as regions).

    The puller resolves ``CacheKeyByIdAndIndex`` through ``caches`` (by cache_id), ``CacheKey``
    through a REQ/PREFIX :class:`KeyEntry` and ``BlocksCacheKey`` through a BLOCKS entry.
    """

    version: int = attrs.field(validator=_u64)
    full: bool = attrs.field(default=False, validator=_bool)
    caches_added: tuple = attrs.field(default=(), converter=tuple, validator=_tuple_of(CacheEntry))
    caches_removed: tuple = attrs.field(default=(), converter=tuple, validator=_tuple_of(int, _i64))
    keys_added: tuple = attrs.field(default=(), converter=tuple, validator=_tuple_of(KeyEntry))
    keys_removed: tuple = attrs.field(default=(), converter=tuple, validator=_tuple_of(KeyRef))


# --------------------------------------------------------------------------- liveness, teardown

@attrs.frozen(kw_only=True)
class Keepalive:
    seq: int = attrs.field(validator=_u64)
    sent_at_ns: int = attrs.field(validator=_u64)  # sender's monotonic clock


@attrs.frozen(kw_only=True)
class KeepaliveAck:
    seq: int = attrs.field(validator=_u64)
    echo_sent_at_ns: int = attrs.field(validator=_u64)  # the Keepalive's sent_at_ns (RTT on the sender)
    sent_at_ns: int = attrs.field(validator=_u64)       # acker's monotonic clock


@attrs.frozen(kw_only=True)
class UnlinkRequest:
    request_id: int = attrs.field(validator=_u64)
    force: bool = attrs.field(default=False, validator=_bool)
    reason: str = attrs.field(default="", validator=_str)


@attrs.frozen(kw_only=True)
class UnlinkAck:
    request_id: int = attrs.field(validator=_u64)
    status_code: int = attrs.field(default=0, validator=_i64)


# --------------------------------------------------------------------------- owner notifications

@attrs.frozen(kw_only=True)
class ReadDone:
    """Batched: the sender finished reading these caches/blocks (the owner may free them)."""

    entries: tuple = attrs.field(default=(), converter=tuple, validator=_tuple_of(ReadDoneEntry))


@attrs.frozen(kw_only=True)
class KeyConsumed:
    """A ``CacheKey`` was pulled: the owner removes it once every tensor span has been read."""

    key: KeyRef = attrs.field(validator=attrs.validators.instance_of(KeyRef))
    cache_id: int = attrs.field(validator=_i64)
    tensor_spans: tuple = attrs.field(default=(), converter=tuple, validator=_tuple_of(Span))


# --------------------------------------------------------------------------- generic envelope

@attrs.frozen(kw_only=True)
class TransferRequest:
    """An operation needing the owner's help (e.g. a mediated tcp op, a push notification)."""

    request_id: int = attrs.field(validator=_u64)
    op: str = attrs.field(validator=_str)
    args: dict = attrs.field(factory=dict, validator=_str_dict)


@attrs.frozen(kw_only=True)
class TransferReply:
    request_id: int = attrs.field(validator=_u64)
    status_code: int = attrs.field(default=0, validator=_i64)
    result: dict = attrs.field(factory=dict, validator=_str_dict)


@attrs.frozen(kw_only=True)
class Error:
    """The sender hit an error it wants the peer to know about; ``fatal`` closes the link."""

    status_code: int = attrs.field(validator=_i64)
    message: str = attrs.field(default="", validator=_str)
    fatal: bool = attrs.field(default=False, validator=_bool)


Message = Union[
    Hello, AuthChallenge, AuthResponse, Welcome, Refuse, RegionsUpdate, CacheTableUpdate,
    Keepalive, KeepaliveAck, UnlinkRequest, UnlinkAck, ReadDone, KeyConsumed,
    TransferRequest, TransferReply, Error,
]

MESSAGE_CLASSES = (
    Hello, AuthChallenge, AuthResponse, Welcome, Refuse, RegionsUpdate, CacheTableUpdate,
    Keepalive, KeepaliveAck, UnlinkRequest, UnlinkAck, ReadDone, KeyConsumed,
    TransferRequest, TransferReply, Error,
)
