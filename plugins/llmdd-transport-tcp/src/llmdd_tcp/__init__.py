"""llmdd transport ``tcp``: a one-sided client/server engine over TCP.

Every endpoint listens on ``host:0`` (ephemeral port, bound to the given host only) and
serves READ and WRITE requests against *its own* registered regions: the owner checks
region id, bounds and the remote-accessible flag of every op (vectorised, all or nothing)
before a byte moves, and refuses the whole request otherwise. The peer's memory is never
addressed directly, which is the trust level of this transport: the owner mediates every op.

Wire (little endian, one request at a time per stream):

* connect: server ``HELLO(magic, version, auth, endpoint_id[16], nonce_s[16])``; the client
  answers ``OPEN(nonce_c[16], handle[16], HMAC(key, "c"|id|nonce_s|nonce_c))`` where ``cap`` is
  the capability the owner granted to the client's link (``Endpoint.grant``; it reached the client
  inside the owner's descriptor, over the link's control connection), ``handle =
  SHA256("llmdd-tcp-handle"|cap)[:16]`` names the grant and ``key`` is ``cap`` itself, or
  ``HMAC(secret, "llmdd-tcp-key"|cap)`` with a shared secret.  The owner answers
  ``OPEN_RSP(0, HMAC(key, "s"|id|nonce_c|nonce_s))`` and from then on serves that stream for that
  grant only (its link live, its regions only), or ``OPEN_RSP(1, 0)`` and closes.  Neither the
  capability nor the secret is ever sent on a data connection.
* request: ``REQ(magic, kind, count, total)`` + ``count`` packed ``(region u4, offset u8,
  length u8)``; a segment carries at most ``segment_bytes`` of payload.
* READ: ``RSP(ok)`` + the bytes of every op in order, or ``RSP(refused, reason)``.
* WRITE: ``RSP(go)`` or ``RSP(refused)``; after go the client sends exactly ``total`` bytes,
  which the owner receives straight into the validated destinations; then ``RSP(ok)``. The
  owner never reads more than announced, and never reads before validating, so a WRITE can
  not overfill it; bytes in flight are capped by the segment size plus the socket buffers.

TLS: with ``llmdd.tls_*`` options (the engine's, which reach every transport) every data connection
is TLS first, built by :func:`llmdd._base.options.tls_config` as the engine's control connections are: mutual
with a CA, the server name checked as ``llmdd.tls_server_name`` says, refused without a CA unless
``llmdd.tls_insecure``.  The wire above is unchanged inside TLS.  ``describe()`` says ``tls``; a channel
refuses, before connecting, a peer whose ``tls`` differs from its own (no silent plaintext).  The
server runs the handshake on the I/O loop under the pending timer and caps; a failed one is counted
(``tls_failures``), logged and closed.

Data moves with ``sendmsg`` / ``recvmsg(MSG_WAITALL)`` (libc, through ctypes: the GIL is released)
over one ``struct iovec`` array per request, built from the numpy op arrays with numpy (region base
addresses by ``np.searchsorted``, plus offsets) and handed over IOV_MAX entries at a time: no copy
through ``bytes`` and no Python object per op. Large batches are coalesced and split over two streams.  Over TLS (no
``sendmsg``, no flags on receive, no ``MSG_PEEK``) the same windows go out as staged buffers of up
to 256 KiB (small ops) or slices of that size (large ones) and come in with ``recv_into`` straight
into the destinations; the loop notices a request by taking its first byte.  Deadlines on TLS
streams are Python socket timeouts (under ``SO_RCVTIMEO`` a blocking SSL read would retry forever).

Cancellation and deadlines: streams are blocking sockets armed with ``SO_RCVTIMEO`` /
``SO_SNDTIMEO`` set to the time left; cancel, deadline, close and deregistration shut the
sockets down and join the worker threads before the completion reports its error.

Serving: one I/O loop per endpoint (:class:`llmdd._control.ioloop.IoLoop`) accepts, runs the HELLO/AUTH
exchange without blocking and watches idle streams; a stream with a request waiting is served
by one of a bounded pool of workers (``llmdd.tcp.server_workers``), which keeps it while requests
follow each other closely (``llmdd.tcp.linger_ms``) and then hands it back to the loop.  No thread
waits on an idle stream.  A stream that has not proven it belongs to a link (a valid OPEN for a live
grant) within ``llmdd.tcp.pending_timeout_ms`` (10 s) is closed; at most ``llmdd.max_pending_connections`` (64)
such streams per endpoint and ``llmdd.max_pending_per_address`` (8) per source address are held;
past the per-address cap the next one is closed at once, and with every slot taken a newcomer from
an address holding fewer takes the place of the busiest address's oldest (else it is closed at once).

Grants (the trust boundary): the engine's link manager calls :meth:`TcpEndpoint.serve_links_only`
right after opening the endpoint, then :meth:`~TcpEndpoint.grant` once per link and incarnation with
a fresh 256-bit capability and the regions it announced to that link, and
:meth:`~TcpEndpoint.revoke` when the link ends (unlink, failure, replacement by a restarted peer,
finalize).  A stream serves one grant: every request is checked against the remote-accessible
regions *and* the grant's regions, and dies with the grant.  An endpoint used directly (tests,
``llmdd doctor``) serves the holders of its ``describe()``, which then carries an endpoint-wide
capability.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import hmac
import os
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from typing import Any, Callable, Mapping, Optional, TypeGuard, Union


from llmdd.plugin import hookimpl
from llmdd.lowlevel import EVENT_READ, EVENT_WRITE, IoLoop, PoolFull, TlsConfig, get_logger, tls_config
from llmdd.lowlevel import TransportError
from llmdd.status import LLMStatusCode
import msgspec

from llmdd.abc import CAPABILITY_BYTES, Channel, Completion, Endpoint, EndpointDescriptor, RegionDescriptor
from llmdd.abc import Transport, TransportInfo
from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none
from llmdd.lowlevel import when_numpy_loaded
from llmdd.lowlevel import Batch, BatchSet, Cancelled, Corrupt, DoneCompletion, MemRegion, PeerGone, RegionRegistry
from llmdd.lowlevel import RegionTable, RegisteredRegion, Refused, ThreadCompletion, TransportTimeout
from llmdd.lowlevel import coalesce_ops, copy_runs, decode_payload, encode_payload, map_os_error, split_ops

__all__ = ["TcpTransport", "TcpEndpoint", "TcpChannel", "EndpointFields", "RegionFields", "endpoint_fields",
           "region_fields", "hookimpl", "llmdd_register_transports"]


_log = get_logger("llmdd.transport.tcp")

VERSION = 2
_HELLO = struct.Struct("<4sHBx16s16s")   # magic, version, auth, endpoint id, server nonce
_OPEN = struct.Struct("<16s16s32s")       # client nonce, grant handle, client mac
_AUTH_RSP = struct.Struct("<B32s")        # status, server mac
_REQ = struct.Struct("<4sBBHIQ")          # magic, kind, flags, pad, op count, payload bytes
_RSP = struct.Struct("<4sBBHI")           # magic, status, pad, pad, message length
_M_HELLO, _M_REQ, _M_RSP = b"LDTH", b"LDRQ", b"LDRS"
READ, WRITE = 1, 2
ST_OK, ST_REFUSED, ST_ERROR = 0, 1, 2
WIRE_OP: Any   # packed (region <u4, offset <u8, length <u8), 20 bytes: a numpy dtype, defined at numpy's first use


@when_numpy_loaded
def _define_dtypes(numpy: Any) -> None:
    global WIRE_OP
    WIRE_OP = numpy.dtype([("region", "<u4"), ("offset", "<u8"), ("length", "<u8")])
MAX_OPS_PER_REQUEST = 1 << 18
MAX_MESSAGE = 4096
_WINDOW = 1024                             # iovec entries per sendmsg / recvmsg call (Linux IOV_MAX)
_TLS_CHUNK = 256 * 1024                    # TLS: small pieces are staged up to this, large ones sent in slices of it
_TLS_FEW = 8                               # TLS: batches of at most this many ops go as Python ints (latency path)
_TLS_INPLACE = 8 * 1024                    # TLS: received ops of this size or more land in place, smaller ones are staged

# options (engine options pass through; unknown keys such as "llm.RdmaTrafficClass" are ignored)
OPT_STREAMS = "llmdd.tcp.streams"
OPT_INLINE = "llmdd.tcp.inline_max_bytes"
OPT_SPLIT = "llmdd.tcp.split_min_bytes"
OPT_SEGMENT = "llmdd.tcp.segment_bytes"
OPT_SERVER_SEND_TIMEOUT = "llmdd.tcp.server_send_timeout"
OPT_PENDING_TIMEOUT = "llmdd.tcp.pending_timeout_ms"
OPT_SERVER_WORKERS = "llmdd.tcp.server_workers"
OPT_LINGER = "llmdd.tcp.linger_ms"
OPT_MAX_PENDING = "llmdd.max_pending_connections"            # the engine's keys: one policy for every port
OPT_MAX_PENDING_PER_ADDRESS = "llmdd.max_pending_per_address"
_DEFAULTS = {OPT_STREAMS: 2, OPT_INLINE: 256 * 1024, OPT_SPLIT: 4 * 1024 * 1024,
             OPT_SEGMENT: 64 * 1024 * 1024, OPT_SERVER_SEND_TIMEOUT: 60.0, OPT_PENDING_TIMEOUT: 10000,
             OPT_SERVER_WORKERS: 8, OPT_LINGER: 50, OPT_MAX_PENDING: 64, OPT_MAX_PENDING_PER_ADDRESS: 8}
_ACCEPT_PAUSE_S = 0.1
#: the grant of an endpoint not (yet) serving links only: every region, for holders of ``describe()``
_DIRECT = -1


# --------------------------------------------------------------------------- low-level I/O


_memview = ctypes.pythonapi.PyMemoryView_FromMemory
_memview.restype = ctypes.py_object
_memview.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
_PyBUF_WRITE = 0x200


def _region_view(addr: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes at ``addr`` (PyMemoryView_FromMemory: a ctypes array type per
    length would be created, ~20 us, and cached by ctypes for ever, for every length a batch brings)."""
    if size == 0:
        return memoryview(bytearray(0))
    return _memview(addr, size, _PyBUF_WRITE)


