"""The bytes of a request over TLS (an SSL socket takes Python buffers only: no ``sendmsg``, no flags on a
receive): small ops staged up to ``_TLS_CHUNK`` and gathered or scattered with ``llmdd.lowlevel.copy_runs``,
large ones moved straight from or into their memory, a few as Python ints (the latency path)."""

from __future__ import annotations

import ctypes
import ssl
import threading
from typing import Callable, Union

from llmdd.lowlevel import Cancelled, PeerGone, copy_runs
from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none

from ._sock import arm_deadline, region_view

_TLS_CHUNK = 256 * 1024                    # TLS: small pieces are staged up to this, large ones sent in slices of it
_TLS_FEW = 8                               # TLS: batches of at most this many ops go as Python ints (latency path)
_TLS_INPLACE = 8 * 1024                    # TLS: received ops of this size or more land in place, smaller ones are staged


def move_tls(sock: ssl.SSLSocket, addrs: np.ndarray, ln: np.ndarray, deadline: Union[float, None], send: bool,
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
    span = region_view(lo, int((addrs[big] + ln[big]).max()) - lo)
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
    """:func:`move_tls` for a few ops: sent through the stage (one write per ``_TLS_CHUNK``), received in place."""
    if not send:
        for a, k in zip(al, ll):
            _recv_tls(sock, [region_view(a, k)], deadline, abort_check)
        return sum(ll)
    sa = _tls_stage_addr()
    stage = _tls_local.stage
    used = 0
    mm = ctypes.memmove
    for a, k in zip(al, ll):
        if used and (k >= _TLS_CHUNK or used + k > _TLS_CHUNK):
            tls_put(sock, memoryview(stage)[:used], deadline, abort_check)
            used = 0
        if k >= _TLS_CHUNK:
            _tls_one(sock, region_view(a, k), deadline, True, abort_check)
            continue
        mm(sa + used, a, k)
        used += k
    if used:
        tls_put(sock, memoryview(stage)[:used], deadline, abort_check)
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
            tls_put(sock, buf, deadline, abort_check)
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
        tls_put(sock, view[at:at + _TLS_CHUNK], deadline, abort_check)


_tls_local = threading.local()


def _tls_stage_addr() -> int:
    """The address of this thread's staging buffer (``_tls_local.stage``) of ``2 * _TLS_CHUNK`` bytes
    (kept: no allocation or page fault per stage)."""
    addr = getattr(_tls_local, "addr", None)
    if addr is None:
        _tls_local.stage = np.empty(2 * _TLS_CHUNK, np.uint8)
        addr = _tls_local.addr = _tls_local.stage.ctypes.data
    return addr


def tls_put(sock: ssl.SSLSocket, buf, deadline: Union[float, None],
             abort_check: Union[Callable[[], bool], None]) -> None:
    if abort_check is not None and abort_check():
        raise Cancelled("stream aborted")
    arm_deadline(sock, deadline)
    sock.sendall(buf)


def send_tls(sock: ssl.SSLSocket, views: list, deadline: Union[float, None] = None,
              abort_check: Union[Callable[[], bool], None] = None) -> None:
    """Send ``views`` in order over TLS (no sendmsg there): small ones staged into one buffer of up to
    ``_TLS_CHUNK`` bytes (one TLS write instead of one record each), large ones in slices of it."""
    staged = bytearray()

    def put(buf) -> None:
        tls_put(sock, buf, deadline, abort_check)

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
            arm_deadline(sock, deadline)
            r = sock.recv_into(v[got:], n - got)
            if r == 0:
                raise PeerGone("peer closed the stream in the middle of a batch")
            got += r
