"""Memory layer: backends (shared-memory hygiene), page pool, region table, copy executor, manager."""

from __future__ import annotations

import multiprocessing
import os
import sys

import numpy as np
import pytest

from llmdd._base.enums import DataType, Placement
from llmdd._lifecycle.machines import Lifecycle
from llmdd._lifecycle.tables import CacheState, Machine
from llmdd._memory import backend as backend_mod
from llmdd._memory.backend import EmulatedDeviceBackend, HostBackend, MemoryBackend, attach_segment
from llmdd._memory.copy import (
    COPY_OP_DTYPE,
    Bounds,
    block_copy_ops,
    coalesce_copy_ops,
    execute,
    make_copy_ops,
)
from llmdd._memory.manager import MemoryManager
from llmdd._memory.pool import PagePool
from llmdd._memory.regions import RegionTable
from llmdd._base.status import LLMException, LLMStatusCode
from llmdd._base.types import BlocksCacheKey, CacheDesc, CacheKey, cache_key_index

PARAM = LLMStatusCode.LLM_PARAM_INVALID
OOM = LLMStatusCode.LLM_OUT_OF_MEMORY


def _shm_entries() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(backend_mod.SEGMENT_PREFIX + f"{os.getpid()}_")}
    except FileNotFoundError:  # pragma: no cover
        return set()


# --------------------------------------------------------------------- backends

@pytest.mark.parametrize("cls, placement", [(HostBackend, Placement.HOST),
                                            (EmulatedDeviceBackend, Placement.DEVICE)])
def test_backend_segment_roundtrip(cls, placement):
    be = cls()
    assert isinstance(be, MemoryBackend)
    assert be.placement == placement
    seg = be.allocate_segment(8192)
    try:
        assert seg.size == 8192 and seg.owner and seg.name.startswith(backend_mod.SEGMENT_PREFIX)
        assert seg.name in _shm_entries()
        arr = seg.array()
        assert arr.ctypes.data == seg.addr
        arr[:4] = [1, 2, 3, 4]
        peer = attach_segment(seg.name, seg.size)
        assert not peer.owner
        assert list(peer.array()[:4]) == [1, 2, 3, 4]
        with pytest.raises(LLMException):
            peer.unlink()
        peer.close()
    finally:
        be.release(seg)
    assert seg.name not in _shm_entries()
    be.release(seg)  # idempotent


def test_emulated_device_describes_itself():
    d = EmulatedDeviceBackend().describe()
    assert d["emulated"] is True and d["placement"] == "DEVICE"
    assert HostBackend().describe()["emulated"] is False


def test_backend_rejects_bad_sizes_and_names():
    with pytest.raises(LLMException) as e:
        HostBackend().allocate_segment(0)
    assert e.value.status_code == PARAM
    with pytest.raises(LLMException) as e:
        attach_segment("llmdd_no_such_segment_x", 4096)
    assert e.value.status_code == PARAM
    with pytest.raises(LLMException):
        attach_segment("a/b", 10)


def test_attach_larger_than_segment_refused():
    be = HostBackend()
    seg = be.allocate_segment(4096)
    try:
        with pytest.raises(LLMException) as e:
            attach_segment(seg.name, 4096 * 4)
        assert e.value.status_code == PARAM
    finally:
        be.release(seg)


def _child_attach(name: str, size: int, q) -> None:  # runs in a spawned process
    from llmdd._memory.backend import attach_segment as attach

    seg = attach(name, size)
    arr = seg.array()
    q.put(int(arr[0]))
    arr[1] = 99
    seg.close()


def test_spawned_peer_attach_does_not_unlink_on_exit():
    be = HostBackend()
    seg = be.allocate_segment(4096)
    try:
        seg.array()[0] = 42
        ctx = multiprocessing.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_child_attach, args=(seg.name, 4096, q))
        p.start()
        assert q.get(timeout=30) == 42
        p.join(30)
        assert p.exitcode == 0
        # the child has exited (its resource tracker, if any, too): the segment must still exist
        assert seg.name in _shm_entries()
        again = attach_segment(seg.name, 4096)
        assert int(again.array()[1]) == 99
        again.close()
    finally:
        be.release(seg)
    assert seg.name not in _shm_entries()


