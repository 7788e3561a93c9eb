"""Helpers of the tcp data-port capability tests: child-side calls (run in a peer process through
the harness, ``state`` first) and a raw, hostile data-port client (run in the test process).

The raw client speaks the tcp transport's wire (plugins/llmdd-transport-tcp, module docstring):
``HELLO`` from the owner, ``OPEN(nonce_c, handle, mac)`` from the client, ``OPEN_RSP`` back, then
``REQ`` / ``RSP``.  ``handle`` and ``key`` are what a linked engine's tcp channel derived from the
capability its owner granted to that link; a test takes them from a linked peer (what an attacker
who stole them would hold) or forges them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading
import time
from typing import Optional

HELLO = struct.Struct("<4sHBx16s16s")
OPEN = struct.Struct("<16s16s32s")
OPEN_RSP = struct.Struct("<B32s")
REQ = struct.Struct("<4sBBHIQ")
RSP = struct.Struct("<4sBBHI")
OP = struct.Struct("<IQQ")
READ, WRITE = 1, 2
ST_OK, ST_REFUSED = 0, 1
#: how long the raw client keeps reading after an answer or a refusal: nothing may follow (a
#: measurement window, not synchronisation)
AFTER_S = 0.3


# --------------------------------------------------------------------------- child side


def credential(state: dict, peer_cluster_id: int) -> dict:
    """What this engine's live link to ``peer_cluster_id`` holds to open data connections to it."""
    link = state["dd"]._core.link_manager.get(peer_cluster_id)
    assert link is not None and link.channel is not None, f"no live link to {peer_cluster_id}"
    ch = link.channel
    return {"handle": bytes(ch._handle), "key": bytes(ch._key), "port": int(ch._addr[1]),
            "endpoint_id": bytes(ch._peer_id)}


def wait_grants(state: dict, n: int, timeout: float = 10.0) -> int:
    """Wait (up to ``timeout``) until the tcp endpoint holds ``n`` link grants; return the count seen."""
    ep = state["dd"]._core.link_manager.endpoint("tcp")
    deadline = time.monotonic() + timeout
    while True:
        with ep._lock:
            got = len(ep._grants)
        if got == n or time.monotonic() >= deadline:
            return got
        time.sleep(0.02)


def own_capability(state: dict, peer_cluster_id: int) -> dict:
    """The capability this engine granted to its link to ``peer_cluster_id``, and every place an
    operator could see that link: its repr, the engine's statistics (for the never-logged check)."""
    dd = state["dd"]
    link = dd._core.link_manager.get(peer_cluster_id)
    assert link is not None and link.capability is not None, f"no granted link to {peer_cluster_id}"
    return {"capability": bytes(link.capability), "shown": repr(link) + "\n" + repr(dd.statistics())}


def data_port(state: dict) -> int:
    from llmdd_tcp import endpoint_fields

    return endpoint_fields(state["dd"]._core.link_manager.endpoint("tcp").describe()).port


def describe_has_capability(state: dict) -> bool:
    """Does the engine's tcp endpoint description carry a capability? (It must not: links only.)"""
    return state["dd"]._core.link_manager.endpoint("tcp").describe().capability is not None


def owner_usage(state: dict) -> dict:
    """Threads, descriptors and data-port counters of this process (the owner under attack)."""
    ep = state["dd"]._core.link_manager.endpoint("tcp")
    st = ep.statistics()
    return {"threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd")),
            "open_connections": st["open_connections"], "pending": st["pending_connections"],
            "capability_refused": st["capability_refused"], "auth_failures": st["auth_failures"],
            "grants": len(ep._grants), "requests": st["requests"], "bytes_served": st["bytes_served"]}


def settle_usage(state: dict, baseline: dict, timeout: float = 10.0) -> dict:
    """Wait (up to ``timeout``) until threads, fds and open data connections are back to ``baseline``;
    return the usage seen last (the caller asserts on it)."""
    deadline = time.monotonic() + timeout
    while True:
        now = owner_usage(state)
        back = (now["threads"] <= baseline["threads"] and now["fds"] <= baseline["fds"]
                and now["open_connections"] <= baseline["open_connections"] and now["pending"] == 0)
        if back or time.monotonic() >= deadline:
            return now
        time.sleep(0.02)


