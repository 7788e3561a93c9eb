"""Contract tests for the v2 data classes (spec §8)."""

from __future__ import annotations

import threading

import pytest

from llmdd._base.enums import DataType, Memtype, Placement
from llmdd._base.status import LLMException, LLMStatusCode
from llmdd._base.types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    CacheTask,
    KvCache,
    LayerSynchronizer,
    MemInfo,
    TransferConfig,
    TransferWithCacheKeyConfig,
    cache_key_index,
    check_cache_key,
    check_layer_range,
)
from llmdd._base.types.transfer import _AsyncTaskLike

U64 = 2**64 - 1
PARAM_INVALID = LLMStatusCode.LLM_PARAM_INVALID


def _raises(exc, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    if exc is LLMException:
        assert info.value.status_code is PARAM_INVALID
    return info.value


# ----------------------------------------------------------------------- CacheDesc


def test_cache_desc_defaults_and_props():
    shape = [4, 256]
    desc = CacheDesc(80, shape, DataType.DT_FLOAT16)
    assert desc.num_tensors == 80
    assert desc.shape is shape
    assert desc.data_type is DataType.DT_FLOAT16
    assert desc.placement is Placement.DEVICE
    assert desc.batch_dim == 0
    assert desc.batch_size == 4
    assert desc.seq_len_dim_index == -1
    assert desc.kv_tensor_format is None
    assert desc._is_blocks is False
    assert desc.size == 4 * 256 * 2


def test_cache_desc_repr():
    desc = CacheDesc(2, [3, 10], DataType.DT_FLOAT, Placement.HOST, 1, 0, "ND")
    assert repr(desc) == ("CacheDesc(num_tensors=2, shape=[3, 10], data_type=DataType.DT_FLOAT, "
                          "placement=Placement.HOST, batch_dim_index=1, seq_len_dim_index=0,kv_tensor_format=ND)")


@pytest.mark.parametrize("dtype,itemsize", [
    (DataType.DT_FLOAT, 4), (DataType.DT_FLOAT16, 2), (DataType.DT_BF16, 2), (DataType.DT_INT8, 1),
    (DataType.DT_INT16, 2), (DataType.DT_UINT16, 2), (DataType.DT_UINT8, 1), (DataType.DT_INT32, 4),
    (DataType.DT_INT64, 8), (DataType.DT_UINT32, 4), (DataType.DT_UINT64, 8), (DataType.DT_BOOL, 1),
    (DataType.DT_DOUBLE, 8),
])
def test_cache_desc_size_per_dtype(dtype, itemsize):
    assert CacheDesc(3, (2, 3, 5), dtype).size == 30 * itemsize


def test_cache_desc_size_errors():
    _raises(LLMException, lambda: CacheDesc(1, [2, 3], DataType.DT_STRING).size)
    _raises(LLMException, lambda: CacheDesc(1, [2, -1], DataType.DT_FLOAT).size)
    _raises(LLMException, lambda: CacheDesc(1, [2**62, 4], DataType.DT_FLOAT).size)


def test_cache_desc_zero_dim_size():
    assert CacheDesc(1, [0, 3], DataType.DT_FLOAT).size == 0


def test_cache_desc_update_dim_resets_size_and_mutates_caller_shape():
    shape = [4, 8]
    desc = CacheDesc(2, shape, DataType.DT_FLOAT)
    assert desc.size == 128
    desc.update_dim(1, 16)
    assert shape == [4, 16]
    assert desc.size == 256
    desc.update_dim(0, 1)
    assert desc.batch_size == 4  # computed at construction, as upstream
    with pytest.raises(TypeError):
        CacheDesc(1, (4, 8), DataType.DT_FLOAT).update_dim(0, 1)  # a tuple shape cannot be updated
    with pytest.raises(TypeError):
        desc.update_dim(0, "1")


def test_cache_desc_accepts_tuple_and_bool_dims():
    assert CacheDesc(1, (2, True), DataType.DT_INT8).size == 2


CACHE_DESC_BAD = [
    ((-1, [1], DataType.DT_FLOAT), {}, ValueError),
    ((2**32, [1], DataType.DT_FLOAT), {}, ValueError),
    ((1.0, [1], DataType.DT_FLOAT), {}, TypeError),
    ((None, [1], DataType.DT_FLOAT), {}, TypeError),
    ((1, None, DataType.DT_FLOAT), {}, TypeError),
    ((1, "12", DataType.DT_FLOAT), {}, TypeError),
    ((1, [1, 2.0], DataType.DT_FLOAT), {}, TypeError),
    ((1, [1], 0), {}, TypeError),
    ((1, [1], None), {}, TypeError),
    ((1, [1], DataType.DT_FLOAT, 1), {}, TypeError),
    ((1, [1], DataType.DT_FLOAT, None), {}, TypeError),
    ((1, [1], DataType.DT_FLOAT), {"batch_dim_index": 0.0}, TypeError),
    ((1, [1], DataType.DT_FLOAT), {"batch_dim_index": None}, TypeError),
    ((1, [1], DataType.DT_FLOAT), {"seq_len_dim_index": "0"}, TypeError),
    ((1, [1], DataType.DT_FLOAT), {"seq_len_dim_index": 2**31}, ValueError),
    ((1, [1], DataType.DT_FLOAT), {"kv_tensor_format": 1}, TypeError),
    ((1, [1], DataType.DT_FLOAT), {"batch_dim_index": 1}, LLMException),
    ((1, [1], DataType.DT_FLOAT), {"batch_dim_index": -1}, LLMException),
    ((1, [], DataType.DT_FLOAT), {}, LLMException),
    ((1, [1, 2], DataType.DT_FLOAT), {"seq_len_dim_index": 2}, LLMException),
    ((1, [1, 2], DataType.DT_FLOAT), {"seq_len_dim_index": -2}, LLMException),
    ((1, [1, 2**63], DataType.DT_FLOAT), {}, ValueError),
    # order: type checks first, then the index range checks, then the int64 range of the dims
    ((1, [2**63], DataType.DT_FLOAT), {"batch_dim_index": 1}, LLMException),
    ((-1, [1, 2.0], DataType.DT_FLOAT), {}, ValueError),
]


@pytest.mark.parametrize("args,kwargs,exc", CACHE_DESC_BAD)
def test_cache_desc_bad(args, kwargs, exc):
    _raises(exc, CacheDesc, *args, **kwargs)


def test_cache_desc_identity_semantics():
    a = CacheDesc(1, [2], DataType.DT_FLOAT)
    b = CacheDesc(1, [2], DataType.DT_FLOAT)
    assert a == a and a != b
    assert len({a, b}) == 2


# --------------------------------------------------------------------------- Cache


def test_cache_props_and_str():
    desc = CacheDesc(4, [2, 8], DataType.DT_FLOAT16)
    cache = Cache(1, desc, [1, 2, 3, 4])
    assert cache.cache_id == 1
    assert cache.cache_desc is desc
    assert cache.tensor_addrs == [1, 2, 3, 4]
    assert cache.per_device_tensor_addrs == [[1, 2, 3, 4]]
    assert cache.is_blocks_cache is False
    assert cache._valid is True and cache._is_registered is False and cache._cache_manager is None
    assert str(cache) == "Cache(cache_id = 1, device_tensor_addrs = 4, is_blocks_cache = False)"
    assert repr(cache) == str(cache)
    cache._tensor_addrs = []
    cache._valid = False
    assert cache.tensor_addrs == [] and cache.per_device_tensor_addrs == [[]]


def test_cache_positional_ctor():
    manager = object()
    cache = Cache(7, CacheDesc(1, [1], DataType.DT_FLOAT), [5], manager, True, True)
    assert cache._cache_manager is manager and cache._is_registered is True and cache.is_blocks_cache is True
    assert str(cache) == "Cache(cache_id = 7, device_tensor_addrs = 1, is_blocks_cache = True)"


@pytest.mark.parametrize("cache_id,exc", [("1", TypeError), (1.0, TypeError), (None, TypeError),
                                          (2**63, ValueError), (-(2**63) - 1, ValueError)])
def test_cache_bad_id(cache_id, exc):
    _raises(exc, Cache, cache_id, CacheDesc(1, [1], DataType.DT_FLOAT), [1])


def test_create_cpu_cache():
    desc = CacheDesc(2, [4, 8], DataType.DT_FLOAT, Placement.HOST)
    cache = Cache.create_cpu_cache(desc, [10, 20])
    assert cache.cache_id == -1 and cache.is_blocks_cache is True and cache.tensor_addrs == [10, 20]
    assert cache._cache_manager is None and cache._is_registered is False


@pytest.mark.parametrize("desc,addrs,exc", [
    (None, [1], TypeError),
    ("desc", [1], TypeError),
    (CacheDesc(1, [1], DataType.DT_FLOAT, Placement.HOST), (1,), TypeError),
    (CacheDesc(1, [1], DataType.DT_FLOAT, Placement.HOST), None, TypeError),
    (CacheDesc(1, [1], DataType.DT_FLOAT, Placement.HOST), [1.0], TypeError),
    (CacheDesc(1, [1], DataType.DT_FLOAT, Placement.DEVICE), [1], LLMException),
    (CacheDesc(2, [1], DataType.DT_FLOAT, Placement.HOST), [1], LLMException),
])
def test_create_cpu_cache_bad(desc, addrs, exc):
    _raises(exc, Cache.create_cpu_cache, desc, addrs)


# ------------------------------------------------------------------------- KvCache


class _Manager:
    def __init__(self, initialized=True, fail=False):
        self.initialized = initialized
        self.fail = fail
        self.deallocated = []

    def is_initialized(self):
        return self.initialized

    def deallocate_cache(self, cache):
        if self.fail:
            raise LLMException("boom", status_code=LLMStatusCode.LLM_FAILED)
        self.deallocated.append(cache.cache_id)
        cache._valid = False


def test_kv_cache_props_and_str():
    desc = CacheDesc(2, [1], DataType.DT_FLOAT)
    kv = KvCache(3, desc, [[1, 2], [3, 4]], None)
    assert kv.cache_id == 3 and kv.cache_desc is desc and kv.per_device_tensor_addrs == [[1, 2], [3, 4]]
    assert str(kv) == "KvCache(cache_id = 3, num_devices = 2)"


def test_kv_cache_auto_deallocates_on_del():
    manager = _Manager()
    kv = KvCache(5, CacheDesc(1, [1], DataType.DT_FLOAT), [[1]], manager)
    del kv
    assert manager.deallocated == [5]
    manager = _Manager(initialized=False)
    kv = KvCache(6, CacheDesc(1, [1], DataType.DT_FLOAT), [[1]], manager)
    del kv
    assert manager.deallocated == []
    manager = _Manager(fail=True)
    kv = KvCache(7, CacheDesc(1, [1], DataType.DT_FLOAT), [[1]], manager)
    del kv  # errors are swallowed


def test_kv_cache_bad_id():
    _raises(TypeError, KvCache, "1", CacheDesc(1, [1], DataType.DT_FLOAT), [[1]], None)


def test_kv_cache_create_cpu_cache():
    desc = CacheDesc(2, [1], DataType.DT_FLOAT, Placement.HOST)
    assert KvCache.create_cpu_cache(desc, [1, 2]).per_device_tensor_addrs == [[1, 2]]
    kv = KvCache.create_cpu_cache(desc, [[1, 2], [3, 4]])
    assert kv.cache_id == -1 and kv.per_device_tensor_addrs == [[1, 2], [3, 4]]


@pytest.mark.parametrize("placement,addrs,exc", [
    (Placement.DEVICE, [1, 2], LLMException),
    (Placement.HOST, (1, 2), TypeError),
    (Placement.HOST, [], LLMException),
    (Placement.HOST, [1], LLMException),
    (Placement.HOST, [[1]], LLMException),
    (Placement.HOST, [1, [1, 2]], LLMException),
    (Placement.HOST, [[1, 2], 1], LLMException),
    (Placement.HOST, [1.0, 2], TypeError),
    (Placement.HOST, [[1, 2.0]], TypeError),
])
def test_kv_cache_create_cpu_cache_bad(placement, addrs, exc):
    _raises(exc, KvCache.create_cpu_cache, CacheDesc(2, [1], DataType.DT_FLOAT, placement), addrs)


# ------------------------------------------------------------------------ CacheKey


@pytest.mark.parametrize("args,kwargs,expected", [
    ((1, 2), {}, (1, 2, 0, U64)),
    ((1, 2, 3), {}, (1, 2, 3, U64)),
    ((1, 2, 3, 4), {}, (1, 2, 3, 4)),
    ((), {"prompt_cluster_id": 1, "req_id": 0, "model_id": 0}, (1, 0, 0, U64)),
    ((), {"cluster_id": 1, "req_id": 5, "prefix_id": 9}, (1, 5, 0, 9)),
    ((1,), {"req_id": 2, "model_id": 3}, (1, 2, 3, U64)),
    ((), {"cluster_id": U64, "req_id": U64, "model_id": U64, "prefix_id": 0}, (U64, U64, U64, 0)),
    ((1, 2), {"cluster_id": 7}, (1, 2, 0, U64)),  # positional overrides the same-named keyword, as upstream
    ((), {"cluster_id": 1, "prompt_cluster_id": 2, "req_id": 3}, (1, 3, 0, U64)),  # cluster_id wins
])
def test_cache_key_parsing(args, kwargs, expected):
    key = CacheKey(*args, **kwargs)
    assert (key.cluster_id, key.req_id, key.model_id, key.prefix_id) == expected
    assert key.prompt_cluster_id == key.cluster_id


CACHE_KEY_BAD = [
    ((1, 2, 3, 4, 5), {}, LLMException, "Param num is over limit"),
    ((1, 2, 3, 4), {"model_id": 1}, LLMException, "Param num is over limit"),
    ((), {"req_id": 1}, LLMException, "Param prompt_cluster_id or cluster_id is required"),
    ((), {}, LLMException, "Param prompt_cluster_id or cluster_id is required"),
    ((1,), {}, LLMException, "Param req_id is required"),
    ((), {"cluster_id": 1, "model_id": 2}, LLMException, "Param req_id is required"),
    ((1, 2), {"foo": 1}, LLMException, "Unsupported param:foo"),
    ((), {"foo": 1}, LLMException, "Param prompt_cluster_id or cluster_id is required"),
    ((-1, 0), {}, ValueError, "cluster_id's value is out of range"),
    ((2**64, 0), {}, ValueError, "cluster_id's value is out of range"),
    ((1, -1), {}, ValueError, "req_id's value is out of range"),
    ((1, 1, 2**64), {}, ValueError, "model_id's value is out of range"),
    ((1, 1, 0, -1), {}, ValueError, "prefix_id's value is out of range"),
    (("1", 0), {}, TypeError, "cluster_id only support"),
    ((1, 0.0), {}, TypeError, "req_id only support"),
    ((1, None), {}, TypeError, "req_id only support"),
    ((1, 0, "0"), {}, TypeError, "model_id only support"),
    ((1, 0, 0, 1.0), {}, TypeError, "prefix_id only support"),
    ((), {"prompt_cluster_id": None, "req_id": 0}, TypeError, "cluster_id only support"),
]


@pytest.mark.parametrize("args,kwargs,exc,msg", CACHE_KEY_BAD)
def test_cache_key_bad(args, kwargs, exc, msg):
    err = _raises(exc, CacheKey, *args, **kwargs)
    assert str(err).startswith(msg)


def test_cache_key_repr():
    assert repr(CacheKey(prompt_cluster_id=1, req_id=2, model_id=3)) == \
        f"CacheKey(cluster_id=1, req_id=2, prefix_id={U64}, model_id=3)"


def test_cache_key_eq_hash():
    assert CacheKey(1, 2) == CacheKey(prompt_cluster_id=1, req_id=2, model_id=0, prefix_id=U64)
    assert hash(CacheKey(1, 2)) == hash(CacheKey(cluster_id=1, req_id=2))
    assert CacheKey(1, 2) != CacheKey(1, 3)
    assert CacheKey(1, 2) != CacheKey(2, 2)
    assert CacheKey(1, 2, 1) != CacheKey(1, 2, 0)
    assert CacheKey(1, 2, 0, 5) != CacheKey(1, 2, 0)
    assert CacheKey(1, 0) != BlocksCacheKey(1, 0)
    assert CacheKey(1, 0) != (1, 0, 0, U64)
    assert {CacheKey(1, 2): "a"}[CacheKey(1, 2)] == "a"


def test_cache_key_has_no_setters():
    key = CacheKey(1, 2)
    for name in ("cluster_id", "prompt_cluster_id", "req_id", "model_id", "prefix_id"):
        with pytest.raises(AttributeError):
            setattr(key, name, 3)


# --------------------------------------------------------------- CacheKeyByIdAndIndex


def test_cache_key_by_id():
    key = CacheKeyByIdAndIndex(cluster_id=0, cache_id=1, batch_index=0)
    assert (key.cluster_id, key.cache_id, key.batch_index) == (0, 1, 0)
    assert CacheKeyByIdAndIndex(1, -1).batch_index == 0
    assert key.req_id == U64
    assert repr(CacheKeyByIdAndIndex(1, 2, 3)) == "CacheKeyByIdAndIndex(cluster_id=1, cache_id=2, batch_index=3)"
    assert CacheKeyByIdAndIndex(1, 2, 3) == CacheKeyByIdAndIndex(1, 2, 3)
    assert hash(CacheKeyByIdAndIndex(1, 2, 3)) == hash(CacheKeyByIdAndIndex(1, 2, 3))
    assert CacheKeyByIdAndIndex(1, 2, 3) != CacheKeyByIdAndIndex(1, 2, 4)
    assert CacheKeyByIdAndIndex(1, 2, 0) != CacheKey(1, 2)


@pytest.mark.parametrize("args,exc", [
    ((-1, 1), ValueError), ((2**64, 1), ValueError), (("1", 1), TypeError),
    ((1, 2**63), ValueError), ((1, "1"), TypeError), ((1, None), TypeError),
    ((1, 1, -1), ValueError), ((1, 1, 2**32), ValueError), ((1, 1, 1.0), TypeError),
])
def test_cache_key_by_id_bad(args, exc):
    _raises(exc, CacheKeyByIdAndIndex, *args)


# -------------------------------------------------------------------- BlocksCacheKey


@pytest.mark.parametrize("args,kwargs,expected,text", [
    ((1,), {}, (1, 0), "BlocksCacheKey(cluster_id=1, model_id=0)"),
    ((1, 2), {}, (1, 2), "BlocksCacheKey(cluster_id=1, model_id=2)"),
    ((), {"prompt_cluster_id": 5}, (5, 0), "BlocksCacheKey(prompt_cluster_id=5, model_id=0)"),
    ((), {"prompt_cluster_id": 5, "model_id": 1}, (5, 1), "BlocksCacheKey(prompt_cluster_id=5, model_id=1)"),
    ((), {"cluster_id": 6, "model_id": 1}, (6, 1), "BlocksCacheKey(cluster_id=6, model_id=1)"),
    ((1,), {"model_id": 3}, (1, 3), "BlocksCacheKey(cluster_id=1, model_id=3)"),
    ((2**70, -5), {}, (2**70, -5), f"BlocksCacheKey(cluster_id={2**70}, model_id=-5)"),  # no range check
])
def test_blocks_cache_key(args, kwargs, expected, text):
    key = BlocksCacheKey(*args, **kwargs)
    assert (key.cluster_id, key.model_id) == expected
    assert key.prompt_cluster_id == key.cluster_id
    assert repr(key) == text


@pytest.mark.parametrize("args,kwargs,exc,msg", [
    ((1, 2, 3), {}, LLMException, "Param num is over limit"),
    ((1, 2), {"model_id": 1}, LLMException, "Param num is over limit"),
    ((), {}, LLMException, "Param prompt_cluster_id or cluster_id is required"),
    ((), {"model_id": 1}, LLMException, "Param prompt_cluster_id or cluster_id is required"),
    ((1,), {"foo": 1}, LLMException, "Unsupported param:foo"),
    # upstream's extra_fmt prefixes the message
    (("1",), {}, TypeError, "The first param cluster_id only support ['int'], but got <class 'str'>."),
    ((None,), {}, TypeError, "The first param cluster_id only support"),
    ((1, 1.0), {}, TypeError, "The second param model_id only support ['int'], but got <class 'float'>."),
    ((), {"prompt_cluster_id": 1.0}, TypeError, "The first param cluster_id only support"),
])
def test_blocks_cache_key_bad(args, kwargs, exc, msg):
    err = _raises(exc, BlocksCacheKey, *args, **kwargs)
    assert str(err).startswith(msg)


def test_blocks_cache_key_eq_hash_ignore_kw_name():
    a, b = BlocksCacheKey(cluster_id=1, model_id=2), BlocksCacheKey(prompt_cluster_id=1, model_id=2)
    assert a == b and hash(a) == hash(b)
    assert BlocksCacheKey(1, 2) != BlocksCacheKey(1, 3)
    assert BlocksCacheKey(1) != BlocksCacheKey(2)
    assert len({a, b, BlocksCacheKey(1, 2)}) == 1


# ------------------------------------------------------------ key index / check_cache_key


@pytest.mark.parametrize("key,index", [
    (CacheKey(1, 5), (5, 0)),
    (CacheKey(1, 5, 2), (5, 2)),
    (CacheKey(1, U64, 2, 7), (7, 2)),
    (CacheKey(1, 5, 2, 7), (7, 2)),
    (CacheKey(9, U64), (U64, 0)),
    (BlocksCacheKey(1, 3), (U64, 3)),
    (BlocksCacheKey(prompt_cluster_id=99), (U64, 0)),
])
def test_cache_key_index(key, index):
    assert cache_key_index(key) == index


def test_cache_key_index_ignores_cluster_id():
    assert cache_key_index(CacheKey(1, 5)) == cache_key_index(CacheKey(2, 5))
    assert cache_key_index(BlocksCacheKey(1, 0)) == cache_key_index(BlocksCacheKey(2, 0))


def test_cache_key_index_rejects_other_types():
    with pytest.raises(TypeError):
        cache_key_index(CacheKeyByIdAndIndex(1, 1))


@pytest.mark.parametrize("key,ok", [
    (CacheKey(1, 0), True),
    (CacheKey(1, U64 - 1), True),
    (CacheKey(1, U64, 0, 3), True),
    (CacheKey(1, U64), False),
    (CacheKey(1, 3, 0, 4), False),
    (CacheKey(1, U64, 0, U64), False),
])
def test_check_cache_key(key, ok):
    if ok:
        check_cache_key(key)
    else:
        _raises(LLMException, check_cache_key, key)


# ------------------------------------------------------------------------- MemInfo


def test_mem_info():
    info = MemInfo(Memtype.MEM_TYPE_DEVICE, 4096, 1024)
    assert (info.mem_type, info.addr, info.size) == (Memtype.MEM_TYPE_DEVICE, 4096, 1024)
    assert str(info) == "MemInfo(mem_type=Memtype.MEM_TYPE_DEVICE, addr=4096, size=1024)"
    assert repr(info) == str(info)
    assert info == MemInfo(Memtype.MEM_TYPE_DEVICE, 4096, 1024)
    assert hash(info) == hash(MemInfo(Memtype.MEM_TYPE_DEVICE, 4096, 1024))
    assert info != MemInfo(Memtype.MEM_TYPE_HOST, 4096, 1024)


@pytest.mark.parametrize("args", [
    (0, 1, 1), (None, 1, 1), (Memtype.MEM_TYPE_HOST, "1", 1), (Memtype.MEM_TYPE_HOST, None, 1),
    (Memtype.MEM_TYPE_HOST, 1, 1.0),
])
def test_mem_info_bad(args):
    _raises(TypeError, MemInfo, *args)


# ---------------------------------------------------------------- LayerSynchronizer


def test_layer_synchronizer_is_abstract():
    with pytest.raises(TypeError):
        LayerSynchronizer()  # type: ignore[abstract]

    class Impl(LayerSynchronizer):
        def synchronize_layer(self, layer_index, timeout_in_millis):
            return layer_index >= 0

    assert Impl().synchronize_layer(0, None) is True


# ------------------------------------------------------------------- layer ranges


@pytest.mark.parametrize("value,allow_none,exc", [
    (None, True, None),
    (range(0, 1), True, None),
    (range(3, 10), False, None),
    (None, False, TypeError),
    ([0, 1], True, TypeError),
    (range(0, 4, 2), True, LLMException),
    (range(2, 2), True, LLMException),
    (range(3, 1), True, LLMException),
    (range(-1, 2), True, LLMException),
])
def test_check_layer_range(value, allow_none, exc):
    if exc is None:
        check_layer_range("r", value, allow_none)
    else:
        _raises(exc, check_layer_range, "r", value, allow_none)


# -------------------------------------------------------------------- TransferConfig


def test_transfer_config_defaults_and_setters():
    cfg = TransferConfig(1, [10, 20])
    assert (cfg.dst_cluster_id, cfg.dst_addrs, cfg.src_layer_range, cfg.src_batch_index) == (1, [10, 20], None, 0)
    assert cfg.dst_layer_range is None
    assert repr(cfg) == "TransferConfig(dst_cluster_id=1, dst_addrs=[10, 20], src_layer_range=None, src_batch_index=0)"
    cfg.dst_cluster_id = 2
    cfg.dst_addrs = (1, 2, 3, 4)
    cfg.src_layer_range = range(0, 2)
    cfg.src_batch_index = 3
    cfg.dst_layer_range = range(1, 3)
    assert (cfg.dst_cluster_id, cfg.dst_addrs, cfg.src_layer_range, cfg.src_batch_index) == \
        (2, (1, 2, 3, 4), range(0, 2), 3)
    cfg.src_layer_range = None
    assert cfg.src_layer_range is None


TRANSFER_BAD = [
    ((-1, [1]), {}, ValueError),
    (("1", [1]), {}, TypeError),
    ((None, [1]), {}, TypeError),
    ((1, None), {}, TypeError),
    ((1, 5), {}, TypeError),
    ((1, [1.0]), {}, TypeError),
    ((1, [-1]), {}, ValueError),
    ((1, [2**64]), {}, ValueError),
    ((1, [1]), {"src_layer_range": (0, 1)}, TypeError),
    ((1, [1]), {"src_layer_range": range(0, 4, 2)}, LLMException),
    ((1, [1]), {"src_layer_range": range(1, 1)}, LLMException),
    ((1, [1]), {"src_batch_index": -1}, ValueError),
    ((1, [1]), {"src_batch_index": None}, TypeError),
]


@pytest.mark.parametrize("args,kwargs,exc", TRANSFER_BAD)
def test_transfer_config_bad(args, kwargs, exc):
    _raises(exc, TransferConfig, *args, **kwargs)


@pytest.mark.parametrize("name,value,exc", [
    ("dst_cluster_id", -1, ValueError), ("dst_addrs", None, TypeError), ("dst_addrs", [-1], ValueError),
    ("src_layer_range", range(0, 3, 3), LLMException), ("src_batch_index", 2**32, ValueError),
])
def test_transfer_config_bad_setter(name, value, exc):
    cfg = TransferConfig(1, [1, 2], range(0, 1))
    before = getattr(cfg, name)
    _raises(exc, setattr, cfg, name, value)
    assert getattr(cfg, name) == before


# --------------------------------------------------------- TransferWithCacheKeyConfig


def test_transfer_with_key_config():
    key = BlocksCacheKey(7, 0)
    cfg = TransferWithCacheKeyConfig(key, range(0, 1), range(0, 1))
    assert cfg.cache_key is key and cfg.dst_cluster_id == 7 and cfg.src_batch_index == 0
    assert (cfg.src_layer_range, cfg.dst_layer_range) == (range(0, 1), range(0, 1))
    assert repr(cfg) == ("TransferWithCacheKeyConfig(cache_key=BlocksCacheKey(cluster_id=7, model_id=0),"
                         " src_layer_range=range(0, 1), dst_layer_range=range(0, 1), src_batch_index=0)")
    by_id = CacheKeyByIdAndIndex(9, 1, 2)
    cfg2 = TransferWithCacheKeyConfig(by_id, range(2, 4), range(0, 2), 3)
    assert cfg2.src_batch_index == 3 and cfg2.dst_cluster_id == 9
    cfg2.cache_key = BlocksCacheKey(4)
    assert cfg2.dst_cluster_id == 4
    with pytest.raises(LLMException):
        cfg2.src_batch_index = 1  # blocks key now
    cfg2.src_batch_index = 0
    cfg2.src_layer_range = range(5, 6)
    cfg2.dst_layer_range = range(6, 7)
    assert (cfg2.src_layer_range, cfg2.dst_layer_range) == (range(5, 6), range(6, 7))


TWK_BAD = [
    ((None, range(0, 1), range(0, 1)), {}, TypeError),
    ((CacheKey(1, 1), range(0, 1), range(0, 1)), {}, TypeError),
    ((BlocksCacheKey(1),), {}, TypeError),
    ((BlocksCacheKey(1), range(0, 1)), {}, TypeError),
    ((BlocksCacheKey(1), None, range(0, 1)), {}, TypeError),
    ((BlocksCacheKey(1), range(0, 2), range(0, 1)), {}, LLMException),
    ((BlocksCacheKey(1), range(1, 3), range(0, 1)), {}, LLMException),
    ((BlocksCacheKey(1), range(0, 1, 2), range(0, 1)), {}, LLMException),
    ((BlocksCacheKey(1), range(0, 1), range(0, 1)), {"src_batch_index": 1}, LLMException),
    ((CacheKeyByIdAndIndex(1, 1), range(0, 1), range(0, 1)), {"src_batch_index": -1}, ValueError),
    ((CacheKeyByIdAndIndex(1, 1), range(0, 1), range(0, 1)), {"src_batch_index": 1.0}, TypeError),
]


@pytest.mark.parametrize("args,kwargs,exc", TWK_BAD)
def test_transfer_with_key_config_bad(args, kwargs, exc):
    _raises(exc, TransferWithCacheKeyConfig, *args, **kwargs)


def test_transfer_with_key_config_equal_length_different_starts():
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, 1), range(3, 5), range(0, 2))
    assert len(cfg.src_layer_range) == len(cfg.dst_layer_range)


