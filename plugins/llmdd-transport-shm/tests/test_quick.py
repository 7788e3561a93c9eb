"""The one-call path of planned small transfers (``ShmChannel.prepare`` / ``_shmfast.quick``, issue 21).

* it moves the planned blocks of every tensor pair byte for byte, reads and writes, user (CMA) and
  pool (mapped) memory, and counts them in the channel's and the endpoint's statistics;
* every case it does not do returns a negative status with no byte landed on either side (the
  engine then takes the ops path, which reports it): a block out of range or a repeated destination,
  a table changed since the plan (a region added or deregistered on either side, a closed channel or
  endpoint), the owner holding its lock, the owner's re-registered slot (stale generation), the peer
  endpoint closed, a peer process that exited;
* there is no plan without the C extension (the pure-Python path), for a region the tables do not
  hold, or for a block above the single-call limit.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

import llmdd_shm
from llmdd.lowlevel import SharedSegment
from llmdd.lowlevel import MemRegion, make_ops
from llmdd_shm import MAX_SLOTS, OPT_NATIVE, ShmTransport, _hotpath, _seg

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(_hotpath.native is None,
                                 reason=f"C hot path not active: {llmdd_shm.NATIVE_REASON}")]

KiB = 1 << 10
# statuses of _shmfast.quick, negated (see _shmfast.c)
FALLBACK, BUSY, CLOSED, STALE, DEAD = -1, -2, -3, -4, -7


class _Side:
    def __init__(self, seed: int, native: str = "on") -> None:
        from llmdd._memory.backend import HostBackend

        self.ep = ShmTransport({OPT_NATIVE: native}).open_endpoint()
        self.backend = HostBackend()
        self.segs: list = []
        self.bufs: dict[int, np.ndarray] = {}
        self.descs: dict[int, dict] = {}
        self.rng = np.random.default_rng(seed)

    def region(self, rid: int, size: int, *, pool: bool = False, remote: bool = True) -> np.ndarray:
        if pool:
            seg = self.backend.allocate_segment(size + 8192)
            self.segs.append(seg)
            arr = seg.array()[4096:4096 + size]
            extra = {"backing": SharedSegment(name=seg.name, offset=4096)}
        else:
            arr = np.empty(size, np.uint8)
            extra = {}
        arr[:] = self.rng.integers(0, 256, size, dtype=np.uint8)
        self.bufs[rid] = arr
        self.descs[rid] = self.ep.register(MemRegion(region_id=rid, addr=arr.ctypes.data, size=size,
                                                     remote_accessible=remote, placement=0, **extra))
        return arr

    def close(self) -> None:
        self.ep.close()
        for seg in self.segs:
            self.backend.release(seg)


@pytest.fixture
def sides():
    made: list = []

    def make(*seeds: int, native: str = "on"):
        out = [_Side(s, native) for s in seeds]
        made.extend(out)
        return out

    yield make
    for s in made:
        s.close()


def _blocks(buf: np.ndarray, bs: int, idx: list) -> np.ndarray:
    return np.stack([buf[b * bs:(b + 1) * bs] for b in idx])


@pytest.mark.parametrize("pool", [False, True], ids=["user", "pool"])
def test_quick_moves_every_pairs_blocks_both_ways(sides, pool):
    bs, nb = 16 * KiB, 32
    a, b = sides(11, 12)
    for rid in (1, 2):
        a.region(rid, bs * nb)
    for rid in (10, 11):
        b.region(rid, bs * nb, pool=pool)
    ch = a.ep.connect(b.ep.describe(), timeout=5)
    for rid in (10, 11):
        ch.add_remote_region(rid, bs * nb, b.descs[rid])
    pairs = [(1, 10), (2, 11)]
    cma0 = ch.statistics()["cma_calls"]
    rng = np.random.default_rng(13)
    src = rng.choice(nb, 8, replace=False).tolist()
    dst = rng.choice(nb, 8, replace=False).tolist()
    # read: remote src blocks -> local dst blocks
    before = {r: a.bufs[r].copy() for r in (1, 2)}
    pull = ch.prepare(pairs, bs, nb, nb, False)
    assert pull is not None
    for lr, rr in pairs:   # the control: the bytes differ before the call
        assert not np.array_equal(_blocks(a.bufs[lr], bs, dst), _blocks(b.bufs[rr], bs, src))
    assert pull(src, dst) == 2 * 8 * bs
    for lr, rr in pairs:
        assert np.array_equal(_blocks(a.bufs[lr], bs, dst), _blocks(b.bufs[rr], bs, src))
        untouched = sorted(set(range(nb)) - set(dst))
        assert np.array_equal(_blocks(a.bufs[lr], bs, untouched), _blocks(before[lr], bs, untouched))
    # write: local src blocks -> remote dst blocks (fresh random source)
    for r in (1, 2):
        a.bufs[r][:] = a.rng.integers(0, 256, bs * nb, dtype=np.uint8)
    push = ch.prepare(pairs, bs, nb, nb, True)
    src2 = rng.choice(nb, 5, replace=False).tolist()
    dst2 = rng.choice(nb, 5, replace=False).tolist()
    assert push(tuple(src2), tuple(dst2)) == 2 * 5 * bs
    for lr, rr in pairs:
        assert np.array_equal(_blocks(b.bufs[rr], bs, dst2), _blocks(a.bufs[lr], bs, src2))
    st = ch.statistics()
    assert st["quick_batches"] == 2 and st["bytes_read"] == 16 * bs and st["bytes_written"] == 10 * bs
    assert st["cma_calls"] == cma0 + (0 if pool else 2)   # one process_vm_* per call on user memory
    assert a.ep.statistics()["quick_batches"] == 2
    ch.close()


def test_quick_declines_without_landing_a_byte(sides):
    bs, nb = 4 * KiB, 16
    a, b = sides(21, 22)
    a.region(1, bs * nb)
    b.region(10, bs * nb)
    b.region(11, bs * nb, pool=True)
    ch = a.ep.connect(b.ep.describe(), timeout=5)
    for rid in (10, 11):
        ch.add_remote_region(rid, bs * nb, b.descs[rid])
    local0, remote0 = a.bufs[1].copy(), {r: b.bufs[r].copy() for r in (10, 11)}

    def unchanged() -> bool:
        return np.array_equal(a.bufs[1], local0) and all(np.array_equal(b.bufs[r], remote0[r]) for r in (10, 11))

    pull = ch.prepare([(1, 10)], bs, nb, nb, False)
    push = ch.prepare([(1, 11)], bs, nb, nb, True)
    # arguments it leaves to the planner
    for f in (pull, push):
        for s, d in (([nb], [0]), ([0], [nb]), ([0, 1], [2, 2]), ([True], [0]), ([0], [1.0]), ([-1], [0]),
                     ([0] * 17, list(range(17))), ([], []), ([0], [0, 1]), ([2 ** 64], [0])):
            assert f(s, d) == FALLBACK, (s, d)
        with pytest.raises(TypeError):
            f([0])
    # a block whose offset wraps 64 bits (2**52 * 4 KiB == 2**64) under a plan that allows any block id
    wide = ch.prepare([(1, 10)], bs, 1 << 62, 1 << 62, False)
    assert wide([1 << 52], [0]) == FALLBACK and wide([0], [1 << 52]) == FALLBACK
    assert wide([2], [3]) == bs   # the control: an ordinary block under the same plan lands
    assert np.array_equal(a.bufs[1][3 * bs:4 * bs], b.bufs[10][2 * bs:3 * bs])
    local0 = a.bufs[1].copy()
    assert unchanged()
    # the owner holds the lock on its slots (mid-deregistration): busy, nothing moved
    fd = _seg.open_fd(b.ep._ctl_name)
    try:
        assert _seg.lock(fd, _seg.F_WRLCK, 0, MAX_SLOTS)
        assert pull([0], [1]) == BUSY and push([0], [1]) == BUSY
    finally:
        _seg.lock(fd, _seg.F_UNLCK, 0, MAX_SLOTS)
        import os

        os.close(fd)
    assert unchanged()
    # the owner re-registers region 10 (the channel still holds the old descriptor): stale generation
    b.ep.deregister(10)
    b.region(10, bs * nb)
    remote0[10] = b.bufs[10].copy()
    assert pull([0], [1]) == STALE
    assert unchanged()
    # the control: the same push of the same blocks lands while nothing is wrong
    assert push([3], [4]) == bs
    assert np.array_equal(b.bufs[11][4 * bs:5 * bs], a.bufs[1][3 * bs:4 * bs])
    remote0[11] = b.bufs[11].copy()
    # a table changed since the plan: a remote region learnt, a local region registered
    ch.add_remote_region(10, bs * nb, b.descs[10])
    assert pull([0], [1]) == FALLBACK and push([0], [1]) == FALLBACK
    fresh = ch.prepare([(1, 10)], bs, nb, nb, False)
    assert fresh([0], [1]) == bs   # the plan on the new tables works
    local0 = a.bufs[1].copy()
    a.region(2, bs)
    assert fresh([0], [1]) == FALLBACK
    assert unchanged()
    # the peer endpoint closes: the C side reads its header
    again = ch.prepare([(1, 10)], bs, nb, nb, False)
    b.ep.close()
    assert again([0], [1]) == CLOSED
    assert unchanged()
    # the channel closes: every plan is stale
    ch.close()
    assert again([0], [1]) == FALLBACK
    assert ch.prepare([(1, 10)], bs, nb, nb, False) is None
    assert unchanged()


def test_local_deregister_and_endpoint_close_invalidate_plans(sides):
    bs, nb = 4 * KiB, 8
    a, b = sides(31, 32)
    a.region(1, bs * nb)
    b.region(10, bs * nb)
    ch = a.ep.connect(b.ep.describe(), timeout=5)
    ch.add_remote_region(10, bs * nb, b.descs[10])
    pull = ch.prepare([(1, 10)], bs, nb, nb, False)
    assert pull([1], [1]) == bs
    keep = a.bufs[1].copy()
    a.ep.deregister(1)
    assert pull([2], [2]) == FALLBACK
    assert np.array_equal(a.bufs[1], keep)
    assert ch.prepare([(1, 10)], bs, nb, nb, False) is None   # no such local region now
    a.region(1, bs * nb)
    pull = ch.prepare([(1, 10)], bs, nb, nb, False)
    keep = a.bufs[1].copy()
    a.ep.close()
    assert pull([2], [2]) == FALLBACK
    assert np.array_equal(a.bufs[1], keep)
    ch.close()


def test_no_plan_where_the_one_call_cannot_go(sides):
    bs, nb = 4 * KiB, 8
    a, b = sides(41, 42)
    a.region(1, bs * nb)
    b.region(10, bs * nb)
    b.region(12, bs * nb, remote=False)
    ch = a.ep.connect(b.ep.describe(), timeout=5)
    for rid in (10, 12):
        ch.add_remote_region(rid, bs * nb, b.descs[rid])
    assert ch.prepare([(1, 10)], bs, nb, nb, False) is not None   # the control
    assert ch.prepare([(1, 99)], bs, nb, nb, False) is None       # unknown remote region
    assert ch.prepare([(7, 10)], bs, nb, nb, False) is None       # unknown local region
    assert ch.prepare([(1, 12)], bs, nb, nb, False) is None       # not remote-accessible
    assert ch.prepare([], bs, nb, nb, False) is None
    assert ch.prepare([(1, 10)] * 65, bs, nb, nb, False) is None  # more pairs than one call takes
    assert ch.prepare([(1, 10)], ch._ngil + 1, 1, 1, False) is None   # above the GIL-held limit
    # the 8 x 2 x 16 KiB decode step: 256 KiB, the default limit, goes in one call
    assert ch.prepare([(1, 10), (1, 10)], 16 * KiB, 8, 8, False) is not None
    ch.close()
    # the pure-Python path has no one-call path
    c, d = sides(43, 44, native="off")
    c.region(1, bs * nb)
    d.region(10, bs * nb)
    ch = c.ep.connect(d.ep.describe(), timeout=5)
    ch.add_remote_region(10, bs * nb, d.descs[10])
    assert ch.prepare([(1, 10)], bs, nb, nb, False) is None
    ch.close()


def _exiting_peer(conn) -> None:
    ep = ShmTransport({}).open_endpoint()
    arr = np.random.default_rng(51).integers(0, 256, 1 << 16, dtype=np.uint8)
    d = ep.register(MemRegion(region_id=10, addr=arr.ctypes.data, size=arr.size, remote_accessible=True,
                              placement=0))
    conn.send((ep.describe(), d, arr.tobytes()))
    conn.recv()   # killed while waiting here


def test_quick_reads_another_process_and_reports_its_exit(sides):
    (a,) = sides(52)
    a.region(1, 1 << 16)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_exiting_peer, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "peer did not start"
        desc, d, data = parent.recv()
        ch = a.ep.connect(desc, timeout=5)
        ch.add_remote_region(10, 1 << 16, d)
        pull = ch.prepare([(1, 10)], 4 * KiB, 16, 16, False)
        assert pull([3, 4], [0, 1]) == 8 * KiB
        peer = np.frombuffer(data, np.uint8)
        assert np.array_equal(a.bufs[1][:8 * KiB], peer[3 * 4 * KiB:5 * 4 * KiB])
        keep = a.bufs[1].copy()
        proc.kill()
        proc.join(10)
        deadline = time.monotonic() + 10
        got = pull([5], [5])
        while got == CLOSED and time.monotonic() < deadline:   # its header is never closed: the pidfd tells
            got = pull([5], [5])
        assert got == DEAD, got
        assert np.array_equal(a.bufs[1], keep)
        ch.close()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
