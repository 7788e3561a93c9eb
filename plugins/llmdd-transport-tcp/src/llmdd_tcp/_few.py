"""The owner's few-ops path (issue 21): a request of at most :data:`FEW_OPS` ops served in plain Python.

The same decisions as the numpy path of :meth:`TcpEndpoint._serve_request`, in the same order and with
the same messages (a property test holds the two to it): the grant alive, every op inside a served
(registered, remote-accessible) region (``RegionTable.check`` of a few ops: the first missing region or
the first op out of bounds), every region in the grant, the announced total equal to the op lengths;
all before a byte moves.  The rows come in with one ``recv_into`` (``MSG_WAITALL``) and are unpacked
with ``struct``; the regions are pinned and their streams recorded as the numpy path does; a READ of at
most 16 KiB is answered with one ``sendmsg`` of a copy of the OK header and the bytes (the entries'
views, sliced), a larger one from the views but its last bytes (``llmdd_tcp._io.cut_tail`` says why);
a WRITE's bytes come in with ``recvmsg_into`` straight into them.  Plain sockets only: a TLS
stream takes the numpy path (its staging).
"""

from __future__ import annotations

import socket
import struct
from typing import Any, Optional, Protocol, Union

from llmdd.lowlevel import Batch, Corrupt, PeerGone, Refused

from ._grants import Grant
from ._io import COPY_ALL, TAIL, advance
from ._wire import M_RSP, OK_PADDED, RSP, F_EAGER, F_PAD, READ, ST_OK, ST_REFUSED, send_rsp


class _Warns(Protocol):
    def warning(self, event: str, **kw: Any) -> object: ...


class FewOwner(Protocol):
    """What the few-ops path uses of the endpoint that serves the request
    (:class:`~llmdd_tcp._endpoint.TcpEndpoint`): its logger, the most of a refused write's payload it reads
    to drop, and a request's regions taken and let go (``admit_few`` / ``end_request``)."""

    @property
    def log(self) -> _Warns: ...

    @property
    def eager_max(self) -> int: ...

    def admit_few(self, token: int, sock: socket.socket, grant: Grant, regions: tuple, offsets: tuple, lengths: tuple,
                  total: int) -> Union[str, tuple[Batch, list]]: ...

    def end_request(self, token: int, grant: Grant, served: Batch, nbytes: int = 0, nops: int = -1) -> None: ...

#: requests of at most this many ops take the few-ops path (the count is bounded before any work)
FEW_OPS = 8

_ROWS = [struct.Struct("<" + "IQQ" * n) for n in range(FEW_OPS + 1)]
_OK = RSP.pack(M_RSP, ST_OK, 0, 0, 0)


def refusal(served: Any, grant: Grant, regions: tuple, offsets: tuple, lengths: tuple, total: int) -> Optional[str]:
    """Why the numpy path would refuse these ops (None: served); :class:`Corrupt` for a wrong total."""
    by_id = served.by_id
    for i, (rid, off, ln) in enumerate(zip(regions, offsets, lengths)):
        size = by_id.get(rid)
        if size is None:
            if rid in served.private:
                return f"remote region {rid} is not remote-accessible"
            return f"remote region {rid} is not registered"
        if off > size or ln > size - off:
            return f"remote op {i} out of bounds: region {rid} offset {off} length {ln} size {size}"
    allowed = grant.regions
    if allowed is not None:
        for rid in regions:
            if rid not in allowed:
                return f"remote region {rid} is not granted to this link"
    if sum(lengths) != total:
        raise Corrupt("announced payload does not match the op lengths")
    return None


def recv_rows(sock: socket.socket, count: int, flags: int, pad: int = 0) -> tuple:
    """The ``count`` (at most :data:`FEW_OPS`) packed ops of a request, and ``pad`` bytes after them (read
    and dropped), as one flat tuple."""
    buf = bytearray(20 * count + pad)
    if buf:
        view, got = memoryview(buf), 0
        while got < len(buf):
            r = sock.recv_into(view[got:], len(buf) - got, flags)
            if r == 0:
                raise PeerGone("peer closed the stream mid-request")
            got += r
    return _ROWS[count].unpack_from(buf)


def serve_few(ep: FewOwner, sock: socket.socket, kind: int, flat: tuple, total: int, grant: Grant,
              flags: int = 0) -> None:
    """Check, then serve, the ops ``flat`` (region, offset, length triples) of one request."""
    regions, offsets, lengths = flat[0::3], flat[1::3], flat[2::3]
    token = id(flat)
    admitted = ep.admit_few(token, sock, grant, regions, offsets, lengths, total)
    if isinstance(admitted, str):
        refused = admitted
        ep.log.warning("llmdd.transport.tcp.refused", kind="read" if kind == READ else "write", reason=refused)
        send_rsp(sock, ST_REFUSED, refused, flags & F_PAD)
        if kind != READ and flags & F_EAGER:   # its payload follows: dropped (the stream stays in step)
            discard_payload(sock, total, ep.eager_max, refused)
        return
    served, views = admitted
    released = False
    try:
        if kind == READ:
            # the answer's last bytes leave from a copy, after the request let go of its regions (as the
            # numpy path: llmdd_tcp._io.cut_tail says why)
            ok = OK_PADDED if flags & F_PAD else _OK
            if total <= COPY_ALL:   # the OK header and a copy of the bytes in one sendmsg
                tail = b"".join([ok, *views])
            else:
                j = max(i for i, v in enumerate(views) if len(v))
                view = views[j]
                k = min(len(view), TAIL)
                _send(sock, [ok, *views[:j], view[:len(view) - k]], total - k + len(ok))
                tail = bytes(view[len(view) - k:])
            ep.end_request(token, grant, served, total, len(regions))
            released = True
            _send(sock, [tail], len(tail))
        else:
            if not flags & F_EAGER:   # an eager write's payload follows its request: no "go"
                send_rsp(sock, ST_OK, "", flags & F_PAD)
            try:
                _recv(sock, views, total)
            except Exception:
                ep.log.warning("llmdd.transport.tcp.partial_write", regions=sorted(served.regions), bytes=total)
                raise
            ep.end_request(token, grant, served, total, len(regions))   # before the answer (as a read's tail)
            released = True
            send_rsp(sock, ST_OK, "", flags & F_PAD)
    finally:
        if not released:
            ep.end_request(token, grant, served)


def discard_payload(sock: socket.socket, total: int, limit: int, reason: str) -> None:
    """Read and drop the ``total`` payload bytes of a refused eager write (the client may still be sending
    them: closing now could reset the stream before it read the refusal); more than ``limit`` (a peer's
    number, bounded before the work): :class:`Refused`, the stream ends."""
    if total > limit:
        raise Refused(f"refused an eager write of {total} bytes: {reason}")
    scratch = memoryview(bytearray(min(total, 1 << 16)))
    left = total
    while left:
        k = sock.recv_into(scratch, min(left, len(scratch)))
        if k == 0:
            raise PeerGone("peer closed the stream in the middle of a batch")
        left -= k


def _send(sock: socket.socket, bufs: list, total: int) -> None:
    sent = 0
    while True:
        k = sock.sendmsg(bufs)
        sent += k
        if sent >= total:
            return
        bufs = advance(bufs, k)


def _recv(sock: socket.socket, views: list, total: int) -> None:
    views = [v for v in views if len(v)]
    got = 0
    while got < total:
        k = sock.recvmsg_into(views, 0, socket.MSG_WAITALL)[0]
        if k == 0:
            raise PeerGone("peer closed the stream in the middle of a batch")
        got += k
        if got < total:
            views = advance(views, k)