def _is_tls(sock: socket.socket) -> TypeGuard[ssl.SSLSocket]:
    return isinstance(sock, ssl.SSLSocket)


def _set_timeouts(sock: socket.socket, seconds: float) -> None:
    seconds = max(seconds, 1e-3)
    if _is_tls(sock):
        # an SSL socket needs Python's own timeout: under SO_RCVTIMEO a blocking SSL read retries forever
        sock.settimeout(seconds)
        return
    tv = struct.pack("ll", int(seconds), int((seconds % 1.0) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _arm(sock: socket.socket, deadline: Union[float, None]) -> None:
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransportTimeout("deadline passed")
    _set_timeouts(sock, left)


class _StaleStream(PeerGone):
    """A reused idle stream turned out closed before any byte of the answer came back."""


def _recv_exact(sock: socket.socket, n: int, deadline: Union[float, None] = None, *,
                stale_ok: bool = False) -> bytearray:
    buf = bytearray(n)
    mv = memoryview(buf)
    got = 0
    flags = _waitall(sock)
    while got < n:
        _arm(sock, deadline)
        r = sock.recv_into(mv[got:], n - got, flags)
        if r == 0:
            if stale_ok and got == 0:
                raise _StaleStream("peer closed the stream before answering")
            raise PeerGone("peer closed the stream")
        got += r
    return buf


def _waitall(sock: socket.socket) -> int:
    """``MSG_WAITALL`` on a plain socket; an SSL socket takes no flags (it returns a record at a time)."""
    return 0 if _is_tls(sock) else socket.MSG_WAITALL


def _advance(views: list, k: int) -> list:
    i = 0
    while k >= len(views[i]):
        k -= len(views[i])
        i += 1
    views = views[i:]
    views[0] = views[0][k:]
    return views


class _Where:
    """Where the regions of a batch (or a served request) live: sorted region ids and their base
    addresses (the registry's snapshot taken when their pins were taken: it holds them)."""

    __slots__ = ("ids", "addrs")

    def __init__(self, ids: np.ndarray, addrs: np.ndarray) -> None:
        self.ids, self.addrs = ids, addrs


class _MsgHdr(ctypes.Structure):
    _fields_ = [("msg_name", ctypes.c_void_p), ("msg_namelen", ctypes.c_uint32), ("msg_iov", ctypes.c_void_p),
                ("msg_iovlen", ctypes.c_size_t), ("msg_control", ctypes.c_void_p),
                ("msg_controllen", ctypes.c_size_t), ("msg_flags", ctypes.c_int)]


def _load_libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    for fn in (libc.sendmsg, libc.recvmsg):   # ctypes drops the GIL for the call
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_MsgHdr), ctypes.c_int]
        fn.restype = ctypes.c_ssize_t
    return libc


_libc = _load_libc()
_MSG_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)


def _static_buffer(data: bytes) -> tuple[Any, int, int]:
    """A buffer that lives as long as the module, as (keep-alive, address, length), for an iovec entry."""
    buf = ctypes.create_string_buffer(data, len(data))
    return buf, ctypes.addressof(buf), len(data)


#: the READ answer's OK header: the first iovec of the answer's first sendmsg
_OK_HEAD = _static_buffer(_RSP.pack(_M_RSP, ST_OK, 0, 0, 0))


def _vectored(sock: socket.socket, iov: np.ndarray, start: int, stop: int, total: int,
              deadline: Union[float, None], send: bool, abort_check: Union[Callable[[], bool], None]) -> None:
    """Send or receive every byte of ``iov[start:stop]`` (rows ``(address, length)``) with one
    sendmsg / recvmsg(MSG_WAITALL) on the descriptor, resumed with numpy after a short transfer."""
    fd = sock.fileno()
    msg = _MsgHdr()
    ref = ctypes.byref(msg)
    call, flags = (_libc.sendmsg, _MSG_NOSIGNAL) if send else (_libc.recvmsg, socket.MSG_WAITALL)
    base = iov.ctypes.data
    first, moved = start, 0
    while moved < total:
        if abort_check is not None and abort_check():
            raise Cancelled("stream aborted")
        _arm(sock, deadline)
        msg.msg_iov = base + first * 16
        msg.msg_iovlen = stop - first
        k = call(fd, ref, flags)
        if k < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            raise OSError(err, os.strerror(err))   # EAGAIN under SO_RCVTIMEO / SO_SNDTIMEO: a timeout
        if k == 0 and not send:
            raise PeerGone("peer closed the stream in the middle of a batch")
        moved += k
        if moved < total:   # resume inside the window: skip the entries done, trim the one in progress
            done = np.cumsum(iov[first:stop, 1], dtype=np.uint64)
            j = int(np.searchsorted(done, k, side="right"))
            first += j
            part = k - (int(done[j - 1]) if j else 0)
            if part:
                iov[first, 0] += np.uint64(part)
                iov[first, 1] -= np.uint64(part)


def _move(sock: socket.socket, where: _Where, reg: np.ndarray, off: np.ndarray, ln: np.ndarray,
          deadline: Union[float, None], send: bool, abort_check: Union[Callable[[], bool], None] = None,
          head: Union[tuple, None] = None, total: Union[int, None] = None) -> int:
    """Send or receive the bytes of ops (``reg``, ``off``, ``ln``; ``total`` of them when the caller
    knows it), ``head`` (a :func:`_static_buffer`) first in the same call; return the payload bytes.
    The ops' addresses come from numpy (``np.searchsorted`` over the regions).  Plain sockets: one iovec
    array for the whole request, sent or received window by window (IOV_MAX entries a call).  TLS (an SSL
    socket takes Python buffers only): :func:`_move_tls`.  No per-op Python object either way."""
    n = len(ln)
    if _is_tls(sock):
        if head is not None:
            _tls_put(sock, head[0].raw, deadline, abort_check)
        if not n:
            return 0
        addrs = where.addrs[np.searchsorted(where.ids, reg)] + off.astype(np.uint64, copy=False)
        return _move_tls(sock, addrs, ln.astype(np.uint64, copy=False), deadline, send, abort_check)
    h = 0 if head is None else 1
    rows = n + h
    iov = np.empty((rows, 2), dtype=np.uint64)
    if head is not None:
        iov[0] = head[1:]
    if n:
        np.add(where.addrs[np.searchsorted(where.ids, reg)], off, out=iov[h:, 0], casting="unsafe")
        iov[h:, 1] = ln
    if rows <= _WINDOW:
        payload = int(ln.sum(dtype=np.uint64)) if total is None else total
        _vectored(sock, iov, 0, rows, payload + (head[2] if head is not None else 0), deadline, send, abort_check)
        return payload
    ends = np.cumsum(iov[:, 1], dtype=np.uint64)
    for s in range(0, rows, _WINDOW):
        e = min(s + _WINDOW, rows)
        _vectored(sock, iov, s, e, int(ends[e - 1]) - (int(ends[s - 1]) if s else 0), deadline, send, abort_check)
    return int(ends[-1]) - (head[2] if head is not None else 0)


