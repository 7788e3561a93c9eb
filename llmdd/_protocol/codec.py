"""Wire format of the llmdd control plane: framing plus a schema-driven binary codec (sans-io).

Frame (all integers big-endian)::

    offset  size  field
    0       2     magic  b"LD"
    2       1     wire version (1)
    3       1     message type (see MESSAGE_TYPES)
    4       1     flags: bit 0 = CRC32 trailer present; bit 1 = 32-byte HMAC-SHA256 trailer instead
                  (every frame after an authenticated handshake); other bits must be 0
    5       4     payload length (u32, <= max_frame_size)
    9       len   payload (fields of the message, in schema order, no padding)
    9+len   4     CRC32 (zlib) of header + payload, when flag bit 0 is set

Payload primitives: u8/u16/u32/u64/i64 fixed width; bool = one byte 0/1; f64 IEEE-754;
bytes/str = u32 length + data (str is UTF-8); list = u32 count + elements; optional = one byte
0/1 + value; "any64" int = tag byte (0: i64, 1: u64 >= 2**63) + 8 bytes; a descriptor dict =
u32 count + (str key, tagged value) pairs.  Tagged values (descriptor dicts)::

    0x00 None  0x01 False  0x02 True  0x03 i64  0x04 u64 (only >= 2**63)  0x05 f64
    0x06 str   0x07 bytes  0x08 list  0x09 dict (str keys, no duplicates)

Encodings are canonical (the decoder rejects a u64 tag for a value that fits i64, bool bytes
other than 0/1, duplicate dict keys, trailing bytes), so ``encode(decode(b)) == b`` for every
accepted payload; the handshake relies on that to MAC a transcript.

Decoder guarantees: every length/count is checked against the bytes actually present before
anything is built, against the frame limit and against per-field caps; nesting depth is bounded;
the header is rejected as soon as its bytes arrive (wrong magic, version, flags, type or an
oversized length), before the payload is buffered.  Any malformed input ends in
:class:`ProtocolError` and the connection is dead from then on.
"""

from __future__ import annotations

import abc
import hashlib
import hmac

import struct
import zlib
from typing import Any

import attrs

from .._enums import LLMRole, Placement
from .._status import LLMStatusCode, LocalUsageError, TransportError
from . import messages as m

__all__ = [
    "MAGIC",
    "WIRE_VERSION",
    "SUPPORTED_WIRE_VERSIONS",
    "HEADER_SIZE",
    "FLAG_CRC32",
    "DEFAULT_MAX_FRAME_SIZE",
    "DEFAULT_MAX_DEPTH",
    "MAX_COUNT",
    "MESSAGE_TYPES",
    "NEED_DATA",
    "PEER_CLOSED",
    "ProtocolError",
    "LocalProtocolError",
    "CodecStatistics",
    "Connection",
    "encode_payload",
    "decode_payload",
    "encode_frame",
]

MAGIC = b"LD"
WIRE_VERSION = 1
SUPPORTED_WIRE_VERSIONS = frozenset({1})
_HEADER = struct.Struct(">2sBBBI")
HEADER_SIZE = _HEADER.size  # 9
FLAG_CRC32 = 0x01
#: the frame ends in HMAC-SHA256(direction key, seq u64 | header | payload) instead of a CRC32: set on
#: every frame after an authenticated handshake (``Connection.enable_frame_mac``)
FLAG_MAC = 0x02
_KNOWN_FLAGS = FLAG_CRC32 | FLAG_MAC
_CRC = struct.Struct(">I")
_MAC_SIZE = 32
_SEQ = struct.Struct(">Q")
DEFAULT_MAX_FRAME_SIZE = 16 * 1024 * 1024
DEFAULT_MAX_DEPTH = 16
_MAX_DEPTH_LIMIT = 64  # keeps the recursive value decoder far from Python's recursion limit
MAX_COUNT = 1 << 20      # elements in any one list / dict
MAX_NAME = 4096          # bytes in a name or reason string outside descriptor dicts
_ABS_MAX_FRAME = 2**32 - 1


