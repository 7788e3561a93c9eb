"""tcp transport: waits expected to be short are polled before they sleep (``llmdd.tcp.spin_us``).

``_spin_readable`` on real loopback streams (bytes waiting, nothing waiting, the end of the stream,
sockets it must not poll), and the owner's serving thread: with a spin budget far longer than the gap
between a client's back-to-back requests, every request after the first is found while polling
(``requests_spun``); with ``spin_us = 0`` none is, and the bytes are the same either way."""

from __future__ import annotations

import os
import socket
import sys

import numpy as np
import pytest

from llmdd.lowlevel import MemRegion
from llmdd_tcp import TcpTransport
from llmdd_tcp._sock import SPIN_SKIP_MAX, Spinner, _spin_readable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _quick_owner import pattern  # noqa: E402
from test_quick import BS, NB, SEED, SIZE, Owner  # noqa: E402

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def stream():
    """A connected pair of loopback TCP sockets (client, server side), both blocking."""
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        a = socket.create_connection(lst.getsockname(), timeout=10)
        a.settimeout(None)
        b, _ = lst.accept()
    yield a, b
    a.close()
    b.close()


def test_spin_finds_waiting_bytes_without_taking_them(stream):
    a, b = stream
    a.sendall(b"xyz")
    assert _spin_readable(b, 5.0)
    assert b.recv(3, socket.MSG_WAITALL) == b"xyz"   # peeked, not consumed


def test_spin_gives_up_on_an_idle_stream(stream):
    a, b = stream
    assert not _spin_readable(b, 0.001)
    a.sendall(b"q")   # the control: the same socket, bytes waiting
    assert _spin_readable(b, 5.0)


def test_spin_reports_the_end_of_the_stream(stream):
    a, b = stream
    a.shutdown(socket.SHUT_WR)
    assert _spin_readable(b, 5.0)
    assert b.recv(1) == b""


def test_spin_declines_what_it_must_not_poll(stream):
    a, b = stream
    a.sendall(b"z")
    assert not _spin_readable(b, 0.0)          # no budget
    b.settimeout(5.0)                          # a Python timeout: its recv would wait in poll() first
    assert not _spin_readable(b, 5.0)
    b.settimeout(None)
    assert _spin_readable(b, 5.0)              # the control


def test_spinner_backs_off_after_misses_and_starts_over_after_a_hit(stream):
    a, b = stream
    sp = Spinner(0.0005)
    pattern = []   # per wait: "s" spun and missed, "-" slept at once (skipped)
    skips = [1, 2, 4, 8, 16, 32, 64, 64]
    for _ in range(len(skips) + sum(skips)):   # each spin that missed, then the waits it skips
        before = sp.misses
        assert not sp.wait(b, 5.0)                    # nothing ever comes on this stream
        pattern.append("s" if sp.misses > before else "-")
    runs = "".join(pattern).split("s")[1:]
    assert [len(r) for r in runs] == skips, pattern   # the skips double, up to the cap
    assert SPIN_SKIP_MAX == 64 and sp.hits == 0
    assert sp.skip == 0 and sp.misses == len(skips)
    a.sendall(b"h")
    assert sp.wait(b, 5.0) and sp.hits == 1           # a hit ...
    b.recv(1)
    assert not sp.wait(b, 5.0)                        # ... so the next miss is spun (not skipped) ...
    assert sp.skip == 1                               # ... and costs one skipped wait, as the first did
    assert not Spinner(0.0).wait(b, 5.0) and not Spinner(1.0).wait(b, 0.0)   # no budget: never spins


def _pull_n(options: dict, n: int) -> tuple[dict, list]:
    owner = Owner(options)
    ep = TcpTransport({}).open_endpoint()
    try:
        local = np.zeros(SIZE, np.uint8)
        ep.register(MemRegion(region_id=1, addr=local.ctypes.data, size=SIZE, remote_accessible=False, placement=0))
        ch = ep.connect(owner.desc, timeout=10)
        ch.add_remote_region(5, SIZE, owner.descs[5])
        pull = ch.prepare([(1, 5)], BS, NB, NB, False, timeout_s=10)
        assert pull is not None
        rng = np.random.default_rng(SEED + 9)
        pairs = list(zip(rng.integers(0, NB, n).tolist(), rng.integers(0, NB, n).tolist()))
        want = pattern(5, SIZE, SEED).reshape(NB, BS)
        for s, d in pairs:
            assert pull([s], [d]) == BS
            assert np.array_equal(local.reshape(NB, BS)[d], want[s])
        stats = owner.ask("stats")   # before the channel closes: its end would be found by a spin too
        ch.close()
        return stats, pairs
    finally:
        ep.close()
        owner.close()


def test_owner_finds_back_to_back_requests_while_spinning():
    n = 12
    # a spin far longer than any gap between two calls of this loop, and a linger as long
    stats, _ = _pull_n({"llmdd.tcp.spin_us": 20_000_000, "llmdd.tcp.linger_ms": 20_000}, n)
    assert stats["requests"] == n
    assert stats["requests_spun"] == n - 1, stats   # the first came through the loop's hand-over


def test_owner_with_spin_off_never_spins():
    stats, _ = _pull_n({"llmdd.tcp.spin_us": 0, "llmdd.tcp.linger_ms": 20_000}, 12)
    assert stats["requests"] == 12 and stats["requests_spun"] == 0, stats
