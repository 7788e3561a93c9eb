"""shm transport with real processes: pool and user regions, segment hygiene, a killed owner,
the CMA probe, IOV_MAX-sized batches, and the partial-transfer resume logic."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time

import attrs
import msgspec
import numpy as np
import pytest

from llmdd._base.status import LLMStatusCode
from llmdd.lowlevel import MemRegion, PeerGone, Refused, encode_payload, make_ops
from llmdd_shm import ShmChannel, ShmTransport, _cma, endpoint_fields, hookimpl, llmdd_register_transports
from llmdd_shm._cma import Cma, CmaError, iovecs, probe_cma

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _llmdd_shm_owner import POOL_RID, POOL_SINK, SIZE, USER_RID, USER_SINK, _content, _owner_main  # noqa: E402


@pytest.fixture
def owner():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_owner_main, args=(child,), daemon=True)
    p.start()
    assert parent.poll(60), "owner did not start"
    desc, descs, seg_name = parent.recv()
    yield p, parent, desc, descs, seg_name
    if p.is_alive():
        try:
            parent.send(("quit",))
            parent.poll(10)
        except (OSError, EOFError):
            pass
        p.join(10)
    if p.is_alive():
        p.kill()
        p.join(5)
    # an owner killed by a test leaves its names behind; the test process cleans up for it
    from llmdd_shm import _seg

    for name in (seg_name, endpoint_fields(desc).ctl):
        if p.exitcode not in (0, None):
            _seg.unlink(name)


def _connect(desc, descs):
    ep = ShmTransport({}).open_endpoint()
    ch = ep.connect(desc, timeout=10)
    for rid, d in descs.items():
        ch.add_remote_region(rid, SIZE, d)
    return ep, ch


def _ok(c, timeout=30.0):
    assert c.wait(timeout), "batch did not finish"
    assert c.error is None, repr(c.error)


def test_two_processes_read_and_write_pool_and_user(owner):
    p, conn, desc, descs, seg_name = owner
    ep, ch = _connect(desc, descs)
    try:
        dst = np.zeros(SIZE, dtype=np.uint8)
        src = _content(99)
        ep.register(MemRegion(region_id=1, addr=dst.ctypes.data, size=SIZE, remote_accessible=False, placement=0))
        ep.register(MemRegion(region_id=2, addr=src.ctypes.data, size=SIZE, remote_accessible=False, placement=0))
        rng = np.random.default_rng(0)
        for rid, seed in ((POOL_RID, 1), (USER_RID, 2)):
            for block in (65536, 4096, 1000):
                n = SIZE // block
                perm_l, perm_r = rng.permutation(n), rng.permutation(n)
                dst[:] = 0
                ops = make_ops(1, perm_l * block, rid, perm_r * block, block)
                _ok(ch.read(ops, deadline=time.monotonic() + 30))
                expect = _content(seed)
                got = dst[: n * block].reshape(n, block)[perm_l]
                assert np.array_equal(got, expect[: n * block].reshape(n, block)[perm_r]), (rid, block)
            # the whole region in one op, both kinds, and a write with random contents
            dst[:] = 0
            _ok(ch.read(make_ops(1, 0, rid, 0, SIZE), deadline=time.monotonic() + 30))
            assert np.array_equal(dst, _content(seed))
        for rid in (POOL_SINK, USER_SINK):
            n = SIZE // 16384
            perm = rng.permutation(n)
            ops = make_ops(2, np.arange(n) * 16384, rid, perm * 16384, 16384)
            _ok(ch.write(ops, deadline=time.monotonic() + 30))
            expect = np.empty(SIZE, dtype=np.uint8)
            expect.reshape(n, 16384)[perm] = src.reshape(n, 16384)
            conn.send(("digest", rid))
            assert conn.recv() == hashlib.sha256(expect).hexdigest(), rid
        st = ch.statistics()
        assert st["mapped_segments"] == 1 and st["cma"] and st["failed"] == 0
    finally:
        ch.close()
        ep.close()
    assert os.path.exists(f"/dev/shm/{seg_name}"), "a reader's close unlinked the owner's segment"


def test_python_path_copies_short_pool_runs_in_gathers_and_long_ones_in_place(owner, monkeypatch):
    """The pure-Python path (llmdd.shm.native=off) reading another process's pool region: 512 blocks of
    1 KiB go in numpy gathers (llmdd.lowlevel.copy_runs, no memmove per op), 16 blocks of 64 KiB in one
    memmove each; every block lands, the blocks not asked for stay zero."""
    import ctypes

    from llmdd._base import runs

    p, conn, desc, descs, seg_name = owner
    ep = ShmTransport({"llmdd.shm.native": "off"}).open_endpoint()
    ch = ep.connect(desc, timeout=10)
    gathers: list = []
    moves: list = []
    real_gather, real_mm = runs._gather, ctypes.memmove
    monkeypatch.setattr(runs, "_gather", lambda d, s, n: (gathers.append((len(d), n)), real_gather(d, s, n)))
    monkeypatch.setattr(ctypes, "memmove", lambda d, s, n: (moves.append(n), real_mm(d, s, n)))
    try:
        assert ep.native is None and ch.native is None
        ch.add_remote_region(POOL_RID, SIZE, descs[POOL_RID])
        dst = np.zeros(SIZE, dtype=np.uint8)
        ep.register(MemRegion(region_id=1, addr=dst.ctypes.data, size=SIZE, remote_accessible=False, placement=0))
        expect = _content(1)
        rng = np.random.default_rng(1701)
        for block, n in ((1024, 512), (65536, 16)):
            nb = SIZE // block
            lb = rng.permutation(nb // 2)[:n] * 2   # even local blocks: no two ops continue each other
            rb = rng.permutation(nb)[:n]
            dst[:] = 0
            gathers.clear()
            moves.clear()
            _ok(ch.read(make_ops(1, lb * block, POOL_RID, rb * block, block), deadline=time.monotonic() + 30))
            got = dst.reshape(nb, block)
            assert np.array_equal(got[lb], expect.reshape(nb, block)[rb]), block
            rest = np.ones(nb, bool)
            rest[lb] = False
            assert not got[rest].any(), block
            if block == 1024:
                assert gathers == [(512, 1024)] and moves == [], (gathers, moves)
            else:
                assert gathers == [] and moves == [65536] * 16, (gathers, moves)
        assert ch.statistics()["cma_calls"] <= 1   # the connect-time probe: pool memory never takes CMA
    finally:
        ch.close()
        ep.close()


_READER = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from llmdd.lowlevel import MemRegion, make_ops
    from llmdd.abc import EndpointDescriptor, RegionDescriptor
    from llmdd_shm import ShmTransport, region_fields
    info = json.loads(sys.stdin.read())
    desc = EndpointDescriptor(transport="shm", version=info["desc"]["version"],
                              payload=bytes.fromhex(info["desc"]["payload"]))
    d = RegionDescriptor(transport="shm", version=info["region"]["version"],
                         payload=bytes.fromhex(info["region"]["payload"]))
    rf = region_fields(d)
    ep = ShmTransport({}).open_endpoint()
    ch = ep.connect(desc, timeout=10)
    ch.add_remote_region(rf.region_id, rf.size, d)
    dst = np.zeros(rf.size, dtype=np.uint8)
    ep.register(MemRegion(region_id=1, addr=dst.ctypes.data, size=dst.size, remote_accessible=False, placement=0))
    c = ch.read(make_ops(1, 0, rf.region_id, 0, rf.size), deadline=time.monotonic() + 20)
    assert c.wait(30) and c.error is None, c.error
    import os
    print(os.getpid(), int(dst.astype(np.uint64).sum()))
    # exit without closing anything: the interpreter (and its resource tracker) goes away
""")