def _move_tls(sock: ssl.SSLSocket, addrs: np.ndarray, ln: np.ndarray, deadline: Union[float, None], send: bool,
              abort_check: Union[Callable[[], bool], None]) -> int:
    """The bytes of ops at ``addrs`` (``ln`` each) over TLS, in order: consecutive small ops are staged
    in one buffer of up to ``_TLS_CHUNK`` (gathered with ``llmdd.lowlevel.copy_runs`` before a send,
    scattered after a receive: one TLS write or read sequence per stage, no Python object per op, and a
    receive writes a stage's ops only once all of its bytes came).  Small: under ``_TLS_CHUNK`` bytes
    on a send (one write of a stage beats a write per op), under ``_TLS_INPLACE`` on a receive (from
    there on, receiving into the op's memory, a slice of one view of the batch's address span, is
    cheaper than the stage's extra copy of its bytes; bench/results-committed/issue17/
    tcp_tls_move_micro-*.txt).  Other ops move straight from or into their memory.  At most
    ``_TLS_FEW`` ops (the latency path) go as Python ints, without numpy's fixed costs."""
    n = len(ln)
    if n <= _TLS_FEW:
        return _tls_few(sock, addrs.tolist(), ln.tolist(), deadline, send, abort_check)
    ends = np.cumsum(ln, dtype=np.uint64)
    big = np.flatnonzero(ln >= np.uint64(_TLS_CHUNK if send else _TLS_INPLACE))
    if not len(big):
        _tls_stages(sock, addrs, ln, ends, 0, n, deadline, send, abort_check)
        return int(ends[-1])
    # one view of the address span of the batch's large ops (nothing outside the ops is touched, and
    # they lie inside the pinned regions); a slice of it per large op, runs of them in one call
    lo = int(addrs[big].min())
    span = _region_view(lo, int((addrs[big] + ln[big]).max()) - lo)
    at, k = (addrs[big] - np.uint64(lo)).tolist(), ln[big].tolist()
    s = 0
    i = 0
    for run in np.split(np.arange(len(big)), np.flatnonzero(np.diff(big) != 1) + 1):
        b0, b1 = int(big[run[0]]), int(big[run[-1]])
        if b0 > s:
            _tls_stages(sock, addrs, ln, ends, s, b0, deadline, send, abort_check)
        views = [span[at[j]:at[j] + k[j]] for j in range(i, i + len(run))]
        if send:
            for v in views:
                _tls_one(sock, v, deadline, True, abort_check)
        else:
            _recv_tls(sock, views, deadline, abort_check)
        i += len(run)
        s = b1 + 1
    if s < n:
        _tls_stages(sock, addrs, ln, ends, s, n, deadline, send, abort_check)
    return int(ends[-1])


def _tls_few(sock: ssl.SSLSocket, al: list, ll: list, deadline: Union[float, None], send: bool,
             abort_check: Union[Callable[[], bool], None]) -> int:
    """:func:`_move_tls` for a few ops: sent through the stage (one write per ``_TLS_CHUNK``), received in place."""
    if not send:
        for a, k in zip(al, ll):
            _recv_tls(sock, [_region_view(a, k)], deadline, abort_check)
        return sum(ll)
    sa = _tls_stage_addr()
    stage = _tls_local.stage
    used = 0
    mm = ctypes.memmove
    for a, k in zip(al, ll):
        if used and (k >= _TLS_CHUNK or used + k > _TLS_CHUNK):
            _tls_put(sock, memoryview(stage)[:used], deadline, abort_check)
            used = 0
        if k >= _TLS_CHUNK:
            _tls_one(sock, _region_view(a, k), deadline, True, abort_check)
            continue
        mm(sa + used, a, k)
        used += k
    if used:
        _tls_put(sock, memoryview(stage)[:used], deadline, abort_check)
    return sum(ll)


def _tls_stages(sock: ssl.SSLSocket, addrs: np.ndarray, ln: np.ndarray, ends: np.ndarray, s: int, stop: int,
                deadline: Union[float, None], send: bool, abort_check: Union[Callable[[], bool], None]) -> None:
    """Ops ``s:stop`` (each under ``_TLS_CHUNK`` bytes) in stages: the ops starting in one ``_TLS_CHUNK``
    of the batch's byte stream form a stage (under ``2 * _TLS_CHUNK`` bytes), all cut at once."""
    e_ = ends[s:stop]
    l_ = ln[s:stop]
    a_ = addrs[s:stop]
    starts = e_ - l_
    key = starts // np.uint64(_TLS_CHUNK)
    cuts = [0, *(np.flatnonzero(key[1:] != key[:-1]) + 1).tolist(), stop - s]
    first = starts[cuts[:-1]]
    at = starts - np.repeat(first, np.diff(cuts)) + np.uint64(_tls_stage_addr())
    stage = _tls_local.stage
    for i, j, base, end in zip(cuts[:-1], cuts[1:], first.tolist(), e_[np.array(cuts[1:]) - 1].tolist()):
        buf = memoryview(stage)[:end - base]
        if send:
            copy_runs(at[i:j], a_[i:j], l_[i:j])
            _tls_put(sock, buf, deadline, abort_check)
        else:
            _recv_tls(sock, [buf], deadline, abort_check)
            copy_runs(a_[i:j], at[i:j], l_[i:j])


def _tls_one(sock: ssl.SSLSocket, view: memoryview, deadline: Union[float, None], send: bool,
             abort_check: Union[Callable[[], bool], None]) -> None:
    """One op's memory over TLS, in place: sent in writes of at most ``_TLS_CHUNK``, or received into."""
    if not send:
        _recv_tls(sock, [view], deadline, abort_check)
        return
    for at in range(0, len(view), _TLS_CHUNK):
        _tls_put(sock, view[at:at + _TLS_CHUNK], deadline, abort_check)


_tls_local = threading.local()


def _tls_stage_addr() -> int:
    """The address of this thread's staging buffer (``_tls_local.stage``) of ``2 * _TLS_CHUNK`` bytes
    (kept: no allocation or page fault per stage)."""
    addr = getattr(_tls_local, "addr", None)
    if addr is None:
        _tls_local.stage = np.empty(2 * _TLS_CHUNK, np.uint8)
        addr = _tls_local.addr = _tls_local.stage.ctypes.data
    return addr


def _tls_put(sock: ssl.SSLSocket, buf, deadline: Union[float, None],
             abort_check: Union[Callable[[], bool], None]) -> None:
    if abort_check is not None and abort_check():
        raise Cancelled("stream aborted")
    _arm(sock, deadline)
    sock.sendall(buf)


def _send_tls(sock: ssl.SSLSocket, views: list, deadline: Union[float, None] = None,
              abort_check: Union[Callable[[], bool], None] = None) -> None:
    """Send ``views`` in order over TLS (no sendmsg there): small ones staged into one buffer of up to
    ``_TLS_CHUNK`` bytes (one TLS write instead of one record each), large ones in slices of it."""
    staged = bytearray()

    def put(buf) -> None:
        _tls_put(sock, buf, deadline, abort_check)

    for v in views:
        n = len(v)
        if n < _TLS_CHUNK:
            staged += v
            if len(staged) >= _TLS_CHUNK:
                put(staged)
                staged = bytearray()
            continue
        if staged:
            put(staged)
            staged = bytearray()
        for at in range(0, n, _TLS_CHUNK):
            put(v[at:at + _TLS_CHUNK])
    if staged:
        put(staged)


def _recv_tls(sock: ssl.SSLSocket, views: list, deadline: Union[float, None] = None,
              abort_check: Union[Callable[[], bool], None] = None) -> None:
    """Receive exactly the bytes of ``views`` over TLS, straight into them (no MSG_WAITALL there)."""
    for v in views:
        got, n = 0, len(v)
        while got < n:
            if abort_check is not None and abort_check():
                raise Cancelled("stream aborted")
            _arm(sock, deadline)
            r = sock.recv_into(v[got:], n - got)
            if r == 0:
                raise PeerGone("peer closed the stream in the middle of a batch")
            got += r


def _sendmsg_all(sock: socket.socket, bufs: list) -> None:
    if _is_tls(sock):
        _send_tls(sock, bufs)
        return
    total = sum(len(b) for b in bufs)
    k = sock.sendmsg(bufs)
    if k < total:
        for b in _advance(bufs, k):
            sock.sendall(b)


