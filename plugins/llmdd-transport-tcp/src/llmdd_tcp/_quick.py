"""The tcp channel's one-call small transfers (issue 21): a planned ``pull_blocks`` / ``push_blocks``
shape as one request on one pooled stream, in plain Python (no numpy per call).

The engine plans a call shape once (each tensor pair's local and remote region, the block size, the
two caches' block counts, the direction) and asks the channel for a prepared transfer (the seam's ``Channel.prepare``, :func:`prepare`):
the local regions' registry entries and writable views, checked against the endpoint's table, the
remote regions checked against the channel's table (known, remote-accessible, large enough for
every block of the shape), and the versions of both tables.  A call of the plan
(:meth:`QuickCall.__call__`) then checks the blocks (exact ints in range, no destination twice, a
few of them), that both versions are still current, pins the local regions as a batch of the ops
path does (:meth:`TcpEndpoint.pin_prepared`: a deregistration or a close fails it and waits for the
pin), builds the request's rows as the ops path would send them (runs of consecutive blocks merged
as ``PreparedPlan.ops`` merges them, then sorted and coalesced as ``coalesce_ops`` does: the same bytes
on the wire), takes an idle stream, sends the request in one call, receives the answer header and
then the bytes straight into the views (``MSG_WAITALL``), or for a WRITE sends them after the
owner's go.  The deadline is armed once per call (see :class:`_Deadline`).

It returns the bytes moved, or -1 when it did nothing (a block it does not take, a table changed
since the plan, the channel or endpoint closed): the engine then runs the same transfer on the ops
path.  A transfer it started that fails raises the transport error, as the ops path reports it
(:class:`PeerGone`, :class:`TransportTimeout`, :class:`Refused`, :class:`Corrupt`,
:class:`Cancelled`).  TLS streams take the ops path (an SSL socket has no ``sendmsg`` / flags).
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import time
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, Union

from llmdd.lowlevel import Cancelled, Corrupt, PeerGone, Refused, TlsConfig, TransportError, TransportTimeout, block_runs

from ._io import advance
from ._native import native
from ._options import OPT_INLINE, OPT_SEGMENT
from ._sock import Spinner, StaleStream, StreamBatch, close_sock, map_exc
from ._request import request_pad
from ._wire import M_REQ, M_RSP, RSP, F_EAGER, F_PAD, FEAT_QUICK, MAX_MESSAGE, READ, ST_OK, ST_REFUSED, WRITE


class QuickOwner(Protocol):
    """What a plan uses of the endpoint (:class:`~llmdd_tcp._endpoint.TcpEndpoint`): its configuration, TLS
    and C path, and its local table read and pinned at a version (``prepared_locals``, ``pin_prepared``,
    ``end_batch``)."""

    @property
    def cfg(self) -> Mapping[str, Any]: ...

    @property
    def tls(self) -> Union[TlsConfig, None]: ...

    @property
    def native(self) -> bool: ...

    def prepared_locals(self, region_ids: Sequence[int], min_size: int) -> Optional[tuple[int, dict, dict]]: ...

    def pin_prepared(self, batch: StreamBatch, version: int) -> bool: ...

    def end_batch(self, batch: StreamBatch) -> None: ...


class QuickChannel(Protocol):
    """What a plan uses of the channel (:class:`~llmdd_tcp._channel.TcpChannel`): the owner's features, the
    spinner of its waits, the remote table read at a version (``prepared_remotes``), a call's start
    (``begin_prepared``, ``bump_arm_epoch``), its streams (``open_stream``, ``give_back``) and its end
    (``quick_done``, ``finish``)."""

    @property
    def features(self) -> int: ...

    @property
    def spinner(self) -> Spinner: ...

    def prepared_remotes(self, region_ids: Sequence[int], min_size: int) -> Optional[int]: ...

    def begin_prepared(self, batch: StreamBatch, version: int, armed_sock: Optional[socket.socket],
                       armed_epoch: int) -> Optional[tuple[Optional[socket.socket], bool]]: ...

    def bump_arm_epoch(self) -> int: ...

    def open_stream(self, deadline: float) -> socket.socket: ...

    def give_back(self, batch: StreamBatch, sock: socket.socket) -> None: ...

    def quick_done(self, batch: StreamBatch, sock: socket.socket, kind: int, nops: int, total: int,
                   native: bool) -> None: ...

    def finish(self, batch: StreamBatch, err: Union[TransportError, None] = None, kind: int = READ,
               nops: Union[int, None] = None, total: int = 0, *, quick: bool = False, native: bool = False) -> None: ...

#: the most tensor pairs and blocks of one call the quick path takes (the engine's small path: 16 blocks)
QUICK_MAX_PAIRS = 8
QUICK_MAX_BLOCKS = 16
#: the C call's "done" result (llmdd_tcp._tcpfast.Q_OK; its other results are read off the module)
_Q_OK = native.Q_OK if native is not None else 0
#: the longest a syscall may start after the deadline was (re)armed: the deadline is armed that much early
_SLACK_S = 0.002

_REQS: dict[int, struct.Struct] = {}   # REQ header + n WIRE_OP rows (+ padding), packed as the ops path packs them


def _req(n: int, pad: int = 0) -> struct.Struct:
    packer = _REQS.get(n * 16 + pad)
    if packer is None:
        packer = _REQS[n * 16 + pad] = struct.Struct("<4sBBHIQ" + "IQQ" * n + "x" * pad)
    return packer


def _timeval(seconds: float) -> bytes:
    return struct.pack("ll", int(seconds), int((seconds % 1.0) * 1e6))


class _Deadline:
    """The call's deadline on one stream: armed once (``SO_RCVTIMEO``, and ``SO_SNDTIMEO`` when the call
    sends a payload, = the timeout less the slack; a pull's request of a few hundred bytes goes into an
    idle stream's empty send buffer and never waits); a syscall that starts more than the slack after
    the last arming re-arms first with what is left (less the slack), so no syscall of the call outlives
    the deadline."""

    __slots__ = ("deadline", "slack", "rearm_at", "sock", "send", "start", "armings")

    def __init__(self, timeout_s: float, slack: float, send: bool) -> None:
        now = time.monotonic()
        self.start = now
        self.deadline = now + timeout_s
        self.send = send
        self.slack = slack
        self.rearm_at = 0.0
        self.armings = 0
        self.sock: Optional[socket.socket] = None

    def assume(self, sock: socket.socket) -> None:
        """``sock`` is still armed by the last call of the same plan, with at most this call's timeout less
        the slack (:meth:`QuickCall.keep_armed`): as if armed when this call began (a syscall that starts
        more than the slack later re-arms), so no syscall outlives the deadline and none is made."""
        self.rearm_at = self.start + self.slack
        self.sock = sock

    def arm(self, sock: socket.socket) -> None:
        """Arm ``sock`` with the time left (a fresh stream, or a syscall late in the call)."""
        now = time.monotonic()
        left = self.deadline - now - self.slack
        if left <= 0:
            raise TransportTimeout("deadline passed")
        tv = _timeval(left)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        if self.send:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self.rearm_at = now + self.slack
        self.sock = sock
        self.armings += 1

    def check(self, sock: socket.socket) -> None:
        """Before a syscall on ``sock``: re-arm when the last arming is older than the slack."""
        if sock is not self.sock or time.monotonic() > self.rearm_at:
            self.arm(sock)


def _recv_into(sock: socket.socket, views: list, total: int, dl: _Deadline) -> None:
    """Receive exactly ``total`` bytes into ``views`` (``MSG_WAITALL``; resumed after a short one)."""
    got = 0
    while True:
        if len(views) == 1:
            k = sock.recv_into(views[0], 0, socket.MSG_WAITALL)
        else:
            k = sock.recvmsg_into(views, 0, socket.MSG_WAITALL)[0]
        if k == 0:
            raise PeerGone("peer closed the stream in the middle of a batch")
        got += k
        if got >= total:
            return
        views = advance(list(views), k)
        dl.check(sock)


def _send_all(sock: socket.socket, bufs: list, total: int, dl: _Deadline) -> None:
    """Send every byte of ``bufs`` (one ``sendmsg``; resumed after a short one)."""
    sent = 0
    while True:
        k = sock.sendmsg(bufs)
        sent += k
        if sent >= total:
            return
        bufs = advance(list(bufs), k)
        dl.check(sock)


def _recv_exact(sock: socket.socket, buf: bytearray, dl: _Deadline, *, stale_ok: bool = False) -> None:
    """Fill ``buf``; :class:`StaleStream` (with ``stale_ok``) when the stream ends before its first byte."""
    view = memoryview(buf)
    got = 0
    while got < len(buf):
        k = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
        if k == 0:
            if stale_ok and got == 0:
                raise StaleStream("peer closed the stream before answering")
            raise PeerGone("peer closed the stream")
        got += k
        if got < len(buf):
            dl.check(sock)


def _drop(batch: StreamBatch, sock: socket.socket) -> None:
    """Take ``sock`` from ``batch`` and close it (an idle stream the owner closed; nothing moved on it)."""
    with batch.lock:
        if sock in batch.socks:
            batch.socks.remove(sock)
    close_sock(sock)


def _answer(sock: socket.socket, head: bytearray, dl: _Deadline) -> tuple[int, str]:
    """The status and message of the answer whose first bytes are in ``head``: its 12-byte header, or 16
    bytes of a padded answer (``F_PAD`` to an owner with ``FEAT_QUICK``: at least 4 bytes of message, a
    multiple of 16 in all).  The rest of the message is read here (a refusal's reason; padding)."""
    magic, status, _, _, n = RSP.unpack_from(head)
    have = len(head) - RSP.size
    if magic != M_RSP or n > MAX_MESSAGE or (have and (n < have or (RSP.size + n) % 16)):
        raise Corrupt("bad response header from peer")
    if n == have:
        return status, "" if status == ST_OK else bytes(head[RSP.size:]).rstrip(b"\0").decode(errors="replace")
    msg = bytearray(n - have)
    dl.check(sock)
    _recv_exact(sock, msg, dl)
    if status == ST_OK:
        return status, ""
    return status, (bytes(head[RSP.size:]) + bytes(msg)).rstrip(b"\0").decode(errors="replace")


class QuickCall:
    """One planned shape on one channel: ``f(src_blocks, dst_blocks) -> bytes moved, or -1``."""

    __slots__ = ("ch", "ep", "pairs", "bs", "su", "du", "push", "timeout_s", "slack", "ep_ver", "ch_ver",
                 "views", "lids", "max_bytes", "kind", "armed_sock", "armed_epoch", "bases", "native")

    def __init__(self, ch: QuickChannel, ep: QuickOwner, pairs: list, bs: int, su: int, du: int, push: bool, timeout_s: float,
                 ep_ver: int, ch_ver: int, views: dict, max_bytes: int, bases: dict) -> None:
        self.ch, self.ep = ch, ep
        self.pairs, self.bs, self.su, self.du, self.push = pairs, bs, su, du, push
        self.timeout_s, self.slack = timeout_s, min(_SLACK_S, timeout_s / 4)
        self.ep_ver, self.ch_ver = ep_ver, ch_ver
        self.views = views            # local region id -> writable view of the whole region
        self.lids = frozenset(views)
        self.max_bytes = max_bytes
        self.kind = WRITE if push else READ
        # the stream this plan armed last and the channel's arming epoch then (TcpChannel.bump_arm_epoch): the
        # same stream popped again with the epoch unchanged still has this plan's timeouts set
        self.armed_sock: Optional[socket.socket] = None
        self.armed_epoch = -1
        # the C path (llmdd_tcp._tcpfast.quick) takes the calls when it is loaded, the endpoint uses it and
        # the owner knows padded and eager requests; it needs the local regions' addresses (a call's rows,
        # at most QUICK_MAX_PAIRS x QUICK_MAX_BLOCKS, never exceed its QUICK_ROWS: test_native.py)
        self.bases = bases   # local region id -> its address
        self.native = native is not None and ep.native and bool(ch.features & FEAT_QUICK)

    def rows(self, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> Optional[list]:
        """The request's rows ``[remote region, remote offset, local region, local offset, length]`` as
        the ops path sends them, or None when the quick path does not take these blocks."""
        runs = block_runs(src_blocks, dst_blocks, self.su, self.du, QUICK_MAX_BLOCKS)
        if runs is None:
            return None
        bs, push = self.bs, self.push
        if len(runs) == 1 and runs[0][2] == 1 and len(self.pairs) == 1:
            lreg, rreg = self.pairs[0]
            s, d, _ = runs[0]
            return [[rreg, d * bs, lreg, s * bs, bs]] if push else [[rreg, s * bs, lreg, d * bs, bs]]
        rows = []
        for lreg, rreg in self.pairs:
            for s0, d0, c in runs:
                if push:
                    rows.append((rreg, d0 * bs, lreg, s0 * bs, c * bs))
                else:
                    rows.append((rreg, s0 * bs, lreg, d0 * bs, c * bs))
        # coalesce_ops: ordered by (remote region, remote offset, local region, local offset) (no two rows
        # tie on all four: no destination twice), then rows that continue each other on both sides merged
        rows.sort()
        out = [list(rows[0])]
        for rr, ro, lr, lo, ln in rows[1:]:
            p = out[-1]
            if rr == p[0] and lr == p[2] and p[1] + p[4] == ro and p[3] + p[4] == lo:
                p[4] += ln
            else:
                out.append([rr, ro, lr, lo, ln])
        return out

    def __call__(self, src_blocks: Any, dst_blocks: Any) -> int:
        if type(src_blocks) not in (list, tuple) or type(dst_blocks) not in (list, tuple):
            return -1
        rows = self.rows(src_blocks, dst_blocks)
        if rows is None:
            return -1
        total = len(dst_blocks) * self.bs * len(self.pairs)
        if total > self.max_bytes:
            return -1
        ch, ep = self.ch, self.ep
        batch = StreamBatch()
        batch.regions = self.lids
        if not ep.pin_prepared(batch, self.ep_ver):   # the local regions pinned as begin_batch pins them
            return -1
        taken = ch.begin_prepared(batch, self.ch_ver, self.armed_sock, self.armed_epoch)
        if taken is None:
            ep.end_batch(batch)
            return -1
        sock, armed = taken
        try:
            if self.native:
                sock = self._transfer_native(batch, sock, rows, total)
            else:
                sock = self._transfer(batch, sock, rows, total, armed)
        except BaseException as exc:  # noqa: BLE001 - reported as the ops path reports it
            err = map_exc(exc)
            if batch.aborted and not isinstance(err, Refused):
                err = Cancelled(f"batch aborted: {err}")
            ch.finish(batch, err, self.kind, len(rows), total, quick=True, native=self.native)
            raise err from None
        ch.quick_done(batch, sock, self.kind, len(rows), total, self.native)
        return total

    def _transfer(self, batch: StreamBatch, sock: Optional[socket.socket], rows: list, total: int,
                  armed: bool = False) -> socket.socket:
        """The call's transfer in Python; the stream it ended on (still the batch's: the caller gives it
        back with the batch's end)."""
        ch = self.ch
        reused = sock is not None
        if sock is not None:
            batch.adopt(sock)   # from the pool: the batch's from now on (closed if this call fails)
        dl = _Deadline(self.timeout_s, self.slack, self.push)
        flat: list = []
        views = []
        lviews = self.views
        for rr, ro, lr, lo, ln in rows:
            flat += (rr, ro, ln)
            views.append(lviews[lr][lo:lo + ln])
        while True:
            if sock is None:
                sock = ch.open_stream(dl.deadline)
                batch.adopt(sock)
            # an owner that knows them (its HELLO said so) takes a push as one padded, eager request, and
            # pads its answers to a pull or such a push to 16 bytes (read at once)
            quick = ch.features & FEAT_QUICK
            eager = self.push and quick
            head = bytearray(16 if quick else RSP.size)
            if eager:
                flags, pad = F_PAD | F_EAGER, request_pad(WRITE, F_PAD, len(rows))
            else:
                flags, pad = (0 if self.push else F_PAD), 0
            req = _req(len(rows), pad).pack(M_REQ, self.kind, flags, 0, len(rows), total, *flat)
            if armed and reused:
                dl.assume(sock)   # armed by this plan's last call, nothing armed it since: no setsockopt
            else:
                dl.arm(sock)
            try:
                if eager:
                    _send_all(sock, [req, *views], len(req) + total, dl)
                else:
                    sock.sendall(req)
                ch.spinner.wait(sock, dl.deadline - time.monotonic())   # the answer polled for first
                _recv_exact(sock, head, dl, stale_ok=True)
            except (StaleStream, ConnectionResetError, BrokenPipeError) as exc:
                if not reused or batch.aborted:
                    raise PeerGone(f"stream closed by the owner: {exc}") from None
                _drop(batch, sock)   # the owner closed this idle stream just as it was reused: once more, fresh
                sock, reused = None, False
                continue
            break
        status, msg = _answer(sock, head, dl)
        if status == ST_REFUSED:
            # a refusal comes before any payload, or the owner dropped an eager one: the stream is in step
            ch.give_back(batch, sock)
            raise Refused(f"peer refused the batch: {msg}")
        if status != ST_OK:
            raise Corrupt(f"peer failed the batch: {msg}")
        dl.check(sock)
        if eager:
            pass   # the one answer came: done
        elif self.push:
            _send_all(sock, views, total, dl)
            dl.check(sock)
            _recv_exact(sock, head, dl)
            status, msg = _answer(sock, head, dl)
            if status != ST_OK:
                raise Corrupt(f"peer failed the write: {msg}")
        else:
            _recv_into(sock, views, total, dl)
        if batch.aborted:
            raise Cancelled("batch aborted")
        self.keep_armed(sock, dl)
        return sock

    def _transfer_native(self, batch: StreamBatch, sock: Optional[socket.socket], rows: list, total: int) -> socket.socket:
        """:meth:`_transfer` in one C call (the GIL released): the request (a push's payload with it) sent,
        the answer polled for and received, a pull's bytes straight into the local regions; the deadline
        bounds every wait there (``ppoll``), no socket option is set.  An answer other than the expected
        OK comes back as its header and is read on and reported here as :meth:`_transfer` reports it.
        Returns the stream, as :meth:`_transfer`."""
        ch = self.ch
        reused = sock is not None
        if sock is not None:
            batch.adopt(sock)
        deadline = time.monotonic() + self.timeout_s
        bases = self.bases
        if len(rows) == 1:
            rr, ro, lr, lo, ln = rows[0]
            flat = [rr, ro, bases[lr] + lo, ln]
        else:
            flat = []
            for rr, ro, lr, lo, ln in rows:
                flat += (rr, ro, bases[lr] + lo, ln)
        kind = self.kind
        flags, pad = (F_PAD | F_EAGER, request_pad(WRITE, F_PAD, len(rows))) if self.push else (F_PAD, 0)
        spinner = ch.spinner
        while True:
            if sock is None:
                sock = ch.open_stream(deadline)
                batch.adopt(sock)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportTimeout("deadline passed")
            spin = spinner.take(left)
            res, value, head, spun = native.quick(sock.fileno(), kind, flags, pad, flat, total, 16, int(left * 1e9),
                                                  int(spin * 1e9))
            if spin:
                spinner.record(bool(spun))
            if res == _Q_OK:
                if batch.aborted:
                    raise Cancelled("batch aborted")
                return sock
            stale = res == native.Q_STALE or (res == native.Q_ERRNO and value in (errno.ECONNRESET, errno.EPIPE))
            if stale and reused and not batch.aborted:
                _drop(batch, sock)   # the owner closed this idle stream just as it was reused: once more, fresh
                sock, reused = None, False
                continue
            break
        if res == native.Q_ANSWER:
            dl = _Deadline(max(deadline - time.monotonic(), 1e-6), min(self.slack, self.timeout_s / 4), False)
            dl.arm(sock)
            ch.bump_arm_epoch()   # (timeouts set on this stream: no plan assumes its own are)
            status, msg = _answer(sock, bytearray(head), dl)
            if status == ST_REFUSED:
                ch.give_back(batch, sock)
                raise Refused(f"peer refused the batch: {msg}")
            raise Corrupt(f"peer failed the batch: {msg}")
        if res == native.Q_STALE:
            raise PeerGone("stream closed by the owner before it answered")
        if res == native.Q_GONE:
            why = f": {os.strerror(value)}" if value else ""
            raise PeerGone(f"peer closed the stream in the middle of a batch{why}")
        if res == native.Q_TIMEOUT:
            raise TransportTimeout(f"no answer within the deadline ({self.timeout_s:.3f} s)")
        if res == native.Q_ERRNO:
            raise OSError(value, os.strerror(value))
        raise Corrupt(f"the C quick call returned an unknown result {res!r}")

    def keep_armed(self, sock: socket.socket, dl: _Deadline) -> None:
        """Remember ``sock`` as armed with this plan's timeout less the slack when this call armed it once,
        within a quarter of the slack of its start (a later or second arming left a shorter timeout on it:
        forget it); an assumed arming stays remembered."""
        if dl.armings == 0 and sock is self.armed_sock:
            return   # assumed (the epoch was current when the stream was taken, and only this call had it)
        keep = dl.armings == 1 and dl.sock is sock and dl.rearm_at - dl.slack - dl.start <= dl.slack / 4
        epoch = self.ch.bump_arm_epoch()   # (a later epoch than this one: the stream's arming is not assumed)
        self.armed_sock, self.armed_epoch = (sock, epoch) if keep else (None, -1)


def prepare(ch: QuickChannel, ep: QuickOwner, pairs: Sequence[tuple[int, int]], block_bytes: int, src_units: int,
            dst_units: int, push: bool, timeout_s: float) -> Optional[Callable[[Any, Any], int]]:
    """The one-call path of this shape on channel ``ch`` of endpoint ``ep``, or None when it cannot take it:
    TLS (an SSL socket takes neither ``sendmsg`` nor receive flags: the ops path stages), too many pairs, a
    block larger than ``llmdd.tcp.inline_max_bytes``, a local region not registered or too small for the
    shape's blocks, a remote region unknown, not remote-accessible or too small."""
    if ep.tls is not None or not 0 < len(pairs) <= QUICK_MAX_PAIRS:
        return None
    bs, su, du, timeout_s = int(block_bytes), int(src_units), int(dst_units), float(timeout_s)
    max_bytes = min(int(ep.cfg[OPT_INLINE]), int(ep.cfg[OPT_SEGMENT]))
    if bs <= 0 or su <= 0 or du <= 0 or bs * len(pairs) > max_bytes or not timeout_s > 0:
        return None
    local_units, remote_units = (su, du) if push else (du, su)
    plan = [(int(lid), int(rid)) for lid, rid in pairs]
    local = ep.prepared_locals([lid for lid, _ in plan], bs * local_units)
    if local is None:
        return None
    ep_ver, views, bases = local
    ch_ver = ch.prepared_remotes([rid for _, rid in plan], bs * remote_units)
    if ch_ver is None:
        return None
    return QuickCall(ch, ep, plan, bs, su, du, bool(push), timeout_s, ep_ver, ch_ver, views, max_bytes, bases)
