"""The owner's reading of one request (REQ, its ops, and the padding of a padded WRITE): the header
checked and the op count bounded before anything proportional to it; a few ops (at most
``few_ops``, plain sockets) as a flat tuple for :mod:`._few`, more as a numpy ``WIRE_OP`` array."""

from __future__ import annotations

import socket
from typing import Union

from llmdd.lowlevel import Corrupt, PeerGone
from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none

from . import _wire
from ._few import FEW_OPS, recv_rows
from ._sock import recv_exact
from ._wire import M_REQ, REQ, F_PAD, MAX_OPS_PER_REQUEST, READ, WRITE


def request_pad(kind: int, rflags: int, count: int) -> int:
    """The zero bytes after the ops of a request: a padded WRITE's fill up to a multiple of 16."""
    return (-(REQ.size + 20 * count)) % 16 if kind == WRITE and rflags & F_PAD else 0


def read_request(sock: socket.socket, head: bytes, flags: int, few_ops: int) -> tuple[int, int, Union[tuple, np.ndarray],
                                                                                    int]:
    """``(kind, request flags, ops, total)`` of the next request (``head``: its first bytes, taken already;
    ``flags``: the receive flags; ``few_ops``: 0 on a TLS stream); :class:`PeerGone` when the stream
    ends, :class:`Corrupt` for a bad header."""
    hdr = head + recv_exact(sock, REQ.size - len(head))
    magic, kind, rflags, _, count, total = REQ.unpack(hdr)
    if magic != M_REQ or kind not in (READ, WRITE) or count > MAX_OPS_PER_REQUEST:
        raise Corrupt(f"bad request header (kind={kind}, count={count})")
    pad = request_pad(kind, rflags, count)
    if count <= min(few_ops, FEW_OPS):   # a few ops: plain Python (llmdd_tcp._few)
        return kind, rflags, recv_rows(sock, count, flags, pad), total
    wire = np.empty(count, dtype=_wire.WIRE_OP)
    if count:
        got, mv = 0, memoryview(wire.view(np.uint8))
        while got < len(mv):
            r = sock.recv_into(mv[got:], len(mv) - got, flags)
            if r == 0:
                raise PeerGone("peer closed the stream mid-request")
            got += r
    if pad:
        recv_exact(sock, pad)
    return kind, rflags, wire, total
