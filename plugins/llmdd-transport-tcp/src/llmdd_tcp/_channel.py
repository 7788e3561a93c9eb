"""The client side of the tcp transport: :class:`TcpChannel` (streams to one peer endpoint, pooled: the
OPEN exchange, batches split over streams and segments, stale idle streams retried once); a batch's
sockets are a :class:`~llmdd_tcp._sock.StreamBatch`."""

from __future__ import annotations

import hmac
import os
import socket
import threading
import time
from typing import Any, Callable, Optional, Protocol, Sequence, Union

from llmdd.abc import Channel, Completion, PreparedTransfer, RegionDescriptor
from llmdd.lowlevel import Batch, BatchSet, Cancelled, Corrupt, DoneCompletion, PeerGone, Refused, RegionTable
from llmdd.lowlevel import ThreadCompletion, TransportError, TransportTimeout, coalesce_ops, split_ops, submitted
from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none
from llmdd.status import LLMStatusCode

from . import _quick, _wire
from ._descriptors import EndpointFields, region_fields
from ._grants import cap_key, grant_handle, mac
from ._io import move, sendmsg_all, Where
from ._options import OPT_INLINE, OPT_SEGMENT, OPT_SPLIT, OPT_STREAMS
from ._sock import Spinner, StaleStream, StreamBatch, arm_deadline, close_sock, map_exc, readable, recv_exact, shutdown_sock
from ._sock import tune
from ._wire import AUTH_RSP, HELLO, M_HELLO, M_REQ, OPEN, REQ, RSP, MAX_OPS_PER_REQUEST, READ, ST_OK
from ._wire import F_PAD, ST_REFUSED, VERSION, WRITE, parse_rsp, recv_rsp

#: idle streams a channel keeps for its next batches (more are closed when they come back)
_POOL_MAX = 4

class ChannelOwner(_quick.QuickOwner, Protocol):
    """What a channel uses of the endpoint that opened it (:class:`~llmdd_tcp._endpoint.TcpEndpoint`): what a
    plan of its prepared path uses (:class:`~llmdd_tcp._quick.QuickOwner`), the link secret, the spin
    time of its waits, a batch's pins (``begin_batch`` / ``end_batch``) and its close (``forget_channel``)."""

    @property
    def secret(self) -> Union[bytes, None]: ...

    @property
    def spin_s(self) -> float: ...

    def begin_batch(self, ops: np.ndarray, remote: RegionTable) -> tuple[StreamBatch, Where]: ...

    def forget_channel(self, ch: TcpChannel) -> None: ...


