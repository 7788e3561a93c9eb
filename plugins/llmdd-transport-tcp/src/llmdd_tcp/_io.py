"""The bytes of a request on a plain socket: one ``struct iovec`` array built with numpy from the op arrays
(region base addresses by ``np.searchsorted``, plus offsets), moved by libc ``sendmsg`` /
``recvmsg(MSG_WAITALL)`` through ctypes (the GIL released) ``WINDOW`` (IOV_MAX) entries at a time, and
resumed with numpy after a short transfer.  :func:`move` hands a TLS socket to :mod:`._tls_io`."""

from __future__ import annotations

import ctypes
import errno
import os
import socket
from typing import Any, Callable, Union

from llmdd.lowlevel import Cancelled, PeerGone
from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none

from ._sock import arm_deadline, is_tls
from ._tls_io import move_tls, send_tls, tls_put
from ._wire import M_RSP, OK_PADDED, RSP, ST_OK

WINDOW = 1024                             # iovec entries per sendmsg / recvmsg call (Linux IOV_MAX)


def advance(views: list, k: int) -> list:
    i = 0
    while k >= len(views[i]):
        k -= len(views[i])
        i += 1
    views = views[i:]
    views[0] = views[0][k:]
    return views


class Where:
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
OK_HEAD = _static_buffer(RSP.pack(M_RSP, ST_OK, 0, 0, 0))
OK_HEAD_PADDED = _static_buffer(OK_PADDED)   # the same, for a request with F_PAD


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
        arm_deadline(sock, deadline)
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


def move(sock: socket.socket, where: Where, reg: np.ndarray, off: np.ndarray, ln: np.ndarray,
          deadline: Union[float, None], send: bool, abort_check: Union[Callable[[], bool], None] = None,
          head: Union[tuple, None] = None, total: Union[int, None] = None) -> int:
    """Send or receive the bytes of ops (``reg``, ``off``, ``ln``; ``total`` of them when the caller
    knows it), ``head`` (a :func:`_static_buffer`) first in the same call; return the payload bytes.
    The ops' addresses come from numpy (``np.searchsorted`` over the regions).  Plain sockets: one iovec
    array for the whole request, sent or received window by window (IOV_MAX entries a call).  TLS (an SSL
    socket takes Python buffers only): :func:`move_tls`.  No per-op Python object either way."""
    n = len(ln)
    if is_tls(sock):
        if head is not None:
            tls_put(sock, head[0].raw, deadline, abort_check)
        if not n:
            return 0
        addrs = where.addrs[np.searchsorted(where.ids, reg)] + off.astype(np.uint64, copy=False)
        return move_tls(sock, addrs, ln.astype(np.uint64, copy=False), deadline, send, abort_check)
    h = 0 if head is None else 1
    rows = n + h
    iov = np.empty((rows, 2), dtype=np.uint64)
    if head is not None:
        iov[0] = head[1:]
    if n:
        np.add(where.addrs[np.searchsorted(where.ids, reg)], off, out=iov[h:, 0], casting="unsafe")
        iov[h:, 1] = ln
    if rows <= WINDOW:
        payload = int(ln.sum(dtype=np.uint64)) if total is None else total
        _vectored(sock, iov, 0, rows, payload + (head[2] if head is not None else 0), deadline, send, abort_check)
        return payload
    ends = np.cumsum(iov[:, 1], dtype=np.uint64)
    for s in range(0, rows, WINDOW):
        e = min(s + WINDOW, rows)
        _vectored(sock, iov, s, e, int(ends[e - 1]) - (int(ends[s - 1]) if s else 0), deadline, send, abort_check)
    return int(ends[-1]) - (head[2] if head is not None else 0)


#: a read's last bytes leave from a copy of at most this many (see :func:`cut_tail`; the C owner's
#: TAIL and COPY_ALL in _tcpfast.c are the same two sizes)
TAIL = 4096
#: the few-ops path answers a read of at most this many bytes from one copy of the header and the
#: bytes, sent after the release (past about there a second send costs less than the copy)
COPY_ALL = 1 << 14


def cut_tail(where: Where, reg: np.ndarray, off: np.ndarray, ln: np.ndarray) -> tuple:
    """``(reg, off, ln, tail)``: the ops without the last (at most :data:`TAIL`) bytes of their last
    non-empty op, and a copy of those bytes.  An owner sends the ops, copies the tail while the request
    still pins its regions, releases them, then sends the copy: the client has its whole answer only
    after the owner let go of the regions, so a deregistration the client asks for next never finds the
    request still serving (and never cuts the stream the client keeps for its next request)."""
    nz = np.flatnonzero(ln)
    if not len(nz):
        return reg, off, ln, b""
    j = int(nz[-1])
    n = int(ln[j])
    k = min(n, TAIL)
    addr = int(where.addrs[np.searchsorted(where.ids, reg[j])]) + int(off[j]) + n - k
    tail = ctypes.string_at(addr, k)
    if n == k:   # the whole op is in the tail
        return reg[:j], off[:j], ln[:j], tail
    body = ln[:j + 1].copy()
    body[j] = n - k
    return reg[:j + 1], off[:j + 1], body, tail


def sendmsg_all(sock: socket.socket, bufs: list) -> None:
    if is_tls(sock):
        send_tls(sock, bufs)
        return
    total = sum(len(b) for b in bufs)
    k = sock.sendmsg(bufs)
    if k < total:
        for b in advance(bufs, k):
            sock.sendall(b)
