"""The shipped conformance suite against the shm transport, in-process pairs.

Two memory styles: *user* regions (plain numpy arrays: cross-memory attach) and *pool*
regions (the suite's buffers allocated inside POSIX shared-memory segments and registered with
a ``backing`` segment, as the engine's pools are: mapped by the peer).

Three data paths: the pure-Python one (``llmdd.shm.native=off``), the C hot path
(``llmdd.shm.native=on``; skipped with its reason when the extension is not built, which
``test_native.py::test_native_extension_is_built_when_expected`` turns into a failure in CI), and
*quick*: the C path whose channels take every batch the engine's small-transfer path would hand the
one-call path (at most 16 equal-length ops between one local and one remote region, at offsets that
are multiples of that length) through ``prepare`` first, and the ops path when it declines, as
``llmdd._data.engine.TransferEngine._run_prepared`` does.
"""

from __future__ import annotations

import contextlib
import time
import functools
import types

import attrs
import numpy as np
import pytest

from llmdd._seam.completions import DoneCompletion

from llmdd._seam.ops import as_ops
from llmdd.lowlevel import SharedSegment
from llmdd._memory.backend import HostBackend
from llmdd.testing import _conformance, _conformance_kit
from llmdd.testing import CONFORMANCE_CHECKS, run_check
import llmdd_shm
from llmdd_shm import MAX_SLOTS, OPT_NATIVE, ShmTransport, _hotpath, _seg, region_fields


class _PoolNumpy(types.ModuleType):
    """numpy, except that 1-d ``uint8`` buffers come out of shared-memory segments (pool style)."""

    def __init__(self) -> None:
        super().__init__("numpy")
        self.backend = HostBackend()
        self.segments: dict[int, object] = {}  # addr -> Segment

    def __getattr__(self, name):
        return getattr(np, name)

    def empty(self, shape, dtype=float, **kw):
        if np.dtype(dtype) != np.uint8 or not isinstance(shape, int) or shape <= 0:
            return np.empty(shape, dtype=dtype, **kw)
        seg = self.backend.allocate_segment(shape + 4096)
        arr = seg.array()[4096:4096 + shape]  # at an offset inside the segment, as a pool hands it out
        self.segments[arr.ctypes.data] = seg
        return arr

    def lookup(self, addr: int):
        seg = self.segments.get(addr)
        return None if seg is None else (seg.name, addr - seg.addr)

    def release(self) -> None:
        for seg in self.segments.values():
            self.backend.release(seg)
        self.segments.clear()


class _PoolEndpoint:
    """Registers the pool's buffers as pool regions (``backing`` set); everything else passes."""

    def __init__(self, ep, pool: _PoolNumpy) -> None:
        self._ep = ep
        self._pool = pool

    def register(self, region):
        found = self._pool.lookup(region.addr)
        assert found is not None, "conformance buffer not from the pool"
        return self._ep.register(attrs.evolve(region, backing=SharedSegment(name=found[0], offset=found[1])))

    def __getattr__(self, name):
        return getattr(self._ep, name)


def make_pair(native: str = "auto"):
    t = ShmTransport({"llm.RdmaTrafficClass": "132", OPT_NATIVE: native})
    return t.open_endpoint(), t.open_endpoint()


#: batches the quick variant's channels did in one call / handed to the ops path after it declined
QUICK_COUNTS = {"quick": 0, "declined": 0}