def test_owner_is_not_registered_with_resource_tracker():
    if sys.version_info >= (3, 13):
        pytest.skip("track=False is used on 3.13+")
    from multiprocessing import resource_tracker

    calls = []
    orig = resource_tracker.unregister
    resource_tracker.unregister = lambda name, rtype: calls.append((name, rtype)) or orig(name, rtype)
    try:
        be = HostBackend()
        seg = be.allocate_segment(4096)
        be.release(seg)
    finally:
        resource_tracker.unregister = orig
    assert any(rtype == "shared_memory" for _, rtype in calls)


# --------------------------------------------------------------------- page pool

@pytest.fixture
def pool():
    p = PagePool(16 * 4096, 12, HostBackend())
    yield p
    p.close()


def test_pool_allocate_free_and_stats(pool):
    st = pool.statistics()
    assert (st.total_pages, st.used_pages, st.free_pages, st.largest_free_run) == (16, 0, 16, 16)
    a = pool.allocate(1)          # 1 page
    b = pool.allocate(4096 * 2 + 1)  # 3 pages
    c = pool.allocate(0)          # at least one page
    assert a == pool.base and b == a + 4096 and c == b + 3 * 4096
    assert pool.allocation_size(b) == 3 * 4096
    st = pool.statistics()
    assert (st.used_pages, st.allocations, st.allocations_total) == (5, 3, 3)
    pool.free(b)
    pool.check_consistency()
    assert pool.statistics().free_runs == 2
    # best fit: a 3-page request reuses the hole, not the tail
    assert pool.allocate(3 * 4096) == b
    pool.free(a)
    pool.free(b)
    pool.free(c)
    pool.check_consistency()
    st = pool.statistics()
    assert (st.used_pages, st.free_runs, st.largest_free_run) == (0, 1, 16)


def test_pool_exhaustion_is_oom_and_consistent(pool):
    addrs = [pool.allocate(4096 * 4) for _ in range(4)]
    before = pool.statistics()
    with pytest.raises(LLMException) as e:
        pool.allocate(1)
    assert e.value.status_code == OOM
    pool.free(addrs[1])
    with pytest.raises(LLMException) as e:  # fragmented: 4 free pages, 5 wanted
        pool.allocate(4096 * 5)
    assert e.value.status_code == OOM
    pool.check_consistency()
    after = pool.statistics()
    assert after.used_pages == before.used_pages - 4 and after.failures == 2
    assert pool.allocate(4096 * 4) == addrs[1]


@pytest.mark.parametrize("bad", ["double", "foreign", "misaligned", "not_int"])
def test_pool_bad_free(pool, bad):
    a = pool.allocate(4096)
    if bad == "double":
        pool.free(a)
        addr = a
    elif bad == "foreign":
        addr = pool.base + pool.size + 4096
    elif bad == "misaligned":
        addr = a + 8
    else:
        addr = "x"
    with pytest.raises(LLMException) as e:
        pool.free(addr)
    assert e.value.status_code == PARAM
    pool.check_consistency()


def test_pool_rounds_memory_size_up_and_closes():
    p = PagePool(4096 + 1, 12, EmulatedDeviceBackend())
    name = p.segment.name
    assert p.total_pages == 2 and p.placement == Placement.DEVICE
    p.allocate(4096 + 1)
    p.close()
    assert name not in _shm_entries()
    with pytest.raises(LLMException):
        p.allocate(1)
    p.close()


def test_pool_memory_is_usable(pool):
    a = pool.allocate(4096)
    view = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 4096).from_address(a))
    view[:] = 7
    assert int(pool.segment.array()[a - pool.base + 100]) == 7


# --------------------------------------------------------------------- region table

def _spec(table, addr, size, cache_id=1, tensor_index=0, **kw):
    return table.add(cache_id=cache_id, tensor_index=tensor_index, addr=addr, size=size,
                     placement=kw.get("placement", Placement.DEVICE), remote_accessible=True, owned=False)


