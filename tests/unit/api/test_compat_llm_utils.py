"""``llm_datadist.v2.llm_utils`` and ``llm_datadist.v2.config``: upstream's helpers, behaviour for
behaviour (values returned, what is refused, status codes)."""

from __future__ import annotations

import json
import os

import pytest

from llmdd import (BlocksCacheKey, CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType, LLMException, LLMRole,
                   LLMStatusCode, MemInfo, Memtype, Placement, TransferWithCacheKeyConfig)
from llmdd.v2 import config, llm_utils

PARAM = LLMStatusCode.LLM_PARAM_INVALID
U64 = 2**64 - 1


def _refused(fn, *args, status=PARAM, match=None):
    with pytest.raises(LLMException, match=match) as info:
        fn(*args)
    assert info.value.status_code is status
    return info.value


# ----------------------------------------------------------------- cache descriptions

def test_clone_cache_desc_is_equal_and_independent():
    shape = [4, -1, 8]
    desc = CacheDesc(2, shape, DataType.DT_FLOAT16, Placement.HOST, 0, 1, "ND")
    clone = llm_utils.clone_cache_desc(desc)
    assert clone is not desc
    assert (clone.num_tensors, list(clone.shape), clone.data_type, clone.placement, clone.batch_dim,
            clone.seq_len_dim_index, clone.kv_tensor_format) == (2, shape, DataType.DT_FLOAT16, Placement.HOST, 0,
                                                                 1, "ND")
    clone.update_dim(1, 16)
    assert desc.shape[1] == -1 and clone.shape[1] == 16


def test_verify_cache_shape():
    assert llm_utils.verify_cache_shape([2, -1, 3]) is None
    _refused(llm_utils.verify_cache_shape, [], match="scalar is not supported")
    _refused(llm_utils.verify_cache_shape, [2, 0], match="empty dimension is not supported")
    # upstream raises this one without a status code: the exception's default
    _refused(llm_utils.verify_cache_shape, [2, -2], status=LLMStatusCode.LLM_SUCCESS, match="dim -2 is not supported")


def test_to_data_type():
    for dt in DataType:
        assert llm_utils.to_data_type(str(dt.value)) is dt
    _refused(llm_utils.to_data_type, "999", match="unsupported dtype: 999")
    _refused(llm_utils.to_data_type, "DT_FLOAT")


@pytest.mark.parametrize("shape, dt, size", [
    ([2, 3], DataType.DT_FLOAT, 24), ([4], DataType.DT_BF16, 8), ([1, 1, 1], DataType.DT_INT64, 8),
    ([0, 5], DataType.DT_UINT8, 0),
])
def test_calc_tensor_size(shape, dt, size):
    assert llm_utils.calc_tensor_size(shape, dt) == size
    assert CacheDesc(1, shape, dt).size == size   # the same bytes CacheDesc.size reports


@pytest.mark.parametrize("shape, dt", [([2, -1], DataType.DT_FLOAT), ([2], DataType.DT_STRING),
                                       ([2**62, 4], DataType.DT_INT8)])
def test_calc_tensor_size_refuses(shape, dt):
    _refused(llm_utils.calc_tensor_size, shape, dt, match="Failed to calc tensor size")


def test_ids():
    for ok in (0, 1, U64 - 1):
        assert llm_utils.is_valid_id(ok) and not llm_utils.is_invalid_id(ok)
    for bad in (-1, U64):
        assert llm_utils.is_invalid_id(bad) and not llm_utils.is_valid_id(bad)


