"""tcp transport: per-link grants on the data port (Endpoint.serve_links_only / grant / revoke).

Two endpoints in one process over loopback; the owner ``b`` serves links only.  What the engine's
link manager does with these calls (one grant per link and incarnation, revoked when the link
ends) is tested across processes in tests/reliability/test_data_port_capabilities.py.
"""

from __future__ import annotations

import secrets
import threading
import time

import numpy as np
import pytest

from llmdd._base.status import LLMStatusCode
import attrs
from llmdd.lowlevel import MemRegion, PeerGone, Refused, TransportError, make_ops
from llmdd_tcp import TcpTransport

pytestmark = pytest.mark.timeout(60)
SIZE = 1 << 16


def _reg(ep, rid: int, buf: np.ndarray, remote: bool) -> dict:
    return ep.register(MemRegion(region_id=rid, addr=buf.ctypes.data, size=buf.size, remote_accessible=remote,
                                 placement=0))


def _read(ch, local: int, remote: int, n: int = 256):
    c = ch.read(make_ops(local, 0, remote, 0, n), deadline=time.monotonic() + 5)
    assert c.wait(10)
    return c.error


@pytest.fixture
def pair():
    t = TcpTransport({})
    a, b = t.open_endpoint(), t.open_endpoint()
    rng = np.random.default_rng(1414)
    src = {rid: rng.integers(0, 256, SIZE, dtype=np.uint8) for rid in (10, 11)}
    dst = np.zeros(SIZE, np.uint8)
    b.serve_links_only()
    descs = {rid: _reg(b, rid, buf, True) for rid, buf in src.items()}
    _reg(a, 1, dst, False)
    yield a, b, src, dst, descs
    a.close()
    b.close()


def _channel(a, b, cap: bytes, descs: dict):
    ch = a.connect(attrs.evolve(b.describe(), capability=cap), timeout=5)
    for rid, d in descs.items():
        ch.add_remote_region(rid, SIZE, d)
    return ch


def test_links_only_endpoint_describes_no_capability_and_refuses_its_old_description():
    t = TcpTransport({})
    a, b = t.open_endpoint(), t.open_endpoint()
    try:
        direct = b.describe()
        assert direct.capability is not None         # used directly, the description opens the port
        a.connect(direct, timeout=5).close()
        b.serve_links_only()
        assert b.describe().capability is None
        with pytest.raises(Refused) as info:     # no capability at all: refused before connecting
            a.connect(b.describe(), timeout=5)
        assert info.value.status_code is LLMStatusCode.LLM_LINK_FAILED
        with pytest.raises(Refused):             # the endpoint-wide capability died with the call
            a.connect(direct, timeout=5)
        assert b.statistics()["capability_refused"] >= 1
    finally:
        a.close()
        b.close()


def test_grant_serves_its_regions_only_and_regrant_changes_them(pair):
    a, b, src, dst, descs = pair
    cap = secrets.token_bytes(32)
    b.grant(7, cap, [10])
    ch = _channel(a, b, cap, descs)
    assert _read(ch, 1, 10) is None
    assert np.array_equal(dst[:256], src[10][:256])
    dst[:] = 0
    err = _read(ch, 1, 11)
    assert isinstance(err, Refused) and "not granted to this link" in str(err), err
    assert (dst == 0).all(), "a refused read wrote into local memory"
    b.grant(7, cap, [10, 11])                    # the link announced region 11 too
    assert _read(ch, 1, 11) is None
    assert np.array_equal(dst[:256], src[11][:256])
    # a guessed capability opens nothing
    with pytest.raises(Refused):
        _channel(a, b, secrets.token_bytes(32), descs)


def test_revoke_closes_open_streams_and_stays_revoked(pair):
    a, b, src, dst, descs = pair
    cap = secrets.token_bytes(32)
    b.grant(3, cap, [10, 11])
    ch = _channel(a, b, cap, descs)
    assert _read(ch, 1, 10) is None
    before = b.statistics()["open_connections"]
    assert before >= 1
    b.revoke(3)
    dst[:] = 0
    err = _read(ch, 1, 10)
    assert isinstance(err, (PeerGone, Refused)), err
    assert (dst == 0).all()
    b.grant(3, cap, [10, 11])                    # a late re-grant of a revoked link is ignored
    with pytest.raises(Refused):
        _channel(a, b, cap, descs)
    deadline = time.monotonic() + 5
    while b.statistics()["open_connections"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.statistics()["open_connections"] == 0
    ch.close()


def test_revoke_fails_a_request_the_owner_already_received(pair):
    a, b, src, dst, descs = pair
    cap = secrets.token_bytes(32)
    b.grant(5, cap, [10])
    ch = _channel(a, b, cap, descs)
    entered, release = threading.Event(), threading.Event()
    originals = {name: getattr(b, name) for name in ("_serve_request", "_serve_native")}

    def slowed(original):   # the Python serving, and the C path's (the request waits unread in the stream)
        def slow(*args):
            entered.set()
            release.wait(10)
            return original(*args)
        return slow

    for name, original in originals.items():
        setattr(b, name, slowed(original))
    box = {}
    # a small read runs inline in the caller: in a thread of its own here
    reader = threading.Thread(target=lambda: box.update(c=ch.read(make_ops(1, 0, 10, 0, 4096),
                                                                  deadline=time.monotonic() + 10)))
    reader.start()
    assert entered.wait(5)
    done = threading.Event()
    t = threading.Thread(target=lambda: (b.revoke(5), done.set()))
    t.start()
    # revoke returns while the request waits in the worker; validated after it, the request is not served
    assert done.wait(10), "revoke did not return"
    dst[:] = 0
    release.set()
    t.join(5)
    reader.join(10)
    c = box["c"]
    c.wait(10)
    assert isinstance(c.error, TransportError), c.error
    assert (dst == 0).all(), "a request of a revoked grant moved bytes"
    assert b.statistics()["requests"] == 0
    for name, original in originals.items():
        setattr(b, name, original)


def test_secret_binds_the_capability():
    t = TcpTransport({})
    a, b = t.open_endpoint(secret=b"other"), t.open_endpoint(secret=b"s3cret")
    try:
        b.serve_links_only()
        cap = secrets.token_bytes(32)
        b.grant(1, cap, None)
        with pytest.raises(Refused):             # the right capability, the wrong secret
            a.connect(attrs.evolve(b.describe(), capability=cap), timeout=5)
        assert b.statistics()["auth_failures"] >= 1
        good = t.open_endpoint(secret=b"s3cret")
        try:
            good.connect(attrs.evolve(b.describe(), capability=cap), timeout=5).close()
        finally:
            good.close()
    finally:
        a.close()
        b.close()