_map_exc = map_os_error   # a TLS failure is a typed refusal, EAGAIN under SO_RCVTIMEO a timeout


def _send_rsp(sock: socket.socket, status: int, message: str = "") -> None:
    msg = message.encode()[:MAX_MESSAGE]
    sock.sendall(_RSP.pack(_M_RSP, status, 0, 0, len(msg)) + msg)


def _recv_rsp(sock: socket.socket, deadline: float) -> tuple[int, str]:
    return _parse_rsp(sock, _recv_exact(sock, _RSP.size, deadline), deadline)


def _parse_rsp(sock: socket.socket, head: bytearray, deadline: float) -> tuple[int, str]:
    magic, status, _, _, n = _RSP.unpack(head)
    if magic != _M_RSP or n > MAX_MESSAGE:
        raise Corrupt("bad response header from peer")
    msg = bytes(_recv_exact(sock, n, deadline)).decode(errors="replace") if n else ""
    return status, msg


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def _handle(cap: bytes) -> bytes:
    """The public name of a grant: it tells the owner which grant a stream claims, not the capability."""
    return hashlib.sha256(b"llmdd-tcp-handle" + cap).digest()[:16]


def _cap_key(cap: bytes, secret: Union[bytes, None]) -> bytes:
    """The MAC key of a data connection: the capability, bound to the shared secret when there is one."""
    return cap if secret is None else _mac(secret, b"llmdd-tcp-key", cap)


class _Grant:
    """What one link (``link_id``) may do on this endpoint's data port, while ``alive``."""

    __slots__ = ("link_id", "handle", "key", "regions", "region_ids", "alive", "busy", "conns")

    def __init__(self, link_id: int, cap: bytes, secret: Union[bytes, None],
                 regions: Union[frozenset, None]) -> None:
        self.link_id = link_id
        self.handle = _handle(cap)
        self.key = _cap_key(cap, secret)
        self.alive = True
        self.busy = 0
        self.conns: set = set()
        self.set_regions(regions)

    def set_regions(self, regions: Union[frozenset, None]) -> None:
        self.regions = regions
        self.region_ids = None if regions is None else np.array(sorted(regions), dtype=np.int64)

    def __repr__(self) -> str:   # never the key
        return f"<tcp grant link={self.link_id} alive={self.alive} regions={self.regions!r}>"

    def check(self, ids: np.ndarray) -> None:
        """Raise :class:`Refused` unless every region id of ``ids`` is in the grant."""
        if self.regions is None or not len(ids):
            return
        if len(ids) <= 8:
            for r in ids.tolist():
                if r not in self.regions:
                    raise Refused(f"remote region {r} is not granted to this link")
            return
        inside = np.isin(ids.astype(np.int64, copy=False), self.region_ids)
        if not inside.all():
            raise Refused(f"remote region {int(ids[np.argmin(inside)])} is not granted to this link")


def _shutdown(sock: socket.socket) -> None:
    """Shut the descriptor down (from any thread). On an SSL socket the plain socket's call: the SSL
    one also drops the SSL object, under the feet of a thread still reading or writing with it."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


def _readable(sock: socket.socket) -> bool:
    """True when ``sock`` has data or EOF pending (a zero-timeout poll; no byte is consumed)."""
    try:
        if _is_tls(sock) and sock.pending():
            return True
        ready, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(ready)


def _close(sock: socket.socket) -> None:
    _shutdown(sock)
    try:
        sock.close()
    except OSError:
        pass


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# --------------------------------------------------------------------------- descriptors


class EndpointFields(msgspec.Struct, frozen=True, kw_only=True):
    """The payload of a tcp :class:`~llmdd.abc.EndpointDescriptor` (version :data:`VERSION`); the
    data capability travels beside it, in the descriptor's ``capability``."""

    host: str
    port: int
    endpoint_id: bytes
    auth: bool = False
    tls: bool = False
    pid: int = 0
    hostname: str = ""


class RegionFields(msgspec.Struct, frozen=True, kw_only=True):
    """The payload of a tcp :class:`~llmdd.abc.RegionDescriptor` (version :data:`VERSION`)."""

    endpoint_id: bytes
    region_id: int
    size: int
    remote_accessible: bool


def endpoint_fields(desc: EndpointDescriptor) -> EndpointFields:
    """The fields of a tcp endpoint descriptor (:class:`Refused` for another's, a newer or a malformed one)."""
    return decode_payload(desc, transport="tcp", version=VERSION, type=EndpointFields)


def region_fields(desc: RegionDescriptor) -> RegionFields:
    """The fields of a tcp region descriptor (:class:`Refused` for another's, a newer or a malformed one)."""
    return decode_payload(desc, transport="tcp", version=VERSION, type=RegionFields)


# --------------------------------------------------------------------------- transport


class TcpTransport(Transport):
    """Any host to any host over TCP; the owner mediates every op."""

    name = "tcp"
    priority = 10
    same_host_only = False
    authenticates = True

    @classmethod
    def probe(cls) -> TransportInfo:
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.close()
        except OSError as exc:
            return TransportInfo(name=cls.name, available=False, reason=f"no TCP sockets: {exc}")
        if not hasattr(socket.socket, "recvmsg_into"):
            return TransportInfo(name=cls.name, available=False, reason="socket.recvmsg_into is not available")
        return TransportInfo(name=cls.name, available=True, reason="",
                             details={"version": VERSION, "window": _WINDOW})

    def __init__(self, options: Mapping[str, str]) -> None:
        super().__init__(options)
        self._cfg = {k: type(v)(self.options.get(k, v)) for k, v in _DEFAULTS.items()}
        # the engine's options reach every transport: with llmdd.tls_* set, data connections use TLS
        # under the same policy as the engine's control connections (llmdd._base.options.tls_config)
        self._tls = tls_config(self.options)
        if self._tls is not None:
            self._tls.server.num_tickets = 0   # no session tickets: nothing unasked-for on an idle stream

    def open_endpoint(self, *, host: str = "127.0.0.1", secret: Union[bytes, None] = None) -> "TcpEndpoint":
        return TcpEndpoint(host=host, secret=secret, cfg=self._cfg, tls=self._tls)


@hookimpl
def llmdd_register_transports(register: Callable[[type], Any]) -> None:
    register(TcpTransport)


class _Reg(RegisteredRegion):
    __slots__ = ()


class _Batch(Batch):
    """A batch and its sockets, so that cancel/deadline/deregister can kill them."""

    __slots__ = ("socks", "lock")

    def __init__(self) -> None:
        super().__init__()
        self.socks: list[socket.socket] = []
        self.lock = threading.Lock()

    def adopt(self, sock: socket.socket) -> None:
        with self.lock:
            self.socks.append(sock)
            if not self.aborted:
                return
        _shutdown(sock)
        raise Cancelled("batch aborted")

    def on_abort(self) -> None:
        with self.lock:
            socks = list(self.socks)
        for s in socks:
            _shutdown(s)


