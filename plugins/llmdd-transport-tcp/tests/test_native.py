"""The tcp transport's C hot path (``llmdd_tcp._tcpfast``): built and active where it is expected (a silent
fall back to the pure-Python path fails CI), its wire constants the Python side's, the switches
(``LLMDD_TCP_NATIVE=0``, ``llmdd.tcp.native``), what ``llmdd info`` says, and the owner's C path under
revocation and deregistration while it holds a stream.  The transfers themselves, each side on either
path, are in test_quick.py (``mode``); the hostile and conformance tests run on the default path."""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import sysconfig
import threading
import time

import attrs
import numpy as np
import pytest

import llmdd_tcp
import llmdd_tcp._quick
from llmdd.lowlevel import MemRegion, PeerGone, Refused, TransportError, make_ops
from llmdd_tcp import OPT_NATIVE, TcpTransport, _few, _native, _wire, data_path

pytestmark = pytest.mark.timeout(120)

needs_native = pytest.mark.skipif(_native.native is None, reason=f"C path not active: {llmdd_tcp.NATIVE_REASON}")


def _toolchain() -> bool:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    inc = sysconfig.get_paths().get("include") or ""
    return shutil.which(cc) is not None and os.path.exists(os.path.join(inc, "Python.h"))


def test_native_extension_is_built_when_expected():
    """scripts/test.sh sets LLMDD_REQUIRE_NATIVE=1 (it installs gcc and Python.h where missing); elsewhere a
    compiler and the headers being present mean the build was expected too, unless switched off."""
    required = os.environ.get("LLMDD_REQUIRE_NATIVE") == "1"
    switched_off = (os.environ.get("LLMDD_TCP_NATIVE", "").lower() in ("0", "off", "no", "false")
                    or os.environ.get("LLMDD_TCP_BUILD_NATIVE") == "0")
    if switched_off or (not required and not _toolchain()):
        pytest.skip("the tcp C path is not expected here (switched off, or no toolchain)")
    assert _native.native is not None, f"the tcp C path is not active: {llmdd_tcp.NATIVE_REASON}"
    assert data_path()["native"] is True
    ep = TcpTransport({}).open_endpoint()
    try:
        assert ep._fast is not None and ep.statistics()["native"] is True   # "auto" takes it
    finally:
        ep.close()


@needs_native
def test_native_wire_constants_match_the_python_side():
    nat = _native.native
    assert nat.REQ_SIZE == _wire.REQ.size == 20
    assert nat.RSP_SIZE == _wire.RSP.size == 12
    assert nat.OP_SIZE == 20   # (region u4, offset u8, length u8), packed
    assert nat.FEW == _few.FEW_OPS
    # a quick call's rows: runs of at most QUICK_MAX_BLOCKS blocks per pair, merged when they continue each
    # other: more than QUICK_ROWS of them make the C call refuse (ValueError), never truncate
    assert nat.QUICK_ROWS == llmdd_tcp._quick.QUICK_MAX_PAIRS * llmdd_tcp._quick.QUICK_MAX_BLOCKS
    with pytest.raises(ValueError):
        nat.quick(0, 1, 1, 0, [1, 0, 0, 1] * (nat.QUICK_ROWS + 1), nat.QUICK_ROWS + 1, 16, 10**9, 0)
    with pytest.raises(ValueError):   # a total that is not the rows' sum
        nat.quick(0, 1, 1, 0, [1, 0, 0, 1], 2, 16, 10**9, 0)