def _jsonable(d):
    return {"version": d.version, "payload": d.payload.hex()}


def test_segment_survives_reader_exit_and_is_never_unlinked_by_it(owner):
    p, conn, desc, descs, seg_name = owner
    info = json.dumps({"desc": _jsonable(desc), "region": _jsonable(descs[POOL_RID])})
    # an independent interpreter: its own resource tracker would unlink a tracked segment at exit
    r = subprocess.run([sys.executable, "-c", _READER], input=info, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[1]) == int(_content(1).astype(np.uint64).sum())
    time.sleep(0.2)  # let a (wrongly) tracking resource tracker finish its cleanup
    assert os.path.exists(f"/dev/shm/{seg_name}"), "the reader's exit removed the owner's segment"
    assert os.path.exists(f"/dev/shm/{endpoint_fields(desc).ctl}"), "the reader's exit removed the owner's control segment"
    reader_pid, total = (int(x) for x in r.stdout.split())
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(f"llmdd_{reader_pid}_")]
    assert not leftovers, f"the reader left its own control segment behind: {leftovers}"
    conn.send(("digest", POOL_RID))
    assert conn.recv() == hashlib.sha256(_content(1)).hexdigest()
    # and the segment is still readable by a new channel from this process
    ep, ch = _connect(desc, {POOL_RID: descs[POOL_RID]})
    try:
        dst = np.zeros(SIZE, dtype=np.uint8)
        ep.register(MemRegion(region_id=1, addr=dst.ctypes.data, size=SIZE, remote_accessible=False, placement=0))
        _ok(ch.read(make_ops(1, 0, POOL_RID, 0, SIZE), deadline=time.monotonic() + 10))
        assert np.array_equal(dst, _content(1))
    finally:
        ch.close()
        ep.close()
    assert os.path.exists(f"/dev/shm/{seg_name}")
    # the owner's orderly exit removes its names (only the owner unlinks)
    conn.send(("quit",))
    assert conn.poll(20) and conn.recv() == "bye"
    p.join(20)
    assert not os.path.exists(f"/dev/shm/{seg_name}")
    assert not os.path.exists(f"/dev/shm/{endpoint_fields(desc).ctl}")