class TcpEndpoint(Endpoint):
    """Listens on ``host:ephemeral``; serves its own regions to granted links; opens channels to peers."""

    capabilities = True

    def __init__(self, *, host: str, secret: Union[bytes, None], cfg: Mapping[str, Any],
                 tls: Union[TlsConfig, None] = None) -> None:
        self._host = host
        self._secret = secret
        self._tls = tls
        self._cfg = dict(cfg)
        self._id = os.urandom(16)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._regs: RegionRegistry[_Reg] = RegionRegistry(self._cond)
        self._closed = False
        self._server_conns: dict[socket.socket, _ServerConn] = {}
        self._pending: dict[_ServerConn, None] = {}
        self._pending_by_ip: dict[str, int] = {}
        self._serving: dict[int, tuple[socket.socket, frozenset]] = {}
        self._channels: set[TcpChannel] = set()
        self._grants: dict[int, _Grant] = {}
        self._by_handle: dict[bytes, _Grant] = {}
        self._revoked: set[int] = set()
        self._direct = secrets.token_bytes(CAPABILITY_BYTES)
        self._links_only = False
        self._install(_DIRECT, self._direct, None)
        # int counters, last_error and listener_failed (str or None)
        self._stats: dict[str, Any] = {"bytes_served": 0, "ops_served": 0, "requests": 0, "refused": 0,
                       "connections": 0, "auth_failures": 0, "last_error": None, "refused_connections": 0,
                       "pending_expired": 0, "evicted": 0, "accept_errors": 0, "listener_failed": None,
                       "capability_refused": 0, "grants_revoked": 0, "tls_failures": 0}
        self._lsock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._lsock.bind((host, 0))
        self._lsock.listen(128)
        self._lsock.setblocking(False)
        self._port = self._lsock.getsockname()[1]
        self._log = _log.bind(endpoint=self._id.hex()[:8], port=self._port)
        self._linger = max(0.0, float(self._cfg[OPT_LINGER]) / 1000.0)
        self._pending_s = max(1, int(self._cfg[OPT_PENDING_TIMEOUT])) / 1000.0
        self._last_accept_warning = 0.0
        self._on_listener_failed: list = []
        self._io = IoLoop(f"tcp-{self._port}", workers=max(1, int(self._cfg[OPT_SERVER_WORKERS])))
        self._io.on_dead(lambda exc: self._listener_dead(f"the endpoint's I/O loop stopped: {exc!r}"))
        self._io.set_events(self._lsock, EVENT_READ, self._on_accept)

    # ------------------------------------------------------------------ public API

    def describe(self) -> EndpointDescriptor:
        fields = EndpointFields(host=self._host, port=self._port, endpoint_id=self._id,
                                auth=self._secret is not None, tls=self._tls is not None, pid=os.getpid(),
                                hostname=socket.gethostname())
        with self._lock:
            # not serving links only: the description itself opens the port
            cap = None if self._links_only else self._direct
        return EndpointDescriptor(transport="tcp", version=VERSION, payload=encode_payload(fields), capability=cap)

    def listen_address(self) -> tuple[str, int]:
        return (self._host, self._port)

    # ------------------------------------------------------------------ grants

    def _install(self, link_id: int, cap: bytes, regions: Union[frozenset, None]) -> None:
        grant = _Grant(link_id, cap, self._secret, regions)
        self._grants[link_id] = grant
        self._by_handle[grant.handle] = grant

    def serve_links_only(self) -> None:
        with self._lock:
            self._links_only = True
        self.revoke(_DIRECT)

    def grant(self, link_id: int, capability: bytes, regions) -> None:
        link_id = int(link_id)
        capability = bytes(capability)
        if len(capability) < 16:
            raise Refused("a capability has at least 128 bits")
        ids = None if regions is None else frozenset(int(r) for r in regions)
        with self._lock:
            if self._closed or link_id in self._revoked:
                return
            old = self._grants.get(link_id)
            if old is not None and hmac.compare_digest(old.handle, _handle(capability)):
                old.set_regions(ids)
                return
        if old is not None:
            self.revoke(link_id)   # another capability for the same link: the old one dies first
            with self._lock:
                self._revoked.discard(link_id)
        with self._lock:
            if not self._closed and link_id not in self._revoked:
                self._install(link_id, capability, ids)

    def revoke(self, link_id: int) -> None:
        link_id = int(link_id)
        with self._lock:
            self._revoked.add(link_id)
            grant = self._grants.pop(link_id, None)
            if grant is None:
                return
            self._by_handle.pop(grant.handle, None)
            grant.alive = False
            self._stats["grants_revoked"] += 1
            conns = list(grant.conns)
        for conn in conns:      # idle ones see the end of stream on the loop, served ones fail in the worker
            _shutdown(conn.sock)
        with self._cond:
            while grant.busy:
                self._cond.wait()

    def register(self, region: MemRegion) -> RegionDescriptor:
        with self._lock:
            if self._closed:
                raise Cancelled("endpoint is closed")
            self._regs.add(_Reg(region))
        fields = RegionFields(endpoint_id=self._id, region_id=region.region_id, size=region.size,
                              remote_accessible=region.remote_accessible)
        return RegionDescriptor(transport="tcp", version=VERSION, payload=encode_payload(fields))

    def deregister(self, region_id: int) -> None:
        def stop_serving(_reg: _Reg) -> None:   # under the lock: requests serving it end (their streams die)
            for sock, regions in list(self._serving.values()):
                if region_id in regions:
                    _shutdown(sock)
        # cancel the batches touching it, then drain: wait until no batch or request pins it
        self._regs.deregister(region_id, locked=stop_serving)

    def connect(self, peer: EndpointDescriptor, *, timeout: float) -> "TcpChannel":
        if self._closed:
            raise Cancelled("endpoint is closed")
        fields = endpoint_fields(peer)
        try:
            ch = TcpChannel(self, fields, peer.capability)
        except (KeyError, TypeError, ValueError) as exc:
            raise Refused(f"bad tcp endpoint description: {exc!r}") from None
        sock = ch._open_stream(time.monotonic() + timeout)
        ch._release(sock)
        with self._lock:
            if self._closed:
                ch.close()
                raise Cancelled("endpoint is closed")
            self._channels.add(ch)
        return ch

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            channels = list(self._channels)
            conns = list(self._server_conns.items())
            for grant in self._grants.values():
                grant.alive = False
            self._grants.clear()
            self._by_handle.clear()
        _shutdown(self._lsock)
        lsock = self._lsock

        def forget_and_close() -> None:
            self._io.forget(lsock)
            _close(lsock)
        self._io.call_soon(forget_and_close)
        for ch in channels:
            ch.close()
        for sock, conn in conns:
            _shutdown(sock)
            self._io.call_soon(conn.release)
        self._io.close()   # joins the loop and the workers (each ends its stream: shut down above)
        self._regs.close()   # what is left: cancel, then drain

    def statistics(self) -> dict:
        with self._lock:
            return dict(self._stats, regions=len(self._regs), port=self._port, closed=self._closed,
                        tls=self._tls is not None,
                        open_connections=len(self._server_conns), pending_connections=len(self._pending),
                        threads=self._io.threads())

    # ------------------------------------------------------------------ shared with channels

    def _begin_batch(self, ops: np.ndarray, remote: RegionTable) -> tuple[_Batch, _Where]:
        """Validate ops and pin their local regions (deregister waits for the pin)."""
        batch = _Batch()
        with self._lock:
            if self._closed:
                raise Cancelled("endpoint is closed")
            self._regs.pin(ops, remote, batch)
            regs = self._regs
            where = _Where(regs.ids, regs.addrs)   # the snapshot holds the pinned regions
        return batch, where

    def _end_batch(self, batch: _Batch) -> None:
        self._regs.unpin(batch)   # a deregistered _Reg is still counted down: its drain waits on it

    def _forget_channel(self, ch: "TcpChannel") -> None:
        with self._lock:
            self._channels.discard(ch)

    # ------------------------------------------------------------------ server side

    def _on_accept(self, _mask: int) -> None:
        """The listening socket is readable (loop thread): admit what is ready, refuse over the caps."""
        for _ in range(64):
            try:
                sock, addr = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if self._closed:
                    return
                if exc.errno in (errno.EBADF, errno.EINVAL, errno.ENOTSOCK):
                    # the listening socket itself is gone: logged once, counted, never silent
                    self._io.forget(self._lsock)
                    self._listener_dead(str(exc))
                    return
                self._accept_trouble(exc)
                return
            except Exception as exc:  # noqa: BLE001 - refuse this attempt, keep the listener
                self._accept_trouble(exc)
                return
            self._admit(sock, addr)

    def on_listener_failed(self, callback: Callable[[str], None]) -> None:
        with self._lock:
            failed = self._stats["listener_failed"]
            if failed is None:
                self._on_listener_failed.append(callback)
        if failed is not None:
            callback(failed)

    def _listener_dead(self, error: str) -> None:
        """The data port cannot continue (its socket is broken, or its loop stopped): logged once,
        recorded in the statistics, and the owner told (:meth:`on_listener_failed`)."""
        with self._lock:
            if self._closed or self._stats["listener_failed"] is not None:
                return
            self._stats["listener_failed"] = error
            callbacks, self._on_listener_failed = self._on_listener_failed, []
        self._log.error("llmdd.transport.tcp.listener_failed", error=error)
        for cb in callbacks:
            try:
                cb(error)
            except Exception as exc:  # noqa: BLE001 - the owner's bug never hides the failure
                self._log.error("llmdd.transport.tcp.listener_failed_callback", error=repr(exc))

    def _accept_trouble(self, exc: BaseException) -> None:
        with self._lock:
            self._stats["accept_errors"] += 1
            self._stats["last_error"] = f"accept: {exc}"
        now = time.monotonic()
        if now - self._last_accept_warning > 5.0:
            self._last_accept_warning = now
            self._log.warning("llmdd.transport.tcp.accept_failed", error=repr(exc))
        # out of descriptors: the connection stays in the backlog; pause instead of spinning
        self._io.set_events(self._lsock, 0, self._on_accept)
        self._io.call_later(_ACCEPT_PAUSE_S, self._resume_accept)

    def _resume_accept(self) -> None:
        if not self._closed:
            self._io.set_events(self._lsock, EVENT_READ, self._on_accept)

    def _admit(self, sock: socket.socket, addr) -> None:
        ip = addr[0]
        try:
            if self._closed:
                raise Refused("endpoint is closed")
            if self._pending_by_ip.get(ip, 0) >= int(self._cfg[OPT_MAX_PENDING_PER_ADDRESS]):
                raise Refused(f"{ip} has too many connections that did not prove themselves yet")
            if len(self._pending) >= int(self._cfg[OPT_MAX_PENDING]):
                victim = self._eviction_victim(ip)
                if victim is None:
                    raise Refused("too many connections that did not prove themselves yet")
                with self._lock:
                    self._stats["evicted"] += 1
                self._proven(victim)   # its slot is the newcomer's from now on
                victim.finish(None)
            sock.setblocking(False)
            _tune(sock)
            if self._tls is not None:
                # the handshake runs on the loop (_ServerConn.start), under the pending timer and caps
                sock = self._tls.server.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            conn = _ServerConn(self, sock, ip)
        except Exception as exc:  # noqa: BLE001 - over a cap, or no memory: this one is closed at once
            with self._lock:
                self._stats["refused_connections"] += 1
            self._log.debug("llmdd.transport.tcp.connection_refused", peer=ip, reason=str(exc))
            _close(sock)
            return
        with self._lock:
            self._server_conns[sock] = conn
            self._stats["connections"] += 1
        self._pending[conn] = None
        self._pending_by_ip[ip] = self._pending_by_ip.get(ip, 0) + 1
        conn.start()

    def _eviction_victim(self, ip: str) -> Union["_ServerConn", None]:
        """With every pending slot taken (loop thread): the oldest pending stream of the address holding
        the most slots makes room, unless ``ip`` already holds as many (as on the control port: a flood
        from some addresses never locks another address's links out of the data port)."""
        busiest, count = None, self._pending_by_ip.get(ip, 0)
        for addr, n in self._pending_by_ip.items():
            if n > count:
                busiest, count = addr, n
        if busiest is None:
            return None
        for conn in self._pending:   # insertion order: the oldest first
            if conn.ip == busiest:
                return conn
        return None

    def _proven(self, conn: "_ServerConn") -> None:
        """``conn`` authenticated (or served its first request): it no longer counts as pending."""
        if self._pending.pop(conn, 0) is None:
            n = self._pending_by_ip.get(conn.ip, 1) - 1
            if n > 0:
                self._pending_by_ip[conn.ip] = n
            else:
                self._pending_by_ip.pop(conn.ip, None)
        conn.timer.cancel()

    def _open_grant(self, conn: "_ServerConn", nonce_c: bytes, handle: bytes, mac_c: bytes) -> Union[_Grant, None]:
        """The live grant an OPEN proves it holds, bound to ``conn``; ``None`` (counted, logged) if none."""
        with self._lock:
            grant = self._by_handle.get(handle)
            if grant is not None and grant.alive and not self._closed:
                if hmac.compare_digest(mac_c, _mac(grant.key, b"c", self._id, conn.nonce_s, nonce_c)):
                    grant.conns.add(conn)
                    conn.grant = grant
                    return grant
                key, what = "auth_failures", "authentication failed"
            else:
                key, what = "capability_refused", "no live link grant for the presented capability"
            self._stats[key] += 1
            self._stats["refused"] += 1
            self._stats["last_error"] = what
        self._log.warning("llmdd.transport.tcp.open_refused", peer=conn.ip, reason=what)
        return None

    def _serve_ready(self, conn: "_ServerConn") -> None:
        """A worker serves ``conn`` while requests keep coming, then hands it back to the loop."""
        sock = conn.sock
        try:
            sock.setblocking(True)
            _set_timeouts(sock, float(self._cfg[OPT_SERVER_SEND_TIMEOUT]))
            flags = _waitall(sock)
            while True:
                # over TLS the loop took the request's first byte (no MSG_PEEK there): it starts the header
                head, conn.head = conn.head, b""
                try:
                    hdr = head + _recv_exact(sock, _REQ.size - len(head))
                except PeerGone:
                    conn.finish(None)
                    return
                magic, kind, _, _, count, total = _REQ.unpack(hdr)
                if magic != _M_REQ or kind not in (READ, WRITE) or count > MAX_OPS_PER_REQUEST:
                    raise Corrupt(f"bad request header (kind={kind}, count={count})")
                wire = np.empty(count, dtype=WIRE_OP)
                if count:
                    got, mv = 0, memoryview(wire.view(np.uint8))
                    while got < len(mv):
                        r = sock.recv_into(mv[got:], len(mv) - got, flags)
                        if r == 0:
                            raise PeerGone("peer closed the stream mid-request")
                        got += r
                grant = conn.grant
                if grant is None:   # a stream is served only after its OPEN proved a grant
                    raise Refused("request on a stream that proved no grant")
                self._serve_request(sock, kind, wire, total, grant)
                if self._closed:
                    raise Cancelled("endpoint is closed")
                if not _wait_readable(sock, self._linger):
                    break
        except Exception as exc:  # noqa: BLE001 - a broken client must never break the endpoint
            err = _map_exc(exc)
            if not self._closed:
                with self._lock:
                    self._stats["last_error"] = str(err)
                self._log.info("llmdd.transport.tcp.conn_closed", error=str(err))
            conn.finish(err)
            return
        try:
            sock.setblocking(False)
        except OSError as exc:
            conn.finish(_map_exc(exc))
            return
        self._io.call_soon(conn.watch)

    def _serve_request(self, sock: socket.socket, kind: int, wire: np.ndarray, total: int, grant: _Grant) -> None:
        token = id(wire)
        with self._lock:
            if not grant.alive:
                raise PeerGone("the link of this stream ended (its capability was revoked)")
            try:
                self._regs.served.check(wire["region"], wire["offset"], wire["length"], "remote")
                grant.check(wire["region"])
                if int(wire["length"].sum(dtype=np.uint64)) != total:
                    raise Corrupt("announced payload does not match the op lengths")
            except Refused as exc:
                reason = str(exc)
                self._stats["refused"] += 1
                self._stats["last_error"] = reason
                refused: Optional[str] = reason
            else:
                refused = None
                # a few ops: their ids as ints (cheaper than numpy's fixed cost); more: the distinct ids only
                regions = wire["region"].tolist() if len(wire) <= 8 else np.unique(wire["region"]).tolist()
                ids = frozenset(regions)
                served = Batch(ids)   # the request's pins: a deregistration drains them
                self._regs.pin_entries(served, ids)
                grant.busy += 1
                where = _Where(self._regs.ids, self._regs.addrs)
                self._serving[token] = (sock, ids)
        if refused is not None:
            self._log.warning("llmdd.transport.tcp.refused", kind="read" if kind == READ else "write",
                              reason=refused)
            _send_rsp(sock, ST_REFUSED, refused)
            return
        try:
            if kind == READ:
                # the OK header and the first window of bytes leave in one sendmsg
                _move(sock, where, wire["region"], wire["offset"], wire["length"], None, send=True, head=_OK_HEAD,
                      total=total)
            else:
                _send_rsp(sock, ST_OK)
                try:
                    _move(sock, where, wire["region"], wire["offset"], wire["length"], None, send=False, total=total)
                except Exception:
                    self._log.warning("llmdd.transport.tcp.partial_write", regions=sorted(ids), bytes=total)
                    raise
                _send_rsp(sock, ST_OK)
            with self._lock:
                self._stats["bytes_served"] += total
                self._stats["ops_served"] += len(wire)
                self._stats["requests"] += 1
        finally:
            with self._cond:
                self._serving.pop(token, None)
                grant.busy -= 1
                self._regs.unpin_locked(served)