@pytest.mark.parametrize("name,value,exc", [
    ("cache_key", None, TypeError), ("cache_key", CacheKey(1, 1), TypeError),
    ("src_layer_range", None, TypeError), ("dst_layer_range", range(2, 1), LLMException),
    ("src_batch_index", -1, ValueError),
])
def test_transfer_with_key_config_bad_setter(name, value, exc):
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, 1), range(0, 1), range(0, 1))
    _raises(exc, setattr, cfg, name, value)


# ------------------------------------------------------------------------ CacheTask


class _FakeTask:
    def __init__(self, results, finished=True):
        self._results = results
        self.finished = threading.Event()
        if finished:
            self.finished.set()
        self.waits = []

    def wait(self, timeout_s):
        self.waits.append(timeout_s)
        return self.finished.wait(timeout_s)

    def results(self):
        return list(self._results)


S, F, T = LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_LINK_FAILED, LLMStatusCode.LLM_TIMEOUT


def test_fake_task_matches_protocol():
    assert isinstance(_FakeTask([]), _AsyncTaskLike)


@pytest.mark.parametrize("results,expected", [
    ([], S),
    ([S, S], S),
    ([S, None], S),
    ([None, None], S),
    ([S, F, PARAM_INVALID], F),
    ([None, PARAM_INVALID, F], PARAM_INVALID),
])
def test_cache_task_synchronize(results, expected):
    task = CacheTask(_FakeTask(results))
    assert task.synchronize() is expected
    assert task.synchronize(1000) is expected
    assert task.get_results() == results


def test_cache_task_timeouts_convert_ms_to_seconds():
    fake = _FakeTask([S])
    task = CacheTask(fake)
    task.synchronize(1500)
    task.get_results(0)
    task.synchronize()
    assert fake.waits == [1.5, 0.0, None]


def test_cache_task_not_finished():
    fake = _FakeTask([None, S, None], finished=False)
    task = CacheTask(fake)
    assert task.synchronize(0) is T
    assert task.get_results(1) == [T, T, T]
    fake._results = [S, F, None]
    fake.finished.set()
    assert task.synchronize(0) is F
    assert task.get_results(0) == [S, F, None]


def test_cache_task_completes_from_another_thread():
    fake = _FakeTask([S], finished=False)
    timer = threading.Timer(0.05, fake.finished.set)
    timer.start()
    try:
        assert CacheTask(fake).synchronize() is S
    finally:
        timer.cancel()


@pytest.mark.parametrize("timeout,exc", [(-1, ValueError), (2**32, ValueError), (1.5, TypeError), ("1", TypeError)])
@pytest.mark.parametrize("method", ["synchronize", "get_results"])
def test_cache_task_bad_timeout(method, timeout, exc):
    _raises(exc, getattr(CacheTask(_FakeTask([S])), method), timeout)