class ProtocolError(TransportError):
    """The peer sent bytes that are not a valid llmdd control stream.

    Status ``LLM_LINK_FAILED``: a corrupt control stream leaves the link unusable (the link
    goes FAILED and must be re-established), which is how upstream reports link-level failure,
    and what a client sees when a handshake is refused or garbled (reliability spec F13/F14/F28).
    """

    def __init__(self, *args: Any, status_code: LLMStatusCode = LLMStatusCode.LLM_LINK_FAILED) -> None:
        super().__init__(*args, status_code=status_code)


class LocalProtocolError(LocalUsageError):
    """The caller asked to send something the wire cannot carry (caller's fault)."""

    def __init__(self, *args: Any, status_code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID) -> None:
        super().__init__(*args, status_code=status_code)


class _Sentinel:
    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name

    def __reduce__(self) -> str:
        return self._name


NEED_DATA = _Sentinel("NEED_DATA")
"""``next_message()``: no complete frame buffered yet; feed more bytes."""
PEER_CLOSED = _Sentinel("PEER_CLOSED")
"""``next_message()``: the peer closed cleanly (``receive_data(b"")``) at a frame boundary."""


# --------------------------------------------------------------------------- reader / field types

class _Reader:
    __slots__ = ("_buf", "_pos", "_end", "max_depth", "limit")

    def __init__(self, buf: memoryview, max_depth: int) -> None:
        self._buf = buf
        self._pos = 0
        self._end = len(buf)
        self.max_depth = max_depth
        self.limit = len(buf)

    @property
    def remaining(self) -> int:
        return self._end - self._pos

    def take(self, n: int) -> memoryview:
        if n > self._end - self._pos:
            raise ProtocolError(f"truncated payload: need {n} bytes, {self._end - self._pos} left")
        start = self._pos
        self._pos += n
        return self._buf[start:self._pos]

    def unpack(self, st: struct.Struct) -> Any:
        if st.size > self._end - self._pos:
            raise ProtocolError(f"truncated payload: need {st.size} bytes, {self._end - self._pos} left")
        (value,) = st.unpack_from(self._buf, self._pos)
        self._pos += st.size
        return value

    def count(self, what: str, cap: int, min_item: int) -> int:
        n = self.unpack(_U32)
        if n > cap:
            raise ProtocolError(f"{what}: count {n} exceeds limit {cap}")
        if n * min_item > self.remaining:
            raise ProtocolError(f"{what}: count {n} needs more bytes than the frame holds")
        return n


_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_I64 = struct.Struct(">q")
_F64 = struct.Struct(">d")


def _bad(msg: str) -> LocalProtocolError:
    return LocalProtocolError(msg)


class _Field(abc.ABC):
    """One field codec of a message schema (every concrete field implements both directions)."""

    min_size = 1

    @abc.abstractmethod
    def enc(self, v: Any, out: bytearray) -> None:
        """Append the encoding of ``v`` to ``out``."""

    @abc.abstractmethod
    def dec(self, r: _Reader) -> Any:
        """Decode one value from ``r`` (bounded; raises on malformed input)."""


class _Int(_Field):
    def __init__(self, st: struct.Struct, lo: int, hi: int) -> None:
        self.st, self.lo, self.hi = st, lo, hi
        self.min_size = st.size

    def enc(self, v: Any, out: bytearray) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or not self.lo <= v <= self.hi:
            raise _bad(f"integer {v!r} outside [{self.lo}, {self.hi}]")
        out += self.st.pack(v)

    def dec(self, r: _Reader) -> int:
        return r.unpack(self.st)


U8 = _Int(_U8, 0, m.U8_MAX)
U16 = _Int(_U16, 0, m.U16_MAX)
U32 = _Int(_U32, 0, m.U32_MAX)
U64 = _Int(_U64, 0, m.U64_MAX)
I64 = _Int(_I64, m.I64_MIN, m.I64_MAX)


class _AnyInt(_Field):
    """-2**63 .. 2**64-1 as tag + 8 bytes (canonical: u64 tag only for values above i64)."""

    min_size = 9

    def enc(self, v: Any, out: bytearray) -> None:
        if isinstance(v, bool) or not isinstance(v, int):
            raise _bad(f"expected int, got {type(v).__name__}")
        if m.I64_MIN <= v <= m.I64_MAX:
            out.append(0)
            out += _I64.pack(v)
        elif v <= m.U64_MAX:
            out.append(1)
            out += _U64.pack(v)
        else:
            raise _bad(f"integer {v} outside the 64-bit range")

    def dec(self, r: _Reader) -> int:
        tag = r.unpack(_U8)
        if tag == 0:
            return r.unpack(_I64)
        if tag == 1:
            v = r.unpack(_U64)
            if v <= m.I64_MAX:
                raise ProtocolError("non-canonical u64 encoding")
            return v
        raise ProtocolError(f"bad integer tag {tag}")