class TcpChannel(Channel):
    """Streams to one peer endpoint, pooled; a batch takes one or two of them."""

    def __init__(self, endpoint: ChannelOwner, peer: EndpointFields, cap: Optional[bytes]) -> None:
        self._ep = endpoint
        self._peer = peer
        self._addr = (peer.host, peer.port)
        self._peer_id = peer.endpoint_id
        if cap is None or len(cap) < 16:
            raise Refused("the tcp endpoint description carries no data capability (the owner grants one per "
                          "link, in the link handshake)", status_code=LLMStatusCode.LLM_LINK_FAILED)
        peer_tls = peer.tls
        if peer_tls and endpoint.tls is None:
            raise Refused(f"the tcp data port at {self._addr[0]}:{self._addr[1]} requires TLS and this side has no "
                          "llmdd.tls_* options", status_code=LLMStatusCode.LLM_LINK_FAILED)
        if endpoint.tls is not None and not peer_tls:
            raise Refused(f"TLS is configured here but the tcp data port at {self._addr[0]}:{self._addr[1]} is "
                          "plaintext: refused rather than sending data unencrypted",
                          status_code=LLMStatusCode.LLM_LINK_FAILED)
        self._handle = grant_handle(bytes(cap))
        self._key = cap_key(bytes(cap), endpoint.secret)
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self._remote: dict[int, int] = {}
        self._private: set[int] = set()   # remote regions not remote-accessible (the quick path plans none)
        self._remote_table = RegionTable()
        self._qver = 0   # the remote table's version: bumped on every change and on close (llmdd_tcp._quick)
        self.features = 0   # the owner's HELLO features (_wire.FEAT_QUICK: padded and eager writes)
        self._batches: BatchSet[StreamBatch] = BatchSet(threading.Condition(self._lock))
        self._cfg = endpoint.cfg
        self._arm_epoch = 0   # bumped whenever a stream's timeouts may change (QuickCall.keep_armed)
        self.spinner = Spinner(endpoint.spin_s)   # one-call transfers' waits for their answers (llmdd_tcp._quick)
        # int counters, and last_error (str or None)
        self._stats: dict[str, Any] = {"bytes_read": 0, "bytes_written": 0, "ops_read": 0, "ops_written": 0,
                                       "batches": 0, "failed": 0, "streams_opened": 0, "quick_batches": 0, "quick_native": 0,
                                       "last_error": None}

    # ------------------------------------------------------------------ public API

    def add_remote_region(self, region_id: int, size: int, desc: RegionDescriptor) -> None:
        fields = region_fields(desc)
        if fields.endpoint_id != self._peer_id:
            raise Refused(f"descriptor of region {region_id} belongs to another endpoint")
        rid = int(region_id)
        with self._lock:
            self._remote[rid] = int(size)
            if fields.remote_accessible:
                self._private.discard(rid)
            else:
                self._private.add(rid)
            self._remote_table = RegionTable(self._remote)
            self._qver += 1

    def remove_remote_region(self, region_id: int) -> None:
        with self._lock:
            self._remote.pop(int(region_id), None)
            self._private.discard(int(region_id))
            self._remote_table = RegionTable(self._remote)
            self._qver += 1

    def read(self, ops: np.ndarray, *, deadline: float) -> Completion:
        # the seam's one refusal path: a refusal or failure is the completion's error, never raised
        return submitted(self._submit, READ, ops, deadline)

    def write(self, ops: np.ndarray, *, deadline: float) -> Completion:
        return submitted(self._submit, WRITE, ops, deadline)

    def close(self) -> None:
        with self._lock:
            self._qver += 1   # the quick plans of this channel are void from now on
        # refuse new batches, fail those in flight, wait until they left (the close-drain)
        if not self._batches.close(Cancelled("channel closed")):
            return
        with self._lock:
            idle, self._idle = self._idle, []
        for s in idle:
            close_sock(s)
        self._ep.forget_channel(self)

    def statistics(self) -> dict:
        with self._lock:
            return dict(self._stats, idle_streams=len(self._idle), remote_regions=len(self._remote),
                        closed=self._batches.closed, answers_spun=self.spinner.hits,
                        spins_missed=self.spinner.misses)

    def prepare(self, pairs: Sequence[tuple[int, int]], block_bytes: int, src_units: int, dst_units: int,
                push: bool, *, timeout_s: float) -> Optional[PreparedTransfer]:
        """The seam's prepared path (``Channel.prepare``): the one-call path of a small-transfer shape
        (``llmdd_tcp._quick.prepare``), or None; a call of it ends by ``timeout_s`` after it began."""
        return _quick.prepare(self, self._ep, pairs, block_bytes, src_units, dst_units, push, timeout_s)

    # ------------------------------------------------------------------ the one-call path (llmdd_tcp._quick)

    def prepared_remotes(self, region_ids: Sequence[int], min_size: int) -> Optional[int]:
        """The remote table's version now, when every one of ``region_ids`` is known, remote-accessible and at
        least ``min_size`` bytes (a plan of :func:`llmdd_tcp._quick.prepare`); else None."""
        with self._lock:   # the remote table and its version together
            if self._batches.closed:
                return None
            for rid in region_ids:
                size = self._remote.get(rid)
                if size is None or rid in self._private or size < min_size:
                    return None
            return self._qver

    def begin_prepared(self, batch: StreamBatch, version: int, armed_sock: Optional[socket.socket],
                       armed_epoch: int) -> Optional[tuple[Optional[socket.socket], bool]]:
        """A one-call transfer of a plan made at remote table ``version`` starts: ``batch`` tracked, an idle
        stream taken (or None: the call opens one) and whether it is still ``armed_sock`` armed at
        ``armed_epoch`` (:meth:`bump_arm_epoch`); None when the table changed or the channel closed (the
        call declines)."""
        with self._lock:
            if self._qver != version or self._batches.closed:
                return None
            self._batches.add(batch)
            sock = self._idle.pop() if self._idle else None
            return sock, sock is not None and sock is armed_sock and self._arm_epoch == armed_epoch

    def bump_arm_epoch(self) -> int:
        """A stream's timeouts may have changed: the new arming epoch (a plan remembers the one its own
        arming left, and assumes a stream armed only while the epoch is unchanged)."""
        with self._lock:
            self._arm_epoch += 1
            return self._arm_epoch

    # ------------------------------------------------------------------ streams

    def open_stream(self, deadline: float) -> socket.socket:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportTimeout("deadline passed before connecting")
        try:
            sock = socket.create_connection(self._addr, timeout=left)
        except OSError as exc:
            raise map_exc(exc) from None
        try:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            tls = self._ep.tls
            if tls is not None:
                tune(sock)
                plain = sock
                try:
                    # the server's certificate is checked as on control connections (llmdd.tls_server_name)
                    sock = tls.wrap_client(plain, self._addr[0])
                except BaseException:
                    plain.close()
                    raise
            magic, version, auth, features, peer_id, nonce_s = HELLO.unpack(recv_exact(sock, HELLO.size))
            if magic != M_HELLO or version != VERSION:
                raise Corrupt(f"peer at {self._addr} does not speak llmdd-tcp v{VERSION}")
            if peer_id != self._peer_id:
                raise PeerGone(f"peer at {self._addr} is another endpoint incarnation")
            secret = self._ep.secret
            if auth and secret is None:
                raise Refused("peer requires a shared secret", status_code=LLMStatusCode.LLM_LINK_FAILED)
            if not auth and secret is not None:
                raise Refused("peer does not authenticate but a secret is configured",
                              status_code=LLMStatusCode.LLM_LINK_FAILED)
            nonce_c = os.urandom(16)
            sock.sendall(OPEN.pack(nonce_c, self._handle, mac(self._key, b"c", peer_id, nonce_s, nonce_c)))
            status, mac_s = AUTH_RSP.unpack(recv_exact(sock, AUTH_RSP.size))
            if status != 0 or not hmac.compare_digest(mac_s, mac(self._key, b"s", peer_id, nonce_c, nonce_s)):
                raise Refused("the peer refused the data connection (no live link grant, or authentication "
                              "failed)", status_code=LLMStatusCode.LLM_LINK_FAILED)
            sock.settimeout(None)
            tune(sock)
            self.features = features   # the same for every stream of this owner incarnation (its id)
        except BaseException as exc:
            if sock is not None:   # None: the TLS wrap failed and closed its socket
                close_sock(sock)
            raise map_exc(exc) from None
        with self._lock:
            self._stats["streams_opened"] += 1
        return sock

    def _acquire(self, batch: StreamBatch, deadline: float, *, fresh: bool = False) -> tuple[socket.socket, bool]:
        """A stream for ``batch`` and whether it was reused from the idle pool."""
        sock = None
        while not fresh:
            with self._lock:
                if self._batches.closed:
                    raise Cancelled("channel closed")
                sock = self._idle.pop() if self._idle else None
                self._arm_epoch += 1   # the ops path arms the streams it takes (llmdd_tcp._quick caches armings)
            if sock is None or not readable(sock):
                break
            # an idle stream has nothing to read: readable means the owner closed it (it fails the
            # streams of batches that touched a region it deregistered); never reuse it
            close_sock(sock)
        reused = sock is not None
        if sock is None:
            sock = self.open_stream(deadline)
        batch.adopt(sock)
        return sock, reused

    def release(self, sock: socket.socket) -> None:
        with self._lock:
            if self._pool_locked(sock):
                return
        close_sock(sock)

    def _pool_locked(self, sock: socket.socket) -> bool:
        """Keep ``sock`` as an idle stream (lock held); False when the channel is closed or already keeps
        :data:`_POOL_MAX` (the caller then closes it)."""
        if self._batches.closed or len(self._idle) >= _POOL_MAX:
            return False
        self._idle.append(sock)
        return True

    # ------------------------------------------------------------------ batches

    def _submit(self, kind: int, ops: np.ndarray, deadline: float) -> Completion:
        with self._lock:
            if self._batches.closed:
                raise Cancelled("channel closed")
            remote = self._remote_table
        batch, where = self._ep.begin_batch(ops, remote)
        try:
            with self._lock:
                self._batches.add(batch)
        except BaseException:
            self._ep.end_batch(batch)
            raise
        try:
            ops = coalesce_ops(np.asarray(ops))
            total = int(ops["length"].sum(dtype=np.uint64)) if len(ops) else 0
        except BaseException:
            self.finish(batch)
            raise
        if total <= int(self._cfg[OPT_INLINE]):
            err = None
            try:
                self._run_stream(batch, kind, ops, where, deadline)
            except BaseException as exc:  # noqa: BLE001
                err = map_exc(exc)
                if batch.aborted and not isinstance(err, Refused):
                    err = Cancelled(f"batch aborted: {err}")
            self.finish(batch, err, kind, len(ops), total)
            return DoneCompletion(err)
        streams = int(self._cfg[OPT_STREAMS]) if total >= int(self._cfg[OPT_SPLIT]) else 1
        parts = split_ops(ops, max(1, streams))
        workers = [(lambda p=p: self._run_stream_mapped(batch, kind, p, where, deadline)) for p in parts]
        batch.completion = ThreadCompletion(
            workers, deadline=deadline, abort=batch.abort,
            on_done=lambda c: self.finish(batch, c.recorded_error, kind, len(ops), total),
            name="llmdd-tcp-io")
        return batch.completion

    def finish(self, batch: StreamBatch, err: Union[TransportError, None] = None, kind: int = READ,
                nops: Union[int, None] = None, total: int = 0, *, quick: bool = False, native: bool = False) -> None:
        """``batch`` ended: its broken streams closed, its pins dropped, counted (``nops`` ops of ``total``
        bytes; not counted when None; ``quick``: by the one-call path, ``native``: in its C path)."""
        with batch.lock:
            socks, batch.socks = batch.socks, []
        for s in socks:  # streams still owned by the batch were not released: they are broken
            close_sock(s)
        self._ep.end_batch(batch)
        with self._lock:
            self._batches.discard_locked(batch)
            if nops is not None:
                self._count_locked(err, kind, nops, total, quick, native)

    def _count_locked(self, err: Union[TransportError, None], kind: int, nops: int, total: int, quick: bool,
                      native: bool) -> None:
        """Count a batch that ended (lock held): ``nops`` ops of ``total`` bytes, or its error."""
        stats = self._stats
        stats["batches"] += 1
        if quick:
            stats["quick_batches"] += 1
            stats["quick_native"] += native
        if err is None:
            if kind == READ:
                stats["bytes_read"] += total
                stats["ops_read"] += nops
            else:
                stats["bytes_written"] += total
                stats["ops_written"] += nops
        else:
            stats["failed"] += 1
            stats["last_error"] = str(err)

    def quick_done(self, batch: StreamBatch, sock: socket.socket, kind: int, nops: int, total: int, native: bool) -> None:
        """A one-call transfer (``llmdd_tcp._quick``) ended well on ``sock``: :meth:`give_back` and
        :meth:`finish` in one pass (the stream back to the pool unless the batch was aborted meanwhile,
        its pins dropped, counted), each lock taken once."""
        with batch.lock:
            socks, batch.socks = batch.socks, []
            keep = not batch.aborted
        self._ep.end_batch(batch)
        with self._lock:
            self._batches.discard_locked(batch)
            self._count_locked(None, kind, nops, total, True, native)
            if keep and sock in socks and self._pool_locked(sock):
                socks.remove(sock)
        for s in socks:   # an aborted batch's stream, or one the pool has no room for
            close_sock(s)

    def _run_stream_mapped(self, batch: StreamBatch, kind: int, ops: np.ndarray, where: Where, deadline: float) -> None:
        try:
            self._run_stream(batch, kind, ops, where, deadline)
        except TransportError:
            raise
        except Exception as exc:  # noqa: BLE001 - a socket timeout (EAGAIN under SO_RCVTIMEO) is a timeout
            raise map_exc(exc) from None

    def _run_stream(self, batch: StreamBatch, kind: int, ops: np.ndarray, where: Where, deadline: float) -> None:
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
                except StaleStream as exc:
                    if not (reused and start == 0) or batch.aborted:
                        raise PeerGone(str(exc)) from None
                    # the owner closed this idle stream just as it was reused (nothing was moved): once
                    # more on a fresh one
                    with batch.lock:
                        if sock in batch.socks:
                            batch.socks.remove(sock)
                    close_sock(sock)
                    sock, reused = self._acquire(batch, deadline, fresh=True)
                    continue
                start = stop
        except Refused:
            # refusals come before any payload: the stream is still in step
            self.give_back(batch, sock)
            raise
        self.give_back(batch, sock)

    def give_back(self, batch: StreamBatch, sock: socket.socket) -> None:
        with batch.lock:
            if batch.aborted or sock not in batch.socks:
                return
            batch.socks.remove(sock)
        self.release(sock)

    def _segment(self, sock: socket.socket, kind: int, ops: np.ndarray, where: Where, deadline: float,
                 batch: StreamBatch) -> None:
        wire = np.empty(len(ops), dtype=_wire.WIRE_OP)
        wire["region"] = ops["remote_region"]
        wire["offset"] = ops["remote_offset"]
        wire["length"] = ops["length"]
        total = int(ops["length"].sum(dtype=np.uint64))
        arm_deadline(sock, deadline)
        try:
            sendmsg_all(sock, [REQ.pack(M_REQ, kind, F_PAD if kind == READ else 0, 0, len(ops), total),
                                 memoryview(wire.view(np.uint8))])
            head = recv_exact(sock, RSP.size, deadline, stale_ok=True)
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise StaleStream(f"stream closed by the owner: {exc}") from None
        status, msg = parse_rsp(sock, head, deadline)
        if status == ST_REFUSED:
            raise Refused(f"peer refused the batch: {msg}")
        if status != ST_OK:
            raise Corrupt(f"peer failed the batch: {msg}")
        aborted = lambda: batch.aborted  # noqa: E731
        move(sock, where, ops["local_region"], ops["local_offset"], ops["length"], deadline,
              send=(kind == WRITE), abort_check=aborted, total=total)
        if kind == WRITE:
            status, msg = recv_rsp(sock, deadline)
            if status != ST_OK:
                raise Corrupt(f"peer failed the write: {msg}")