def test_env_switch_forces_the_python_path():
    code = "import llmdd_tcp, json; print(json.dumps(llmdd_tcp.data_path()))"
    env = dict(os.environ, LLMDD_TCP_NATIVE="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    dp = json.loads(out.stdout)
    assert dp == {"native": False, "path": "pure Python", "reason": "disabled by LLMDD_TCP_NATIVE=0"}


def test_option_chooses_the_path_and_refuses_nonsense():
    with pytest.raises(Refused, match="auto, on or off"):
        TcpTransport({OPT_NATIVE: "maybe"})
    off = TcpTransport({OPT_NATIVE: "off"}).open_endpoint()
    try:
        assert off._fast is None and off.statistics()["native"] is False
    finally:
        off.close()
    if _native.native is None:
        with pytest.raises(Refused, match="unavailable"):
            TcpTransport({OPT_NATIVE: "on"})
    else:
        on = TcpTransport({OPT_NATIVE: "on"}).open_endpoint()
        on.close()


def test_llmdd_info_names_the_active_path():
    out = subprocess.run([sys.executable, "-m", "llmdd", "info", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    tcp = [t for t in info["transports"] if t["name"] == "tcp"]
    assert tcp and tcp[0]["data_path"], info["transports"]
    want = "C extension (llmdd_tcp._tcpfast" if _native.native is not None else "pure Python"
    assert tcp[0]["data_path"].startswith(want), tcp[0]["data_path"]


# ---------------------------------------------------------------------------- the owner's C path holding a stream

SIZE = 32 << 20   # more than loopback's socket buffers hold: a send of a whole region blocks


@pytest.fixture
def held():
    """An owner whose workers keep a stream for 30 s between requests (so the C path holds it), a client
    channel under a grant, and seeded random regions."""
    if _native.native is None:
        pytest.skip(f"C path not active: {llmdd_tcp.NATIVE_REASON}")
    owner = TcpTransport({"llmdd.tcp.linger_ms": "30000"}).open_endpoint()
    client = TcpTransport({OPT_NATIVE: "off"}).open_endpoint()
    rng = np.random.default_rng(424242)
    src = {rid: rng.integers(0, 256, SIZE, dtype=np.uint8) for rid in (10, 11)}
    dst = np.zeros(SIZE, np.uint8)
    owner.serve_links_only()
    descs = {rid: owner.register(MemRegion(region_id=rid, addr=buf.ctypes.data, size=SIZE, remote_accessible=True,
                                           placement=0)) for rid, buf in src.items()}
    client.register(MemRegion(region_id=1, addr=dst.ctypes.data, size=SIZE, remote_accessible=False, placement=0))
    cap = secrets.token_bytes(32)
    owner.grant(3, cap, [10, 11])
    ch = client.connect(attrs.evolve(owner.describe(), capability=cap), timeout=5)
    for rid, d in descs.items():
        ch.add_remote_region(rid, SIZE, d)
    yield owner, client, ch, src, dst, cap
    ch.close()
    client.close()
    owner.close()


def _read(ch, rid: int, n: int = 4096):
    c = ch.read(make_ops(1, 0, rid, 0, n), deadline=time.monotonic() + 10)
    assert c.wait(15)
    return c.error


def _in_c(owner) -> None:
    """Wait until a worker serves a stream in C (it lingers there between requests)."""
    deadline = time.monotonic() + 10
    while not any(getattr(f, "f_code", None) and f.f_code.co_name == "_serve_native"
                  for f in sys._current_frames().values()):
        assert time.monotonic() < deadline, "no stream is served in C"
        time.sleep(0.001)


def test_revoke_ends_a_stream_the_c_path_holds(held):
    owner, client, ch, src, dst, _ = held
    assert _read(ch, 10) is None and np.array_equal(dst[:4096], src[10][:4096])
    base = owner.statistics()["requests_native"]
    assert base >= 1
    _in_c(owner)
    done = threading.Event()
    t = threading.Thread(target=lambda: (owner.revoke(3), done.set()), daemon=True)
    t.start()
    assert done.wait(10), "revoke did not return while the C path held a stream of the grant"
    dst[:] = 0
    err = _read(ch, 10)
    assert isinstance(err, TransportError), err
    assert not dst.any()
    assert owner.statistics()["requests_native"] == base


def test_regrant_hands_the_next_request_back_and_it_is_refused(held):
    """A grant's regions shrink (the same capability granted again) while the C path holds its stream:
    the next request for the region taken away is refused, with the Python path's message, and the
    other region is still served."""
    owner, client, ch, src, dst, cap = held
    assert _read(ch, 11) is None
    _in_c(owner)
    owner.grant(3, cap, [10])
    dst[:] = 0
    err = _read(ch, 11)
    assert isinstance(err, Refused) and "not granted to this link" in str(err), err
    assert not dst.any()
    assert _read(ch, 10) is None and np.array_equal(dst[:4096], src[10][:4096])


def test_deregister_while_the_c_path_sends_the_region_returns_and_stops_it(held):
    """A client asks for a whole region and stops reading after a part: the C path blocks in its send with
    the region pinned; deregistration shuts that stream down, waits for the pin and returns; the stream
    ends short of the request, and the request is not counted."""
    owner, client, ch, src, dst, _ = held
    base = owner.statistics()["requests_native"]
    s = ch.open_stream(time.monotonic() + 5)
    try:
        s.settimeout(10)
        s.sendall(_wire.REQ.pack(b"LDRQ", 1, 1, 0, 1, SIZE) + np.array(
            [(10, 0, SIZE)], dtype=[("r", "<u4"), ("o", "<u8"), ("n", "<u8")]).tobytes())
        got = b""
        while len(got) < 16 + 4096:
            got += s.recv(16 + 4096 - len(got))
        assert got[:16] == _wire.OK_PADDED and got[16:] == src[10][:4096].tobytes()
        _in_c(owner)
        done = threading.Event()
        t = threading.Thread(target=lambda: (owner.deregister(10), done.set()), daemon=True)
        t.start()
        assert done.wait(10), "deregister did not return while the C path was sending the region"
        rest = 0
        while True:
            try:
                chunk = s.recv(1 << 16)
            except OSError:
                break
            if not chunk:
                break
            rest += len(chunk)
        assert 16 + 4096 + rest < 16 + SIZE, "the whole region was sent although it was deregistered"
    finally:
        s.close()
    assert owner.statistics()["requests_native"] == base
    err = _read(ch, 10)
    assert isinstance(err, Refused) and "not registered" in str(err), err


def _drain(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            chunk = s.recv(1 << 16)
        except OSError:
            return out
        if not chunk:
            return out
        out += chunk


@pytest.mark.parametrize("count,flags", [(0x80000000, 1), (0xFFFFFFFF, 1), (2**31 - 1, 0), (1 << 18 | 1, 1),
                                         (9, 1), (1, 0x80), (0, 1)])
def test_hostile_headers_to_the_c_path_end_or_refuse_their_request_only(held, count, flags):
    """Op counts the C path must not size anything by (past 2**31 they are negative as an int: a stack
    overflow once), more ops than it serves, flags it does not know, no ops: it hands the header to
    Python, which ends the stream (a count past the cap: Corrupt) or refuses the request (regions
    0x41414141 are not registered) as it always did; the owner goes on serving."""
    owner, client, ch, src, dst, _ = held
    assert _read(ch, 10) is None   # a stream the C path serves
    _in_c(owner)
    s = ch.open_stream(time.monotonic() + 5)
    try:
        s.settimeout(10)
        s.sendall(_wire.REQ.pack(b"LDRQ", 1, flags, 0, count, 4096) + b"A" * 8192)
        if count > _wire.MAX_OPS_PER_REQUEST or count == 0:   # (no ops for 4096 bytes: Corrupt)
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError as exc:   # the owner ended the stream first (the outcome checked here):
                assert exc.errno in (errno.ENOTCONN, errno.ECONNRESET, errno.EPIPE), exc
            assert _drain(s) == b"", "the owner answered a request it cannot check"
        else:
            head = s.recv(_wire.RSP.size)
            magic, status, _, _, n = _wire.RSP.unpack(head)
            reason = s.recv(n).rstrip(b"\0").decode()
            assert (magic, status) == (b"LDRS", _wire.ST_REFUSED), (head, reason)
            assert "not registered" in reason or "not granted" in reason, reason
    finally:
        s.close()
    dst[:] = 0
    assert _read(ch, 11) is None and np.array_equal(dst[:4096], src[11][:4096])


def test_close_while_the_c_path_sends_returns(held):
    """The owner closes while the C path is blocked sending a whole region to a client that stopped
    reading: close shuts the stream down, waits for the pin and returns."""
    owner, client, ch, src, dst, _ = held
    s = ch.open_stream(time.monotonic() + 5)
    try:
        s.settimeout(10)
        s.sendall(_wire.REQ.pack(b"LDRQ", 1, 1, 0, 1, SIZE) + np.array(
            [(11, 0, SIZE)], dtype=[("r", "<u4"), ("o", "<u8"), ("n", "<u8")]).tobytes())
        assert len(s.recv(16)) > 0   # the answer started: the region is pinned while the send blocks
        _in_c(owner)
        done = threading.Event()
        t = threading.Thread(target=lambda: (owner.close(), done.set()), daemon=True)
        t.start()
        assert done.wait(15), "close did not return while the C path was sending"
        assert len(_drain(s)) < SIZE
    finally:
        s.close()
    assert owner.statistics()["requests_native"] == 0