ANY64 = _AnyInt()


class _Bool(_Field):
    def enc(self, v: Any, out: bytearray) -> None:
        if not isinstance(v, bool):
            raise _bad(f"expected bool, got {type(v).__name__}")
        out.append(1 if v else 0)

    def dec(self, r: _Reader) -> bool:
        b = r.unpack(_U8)
        if b > 1:
            raise ProtocolError(f"bad bool byte {b}")
        return b == 1


BOOL = _Bool()


class _Bytes(_Field):
    min_size = 4

    def __init__(self, max_len: int | None = None) -> None:
        self.max_len = max_len

    def enc(self, v: Any, out: bytearray) -> None:
        if not isinstance(v, (bytes, bytearray, memoryview)):
            raise _bad(f"expected bytes, got {type(v).__name__}")
        v = bytes(v)
        if self.max_len is not None and len(v) > self.max_len:
            raise _bad(f"byte string of {len(v)} exceeds {self.max_len}")
        if len(v) > m.U32_MAX:
            raise _bad("byte string too long")
        out += _U32.pack(len(v))
        out += v

    def _len(self, r: _Reader) -> int:
        n = r.unpack(_U32)
        if self.max_len is not None and n > self.max_len:
            raise ProtocolError(f"length {n} exceeds {self.max_len}")
        return n

    def dec(self, r: _Reader) -> bytes:
        return bytes(r.take(self._len(r)))


class _Str(_Bytes):
    def enc(self, v: Any, out: bytearray) -> None:
        if not isinstance(v, str):
            raise _bad(f"expected str, got {type(v).__name__}")
        try:
            data = v.encode("utf-8")
        except UnicodeEncodeError as exc:  # lone surrogates
            raise _bad(f"string is not encodable as UTF-8: {exc}") from None
        super().enc(data, out)

    def dec(self, r: _Reader) -> str:
        return str(r.take(self._len(r)), "utf-8")  # UnicodeDecodeError -> ProtocolError at the boundary


BYTES = _Bytes(m.NONCE_MAX_SIZE)
NAME = _Str(MAX_NAME)
TEXT = _Str(64 * 1024)


class _Enum(_Field):
    def __init__(self, enum_cls: type, base: _Int = U8) -> None:
        self.enum_cls, self.base = enum_cls, base
        self.min_size = base.min_size

    def enc(self, v: Any, out: bytearray) -> None:
        self.base.enc(int(self.enum_cls(v)), out)

    def dec(self, r: _Reader) -> Any:
        return self.enum_cls(self.base.dec(r))  # ValueError -> ProtocolError at the boundary


class _List(_Field):
    min_size = 4

    def __init__(self, elem: _Field, cap: int = MAX_COUNT) -> None:
        self.elem, self.cap = elem, cap

    def enc(self, v: Any, out: bytearray) -> None:
        if not isinstance(v, (tuple, list)):
            raise _bad(f"expected a sequence, got {type(v).__name__}")
        if len(v) > self.cap:
            raise _bad(f"{len(v)} elements exceed {self.cap}")
        out += _U32.pack(len(v))
        for item in v:
            self.elem.enc(item, out)

    def dec(self, r: _Reader) -> tuple:
        n = r.count("list", self.cap, self.elem.min_size)
        return tuple(self.elem.dec(r) for _ in range(n))


class _Optional(_Field):
    def __init__(self, elem: _Field) -> None:
        self.elem = elem

    def enc(self, v: Any, out: bytearray) -> None:
        if v is None:
            out.append(0)
        else:
            out.append(1)
            self.elem.enc(v, out)

    def dec(self, r: _Reader) -> Any:
        b = r.unpack(_U8)
        if b == 0:
            return None
        if b == 1:
            return self.elem.dec(r)
        raise ProtocolError(f"bad optional marker {b}")


