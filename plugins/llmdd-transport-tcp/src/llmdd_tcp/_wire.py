"""The tcp data port's wire: its version, the layouts of HELLO, OPEN, OPEN_RSP, REQ and RSP, the request
kinds and answer statuses, the packed op of a request (:data:`WIRE_OP`, a numpy dtype defined at numpy's
first use: read it as ``_wire.WIRE_OP``), the caps on a request, and the framing of an answer.  The
exchange is described in :mod:`llmdd_tcp`."""

from __future__ import annotations

import socket
import struct
from typing import Any

from llmdd.lowlevel import Corrupt, when_numpy_loaded

from ._sock import recv_exact

VERSION = 2
HELLO = struct.Struct("<4sHBB16s16s")   # magic, version, auth, features, endpoint id, server nonce
OPEN = struct.Struct("<16s16s32s")       # client nonce, grant handle, client mac
AUTH_RSP = struct.Struct("<B32s")        # status, server mac
REQ = struct.Struct("<4sBBHIQ")          # magic, kind, flags, pad, op count, payload bytes
RSP = struct.Struct("<4sBBHI")           # magic, status, pad, pad, message length
M_HELLO, M_REQ, M_RSP = b"LDTH", b"LDRQ", b"LDRS"
READ, WRITE = 1, 2
#: REQ flags: ``F_PAD``: pad a READ's OK answer header to 16 bytes (``RSP`` with a 4-byte message of zeros),
#: so that the bytes after it keep the sender's 16-byte alignment (a payload copied from a source 12 bytes
#: off its alignment costs more than the whole request/reply of a small block on some machines).  An owner
#: that does not know the flag ignores it: its unpadded answer reads the same (a message of 0 bytes).
F_PAD = 1
#: REQ flags an owner whose HELLO says :data:`FEAT_QUICK` also knows: ``F_PAD``: every answer to the request
#: is NUL-padded to a multiple of 16 bytes, at least 16 (a client reads its header at once); on a WRITE
#: the ops are followed by zero bytes up to a multiple of 16 (its payload keeps the sender's alignment); ``F_EAGER``
#: on a WRITE: the payload follows the request at once (no "go"), and the one answer is ``RSP(ok)``, or
#: ``RSP(refused)``, after which the owner reads and drops the payload (never into a region; more than
#: ``llmdd.tcp.segment_bytes`` of it: the stream ends instead).
F_EAGER = 2
#: HELLO features (a byte older owners send as 0, older clients ignore): padded and eager writes
FEAT_QUICK = 1
ST_OK, ST_REFUSED, ST_ERROR = 0, 1, 2
WIRE_OP: Any   # packed (region <u4, offset <u8, length <u8), 20 bytes: a numpy dtype, defined at numpy's first use


@when_numpy_loaded
def _define_dtypes(numpy: Any) -> None:
    global WIRE_OP
    WIRE_OP = numpy.dtype([("region", "<u4"), ("offset", "<u8"), ("length", "<u8")])
MAX_OPS_PER_REQUEST = 1 << 18
MAX_MESSAGE = 4096
OK_PADDED = RSP.pack(M_RSP, ST_OK, 0, 0, 4) + bytes(4)   # the OK answer header of a READ with F_PAD


def send_rsp(sock: socket.socket, status: int, message: str = "", pad: int = 0) -> None:
    """An answer; with ``pad`` (the request's ``F_PAD``) its message is NUL-padded to at least 4 bytes and
    header and message to a multiple of 16 (a client that knows it reads 16 bytes at once)."""
    msg = message.encode()[:MAX_MESSAGE - 16]
    if pad:
        msg += bytes((4 - len(msg)) % 16)   # 12 + len(msg) a multiple of 16, len(msg) >= 4
    sock.sendall(RSP.pack(M_RSP, status, 0, 0, len(msg)) + msg)


def recv_rsp(sock: socket.socket, deadline: float) -> tuple[int, str]:
    return parse_rsp(sock, recv_exact(sock, RSP.size, deadline), deadline)


def parse_rsp(sock: socket.socket, head: bytearray, deadline: float) -> tuple[int, str]:
    magic, status, _, _, n = RSP.unpack(head)
    if magic != M_RSP or n > MAX_MESSAGE:
        raise Corrupt("bad response header from peer")
    # a padded answer (F_PAD) carries NULs after its message
    msg = bytes(recv_exact(sock, n, deadline)).rstrip(b"\0").decode(errors="replace") if n else ""
    return status, msg