def test_region_table_add_lookup_remove_and_listeners():
    t = RegionTable()
    seen = []
    t.add_listener(lambda kind, regions, version: seen.append((kind, [r.region_id for r in regions], version)))
    r1 = _spec(t, 1000, 100)
    r2 = _spec(t, 2000, 100, tensor_index=1)
    assert t.version == 2 and len(t) == 2
    assert t.contains(1000, 100) == r1 and t.contains(1050, 50) == r1
    assert t.contains(1050, 51) is None and t.contains(999, 1) is None and t.contains(1100, 1) is None
    assert t.get(r2.region_id) == r2
    assert [r.tensor_index for r in t.regions_of(1)] == [0, 1]
    for addr, size in [(1000, 1), (950, 51), (1099, 10), (900, 2000)]:
        with pytest.raises(LLMException) as e:
            _spec(t, addr, size, cache_id=2)
        assert e.value.status_code == PARAM
    _spec(t, 1100, 900, cache_id=3)  # exactly between: fine
    remapped = t.remap([(2010, 10)])
    assert remapped[0].generation == 1 and t.get(r2.region_id).generation == 1
    with pytest.raises(LLMException):
        t.remap([(2090, 20)])
    t.remove_cache(1)
    assert t.contains(1000, 1) is None
    with pytest.raises(LLMException):
        t.get(r1.region_id)
    kinds = [k for k, _, _ in seen]
    assert kinds == ["add", "add", "add", "remap", "remove"]
    assert [v for _, _, v in seen] == sorted(v for _, _, v in seen)
    mr = t.regions()[0].to_mem_region()
    assert mr.addr == 1100 and mr.size == 900


def test_region_table_add_many_is_atomic_and_listener_errors_are_contained():
    t = RegionTable()
    t.add_listener(lambda *a: 1 / 0)
    _spec(t, 5000, 10)
    from llmdd._memory.regions import RegionSpec

    specs = [RegionSpec(cache_id=9, tensor_index=i, addr=a, size=10, placement=Placement.HOST,
                        remote_accessible=False, owned=False) for i, a in enumerate([100, 105])]
    with pytest.raises(LLMException):
        t.add_many(specs)
    specs[1] = RegionSpec(cache_id=9, tensor_index=1, addr=5005, size=1, placement=Placement.HOST,
                          remote_accessible=False, owned=False)
    with pytest.raises(LLMException):
        t.add_many(specs)
    assert len(t) == 1 and t.contains(100, 1) is None


def test_region_bounds_vectorised():
    t = RegionTable()
    _spec(t, 1000, 100)
    _spec(t, 3000, 50, tensor_index=1)
    b = t.bounds()
    b.check(np.array([1000, 1090, 3000]), np.array([100, 10, 50]), "x")
    for addr, n in [(999, 1), (1090, 11), (3049, 2), (2000, 1), (2**64 - 1, 2)]:
        with pytest.raises(LLMException) as e:
            b.check(np.array([addr], dtype=np.uint64), np.array([n], dtype=np.uint64), "x")
        assert e.value.status_code == PARAM


# --------------------------------------------------------------------- copy executor

def test_coalesce_merges_runs_and_keeps_order_semantics():
    ops = make_copy_ops([0, 10, 20, 50], [100, 110, 120, 200], 10)
    out = coalesce_copy_ops(ops)
    assert out.tolist() == [(0, 100, 30), (50, 200, 10)]
    # chain inside one buffer (dst starts inside src) must not be merged
    chain = make_copy_ops([0, 10], [10, 20], 10)
    assert len(coalesce_copy_ops(chain)) == 2
    # backward move can be merged
    back = make_copy_ops([10, 20], [0, 10], 10)
    assert coalesce_copy_ops(back).tolist() == [(10, 0, 20)]


def test_chain_copy_matches_sequential_semantics():
    buf = np.arange(40, dtype=np.uint8)
    base = buf.ctypes.data
    ops = block_copy_ops([base], [base], 10, np.array([0, 1]), np.array([1, 2]))
    bounds = Bounds.from_ranges([(base, 40)])
    execute(ops, src_bounds=bounds, dst_bounds=bounds)
    ref = np.arange(40, dtype=np.uint8)
    ref[10:20] = ref[0:10]
    ref[20:30] = ref[10:20]
    assert np.array_equal(buf, ref)