class _Struct(_Field):
    """An attrs class encoded as its fields in order; construction runs the class's validators."""

    def __init__(self, cls: type, *fields: tuple[str, _Field]) -> None:
        names = tuple(a.name for a in attrs.fields(cls))
        if names != tuple(n for n, _ in fields):
            raise RuntimeError(f"wire schema of {cls.__name__} {fields} does not match its fields {names}")
        self.cls = cls
        self.fields = fields
        self.min_size = max(1, sum(f.min_size for _, f in fields))

    def enc(self, v: Any, out: bytearray) -> None:
        if type(v) is not self.cls:
            raise _bad(f"expected {self.cls.__name__}, got {type(v).__name__}")
        for name, f in self.fields:
            f.enc(getattr(v, name), out)

    def dec(self, r: _Reader) -> Any:
        kwargs = {name: f.dec(r) for name, f in self.fields}
        return self.cls(**kwargs)  # validator failures (ValueError/TypeError) -> ProtocolError


# tagged dynamic values (descriptor dicts) -------------------------------------------------

_T_NONE, _T_FALSE, _T_TRUE, _T_I64, _T_U64, _T_F64, _T_STR, _T_BYTES, _T_LIST, _T_DICT = range(10)


def _enc_value(v: Any, out: bytearray, depth: int, max_depth: int) -> None:
    if v is None:
        out.append(_T_NONE)
    elif v is True:
        out.append(_T_TRUE)
    elif v is False:
        out.append(_T_FALSE)
    elif isinstance(v, int):
        if m.I64_MIN <= v <= m.I64_MAX:
            out.append(_T_I64)
            out += _I64.pack(v)
        elif m.I64_MAX < v <= m.U64_MAX:
            out.append(_T_U64)
            out += _U64.pack(v)
        else:
            raise _bad(f"integer {v} outside the 64-bit range")
    elif isinstance(v, float):
        out.append(_T_F64)
        out += _F64.pack(v)
    elif isinstance(v, str):
        out.append(_T_STR)
        _VSTR.enc(v, out)
    elif isinstance(v, (bytes, bytearray, memoryview)):
        out.append(_T_BYTES)
        _VBYTES.enc(v, out)
    elif isinstance(v, (list, tuple)):
        if depth >= max_depth:
            raise _bad(f"descriptor nesting deeper than {max_depth}")
        if len(v) > MAX_COUNT:
            raise _bad(f"{len(v)} elements exceed {MAX_COUNT}")
        out.append(_T_LIST)
        out += _U32.pack(len(v))
        for item in v:
            _enc_value(item, out, depth + 1, max_depth)
    elif isinstance(v, dict):
        if depth >= max_depth:
            raise _bad(f"descriptor nesting deeper than {max_depth}")
        out.append(_T_DICT)
        _enc_dict_body(v, out, depth + 1, max_depth)
    else:
        raise _bad(f"descriptor values cannot be {type(v).__name__}")


def _enc_dict_body(v: Any, out: bytearray, depth: int, max_depth: int) -> None:
    if not isinstance(v, dict):
        raise _bad(f"expected a dict, got {type(v).__name__}")
    if len(v) > MAX_COUNT:
        raise _bad(f"{len(v)} entries exceed {MAX_COUNT}")
    out += _U32.pack(len(v))
    for key, item in v.items():
        if not isinstance(key, str):
            raise _bad(f"descriptor keys must be str, got {type(key).__name__}")
        _VSTR.enc(key, out)
        _enc_value(item, out, depth, max_depth)


def _dec_value(r: _Reader, depth: int) -> Any:
    tag = r.unpack(_U8)
    if tag == _T_NONE:
        return None
    if tag == _T_FALSE:
        return False
    if tag == _T_TRUE:
        return True
    if tag == _T_I64:
        return r.unpack(_I64)
    if tag == _T_U64:
        v = r.unpack(_U64)
        if v <= m.I64_MAX:
            raise ProtocolError("non-canonical u64 value")
        return v
    if tag == _T_F64:
        return r.unpack(_F64)
    if tag == _T_STR:
        return _VSTR.dec(r)
    if tag == _T_BYTES:
        return _VBYTES.dec(r)
    if tag == _T_LIST:
        if depth >= r.max_depth:
            raise ProtocolError(f"descriptor nesting deeper than {r.max_depth}")
        n = r.count("list", MAX_COUNT, 1)
        return [_dec_value(r, depth + 1) for _ in range(n)]
    if tag == _T_DICT:
        if depth >= r.max_depth:
            raise ProtocolError(f"descriptor nesting deeper than {r.max_depth}")
        return _dec_dict_body(r, depth + 1)
    raise ProtocolError(f"unknown value tag {tag}")