class _ServerConn:
    """One accepted data stream: (TLS handshake,) HELLO/AUTH on the loop, then idle on the loop or
    served by a worker."""

    __slots__ = ("ep", "sock", "ip", "nonce_s", "buf", "proven", "timer", "closed", "grant", "tls", "head")

    def __init__(self, ep: TcpEndpoint, sock: socket.socket, ip: str) -> None:
        self.ep = ep
        self.sock = sock
        self.ip = ip
        self.nonce_s = os.urandom(16)
        self.buf = bytearray()
        self.proven = False
        self.closed = False
        self.grant: Union[_Grant, None] = None
        self.tls: Optional[ssl.SSLSocket] = sock if _is_tls(sock) else None   # sock, when it is a TLS socket
        self.head = b""          # TLS: the first byte of a request, taken by the loop to see it come
        self.timer = ep._io.call_later(ep._pending_s, self.expire)

    def start(self) -> None:
        if self.tls is not None:
            self.handshake(0)
        else:
            self.hello()

    def handshake(self, _mask: int) -> None:
        """Drive the server side of the TLS handshake without blocking (loop thread)."""
        if self.tls is None:   # started only for a TLS stream (see start)
            raise TypeError("TLS handshake on a plain TCP stream")
        try:
            self.tls.do_handshake()
        except ssl.SSLWantReadError:
            self.ep._io.set_events(self.sock, EVENT_READ, self.handshake)
            return
        except ssl.SSLWantWriteError:
            self.ep._io.set_events(self.sock, EVENT_WRITE, self.handshake)
            return
        except (OSError, ValueError) as exc:
            # plaintext, a certificate our CA did not sign, no certificate: counted, logged, closed
            with self.ep._lock:
                self.ep._stats["tls_failures"] += 1
                self.ep._stats["last_error"] = f"TLS handshake failed: {exc}"
            self.ep._log.warning("llmdd.transport.tcp.tls_refused", peer=self.ip, error=str(exc))
            self.finish(None)
            return
        self.hello()

    def hello(self) -> None:
        hello = _HELLO.pack(_M_HELLO, VERSION, int(self.ep._secret is not None), self.ep._id, self.nonce_s)
        try:
            if self.sock.send(hello) != len(hello):   # 40 bytes into a fresh socket: all or broken
                raise PeerGone("short HELLO")
        except OSError as exc:
            self.finish(_map_exc(exc))
            return
        self.watch()

    def watch(self) -> None:
        """Idle: the loop waits for the next bytes (no thread)."""
        if self.closed:
            self.release()
            return
        handler = self.on_request if self.proven else self.on_open
        self.ep._io.set_events(self.sock, EVENT_READ, handler)
        if self.tls is not None and self.tls.pending():
            self.ep._io.call_soon(handler, EVENT_READ)   # bytes already decrypted: no readiness would come

    def on_open(self, _mask: int) -> None:
        while True:
            try:
                data = self.sock.recv(_OPEN.size - len(self.buf))
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except OSError as exc:
                self.finish(_map_exc(exc))
                return
            if not data:
                self.finish(None)
                return
            self.buf += data
            if len(self.buf) >= _OPEN.size:
                break
            if not (self.tls is not None and self.tls.pending()):
                return   # the rest comes with a later readiness (bytes buffered in TLS would not signal one)
        nonce_c, handle, mac_c = _OPEN.unpack(bytes(self.buf))
        self.buf = bytearray()
        ep = self.ep
        try:
            grant = ep._open_grant(self, nonce_c, handle, mac_c)
            if grant is None:
                self.sock.send(_AUTH_RSP.pack(1, bytes(32)))
                self.finish(None)
                return
            rsp = _AUTH_RSP.pack(0, _mac(grant.key, b"s", ep._id, nonce_c, self.nonce_s))
            if self.sock.send(rsp) != len(rsp):
                raise PeerGone("short AUTH response")
        except OSError as exc:
            self.finish(_map_exc(exc))
            return
        self.proven = True
        ep._proven(self)
        self.watch()

    def on_request(self, _mask: int) -> None:
        """Bytes wait on an idle stream: a worker takes it over (an end of stream is handled here)."""
        try:
            if self.tls is not None:
                # TLS has no MSG_PEEK, and a readable descriptor may hold a part of a record only: take
                # the first byte of the request (the worker reads the header on from it), or wait
                peek = self.head = self.sock.recv(1)
            else:
                peek = self.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except OSError as exc:
            self.finish(_map_exc(exc))
            return
        if not peek:
            self.finish(None)
            return
        self.ep._io.forget(self.sock)
        try:
            self.ep._io.pool.submit(self.ep._serve_ready, self)
        except PoolFull as exc:
            self.finish(PeerGone(f"no worker to serve the stream: {exc}"))

    def expire(self) -> None:
        if self.proven or self.closed:
            return
        with self.ep._lock:
            self.ep._stats["pending_expired"] += 1
        self.ep._log.debug("llmdd.transport.tcp.pending_expired", peer=self.ip, seconds=self.ep._pending_s)
        _shutdown(self.sock)
        self.finish(None)

    def finish(self, err: Union[TransportError, None]) -> None:
        """Close the stream (any thread); the loop forgets and closes the descriptor."""
        if self.closed:
            return
        self.closed = True
        _shutdown(self.sock)
        self.ep._io.call_soon(self.release)

    def release(self) -> None:
        ep = self.ep
        ep._proven(self) if self in ep._pending else self.timer.cancel()
        ep._io.forget(self.sock)
        with ep._lock:
            ep._server_conns.pop(self.sock, None)
            if self.grant is not None:
                self.grant.conns.discard(self)
        _close(self.sock)