def test_execute_checks_every_op_before_copying():
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    sb = Bounds.from_ranges([(src.ctypes.data, 64)])
    db = Bounds.from_ranges([(dst.ctypes.data, 64)])
    good = make_copy_ops(src.ctypes.data, dst.ctypes.data, 32)
    bad = make_copy_ops(src.ctypes.data + 40, dst.ctypes.data + 40, 32)  # 8 bytes past the end
    with pytest.raises(LLMException) as e:
        execute(np.concatenate([good, bad]), src_bounds=sb, dst_bounds=db)
    assert e.value.status_code == PARAM
    assert not dst.any()  # nothing moved
    assert execute(good, src_bounds=sb, dst_bounds=db) == 32
    assert np.array_equal(dst[:32], src[:32])
    with pytest.raises(LLMException):
        execute(np.zeros(1, dtype=[("a", "u8")]), src_bounds=sb, dst_bounds=db)
    assert COPY_OP_DTYPE.itemsize == 24


# --------------------------------------------------------------------- manager

def _manager(device="{\"memory_size\": 262144, \"page_shift\": 12}", host=""):
    events = []
    lc = Lifecycle(Machine.CACHE, events.append)
    opts = {"llm.MemPoolConfig": device, "llm.HostMemPoolConfig": host}
    return MemoryManager.from_options(opts, caches=lc), events


def test_manager_bad_pool_config_is_param_invalid():
    lc = Lifecycle(Machine.CACHE)
    for cfg in ["{", "{\"memory_size\": 0}", "{\"memory_size\": 10, \"page_shift\": 9}"]:
        with pytest.raises(LLMException) as e:
            MemoryManager.from_options({"llm.MemPoolConfig": cfg}, caches=lc)
        assert e.value.status_code == PARAM


def test_manager_pool_on_demand_ids_keys_and_deferred_release():
    mm, events = _manager()
    assert mm.existing_pool(Placement.DEVICE) is None  # created on demand
    desc = CacheDesc(2, [4, 256], DataType.DT_FLOAT16)
    k0, k1 = CacheKey(1, req_id=10), CacheKey(1, req_id=11)
    pad = CacheKey(1, req_id=2**64 - 1)
    rec = mm.allocate_cache(desc, keys=(k0, pad, k1), is_blocks=False)
    assert rec.cache_id == 1 and rec.stride == 512 and rec.rows == 4
    pool = mm.existing_pool(Placement.DEVICE)
    assert pool is not None and pool.statistics().allocations == 2
    assert mm.resolve_key(k0) == (rec, 0) and mm.resolve_key(k1) == (rec, 2)
    assert mm.resolve_key(pad) is None
    with pytest.raises(LLMException) as e:  # duplicate key
        mm.allocate_cache(desc, keys=(k0,), is_blocks=False)
    assert e.value.status_code == PARAM
    with pytest.raises(LLMException):  # more keys than batch slots
        mm.allocate_cache(desc, keys=[CacheKey(1, req_id=i) for i in range(100, 105)], is_blocks=False)
    assert pool.statistics().allocations == 2  # nothing leaked by the refusals
    assert not mm.deallocate_cache(1)  # deferred
    assert rec.state == CacheState.RELEASE_PENDING and pool.statistics().allocations == 2
    assert mm.resolve_key(k0) is not None  # still pullable by key
    assert mm.consume_key(cache_key_index(k0))
    assert not mm.consume_key(cache_key_index(k0))
    assert mm.remove_key(cache_key_index(k1))
    assert rec.state == CacheState.RELEASED and pool.statistics().allocations == 0
    assert mm.get(1) is None and len(mm.regions) == 0
    triggers = [ev.trigger for ev in events]
    assert triggers == ["allocate", "defer_release", "keys_changed", "keys_released"]
    rec2 = mm.allocate_cache(desc, is_blocks=False)
    assert rec2.cache_id == 2  # ids keep increasing
    mm.close()


