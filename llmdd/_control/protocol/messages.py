"""Typed control-plane messages of llmdd (value types only; the wire format lives in ``codec``).

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
  both versioned (see ``handshake.PeerTables``);
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
import typing
from typing import Annotated, Any, Optional, Union

import attrs
import msgspec
from msgspec import Meta
from msgspec.structs import force_setattr

from llmdd._base.enums import LLMRole, Placement
from llmdd._base.status import LLMStatusCode, LocalUsageError
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
MAX_COUNT = 1 << 20          # elements in any one list / dict
MAX_NAME = 4096              # characters in a name (host ids, transport names, request ops)
MAX_TEXT = 64 * 1024         # characters in a reason / error message
MAX_DESCRIPTOR_DEPTH = 16    # nesting of a descriptor dict (the top-level dict counts as 1)
MAX_TAG_BYTES = 256          # a transfer's tag (the connector extensions' opaque request id)
MAX_NOTICE_BATCH = 1024      # transfer-done notices in one PushDone
MAX_DESCRIPTOR_PAYLOAD = MAX_PAYLOAD_BYTES   # bytes of one transport descriptor's payload (llmdd.abc)
MAX_REGION_TRANSPORTS = 64   # per-transport descriptors of one region


# --------------------------------------------------------------------------- wire field types
# The typed decoder enforces these in C.  msgspec cannot state an upper bound beyond int64, and
# MessagePack carries no integer above 2**64-1, so u64 is "ge=0"; an unconstrained int is the full
# wire range -2**63 .. 2**64-1 (BlocksCacheKey.model_id is only checked to be an int upstream).

U8 = Annotated[int, Meta(ge=0, le=U8_MAX)]
U16 = Annotated[int, Meta(ge=0, le=U16_MAX)]
U32 = Annotated[int, Meta(ge=0, le=U32_MAX)]
U64 = Annotated[int, Meta(ge=0)]
I64 = Annotated[int, Meta(ge=I64_MIN, le=I64_MAX)]
Name = Annotated[str, Meta(max_length=MAX_NAME)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
Incarnation = Annotated[bytes, Meta(min_length=INCARNATION_SIZE, max_length=INCARNATION_SIZE)]
Nonce = Annotated[bytes, Meta(min_length=NONCE_MIN_SIZE, max_length=NONCE_MAX_SIZE)]
Mac = Annotated[bytes, Meta(min_length=MAC_SIZE, max_length=MAC_SIZE)]
Descriptor = dict[str, Any]
TransportName = Annotated[str, Meta(min_length=1, max_length=MAX_TRANSPORT_NAME)]
Payload = Annotated[bytes, Meta(max_length=MAX_DESCRIPTOR_PAYLOAD)]
Capability = Annotated[bytes, Meta(min_length=MIN_CAPABILITY_BYTES, max_length=MAX_CAPABILITY_BYTES)]


# --------------------------------------------------------------------------- attrs validators
# (for the attrs classes beside the messages, e.g. handshake.HandshakeConfig)

def _int_in(lo: int, hi: int):
    def check(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidMessageType(f"{attribute.name} must be an int, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise InvalidMessage(f"{attribute.name} out of range [{lo}, {hi}]: {value}")

    return check


_u16 = _int_in(0, U16_MAX)
_u64 = _int_in(0, U64_MAX)


def _bytes_len(lo: int, hi: int):
    def check(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, bytes):
            raise InvalidMessageType(f"{attribute.name} must be bytes, got {type(value).__name__}")
        if not lo <= len(value) <= hi:
            raise InvalidMessage(f"{attribute.name} must be {lo}..{hi} bytes long, got {len(value)}")

    return check


def _tuple_of(cls: type, elem_check=None):
    member = attrs.validators.instance_of(cls) if elem_check is None else elem_check
    return attrs.validators.deep_iterable(member_validator=member,
                                          iterable_validator=attrs.validators.instance_of(tuple))


# --------------------------------------------------------------------------- construction checks

class InvalidMessage(LocalUsageError, ValueError):
    """A message built with a value the wire cannot carry (``LLM_PARAM_INVALID``; also a ValueError,
    which is what msgspec turns into a ValidationError, hence a ProtocolError, while decoding)."""

    def __init__(self, *args: Any, status_code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID) -> None:
        super().__init__(*args, status_code=status_code)


class InvalidMessageType(InvalidMessage, TypeError):
    """A message built with a value of the wrong type (see :class:`InvalidMessage`)."""


def check_descriptor(value: Any, name: str, depth: int = 1, max_depth: int = MAX_DESCRIPTOR_DEPTH) -> None:
    """A descriptor dict: str keys, the value types the wire carries, at most ``max_depth`` deep and
    :data:`MAX_COUNT` entries per container (ValueError/TypeError otherwise)."""
    if type(value) is not dict:
        raise InvalidMessageType(f"{name} must be a dict, got {type(value).__name__}")
    if depth > max_depth:
        raise InvalidMessage(f"{name}: descriptor nesting deeper than {max_depth}")
    if len(value) > MAX_COUNT:
        raise InvalidMessage(f"{name}: {len(value)} entries exceed {MAX_COUNT}")
    for k, v in value.items():
        if type(k) is not str:
            raise InvalidMessageType(f"{name} keys must be str, got {type(k).__name__}")
        _check_value(v, name, depth, max_depth)


def _check_value(v: Any, name: str, depth: int, max_depth: int) -> None:
    t = type(v)
    if v is None or t is bool or t is float or t is str or t is bytes:
        return
    if t is int:
        if not I64_MIN <= v <= U64_MAX:
            raise InvalidMessage(f"{name}: integer {v} outside the 64-bit range")
        return
    if t is dict:
        check_descriptor(v, name, depth + 1, max_depth)
        return
    if t is list or t is tuple:
        if depth + 1 > max_depth:
            raise InvalidMessage(f"{name}: descriptor nesting deeper than {max_depth}")
        if len(v) > MAX_COUNT:
            raise InvalidMessage(f"{name}: {len(v)} elements exceed {MAX_COUNT}")
        for item in v:
            _check_value(item, name, depth + 1, max_depth)
        return
    if t is bytearray or t is memoryview:
        return
    raise InvalidMessageType(f"{name}: descriptor values cannot be {t.__name__}")


def _meta_of(tp: Any) -> tuple[Any, Any]:
    """(base type, msgspec.Meta or None) of an annotation."""
    if getattr(tp, "__metadata__", None):
        metas = [x for x in tp.__metadata__ if isinstance(x, Meta)]
        return tp.__origin__, (metas[0] if metas else None)
    return tp, None


def _compile(tp: Any):
    """A checker ``(value, name) -> value`` (possibly converted) for one field annotation."""
    base, meta = _meta_of(tp)
    origin = getattr(base, "__origin__", None)
    if base is int:
        lo = I64_MIN if meta is None or meta.ge is None else meta.ge
        hi = U64_MAX if meta is None or meta.le is None else meta.le

        def check_int(v: Any, name: str) -> Any:
            if type(v) is not int:
                if isinstance(v, int) and not isinstance(v, bool):
                    v = int(v)   # an IntEnum member or another int subclass: its value
                else:
                    raise InvalidMessageType(f"{name} must be an int, got {type(v).__name__}")
            if not lo <= v <= hi:
                raise InvalidMessage(f"{name} out of range [{lo}, {hi}]: {v}")
            return v

        return check_int
    if base is bool or base is float:
        def check_exact(v: Any, name: str) -> Any:
            if type(v) is not base:
                raise InvalidMessageType(f"{name} must be a {base.__name__}, got {type(v).__name__}")
            return v

        return check_exact
    if base is str or base is bytes:
        lo = 0 if meta is None or meta.min_length is None else meta.min_length
        hi = None if meta is None else meta.max_length

        def check_sized(v: Any, name: str) -> Any:
            if type(v) is not base:
                raise InvalidMessageType(f"{name} must be {base.__name__}, got {type(v).__name__}")
            if len(v) < lo or (hi is not None and len(v) > hi):
                raise InvalidMessage(f"{name} must be {lo}..{hi} long, got {len(v)}")
            return v

        return check_sized
    if isinstance(base, type) and issubclass(base, enum.Enum):
        def check_enum(v: Any, name: str) -> Any:
            if type(v) is base:
                return v
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidMessageType(f"{name} must be a {base.__name__}, got {type(v).__name__}")
            try:
                return base(v)
            except ValueError:
                raise InvalidMessage(f"{name}: {v} is not a {base.__name__}") from None

        return check_enum
    if isinstance(base, type) and issubclass(base, msgspec.Struct):
        def check_struct(v: Any, name: str) -> Any:
            if type(v) is not base:
                raise InvalidMessageType(f"{name} must be a {base.__name__}, got {type(v).__name__}")
            return v

        return check_struct
    if origin is Union:
        (inner,) = [a for a in base.__args__ if a is not type(None)]
        check_inner = _compile(inner)
        return lambda v, name: None if v is None else check_inner(v, name)
    if origin is tuple:
        elem = base.__args__[0]
        check_elem = _compile(elem)
        cap = MAX_COUNT if meta is None or meta.max_length is None else meta.max_length
        elem_base, elem_meta = _meta_of(elem)
        # fast paths (builtins, no Python call per element) for the common element types
        if elem_base is int:
            lo = I64_MIN if elem_meta is None or elem_meta.ge is None else elem_meta.ge
            hi = U64_MAX if elem_meta is None or elem_meta.le is None else elem_meta.le

            def fast(v: Any) -> bool:
                return all(type(x) is int for x in v) and lo <= min(v) and max(v) <= hi
        elif isinstance(elem_base, type) and issubclass(elem_base, msgspec.Struct):
            def fast(v: Any) -> bool:
                return all(type(x) is elem_base for x in v)
        else:
            def fast(v: Any) -> bool:
                return False

        def check_tuple(v: Any, name: str) -> Any:
            if type(v) is not tuple and type(v) is not list:
                raise InvalidMessageType(f"{name} must be a tuple, got {type(v).__name__}")
            if len(v) > cap:
                raise InvalidMessage(f"{name}: {len(v)} elements exceed {cap}")
            if not v or fast(v):
                return v if type(v) is tuple else tuple(v)
            out = tuple(check_elem(x, name) for x in v)
            return v if type(v) is tuple and all(a is b for a, b in zip(out, v)) else out

        return check_tuple
    if origin is dict:
        def check_dict(v: Any, name: str) -> Any:
            check_descriptor(v, name)
            return v

        return check_dict
    raise RuntimeError(f"no construction check for the annotation {tp!r}")


_CHECKS: dict[type, tuple] = {}


def _checks_of(cls: type[msgspec.Struct]) -> tuple:
    checks = _CHECKS.get(cls)
    if checks is None:  # first construction of each class
        hints = typing.get_type_hints(cls, include_extras=True)
        checks = _CHECKS[cls] = tuple((f, _compile(hints[f])) for f in cls.__struct_fields__)
    return checks


# Every subclass restates frozen=True: msgspec inherits it anyway, but a type checker reading the
# dataclass_transform does not, and would take the subclass for a mutable one.
class _Wire(msgspec.Struct, frozen=True, kw_only=True, array_like=True, forbid_unknown_fields=True):
    """Base of every wire type: immutable, keyword-built, a MessagePack array of its fields."""


class _Checked(_Wire, frozen=True, kw_only=True):
    """A wire type whose construction (and decoding) runs the field checks and :meth:`_check`."""

    def __post_init__(self) -> None:
        for name, check in _checks_of(type(self)):
            v = getattr(self, name)
            nv = check(v, name)
            if nv is not v:
                force_setattr(self, name, nv)
        self._check()

    def _check(self) -> None:
        """Cross-field rules of a message (after the field checks)."""


def descriptor_dicts(msg: Any):
    """Every descriptor dict inside ``msg`` (for a connection with a tighter nesting limit)."""
    for name in msg.__struct_fields__:
        v = getattr(msg, name)
        if type(v) is dict:
            yield v
        elif isinstance(v, msgspec.Struct):
            yield from descriptor_dicts(v)
        elif type(v) is tuple and v and isinstance(v[0], msgspec.Struct):
            for item in v:
                yield from descriptor_dicts(item)


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


class HostIdentity(_Checked, frozen=True, kw_only=True):
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


class TransportDescriptor(_Checked, frozen=True, kw_only=True):
    """A transport's descriptor of an endpoint or a region, as the wire carries it: the transport's
    name, the version of its payload format and the payload (the transport's own bytes, opaque to the
    control plane; :class:`llmdd.abc.EndpointDescriptor` / :class:`llmdd.abc.RegionDescriptor` on the
    seam's side)."""

    transport: TransportName
    version: U32 = 0
    payload: Payload = b""

    def __repr__(self) -> str:
        return f"TransportDescriptor(transport={self.transport!r}, version={self.version}, payload=<{len(self.payload)} bytes>)"


class TransportOffer(_Checked, frozen=True, kw_only=True):
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


class RegionDescriptor(_Checked, frozen=True, kw_only=True):
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


class KeyRef(_Wire, frozen=True, kw_only=True, gc=False):
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


class KeyEntry(_Checked, frozen=True, kw_only=True):
    """``key`` resolves to batch ``batch_index`` of cache ``cache_id`` (BLOCKS keys: the whole cache)."""

    key: KeyRef
    cache_id: I64
    batch_index: U32 = 0


class CacheEntry(_Checked, frozen=True, kw_only=True):
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


class Span(_Wire, frozen=True, kw_only=True, gc=False):
    """Half-open index range ``[start, stop)`` (blocks, tensors).

    Hot: no construction check (see the module docstring); the owner checks ``start <= stop``
    and both against its table when it uses a peer's span."""

    start: U64
    stop: U64

    def __len__(self) -> int:
        return self.stop - self.start


class ReadDoneEntry(_Wire, frozen=True, kw_only=True, gc=False):
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
    def from_spans(cls, *, cache_id: int, key: Optional[KeyRef] = None, block_spans: Any = ()) -> "ReadDoneEntry":
        return cls(cache_id=cache_id, key=key, block_bounds=tuple(x for s in block_spans for x in (s.start, s.stop)))

    @property
    def block_spans(self) -> tuple:
        """The spans as :class:`Span` objects (a trailing odd bound, which the owner refuses, is left out)."""
        b = self.block_bounds
        return tuple(Span(start=b[i], stop=b[i + 1]) for i in range(0, len(b) - 1, 2))


# --------------------------------------------------------------------------- handshake messages

class Hello(_Checked, frozen=True, kw_only=True):
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


class AuthChallenge(_Checked, frozen=True, kw_only=True):
    """Server demands proof of the shared secret; carries its nonce and incarnation (nothing else)."""

    nonce: Nonce
    incarnation: Incarnation


class AuthResponse(_Checked, frozen=True, kw_only=True):
    """Client's HMAC-SHA256 over both nonces, both incarnations and its Hello."""

    mac: Mac


class Welcome(_Checked, frozen=True, kw_only=True):
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


class Refuse(_Checked, frozen=True, kw_only=True):
    """Either side ends the handshake: an ``LLMStatusCode`` value and a reason (no secrets, no tables)."""

    status_code: I64
    reason: Text = ""


# --------------------------------------------------------------------------- descriptor tables

class RegionsUpdate(_Checked, frozen=True, kw_only=True):
    """Versioned update of the sender's region table.

    ``full=True`` replaces the table (any version newer than the last); a delta must carry
    exactly ``last + 1``.  Removals apply before additions.
    """

    version: U64
    full: bool = False
    added: Annotated[tuple[RegionDescriptor, ...], Meta(max_length=MAX_COUNT)] = ()
    removed: Annotated[tuple[U32, ...], Meta(max_length=MAX_COUNT)] = ()


class CacheTableUpdate(_Checked, frozen=True, kw_only=True):
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

class Keepalive(_Checked, frozen=True, kw_only=True):
    seq: U64
    sent_at_ns: U64  # sender's monotonic clock


class KeepaliveAck(_Checked, frozen=True, kw_only=True):
    seq: U64
    echo_sent_at_ns: U64  # the Keepalive's sent_at_ns (RTT on the sender)
    sent_at_ns: U64       # acker's monotonic clock


class UnlinkRequest(_Checked, frozen=True, kw_only=True):
    request_id: U64
    force: bool = False
    reason: Text = ""


class UnlinkAck(_Checked, frozen=True, kw_only=True):
    request_id: U64
    status_code: I64 = 0


# --------------------------------------------------------------------------- owner notifications

class ReadDone(_Wire, frozen=True, kw_only=True, gc=False):
    """Batched: the sender finished reading these caches/blocks (the owner may free them)."""

    entries: Annotated[tuple[ReadDoneEntry, ...], Meta(max_length=MAX_COUNT)] = ()


class KeyConsumed(_Checked, frozen=True, kw_only=True):
    """A ``CacheKey`` was pulled: the owner removes it once every tensor span has been read."""

    key: KeyRef
    cache_id: I64
    tensor_spans: Annotated[tuple[Span, ...], Meta(max_length=MAX_COUNT)] = ()


class ReleaseKey(_Checked, frozen=True, kw_only=True):
    """A puller gave up on a ``CacheKey`` it reserved: the owner puts the key back (one-way).

    ``id`` and ``model_id`` are the key's lookup index on the owner (``req_id`` or ``prefix_id``,
    and ``model_id``); a release of a key this link does not hold is benign and changes nothing."""

    id: U64
    model_id: U64


class TransferDone(_Checked, frozen=True, kw_only=True):
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


class PushDone(_Checked, frozen=True, kw_only=True):
    """Untagged pushes ended (one-way, batched in push order): one "peer finished writing" event each."""

    entries: Annotated[tuple[TransferDone, ...], Meta(max_length=MAX_NOTICE_BATCH)]


class TaggedDone(_Checked, frozen=True, kw_only=True):
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

class TransferRequest(_Checked, frozen=True, kw_only=True):
    """An operation needing the owner's help (e.g. a mediated tcp op, a push notification)."""

    request_id: U64
    op: Name
    args: Descriptor = {}


class TransferReply(_Checked, frozen=True, kw_only=True):
    request_id: U64
    status_code: I64 = 0
    result: Descriptor = {}


class Error(_Checked, frozen=True, kw_only=True):
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
