"""MAC'd control frames across real processes (issue 14, items 3 and 5): with a shared secret and
no TLS, an on-path attacker (a forwarding proxy in this test process, between the decoder and the
prompt's control listener) who modifies, replays or reorders one control frame after the
handshake fails the link on the side that receives it, and nothing is pulled over the dead link.
The control: through the same proxy, untouched, frames are MAC'd and the link works.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time

import numpy as np
import pytest

from llmdd import LLMStatusCode
from llmdd._protocol.codec import FLAG_CRC32, FLAG_MAC
from llmdd.testing._harness import peers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peers as P  # noqa: E402

S = LLMStatusCode
HOST = "127.0.0.1"
ENV = {"LLMDD_AUTH_SECRET": None}
SECRET = {"llmdd.auth_secret": "frame macs: a shared secret"}
HEADER = struct.Struct(">2sBBBI")

pytestmark = pytest.mark.timeout(90)


class Proxy:
    """Forward one control connection frame by frame; ``tamper(direction, action)`` arms an attack
    on the next MAC'd frame of ``direction`` ("up": decoder -> prompt, "down": back)."""

    def __init__(self, target: tuple) -> None:
        self.target = target
        self.lsock = socket.create_server((HOST, 0))
        self.port = self.lsock.getsockname()[1]
        self.lock = threading.Lock()
        self.armed: dict = {}
        self.done = {"up": threading.Event(), "down": threading.Event()}
        self.flags = {"up": [], "down": []}
        self.socks: list = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def tamper(self, direction: str, action: str) -> None:
        with self.lock:
            self.armed[direction] = action

    def close(self) -> None:
        for s in [self.lsock, *self.socks]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for t in self.threads:
            t.join(5)

    def _accept(self) -> None:
        try:
            client, _ = self.lsock.accept()
        except OSError:
            return
        server = socket.create_connection(self.target)
        self.socks += [client, server]
        for src, dst, name in ((client, server, "up"), (server, client, "down")):
            t = threading.Thread(target=self._pump, args=(src, dst, name), daemon=True)
            self.threads.append(t)
            t.start()

    def _pump(self, src: socket.socket, dst: socket.socket, name: str) -> None:
        buf = b""
        held = None
        try:
            while True:
                chunk = src.recv(65536)
                if not chunk:
                    break
                buf += chunk
                while len(buf) >= HEADER.size:
                    _, _, _, flags, length = HEADER.unpack_from(buf)
                    total = HEADER.size + length + (32 if flags & FLAG_MAC else 4 if flags & FLAG_CRC32 else 0)
                    if len(buf) < total:
                        break
                    frame, buf = buf[:total], buf[total:]
                    self.flags[name].append(flags)
                    with self.lock:
                        action = self.armed.get(name) if flags == FLAG_MAC else None
                        if action in ("modify", "replay"):
                            del self.armed[name]
                    if action == "modify":
                        frame = frame[:HEADER.size] + bytes([frame[HEADER.size] ^ 0x01]) + frame[HEADER.size + 1:]
                        self.done[name].set()
                    elif action == "replay":
                        dst.sendall(frame)
                        self.done[name].set()
                    elif action == "reorder":
                        if held is None:
                            held = frame          # keep the first, send it after the second
                            continue
                        with self.lock:
                            del self.armed[name]
                        frame, held = frame + held, None
                        self.done[name].set()
                    dst.sendall(frame)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass


def _linked_through_proxy(c) -> tuple:
    p, d = c["p"], c["d"]
    port = p.call(P.start, "PROMPT", 1, f"{HOST}:0", seed=1, extra=SECRET)
    d.call(P.start, "DECODER", 2, extra=SECRET)
    proxy = Proxy((HOST, port))
    assert d.call(P.link, [(1, HOST, proxy.port)], 5000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    return p, d, proxy


def _wait(pred, timeout: float = 8.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def test_untouched_frames_are_macd_and_the_link_works():
    with peers("p", "d", env=ENV) as c:
        p, d, proxy = _linked_through_proxy(c)
        try:
            assert d.call(P.pull, 1, [1], [0])[0] == "LLM_SUCCESS"
            np.testing.assert_array_equal(d.call(P.blocks)[:, 0], P.pattern(1, 1)[:, 1])
            # keepalives flow both ways, every one after the handshake MAC'd, and the link stays up
            assert _wait(lambda: all(proxy.flags[k].count(FLAG_MAC) >= 4 for k in ("up", "down"))), proxy.flags
            for k in ("up", "down"):
                seq = proxy.flags[k]
                first = seq.index(FLAG_MAC)
                assert first >= 1 and all(f == FLAG_MAC for f in seq[first:]), (k, seq)
            assert p.call(P.link_states) == {2: "linked"} and d.call(P.link_states) == {1: "linked"}
        finally:
            proxy.close()


@pytest.mark.parametrize("direction", ["up", "down"])
@pytest.mark.parametrize("action", ["modify", "replay", "reorder"])
def test_a_tampered_control_frame_fails_the_link(direction, action):
    with peers("p", "d", env=ENV) as c:
        p, d, proxy = _linked_through_proxy(c)
        try:
            d.call(P.pull, 1, [1], [0])
            receiver, peer_id = (p, 2) if direction == "up" else (d, 1)
            proxy.tamper(direction, action)
            assert proxy.done[direction].wait(10), "no frame to tamper with came"
            state, took = receiver.call(P.wait_link_state, peer_id, (None, "failed", "closed"), 8.0)
            assert state in (None, "failed", "closed"), (state, receiver.call(P.link_states))
            # nothing moves over the dead link: the decoder's pull fails (it hears of the failure)
            assert _wait(lambda: d.call(P.link_states).get(1) != "linked"), d.call(P.link_states)
            before = d.call(P.blocks).copy()
            status = d.call(P.pull, 1, [2], [3])[0]
            assert status != "LLM_SUCCESS", status
            np.testing.assert_array_equal(d.call(P.blocks), before)
        finally:
            proxy.close()