def _dec_dict_body(r: _Reader, depth: int) -> dict:
    n = r.count("dict", MAX_COUNT, 5)  # key length (4) + value tag (1) at least
    out: dict = {}
    for _ in range(n):
        key = _VSTR.dec(r)
        if key in out:
            raise ProtocolError(f"duplicate descriptor key {key!r}")
        out[key] = _dec_value(r, depth)
    return out


_VSTR = _Str(None)    # bounded by the frame
_VBYTES = _Bytes(None)


class _Dict(_Field):
    """A descriptor dict (str keys, tagged values), the top level counting as depth 1."""

    min_size = 4

    def enc(self, v: Any, out: bytearray) -> None:
        _enc_dict_body(v, out, 1, _encode_depth)

    def dec(self, r: _Reader) -> dict:
        return _dec_dict_body(r, 1)


_encode_depth = DEFAULT_MAX_DEPTH
DICT = _Dict()


# --------------------------------------------------------------------------- schemas

_HOST = _Struct(m.HostIdentity, ("boot_id", NAME), ("machine_id", NAME), ("uid", I64), ("pid", I64),
                ("namespaces", DICT))
_OFFER = _Struct(m.TransportOffer, ("name", NAME), ("descriptor", DICT))
_REGION = _Struct(m.RegionDescriptor, ("region_id", U32), ("cache_id", I64), ("addr", U64), ("size", U64),
                  ("placement", _Enum(Placement)), ("remote_accessible", BOOL), ("transports", DICT))
_KEYREF = _Struct(m.KeyRef, ("kind", _Enum(m.KeyKind)), ("model_id", ANY64), ("id", U64))
_KEYENTRY = _Struct(m.KeyEntry, ("key", _KEYREF), ("cache_id", I64), ("batch_index", U32))
_CACHE = _Struct(m.CacheEntry, ("cache_id", I64), ("addrs", _List(U64)), ("tensor_size", U64),
                 ("shape", _List(I64, 64)), ("data_type", U16), ("placement", _Enum(Placement)),
                 ("is_blocks", BOOL))
_SPAN = _Struct(m.Span, ("start", U64), ("stop", U64))
_READDONE_ENTRY = _Struct(m.ReadDoneEntry, ("cache_id", I64), ("key", _Optional(_KEYREF)),
                          ("block_spans", _List(_SPAN)))
_ROLE = _Enum(LLMRole)

_SCHEMAS: dict[type, _Struct] = {
    s.cls: s for s in (
        _Struct(m.Hello, ("min_version", U16), ("max_version", U16), ("cluster_id", U64),
                ("incarnation", BYTES), ("role", _ROLE), ("transports", _List(_OFFER, 256)),
                ("host", _HOST), ("nonce", BYTES)),
        _Struct(m.AuthChallenge, ("nonce", BYTES), ("incarnation", BYTES)),
        _Struct(m.AuthResponse, ("mac", BYTES)),
        _Struct(m.Welcome, ("version", U16), ("cluster_id", U64), ("incarnation", BYTES), ("role", _ROLE),
                ("transport", _OFFER), ("host", _HOST), ("proof", BYTES)),
        _Struct(m.Refuse, ("status_code", I64), ("reason", TEXT)),
        _Struct(m.RegionsUpdate, ("version", U64), ("full", BOOL), ("added", _List(_REGION)),
                ("removed", _List(U32))),
        _Struct(m.CacheTableUpdate, ("version", U64), ("full", BOOL), ("caches_added", _List(_CACHE)),
                ("caches_removed", _List(I64)), ("keys_added", _List(_KEYENTRY)),
                ("keys_removed", _List(_KEYREF))),
        _Struct(m.Keepalive, ("seq", U64), ("sent_at_ns", U64)),
        _Struct(m.KeepaliveAck, ("seq", U64), ("echo_sent_at_ns", U64), ("sent_at_ns", U64)),
        _Struct(m.UnlinkRequest, ("request_id", U64), ("force", BOOL), ("reason", TEXT)),
        _Struct(m.UnlinkAck, ("request_id", U64), ("status_code", I64)),
        _Struct(m.ReadDone, ("entries", _List(_READDONE_ENTRY))),
        _Struct(m.KeyConsumed, ("key", _KEYREF), ("cache_id", I64), ("tensor_spans", _List(_SPAN))),
        _Struct(m.TransferRequest, ("request_id", U64), ("op", NAME), ("args", DICT)),
        _Struct(m.TransferReply, ("request_id", U64), ("status_code", I64), ("result", DICT)),
        _Struct(m.Error, ("status_code", I64), ("message", TEXT), ("fatal", BOOL)),
    )
}

