"""A loopback TCP proxy with fault controls, to partition, delay, truncate or reset a link.

``LoopbackProxy(target_host, target_port)`` listens on ``127.0.0.1`` (``proxy.address``) and
forwards every accepted connection to the target, both directions, from one I/O thread driven
by ``selectors``.  Controls (thread-safe, effective at once):

* ``partition()`` — stop forwarding in both directions and keep every connection open without
  sending anything (no data, no FIN, no RST), like a network partition.  Connections accepted
  while partitioned are held too and reach the target only after ``heal()``.  Bytes already
  read by the proxy are kept and delivered after ``heal()``.
* ``heal()`` — resume forwarding.
* ``reset_all()`` — RST every current connection on both sides (``SO_LINGER`` 0).
* ``delay(seconds)`` — hold every chunk for ``seconds`` before forwarding it (0 disables).
* ``drop_after(nbytes)`` — from now on, forward at most ``nbytes`` more in each direction
  (summed over connections), then read and silently discard the rest; ``None`` disables.
* counters ``bytes_client_to_target``, ``bytes_target_to_client`` (bytes forwarded),
  ``bytes_dropped``, ``accepted``, ``active``.

``close()`` closes every socket and joins the I/O thread.  Half-closes are propagated (a FIN
from one side becomes ``shutdown(SHUT_WR)`` on the other once its buffered bytes are written);
an error on one side resets the other.
"""

from __future__ import annotations

import collections
import errno
import selectors
import socket
import struct
import threading
import time
from typing import Any

__all__ = ["LoopbackProxy"]

_CHUNK = 65536
_HIGH_WATER = 4 * _CHUNK  # stop reading a side while this much is queued for the other


