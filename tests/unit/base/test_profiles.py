"""Chip-family profiles: each limit enforced with the contract's error when the profile is selected."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmdd import (BlocksCacheKey, CacheDesc, DataType, LLMConfig, LLMDataDist, LLMException, LLMRole,
                   LLMStatusCode, MemInfo, Memtype, Placement)
from llmdd._base.profiles import PROFILES

MB2 = 2 * 1024 * 1024


@pytest.fixture
def engine():
    made = []

    def make(profile: str, **cfg):
        config = LLMConfig()
        config.enable_cache_manager = True
        for k, v in cfg.items():
            setattr(config, k, v)
        options = config.generate_options()
        options["llmdd.chip_profile"] = profile
        dd = LLMDataDist(LLMRole.PROMPT, 1)
        dd.init(options)
        made.append(dd)
        return dd

    yield make
    for dd in made:
        dd.finalize()


def _aligned(nbytes: int, count: int = 1) -> tuple[np.ndarray, list[int]]:
    raw = np.zeros(nbytes * count + MB2, dtype=np.uint8)
    base = (-raw.ctypes.data) % MB2
    return raw, [raw.ctypes.data + base + i * nbytes for i in range(count)]


def test_generic_profile_allows_what_a2_refuses(engine):
    dd = engine("generic")
    buf = np.zeros(8192, dtype=np.uint8)
    dd.cache_manager.register_blocks_cache(CacheDesc(1, [2, 1024], DataType.DT_UINT8), [buf.ctypes.data + 8])
    assert "no vendor limit" in PROFILES["generic"].describe()["description"]


def test_a2_device_memory_must_be_2mb_aligned(engine):
    dd = engine("atlas_a2")
    raw, (addr,) = _aligned(MB2)
    with pytest.raises(LLMException) as e:
        dd.cache_manager.register_blocks_cache(CacheDesc(1, [2, 1024], DataType.DT_UINT8), [addr + 4096])
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    dd.cache_manager.register_blocks_cache(CacheDesc(1, [2, 1024], DataType.DT_UINT8), [addr])


def test_a2_at_most_240_registered_addresses(engine):
    dd = engine("atlas_a2")
    raw, addrs = _aligned(MB2, 241)
    desc = CacheDesc(120, [1, 1024], DataType.DT_UINT8, Placement.HOST)
    dd.cache_manager.register_cache(desc, addrs[:120])
    dd.cache_manager.register_cache(CacheDesc(120, [1, 1024], DataType.DT_UINT8, Placement.HOST), addrs[120:240])
    with pytest.raises(LLMException) as e:
        dd.cache_manager.register_cache(CacheDesc(1, [1, 1024], DataType.DT_UINT8, Placement.HOST), addrs[240:])
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert "240" in str(e.value)


def test_a2_registered_memory_caps(engine, monkeypatch):
    dd = engine("atlas_a2")
    # a descriptor claiming 60 GB of device memory is refused before anything is registered
    raw, (addr,) = _aligned(4096)
    with pytest.raises(LLMException) as e:
        dd.cache_manager.register_blocks_cache(CacheDesc(1, [60, 1 << 30], DataType.DT_UINT8), [addr])
    assert e.value.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY


def test_a3_host_memory_cannot_be_a_remote_cache(engine):
    dd = engine("atlas_a3")
    buf = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(LLMException) as e:
        dd.cache_manager.register_blocks_cache(CacheDesc(1, [2, 1024], DataType.DT_UINT8, Placement.HOST),
                                               [buf.ctypes.data], remote_accessible=True)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    dd.cache_manager.register_blocks_cache(CacheDesc(1, [2, 1024], DataType.DT_UINT8, Placement.HOST),
                                           [buf.ctypes.data], remote_accessible=False)


def test_a2_host_pool_cap_at_init():
    config = LLMConfig()
    config.enable_cache_manager = True
    config.host_mem_pool_cfg = json.dumps({"memory_size": 21 << 30})
    options = config.generate_options()
    options["llmdd.chip_profile"] = "atlas_a2"
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(LLMException) as e:
        dd.init(options)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert LLMDataDist.llm_engine_instance is None


def test_950_refuses_link_apis_and_remap(engine):
    dd = engine("ascend_950", enable_remote_cache_accessible=True)
    table = json.dumps({"version": "1.0", "server_count": "1", "status": "completed", "server_list": [
        {"server_id": "a", "device": [{"device_id": "0", "device_ip": "127.0.0.1", "rank_id": "0"},
                                      {"device_id": "1", "device_ip": "127.0.0.1", "rank_id": "1"}]}]})
    for call in (lambda: dd.link("c", {1: 0, 2: 1}, table), lambda: dd.unlink(1),
                 lambda: dd.query_register_mem_status(1),
                 lambda: dd.cache_manager.remap_registered_memory(MemInfo(Memtype.MEM_TYPE_DEVICE, 4096, 4096))):
        with pytest.raises(LLMException) as e:
            call()
        assert e.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED


def test_950_cache_manager_options_cannot_be_false():
    config = LLMConfig()
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = False
    options = config.generate_options()
    options["llmdd.chip_profile"] = "ascend_950"
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(LLMException) as e:
        dd.init(options)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_unknown_profile_is_refused():
    config = LLMConfig()
    config.enable_cache_manager = True
    options = config.generate_options()
    options["llmdd.chip_profile"] = "tpu"
    with pytest.raises(LLMException):
        LLMDataDist(LLMRole.PROMPT, 1).init(options)
    assert LLMDataDist.llm_engine_instance is None


def test_link_limit_is_enforced_by_profile(engine, monkeypatch):
    import attrs

    import llmdd._engine.core as datadist

    real = datadist.profile_from_options
    # the engine's profile allows no link (the composition root hands it to the link manager)
    monkeypatch.setattr(datadist, "profile_from_options", lambda raw: attrs.evolve(real(raw), max_links=0))
    dd = engine("generic")
    assert dd._core.profile.max_links == 0
    from llmdd import LLMClusterInfo

    info = LLMClusterInfo()
    info.remote_cluster_id = 9
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", 1)
    ret, rets = dd.link_clusters([info], 1000)
    assert rets == [LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT]