def _wait_readable(sock: socket.socket, seconds: float) -> bool:
    if seconds <= 0:
        return False
    try:
        if _is_tls(sock) and sock.pending():
            return True   # decrypted bytes already buffered: the descriptor may never turn readable
        ready, _, _ = select.select([sock], [], [], seconds)
    except (OSError, ValueError):
        return True   # let the read report it
    return bool(ready)


class TcpChannel(Channel):
    """Streams to one peer endpoint, pooled; a batch takes one or two of them."""

    def __init__(self, endpoint: TcpEndpoint, peer: EndpointFields, cap: Optional[bytes]) -> None:
        self._ep = endpoint
        self._peer = peer
        self._addr = (peer.host, peer.port)
        self._peer_id = peer.endpoint_id
        if cap is None or len(cap) < 16:
            raise Refused("the tcp endpoint description carries no data capability (the owner grants one per "
                          "link, in the link handshake)", status_code=LLMStatusCode.LLM_LINK_FAILED)
        peer_tls = peer.tls
        if peer_tls and endpoint._tls is None:
            raise Refused(f"the tcp data port at {self._addr[0]}:{self._addr[1]} requires TLS and this side has no "
                          "llmdd.tls_* options", status_code=LLMStatusCode.LLM_LINK_FAILED)
        if endpoint._tls is not None and not peer_tls:
            raise Refused(f"TLS is configured here but the tcp data port at {self._addr[0]}:{self._addr[1]} is "
                          "plaintext: refused rather than sending data unencrypted",
                          status_code=LLMStatusCode.LLM_LINK_FAILED)
        self._handle = _handle(bytes(cap))
        self._key = _cap_key(bytes(cap), endpoint._secret)
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self._remote: dict[int, int] = {}
        self._remote_table = RegionTable()
        self._batches: BatchSet[_Batch] = BatchSet(threading.Condition(self._lock))
        self._cfg = endpoint._cfg
        # int counters, and last_error (str or None)
        self._stats: dict[str, Any] = {"bytes_read": 0, "bytes_written": 0, "ops_read": 0, "ops_written": 0,
                                       "batches": 0, "failed": 0, "streams_opened": 0, "last_error": None}

    # ------------------------------------------------------------------ public API

    def add_remote_region(self, region_id: int, size: int, desc: RegionDescriptor) -> None:
        if region_fields(desc).endpoint_id != self._peer_id:
            raise Refused(f"descriptor of region {region_id} belongs to another endpoint")
        with self._lock:
            self._remote[int(region_id)] = int(size)
            self._remote_table = RegionTable(self._remote)

    def remove_remote_region(self, region_id: int) -> None:
        with self._lock:
            self._remote.pop(int(region_id), None)
            self._remote_table = RegionTable(self._remote)

    def read(self, ops: np.ndarray, *, deadline: float) -> Completion:
        # the seam's one refusal path: a refusal or failure is the completion's error, never raised
        try:
            return self._submit(READ, ops, deadline)
        except TransportError as exc:
            return DoneCompletion(exc)

    def write(self, ops: np.ndarray, *, deadline: float) -> Completion:
        try:
            return self._submit(WRITE, ops, deadline)
        except TransportError as exc:
            return DoneCompletion(exc)

    def close(self) -> None:
        # refuse new batches, fail those in flight, wait until they left (the close-drain)
        if not self._batches.close(Cancelled("channel closed")):
            return
        with self._lock:
            idle, self._idle = self._idle, []
        for s in idle:
            _close(s)
        self._ep._forget_channel(self)

    def statistics(self) -> dict:
        with self._lock:
            return dict(self._stats, idle_streams=len(self._idle), remote_regions=len(self._remote),
                        closed=self._batches.closed)

    # ------------------------------------------------------------------ streams

    def _open_stream(self, deadline: float) -> socket.socket:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportTimeout("deadline passed before connecting")
        try:
            sock = socket.create_connection(self._addr, timeout=left)
        except OSError as exc:
            raise _map_exc(exc) from None
        try:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            tls = self._ep._tls
            if tls is not None:
                _tune(sock)
                plain = sock
                try:
                    # the server's certificate is checked as on control connections (llmdd.tls_server_name)
                    sock = tls.wrap_client(plain, self._addr[0])
                except BaseException:
                    plain.close()
                    raise
            magic, version, auth, peer_id, nonce_s = _HELLO.unpack(_recv_exact(sock, _HELLO.size))
            if magic != _M_HELLO or version != VERSION:
                raise Corrupt(f"peer at {self._addr} does not speak llmdd-tcp v{VERSION}")
            if peer_id != self._peer_id:
                raise PeerGone(f"peer at {self._addr} is another endpoint incarnation")
            secret = self._ep._secret
            if auth and secret is None:
                raise Refused("peer requires a shared secret", status_code=LLMStatusCode.LLM_LINK_FAILED)
            if not auth and secret is not None:
                raise Refused("peer does not authenticate but a secret is configured",
                              status_code=LLMStatusCode.LLM_LINK_FAILED)
            nonce_c = os.urandom(16)
            sock.sendall(_OPEN.pack(nonce_c, self._handle, _mac(self._key, b"c", peer_id, nonce_s, nonce_c)))
            status, mac_s = _AUTH_RSP.unpack(_recv_exact(sock, _AUTH_RSP.size))
            if status != 0 or not hmac.compare_digest(mac_s, _mac(self._key, b"s", peer_id, nonce_c, nonce_s)):
                raise Refused("the peer refused the data connection (no live link grant, or authentication "
                              "failed)", status_code=LLMStatusCode.LLM_LINK_FAILED)
            sock.settimeout(None)
            _tune(sock)
        except BaseException as exc:
            if sock is not None:   # None: the TLS wrap failed and closed its socket
                _close(sock)
            raise _map_exc(exc) from None
        with self._lock:
            self._stats["streams_opened"] += 1
        return sock

    def _acquire(self, batch: _Batch, deadline: float, *, fresh: bool = False) -> tuple[socket.socket, bool]:
        """A stream for ``batch`` and whether it was reused from the idle pool."""
        sock = None
        while not fresh:
            with self._lock:
                if self._batches.closed:
                    raise Cancelled("channel closed")
                sock = self._idle.pop() if self._idle else None
            if sock is None or not _readable(sock):
                break
            # an idle stream has nothing to read: readable means the owner closed it (it fails the
            # streams of batches that touched a region it deregistered); never reuse it
            _close(sock)
        reused = sock is not None
        if sock is None:
            sock = self._open_stream(deadline)
        batch.adopt(sock)
        return sock, reused

    def _release(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._batches.closed and len(self._idle) < 4:
                self._idle.append(sock)
                return
        _close(sock)

    # ------------------------------------------------------------------ batches

    def _submit(self, kind: int, ops: np.ndarray, deadline: float) -> Completion:
        with self._lock:
            if self._batches.closed:
                raise Cancelled("channel closed")
            remote = self._remote_table
        batch, where = self._ep._begin_batch(ops, remote)
        try:
            with self._lock:
                self._batches.add(batch)
        except BaseException:
            self._ep._end_batch(batch)
            raise
        try:
            ops = coalesce_ops(np.asarray(ops))
            total = int(ops["length"].sum(dtype=np.uint64)) if len(ops) else 0
        except BaseException:
            self._finish(batch)
            raise
        if total <= int(self._cfg[OPT_INLINE]):
            err = None
            try:
                self._run_stream(batch, kind, ops, where, deadline)
            except BaseException as exc:  # noqa: BLE001
                err = _map_exc(exc)
                if batch.aborted and not isinstance(err, Refused):
                    err = Cancelled(f"batch aborted: {err}")
            self._finish(batch, err, kind, ops, total)
            return DoneCompletion(err)
        streams = int(self._cfg[OPT_STREAMS]) if total >= int(self._cfg[OPT_SPLIT]) else 1
        parts = split_ops(ops, max(1, streams))
        workers = [(lambda p=p: self._run_stream_mapped(batch, kind, p, where, deadline)) for p in parts]
        batch.completion = ThreadCompletion(
            workers, deadline=deadline, abort=batch.abort,
            on_done=lambda c: self._finish(batch, c.recorded_error, kind, ops, total),
            name="llmdd-tcp-io")
        return batch.completion

    def _finish(self, batch: _Batch, err: Union[TransportError, None] = None, kind: int = READ,
                ops: Union[np.ndarray, None] = None, total: int = 0) -> None:
        with batch.lock:
            socks, batch.socks = batch.socks, []
        for s in socks:  # streams still owned by the batch were not released: they are broken
            _close(s)
        self._ep._end_batch(batch)
        with self._lock:
            self._batches.discard_locked(batch)
            if ops is None:
                return
            self._stats["batches"] += 1
            if err is None:
                key = "read" if kind == READ else "written"
                self._stats[f"bytes_{key}"] += total
                self._stats[f"ops_{key}"] += len(ops)
            else:
                self._stats["failed"] += 1
                self._stats["last_error"] = str(err)

    def _run_stream_mapped(self, batch: _Batch, kind: int, ops: np.ndarray, where: _Where, deadline: float) -> None:
        try:
            self._run_stream(batch, kind, ops, where, deadline)
        except TransportError:
            raise
        except Exception as exc:  # noqa: BLE001 - a socket timeout (EAGAIN under SO_RCVTIMEO) is a timeout
            raise _map_exc(exc) from None

    def _run_stream(self, batch: _Batch, kind: int, ops: np.ndarray, where: _Where, deadline: float) -> None:
        sock, reused = self._acquire(batch, deadline)
        seg_max = int(self._cfg[OPT_SEGMENT])
        ends = np.cumsum(ops["length"], dtype=np.uint64)
        start = 0
        n = len(ops)
        try:
            while start < n:
                base = int(ends[start - 1]) if start else 0
                stop = int(np.searchsorted(ends, base + seg_max, side="right"))
                stop = min(max(stop, start + 1), n, start + MAX_OPS_PER_REQUEST)
                try:
                    self._segment(sock, kind, ops[start:stop], where, deadline, batch)
                except _StaleStream as exc:
                    if not (reused and start == 0) or batch.aborted:
                        raise PeerGone(str(exc)) from None
                    # the owner closed this idle stream just as it was reused (nothing was moved): once
                    # more on a fresh one
                    with batch.lock:
                        if sock in batch.socks:
                            batch.socks.remove(sock)
                    _close(sock)
                    sock, reused = self._acquire(batch, deadline, fresh=True)
                    continue
                start = stop
        except Refused:
            # refusals come before any payload: the stream is still in step
            self._give_back(batch, sock)
            raise
        self._give_back(batch, sock)

    def _give_back(self, batch: _Batch, sock: socket.socket) -> None:
        with batch.lock:
            if batch.aborted or sock not in batch.socks:
                return
            batch.socks.remove(sock)
        self._release(sock)

    def _segment(self, sock: socket.socket, kind: int, ops: np.ndarray, where: _Where, deadline: float,
                 batch: _Batch) -> None:
        wire = np.empty(len(ops), dtype=WIRE_OP)
        wire["region"] = ops["remote_region"]
        wire["offset"] = ops["remote_offset"]
        wire["length"] = ops["length"]
        total = int(ops["length"].sum(dtype=np.uint64))
        _arm(sock, deadline)
        try:
            _sendmsg_all(sock, [_REQ.pack(_M_REQ, kind, 0, 0, len(ops), total), memoryview(wire.view(np.uint8))])
            head = _recv_exact(sock, _RSP.size, deadline, stale_ok=True)
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise _StaleStream(f"stream closed by the owner: {exc}") from None
        status, msg = _parse_rsp(sock, head, deadline)
        if status == ST_REFUSED:
            raise Refused(f"peer refused the batch: {msg}")
        if status != ST_OK:
            raise Corrupt(f"peer failed the batch: {msg}")
        aborted = lambda: batch.aborted  # noqa: E731
        _move(sock, where, ops["local_region"], ops["local_offset"], ops["length"], deadline,
              send=(kind == WRITE), abort_check=aborted, total=total)
        if kind == WRITE:
            status, msg = _recv_rsp(sock, deadline)
            if status != ST_OK:
                raise Corrupt(f"peer failed the write: {msg}")
