"""Legacy v1 mode in one process: mode selection and options, the v1/v2 refusals, KvCacheManager's
local calls (allocation bound, keys and deferred free, copies, swaps, tensors), Tensor/TensorDesc."""

from __future__ import annotations

import ctypes
import gc
import json
from typing import Iterator

import numpy as np
import pytest

import llmdd
from llmdd import (BlocksCacheKey, CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType, KvCache, LayerSynchronizer,
                   LLMClusterInfo, LLMConfig, LLMDataDist, LLMException, LLMRole, LLMStatusCode, Placement,
                   TransferConfig, TransferWithCacheKeyConfig)
from llmdd._api.v1 import KvCacheManager, Tensor, TensorDesc
from llmdd._api.v1.options import DEFAULT_FLOW_GRAPH_MEM_MAX_SIZE, V1_PAGE_SHIFT

S = LLMStatusCode
PARAM = S.LLM_PARAM_INVALID
MiB = 1 << 20
PAGE = 1 << V1_PAGE_SHIFT

pytestmark = pytest.mark.timeout(60)


def _finalize_live() -> None:
    live = LLMDataDist.llm_engine_instance
    if live is not None:
        live.finalize()
    LLMDataDist.llm_engine_instance = None


@pytest.fixture(autouse=True)
def _one_engine_per_test() -> Iterator[None]:
    _finalize_live()
    yield
    _finalize_live()


def v1_options(role: LLMRole = LLMRole.PROMPT, mem: int | None = 4 * MiB, **extra) -> dict:
    """The raw options of vllm-ascend's v0 connector (prepare_data_dist), plus a memory size."""
    opts = {"llm.SyncKvCacheWaitTime": "2000", "ge.exec.deviceId": "0"}
    if role == LLMRole.PROMPT:
        opts["llm.listenIpInfo"] = "127.0.0.1:0"
    if mem is not None:
        opts["ge.flowGraphMemMaxSize"] = str(mem)
    opts.update(extra)
    return opts


def v1_engine(role: LLMRole = LLMRole.PROMPT, cluster_id: int = 1, **kw) -> LLMDataDist:
    dd = LLMDataDist(role, cluster_id)
    dd.init(v1_options(role, **kw))
    return dd