def _rst_close(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class _Flow:
    """One direction of a connection: bytes read from ``src`` waiting to be written to ``dst``."""

    def __init__(self, upstream: bool) -> None:
        self.upstream = upstream  # client -> target
        self.chunks: collections.deque[list[Any]] = collections.deque()  # [release_time, memoryview]
        self.queued = 0
        self.eof = False  # src sent FIN
        self.shut = False  # FIN propagated to dst


class _Pair:
    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.target: socket.socket | None = None
        self.connecting = False
        self.up = _Flow(True)
        self.down = _Flow(False)
        self.closed = False


class LoopbackProxy:
    """TCP proxy on 127.0.0.1 in front of ``(target_host, target_port)``; see the module docstring."""

    def __init__(self, target_host: str, target_port: int, *, listen_host: str = "127.0.0.1",
                 listen_port: int = 0) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((listen_host, listen_port))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._pairs: list[_Pair] = []
        self._partitioned = False
        self._delay = 0.0
        self._budget: dict[bool, int | None] = {True: None, False: None}
        self._commands: list[tuple[str, threading.Event]] = []
        self._stopping = False
        self.bytes_client_to_target = 0
        self.bytes_target_to_client = 0
        self.bytes_dropped = 0
        self.accepted = 0
        self._thread = threading.Thread(target=self._run, name=f"llmdd-proxy-{self.address[1]}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public controls

    @property
    def host(self) -> str:
        return self.address[0]

    @property
    def port(self) -> int:
        return self.address[1]

    @property
    def active(self) -> int:
        """Connections currently open through the proxy."""
        with self._lock:
            return sum(1 for p in self._pairs if not p.closed)

    @property
    def partitioned(self) -> bool:
        return self._partitioned

    def partition(self) -> None:
        with self._lock:
            self._partitioned = True
        self._wake()

    def heal(self) -> None:
        with self._lock:
            self._partitioned = False
        self._wake()

    def delay(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("delay must be >= 0")
        with self._lock:
            self._delay = float(seconds)
        self._wake()

    def drop_after(self, nbytes: int | None) -> None:
        if nbytes is not None and nbytes < 0:
            raise ValueError("nbytes must be >= 0 or None")
        with self._lock:
            self._budget = {True: nbytes, False: nbytes}
        self._wake()

    def reset_all(self, timeout: float = 5.0) -> None:
        """RST every current connection (both sides); returns once done."""
        self._command("reset", timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Close the listener and every connection, and join the I/O thread.  Idempotent."""
        if self._thread.is_alive():
            with self._lock:
                self._stopping = True
            self._wake()
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError("proxy I/O thread did not stop")
        for s in (self._wake_r, self._wake_w, self._listener):
            s.close()
        self._sel.close()

    def __enter__(self) -> "LoopbackProxy":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<LoopbackProxy {self.address[0]}:{self.address[1]} -> {self.target[0]}:{self.target[1]}"
                f" partitioned={self._partitioned} active={self.active}>")

    # ------------------------------------------------------------------ internals

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already woken, or closed

    def _command(self, name: str, timeout: float) -> None:
        done = threading.Event()
        with self._lock:
            if self._stopping or not self._thread.is_alive():
                raise RuntimeError("proxy is closed")
            self._commands.append((name, done))
        self._wake()
        if not done.wait(timeout):
            raise TimeoutError(f"proxy did not perform {name!r} within {timeout} s")

    def _run(self) -> None:
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        try:
            while True:
                with self._lock:
                    stopping = self._stopping
                    commands, self._commands = self._commands, []
                if stopping:
                    break
                for name, done in commands:
                    if name == "reset":
                        for pair in list(self._pairs):
                            self._close_pair(pair, rst=True)
                    done.set()
                timeout = self._sync_interest()
                for key, events in self._sel.select(timeout):
                    tag = key.data
                    if tag == "wake":
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except BlockingIOError:
                            pass
                    elif tag == "accept":
                        self._accept()
                    else:
                        pair, side = tag
                        if not pair.closed:
                            self._service(pair, side, events)
                self._pairs = [p for p in self._pairs if not p.closed]
        finally:
            for pair in self._pairs:
                self._close_pair(pair, rst=False)
            self._pairs = []
            with self._lock:
                for _, done in self._commands:
                    done.set()
                self._commands = []

    # -- connection setup

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(client)
            with self._lock:
                self._pairs.append(pair)
                self.accepted += 1
            self._sel.register(client, selectors.EVENT_READ, (pair, "client"))

    def _start_connect(self, pair: _Pair) -> None:
        target = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        target.setblocking(False)
        target.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair.target = target
        pair.connecting = True
        err = target.connect_ex(self.target)
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            self._close_pair(pair, rst=True)  # refused: the client sees a reset
            return
        self._sel.register(target, selectors.EVENT_WRITE, (pair, "target"))

    # -- event interest, recomputed each loop turn

    def _sync_interest(self) -> float | None:
        now = time.monotonic()
        with self._lock:
            partitioned = self._partitioned
        next_release: float | None = None
        for pair in self._pairs:
            if pair.closed:
                continue
            if pair.target is None:
                if partitioned:
                    self._modify(pair.client, 0, (pair, "client"))
                    continue
                self._start_connect(pair)
                if pair.closed:
                    continue
            if pair.connecting:
                self._modify(pair.client, 0, (pair, "client"))
                continue
            for sock, side, out_flow, in_flow in ((pair.client, "client", pair.up, pair.down),
                                                 (pair.target, "target", pair.down, pair.up)):
                mask = 0
                if not partitioned:
                    if not out_flow.eof and out_flow.queued < _HIGH_WATER:
                        mask |= selectors.EVENT_READ
                    if in_flow.chunks:
                        release = in_flow.chunks[0][0]
                        if release <= now:
                            mask |= selectors.EVENT_WRITE
                        elif next_release is None or release < next_release:
                            next_release = release
                    elif in_flow.eof and not in_flow.shut:
                        mask |= selectors.EVENT_WRITE  # propagate the FIN
                assert sock is not None
                self._modify(sock, mask, (pair, side))
        if next_release is None:
            return None
        return max(0.0, next_release - now)

    def _modify(self, sock: socket.socket, mask: int, data: tuple[_Pair, str]) -> None:
        key = self._sel.get_map().get(sock.fileno())
        if key is None:
            if mask:
                self._sel.register(sock, mask, data)
            return
        if mask == 0:
            self._sel.unregister(sock)
            return
        if key.events != mask:
            self._sel.modify(sock, mask, data)

    # -- data

    def _service(self, pair: _Pair, side: str, events: int) -> None:
        if pair.connecting and side == "target":
            assert pair.target is not None
            err = pair.target.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._close_pair(pair, rst=True)
                return
            pair.connecting = False
            return
        sock = pair.client if side == "client" else pair.target
        assert sock is not None
        out_flow = pair.up if side == "client" else pair.down
        in_flow = pair.down if side == "client" else pair.up
        if events & selectors.EVENT_READ:
            try:
                data = sock.recv(_CHUNK)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                self._close_pair(pair, rst=True)
                return
            if data == b"":
                out_flow.eof = True
            elif data:
                self._enqueue(out_flow, data)
        if events & selectors.EVENT_WRITE and not pair.closed:
            self._flush(pair, sock, in_flow)
        if pair.up.shut and pair.down.shut:
            self._close_pair(pair, rst=False)

    def _enqueue(self, flow: _Flow, data: bytes) -> None:
        with self._lock:
            budget = self._budget[flow.upstream]
            delay = self._delay
            if budget is not None:
                keep = min(budget, len(data))
                self._budget[flow.upstream] = budget - keep
                self.bytes_dropped += len(data) - keep
                data = data[:keep]
        if data:
            flow.chunks.append([time.monotonic() + delay, memoryview(data)])
            flow.queued += len(data)

    def _flush(self, pair: _Pair, sock: socket.socket, flow: _Flow) -> None:
        now = time.monotonic()
        while flow.chunks and flow.chunks[0][0] <= now:
            chunk = flow.chunks[0][1]
            try:
                sent = sock.send(chunk)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._close_pair(pair, rst=True)
                return
            flow.queued -= sent
            with self._lock:
                if flow.upstream:
                    self.bytes_client_to_target += sent
                else:
                    self.bytes_target_to_client += sent
            if sent < len(chunk):
                flow.chunks[0][1] = chunk[sent:]
                return
            flow.chunks.popleft()
        if not flow.chunks and flow.eof and not flow.shut:
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            flow.shut = True

    def _close_pair(self, pair: _Pair, *, rst: bool) -> None:
        if pair.closed:
            return
        pair.closed = True
        for sock in (pair.client, pair.target):
            if sock is None:
                continue
            try:
                self._sel.unregister(sock)
            except (KeyError, ValueError):
                pass
            if rst:
                _rst_close(sock)
            else:
                sock.close()
