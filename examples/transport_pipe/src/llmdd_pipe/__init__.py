"""llmdd transport ``pipe``: a minimal example over Unix-domain sockets (docs/writing-a-transport.md).

Trust level: owner-mediated, same host.  Each endpoint listens on a Unix-domain socket in a private
temporary directory and serves READ and WRITE requests against its own registered regions: it checks
every op against its remote-accessible regions before a byte moves and refuses the whole request
otherwise.  With a ``secret`` a connection proves it (HMAC over a fresh nonce) before it is served.

Wire, one request per connection: the server sends ``endpoint_id[16] nonce[16]``, the client answers
``HMAC(secret, endpoint_id|nonce)`` and the server ``ok[1]``; then ``REQ(kind, count)`` and ``count``
packed ``(region u4, offset u8, length u8)``; the server answers ``RSP(status, len) message`` and, for a
READ, the bytes of every op in order; for a WRITE the client then sends the bytes and the server
answers ``RSP`` again once they landed.

Written against the public API only (``llmdd.abc``, ``llmdd.lowlevel``, ``llmdd.plugin``): the
registry, batch tracking and error mapping are ``llmdd.lowlevel``'s, the data movement is this
module's.  It favours brevity over speed: one connection and one thread per batch.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import os
import shutil
import socket
import struct
import tempfile
import threading
import time
from typing import Any, Callable, Mapping, Optional

import msgspec
import numpy as np

from llmdd.abc import Channel, Completion, Endpoint, EndpointDescriptor, RegionDescriptor, Transport, TransportInfo
from llmdd.lowlevel import (Batch, BatchSet, Cancelled, Corrupt, MemRegion, PeerGone, RegionRegistry, RegionTable,
                            RegisteredRegion, Refused, ThreadCompletion, TransportTimeout, decode_payload,
                            encode_payload, map_os_error, submitted)
from llmdd.plugin import hookimpl
from llmdd.status import LLMStatusCode

__all__ = ["PipeTransport", "PipeEndpoint", "PipeChannel", "llmdd_register_transports"]

READ, WRITE = 1, 2
_REQ = struct.Struct("<BxxxI")            # kind, op count
_RSP = struct.Struct("<BxxxI")            # status (0 ok, 1 refused), message length
_WIRE = np.dtype([("region", "<u4"), ("offset", "<u8"), ("length", "<u8")])
_MAX_OPS = 1 << 20
#: the version of this transport's descriptor payloads (a peer's newer one is refused)
VERSION = 1


class _EndpointFields(msgspec.Struct, frozen=True):
    path: str                   # the endpoint's Unix-domain socket
    endpoint_id: bytes


class _RegionFields(msgspec.Struct, frozen=True):
    endpoint_id: bytes
    size: int


def _mac(secret: Optional[bytes], endpoint_id: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret or b"", b"llmdd-pipe" + endpoint_id + nonce, hashlib.sha256).digest()


def _arm(sock: socket.socket, deadline: Optional[float]) -> None:
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportTimeout("batch missed its deadline")
        sock.settimeout(left)


def _recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        _arm(sock, deadline)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise PeerGone("the peer closed the connection")
        got += k
    return buf


def _gather(views: Mapping[int, np.ndarray], reg: np.ndarray, off: np.ndarray, ln: np.ndarray) -> bytes:
    return b"".join(views[r][o:o + n].tobytes() for r, o, n in zip(reg.tolist(), off.tolist(), ln.tolist()))


def _scatter(data: bytes, views: Mapping[int, np.ndarray], reg: np.ndarray, off: np.ndarray, ln: np.ndarray,
             stop: Callable[[], bool]) -> None:
    src = np.frombuffer(data, dtype=np.uint8)
    at = 0
    for r, o, n in zip(reg.tolist(), off.tolist(), ln.tolist()):
        if stop():
            raise Cancelled("batch aborted")
        views[r][o:o + n] = src[at:at + n]
        at += n


class _Region(RegisteredRegion):
    """A registered region and a numpy view of its memory."""

    __slots__ = ("view",)

    def __init__(self, region: MemRegion) -> None:
        super().__init__(region)
        size = region.size
        self.view = (np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(region.addr)) if size
                     else np.empty(0, np.uint8))


class _Batch(Batch):
    """A client batch and its connection (aborting it shuts the connection down)."""

    __slots__ = ("sock", "lock")

    def __init__(self) -> None:
        super().__init__()
        self.sock: Optional[socket.socket] = None
        self.lock = threading.Lock()

    def adopt(self, sock: socket.socket) -> None:
        with self.lock:
            self.sock = sock
            if not self.aborted:
                return
        sock.close()
        raise Cancelled("batch aborted")

    def on_abort(self) -> None:
        with self.lock:
            sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class PipeTransport(Transport):
    """Same host, owner-mediated, over Unix-domain sockets."""

    name = "pipe"
    priority = 1                  # below every built-in transport: chosen only when forced
    same_host_only = True
    authenticates = True          # with a secret, only peers that prove it are served

    @classmethod
    def probe(cls) -> TransportInfo:
        if not hasattr(socket, "AF_UNIX"):
            return TransportInfo(name=cls.name, available=False, reason="no Unix-domain sockets here")
        return TransportInfo(name=cls.name, available=True)

    def open_endpoint(self, *, host: str = "127.0.0.1", secret: Optional[bytes] = None) -> "PipeEndpoint":
        return PipeEndpoint(secret)   # host: a Unix socket binds no address; its directory is private (0700)


@hookimpl
def llmdd_register_transports(register: Callable[[type], Any]) -> None:
    register(PipeTransport)


class PipeEndpoint(Endpoint):
    """Listens on a Unix socket, serves its own regions, opens channels to peers."""

    def __init__(self, secret: Optional[bytes]) -> None:
        self._secret = secret
        self._id = os.urandom(16)
        self._lock = threading.Lock()
        self._regs: RegionRegistry[_Region] = RegionRegistry(threading.Condition(self._lock))
        self._conns: dict[socket.socket, frozenset] = {}     # served connections -> regions in use
        self._closed = False
        self._stats = {"requests": 0, "refused": 0, "bytes_served": 0, "auth_failures": 0}
        self._dir = tempfile.mkdtemp(prefix="llmdd-pipe-")
        self._path = os.path.join(self._dir, "ep.sock")
        self._lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._lsock.bind(self._path)
        self._lsock.listen(64)
        self._accepter = threading.Thread(target=self._accept_loop, name="llmdd-pipe-accept", daemon=True)
        self._accepter.start()

    # ------------------------------------------------------------------ the seam
    def describe(self) -> EndpointDescriptor:
        payload = encode_payload(_EndpointFields(self._path, self._id))
        return EndpointDescriptor(transport="pipe", version=VERSION, payload=payload)

    def register(self, region: MemRegion) -> RegionDescriptor:
        with self._lock:
            if self._closed:
                raise Cancelled("endpoint is closed")
            self._regs.add(_Region(region))
        payload = encode_payload(_RegionFields(self._id, region.size))
        return RegionDescriptor(transport="pipe", version=VERSION, payload=payload)

    def deregister(self, region_id: int) -> None:
        def stop_serving(_entry: _Region) -> None:     # under the lock: requests using it end now
            for sock, regions in self._conns.items():
                if region_id in regions:
                    sock.shutdown(socket.SHUT_RDWR)
        # fail this side's batches on it, then wait until no batch or served request pins it
        self._regs.deregister(region_id, locked=stop_serving)

    def connect(self, peer: EndpointDescriptor, *, timeout: float) -> "PipeChannel":
        if self._closed:
            raise Cancelled("endpoint is closed")
        # Refused for another transport's descriptor, a newer version or a malformed payload
        fields = decode_payload(peer, transport="pipe", version=VERSION, type=_EndpointFields)
        ch = PipeChannel(self, fields.path, fields.endpoint_id)
        ch._open(time.monotonic() + timeout).close()   # reachable, same incarnation, authenticated
        return ch

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        try:
            self._lsock.shutdown(socket.SHUT_RDWR)   # wakes accept()
        except OSError:
            pass
        self._lsock.close()
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._accepter.join(5.0)
        self._regs.close()        # fail what is in flight, then wait until no region is pinned
        shutil.rmtree(self._dir, ignore_errors=True)

    def statistics(self) -> dict:
        with self._lock:
            return dict(self._stats, regions=len(self._regs), connections=len(self._conns), closed=self._closed)

    # ------------------------------------------------------------------ serving
    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._lsock.accept()
            except OSError:
                return                                # closed
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._conns[sock] = frozenset()
            threading.Thread(target=self._serve, args=(sock,), name="llmdd-pipe-serve", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            nonce = os.urandom(16)
            sock.sendall(self._id + nonce)
            if not hmac.compare_digest(bytes(_recv_exact(sock, 32)), _mac(self._secret, self._id, nonce)):
                with self._lock:
                    self._stats["auth_failures"] += 1
                sock.sendall(b"\x00")
                return
            sock.sendall(b"\x01")
            while True:
                try:
                    head = _recv_exact(sock, _REQ.size)
                except PeerGone:
                    return                            # the client is done
                kind, count = _REQ.unpack(head)
                if kind not in (READ, WRITE) or count > _MAX_OPS:
                    raise Corrupt(f"bad request (kind {kind}, {count} ops)")
                wire = np.frombuffer(bytes(_recv_exact(sock, count * _WIRE.itemsize)), dtype=_WIRE)
                self._serve_request(sock, kind, wire)
        except Exception:  # noqa: BLE001 - a broken client never breaks the endpoint
            return
        finally:
            with self._lock:
                self._conns.pop(sock, None)
            sock.close()

    def _serve_request(self, sock: socket.socket, kind: int, wire: np.ndarray) -> None:
        reg, off, ln = wire["region"], wire["offset"], wire["length"]
        served = Batch()
        with self._lock:
            try:   # every op inside a remote-accessible region, or nothing moves
                self._regs.served.check(reg, off, ln, "remote")
            except Refused as exc:
                self._stats["refused"] += 1
                refusal: Optional[str] = str(exc)
            else:
                refusal = None
                ids = frozenset(np.unique(reg).tolist())
                self._regs.pin_entries(served, ids)   # deregister waits until this request let go
                self._conns[sock] = ids
                views = {e.region_id: e.view for e in served.pinned}
        if refusal is not None:
            msg = refusal.encode()
            sock.sendall(_RSP.pack(1, len(msg)) + msg)
            return
        try:
            total = int(ln.sum(dtype=np.uint64))
            if kind == READ:
                sock.sendall(_RSP.pack(0, 0) + _gather(views, reg, off, ln))
            else:
                sock.sendall(_RSP.pack(0, 0))
                _scatter(bytes(_recv_exact(sock, total)), views, reg, off, ln, stop=lambda: False)
                sock.sendall(_RSP.pack(0, 0))
            with self._lock:
                self._stats["requests"] += 1
                self._stats["bytes_served"] += total
        finally:
            with self._lock:
                if sock in self._conns:
                    self._conns[sock] = frozenset()
                self._regs.unpin_locked(served)


class PipeChannel(Channel):
    """Batches to one peer endpoint: one connection and one worker thread per batch."""

    def __init__(self, ep: PipeEndpoint, path: str, peer_id: bytes) -> None:
        self._ep = ep
        self._path = path
        self._peer_id = peer_id
        self._lock = threading.Lock()
        self._remote: dict[int, int] = {}
        self._table = RegionTable()
        self._batches: BatchSet[_Batch] = BatchSet(threading.Condition(self._lock))
        self._stats = {"batches": 0, "failed": 0, "last_error": None}

    # ------------------------------------------------------------------ the seam
    def add_remote_region(self, region_id: int, size: int, desc: RegionDescriptor) -> None:
        fields = decode_payload(desc, transport="pipe", version=VERSION, type=_RegionFields)
        if fields.endpoint_id != self._peer_id:
            raise Refused(f"the descriptor of region {region_id} belongs to another endpoint")
        with self._lock:
            self._remote[int(region_id)] = min(int(size), fields.size)
            self._table = RegionTable(self._remote)

    def remove_remote_region(self, region_id: int) -> None:
        with self._lock:
            self._remote.pop(int(region_id), None)
            self._table = RegionTable(self._remote)

    def read(self, ops: np.ndarray, *, deadline: float) -> Completion:
        # the seam's one refusal path: a refusal or failure is the completion's error, never raised
        return submitted(self._submit, READ, ops, deadline)

    def write(self, ops: np.ndarray, *, deadline: float) -> Completion:
        return submitted(self._submit, WRITE, ops, deadline)

    def close(self) -> None:
        self._batches.close(Cancelled("channel closed"))   # fail the batches in flight, wait until they left

    def statistics(self) -> dict:
        with self._lock:
            return dict(self._stats, remote_regions=len(self._remote), closed=self._batches.closed)

    # ------------------------------------------------------------------ batches
    def _submit(self, kind: int, ops: np.ndarray, deadline: float) -> Completion:
        with self._lock:
            if self._batches.closed:
                raise Cancelled("channel closed")
            remote = self._table
        batch = _Batch()
        regs = self._ep._regs
        with regs.cond:
            arr = regs.pin(ops, remote, batch)      # Refused (nothing pinned) before a byte moves
        try:
            with self._lock:
                self._batches.add(batch)
        except BaseException:
            regs.unpin(batch)
            raise
        views = {e.region_id: e.view for e in batch.pinned}
        batch.completion = ThreadCompletion(
            [lambda: self._run(batch, kind, arr, views, deadline)], deadline=deadline, abort=batch.abort,
            on_done=lambda c: self._end(batch, c.recorded_error), map_error=map_os_error, name="llmdd-pipe")
        return batch.completion

    def _end(self, batch: _Batch, err: Any) -> None:
        with batch.lock:
            sock, batch.sock = batch.sock, None
        if sock is not None:
            sock.close()
        self._ep._regs.unpin(batch)
        with self._lock:
            self._batches.discard_locked(batch)
            self._stats["batches"] += 1
            if err is not None:
                self._stats["failed"] += 1
                self._stats["last_error"] = str(err)

    def _open(self, deadline: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _arm(sock, deadline)
            sock.connect(self._path)
            hello = bytes(_recv_exact(sock, 32, deadline))
            if hello[:16] != self._peer_id:
                raise PeerGone("the socket belongs to another endpoint incarnation")
            sock.sendall(_mac(self._ep._secret, self._peer_id, hello[16:]))
            if _recv_exact(sock, 1, deadline) != b"\x01":
                raise Refused("the peer refused the connection (authentication failed)",
                              status_code=LLMStatusCode.LLM_LINK_FAILED)
            return sock
        except BaseException as exc:
            sock.close()
            raise map_os_error(exc) from None

    def _run(self, batch: _Batch, kind: int, ops: np.ndarray, views: dict, deadline: float) -> None:
        if not len(ops):
            return
        sock = self._open(deadline)
        batch.adopt(sock)
        wire = np.empty(len(ops), dtype=_WIRE)
        wire["region"], wire["offset"], wire["length"] = ops["remote_region"], ops["remote_offset"], ops["length"]
        local = (ops["local_region"], ops["local_offset"], ops["length"])
        _arm(sock, deadline)
        sock.sendall(_REQ.pack(kind, len(ops)) + wire.tobytes())
        status, n = _RSP.unpack(_recv_exact(sock, _RSP.size, deadline))
        if status != 0:
            raise Refused(f"the peer refused the batch: {bytes(_recv_exact(sock, n, deadline)).decode()}")
        if kind == READ:
            data = _recv_exact(sock, int(ops["length"].sum(dtype=np.uint64)), deadline)
            _scatter(bytes(data), views, *local, stop=lambda: batch.aborted)
        else:
            _arm(sock, deadline)
            sock.sendall(_gather(views, *local))
            if _RSP.unpack(_recv_exact(sock, _RSP.size, deadline))[0] != 0:
                raise Corrupt("the peer failed the write")