def view(addr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def fill(cache: KvCache, rng: np.random.Generator) -> list:
    """Seeded random bytes into every tensor of an allocated cache; returns copies."""
    size = cache.cache_desc.size
    out = []
    for addr in cache.per_device_tensor_addrs[0]:
        data = rng.integers(0, 256, size, dtype=np.uint8)
        view(addr, size)[:] = data
        out.append(data)
    return out


def memory(dd: LLMDataDist) -> dict:
    return dd.statistics()["memory"]


def device_pool(dd: LLMDataDist) -> dict:
    return memory(dd)["pools"]["DEVICE"]


# ---------------------------------------------------------------------------- mode selection and options
@pytest.mark.parametrize("role", [LLMRole.PROMPT, LLMRole.DECODER])
def test_init_without_cache_manager_selects_v1(role):
    dd = v1_engine(role)
    assert isinstance(dd.kv_cache_manager, KvCacheManager)
    assert dd.kv_cache_manager.is_initialized()
    with pytest.raises(LLMException) as info:
        dd.cache_manager
    assert info.value.status_code is PARAM
    assert str(info.value) == "cache_manager is not supported when llm.EnableCacheManager is not configured."


def test_llmconfig_generated_v1_options_select_v1():
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.listen_ip_info = "127.0.0.1:0"
    cfg.mem_utilization = 0.5
    cfg.ge_options = {"ge.flowGraphMemMaxSize": str(2 * MiB)}
    dd = LLMDataDist(LLMRole.PROMPT, 3)
    dd.init(cfg.generate_options())
    assert dd.statistics()["listen"][0] == "127.0.0.1"
    km = dd.kv_cache_manager
    km.allocate_cache(CacheDesc(1, [1, PAGE], DataType.DT_UINT8))
    assert device_pool(dd)["total_bytes"] == MiB  # 2 MiB x 0.5


def test_enable_cache_manager_0_is_v1_and_1_is_v2():
    dd = LLMDataDist(LLMRole.DECODER, 2)
    dd.init(v1_options(LLMRole.DECODER, **{"llm.EnableCacheManager": "0"}))
    assert isinstance(dd.kv_cache_manager, KvCacheManager)
    dd.finalize()
    dd.init({"llm.EnableCacheManager": "1"})
    assert dd.cache_manager is not None
    with pytest.raises(LLMException) as info:
        dd.kv_cache_manager
    assert info.value.status_code is PARAM
    assert str(info.value) == "kv_cache_manager is not supported when llm.EnableCacheManager is configured."


def test_v1_cluster_info_is_generated_as_upstream():
    dd = v1_engine(LLMRole.PROMPT, cluster_id=42)
    info = json.loads(dd._engine_options["llm.ClusterInfo"])
    assert info["cluster_id"] == 42 and info["logic_device_id"] == ["0:0:0:0"]
    assert info["listen_ip_info"] == [{"ip": int.from_bytes(bytes([127, 0, 0, 1]), "little"), "port": 0}]
    dd.finalize()
    dd = v1_engine(LLMRole.DECODER, cluster_id=43)
    assert "listen_ip_info" not in json.loads(dd._engine_options["llm.ClusterInfo"])


def test_v1_decoder_does_not_listen_even_with_listen_ip_info():
    dd = LLMDataDist(LLMRole.DECODER, 2)
    dd.init(v1_options(LLMRole.DECODER, **{"llm.listenIpInfo": "127.0.0.1:0"}))
    assert dd.statistics()["listen"] is None


@pytest.mark.parametrize("role, given, exc, status, needle", [
    (LLMRole.PROMPT, {}, LLMException, PARAM, "ge.exec.deviceId"),
    (LLMRole.DECODER, {"llm.MemoryUtilization": "0.95"}, LLMException, PARAM, "ge.exec.deviceId"),
    (LLMRole.PROMPT, {"ge.exec.deviceId": "0"}, LLMException, PARAM, "llm.listenIpInfo"),
    (LLMRole.PROMPT, {"ge.exec.deviceId": "x"}, LLMException, PARAM, "ge.exec.deviceId is invalid"),
    (LLMRole.PROMPT, {"ge.exec.deviceId": "0", "llm.listenIpInfo": "127.0.0.1"}, LLMException, PARAM, "ip:port"),
    (LLMRole.PROMPT, {"ge.exec.deviceId": "0", "llm.listenIpInfo": "1.2.3.4:1:2"}, LLMException, PARAM, "ip:port"),
    (LLMRole.PROMPT, {"ge.exec.deviceId": "0;1", "llm.listenIpInfo": "127.0.0.1:0"}, LLMException, PARAM,
     "not equal to device num"),
    (LLMRole.PROMPT, {"ge.exec.deviceId": "0;1", "llm.listenIpInfo": "127.0.0.1:0;127.0.0.1:0"}, LLMException,
     S.LLM_FEATURE_NOT_ENABLED, "one device per engine"),
    (LLMRole.DECODER, {"ge.exec.deviceId": "0", "llm.MemoryUtilization": "1.5"}, LLMException, PARAM, "[0,1]"),
    (LLMRole.DECODER, {"ge.exec.deviceId": "0", "llm.MemoryUtilization": "much"}, LLMException, PARAM, "[0, 1]"),
    (LLMRole.DECODER, {"ge.exec.deviceId": "0", "ge.flowGraphMemMaxSize": "1,2"}, LLMException, PARAM,
     "flowGraphMemMaxSize"),
    (LLMRole.DECODER, {"ge.exec.deviceId": "0", "ge.flowGraphMemMaxSize": 5}, TypeError, None, "flowGraphMemMaxSize"),
    (LLMRole.DECODER, {"ge.exec.deviceId": 0}, TypeError, None, "ge.exec.deviceId"),
    (LLMRole.DECODER, {"ge.exec.deviceId": "0", "llmdd.chip_profile": "ascend_950"}, LLMException, PARAM,
     "not supported on Ascend 950"),
])
def test_v1_init_refuses_bad_options(role, given, exc, status, needle):
    dd = LLMDataDist(role, 1)
    with pytest.raises(exc) as info:
        dd.init(given)
    if status is not None:
        assert info.value.status_code is status
    assert needle in str(info.value)
    assert LLMDataDist.llm_engine_instance is None


def test_v1_refuses_comm_group_calls_and_v2_refuses_check_link_status():
    dd = v1_engine(LLMRole.DECODER)
    for name, call in [("link", lambda: dd.link("c", {1: 0, 2: 1}, "{}")), ("unlink", lambda: dd.unlink(1)),
                       ("query_register_mem_status", lambda: dd.query_register_mem_status(1))]:
        with pytest.raises(LLMException) as info:
            call()
        assert info.value.status_code is PARAM
        assert str(info.value) == f"{name} is not supported when llm.EnableCacheManager is not configured."
    dd.finalize()
    dd.init({"llm.EnableCacheManager": "1"})
    with pytest.raises(LLMException) as info:
        dd.check_link_status(1)
    assert info.value.status_code is PARAM
    assert "check_link_status is not supported when llm.EnableCacheManager is configured." == str(info.value)


def test_v1_calls_before_init_and_after_finalize():
    dd = LLMDataDist(LLMRole.DECODER, 2)
    with pytest.raises(RuntimeError, match="not initialized"):
        dd.kv_cache_manager
    with pytest.raises(RuntimeError, match="not initialized"):
        dd.check_link_status(1)
    dd.init(v1_options(LLMRole.DECODER))
    km = dd.kv_cache_manager
    dd.finalize()
    assert km.is_initialized() is False
    with pytest.raises(LLMException, match="not initialized") as info:  # as v2's CacheManager
        km.allocate_cache(CacheDesc(1, [1, 8], DataType.DT_UINT8))
    assert info.value.status_code is S.LLM_ENGINE_FINALIZED
    with pytest.raises(RuntimeError, match="not initialized"):
        dd.kv_cache_manager
    dd.init(v1_options(LLMRole.DECODER))  # a new engine makes a new manager; the old one stays dead
    assert dd.kv_cache_manager is not km and dd.kv_cache_manager.is_initialized()
    with pytest.raises(LLMException) as info:
        km.pull_cache(CacheKeyByIdAndIndex(1, 1), KvCache(1, CacheDesc(1, [1, 8], DataType.DT_UINT8), [[1]]))
    assert info.value.status_code is S.LLM_ENGINE_FINALIZED


# ---------------------------------------------------------------------------- memory bound
def test_default_pool_is_documented_size_times_utilization():
    dd = v1_engine(LLMRole.DECODER, mem=None)
    km = dd.kv_cache_manager
    km.allocate_cache(CacheDesc(1, [1, 16], DataType.DT_UINT8))
    expected = int(DEFAULT_FLOW_GRAPH_MEM_MAX_SIZE * 0.95)
    assert device_pool(dd)["total_bytes"] == -(-expected // PAGE) * PAGE


def test_allocation_beyond_the_pool_is_device_out_of_memory_and_leaves_nothing():
    """Upstream v1 answers an exhausted pool with LLM_DEVICE_OUT_OF_MEMORY (the UDF's code 14:
    hicann/ge ``llm_flow_service.cc:613``, ``llm_datadist_v1.h:55``, ``llm_datadist_v1/status.py:83``);
    LLM_OUT_OF_MEMORY is cache-manager mode's."""
    dd = v1_engine(LLMRole.PROMPT, mem=1 * MiB, **{"llm.MemoryUtilization": "0.5"})
    km = dd.kv_cache_manager
    half = 512 * 1024
    first = km.allocate_cache(CacheDesc(2, [1, half // 4], DataType.DT_UINT8))  # 2 x 128 KiB
    assert first.cache_id == 1
    with pytest.raises(LLMException) as info:
        km.allocate_cache(CacheDesc(3, [1, half // 4], DataType.DT_UINT8), [CacheKey(1, 5)])
    assert info.value.status_code is S.LLM_DEVICE_OUT_OF_MEMORY
    stats = device_pool(dd)
    assert stats["used_bytes"] == 2 * (half // 4) and stats["allocations"] == 2
    assert memory(dd)["cache_keys"] == 0
    # the id of the failed call is not consumed, the key can be used
    second = km.allocate_cache(CacheDesc(2, [1, half // 4], DataType.DT_UINT8), [CacheKey(1, 5)])
    assert second.cache_id == 2
    with pytest.raises(LLMException) as info:
        km.allocate_blocks_cache(CacheDesc(1, [2, PAGE], DataType.DT_UINT8))
    assert info.value.status_code is S.LLM_DEVICE_OUT_OF_MEMORY
    km.deallocate_cache(first)
    third = km.allocate_blocks_cache(CacheDesc(1, [2, PAGE], DataType.DT_UINT8))
    assert third.cache_id == 3


def test_zero_utilization_refuses_every_allocation():
    dd = v1_engine(LLMRole.DECODER, **{"llm.MemoryUtilization": "0.0"})
    with pytest.raises(LLMException) as info:
        dd.kv_cache_manager.allocate_cache(CacheDesc(1, [1, 1], DataType.DT_UINT8))
    assert info.value.status_code is S.LLM_DEVICE_OUT_OF_MEMORY


def test_many_small_allocations_are_bounded_too():
    dd = v1_engine(LLMRole.DECODER, mem=64 * PAGE, **{"llm.MemoryUtilization": "1.0"})
    km = dd.kv_cache_manager
    caches = [km.allocate_cache(CacheDesc(1, [1, 1], DataType.DT_UINT8)) for _ in range(64)]
    with pytest.raises(LLMException) as info:
        km.allocate_cache(CacheDesc(1, [1, 1], DataType.DT_UINT8))
    assert info.value.status_code is S.LLM_DEVICE_OUT_OF_MEMORY
    assert [c.cache_id for c in caches] == list(range(1, 65))


# ---------------------------------------------------------------------------- allocation rules and keys
def test_cache_ids_start_at_one_and_addresses_are_per_device():
    dd = v1_engine()
    km = dd.kv_cache_manager
    desc = CacheDesc(2, [1, 7, 4, 8], DataType.DT_FLOAT16, seq_len_dim_index=1)
    caches = [km.allocate_cache(desc, [CacheKey(1, 0, m)]) for m in (1, 2, 3, 4)]
    assert [c.cache_id for c in caches] == [1, 2, 3, 4]
    for c in caches:
        assert len(c.per_device_tensor_addrs) == 1 and len(c.per_device_tensor_addrs[0]) == 2
        assert str(c) == f"KvCache(cache_id = {c.cache_id}, num_devices = 1)"


@pytest.mark.parametrize("call, exc, status, needle", [
    (lambda km: km.allocate_cache(None), TypeError, None, "cache_desc"),
    (lambda km: km.allocate_cache(CacheDesc(1, [1, 4], DataType.DT_UINT8), CacheKey(1, 1)), TypeError, None,
     "cache_keys"),
    (lambda km: km.allocate_cache(CacheDesc(1, [1, 4], DataType.DT_UINT8), [1]), TypeError, None, "cache_keys"),
    (lambda km: km.allocate_cache(CacheDesc(0, [1, 4], DataType.DT_UINT8)), LLMException, PARAM, "num_tensors"),
    (lambda km: km.allocate_cache(CacheDesc(1, [1, 4], DataType.DT_UINT8, Placement.HOST)), LLMException, PARAM,
     "Only support allocate device cache"),
    (lambda km: km.allocate_cache(CacheDesc(1, [1, 0], DataType.DT_UINT8)), LLMException, PARAM, "every dim"),
    (lambda km: km.allocate_cache(CacheDesc(1, [1] * 32, DataType.DT_UINT8)), LLMException, PARAM, "dim_num"),
    (lambda km: km.allocate_cache(CacheDesc(1, [2, 4], DataType.DT_UINT8), [CacheKey(1, 1)] * 0 +
                                  [CacheKey(1, 1), CacheKey(1, 2), CacheKey(1, 3)]), LLMException, PARAM,
     "bigger than batch size"),
    (lambda km: km.allocate_blocks_cache(CacheDesc(1, [2, 4], DataType.DT_UINT8), CacheKey(1, 1)), TypeError, None,
     "blocks_cache_key"),
    (lambda km: km.deallocate_cache(None), TypeError, None, "cache"),
    (lambda km: km.deallocate_cache(KvCache.create_cpu_cache(CacheDesc(1, [1, 4], DataType.DT_UINT8,
                                                                        Placement.HOST), [4096])),
     LLMException, PARAM, "Only support device cache"),
])
def test_allocation_argument_errors(call, exc, status, needle):
    km = v1_engine().kv_cache_manager
    with pytest.raises(exc) as info:
        call(km)
    if status is not None:
        assert info.value.status_code is status
    assert needle in str(info.value)


def test_duplicate_key_in_one_call_last_wins_and_bound_key_is_refused():
    dd = v1_engine()
    km = dd.kv_cache_manager
    key = CacheKey(1, 9, 1)
    km.allocate_cache(CacheDesc(1, [3, 4], DataType.DT_UINT8), [key, CacheKey(1, 8), key])
    rec_hit = dd._core.memory.resolve_key(key)
    assert rec_hit is not None and rec_hit[1] == 2  # the last occurrence names batch slot 2
    assert memory(dd)["cache_keys"] == 2
    with pytest.raises(LLMException) as info:
        km.allocate_cache(CacheDesc(1, [1, 4], DataType.DT_UINT8), [key])
    assert info.value.status_code is PARAM and "already exists" in str(info.value)


def test_padding_keys_hold_their_slots():
    dd = v1_engine()
    km = dd.kv_cache_manager
    padding = CacheKey(prompt_cluster_id=0, req_id=2**64 - 1, model_id=0)
    key = CacheKey(prompt_cluster_id=0, req_id=3, model_id=0)
    km.allocate_cache(CacheDesc(1, [4, 16], DataType.DT_UINT8), [padding, padding, padding, key])
    assert memory(dd)["cache_keys"] == 1
    assert dd._core.memory.resolve_key(key)[1] == 3  # upstream's example: only the last slot is valid
    prefix = CacheKey(0, 2**64 - 1, 0, 7)  # a prefix key (req_id invalid, prefix_id valid)
    km.allocate_cache(CacheDesc(1, [1, 16], DataType.DT_UINT8), [prefix])
    assert memory(dd)["cache_keys"] == 2


def test_decoder_role_rules_for_keys():
    km = v1_engine(LLMRole.DECODER).kv_cache_manager
    with pytest.raises(LLMException) as info:
        km.allocate_cache(CacheDesc(1, [1, 4], DataType.DT_UINT8), [CacheKey(1, 1)])
    assert info.value.status_code is PARAM and str(info.value) == "cache_keys is not supported by DECODER"
    with pytest.raises(LLMException) as info:
        km.allocate_blocks_cache(CacheDesc(1, [2, 4], DataType.DT_UINT8), BlocksCacheKey(1, 0))
    assert info.value.status_code is PARAM and "blocks_cache_key is not supported by DECODER" in str(info.value)
    with pytest.raises(LLMException) as info:
        km.remove_cache_key(CacheKey(1, 1))
    assert info.value.status_code is PARAM and "[remove_cache_key] is not supported by" in str(info.value)
    km.allocate_cache(CacheDesc(1, [1, 4], DataType.DT_UINT8))  # no keys: fine
    km.allocate_blocks_cache(CacheDesc(1, [2, 4], DataType.DT_UINT8))


class _Sync(LayerSynchronizer):
    def synchronize_layer(self, layer_index, timeout_in_millis):
        return True


def test_prompt_role_rules_for_pulls_and_decoder_rule_for_transfer():
    dd = v1_engine(LLMRole.PROMPT)
    km = dd.kv_cache_manager
    cache = km.allocate_cache(CacheDesc(2, [1, 4], DataType.DT_UINT8))
    blocks = km.allocate_blocks_cache(CacheDesc(2, [2, 4], DataType.DT_UINT8))
    for call, fn in [(lambda: km.pull_cache(CacheKey(2, 1), cache), "[pull_cache]"),
                     (lambda: km.pull_blocks(BlocksCacheKey(2, 0), blocks, [0], [1]), "[pull_blocks]")]:
        with pytest.raises(LLMException) as info:
            call()
        assert info.value.status_code is PARAM
        assert str(info.value) == f"{fn} is not supported by {LLMRole.PROMPT}"
    with pytest.raises(LLMException) as info:
        dd.check_link_status(2)
    assert info.value.status_code is PARAM and "not supported by" in str(info.value)
    peer = LLMClusterInfo()
    peer.remote_cluster_id = 2
    peer.append_remote_ip_info("127.0.0.1", 1)
    assert dd.link_clusters([peer], 1000) == (PARAM, [])  # only a DECODER links (status, not an exception)
    dd.finalize()
    dd = v1_engine(LLMRole.DECODER, cluster_id=2)
    km = dd.kv_cache_manager
    cache = km.allocate_cache(CacheDesc(2, [1, 4], DataType.DT_UINT8))
    with pytest.raises(LLMException) as info:
        km.transfer_cache_async(cache, _Sync(), [TransferConfig(1, [1, 2])])
    assert info.value.status_code is PARAM
    assert str(info.value) == f"[transfer_cache_async] is not supported by {LLMRole.DECODER}"


def test_transfer_cache_async_takes_transfer_configs_only_and_no_cache_to_blocks():
    """As upstream's v1 path (no remote-cache mode there): a TransferWithCacheKeyConfig is TypeError,
    a cache source with dst_block_indices (even empty) and a blocks source without destination
    blocks are LLM_PARAM_INVALID; all before anything starts."""
    km = v1_engine(LLMRole.PROMPT).kv_cache_manager
    cache = km.allocate_cache(CacheDesc(2, [2, 4], DataType.DT_UINT8))
    blocks = km.allocate_blocks_cache(CacheDesc(2, [4, 4], DataType.DT_UINT8))
    raw = TransferConfig(2, [1, 2])
    by_key = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(2, 1, 0), range(0, 1), range(0, 1))
    cases = [
        (lambda: km.transfer_cache_async(cache, _Sync(), [by_key]), TypeError, "transfer_configs"),
        (lambda: km.transfer_cache_async(cache, _Sync(), (raw, by_key)), TypeError, "transfer_configs"),
        (lambda: km.transfer_cache_async(cache, _Sync(), [raw], None, [0], 4), LLMException,
         "transfer from cache to blocks is not supported"),
        (lambda: km.transfer_cache_async(cache, _Sync(), [raw], [], []), LLMException,
         "transfer from cache to blocks is not supported"),
        (lambda: km.transfer_cache_async(blocks, _Sync(), [raw], [0, 1], None), LLMException,
         "transfer from blocks to cache is not supported"),
        (lambda: km.transfer_cache_async(blocks, _Sync(), [raw], [0, 1], [2]), LLMException,
         "num_block_indices mismatches, src_num = 2, dst_num = 1"),
        (lambda: km.transfer_cache_async(cache, _Sync(), [raw], None, None, 4), LLMException,
         "dst_block_memory_size (4) is neither None nor 0 while dst is not blocks"),
        (lambda: km.transfer_cache_async(cache, _Sync(), [raw], (0, -1), None), ValueError, "src_block_indices"),
        (lambda: km.transfer_cache_async(cache, None, [raw]), TypeError, "layer_synchronizer"),
    ]
    for i, (call, exc, needle) in enumerate(cases):
        with pytest.raises(exc) as info:
            call()
        assert needle in str(info.value), (i, str(info.value))
        if exc is LLMException:
            assert info.value.status_code is PARAM, (i, info.value)
    assert raw.src_layer_range is None   # refused before the configs were completed


def test_deferred_free_until_the_last_key_is_removed():
    dd = v1_engine()
    km = dd.kv_cache_manager
    keys = [CacheKey(1, 10), CacheKey(1, 11)]
    cache = km.allocate_cache(CacheDesc(1, [2, 64], DataType.DT_UINT8), keys)
    used = device_pool(dd)["used_bytes"]
    km.deallocate_cache(cache)  # right after allocate: keys still hold the memory
    assert cache.per_device_tensor_addrs == []
    assert memory(dd)["caches"] == {"release_pending": 1}
    assert device_pool(dd)["used_bytes"] == used
    km.deallocate_cache(cache)  # again: a no-op
    km.remove_cache_key(keys[0])
    assert memory(dd)["caches"] == {"release_pending": 1}
    km.remove_cache_key(CacheKey(1, 99))  # unknown key: no-op
    km.remove_cache_key(keys[1])
    assert memory(dd)["caches"] == {}
    assert device_pool(dd)["used_bytes"] == 0


def test_kv_cache_is_deallocated_when_garbage_collected():
    dd = v1_engine()
    km = dd.kv_cache_manager
    km.allocate_cache(CacheDesc(1, [1, 64], DataType.DT_UINT8))
    gc.collect()
    assert memory(dd)["caches"] == {}
    assert device_pool(dd)["used_bytes"] == 0


# ---------------------------------------------------------------------------- local copies
def test_copy_cache_copies_one_slot_range_of_every_tensor():
    rng = np.random.default_rng(11)
    km = v1_engine(LLMRole.DECODER).kv_cache_manager
    src = km.allocate_cache(CacheDesc(2, [2, 256], DataType.DT_UINT8))
    dst = km.allocate_cache(CacheDesc(2, [3, 256], DataType.DT_UINT8))
    src_data = fill(src, rng)
    dst_data = fill(dst, rng)
    km.copy_cache(dst, src, dst_batch_index=2, src_batch_index=1, offset=16, size=100, req_id=5)
    for t in range(2):
        got = view(dst.per_device_tensor_addrs[0][t], 3 * 256)
        want = dst_data[t].copy()
        want[2 * 256 + 16:2 * 256 + 116] = src_data[t][256 + 16:256 + 116]
        assert np.array_equal(got, want)
    control = dst_data[0].copy()
    assert not np.array_equal(view(dst.per_device_tensor_addrs[0][0], 3 * 256), control)  # it did change
    with pytest.raises(LLMException) as info:
        km.copy_cache(dst, src, src_batch_index=2)
    assert info.value.status_code is PARAM
    with pytest.raises(LLMException) as info:
        km.copy_cache(dst, src, size=0)
    assert info.value.status_code is PARAM
    with pytest.raises(ValueError):
        km.copy_cache(dst, src, dst_batch_index=-1)
    with pytest.raises(TypeError):
        km.copy_cache(dst, src, req_id="x")


def test_copy_blocks_and_its_errors():
    rng = np.random.default_rng(12)
    km = v1_engine(LLMRole.DECODER).kv_cache_manager
    cache = km.allocate_blocks_cache(CacheDesc(2, [4, 128], DataType.DT_UINT8))
    data = fill(cache, rng)
    km.copy_blocks(cache, {0: [2, 3]})
    for t in range(2):
        got = view(cache.per_device_tensor_addrs[0][t], 4 * 128).reshape(4, 128)
        want = data[t].reshape(4, 128).copy()
        want[2] = want[0]
        want[3] = want[0]
        assert np.array_equal(got, want)
    with pytest.raises(LLMException) as info:
        km.copy_blocks(cache, {0: [4]})
    assert info.value.status_code is PARAM
    with pytest.raises(ValueError):
        km.copy_blocks(cache, {-1: [1]})
    with pytest.raises(TypeError):
        km.copy_blocks(cache, {0: 1})
    plain = km.allocate_cache(CacheDesc(1, [2, 8], DataType.DT_UINT8))
    with pytest.raises(LLMException) as info:
        km.copy_blocks(plain, {0: [1]})
    assert info.value.status_code is PARAM and "blocks cache" in str(info.value)


def test_swap_blocks_in_and_out_with_a_cpu_cache():
    rng = np.random.default_rng(13)
    km = v1_engine(LLMRole.DECODER).kv_cache_manager
    npu = km.allocate_blocks_cache(CacheDesc(2, [4, 64], DataType.DT_UINT8))
    npu_data = fill(npu, rng)
    host = [rng.integers(0, 256, 4 * 64, dtype=np.uint8) for _ in range(2)]
    host_orig = [h.copy() for h in host]
    cpu = KvCache.create_cpu_cache(CacheDesc(2, [4, 64], DataType.DT_UINT8, Placement.HOST),
                                   [int(h.ctypes.data) for h in host])
    km.swap_blocks(cpu, npu, {1: 2, 3: 0})  # swap in
    for t in range(2):
        got = view(npu.per_device_tensor_addrs[0][t], 256).reshape(4, 64)
        want = npu_data[t].reshape(4, 64).copy()
        want[2], want[0] = host_orig[t].reshape(4, 64)[1], host_orig[t].reshape(4, 64)[3]
        assert np.array_equal(got, want)
    km.swap_blocks(npu, cpu, {2: 0})  # swap out
    for t in range(2):
        assert np.array_equal(host[t].reshape(4, 64)[0], host_orig[t].reshape(4, 64)[1])
    with pytest.raises(LLMException) as info:
        km.swap_blocks(npu, npu, {0: 1})
    assert info.value.status_code is PARAM and "not support" in str(info.value)
    with pytest.raises(LLMException) as info:
        km.swap_blocks(cpu, npu, {0: 4})
    assert info.value.status_code is PARAM


def test_get_cache_tensors_is_a_host_copy_in_the_cache_dtype_and_shape():
    rng = np.random.default_rng(14)
    km = v1_engine(LLMRole.DECODER).kv_cache_manager
    desc = CacheDesc(3, [2, 5, 4], DataType.DT_FLOAT16)
    cache = km.allocate_cache(desc)
    data = fill(cache, rng)
    tensors = km.get_cache_tensors(cache, 2)
    assert len(tensors) == 1
    t = tensors[0]
    assert t.tensor_desc.dtype is DataType.DT_FLOAT16 and t.tensor_desc.shape == [2, 5, 4]
    arr = t.numpy()
    assert arr.dtype == np.float16 and arr.shape == (2, 5, 4)
    assert arr.tobytes() == data[2].tobytes()
    view(cache.per_device_tensor_addrs[0][2], 1)[0] ^= 0xFF  # the tensor is a snapshot
    assert t.numpy().tobytes() == data[2].tobytes()
    for bad, exc in [(3, LLMException), (-1, LLMException), (2**31, ValueError), ("0", TypeError)]:
        with pytest.raises(exc):
            km.get_cache_tensors(cache, bad)
    km.deallocate_cache(cache)
    with pytest.raises(LLMException) as info:
        km.get_cache_tensors(cache, 0)
    assert info.value.status_code is S.LLM_KV_CACHE_NOT_EXIST


def test_pull_argument_errors_on_a_decoder():
    km = v1_engine(LLMRole.DECODER).kv_cache_manager
    cache = km.allocate_cache(CacheDesc(2, [2, 8], DataType.DT_UINT8))
    blocks = km.allocate_blocks_cache(CacheDesc(2, [4, 8], DataType.DT_UINT8))
    key = CacheKeyByIdAndIndex(1, 1)
    cases = [
        (lambda: km.pull_cache(None, cache), TypeError, None),
        (lambda: km.pull_cache(BlocksCacheKey(1, 0), cache), TypeError, None),
        (lambda: km.pull_cache(key, None), TypeError, None),
        (lambda: km.pull_cache(key, cache, -1), ValueError, None),
        (lambda: km.pull_cache(key, cache, 2), LLMException, PARAM),
        (lambda: km.pull_cache(key, cache, 0, 0), LLMException, PARAM),
        (lambda: km.pull_cache(key, cache, 0, 2**63), ValueError, None),
        (lambda: km.pull_cache(key, cache, tensor_num_per_layer=0), LLMException, PARAM),
        (lambda: km.pull_cache(key, cache, src_layer_range=[0]), TypeError, None),
        (lambda: km.pull_cache(key, cache, bogus=1), LLMException, PARAM),
        (lambda: km.pull_cache(key, cache, src_cache_offset=-1), ValueError, None),   # upstream: ValueError
        (lambda: km.pull_cache(key, cache, dst_cache_offset=-5), ValueError, None),
        (lambda: km.pull_cache(key, cache, dst_cache_offset="8"), TypeError, None),
        (lambda: km.pull_cache(key, blocks), LLMException, PARAM),
        (lambda: km.pull_cache(CacheKey(1, req_id=2**64 - 1), cache), LLMException, PARAM),
        (lambda: km.pull_cache(key, cache), LLMException, S.LLM_NOT_YET_LINK),
        (lambda: km.pull_blocks(CacheKey(1, 1), blocks, [0], [0]), TypeError, None),
        (lambda: km.pull_blocks(BlocksCacheKey(1), blocks, (0,), [0]), TypeError, None),
        (lambda: km.pull_blocks(BlocksCacheKey(1), blocks, [], []), LLMException, PARAM),
        (lambda: km.pull_blocks(BlocksCacheKey(1), blocks, [0, 1], [0]), LLMException, PARAM),
        (lambda: km.pull_blocks(BlocksCacheKey(1), blocks, [-1], [0]), ValueError, None),
        (lambda: km.pull_blocks(BlocksCacheKey(1), cache, [0], [0]), LLMException, PARAM),
        (lambda: km.pull_blocks(BlocksCacheKey(1), blocks, [0], [0], src_cache_offset=0), LLMException, PARAM),
        (lambda: km.pull_blocks(BlocksCacheKey(1), blocks, [0], [0]), LLMException, S.LLM_NOT_YET_LINK),
    ]
    for i, (call, exc, status) in enumerate(cases):
        with pytest.raises(exc) as info:
            call()
        if status is not None:
            assert info.value.status_code is status, (i, info.value)


# ---------------------------------------------------------------------------- Tensor / TensorDesc
def test_tensor_desc():
    desc = TensorDesc(DataType.DT_INT32, (2, 3))
    assert desc.dtype is DataType.DT_INT32 and desc.shape == [2, 3]
    assert str(desc) == "TensorDesc(dtype=DataType.DT_INT32, shape=[2, 3])"
    with pytest.raises(TypeError):
        TensorDesc(1, [2])
    with pytest.raises(TypeError):
        TensorDesc(DataType.DT_INT32, [2.0])


def test_tensor_from_numpy_copies_and_checks():
    rng = np.random.default_rng(15)
    data = rng.standard_normal((3, 4)).astype(np.float32)
    t = Tensor(data)
    assert t.tensor_desc.dtype is DataType.DT_FLOAT and t.tensor_desc.shape == [3, 4]
    data[0, 0] += 1.0  # the tensor owns a copy
    assert t.numpy()[0, 0] == data[0, 0] - 1.0
    view_a = t.numpy(copy=False)
    assert np.shares_memory(view_a, t.numpy())
    copy_a = t.numpy(copy=True)
    assert not np.shares_memory(copy_a, t.numpy())
    assert np.array_equal(Tensor(t).numpy(), t.numpy())
    assert np.array_equal(Tensor(data, TensorDesc(DataType.DT_FLOAT, [3, 4])).numpy(), data)
    with pytest.raises(RuntimeError, match="shape"):
        Tensor(data, TensorDesc(DataType.DT_FLOAT, [4, 3]))
    with pytest.raises(RuntimeError, match="dtype"):
        Tensor(data, TensorDesc(DataType.DT_INT32, [3, 4]))
    with pytest.raises(RuntimeError, match="c_contiguous"):
        Tensor(np.asfortranarray(rng.standard_normal((3, 4)).astype(np.float32)))
    with pytest.raises(RuntimeError, match="not valid"):
        Tensor(np.zeros(2, dtype=np.complex64))
    with pytest.raises(TypeError):
        Tensor([1, 2])
    with pytest.raises(TypeError):
        Tensor(data, "desc")
    with pytest.raises(LLMException) as info:
        Tensor(5)
    assert info.value.status_code is PARAM
    with pytest.raises(TypeError):
        t.numpy(copy=1)


def test_tensor_string_and_bf16_reads():
    s = Tensor(np.array([["ab", "c"], ["d", "ef"]]))
    assert s.tensor_desc.dtype is DataType.DT_STRING
    with pytest.raises(RuntimeError, match="copy is True"):
        s.numpy()
    assert s.numpy(copy=True).tolist() == [["ab", "c"], ["d", "ef"]]
    raw = np.array([0x3F80, 0xC000], dtype=np.uint16)  # bf16 1.0, -2.0
    bf = Tensor._from_buffer(raw.view(np.uint8).copy(), TensorDesc(DataType.DT_BF16, [2]))
    assert bf.numpy().dtype == np.float32 and bf.numpy().tolist() == [1.0, -2.0]
    assert "tensor_desc=TensorDesc(dtype=DataType.DT_BF16" in str(bf)


def test_public_names_are_the_v1_classes():
    assert llmdd.KvCacheManager is KvCacheManager
    assert llmdd.Tensor is Tensor and llmdd.TensorDesc is TensorDesc
    assert {"TensorDesc", "Tensor", "KvCacheManager"} <= set(llmdd.__all__)


def test_tensor_from_tensor_tuple_checks_desc_then_refuses_the_native_handle():
    with pytest.raises(LLMException) as info:
        Tensor.from_tensor_tuple((123, DataType.DT_INT32.value, [2, 3]))
    assert info.value.status_code is PARAM and "native" in str(info.value)
    with pytest.raises(ValueError):
        Tensor.from_tensor_tuple((123, 987654, [2]))  # not a dtype of the wrapper
    with pytest.raises(LLMException):
        Tensor.from_tensor_tuple((1, 2))


# ---------------------------------------------------------------------------- the remaining v1 names
def test_check_cache_key_is_static_and_needs_exactly_one_id():
    KvCacheManager.check_cache_key(CacheKey(1, 5))
    KvCacheManager.check_cache_key(CacheKey(1, 2**64 - 1, 0, 9))
    for bad in (CacheKey(1, 2**64 - 1), CacheKey(1, 5, 0, 9)):
        with pytest.raises(LLMException) as info:
            KvCacheManager.check_cache_key(bad)
        assert info.value.status_code is PARAM


def test_create_cpu_cache_flat_and_per_device_addresses():
    desc = CacheDesc(2, [4, 8], DataType.DT_UINT8, Placement.HOST)
    flat = KvCache.create_cpu_cache(desc, [4096, 8192])
    assert flat.cache_id == -1 and flat.per_device_tensor_addrs == [[4096, 8192]] and flat.cache_desc is desc
    nested = KvCache.create_cpu_cache(desc, [[4096, 8192]])
    assert nested.per_device_tensor_addrs == [[4096, 8192]]
    for bad, exc in [([4096], LLMException), ([[4096]], LLMException), ([4096, [8192]], LLMException),
                     ([], LLMException), ("x", TypeError)]:
        with pytest.raises(exc):
            KvCache.create_cpu_cache(desc, bad)
    with pytest.raises(LLMException):
        KvCache.create_cpu_cache(CacheDesc(2, [4, 8], DataType.DT_UINT8), [4096, 8192])  # DEVICE placement


def test_swap_blocks_refuses_a_cpu_cache_of_several_devices():
    km = v1_engine(LLMRole.DECODER).kv_cache_manager
    npu = km.allocate_blocks_cache(CacheDesc(1, [2, 64], DataType.DT_UINT8))
    host = np.zeros(2 * 64, dtype=np.uint8)
    desc = CacheDesc(1, [2, 64], DataType.DT_UINT8, Placement.HOST)
    cpu = KvCache.create_cpu_cache(desc, [[int(host.ctypes.data)], [int(host.ctypes.data)]])
    with pytest.raises(LLMException) as info:
        km.swap_blocks(cpu, npu, {0: 1})
    assert info.value.status_code is PARAM and "device num:1" in str(info.value)


def test_given_cluster_info_replaces_device_and_listen_options():
    info = {"cluster_id": 5, "logic_device_id": ["0:0:0:0"],
            "listen_ip_info": [{"ip": int.from_bytes(bytes([127, 0, 0, 1]), "little"), "port": 0}]}
    dd = LLMDataDist(LLMRole.PROMPT, 5)
    dd.init({"llm.ClusterInfo": json.dumps(info)})
    assert dd.statistics()["listen"][0] == "127.0.0.1"
    assert dd._engine_options["llm.ClusterInfo"] == json.dumps(info)  # kept as given
    dd.finalize()
    info["logic_device_id"] = ["0:0:0:0", "0:0:1:0"]
    with pytest.raises(LLMException) as err:
        dd.init({"llm.ClusterInfo": json.dumps(info)})
    assert err.value.status_code is S.LLM_FEATURE_NOT_ENABLED
    for bad in ("{", "[]", json.dumps({"listen_ip_info": [{"ip": "127.0.0.1"}]})):
        with pytest.raises(LLMException) as err:
            dd.init({"llm.ClusterInfo": bad})
        assert err.value.status_code is PARAM


def test_llmconfig_v1_keys_are_accepted():
    """buf_pool_cfg, output_max_size, deploy_res_path and enable_switch_role reach a v1 engine's options
    (upstream's v1 reads them in GE; llmdd has no GE and keeps them as given, docs/v1.md)."""
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.buf_pool_cfg = '{"buf_cfg":[{"total_size":2097152,"blk_size":256,"max_buf_size":8192}]}'
    cfg.output_max_size = 1024
    cfg.deploy_res_path = "/tmp/unused"
    cfg.enable_switch_role = True
    dd = LLMDataDist(LLMRole.DECODER, 4)
    dd.init(cfg.generate_options())
    opts = dd._engine_options
    assert opts["llm.BufPoolCfg"] == cfg.buf_pool_cfg and opts["llm.OutputMaxSize"] == "1024"
    assert opts["llm.EnableSwitchRole"] == "1" and dd._v1.enable_switch_role is True
    assert isinstance(dd.kv_cache_manager, KvCacheManager)


def test_every_v1_compat_row_names_tests_that_exist():
    """docs/compat.md's v1 section: each row names at least one test, and every test it names exists."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    text = (root / "docs" / "compat.md").read_text(encoding="utf-8")
    section = text.split("## v1 (legacy) mode", 1)[1].split("\n## ", 1)[0]
    sources = "".join(p.read_text(encoding="utf-8") for p in [
        root / "tests" / "unit" / "api" / "test_v1_mode.py", root / "tests" / "integration" / "test_v1_connectors.py",
        root / "tests" / "test_public_api.py", root / "tests" / "unit" / "api" / "test_datadist_contract.py"])
    defined = set(re.findall(r"^def (test_\w+)", sources, re.M))
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert len(rows) >= 30
    for row in rows:
        named = re.findall(r"(test_\w+)", re.sub(r"[\w/]+\.py(::)?", "", row.rsplit("|", 2)[1]))
        assert named, row
        missing = [n for n in named if n not in defined]
        assert not missing, (row, missing)


def test_mix_role_allocates_but_neither_keys_nor_pulls_nor_links():
    dd = v1_engine(LLMRole.MIX)
    km = dd.kv_cache_manager
    cache = km.allocate_cache(CacheDesc(1, [1, 16], DataType.DT_UINT8))
    assert dd.statistics()["listen"] is None  # only a PROMPT listens
    with pytest.raises(LLMException) as info:
        km.allocate_cache(CacheDesc(1, [1, 16], DataType.DT_UINT8), [CacheKey(1, 1)])
    assert str(info.value) == "cache_keys is not supported by MIX"
    with pytest.raises(LLMException) as info:
        km.pull_cache(CacheKeyByIdAndIndex(2, 1), cache)
    assert info.value.status_code is PARAM and "[pull_cache] is not supported by LLMRole.MIX" == str(info.value)
    with pytest.raises(LLMException) as info:
        km.remove_cache_key(CacheKey(1, 1))
    assert info.value.status_code is PARAM
    peer = LLMClusterInfo()
    peer.remote_cluster_id = 2
    peer.append_remote_ip_info("127.0.0.1", 1)
    assert dd.link_clusters([peer], 500) == (PARAM, [])
