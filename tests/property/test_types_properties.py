"""Property tests for the value types and configs (hypothesis)."""

from __future__ import annotations

import math
import socket
import struct

from hypothesis import assume, given
from hypothesis import strategies as st

from llmdd._base.config import LLMClusterInfo, LLMConfig, parse_mem_pool_cfg, trans_str_ip
from llmdd._base.enums import DTYPE_ITEMSIZE, DataType, Placement
from llmdd._base.status import LLMException, LLMStatusCode
from llmdd._base.types import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    cache_key_index,
)

U64 = 2**64 - 1
u64 = st.integers(0, U64)
sized_dtypes = st.sampled_from(sorted(DTYPE_ITEMSIZE, key=lambda d: d.value))


@st.composite
def cache_descs(draw):
    shape = draw(st.lists(st.integers(0, 2**12), min_size=1, max_size=5))
    as_tuple = draw(st.booleans())
    batch_dim = draw(st.integers(0, len(shape) - 1))
    seq_dim = draw(st.one_of(st.just(-1), st.integers(0, len(shape) - 1)))
    return CacheDesc(draw(st.integers(0, 2**32 - 1)), tuple(shape) if as_tuple else shape, draw(sized_dtypes),
                     draw(st.sampled_from(list(Placement))), batch_dim, seq_dim)


@given(cache_descs())
def test_cache_desc_size_is_prod_shape_times_itemsize(desc):
    assert desc.size == math.prod(desc.shape) * DTYPE_ITEMSIZE[desc.data_type]
    assert desc.batch_size == desc.shape[desc.batch_dim]
    assert desc.size == desc.size  # cached value is stable


@given(cache_descs(), st.data())
def test_cache_desc_update_dim_keeps_size_arithmetic(desc, data):
    assume(isinstance(desc.shape, list))
    index = data.draw(st.integers(0, len(desc.shape) - 1))
    value = data.draw(st.integers(0, 2**12))
    _ = desc.size
    desc.update_dim(index, value)
    assert desc.shape[index] == value
    assert desc.size == math.prod(desc.shape) * DTYPE_ITEMSIZE[desc.data_type]


cache_keys = st.builds(CacheKey, u64, u64, u64, u64)
blocks_keys = st.builds(BlocksCacheKey, st.integers(-(2**70), 2**70), st.integers(-(2**70), 2**70))
by_id_keys = st.builds(CacheKeyByIdAndIndex, u64, st.integers(-(2**63), 2**63 - 1), st.integers(0, 2**32 - 1))
any_key = st.one_of(cache_keys, blocks_keys, by_id_keys)


def _rebuild(key):
    """An equal key built through another spelling of the constructor."""
    if isinstance(key, CacheKey):
        return CacheKey(prompt_cluster_id=key.cluster_id, req_id=key.req_id, model_id=key.model_id,
                        prefix_id=key.prefix_id)
    if isinstance(key, BlocksCacheKey):
        return BlocksCacheKey(prompt_cluster_id=key.cluster_id, model_id=key.model_id)
    return CacheKeyByIdAndIndex(cluster_id=key.cluster_id, cache_id=key.cache_id, batch_index=key.batch_index)


@given(any_key)
def test_key_equal_rebuild_has_equal_hash(key):
    twin = _rebuild(key)
    assert twin == key and not twin != key
    assert hash(twin) == hash(key)
    assert {key: 1}[twin] == 1


@given(any_key, any_key)
def test_key_eq_implies_hash_eq(a, b):
    if a == b:
        assert hash(a) == hash(b)
    assert (a == b) == (b == a)
    if type(a) is not type(b):
        assert a != b


@given(cache_keys)
def test_cache_key_index_rule(key):
    expected_id = key.prefix_id if key.prefix_id != U64 else key.req_id
    assert cache_key_index(key) == (expected_id, key.model_id)


@given(blocks_keys)
def test_blocks_key_index_rule(key):
    assert cache_key_index(key) == (U64, key.model_id)


# ------------------------------------------------------------------------- configs

config_values = st.fixed_dictionaries({}, optional={
    "device_id": st.one_of(st.integers(0, 2**31 - 1), st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=4)),
    "sync_kv_timeout": st.one_of(st.integers(1, 2**31 - 1), st.integers(1, 2**31 - 1).map(str)),
    "deploy_res_path": st.text(max_size=8),
    "listen_ip_info": st.text(max_size=12),
    "enable_cache_manager": st.booleans(),
    "enable_remote_cache_accessible": st.booleans(),
    "enable_switch_role": st.booleans(),
    "link_total_time": st.integers(0, 2**32 - 1),
    "link_retry_count": st.integers(1, 100),
    "rdma_traffic_class": st.integers(0, 2**32 - 1),
    "rdma_service_level": st.integers(0, 2**32 - 1),
    "local_comm_res": st.text(max_size=8),
    "transfer_backend": st.text(max_size=8),
    "global_resource_config": st.text(max_size=8),
    "output_max_size": st.integers(-(2**40), 2**40),
    "mem_utilization": st.floats(0.0, 1.0),
})

