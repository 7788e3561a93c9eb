"""The C hot path (``llmdd_shm._shmfast``) against the pure-Python path.

* CI fails when the extension silently was not built or not loaded (``LLMDD_REQUIRE_NATIVE=1``,
  set by scripts/test.sh, or a C compiler and ``Python.h`` present here);
* both paths move the same bytes for random batches of pool and user memory, reads and writes;
* the native path refuses stale descriptors and closed / dead peers with the Python path's types,
  and lands no byte after the error;
* its short-transfer resume and its EFAULT handling (a real fault in the middle of an iovec);
* deregister and remove_remote_region racing native batches that run with the GIL released.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time

import numpy as np
import pytest

import llmdd_shm
from llmdd.lowlevel import SharedSegment
from llmdd.lowlevel import MemRegion, PeerGone, Refused, make_ops
from llmdd_shm import OPT_GIL, OPT_NATIVE, ShmTransport, _format, _hotpath, data_path, region_fields

pytestmark = pytest.mark.timeout(120)

needs_native = pytest.mark.skipif(_hotpath.native is None, reason=f"C hot path not active: {llmdd_shm.NATIVE_REASON}")

MiB = 1 << 20


def _toolchain() -> bool:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    inc = sysconfig.get_paths().get("include") or ""
    return shutil.which(cc) is not None and os.path.exists(os.path.join(inc, "Python.h"))


def test_native_extension_is_built_when_expected():
    """A silent fallback to the pure-Python path fails here: scripts/test.sh sets
    LLMDD_REQUIRE_NATIVE=1 (it installs gcc / Python.h when missing); elsewhere a compiler and the
    Python headers being present mean the build was expected too (unless it was switched off)."""
    required = os.environ.get("LLMDD_REQUIRE_NATIVE") == "1"
    switched_off = (os.environ.get("LLMDD_SHM_NATIVE", "").lower() in ("0", "off", "no", "false")
                    or os.environ.get("LLMDD_SHM_BUILD_NATIVE") == "0")
    if not required and (switched_off or not _toolchain()):
        pytest.skip("the C hot path is not expected here (no toolchain, or switched off)")
    assert _hotpath.native is not None, f"the shm C hot path is not active: {llmdd_shm.NATIVE_REASON}"
    assert data_path()["native"] is True
    ep = ShmTransport({}).open_endpoint()
    try:
        assert ep.native is _hotpath.native  # "auto" picks it
    finally:
        ep.close()


@needs_native
def test_native_layout_constants_match_the_python_side():
    """The C side hard-codes the control segment's layout and OP_DTYPE: they must agree."""
    from llmdd.lowlevel import OP_DTYPE

    nat = _hotpath.native
    assert nat.MAX_SLOTS == llmdd_shm.MAX_SLOTS and nat.SLOTS_OFF == _format._SLOTS_OFF
    assert nat.CTL_OPEN == _format.CTL_OPEN and nat.SLOT_LIVE == _format.SLOT_LIVE
    assert nat.OP_SIZE == OP_DTYPE.itemsize == 32
    assert [OP_DTYPE.fields[n][1] for n in OP_DTYPE.names] == [0, 4, 12, 16, 24]  # packed, as op_t in _shmfast.c
    assert _format._HDR_WORDS > 2  # the C side reads header word 2 (state)