def test_killed_owner_is_peer_gone_within_deadline(owner):
    p, conn, desc, descs, seg_name = owner
    ep, ch = _connect(desc, descs)
    try:
        dst = np.zeros(SIZE, dtype=np.uint8)
        ep.register(MemRegion(region_id=1, addr=dst.ctypes.data, size=SIZE, remote_accessible=False, placement=0))
        _ok(ch.read(make_ops(1, 0, POOL_RID, 0, 4096), deadline=time.monotonic() + 10))
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        for rid in (POOL_RID, USER_RID):
            for n in (4096, SIZE):
                dst[:] = 0xA5
                t0 = time.monotonic()
                try:
                    c = ch.read(make_ops(1, 0, rid, 0, n), deadline=t0 + 2.0)
                    assert c.wait(5)
                    err = c.error
                except PeerGone as exc:
                    err = exc
                assert isinstance(err, PeerGone), (rid, n, err)
                assert err.status_code == LLMStatusCode.LLM_LINK_FAILED
                assert time.monotonic() - t0 < 2.0
                assert (dst == 0xA5).all()
        with pytest.raises(PeerGone):
            ep.connect(desc, timeout=5).close()
    finally:
        ch.close()
        ep.close()


def test_batch_larger_than_iov_max_two_processes(owner):
    p, conn, desc, descs, seg_name = owner
    ep, ch = _connect(desc, descs)
    try:
        dst = np.zeros(SIZE, dtype=np.uint8)
        ep.register(MemRegion(region_id=1, addr=dst.ctypes.data, size=SIZE, remote_accessible=False, placement=0))
        n = 3 * _cma.IOV_MAX + 17  # 512-byte ops at 1 KiB strides: nothing coalesces
        rng = np.random.default_rng(5)
        lslots, rslots = rng.permutation(SIZE // 1024)[:n], rng.permutation(SIZE // 1024)[:n]
        before = ch.cma.calls
        for rid in (USER_RID, POOL_RID):
            dst[:] = 0
            _ok(ch.read(make_ops(1, lslots * 1024, rid, rslots * 1024, 512), deadline=time.monotonic() + 20))
            src = _content(2 if rid == USER_RID else 1)
            got = dst.reshape(-1, 1024)[lslots, :512]
            assert np.array_equal(got, src.reshape(-1, 1024)[rslots, :512]), rid
        assert ch.cma.calls - before >= 4  # the CMA batch took ceil(n / IOV_MAX) calls
    finally:
        ch.close()
        ep.close()


# --------------------------------------------------------------------------- probe and connect


def test_probe_reports_cma_status(monkeypatch):
    info = ShmTransport.probe()
    assert info.name == "shm" and info.available, info
    assert "cma" in info.details and "ptrace_scope" in info.details and "cma_reason" in info.details
    assert info.details["iov_max"] == _cma.IOV_MAX
    # ptrace_scope >= 2: available (pools in shm still work), CMA reported off with the reason
    monkeypatch.setattr(_cma, "_read_int", lambda path: 2 if "ptrace_scope" in path else None)
    info = ShmTransport.probe()
    assert info.available and info.details["cma"] is False
    assert "ptrace_scope=2" in info.reason
    # the syscall itself refused (seccomp): EPERM reported
    monkeypatch.setattr(_cma, "_read_int", lambda path: None)

    def eperm(*args):
        ctypes.set_errno(errno.EPERM)
        return -1

    monkeypatch.setattr(_cma, "libc_syscalls", lambda: (eperm, eperm))
    info = ShmTransport.probe()
    assert info.available and info.details["cma"] is False
    assert "seccomp" in info.details["cma_reason"]


def test_connect_refuses_another_host():
    t = ShmTransport({})
    a, b = t.open_endpoint(), t.open_endpoint()
    try:
        for key, value in (("boot_id", "00000000-0000-0000-0000-000000000000"), ("machine_id", "elsewhere")):
            fields = msgspec.structs.replace(endpoint_fields(b.describe()), **{key: value})
            peer = attrs.evolve(b.describe(), payload=encode_payload(fields))
            with pytest.raises(Refused, match="not on this host"):
                a.connect(peer, timeout=5)
        with pytest.raises(Refused):
            a.connect(attrs.evolve(b.describe(), transport="tcp"), timeout=5)
    finally:
        a.close()
        b.close()


def test_connect_refuses_user_regions_without_cma(monkeypatch):
    monkeypatch.setattr(ShmChannel, "_check_cma", lambda self, peer: (False, "Operation not permitted (simulated)"))
    t = ShmTransport({})
    a, b = t.open_endpoint(), t.open_endpoint()
    buf = np.zeros(4096, dtype=np.uint8)
    try:
        ch = a.connect(b.describe(), timeout=5)  # no user regions yet: pool memory still works
        d = b.register(MemRegion(region_id=3, addr=buf.ctypes.data, size=4096, remote_accessible=True, placement=0))
        with pytest.raises(Refused, match="cross-memory attach"):
            ch.add_remote_region(3, 4096, d)
        ch.close()
        with pytest.raises(Refused, match="cross-memory attach") as exc:
            a.connect(b.describe(), timeout=5)
        assert exc.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    finally:
        a.close()
        b.close()


def test_plugin_hook_registers_the_transport():
    got = []
    llmdd_register_transports(got.append)
    assert got == [ShmTransport]
    assert ShmTransport.same_host_only and ShmTransport.name == "shm" and ShmTransport.priority > 10
    assert hookimpl.project_name == "llmdd"
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="llmdd") if e.name == "shm"]
    assert eps and eps[0].value == "llmdd_shm"