# --------------------------------------------------------------------------- raw client (test side)


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def _drain(s: socket.socket) -> tuple[bytes, bool]:
    """Every byte that follows within ``AFTER_S``, and whether the owner closed the stream."""
    s.settimeout(AFTER_S)
    extra = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return extra, True
            extra += chunk
    except OSError:
        return extra, False


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def forged_credential(rng) -> dict:
    """A credential an attacker makes up: a random handle and key (seeded)."""
    return {"handle": rng.bytes(16), "key": rng.bytes(32)}


def handle_of(capability: bytes) -> bytes:
    return hashlib.sha256(b"llmdd-tcp-handle" + capability).digest()[:16]


class RawStream:
    """One hostile data connection: ``open(cred)`` then requests; every answer is recorded."""

    def __init__(self, port: int, timeout: float = 3.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        hello = _recv_exact(self.sock, HELLO.size)
        assert len(hello) == HELLO.size and hello[:4] == b"LDTH", hello
        _, self.version, self.auth, self.endpoint_id, self.nonce_s = HELLO.unpack(hello)

    def close(self) -> None:
        self.sock.close()

    def open(self, cred: dict, *, nonce_c: Optional[bytes] = None) -> dict:
        """Present ``cred``; ``{"opened": bool, "status", "extra", "closed"}`` (``server_proved``: the
        owner's answer MAC checks out under the credential's key)."""
        nonce_c = nonce_c or os.urandom(16)
        self.sock.sendall(OPEN.pack(nonce_c, cred["handle"],
                                    _mac(cred["key"], b"c", self.endpoint_id, self.nonce_s, nonce_c)))
        rsp = _recv_exact(self.sock, OPEN_RSP.size)
        if len(rsp) < OPEN_RSP.size:
            return {"opened": False, "status": None, "extra": rsp, "closed": True, "server_proved": False}
        status, mac_s = OPEN_RSP.unpack(rsp)
        proved = hmac.compare_digest(mac_s, _mac(cred["key"], b"s", self.endpoint_id, nonce_c, self.nonce_s))
        if status != 0:
            extra, closed = _drain(self.sock)
            return {"opened": False, "status": status, "extra": extra, "closed": closed, "server_proved": proved}
        return {"opened": True, "status": status, "extra": b"", "closed": False, "server_proved": proved}

    def request(self, ops: list, kind: int = READ, payload: bytes = b"") -> dict:
        """One request; for a WRITE the payload follows at once, before any "go" (hostile).  Returns
        ``{"status", "msg", "extra", "closed"}``; ``status`` None when the owner closed without a header."""
        total = sum(length for _, _, length in ops) % (1 << 64)
        try:
            self.sock.sendall(REQ.pack(b"LDRQ", kind, 0, 0, len(ops), total)
                              + b"".join(OP.pack(*op) for op in ops) + payload)
        except OSError:
            return {"status": None, "msg": "", "extra": b"", "closed": True}
        try:
            hdr = _recv_exact(self.sock, RSP.size)
        except OSError:
            hdr = b""
        if len(hdr) < RSP.size:
            extra, _ = _drain(self.sock) if hdr else (b"", True)
            return {"status": None, "msg": "", "extra": hdr + extra, "closed": True}
        magic, status, _, _, mlen = RSP.unpack(hdr)
        if magic != b"LDRS":   # not an answer to a request (e.g. an OPEN refusal): report what came
            extra, _ = _drain(self.sock)
            return {"status": None, "msg": "", "extra": hdr + extra, "closed": True}
        msg = _recv_exact(self.sock, mlen) if mlen else b""
        extra, closed = _drain(self.sock)
        return {"status": status, "msg": msg.decode("utf-8", "replace"), "extra": extra, "closed": closed}


def unopened_request(port: int, ops: list, kind: int = READ, payload: bytes = b"") -> dict:
    """A client that skips OPEN and sends a request (plus payload) right after HELLO."""
    s = RawStream(port)
    try:
        return s.request(ops, kind, payload)
    finally:
        s.close()