def test_env_switch_forces_the_python_path():
    code = ("import llmdd_shm, json; print(json.dumps(llmdd_shm.data_path()))")
    env = dict(os.environ, LLMDD_SHM_NATIVE="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert '"native": false' in out.stdout and "LLMDD_SHM_NATIVE=0" in out.stdout


def test_native_option_is_checked():
    with pytest.raises(Refused, match="auto, on or off"):
        ShmTransport({OPT_NATIVE: "fast"})
    t = ShmTransport({OPT_NATIVE: "off"})
    ep = t.open_endpoint()
    try:
        assert ep.native is None
    finally:
        ep.close()
    if _hotpath.native is None:
        with pytest.raises(Refused, match="unavailable"):
            ShmTransport({OPT_NATIVE: "on"})


def test_info_says_which_path_is_active():
    from llmdd._tools.doctor import collect_info

    info = collect_info()
    shm = [t for t in info["transports"] if t["name"] == "shm"]
    assert shm, info["transports"]
    assert shm[0]["details"]["data_path"] == data_path()
    dp = data_path()
    assert shm[0]["data_path"] == dp["path"] + (f" ({dp['reason']})" if dp["reason"] else "")


# --------------------------------------------------------------------------- same bytes, both paths


class _Side:
    """An endpoint with pool-style (shared segment) and user regions of seeded random bytes."""

    def __init__(self, native: str, seed: int) -> None:
        from llmdd._memory.backend import HostBackend

        self.ep = ShmTransport({OPT_NATIVE: native}).open_endpoint()
        self.backend = HostBackend()
        self.segs = []
        self.bufs: dict[int, np.ndarray] = {}
        self.descs: dict[int, dict] = {}
        self.rng = np.random.default_rng(seed)

    def user(self, rid: int, size: int, remote: bool = True) -> np.ndarray:
        arr = self.rng.integers(0, 256, size, dtype=np.uint8)
        self.bufs[rid] = arr
        self.descs[rid] = self.ep.register(MemRegion(region_id=rid, addr=arr.ctypes.data, size=size,
                                                     remote_accessible=remote, placement=0))
        return arr

    def pool(self, rid: int, size: int) -> np.ndarray:
        seg = self.backend.allocate_segment(size + 8192)
        self.segs.append(seg)
        arr = seg.array()[4096:4096 + size]
        arr[:] = self.rng.integers(0, 256, size, dtype=np.uint8)
        self.bufs[rid] = arr
        self.descs[rid] = self.ep.register(MemRegion(region_id=rid, addr=arr.ctypes.data, size=size,
                                                     remote_accessible=True, placement=0, backing=SharedSegment(
                                                         name=seg.name, offset=4096)))
        return arr

    def close(self) -> None:
        self.ep.close()
        for seg in self.segs:
            self.backend.release(seg)


def _random_ops(rng, n, bs, lrids, rrids, size):
    """``n`` ops of ``bs`` bytes at distinct destination blocks (reads: local; writes: remote)."""
    lb = rng.permutation(len(lrids) * (size // bs))[:n]
    rb = rng.permutation(len(rrids) * (size // bs))[:n]
    per = size // bs
    return make_ops(np.asarray(lrids)[lb // per], (lb % per) * bs, np.asarray(rrids)[rb // per], (rb % per) * bs, bs)


@pytest.mark.parametrize("native", ["off", pytest.param("on", marks=needs_native)])
def test_both_paths_move_the_same_bytes(native):
    size = 2 * MiB
    a, b = _Side(native, 1), _Side(native, 2)
    try:
        for rid in (1, 2):
            a.user(rid, size, remote=False)
        b.user(10, size)
        b.pool(11, size)
        ch = a.ep.connect(b.ep.describe(), timeout=5)
        for rid in (10, 11):
            ch.add_remote_region(rid, size, b.descs[rid])
        rng = np.random.default_rng(5)
        for n, bs in ((1, 65536), (16, 16384), (7, 4096), (300, 4096), (8, 1 << 20)):
            for write in (False, True):
                before_a = {k: v.copy() for k, v in a.bufs.items()}
                before_b = {k: v.copy() for k, v in b.bufs.items()}
                ops = _random_ops(rng, n, bs, [1, 2], [10, 11], size)
                c = (ch.write if write else ch.read)(ops, deadline=time.monotonic() + 30)
                assert c.wait(30) and c.error is None, c.error
                exp_a, exp_b = before_a, before_b
                for op in ops.tolist():
                    lr, lo, rr, ro, ln = op
                    if write:
                        exp_b[rr][ro:ro + ln] = before_a[lr][lo:lo + ln]
                    else:
                        exp_a[lr][lo:lo + ln] = before_b[rr][ro:ro + ln]
                for k in a.bufs:
                    assert np.array_equal(a.bufs[k], exp_a[k]), (n, bs, write, k)
                for k in b.bufs:
                    assert np.array_equal(b.bufs[k], exp_b[k]), (n, bs, write, k)
        st = ch.statistics()
        if native == "on":
            # every batch fits one chunk: all of them took the single C call, none fell back
            assert st["native_batches"] == 10 and st["native_fallbacks"] == 0, st
        else:
            assert st["native_batches"] == 0 and st["native_fallbacks"] == 0, st
        ch.close()
    finally:
        a.close()
        b.close()


@needs_native
def test_native_refuses_stale_and_closed_peers_without_landing_bytes():
    size = 1 * MiB
    a, b = _Side("on", 3), _Side("on", 4)
    try:
        dst = a.user(1, size, remote=False)
        b.user(10, size)
        b.pool(11, size)
        ch = a.ep.connect(b.ep.describe(), timeout=5)
        for rid in (10, 11):
            ch.add_remote_region(rid, size, b.descs[rid])
        keep = dst.copy()
        # the owner re-registers region 10 (same slot, new generation): the old descriptor is refused
        b.ep.deregister(10)
        b.user(10, size)
        assert region_fields(b.descs[10]).slot >= 0
        c = ch.read(make_ops(1, 0, 10, 0, 65536), deadline=time.monotonic() + 5)
        assert isinstance(c.error, Refused) and "not registered by its owner" in str(c.error), c.error
        assert np.array_equal(dst, keep)
        # an unknown region / out of bounds: the Python path's refusal, after a native fallback
        for ops in (make_ops(1, 0, 99, 0, 64), make_ops(1, size - 10, 11, 0, 64)):
            c = ch.read(ops, deadline=time.monotonic() + 5)   # refused through the completion, never raised
            assert c.wait(5) and isinstance(c.error, Refused), c.error
        assert np.array_equal(dst, keep)
        st = ch.statistics()
        assert st["native_fallbacks"] == 2 and st["native_batches"] == 1, st
        # the peer endpoint closes: PeerGone from the C side's header check
        b.ep.close()
        c = ch.read(make_ops(1, 0, 11, 0, 65536), deadline=time.monotonic() + 5)
        assert isinstance(c.error, PeerGone), c.error
        assert np.array_equal(dst, keep)
        ch.close()
    finally:
        a.close()
        b.close()


def _dead_peer_child(conn) -> None:
    ep = ShmTransport({}).open_endpoint()
    arr = np.arange(1 << 16, dtype=np.uint8)
    d = ep.register(MemRegion(region_id=10, addr=arr.ctypes.data, size=arr.size, remote_accessible=True, placement=0))
    conn.send((ep.describe(), d))
    conn.recv()  # killed while waiting here


@needs_native
def test_native_dead_peer_is_peer_gone():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_dead_peer_child, args=(child,))
    p.start()
    a = _Side("on", 5)
    try:
        assert parent.poll(60)
        desc, d = parent.recv()
        dst = a.user(1, 1 << 16, remote=False)
        ch = a.ep.connect(desc, timeout=5)
        ch.add_remote_region(10, 1 << 16, d)
        c = ch.read(make_ops(1, 0, 10, 0, 1 << 16), deadline=time.monotonic() + 5)
        assert c.error is None and np.array_equal(dst, np.arange(1 << 16, dtype=np.uint8))
        p.kill()
        p.join(30)
        dst[:] = 0
        c = ch.read(make_ops(1, 0, 10, 0, 1 << 16), deadline=time.monotonic() + 5)
        assert isinstance(c.error, PeerGone), c.error
        assert not dst.any()
        ch.close()
    finally:
        a.close()
        if p.is_alive():
            p.kill()
        p.join(30)


@needs_native
def test_native_copy_stops_at_a_fault_and_reports_the_bytes_moved():
    """A real short transfer: the remote iovec runs into an unmapped page. The C loop resumes at the
    exact byte the kernel stopped at, that call faults, and it reports EFAULT with the bytes moved."""
    nat = _hotpath.native
    page = mmap.PAGESIZE
    m = mmap.mmap(-1, 2 * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    src = np.random.default_rng(9).integers(0, 256, page, dtype=np.uint8)
    ctypes.memmove(base, src.ctypes.data, page)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + page, page, 0) == 0  # PROT_NONE: reads of the second page fault
    dst = np.zeros(3 * page, np.uint8)
    half = page // 2
    # element 0: half a page, fine; element 1: the second half of page 1 and 100 bytes of page 2
    liov = np.array([[dst.ctypes.data, half], [dst.ctypes.data + page, half + 100]], np.uint64)
    riov = np.array([[base, half], [base + half, half + 100]], np.uint64)
    st, err, moved = nat.copy(0, os.getpid(), 1, liov.ctypes.data, riov.ctypes.data, 2)
    assert st == _hotpath.ST_CMA and err == errno.EFAULT, (st, err, moved)
    assert moved == page
    assert np.array_equal(dst[:half], src[:half]) and np.array_equal(dst[page:page + half], src[half:])
    assert not dst[half:page].any() and not dst[page + half:].any()
    assert libc.mprotect(base + page, page, 3) == 0
    del liov, riov
    m.close()


@needs_native
def test_deregister_and_remove_remote_region_race_native_batches():
    """1 MiB native reads (above the GIL threshold: the copy runs without the GIL) while the local
    region is deregistered and the remote pool region removed and re-added. Each read either moved
    the right bytes or failed typed; after deregister returns no byte lands in the old region."""
    size = 4 * MiB
    a, b = _Side("on", 6), _Side("on", 7)
    try:
        dst = a.user(1, size, remote=False)
        src = b.pool(11, size)
        ch = a.ep.connect(b.ep.describe(), timeout=5)
        ch._ngil = 0
        ch.add_remote_region(11, size, b.descs[11])
        stop = threading.Event()
        outcomes = {"ok": 0, "typed": 0, "other": []}

        def reader():
            rng = np.random.default_rng(1)
            while not stop.is_set():
                lo, ro = int(rng.integers(0, 4)) * MiB, int(rng.integers(0, 4)) * MiB
                try:
                    c = ch.read(make_ops(1, lo, 11, ro, MiB), deadline=time.monotonic() + 10)
                    e = c.error
                except (Refused, PeerGone) as exc:
                    e = exc
                except Exception as exc:  # noqa: BLE001
                    outcomes["other"].append(exc)
                    return
                if e is None:
                    outcomes["ok"] += 1
                elif isinstance(e, (Refused, PeerGone)):
                    outcomes["typed"] += 1
                else:
                    outcomes["other"].append(e)

        t = threading.Thread(target=reader)
        t.start()
        deadline = time.monotonic() + 30
        while outcomes["ok"] < 20 and time.monotonic() < deadline:
            time.sleep(0.001)  # polling progress with a deadline, not synchronising
        for _ in range(50):
            ch.remove_remote_region(11)
            ch.add_remote_region(11, size, b.descs[11])
        a.ep.deregister(1)
        dst[:] = 7  # no native batch may still be writing into it
        typed_at = outcomes["typed"]
        deadline = time.monotonic() + 30
        while outcomes["typed"] <= typed_at and not outcomes["other"] and time.monotonic() < deadline:
            time.sleep(0.001)  # until the reader's next read was refused (bounded)
        stop.set()
        t.join(30)
        assert not t.is_alive()
        assert not outcomes["other"], outcomes["other"]
        assert outcomes["ok"] >= 20 and outcomes["typed"] > typed_at, outcomes
        assert (dst == 7).all(), "a native batch wrote into a deregistered region"
        assert not ch._deferred and ch._nbusy == 0
        assert np.array_equal(src[:16], b.bufs[11][:16])
        ch.close()
    finally:
        a.close()
        b.close()