# --------------------------------------------------------------------------- partial transfers


class _ShortCopier:
    """A fake process_vm_readv/writev: copies within this process, at most ``limit`` bytes per call."""

    def __init__(self, limit: int, *, fail_after: int = -1) -> None:
        self.limit = limit
        self.calls = []
        self.fail_after = fail_after

    def __call__(self, pid, lptr, lcnt, rptr, rcnt, flags):
        if self.fail_after >= 0 and len(self.calls) >= self.fail_after:
            return 0
        liov = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * lcnt)).from_address(lptr)).reshape(lcnt, 2).copy()
        riov = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * rcnt)).from_address(rptr)).reshape(rcnt, 2).copy()
        left = self.limit
        moved = 0
        for (la, ll), (ra, rl) in zip(liov.tolist(), riov.tolist()):
            assert ll == rl
            k = min(ll, left)
            ctypes.memmove(la, ra, k)
            moved += k
            left -= k
            if not left:
                break
        self.calls.append((liov, riov, moved))
        return moved


@pytest.mark.parametrize("limit", [1, 333, 4096, 5000, 70000])
def test_partial_transfer_resumes_at_the_exact_byte(limit):
    rng = np.random.default_rng(limit)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    n = 40 if limit < 100 else 300
    lens = rng.integers(1, 700, n).astype(np.uint64)
    lo = np.cumsum(np.concatenate(([0], lens[:-1] + 3))).astype(np.uint64)  # gaps: no merging
    ro = rng.permutation(len(src) // 1024)[:n].astype(np.uint64) * 1024
    fake = _ShortCopier(limit)
    cma = Cma(readv=fake, writev=fake, iov_max=64)
    got = cma.transfer(os.getpid(), iovecs(dst.ctypes.data + lo, lens), iovecs(src.ctypes.data + ro, lens),
                       write=False)
    assert got == int(lens.sum())
    for a, b, k in zip(lo.tolist(), ro.tolist(), lens.tolist()):
        assert np.array_equal(dst[a:a + k], src[b:b + k])
    untouched = np.ones(len(dst), bool)
    for a, k in zip(lo.tolist(), lens.tolist()):
        untouched[a:a + k] = False
    assert not dst[untouched].any(), "bytes outside the ops were written"
    assert all(len(l) <= 64 for l, _, _ in fake.calls)
    # 64 ops of < 700 bytes per window: only the 70000-byte limit never cuts a call short
    assert (cma.short_returns > 0) is (limit < 64 * 700 // 2)
    # after a short call the next one starts exactly at the first byte not yet moved
    for (l0, r0, moved), (l1, r1, _) in zip(fake.calls, fake.calls[1:]):
        ends = np.cumsum(l0[:, 1])
        if moved >= int(ends[-1]):
            continue  # that call finished its window; the next window starts fresh
        k = int(np.searchsorted(ends, moved, side="right"))
        skip = moved - (int(ends[k - 1]) if k else 0)
        assert int(l1[0, 0]) == int(l0[k, 0]) + skip and int(r1[0, 0]) == int(r0[k, 0]) + skip
        assert int(l1[0, 1]) == int(l0[k, 1]) - skip


def test_no_progress_and_errno_are_errors():
    buf = np.zeros(64, dtype=np.uint8)
    iov = iovecs(np.array([buf.ctypes.data], np.uint64), np.array([64], np.uint64))
    cma = Cma(readv=_ShortCopier(10, fail_after=1), writev=_ShortCopier(10), iov_max=8)
    with pytest.raises(CmaError) as exc:
        cma.transfer(os.getpid(), iov, iov.copy(), write=False)
    assert exc.value.errno == errno.EFAULT

    def esrch(*args):
        ctypes.set_errno(errno.ESRCH)
        return -1

    with pytest.raises(CmaError) as exc:
        Cma(readv=esrch, writev=esrch).transfer(12345, iov, iov.copy(), write=True)
    assert exc.value.errno == errno.ESRCH


def test_probe_cma_self_read():
    out = probe_cma()
    assert out["cma"] in (True, False) and isinstance(out["cma_reason"], str)
