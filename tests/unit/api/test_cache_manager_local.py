"""CacheManager local operations: real bytes, every validation error, bounds before bytes."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from llmdd._api.cache_manager import CacheManager
from llmdd._base.enums import DataType, Memtype, Placement
from llmdd._lifecycle.machines import Lifecycle
from llmdd._lifecycle.tables import Machine
from llmdd._memory.manager import MemoryManager
from llmdd._base.status import LLMException, LLMStatusCode
from llmdd._base.types import BlocksCacheKey, Cache, CacheDesc, CacheKey, MemInfo

PARAM = LLMStatusCode.LLM_PARAM_INVALID
POOL = "{\"memory_size\": 1048576, \"page_shift\": 12}"


@pytest.fixture
def cm():
    opts = {"llm.MemPoolConfig": POOL, "llm.HostMemPoolConfig": POOL}
    mm = MemoryManager.from_options(opts, caches=Lifecycle(Machine.CACHE))
    mgr = CacheManager(mm, opts)
    yield mgr
    mm.close()


@pytest.fixture
def cm_nopool():
    mm = MemoryManager.from_options({}, caches=Lifecycle(Machine.CACHE))
    mgr = CacheManager(mm, {})
    yield mgr
    mm.close()


def view(addr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def fill(cache: Cache, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for a in cache.tensor_addrs:
        v = view(a, cache.cache_desc.size)
        v[:] = rng.integers(0, 256, v.size, dtype=np.uint8)


# ----------------------------------------------------------------- happy paths

def test_flags_from_options():
    mm = MemoryManager.from_options({}, caches=Lifecycle(Machine.CACHE))
    m = CacheManager(mm, {"llm.MemPoolConfig": POOL, "llm.EnableRemoteCacheAccessible": "1",
                          "llm.LocalCommRes": ""})
    assert m._enabled_mem_pool and not m._enable_host_mem_pool and m._enable_remote_cache_accessible
    assert m._enable_local_comm_res and m._initialized and not m._is_call_linked
    m.set_is_call_linked()
    assert m._is_call_linked
    with pytest.raises(LLMException):  # no data plane attached: remote operations refuse
        m.pull_blocks(BlocksCacheKey(1, 0), None, [0], [0])
    mm.close()


def test_register_ids_start_at_one_and_are_shared(cm):
    bufs = [np.zeros((2, 64), np.float32) for _ in range(2)]
    desc = CacheDesc(2, [2, 64], DataType.DT_FLOAT)
    c1 = cm.register_cache(desc, [b.ctypes.data for b in bufs])
    c2 = cm.allocate_cache(CacheDesc(1, [1, 16], DataType.DT_FLOAT))
    assert (c1.cache_id, c2.cache_id) == (1, 2)
    assert not c1.is_blocks_cache and c1.tensor_addrs == [b.ctypes.data for b in bufs]
    rec = cm._memory.get(1)
    assert rec.remote_accessible is True  # DEVICE default
    cm.unregister_cache(1)
    cm.unregister_cache(1)  # unknown id: success
    assert cm._memory.get(1) is None


def test_remote_accessible_defaults(cm):
    a, b, c = (np.zeros(16, np.uint8) for _ in range(3))
    host = cm.register_cache(CacheDesc(1, [1, 16], DataType.DT_UINT8, Placement.HOST), [a.ctypes.data])
    assert cm._memory.get(host.cache_id).remote_accessible is False
    cm.set_is_call_linked()
    dev = cm.register_cache(CacheDesc(1, [1, 16], DataType.DT_UINT8), [b.ctypes.data])
    assert cm._memory.get(dev.cache_id).remote_accessible is False
    with pytest.raises(LLMException) as e:
        cm.register_blocks_cache(CacheDesc(1, [1, 16], DataType.DT_UINT8), [c.ctypes.data], None, True)
    assert e.value.status_code == PARAM


def test_register_blocks_cache_sets_is_blocks(cm):
    buf = np.zeros((4, 32), np.uint8)
    desc = CacheDesc(1, [4, 32], DataType.DT_UINT8)
    cache = cm.register_blocks_cache(desc, [buf.ctypes.data], BlocksCacheKey(5, 3))
    assert desc._is_blocks and cache.is_blocks_cache
    assert cm._memory.resolve_key(BlocksCacheKey(0, 3))[0].cache_id == cache.cache_id


def test_copy_cache_bytes(cm):
    desc = CacheDesc(2, [4, 8, 16], DataType.DT_FLOAT16)  # stride 256 bytes
    src = cm.allocate_cache(desc)
    fill(src, 1)
    dst_bufs = [np.zeros((4, 8, 16), np.float16) for _ in range(2)]
    dst = cm.register_cache(CacheDesc(2, [4, 8, 16], DataType.DT_FLOAT16), [b.ctypes.data for b in dst_bufs])
    cm.copy_cache(dst, src, dst_batch_index=3, src_batch_index=1)
    cm.copy_cache(dst, src, dst_batch_index=0, src_batch_index=2, offset=64, size=32)
    for t in range(2):
        s = view(src.tensor_addrs[t], desc.size)
        d = dst_bufs[t].view(np.uint8).reshape(-1)
        assert np.array_equal(d[3 * 256:4 * 256], s[256:512])
        assert np.array_equal(d[64:96], s[2 * 256 + 64:2 * 256 + 96])
        assert not d[:64].any() and not d[96:3 * 256].any()


def test_copy_blocks_bytes(cm):
    desc = CacheDesc(2, [6, 40], DataType.DT_UINT8)
    cache = cm.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
    assert desc._is_blocks
    fill(cache, 2)
    before = [view(a, 240).copy() for a in cache.tensor_addrs]
    cm.copy_blocks(cache, {0: [3, 4], 5: [1]})
    for t, a in enumerate(cache.tensor_addrs):
        after = view(a, 240)
        ref = before[t].copy()
        ref[120:160] = before[t][0:40]
        ref[160:200] = before[t][0:40]
        ref[40:80] = before[t][200:240]
        assert np.array_equal(after, ref)
    cm.copy_blocks(cache, {})
    cm.deallocate_blocks_cache(cache)
    assert cache.tensor_addrs == [] and cache._valid is False


def test_swap_blocks_roundtrip(cm):
    dev_desc = CacheDesc(2, [8, 64], DataType.DT_FLOAT)  # block 256 bytes
    dev = cm.allocate_blocks_cache(dev_desc)
    fill(dev, 3)
    host_bufs = [np.zeros((4, 64), np.float32) for _ in range(2)]
    cpu = Cache.create_cpu_cache(CacheDesc(2, [4, 64], DataType.DT_FLOAT, Placement.HOST),
                                 [b.ctypes.data for b in host_bufs])
    cm.swap_blocks(dev, cpu, {7: 0, 2: 3})  # swap out
    for t in range(2):
        d = view(dev.tensor_addrs[t], dev_desc.size)
        h = host_bufs[t].view(np.uint8).reshape(-1)
        assert np.array_equal(h[0:256], d[7 * 256:8 * 256]) and np.array_equal(h[768:1024], d[512:768])
        assert not h[256:768].any()
    host_bufs[0][1] = 5.0
    cm.swap_blocks(cpu, dev, {1: 6})  # swap in
    assert np.array_equal(view(dev.tensor_addrs[0], dev_desc.size)[6 * 256:7 * 256],
                          host_bufs[0].view(np.uint8)[1])


def test_deallocate_deferred_by_keys(cm):
    desc = CacheDesc(1, [2, 32], DataType.DT_UINT8)
    k = CacheKey(1, req_id=7)
    cache = cm.allocate_cache(desc, [k])
    pool = cm._memory.existing_pool(Placement.DEVICE)
    cm.deallocate_cache(cache)
    assert cache.tensor_addrs == [] and cache._valid is False
    assert pool.statistics().allocations == 1
    with pytest.raises(LLMException) as e:  # pending release: no more local use
        cm.copy_cache(cache, cache)
    assert e.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    cm.remove_cache_key(CacheKey(1, req_id=999))  # unknown: no-op
    cm.remove_cache_key(k)
    assert pool.statistics().allocations == 0
    cm.deallocate_cache(cache)  # unknown now: success


def test_allocate_keys_padding_and_limits(cm):
    desc = CacheDesc(1, [3, 32], DataType.DT_UINT8)
    pad = CacheKey(1, req_id=2**64 - 1)
    c = cm.allocate_cache(desc, [pad, CacheKey(1, req_id=1), pad])
    assert cm._memory.resolve_key(CacheKey(9, req_id=1)) == (cm._memory.get(c.cache_id), 1)
    with pytest.raises(LLMException) as e:
        cm.allocate_cache(desc, [CacheKey(1, req_id=i) for i in range(10, 14)])
    assert e.value.status_code == PARAM
    with pytest.raises(LLMException) as e:
        cm.allocate_cache(desc, [CacheKey(1, req_id=1)])
    assert e.value.status_code == PARAM


def test_pool_exhaustion_through_facade(cm):
    big = CacheDesc(1, [1, 1 << 20], DataType.DT_UINT8)
    c = cm.allocate_cache(big)
    with pytest.raises(LLMException) as e:
        cm.allocate_cache(CacheDesc(1, [1, 1], DataType.DT_UINT8))
    assert e.value.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY
    cm.deallocate_cache(c)
    cm.allocate_cache(CacheDesc(1, [1, 1], DataType.DT_UINT8))


def test_remap_registered_memory(cm):
    buf = np.zeros(4096, np.uint8)
    cm.register_cache(CacheDesc(1, [1, 4096], DataType.DT_UINT8), [buf.ctypes.data])
    seen = []
    cm._memory.regions.add_listener(lambda kind, regions, version: seen.append(kind))
    cm.remap_registered_memory(MemInfo(Memtype.MEM_TYPE_DEVICE, buf.ctypes.data, 4096))
    cm.remap_registered_memory([MemInfo(Memtype.MEM_TYPE_DEVICE, buf.ctypes.data + 100, 10)])
    assert seen == ["remap", "remap"]


def test_finalized_manager_raises_runtime_error(cm):
    cm._initialized = False
    calls = [
        lambda: cm.register_cache(None, []), lambda: cm.register_blocks_cache(None, []),
        lambda: cm.unregister_cache(1), lambda: cm.allocate_cache(None), lambda: cm.deallocate_cache(None),
        lambda: cm.allocate_blocks_cache(None), lambda: cm.deallocate_blocks_cache(None),
        lambda: cm.remove_cache_key(None), lambda: cm.copy_cache(None, None), lambda: cm.copy_blocks(None, {}),
        lambda: cm.swap_blocks(None, None, {}), lambda: cm.remap_registered_memory([]),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match="llm datadist is not initialized"):
            call()


# ----------------------------------------------------------------- validation table

def _dev(n=1, shape=(4, 16), dt=DataType.DT_UINT8, placement=Placement.DEVICE):
    return CacheDesc(n, list(shape), dt, placement)


def _cases():
    """(name, fn(cm, ctx), expected exception, expected status or None)."""
    T, V, L = TypeError, ValueError, LLMException
    return [
        # register_cache
        ("reg desc type", lambda cm, c: cm.register_cache("x", [1]), T, None),
        ("reg addrs tuple", lambda cm, c: cm.register_cache(_dev(), (c["a"],)), T, None),
        ("reg addrs elem", lambda cm, c: cm.register_cache(_dev(), [1.0]), T, None),
        ("reg addrs numpy int", lambda cm, c: cm.register_cache(_dev(), [np.int64(5)]), T, None),
        ("reg keys type", lambda cm, c: cm.register_cache(_dev(), [c["a"]], [1]), T, None),
        ("reg remote type", lambda cm, c: cm.register_cache(_dev(), [c["a"]], (), 1), T, None),
        ("reg empty addrs", lambda cm, c: cm.register_cache(_dev(), []), L, PARAM),
        ("reg len mismatch", lambda cm, c: cm.register_cache(_dev(2), [c["a"]]), L, PARAM),
        ("reg zero addr", lambda cm, c: cm.register_cache(_dev(), [0]), L, PARAM),
        ("reg negative addr", lambda cm, c: cm.register_cache(_dev(), [-5]), V, None),
        ("reg overlap", lambda cm, c: (cm.register_cache(_dev(), [c["a"]]),
                                       cm.register_cache(_dev(), [c["a"] + 8])), L, PARAM),
        ("reg dup key", lambda cm, c: cm.register_cache(_dev(), [c["a"]], [CacheKey(1, 1), CacheKey(2, 1)]),
         L, PARAM),
        # register_blocks_cache
        ("regb desc type", lambda cm, c: cm.register_blocks_cache(None, [c["a"]]), T, None),
        ("regb addrs tuple", lambda cm, c: cm.register_blocks_cache(_dev(), (c["a"],)), T, None),
        ("regb key type", lambda cm, c: cm.register_blocks_cache(_dev(), [c["a"]], CacheKey(1, 1)), T, None),
        ("regb empty", lambda cm, c: cm.register_blocks_cache(_dev(), []), L, PARAM),
        ("regb num_tensors", lambda cm, c: cm.register_blocks_cache(_dev(2), [c["a"]]), L, PARAM),
        ("regb zero", lambda cm, c: cm.register_blocks_cache(_dev(), [0]), L, PARAM),
        # unregister
        ("unreg type", lambda cm, c: cm.unregister_cache("1"), T, None),
        ("unreg range", lambda cm, c: cm.unregister_cache(2**63), V, None),
        # allocate
        ("alloc desc type", lambda cm, c: cm.allocate_cache(None), T, None),
        ("alloc keys type", lambda cm, c: cm.allocate_cache(_dev(), [BlocksCacheKey(1)]), T, None),
        ("alloc zero tensors", lambda cm, c: cm.allocate_cache(_dev(0)), L, PARAM),
        ("alloc too many keys", lambda cm, c: cm.allocate_cache(
            _dev(), [CacheKey(1, i) for i in range(5)]), L, PARAM),
        ("allocb key type", lambda cm, c: cm.allocate_blocks_cache(_dev(), CacheKey(1, 1)), T, None),
        ("allocb zero tensors", lambda cm, c: cm.allocate_blocks_cache(_dev(0)), L, PARAM),
        # deallocate
        ("dealloc type", lambda cm, c: cm.deallocate_cache(1), T, None),
        ("dealloc blocks", lambda cm, c: cm.deallocate_cache(c["blocks"]), L, PARAM),
        ("deallocb type", lambda cm, c: cm.deallocate_blocks_cache("x"), T, None),
        ("deallocb non-blocks", lambda cm, c: cm.deallocate_blocks_cache(c["slots"]), L, PARAM),
        ("dealloc registered", lambda cm, c: cm.deallocate_cache(c["reg"]), L, PARAM),
        # remove_cache_key
        ("remove key type", lambda cm, c: cm.remove_cache_key(BlocksCacheKey(1)), T, None),
        # copy_cache
        ("copy dst type", lambda cm, c: cm.copy_cache(None, c["slots"]), T, None),
        ("copy src type", lambda cm, c: cm.copy_cache(c["slots"], 1), T, None),
        ("copy dst bi type", lambda cm, c: cm.copy_cache(c["slots"], c["slots"], 1.0), T, None),
        ("copy dst bi range", lambda cm, c: cm.copy_cache(c["slots"], c["slots"], -1), V, None),
        ("copy src bi range", lambda cm, c: cm.copy_cache(c["slots"], c["slots"], 0, 2**32), V, None),
        ("copy offset range", lambda cm, c: cm.copy_cache(c["slots"], c["slots"], 0, 0, -1), V, None),
        ("copy size type", lambda cm, c: cm.copy_cache(c["slots"], c["slots"], 0, 0, 0, "1"), T, None),
        ("copy req_id range", lambda cm, c: cm.copy_cache(c["slots"], c["slots2"], 0, 0, 0, -1, -3), V, None),
        ("copy size 0", lambda cm, c: cm.copy_cache(c["slots"], c["slots"], 0, 0, 0, 0), L, PARAM),
        ("copy size -2", lambda cm, c: cm.copy_cache(c["slots"], c["slots"], 0, 0, 0, -2), L, PARAM),
        ("copy src blocks", lambda cm, c: cm.copy_cache(c["slots"], c["blocks"]), L, PARAM),
        ("copy dst blocks", lambda cm, c: cm.copy_cache(c["blocks"], c["slots"]), L, PARAM),
        ("copy dst batch oob", lambda cm, c: cm.copy_cache(c["slots"], c["slots2"], 4, 0), L, PARAM),
        ("copy src batch oob", lambda cm, c: cm.copy_cache(c["slots"], c["slots2"], 0, 4), L, PARAM),
        ("copy offset oob", lambda cm, c: cm.copy_cache(c["slots"], c["slots2"], 0, 0, 16), L, PARAM),
        ("copy size oob", lambda cm, c: cm.copy_cache(c["slots"], c["slots2"], 0, 0, 8, 9), L, PARAM),
        ("copy dst stride", lambda cm, c: cm.copy_cache(c["small"], c["slots"]), L, PARAM),
        ("copy tensors differ", lambda cm, c: cm.copy_cache(c["slots"], c["two"]), L, PARAM),
        ("copy unknown cache", lambda cm, c: cm.copy_cache(c["slots"], c["ghost"]), L,
         LLMStatusCode.LLM_KV_CACHE_NOT_EXIST),
        # copy_blocks
        ("cb cache type", lambda cm, c: cm.copy_blocks("x", {}), T, None),
        ("cb info type", lambda cm, c: cm.copy_blocks(c["blocks"], [(0, 1)]), T, None),
        ("cb info key type", lambda cm, c: cm.copy_blocks(c["blocks"], {"0": [1]}), T, None),
        ("cb info value type", lambda cm, c: cm.copy_blocks(c["blocks"], {0: 1}), T, None),
        ("cb info elem type", lambda cm, c: cm.copy_blocks(c["blocks"], {0: [1.0]}), T, None),
        ("cb non-blocks", lambda cm, c: cm.copy_blocks(c["slots"], {0: [1]}), L, PARAM),
        ("cb src oob", lambda cm, c: cm.copy_blocks(c["blocks"], {4: [1]}), L, PARAM),
        ("cb dst oob", lambda cm, c: cm.copy_blocks(c["blocks"], {0: [1, 4]}), L, PARAM),
        ("cb negative", lambda cm, c: cm.copy_blocks(c["blocks"], {-1: [1]}), L, PARAM),
        ("cb huge", lambda cm, c: cm.copy_blocks(c["blocks"], {0: [2**70]}), L, PARAM),
        # swap_blocks
        ("swap src type", lambda cm, c: cm.swap_blocks(None, c["cpu"], {}), T, None),
        ("swap dst type", lambda cm, c: cm.swap_blocks(c["blocks"], 3, {}), T, None),
        ("swap map type", lambda cm, c: cm.swap_blocks(c["blocks"], c["cpu"], [(0, 0)]), T, None),
        ("swap map key type", lambda cm, c: cm.swap_blocks(c["blocks"], c["cpu"], {"0": 0}), T, None),
        ("swap map value type", lambda cm, c: cm.swap_blocks(c["blocks"], c["cpu"], {0: "0"}), T, None),
        ("swap src non-blocks", lambda cm, c: cm.swap_blocks(c["slots"], c["cpu"], {0: 0}), L, PARAM),
        ("swap dst non-blocks", lambda cm, c: cm.swap_blocks(c["blocks"], c["slots"], {0: 0}), L, PARAM),
        ("swap block size", lambda cm, c: cm.swap_blocks(c["blocks"], c["cpu_wide"], {0: 0}), L, PARAM),
        ("swap num tensors", lambda cm, c: cm.swap_blocks(c["blocks"], c["cpu2"], {0: 0}), L, PARAM),
        ("swap src idx oob", lambda cm, c: cm.swap_blocks(c["blocks"], c["cpu"], {4: 0}), L, PARAM),
        ("swap dst idx oob", lambda cm, c: cm.swap_blocks(c["blocks"], c["cpu"], {0: 2}), L, PARAM),
        ("swap negative idx", lambda cm, c: cm.swap_blocks(c["blocks"], c["cpu"], {-1: 0}), L, PARAM),
        ("swap d2d", lambda cm, c: cm.swap_blocks(c["blocks"], c["blocks"], {0: 1}), L, PARAM),
        ("swap h2h", lambda cm, c: cm.swap_blocks(c["cpu"], c["cpu"], {0: 1}), L, PARAM),
        ("swap unknown device", lambda cm, c: cm.swap_blocks(c["ghost_blocks"], c["cpu"], {0: 0}), L,
         LLMStatusCode.LLM_KV_CACHE_NOT_EXIST),
        # remap_registered_memory
        ("remap type", lambda cm, c: cm.remap_registered_memory(1), L, PARAM),
        ("remap elem type", lambda cm, c: cm.remap_registered_memory([1]), L, PARAM),
        ("remap host", lambda cm, c: cm.remap_registered_memory(MemInfo(Memtype.MEM_TYPE_HOST, c["a"], 1)),
         L, PARAM),
        ("remap zero addr", lambda cm, c: cm.remap_registered_memory(MemInfo(Memtype.MEM_TYPE_DEVICE, 0, 1)),
         L, PARAM),
        ("remap zero size", lambda cm, c: cm.remap_registered_memory(
            [MemInfo(Memtype.MEM_TYPE_DEVICE, c["a"], 0)]), L, PARAM),
        ("remap unregistered", lambda cm, c: cm.remap_registered_memory(
            MemInfo(Memtype.MEM_TYPE_DEVICE, c["a"], 8)), L, PARAM),
    ]


@pytest.fixture
def ctx(cm):
    keep = []

    def buf(n):
        b = np.zeros(n, np.uint8)
        keep.append(b)
        return b.ctypes.data

    c = {"a": buf(4096), "keep": keep}
    c["slots"] = cm.allocate_cache(_dev(1, (4, 16)))         # stride 16
    c["slots2"] = cm.allocate_cache(_dev(1, (4, 16)))
    c["small"] = cm.allocate_cache(_dev(1, (4, 8)))          # stride 8
    c["two"] = cm.allocate_cache(_dev(2, (4, 16)))
    c["blocks"] = cm.allocate_blocks_cache(_dev(1, (4, 16)))  # 4 blocks of 16
    c["reg"] = cm.register_cache(_dev(1, (1, 16)), [buf(16)])
    c["ghost"] = Cache(999, _dev(1, (4, 16)), [c["a"]])
    c["ghost_blocks"] = Cache(998, _dev(1, (4, 16)), [c["a"]], is_blocks_cache=True)
    c["cpu"] = Cache.create_cpu_cache(_dev(1, (2, 16), placement=Placement.HOST), [buf(32)])
    c["cpu_wide"] = Cache.create_cpu_cache(_dev(1, (2, 32), placement=Placement.HOST), [buf(64)])
    c["cpu2"] = Cache.create_cpu_cache(_dev(2, (2, 16), placement=Placement.HOST), [buf(32), buf(32)])
    return c


@pytest.mark.parametrize("name, fn, exc, status", _cases(), ids=[c[0] for c in _cases()])
def test_validation(cm, ctx, name, fn, exc, status):
    snapshot = {p: cm._memory.existing_pool(p).statistics() for p in (Placement.DEVICE,)}
    regions = len(cm._memory.regions)
    with pytest.raises(exc) as e:
        fn(cm, ctx)
    if status is not None:
        assert e.value.status_code == status
    if name != "reg overlap":
        assert len(cm._memory.regions) == regions
    assert cm._memory.existing_pool(Placement.DEVICE).statistics().allocations == \
        snapshot[Placement.DEVICE].allocations


def test_allocate_without_pool(cm_nopool):
    with pytest.raises(LLMException) as e:
        cm_nopool.allocate_cache(_dev())
    assert e.value.status_code == PARAM
    with pytest.raises(LLMException):
        cm_nopool.allocate_blocks_cache(_dev(placement=Placement.HOST))


def test_forged_cache_object_cannot_cause_wild_copy(cm):
    """Geometry comes from the table: a Cache with a valid id but foreign addresses copies nothing wild."""
    real = cm.allocate_blocks_cache(_dev(1, (4, 16)))
    fill(real, 5)
    victim = np.zeros(64, np.uint8)
    forged = Cache(real.cache_id, real.cache_desc, [victim.ctypes.data], cm, False, True)
    cm.copy_blocks(forged, {0: [1]})
    assert not victim.any()
    v = view(real.tensor_addrs[0], 64)
    assert np.array_equal(v[16:32], v[0:16])
    # a cpu cache whose desc claims more blocks than its memory: the block index check uses its desc
    small = np.zeros(16, np.uint8)
    cpu = Cache.create_cpu_cache(_dev(1, (4, 16), placement=Placement.HOST), [small.ctypes.data])
    cpu._cache_id = 12345  # not -1 and unknown: refused
    with pytest.raises(LLMException) as e:
        cm.swap_blocks(real, cpu, {0: 0})
    assert e.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