def test_manager_register_blocks_key_overwrite_and_unregister():
    mm, events = _manager(device="")
    a = np.zeros((3, 64), dtype=np.uint8)
    b = np.zeros((3, 64), dtype=np.uint8)
    desc = CacheDesc(1, [3, 64], DataType.DT_UINT8)
    r1 = mm.register_cache(desc, [a.ctypes.data], blocks_key=BlocksCacheKey(1, 0), remote_accessible=True,
                           is_blocks=True)
    r2 = mm.register_cache(desc, [b.ctypes.data], blocks_key=BlocksCacheKey(7, 0), remote_accessible=True,
                           is_blocks=True)
    assert mm.resolve_key(BlocksCacheKey(99, 0))[0] is r2  # overwritten, cluster id ignored
    with pytest.raises(LLMException) as e:  # overlapping registration
        mm.register_cache(desc, [a.ctypes.data + 10], remote_accessible=False, is_blocks=True)
    assert e.value.status_code == PARAM
    assert mm.unregister_cache(r1.cache_id)
    assert mm.resolve_key(BlocksCacheKey(1, 0))[0] is r2  # r1 no longer owned the mapping
    assert not mm.unregister_cache(12345)
    with pytest.raises(LLMException):
        mm.deallocate_cache(r2.cache_id)  # registered memory is not deallocated
    with pytest.raises(LLMException) as e:
        mm.allocate_cache(desc, is_blocks=False)  # no pool configured
    assert e.value.status_code == PARAM
    mm.close()
    assert r2.state == CacheState.RELEASED
    assert [ev.trigger for ev in events] == ["register", "register", "unregister", "finalize"]


def test_manager_allocation_oom_rolls_back():
    mm, _ = _manager(device="{\"memory_size\": 16384, \"page_shift\": 12}")
    desc = CacheDesc(3, [1, 4096], DataType.DT_UINT8)  # 3 pages of 4
    mm.allocate_cache(desc, is_blocks=False)
    with pytest.raises(LLMException) as e:
        mm.allocate_cache(desc, is_blocks=False)
    assert e.value.status_code == OOM
    st = mm.existing_pool(Placement.DEVICE).statistics()
    assert st.used_pages == 3 and st.allocations == 3
    mm.existing_pool(Placement.DEVICE).check_consistency()
    assert mm.allocate_cache(CacheDesc(1, [1, 4096], DataType.DT_UINT8), is_blocks=False).cache_id == 2


def test_manager_close_releases_everything_and_unlinks():
    before = _shm_entries()
    mm, events = _manager(host="{\"memory_size\": 65536, \"page_shift\": 12}")
    desc_d = CacheDesc(1, [2, 128], DataType.DT_FLOAT)
    desc_h = CacheDesc(1, [2, 128], DataType.DT_FLOAT, Placement.HOST)
    mm.allocate_cache(desc_d, keys=[CacheKey(1, req_id=1)], is_blocks=False)
    mm.allocate_cache(desc_h, is_blocks=False)
    mm.deallocate_cache(1)  # pending
    names = {p.segment.name for p in (mm.existing_pool(Placement.DEVICE), mm.existing_pool(Placement.HOST))}
    assert names <= _shm_entries()
    mm.close()
    mm.close()
    assert _shm_entries() == before
    assert [ev.trigger for ev in events][-2:] == ["finalize", "finalize"]
    with pytest.raises(LLMException) as e:
        mm.allocate_cache(desc_d, is_blocks=False)
    assert e.value.status_code == LLMStatusCode.LLM_ENGINE_FINALIZED
    assert mm.statistics()["closed"] is True


def test_manager_remap_notifies_and_fires():
    mm, events = _manager(device="")
    buf = np.zeros(1024, dtype=np.uint8)
    seen = []
    mm.regions.add_listener(lambda kind, regions, version: seen.append(kind))
    rec = mm.register_cache(CacheDesc(1, [1, 1024], DataType.DT_UINT8), [buf.ctypes.data],
                            remote_accessible=True, is_blocks=False)
    mm.remap([(buf.ctypes.data + 10, 100)])
    assert seen == ["add", "remap"] and rec.state == CacheState.REGISTERED
    assert events[-1].trigger == "remapped"
    with pytest.raises(LLMException):
        mm.remap([(buf.ctypes.data + 1000, 100)])
    mm.close()