def test_cache_desc_parser():
    opts = {"llm.RefInputShapes": "4,-1,8;4,-1,8", "llm.RefInputDtypes": "1;1"}
    desc = llm_utils.CacheDescParser.parse_by_options(opts)
    assert (desc.num_tensors, list(desc.shape), desc.data_type, desc.placement, desc.seq_len_dim_index) == (
        2, [4, -1, 8], DataType.DT_FLOAT16, Placement.DEVICE, 1)
    desc = llm_utils.CacheDescParser.parse_by_options({**opts, "llm.RefInputSeqLenDimIndex": "2",
                                                       "llm.kvTensorFormat": "ND"})
    assert desc.seq_len_dim_index == 2 and desc.kv_tensor_format == "ND"
    fixed = llm_utils.CacheDescParser.parse_by_options({"llm.RefInputShapes": "2,3", "llm.RefInputDtypes": "0"})
    assert fixed.seq_len_dim_index == -1
    for bad, msg in [({}, "llm.RefInputShapes not set"),
                     ({"llm.RefInputShapes": "2,3"}, "llm.RefInputDtypes not set"),
                     ({"llm.RefInputShapes": "2,3;2,4", "llm.RefInputDtypes": "0;0"}, "multiple different shapes"),
                     ({"llm.RefInputShapes": "2,3", "llm.RefInputDtypes": "0;1"}, "multiple different data types"),
                     ({"llm.RefInputShapes": "2,3", "llm.RefInputDtypes": "0;0"}, "mismatches"),
                     ({"llm.RefInputShapes": "2,-1,-1", "llm.RefInputDtypes": "0"}, "only have one dynamic dim"),
                     ({**opts, "llm.RefInputSeqLenDimIndex": "3"}, "out of range")]:
        _refused(llm_utils.CacheDescParser.parse_by_options, bad, match=msg)


# ----------------------------------------------------------------- packers

def test_packers():
    desc = CacheDesc(2, [3, 4], DataType.DT_INT8, Placement.DEVICE, 0, -1)
    assert llm_utils.pack_cache_desc(desc) == (2, DataType.DT_INT8.value, -1, [3, 4], Placement.DEVICE.value, False)
    assert llm_utils.pack_cache_key(CacheKey(5, req_id=7, model_id=2)) == (5, -1, 0, 7, U64, 2, False)
    assert llm_utils.pack_cache_key_by_id(CacheKeyByIdAndIndex(5, 9, 3)) == (5, 9, 3, U64, U64, 0, False)
    assert llm_utils.pack_block_cache_key(BlocksCacheKey(5, 4)) == (5, -1, 0, U64, U64, 4, True)
    assert llm_utils.pack_mem_info(MemInfo(Memtype.MEM_TYPE_HOST, 0x1000, 64)) == (1, 0x1000, 64)


def test_transfer_cache_parameters_defaults():
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(1, 0), range(0, 1), range(0, 1))
    params = llm_utils.TransferCacheParameters("cache", [cfg])
    assert (params.src_cache, params.transfer_configs, params.src_block_indices, params.dst_block_indices,
            params.dst_block_memory_size) == ("cache", [cfg], None, None, None)


# ----------------------------------------------------------------- layer ranges

@pytest.mark.parametrize("src, dst, tnpl, expected", [
    (range(0, 2), range(1, 3), 2, ([0, 1, 2, 3], [2, 3, 4, 5])),
    (range(1, 2), None, 3, ([3, 4, 5], [])),
    (None, None, 2, ([], [])),
    (range(3, 3), range(0, 1), 1, ([], [0])),
])
def test_layer_range_to_tensor_indices(src, dst, tnpl, expected):
    assert llm_utils.layer_range_to_tensor_indices(src, dst, tnpl) == expected


def test_layer_range_to_tensor_indices_refuses():
    _refused(llm_utils.layer_range_to_tensor_indices, range(0, 4, 2), None, match="src_layer_range step must be 1")
    _refused(llm_utils.layer_range_to_tensor_indices, None, range(0, 4, 2), match="dst_layer_range step must be 1")
    _refused(llm_utils.layer_range_to_tensor_indices, range(-1, 2), None, match="the start value:-1 is < 0")
    with pytest.raises(ValueError, match="is not a uint32 value"):
        llm_utils.layer_range_to_tensor_indices(range(0, 2**32 + 1), None)
    with pytest.raises(TypeError):
        llm_utils.layer_range_to_tensor_indices([0, 1], None)


# ----------------------------------------------------------------- listen ip info

def test_parse_listen_ip_info():
    assert llm_utils.parse_listen_ip_info("10.0.0.1:26000") == ("10.0.0.1", 26000)
    assert llm_utils.parse_listen_ip_info("host:1") == ("host", 1)
    _refused(llm_utils.parse_listen_ip_info, "10.0.0.1", match='format should be "ip:port"')
    _refused(llm_utils.parse_listen_ip_info, "a:1:2")
    with pytest.raises(ValueError):
        llm_utils.parse_listen_ip_info("10.0.0.1:x")
    with pytest.raises(TypeError):
        llm_utils.parse_listen_ip_info(26000)


