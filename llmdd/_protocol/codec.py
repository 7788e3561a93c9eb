"""Wire format of the llmdd control plane: framing plus MessagePack payloads (sans-io).

Frame (all integers big-endian)::

    offset  size  field
    0       2     magic  b"LD"
    2       1     wire version (2: MessagePack payloads; 1 was the hand-rolled binary payload codec)
    3       1     message type (see MESSAGE_TYPES)
    4       1     flags: bit 0 = CRC32 trailer present; bit 1 = 32-byte HMAC-SHA256 trailer instead
                  (every frame after an authenticated handshake); other bits must be 0
    5       4     payload length (u32, <= max_frame_size)
    9       len   payload: the message as a MessagePack array of its fields in declaration order
                  (nested building blocks the same way; descriptor dicts as MessagePack maps)
    9+len   4     CRC32 (zlib) of header + payload, when flag bit 0 is set

Payloads are encoded and decoded by ``msgspec`` against the message classes of ``messages`` (typed
decoding, in C): every integer is checked against its field's range, every string, byte string and
list against its length cap, every enum against its members, while parsing; a length or count is
checked against the bytes actually present before anything is allocated.  Descriptor dicts
(``dict[str, Any]``) are then walked: str keys only, only the value types the wire carries (no
MessagePack extension types), at most ``max_depth`` nested (the connection's limit, <= 16).

Canonical encodings: every accepted payload except a :class:`~.messages.ReadDone` notice re-encodes
to exactly its bytes (``encode(decode(b)) == b``): the decoder rejects a non-minimal integer or
length, a float32, a duplicate map key, a missing trailing field and trailing bytes.  The handshake
MACs the re-encoded messages, so a payload has one meaning and one encoding.  ReadDone is exempt to
keep the bulk notice cheap; it carries only numbers the owner checks against its tables.

Encoding checks: a message is checked when constructed (``messages``); the encoder also decodes what
it produced (except ReadDone) so it refuses, with :class:`LocalProtocolError`, anything a peer would
refuse, e.g. an instance altered past its constructor.

The header is rejected as soon as its bytes arrive (wrong magic, version, flags, type or an
oversized length), before the payload is buffered.  Any malformed input ends in
:class:`ProtocolError` and the connection is dead from then on.

Why MessagePack, not the v1 binary codec: a peer-read notice of 256 entries x 8 spans took ~1.2 ms
to encode and ~5 ms to decode in pure Python; msgspec does both in C (bench/control_codec.py,
bench/results-committed/issue22/control_codec*.json).  The C++ API embeds this Python package
(cpp/src/llm_datadist.cc), so it speaks the new payloads with no codec of its own to change.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import zlib
from typing import Any, Iterable, Union

import attrs
import msgspec

from llmdd._base.status import LLMStatusCode, LocalUsageError, TransportError
from llmdd._protocol import messages as m
from llmdd._protocol import wire
from llmdd._protocol.messages import MAX_COUNT as MAX_COUNT, MAX_NAME as MAX_NAME

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
WIRE_VERSION = 3   # 3: a ReadDone entry's block spans as flat bounds
SUPPORTED_WIRE_VERSIONS = frozenset({3})
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
DEFAULT_MAX_DEPTH = m.MAX_DESCRIPTOR_DEPTH
_MAX_DEPTH_LIMIT = m.MAX_DESCRIPTOR_DEPTH  # the messages' own check; a connection may only lower it
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


# --------------------------------------------------------------------------- payloads

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
    m.ReleaseKey: 0x42,
    m.PushDone: 0x43,
    m.TaggedDone: 0x44,
    m.TransferRequest: 0x50,
    m.TransferReply: 0x51,
    m.Error: 0x7F,
}
if set(MESSAGE_TYPES) != set(m.MESSAGE_CLASSES):
    raise RuntimeError("every message class needs exactly one type code")

_ENCODER = msgspec.msgpack.Encoder()
_encode = _ENCODER.encode
_DECODERS: dict[int, Any] = {}  # type code -> msgspec Decoder, built on first use (cheap import)
_CLASS_BY_CODE: dict[int, type] = {code: cls for cls, code in MESSAGE_TYPES.items()}
#: the bulk notice: neither re-encoded on decode (canonical check) nor decoded on encode (local check)
_BULK = frozenset({MESSAGE_TYPES[m.ReadDone]})
#: message types that may hold a descriptor dict (the only ones a lower connection depth limit affects)
_WITH_DICTS = frozenset(MESSAGE_TYPES[c] for c in (m.Hello, m.Welcome, m.TransferRequest, m.TransferReply))

# What decoding may raise: all become ProtocolError (ValidationError is a DecodeError; __post_init__
# checks raise ValueError/TypeError, which msgspec turns into ValidationError).
_DECODE_ERRORS = (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError)


def _decoder(code: int) -> Any:
    dec = _DECODERS.get(code)
    if dec is None:
        dec = _DECODERS[code] = msgspec.msgpack.Decoder(_CLASS_BY_CODE[code])
    return dec


def _decode_checked(code: int, payload: Union[bytes, bytearray, memoryview], max_depth: int) -> Any:
    cls = _CLASS_BY_CODE.get(code)
    if cls is None:
        raise ProtocolError(f"unknown message type 0x{code:02x}")
    try:
        msg = _decoder(code).decode(payload)
        if code not in _BULK and _encode(msg) != payload:
            raise ProtocolError(f"non-canonical encoding of {cls.__name__}")
        if max_depth < _MAX_DEPTH_LIMIT and code in _WITH_DICTS:
            for d in wire.descriptor_dicts(msg):
                wire.check_descriptor(d, "descriptor", 1, max_depth)
    except ProtocolError:
        raise
    except _DECODE_ERRORS as exc:
        raise ProtocolError(f"malformed {cls.__name__}: {exc}") from None
    return msg


def encode_payload(msg: m.Message) -> bytes:
    """The payload bytes of ``msg`` (no header); deterministic and canonical."""
    code = MESSAGE_TYPES.get(type(msg))
    if code is None:
        raise LocalProtocolError(f"not an llmdd message: {type(msg).__name__}")
    try:
        payload = _encode(msg)
    except (TypeError, ValueError, OverflowError, UnicodeError) as exc:
        raise LocalProtocolError(f"cannot encode {type(msg).__name__}: {exc}") from None
    if code not in _BULK:
        try:  # refuse locally what the peer would refuse (an instance altered past its checks)
            _decoder(code).decode(payload)
        except _DECODE_ERRORS as exc:
            raise LocalProtocolError(f"cannot encode {type(msg).__name__}: {exc}") from None
    return payload


def decode_payload(type_code: int, payload: bytes | memoryview, *, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """Decode one payload of message type ``type_code``; any malformation -> ProtocolError."""
    return _decode_checked(type_code, payload, max_depth)


def encode_frame(msg: m.Message, *, checksum: bool = True, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
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
    def send(self, msg: m.Message) -> bytes:
        """Encode ``msg`` as one frame and return the bytes to write."""
        if self._mac_send is not None:
            buf = bytearray(encode_frame(msg, checksum=False, max_frame_size=self._max_frame_size))
            buf[4] = FLAG_MAC   # header byte 4: flags
            buf += hmac.new(self._mac_send, _SEQ.pack(self._seq_send) + bytes(buf), hashlib.sha256).digest()
            self._seq_send += 1
            frame = bytes(buf)
        else:
            frame = encode_frame(msg, checksum=self._checksum, max_frame_size=self._max_frame_size)
        self._frames_sent += 1
        self._bytes_sent += len(frame)
        return frame

    def send_many(self, msgs: Iterable[m.Message]) -> bytes:
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
            if code not in _CLASS_BY_CODE:
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
        msg = _decode_checked(code, payload, self._max_depth)
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