_ALWAYS_WHEN_SET = {
    "sync_kv_timeout": "llm.SyncKvCacheWaitTime",
    "link_total_time": "llm.LinkTotalTime",
    "link_retry_count": "llm.LinkRetryCount",
    "rdma_traffic_class": "llm.RdmaTrafficClass",
    "rdma_service_level": "llm.RdmaServiceLevel",
    "local_comm_res": "llm.LocalCommRes",
    "transfer_backend": "llm.TransferBackend",
    "global_resource_config": "llm.GlobalResourceConfig",
    "output_max_size": "llm.OutputMaxSize",
}
_WHEN_TRUTHY = {"deploy_res_path": "llm.deployResPath", "listen_ip_info": "llm.listenIpInfo"}
_BOOLS = {"enable_cache_manager": "llm.EnableCacheManager",
          "enable_remote_cache_accessible": "llm.EnableRemoteCacheAccessible"}


@given(config_values)
def test_config_options_round_trip(values):
    cfg = LLMConfig()
    for name, value in values.items():
        setattr(cfg, name, value)
    opts = cfg.generate_options()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in opts.items())
    for name, value in values.items():
        assert getattr(cfg, name) == value
    expected = {}
    if "device_id" in values:
        dev = values["device_id"]
        ids = [dev] if isinstance(dev, int) else dev
        expected["ge.exec.deviceId"] = ";".join(map(str, ids))
        expected["ge.session_device_id"] = str(ids[0])
    for name, key in _ALWAYS_WHEN_SET.items():
        if name in values:
            expected[key] = str(values[name])
    for name, key in _WHEN_TRUTHY.items():
        if values.get(name):
            expected[key] = values[name]
    for name, key in _BOOLS.items():
        if name in values:
            expected[key] = "1" if values[name] else "0"
    if values.get("enable_switch_role"):
        expected["llm.EnableSwitchRole"] = "1"
    expected["llm.MemoryUtilization"] = str(values.get("mem_utilization", 0.95))
    assert opts == expected
    assert float(opts["llm.MemoryUtilization"]) == values.get("mem_utilization", 0.95)
    if "sync_kv_timeout" in values:
        assert int(opts["llm.SyncKvCacheWaitTime"]) == int(values["sync_kv_timeout"])
    # idempotent and the same object
    assert cfg.generate_options() is opts and opts == expected


@given(st.integers(1, 2**63), st.one_of(st.none(), st.integers(10, 30)))
def test_mem_pool_cfg_parse_round_trip(memory_size, page_shift):
    text = (f'{{"memory_size": {memory_size}}}' if page_shift is None
            else f'{{"memory_size": {memory_size}, "page_shift": {page_shift}}}')
    shift = 16 if page_shift is None else page_shift
    fits = (memory_size >> shift) < 2**32
    try:
        parsed = parse_mem_pool_cfg(text)
    except LLMException as exc:
        assert not fits
        assert exc.status_code is LLMStatusCode.LLM_PARAM_INVALID
    else:
        assert fits and parsed == (memory_size, shift)


ipv4 = st.integers(0, 2**32 - 1).map(lambda n: socket.inet_ntoa(struct.pack("!I", n)))


@given(ipv4, st.integers(0, 2**16 - 1))
def test_cluster_info_ip_round_trip(ip, port):
    info = LLMClusterInfo()
    info.append_local_ip_info(ip, port)
    info.append_remote_ip_info(ip, port)
    for ((as_int, got_port),) in (info.local_ip_info_list, info.remote_ip_info_list):
        assert got_port == port
        assert socket.inet_ntoa(as_int.to_bytes(4, "little")) == ip
        assert trans_str_ip(ip) == as_int


@given(st.integers(0, 2**32 - 1))
def test_int_ip_passes_through(ip_int):
    info = LLMClusterInfo()
    info.append_remote_ip_info(ip_int, 1)
    assert info.remote_ip_info_list == [(ip_int, 1)]
    ip = socket.inet_ntoa(ip_int.to_bytes(4, "little"))
    assert trans_str_ip(ip) == ip_int


@given(st.sampled_from([DataType.DT_STRING]), st.lists(st.integers(1, 8), min_size=1, max_size=3))
def test_string_dtype_has_no_size(dtype, shape):
    desc = CacheDesc(1, shape, dtype)
    try:
        desc.size
    except LLMException:
        pass
    else:
        raise AssertionError("DT_STRING must not have a size")