MESSAGE_TYPES: dict[type, int] = {
    m.Hello: 0x01,
    m.AuthChallenge: 0x02,
    m.AuthResponse: 0x03,
    m.Welcome: 0x04,
    m.Refuse: 0x05,
    m.RegionsUpdate: 0x10,
    m.CacheTableUpdate: 0x11,
    m.Keepalive: 0x20,
    m.KeepaliveAck: 0x21,
    m.UnlinkRequest: 0x30,
    m.UnlinkAck: 0x31,
    m.ReadDone: 0x40,
    m.KeyConsumed: 0x41,
    m.TransferRequest: 0x50,
    m.TransferReply: 0x51,
    m.Error: 0x7F,
}
_BY_CODE: dict[int, _Struct] = {code: _SCHEMAS[cls] for cls, code in MESSAGE_TYPES.items()}
if set(MESSAGE_TYPES) != set(m.MESSAGE_CLASSES) or set(_SCHEMAS) != set(m.MESSAGE_CLASSES):
    raise RuntimeError("every message class needs exactly one type code and one schema")

# What the decoder lets escape from constructors and primitive parsing: all become ProtocolError.
_DECODE_ERRORS = (ValueError, TypeError, OverflowError, struct.error, RecursionError)


def encode_payload(msg: Any) -> bytes:
    """The payload bytes of ``msg`` (no header); deterministic and canonical."""
    schema = _SCHEMAS.get(type(msg))
    if schema is None:
        raise LocalProtocolError(f"not an llmdd message: {type(msg).__name__}")
    out = bytearray()
    try:
        schema.enc(msg, out)
    except (ValueError, TypeError) as exc:  # enum conversions of a hand-built instance
        raise LocalProtocolError(f"cannot encode {type(msg).__name__}: {exc}") from None
    return bytes(out)


