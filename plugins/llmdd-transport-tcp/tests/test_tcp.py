"""tcp transport: real two-process transfers, a peer killed mid-transfer, auth, plugin hook."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time

import attrs
import msgspec
import numpy as np
import pytest

from llmdd._base.status import LLMStatusCode
from llmdd.lowlevel import MemRegion, PeerGone, Refused, encode_payload, make_ops
from llmdd_tcp import TcpTransport, endpoint_fields, region_fields, hookimpl, llmdd_register_transports

MiB = 1 << 20


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _llmdd_tcp_peer import _fill, _peer_main  # noqa: E402  (spawned children import it by name)


def _start_peer(size: int, seed: int):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_peer_main, args=(child, size, seed), daemon=True)
    p.start()
    assert parent.poll(30), "peer did not start"
    return p, parent, parent.recv()


def _local(ep, rid: int, buf: np.ndarray) -> None:
    ep.register(MemRegion(region_id=rid, addr=buf.ctypes.data, size=buf.size, remote_accessible=False, placement=0))


def test_two_processes_read_and_write():
    size = 8 * MiB
    p, conn, (desc, d_src, d_sink) = _start_peer(size, seed=3)
    ep = TcpTransport({}).open_endpoint()
    try:
        dst = np.zeros(size, dtype=np.uint8)
        _local(ep, 1, dst)
        ch = ep.connect(desc, timeout=10)
        ch.add_remote_region(5, size, d_src)
        ch.add_remote_region(6, size, d_sink)
        rng = np.random.default_rng(0)
        block = 64 * 1024
        n = size // block
        perm = rng.permutation(n)
        c = ch.read(make_ops(1, np.arange(n) * block, 5, perm * block, block), deadline=time.monotonic() + 20)
        assert c.wait(30) and c.error is None, c.error
        expect = _fill(size, 3).reshape(n, block)[perm]
        assert np.array_equal(dst.reshape(n, block), expect)
        # small inline read and a write with random contents checked on the other side
        c = ch.read(make_ops(1, 0, 5, 12345, 4000), deadline=time.monotonic() + 5)
        assert c.wait(10) and c.error is None
        assert np.array_equal(dst[:4000], _fill(size, 3)[12345:12345 + 4000])
        dst[:] = rng.integers(0, 256, size, dtype=np.uint8)
        c = ch.write(make_ops(1, np.arange(n) * block, 6, perm * block, block), deadline=time.monotonic() + 20)
        assert c.wait(30) and c.error is None, c.error
        expect_sink = np.empty(size, dtype=np.uint8)
        expect_sink.reshape(n, block)[perm] = dst.reshape(n, block)
        conn.send("digest")
        assert conn.recv() == hashlib.sha256(expect_sink).hexdigest()
        conn.send("stats")
        stats = conn.recv()
        assert stats["bytes_served"] >= 2 * size and stats["refused"] == 0
        ch.close()
    finally:
        ep.close()
        conn.send("stop")
        p.join(10)
        if p.is_alive():
            p.kill()


def test_peer_killed_mid_transfer_fails_within_deadline_and_writes_nothing_after():
    size = 512 * MiB
    p, conn, (desc, d_src, _) = _start_peer(size, seed=5)
    ep = TcpTransport({}).open_endpoint()
    try:
        dst = np.zeros(size, dtype=np.uint8)
        dst[:] = 0  # pre-fault
        _local(ep, 1, dst)
        ch = ep.connect(desc, timeout=10)
        ch.add_remote_region(5, size, d_src)
        block = 64 * 1024
        n = size // block
        offs = np.arange(n) * block
        t0 = time.monotonic()
        deadline = t0 + 10.0
        c = ch.read(make_ops(1, offs, 5, offs, block), deadline=deadline)
        words = dst.view(np.uint64)
        while not words[1:block // 8].any():  # wait for the first bytes to land
            assert time.monotonic() - t0 < 10, "no byte arrived"
            time.sleep(0.0005)
        os.kill(p.pid, signal.SIGSTOP)
        assert not c.done(), "transfer finished before the peer was stopped"
        os.kill(p.pid, signal.SIGKILL)
        assert c.wait(15)
        took = time.monotonic() - t0
        assert isinstance(c.error, PeerGone), repr(c.error)
        assert took < 10.0, f"failed after {took:.2f}s, deadline was 10s"
        dst[:] = 0x5A
        time.sleep(0.2)
        assert (dst == 0x5A).all(), "bytes landed after the failed read returned"
        stats = ch.statistics()
        assert stats["failed"] == 1 and stats["last_error"]
        ch.close()
    finally:
        ep.close()
        p.kill()
        p.join(10)


def test_authentication():
    t = TcpTransport({})
    server = t.open_endpoint(secret=b"right")
    try:
        for secret, code in ((None, LLMStatusCode.LLM_LINK_FAILED), (b"wrong", LLMStatusCode.LLM_LINK_FAILED)):
            client = t.open_endpoint(secret=secret)
            with pytest.raises(Refused) as info:
                client.connect(server.describe(), timeout=5)
            assert info.value.status_code is code
            client.close()
        assert server.statistics()["auth_failures"] == 1
        # a client with a secret refuses a server that does not authenticate
        open_server = t.open_endpoint()
        client = t.open_endpoint(secret=b"right")
        with pytest.raises(Refused):
            client.connect(open_server.describe(), timeout=5)
        ok = t.open_endpoint(secret=b"right")
        ok.connect(server.describe(), timeout=5).close()
        for e in (open_server, client, ok):
            e.close()
    finally:
        server.close()


def test_owner_refuses_and_counts_and_binds_to_host_only():
    t = TcpTransport({})
    a, b = t.open_endpoint(host="127.0.0.1"), t.open_endpoint(host="127.0.0.1")
    try:
        assert endpoint_fields(b.describe()).host == "127.0.0.1"
        assert b._lsock.getsockname()[0] == "127.0.0.1"
        src = np.ones(4096, dtype=np.uint8)
        dst = np.zeros(4096, dtype=np.uint8)
        d = b.register(MemRegion(region_id=3, addr=src.ctypes.data, size=4096, remote_accessible=True, placement=0))
        _local(a, 1, dst)
        ch = a.connect(b.describe(), timeout=5)
        ch.add_remote_region(3, 1 << 30, d)  # lie about the size: only the owner can catch it
        c = ch.read(make_ops(1, 0, 3, 4000, 200), deadline=time.monotonic() + 5)
        assert c.wait(5) and isinstance(c.error, Refused)
        assert c.error.status_code is LLMStatusCode.LLM_PARAM_INVALID
        assert not dst.any()
        assert b.statistics()["refused"] == 1 and "out of bounds" in b.statistics()["last_error"]
        # the ops path asks for padded READ answers (F_PAD): a reason arrives whole, without the NULs that
        # pad header and reason to a multiple of 16 (these two reasons need 13 and 12 of them)
        c = ch.read(make_ops(1, 0, 3, 4001, 99), deadline=time.monotonic() + 5)   # one op: the few-ops path
        assert c.wait(5) and isinstance(c.error, Refused)
        reason = b.statistics()["last_error"]
        assert (12 + len(reason)) % 16 and str(c.error).endswith(reason), (reason, str(c.error))
        many = make_ops(1, np.arange(0, 4096, 256), 3, np.arange(0, 8192, 512) % 4096, 200)   # 16 ops: numpy's
        many["remote_offset"][-1] = 4000
        c = ch.read(many, deadline=time.monotonic() + 5)
        assert c.wait(5) and isinstance(c.error, Refused)
        reason = b.statistics()["last_error"]
        assert (12 + len(reason)) % 16 and str(c.error).endswith(reason), (reason, str(c.error))
        assert not dst.any()
        with pytest.raises(Refused):
            ch.add_remote_region(3, 4096, attrs.evolve(d, payload=encode_payload(
                    msgspec.structs.replace(region_fields(d), endpoint_id=b"x" * 16))))
        c = ch.read(np.zeros(3, dtype=np.uint64), deadline=time.monotonic() + 5)   # not OP_DTYPE: refused
        assert c.wait(5) and isinstance(c.error, Refused), c.error
        with pytest.raises(Refused):
            b.register(MemRegion(region_id=3, addr=src.ctypes.data, size=1, remote_accessible=True, placement=0))
        threads = [th for th in threading.enumerate() if th.name.startswith("llmdd-tcp")]
        assert threads and all(th.daemon for th in threads)
    finally:
        a.close()
        b.close()


def test_plugin_registration_and_probe():
    got = []
    llmdd_register_transports(got.append)
    assert got == [TcpTransport]
    assert getattr(llmdd_register_transports, "llmdd_impl", None) is not None
    assert hookimpl.project_name == "llmdd"
    info = TcpTransport.probe()
    assert info.available and info.name == "tcp"
    assert TcpTransport.priority > 0 and TcpTransport.same_host_only is False
    from importlib.metadata import entry_points

    assert any(ep.value == "llmdd_tcp" for ep in entry_points(group="llmdd"))


def test_interpreter_exits_promptly_with_transfer_in_flight():
    code = (
        "import time, numpy as np, threading\n"
        "from llmdd_tcp import TcpTransport\n"
        "from llmdd.lowlevel import MemRegion, make_ops\n"
        "t = TcpTransport({}); a = t.open_endpoint(); b = t.open_endpoint()\n"
        "buf = np.zeros(8 << 20, dtype=np.uint8)\n"
        "for e, r in ((a, 1), (b, 2)):\n"
        "    d = e.register(MemRegion(region_id=r, addr=buf.ctypes.data, size=buf.size, remote_accessible=True,"
        " placement=0))\n"
        "ch = a.connect(b.describe(), timeout=5); ch.add_remote_region(2, buf.size, d)\n"
        "ev = threading.Event(); b._serve_request = b._serve_native = lambda *a: ev.wait()\n"
        "c = ch.read(make_ops(1, 0, 2, 0, buf.size), deadline=time.monotonic() + 600)\n"
        "print('leaving', flush=True)\n"
    )
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "leaving" in out.stdout
    assert time.monotonic() - t0 < 15
