"""tcp transport over TLS (issue 14, item 2): with ``llmdd.tls_*`` options the data connections use
TLS under the engine's policy; the wire inside TLS, the capability check and the bounds are the
plain transport's.

Endpoints in one process over loopback; certificates from trustme (the test extra): missing, the
test fails under CI and skips elsewhere.  The proof that data goes over TLS is a recording proxy
between channel and data port: the seeded payload never shows on the wire under TLS, while the same
recorder sees it in the clear without TLS (the control).
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import socket
import threading
import time

import numpy as np
import pytest

from llmdd import LLMException, LLMStatusCode
import attrs
import msgspec
from llmdd.lowlevel import MemRegion, Refused, encode_payload, make_ops
from llmdd.testing import CONFORMANCE_CHECKS, run_check
from llmdd.abc import RegionDescriptor
from llmdd_tcp import VERSION, RegionFields, TcpTransport, endpoint_fields

pytestmark = pytest.mark.timeout(120)
SIZE = 1 << 20
NAME = "llmdd-node.test"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    try:
        import trustme
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("the tcp TLS tests need the trustme package (the test extra); CI must install it",
                        pytrace=False)
        pytest.skip("the tcp TLS tests need the trustme package (pip install -e '.[test]')")
    d = tmp_path_factory.mktemp("tcp_tls")
    out = {}
    for tag in ("", "rogue_"):
        ca = trustme.CA()
        ca.cert_pem.write_to_path(str(d / f"{tag}ca.pem"))
        leaf = ca.issue_cert("127.0.0.1", NAME)
        leaf.cert_chain_pems[0].write_to_path(str(d / f"{tag}node.pem"))
        leaf.private_key_pem.write_to_path(str(d / f"{tag}node.key"))
        out.update({f"{tag}{n}": str(d / f"{tag}{n}") for n in ("ca.pem", "node.pem", "node.key")})
    return out


def _opts(certs, tag: str = "", *, ca: str = "", cert: bool = True, **more) -> dict:
    out = {"llmdd.tls_ca": certs[f"{ca or tag}ca.pem"]}
    if cert:
        out.update({"llmdd.tls_cert": certs[f"{tag}node.pem"], "llmdd.tls_key": certs[f"{tag}node.key"]})
    out.update(more)
    return out


def _reg(ep, rid: int, buf: np.ndarray, remote: bool) -> dict:
    return ep.register(MemRegion(region_id=rid, addr=buf.ctypes.data, size=buf.size, remote_accessible=remote,
                                 placement=0))


def _wait(pred, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not pred():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


class Recorder:
    """A loopback TCP proxy to ``target`` that keeps every byte it forwards, both ways."""

    def __init__(self, target: tuple) -> None:
        self.target = target
        self.up = bytearray()      # client -> server
        self.down = bytearray()    # server -> client
        self._lock = threading.Lock()
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self._lsock.settimeout(0.2)
        self.port = self._lsock.getsockname()[1]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._socks: list = []
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self._lsock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            s = socket.create_connection(self.target, timeout=5)
            with self._lock:
                self._socks += [c, s]
            for src, dst, buf in ((c, s, self.up), (s, c, self.down)):
                t = threading.Thread(target=self._pump, args=(src, dst, buf), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src, dst, buf) -> None:
        src.settimeout(None)
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                with self._lock:
                    buf += data
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._stop.set()
        self._lsock.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for t in self._threads:
            t.join(5)


def _tls_records(wire: bytes) -> int:
    """How many bytes of ``wire`` (one direction of a connection, from its first byte) lie inside
    well-formed TLS records: a record is a content type (20-23), version 3.x, a length of at most
    2**14 + 256 and that many bytes; the last one may be cut short (the connection is still open).
    Every byte inside a record, and ``len(wire)`` returned, means nothing travelled outside TLS: a
    check by structure, where a search of the ciphertext for a 4-byte header would match by chance
    (about once in a thousand runs for a few MiB of random bytes: it failed CI once)."""
    at = 0
    while at + 5 <= len(wire):
        kind, major, length = wire[at], wire[at + 1], int.from_bytes(wire[at + 3:at + 5], "big")
        if kind not in (20, 21, 22, 23) or major != 3 or length > (1 << 14) + 256:
            return at
        at += 5 + length
    return len(wire) if at >= len(wire) or len(wire) - at < 5 else at


def _shows(wire: bytes, payload: np.ndarray, probes: int = 64) -> int:
    """How many of ``probes`` 32-byte pieces of ``payload`` appear in ``wire``."""
    raw = payload.tobytes()
    step = max(1, (len(raw) - 32) // probes)
    return sum(raw[i:i + 32] in wire for i in range(0, step * probes, step))


@contextlib.contextmanager
def _linked(opts_a: dict, opts_b: dict, *, via_recorder: bool = False):
    """``a`` reads/writes region 10 of ``b`` (which serves links only) under one grant."""
    a, b = TcpTransport(opts_a).open_endpoint(), TcpTransport(opts_b).open_endpoint()
    rec = None
    try:
        rng = np.random.default_rng(20261201)
        src = rng.integers(0, 256, SIZE, dtype=np.uint8)
        dst = np.zeros(SIZE, np.uint8)
        b.serve_links_only()
        desc = _reg(b, 10, src, True)
        _reg(a, 1, dst, False)
        cap = secrets.token_bytes(32)
        b.grant(1, cap, [10])
        peer = attrs.evolve(b.describe(), capability=cap)
        if via_recorder:
            fields = endpoint_fields(peer)
            rec = Recorder(("127.0.0.1", fields.port))
            peer = attrs.evolve(peer, payload=encode_payload(msgspec.structs.replace(fields, port=rec.port)))
        ch = a.connect(peer, timeout=5)
        ch.add_remote_region(10, SIZE, desc)
        yield a, b, ch, src, dst, rec
        ch.close()
    finally:
        a.close()
        b.close()
        if rec is not None:
            rec.close()


def _pull_and_push(ch, src, dst) -> None:
    """One large pull (many windows) and one push of fresh random bytes; bytes compared both ways."""
    c = ch.read(make_ops(1, 0, 10, 0, SIZE), deadline=time.monotonic() + 20)
    assert c.wait(30) and c.error is None, c.error
    np.testing.assert_array_equal(dst, src)
    dst[:] = np.random.default_rng(77).integers(0, 256, SIZE, dtype=np.uint8)
    c = ch.write(make_ops(1, 0, 10, 0, SIZE), deadline=time.monotonic() + 20)
    assert c.wait(30) and c.error is None, c.error
    np.testing.assert_array_equal(src, dst)


def test_data_goes_over_tls_and_a_plain_pair_shows_its_bytes(certs):
    with _linked(_opts(certs), _opts(certs), via_recorder=True) as (a, b, ch, src, dst, rec):
        assert endpoint_fields(b.describe()).tls is True and b.statistics()["tls"] is True
        pulled = src.copy()
        _pull_and_push(ch, src, dst)
        assert _wait(lambda: len(rec.down) > SIZE and len(rec.up) > SIZE)
        up, down = bytes(rec.up), bytes(rec.down)
        assert up[:1] == b"\x16" and down[:1] == b"\x16", "the data connection does not start with a TLS handshake"
        assert _tls_records(down) == len(down) and _tls_records(up) == len(up), "bytes outside TLS records"
        assert _shows(down, pulled) == 0, "pulled bytes visible on the wire"
        assert _shows(up, src) == 0, "pushed bytes visible on the wire"
    # the control: the same recorder on a plain pair sees the payload and the headers
    with _linked({}, {}, via_recorder=True) as (a, b, ch, src, dst, rec):
        assert endpoint_fields(b.describe()).tls is False
        pulled = src.copy()
        _pull_and_push(ch, src, dst)
        assert _wait(lambda: len(rec.down) > SIZE and len(rec.up) > SIZE)
        assert b"LDTH" in bytes(rec.down) and b"LDRQ" in bytes(rec.up)
        assert _tls_records(bytes(rec.down)) == 0 and _tls_records(bytes(rec.up)) == 0   # no record at all
        assert _shows(bytes(rec.down), pulled) == 64 and _shows(bytes(rec.up), src) == 64


def test_many_small_and_mixed_ops_over_tls(certs):
    with _linked(_opts(certs), _opts(certs)) as (a, b, ch, src, dst, _):
        rng = np.random.default_rng(4242)
        # 5000 small ops (several windows, staged) and two large ones (sliced); the local side holds the
        # pieces in another order, so that no two ops coalesce
        lens = np.concatenate([rng.integers(1, 64, 5000), [300_000, 140_001]]).astype(np.uint64)
        rng.shuffle(lens)
        roff = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.uint64)
        perm = rng.permutation(len(lens))
        loff = np.empty_like(roff)
        loff[perm] = np.concatenate([[0], np.cumsum(lens[perm])[:-1]]).astype(np.uint64)
        n = int(lens.sum())
        assert n <= SIZE
        ops = make_ops(1, loff, 10, roff, lens)

        def pieces(buf, offs):
            return [buf[int(o):int(o) + int(k)] for o, k in zip(offs, lens)]

        c = ch.read(ops, deadline=time.monotonic() + 20)
        assert c.wait(30) and c.error is None, c.error
        for got, want in zip(pieces(dst, loff), pieces(src, roff)):
            np.testing.assert_array_equal(got, want)
        assert (dst[n:] == 0).all()
        dst[:n] = rng.integers(0, 256, n, dtype=np.uint8)
        c = ch.write(ops, deadline=time.monotonic() + 20)
        assert c.wait(30) and c.error is None, c.error
        for got, want in zip(pieces(src, roff), pieces(dst, loff)):
            np.testing.assert_array_equal(got, want)
        # the owner's bounds hold inside TLS: out of range (refused here) and an unknown region (refused by
        # the owner) move nothing
        before = dst.copy()
        c = ch.read(make_ops(1, 0, 10, SIZE - 8, 16), deadline=time.monotonic() + 5)
        assert c.wait(10) and isinstance(c.error, Refused), c.error
        unknown = RegionFields(endpoint_id=endpoint_fields(b.describe()).endpoint_id, region_id=11, size=SIZE,
                               remote_accessible=True)   # the owner has no region 11
        ch.add_remote_region(11, SIZE, RegionDescriptor(transport="tcp", version=VERSION,
                                                         payload=encode_payload(unknown)))
        c = ch.read(make_ops(1, 0, 11, 0, 16), deadline=time.monotonic() + 5)
        assert c.wait(10) and isinstance(c.error, Refused), c.error
        np.testing.assert_array_equal(dst, before)


def test_blocks_over_tls_move_in_staged_gathers(certs, monkeypatch):
    """Equal blocks over TLS (the engine's case): both ends stage them, up to 256 KiB a stage, with one
    copy_runs call per stage (no Python object per op); every block lands, the blocks not asked for
    stay as they were."""
    from llmdd_tcp import _tls_io   # the module whose stages look copy_runs up

    calls: list = []
    real = _tls_io.copy_runs
    monkeypatch.setattr(_tls_io, "copy_runs", lambda d, s_, n: (calls.append(len(n)), real(d, s_, n)))
    with _linked(_opts(certs), _opts(certs)) as (a, b, ch, src, dst, _):
        rng = np.random.default_rng(9090)
        blk, nb = 2048, SIZE // 2048
        lb, rb = rng.permutation(nb // 2)[:200] * 2, rng.permutation(nb)[:200]   # even local blocks: none coalesce
        ops = make_ops(1, lb.astype(np.uint64) * blk, 10, rb.astype(np.uint64) * blk, blk)
        dst[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)
        before = dst.copy()
        c = ch.read(ops, deadline=time.monotonic() + 20)
        assert c.wait(30) and c.error is None, c.error
        for l_, r_ in zip(lb.tolist(), rb.tolist()):
            np.testing.assert_array_equal(dst[l_ * blk:(l_ + 1) * blk], src[r_ * blk:(r_ + 1) * blk])
        untouched = np.ones(nb, bool)
        untouched[lb] = False
        np.testing.assert_array_equal(dst.reshape(nb, blk)[untouched], before.reshape(nb, blk)[untouched])
        # this side scattered 200 blocks, 128 (256 KiB) at most per call; the owner gathered 199: the
        # last block (2 KiB, within llmdd_tcp._io.TAIL) left from the copy it sends after the release
        assert sorted(calls) == [71, 72, 128, 128], calls


def test_plaintext_client_on_a_tls_data_port_gets_no_byte_of_the_protocol(certs):
    t = TcpTransport(_opts(certs))
    b = t.open_endpoint()
    try:
        b.serve_links_only()
        cap = secrets.token_bytes(32)
        b.grant(1, cap, None)
        port = endpoint_fields(b.describe()).port
        rng = np.random.default_rng(9)
        # what a plain llmdd-tcp client would send first, and random bytes: the TLS handshake fails
        for payload in (bytes(64), rng.integers(0, 256, 300, dtype=np.uint8).tobytes()):
            got = b""
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(payload)
                s.settimeout(5)
                with contextlib.suppress(ConnectionResetError):
                    while chunk := s.recv(4096):
                        got += chunk
            # closed (within the timeout, else recv raised): at most a TLS alert, never the llmdd HELLO
            assert b"LDTH" not in got and (got == b"" or got[:1] == b"\x15"), got[:16]
        assert _wait(lambda: b.statistics()["tls_failures"] >= 2)
        assert _wait(lambda: b.statistics()["open_connections"] == 0)
        st = b.statistics()
        assert st["requests"] == 0 and st["bytes_served"] == 0
        # a plain llmdd-tcp endpoint refuses the TLS description at once, typed
        plain = TcpTransport({}).open_endpoint()
        try:
            with pytest.raises(Refused) as info:
                plain.connect(attrs.evolve(b.describe(), capability=cap), timeout=5)
            assert info.value.status_code is LLMStatusCode.LLM_LINK_FAILED and "requires TLS" in str(info.value)
        finally:
            plain.close()
    finally:
        b.close()


def test_tls_side_refuses_a_plaintext_data_port(certs):
    tls_ep = TcpTransport(_opts(certs)).open_endpoint()
    plain = TcpTransport({}).open_endpoint()
    try:
        with pytest.raises(Refused) as info:
            tls_ep.connect(plain.describe(), timeout=5)
        assert info.value.status_code is LLMStatusCode.LLM_LINK_FAILED and "plaintext" in str(info.value)
        assert plain.statistics()["connections"] == 0     # refused before connecting
    finally:
        tls_ep.close()
        plain.close()


@pytest.mark.parametrize("who", ["other_ca", "no_certificate", "wrong_name"])
def test_peer_the_data_port_does_not_trust_fails_typed(certs, who):
    server = TcpTransport(_opts(certs)).open_endpoint()
    if who == "other_ca":        # a certificate from another CA, which trusts only itself
        client_opts = _opts(certs, "rogue_")
    elif who == "no_certificate":  # trusts our CA but has no certificate to show (mutual TLS)
        client_opts = _opts(certs, cert=False)
    else:                         # the right CA and certificate, but it expects another server name
        client_opts = _opts(certs, **{"llmdd.tls_server_name": "other.test"})
    client = TcpTransport(client_opts).open_endpoint()
    try:
        server.serve_links_only()
        cap = secrets.token_bytes(32)
        server.grant(1, cap, None)
        started = time.monotonic()
        with pytest.raises(Refused) as info:
            client.connect(attrs.evolve(server.describe(), capability=cap), timeout=5)
        assert time.monotonic() - started < 4.0
        assert info.value.status_code is LLMStatusCode.LLM_LINK_FAILED, info.value
        assert "TLS" in str(info.value), info.value
        if who != "wrong_name":   # the client gave up on the server's name: the server saw a dropped handshake
            assert _wait(lambda: server.statistics()["tls_failures"] >= 1)
        assert server.statistics()["requests"] == 0
        assert _wait(lambda: server.statistics()["open_connections"] == 0)
    finally:
        client.close()
        server.close()


def test_server_name_is_checked_on_data_connections(certs):
    opts = _opts(certs, **{"llmdd.tls_server_name": NAME})
    with _linked(opts, _opts(certs)) as (a, b, ch, src, dst, _):
        c = ch.read(make_ops(1, 0, 10, 0, 4096), deadline=time.monotonic() + 5)
        assert c.wait(10) and c.error is None
        np.testing.assert_array_equal(dst[:4096], src[:4096])


def test_tls_without_a_ca_is_refused_unless_insecure(certs):
    cert_only = {"llmdd.tls_cert": certs["node.pem"], "llmdd.tls_key": certs["node.key"]}
    with pytest.raises(LLMException) as info:
        TcpTransport(cert_only)
    assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID and "llmdd.tls_insecure" in str(info.value)
    insecure = dict(cert_only, **{"llmdd.tls_insecure": "1"})
    with _linked(insecure, insecure) as (a, b, ch, src, dst, _):
        assert endpoint_fields(b.describe()).tls is True
        c = ch.read(make_ops(1, 0, 10, 0, 4096), deadline=time.monotonic() + 5)
        assert c.wait(10) and c.error is None
        np.testing.assert_array_equal(dst[:4096], src[:4096])


# --------------------------------------------------------------------------- the conformance suite over TLS

_CERTS: dict = {}


def _make_tls_pair():
    t = TcpTransport(_opts(_CERTS))
    return t.open_endpoint(), t.open_endpoint()


@contextlib.contextmanager
def _stall(endpoint):
    release = threading.Event()
    original = endpoint._serve_request

    def stalled(*args):
        release.wait()
        return original(*args)

    endpoint._serve_request = stalled
    try:
        yield
    finally:
        endpoint._serve_request = original
        release.set()


@pytest.mark.parametrize("check", CONFORMANCE_CHECKS, ids=lambda c: c.__name__)
def test_conformance_over_tls(certs, check):
    _CERTS.update(certs)
    run_check(check, _make_tls_pair, stall=_stall, transport=functools.partial(TcpTransport, _opts(certs)))