def decode_payload(type_code: int, payload: bytes | memoryview, *, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """Decode one payload of message type ``type_code``; any malformation -> ProtocolError."""
    schema = _BY_CODE.get(type_code)
    if schema is None:
        raise ProtocolError(f"unknown message type 0x{type_code:02x}")
    r = _Reader(memoryview(payload), max_depth)
    try:
        msg = schema.dec(r)
    except ProtocolError:
        raise
    except _DECODE_ERRORS as exc:
        raise ProtocolError(f"malformed {schema.cls.__name__}: {exc}") from None
    if r.remaining:
        raise ProtocolError(f"{r.remaining} trailing bytes after {schema.cls.__name__}")
    return msg


def encode_frame(msg: Any, *, checksum: bool = True, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """One complete frame for ``msg``."""
    code = MESSAGE_TYPES.get(type(msg))
    if code is None:
        raise LocalProtocolError(f"not an llmdd message: {type(msg).__name__}")
    payload = encode_payload(msg)
    if len(payload) > max_frame_size:
        raise LocalProtocolError(f"{type(msg).__name__} needs {len(payload)} bytes, frame limit {max_frame_size}")
    flags = FLAG_CRC32 if checksum else 0
    frame = bytearray(_HEADER.pack(MAGIC, WIRE_VERSION, code, flags, len(payload)))
    frame += payload
    if checksum:
        frame += _CRC.pack(zlib.crc32(frame))
    return bytes(frame)


# --------------------------------------------------------------------------- connection

@attrs.frozen(kw_only=True)
class CodecStatistics:
    frames_sent: int
    frames_received: int
    bytes_sent: int
    bytes_received: int
    buffered: int
    dead: bool


def _check_frame_limit(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 16 <= value <= _ABS_MAX_FRAME:
        raise LocalProtocolError(f"max_frame_size must be an int in [16, {_ABS_MAX_FRAME}], got {value!r}")
    return value


class Connection:
    """Sans-io framing of one control connection, in the h11 style.

    ``send(msg)`` returns the bytes to write; bytes read from the socket go to
    ``receive_data(data)`` (``b""`` = the peer closed); ``next_message()`` returns the next
    message, :data:`NEED_DATA` or :data:`PEER_CLOSED`, or raises :class:`ProtocolError`.
    After a ProtocolError the receiving side is dead: ``next_message`` and ``receive_data``
    raise the same error again.  Sending stays possible (to tell the peer why, e.g. a Refuse).

    Not thread-safe: one owner (the link's I/O loop) drives it.
    """

    def __init__(self, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, max_depth: int = DEFAULT_MAX_DEPTH,
                 checksum: bool = True, require_checksum: bool = False) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or not 1 <= max_depth <= _MAX_DEPTH_LIMIT:
            raise LocalProtocolError(f"max_depth must be an int in [1, {_MAX_DEPTH_LIMIT}], got {max_depth!r}")
        self._max_frame_size = _check_frame_limit(max_frame_size)
        self._max_depth = max_depth
        self._checksum = bool(checksum)
        self._require_checksum = bool(require_checksum)
        self._buf = bytearray()
        self._off = 0
        self._eof = False
        self._error: ProtocolError | None = None
        self._header: tuple[int, int, int] | None = None  # (type code, flags, length) of the pending frame
        self._frames_sent = self._frames_received = 0
        self._bytes_sent = self._bytes_received = 0
        self._mac_send: bytes | None = None      # direction keys once frame MACs are on
        self._mac_recv: bytes | None = None
        self._seq_send = self._seq_recv = 0

    def enable_frame_mac(self, key: bytes, *, client: bool) -> None:
        """From the next frame on, in both directions, every frame carries an HMAC-SHA256 under a key
        derived from ``key`` for its direction, over a sequence number counted from 0 per direction
        and the frame: a modified, replayed, reordered, dropped-then-resumed or unsigned frame is a
        ProtocolError.  Call it exactly between the last handshake frame and the first frame after."""
        up = hmac.new(key, b"client->server", hashlib.sha256).digest()
        down = hmac.new(key, b"server->client", hashlib.sha256).digest()
        self._mac_send, self._mac_recv = (up, down) if client else (down, up)
        self._seq_send = self._seq_recv = 0

    @property
    def frame_mac(self) -> bool:
        return self._mac_send is not None

    # -- configuration
    @property
    def max_frame_size(self) -> int:
        return self._max_frame_size

    @max_frame_size.setter
    def max_frame_size(self, value: int) -> None:
        """Change the limit (e.g. small before authentication, larger once established)."""
        self._max_frame_size = _check_frame_limit(value)

    @property
    def error(self) -> ProtocolError | None:
        """The ProtocolError that killed the receiving side, if any."""
        return self._error

    @property
    def dead(self) -> bool:
        return self._error is not None

    @property
    def eof(self) -> bool:
        return self._eof

    # -- sending
    def send(self, msg: Any) -> bytes:
        """Encode ``msg`` as one frame and return the bytes to write."""
        if self._mac_send is not None:
            frame = encode_frame(msg, checksum=False, max_frame_size=self._max_frame_size)
            frame = bytearray(frame)
            frame[4] = FLAG_MAC   # header byte 4: flags
            frame += hmac.new(self._mac_send, _SEQ.pack(self._seq_send) + bytes(frame), hashlib.sha256).digest()
            self._seq_send += 1
            frame = bytes(frame)
        else:
            frame = encode_frame(msg, checksum=self._checksum, max_frame_size=self._max_frame_size)
        self._frames_sent += 1
        self._bytes_sent += len(frame)
        return frame

    def send_many(self, msgs: Any) -> bytes:
        """Encode several messages back to back (one write for a batch)."""
        return b"".join(self.send(msg) for msg in msgs)

    # -- receiving
    def receive_data(self, data: bytes) -> None:
        """Feed bytes read from the peer; ``b""`` signals a clean close."""
        if self._error is not None:
            raise self._error
        if not data:
            self._eof = True
            return
        if self._eof:
            raise LocalProtocolError("receive_data() after the peer closed (b'' was already given)")
        self._buf += data
        self._bytes_received += len(data)

    def next_message(self) -> Any:
        """The next complete message, :data:`NEED_DATA`, :data:`PEER_CLOSED`, or raise ProtocolError."""
        if self._error is not None:
            raise self._error
        try:
            return self._next()
        except ProtocolError as exc:
            self._fail(exc)
            raise
        except _DECODE_ERRORS as exc:  # defensive: the decoder converts these itself
            err = ProtocolError(f"malformed frame: {exc}")
            self._fail(err)
            raise err from None

    def _fail(self, exc: ProtocolError) -> None:
        self._error = exc
        self._buf = bytearray()
        self._off = 0

    def _next(self) -> Any:
        avail = len(self._buf) - self._off
        if self._header is None:
            if avail < HEADER_SIZE:
                # Reject a wrong magic as soon as its first byte is here (TLS, HTTP, garbage).
                got = bytes(self._buf[self._off:self._off + min(avail, 2)])
                if got != MAGIC[:len(got)]:
                    raise ProtocolError(f"bad magic {got!r}: not an llmdd control stream")
                if self._eof:
                    if avail == 0:
                        return PEER_CLOSED
                    raise ProtocolError("peer closed in the middle of a frame header")
                return NEED_DATA
            magic, version, code, flags, length = _HEADER.unpack_from(self._buf, self._off)
            if magic != MAGIC:
                raise ProtocolError(f"bad magic {magic!r}: not an llmdd control stream")
            if version not in SUPPORTED_WIRE_VERSIONS:
                raise ProtocolError(f"unsupported wire version {version}")
            if flags & ~_KNOWN_FLAGS:
                raise ProtocolError(f"unknown frame flags 0x{flags:02x}")
            if self._mac_recv is not None:
                if flags != FLAG_MAC:
                    raise ProtocolError("frame without the required MAC")
            elif flags & FLAG_MAC:
                raise ProtocolError("a MAC'd frame before frame MACs were agreed")
            elif self._require_checksum and not flags & FLAG_CRC32:
                raise ProtocolError("frame without the required CRC32")
            if code not in _BY_CODE:
                raise ProtocolError(f"unknown message type 0x{code:02x}")
            if length > self._max_frame_size:
                raise ProtocolError(f"frame of {length} bytes exceeds the limit of {self._max_frame_size}")
            self._header = (code, flags, length)
        code, flags, length = self._header
        total = HEADER_SIZE + length + (_MAC_SIZE if flags & FLAG_MAC else _CRC.size if flags & FLAG_CRC32 else 0)
        if avail < total:
            if self._eof:
                raise ProtocolError(f"peer closed after {avail} of {total} frame bytes")
            return NEED_DATA
        start = self._off
        frame = memoryview(bytes(self._buf[start:start + total]))  # one copy; the buffer stays resizable
        payload = frame[HEADER_SIZE:HEADER_SIZE + length]
        if flags & FLAG_MAC:
            assert self._mac_recv is not None
            want_mac = hmac.new(self._mac_recv, _SEQ.pack(self._seq_recv) + bytes(frame[:HEADER_SIZE + length]),
                                hashlib.sha256).digest()
            if not hmac.compare_digest(want_mac, bytes(frame[HEADER_SIZE + length:])):
                raise ProtocolError("frame MAC mismatch (modified, replayed or out of order)")
            self._seq_recv += 1
        elif flags & FLAG_CRC32:
            (want,) = _CRC.unpack_from(frame, HEADER_SIZE + length)
            if zlib.crc32(frame[:HEADER_SIZE + length]) != want:
                raise ProtocolError("frame CRC32 mismatch")
        msg = decode_payload(code, payload, max_depth=self._max_depth)
        self._header = None
        self._off += total
        self._frames_received += 1
        if self._off == len(self._buf):
            self._buf.clear()
            self._off = 0
        elif self._off > 65536 and self._off * 2 > len(self._buf):
            del self._buf[:self._off]
            self._off = 0
        return msg

    def statistics(self) -> CodecStatistics:
        return CodecStatistics(frames_sent=self._frames_sent, frames_received=self._frames_received,
                               bytes_sent=self._bytes_sent, bytes_received=self._bytes_received,
                               buffered=len(self._buf) - self._off, dead=self._error is not None)