class _QuickChannel:
    """A channel driven as the engine drives a planned small transfer: one call when it can, else the ops path."""

    def __init__(self, ch) -> None:
        self._ch = ch

    def _one_call(self, write: bool, ops, deadline: float):
        ops = as_ops(ops)
        n = len(ops)
        if not 0 < n <= 16 or time.monotonic() >= deadline:   # the engine's deadline is fresh: the ops path
            return None
        length = int(ops["length"][0])
        lr, rr = ops["local_region"], ops["remote_region"]
        lo, ro = ops["local_offset"], ops["remote_offset"]
        if (length <= 0 or (ops["length"] != length).any() or (lr != lr[0]).any() or (rr != rr[0]).any()
                or (lo % length).any() or (ro % length).any()):
            return None
        big = 1 << 62   # the block counts are the engine's check; the C side still bounds every region
        plan = self._ch.prepare([(int(lr[0]), int(rr[0]))], length, big, big, write,
                                timeout_s=deadline - time.monotonic())
        if plan is None:
            return None
        lb, rb = (lo // length).tolist(), (ro // length).tolist()
        moved = plan(lb, rb) if write else plan(rb, lb)
        if moved < 0:
            QUICK_COUNTS["declined"] += 1
            return None
        assert moved == n * length
        QUICK_COUNTS["quick"] += 1
        return DoneCompletion()

    def read(self, ops, *, deadline: float):
        return self._one_call(False, ops, deadline) or self._ch.read(ops, deadline=deadline)

    def write(self, ops, *, deadline: float):
        return self._one_call(True, ops, deadline) or self._ch.write(ops, deadline=deadline)

    def __getattr__(self, name):
        return getattr(self._ch, name)


class _QuickEndpoint:
    def __init__(self, ep) -> None:
        self._ep = ep

    def connect(self, peer, *, timeout: float):
        return _QuickChannel(self._ep.connect(peer, timeout=timeout))

    def __getattr__(self, name):
        return getattr(self._ep, name)


@pytest.fixture(params=["python", "native", "quick"])
def user_pair(request):
    """``make_pair`` on one data path; every endpoint it makes is checked to be on that path."""
    if request.param != "python" and _hotpath.native is None:
        pytest.skip(f"C hot path not active: {llmdd_shm.NATIVE_REASON}")
    mode = "off" if request.param == "python" else "on"

    def make():
        a, b = make_pair(mode)
        assert (a.native is not None) is (mode == "on") and (b.native is not None) is (mode == "on")
        if request.param == "quick":
            return _QuickEndpoint(a), _QuickEndpoint(b)
        return a, b

    make.transport = functools.partial(ShmTransport, {OPT_NATIVE: mode})   # authentication, two processes
    return make


@pytest.fixture
def pool_pair(monkeypatch, user_pair):
    pool = _PoolNumpy()
    monkeypatch.setattr(_conformance, "np", pool)
    monkeypatch.setattr(_conformance_kit, "np", pool)   # the pairs' regions (_Side.region)

    def make():
        a, b = user_pair()
        return _PoolEndpoint(a, pool), _PoolEndpoint(b, pool)

    make.transport = user_pair.transport
    yield make
    pool.release()


@contextlib.contextmanager
def stall(endpoint):
    """While inside, ``endpoint`` holds the exclusive lock on all its slots (an owner stuck
    mid-deregistration): readers cannot start and must fail by their deadline."""
    ep = getattr(endpoint, "_ep", endpoint)
    fd = _seg.open_fd(ep._ctl_name)
    try:
        assert _seg.lock(fd, _seg.F_WRLCK, 0, MAX_SLOTS)
        yield
    finally:
        _seg.lock(fd, _seg.F_UNLCK, 0, MAX_SLOTS)
        import os

        os.close(fd)


def _run_check(check, make):
    run_check(check, make, stall=stall, transport=make.transport)


@pytest.mark.parametrize("check", CONFORMANCE_CHECKS, ids=lambda c: c.__name__)
def test_conformance_user_memory(check, user_pair):
    _run_check(check, user_pair)


@pytest.mark.parametrize("check", CONFORMANCE_CHECKS, ids=lambda c: c.__name__)
def test_conformance_pool_memory(check, pool_pair):
    _run_check(check, pool_pair)


def test_pool_regions_take_the_mapped_path(pool_pair, user_pair):
    """The pool variant really maps segments (no CMA call), the user variant really uses CMA."""
    import time

    from llmdd.lowlevel import MemRegion, make_ops

    for make, mapped in ((pool_pair, True), (user_pair, False)):
        a, b = make()
        try:
            np_mod = _conformance.np if mapped else np
            sb = np_mod.empty(1 << 16, dtype=np.uint8)
            sb[:] = 7
            da = np_mod.empty(1 << 16, dtype=np.uint8)
            da[:] = 0
            a.register(MemRegion(region_id=1, addr=da.ctypes.data, size=da.size, remote_accessible=False,
                                 placement=0))
            d = b.register(MemRegion(region_id=2, addr=sb.ctypes.data, size=sb.size, remote_accessible=True,
                                     placement=0))
            assert region_fields(d).kind == ("shm" if mapped else "cma")
            ch = a.connect(b.describe(), timeout=5)
            ch.add_remote_region(2, sb.size, d)
            c = ch.read(make_ops(1, 0, 2, 0, 1 << 16), deadline=time.monotonic() + 5)
            assert c.wait(5) and c.error is None
            assert (da == 7).all()
            st = ch.statistics()
            assert (st["mapped_segments"] == 1) is mapped
            assert (st["cma_calls"] > 1) is not mapped  # the connect-time probe is one call
            ch.close()
        finally:
            a.close()
            b.close()


@pytest.mark.parametrize("user_pair", ["quick"], indirect=True)
def test_the_quick_variant_takes_and_declines_one_calls(user_pair):
    """The quick variant is not the native one under another name: its channels move small batches
    in one call (seeded bytes land) and hand refused ones to the ops path, which refuses them."""
    from llmdd.lowlevel import MemRegion, make_ops

    before = dict(QUICK_COUNTS)
    _conformance.check_refusals(user_pair)
    assert QUICK_COUNTS["declined"] >= before["declined"] + 4, QUICK_COUNTS
    assert QUICK_COUNTS["quick"] == before["quick"], QUICK_COUNTS   # every refusal case declined
    a, b = user_pair()
    try:
        rng = np.random.default_rng(61)
        src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
        dst = np.zeros(1 << 16, np.uint8)
        a.register(MemRegion(region_id=1, addr=dst.ctypes.data, size=dst.size, remote_accessible=False, placement=0))
        d = b.register(MemRegion(region_id=2, addr=src.ctypes.data, size=src.size, remote_accessible=True,
                                 placement=0))
        ch = a.connect(b.describe(), timeout=5)
        ch.add_remote_region(2, src.size, d)
        ops = make_ops(1, np.array([0, 3, 5]) * 4096, 2, np.array([9, 1, 2]) * 4096, 4096)
        c = ch.read(ops, deadline=time.monotonic() + 5)
        assert c.wait(5) and c.error is None
        assert QUICK_COUNTS["quick"] == before["quick"] + 1 and ch.statistics()["quick_batches"] == 1
        for lb, rb in ((0, 9), (3, 1), (5, 2)):
            assert np.array_equal(dst[lb * 4096:(lb + 1) * 4096], src[rb * 4096:(rb + 1) * 4096])
        assert not dst[4096:3 * 4096].any()   # blocks 1 and 2 were not asked for
        ch.close()
    finally:
        a.close()
        b.close()