def test_engine_config_parse_listen_ip_info_gives_the_ip_as_upstreams_int():
    assert config.EngineConfig.parse_listen_ip_info("127.0.0.1:26001") == (0x0100007F, 26001)
    _refused(config.EngineConfig.parse_listen_ip_info, "127.0.0.1")


# ----------------------------------------------------------------- v2.config

def test_gen_numa_config():
    numa = json.loads(config.EngineConfig.gen_numa_config("0;3", "/res"))
    node = numa["cluster"][0]["cluster_nodes"][0]
    assert node["is_local"] and node["deploy_res_path"] == "/res"
    assert [(i["item_id"], i["device_id"]) for i in node["item_list"]] == [(0, 0), (3, 3)]
    assert "deploy_res_path" not in json.loads(config.EngineConfig.gen_numa_config("1", None))["cluster"][0][
        "cluster_nodes"][0]


def test_cluster_info_generated_and_parsed_back(tmp_path, monkeypatch):
    monkeypatch.delenv("RESOURCE_CONFIG_PATH", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    opts = {"ge.exec.deviceId": "4;5", "llm.listenIpInfo": "127.0.0.1:26000;127.0.0.1:26001"}
    config.EngineConfig.gen_cluster_info_if_not_exist(9, LLMRole.PROMPT, opts)
    info = json.loads(opts["llm.ClusterInfo"])
    assert info["cluster_id"] == 9 and info["logic_device_id"] == ["0:0:0:0", "0:0:1:0"]
    assert info["listen_ip_info"] == [{"ip": 0x0100007F, "port": 26000}, {"ip": 0x0100007F, "port": 26001}]
    assert os.path.dirname(opts["ge.resourceConfigPath"]) == str(tmp_path)
    engine = config.EngineConfig.from_engine_options(True, opts)
    assert engine.is_prompt and engine.cluster_config.rank_id_to_device_id == {0: 4, 1: 5}
    # one rank chosen by ge.exec.rankId
    ranked = config.ClusterConfig.from_engine_options({**opts, "ge.exec.rankId": "1"})
    assert ranked.rank_id_to_device_id == {1: 4}
    # present options are left alone
    kept = {"llm.ClusterInfo": "{}", "ge.exec.deviceId": "0"}
    config.EngineConfig.gen_cluster_info_if_not_exist(1, LLMRole.DECODER, kept)
    assert kept == {"llm.ClusterInfo": "{}", "ge.exec.deviceId": "0"}


def test_cluster_info_refusals(monkeypatch):
    monkeypatch.delenv("RESOURCE_CONFIG_PATH", raising=False)
    gen = config.EngineConfig.gen_cluster_info_if_not_exist
    _refused(gen, 1, LLMRole.PROMPT, {"ge.exec.deviceId": "0"}, match="neither llm.ClusterInfo nor llm.listenIp")
    _refused(gen, 1, LLMRole.PROMPT, {"ge.exec.deviceId": "0;1", "llm.listenIpInfo": "1.1.1.1:1"},
             match="is not equal to device num:2")
    _refused(gen, 1, LLMRole.DECODER, {"ge.exec.deviceId": "0;x"}, match="ge.exec.deviceId is invalid")
    _refused(config.ClusterConfig.from_engine_options, {}, match="'llm.ClusterInfo' is not defined")
    _refused(config.ClusterConfig.from_engine_options, {"llm.ClusterInfo": '{"logic_device_id": []}'},
             match="'ge.resourceConfigPath' is not defined")


def test_resource_config_path_from_the_environment(tmp_path, monkeypatch):
    numa = tmp_path / "numa.json"
    numa.write_text(config.EngineConfig.gen_numa_config("2", None))
    monkeypatch.setenv("RESOURCE_CONFIG_PATH", str(numa))
    opts = {"ge.exec.deviceId": "2"}
    config.EngineConfig.gen_cluster_info_if_not_exist(3, LLMRole.DECODER, opts)
    assert opts["ge.resourceConfigPath"] == str(numa)
    assert config.ClusterConfig.from_engine_options(opts).rank_id_to_device_id == {0: 2}
