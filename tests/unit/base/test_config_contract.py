"""Contract tests for ``LlmConfig`` / ``LLMConfig`` and ``LLMClusterInfo`` (spec §4, §5)."""

from __future__ import annotations

import json
import socket

import pytest

from llmdd._base.config import LLMClusterInfo, LLMConfig, LlmConfig, parse_mem_pool_cfg, trans_str_ip
from llmdd._base.enums import LLMRole
from llmdd._base.status import LLMException, LLMStatusCode


def _config(**props) -> LLMConfig:
    cfg = LLMConfig()
    for name, value in props.items():
        setattr(cfg, name, value)
    return cfg


# ------------------------------------------------------------------ verified outputs


def test_alias():
    assert LLMConfig is LlmConfig


def test_verified_vllm_ascend_options():
    cfg = _config(device_id=0, sync_kv_timeout=33064, enable_switch_role=True,
                  enable_cache_manager=True, enable_remote_cache_accessible=True)
    opts = cfg.generate_options()
    assert list(opts.items()) == [
        ("ge.exec.deviceId", "0"), ("ge.session_device_id", "0"), ("llm.SyncKvCacheWaitTime", "33064"),
        ("llm.EnableCacheManager", "1"), ("llm.EnableRemoteCacheAccessible", "1"),
        ("llm.EnableSwitchRole", "1"), ("llm.MemoryUtilization", "0.95"),
    ]


def test_verified_omni_infer_prefill_options():
    cfg = _config(device_id=3, local_comm_res="", sync_kv_timeout=5000,
                  enable_remote_cache_accessible=True, listen_ip_info="10.0.0.1:26003")
    opts = cfg.generate_options()
    assert list(opts.items()) == [
        ("ge.exec.deviceId", "3"), ("ge.session_device_id", "3"), ("llm.SyncKvCacheWaitTime", "5000"),
        ("llm.EnableRemoteCacheAccessible", "1"), ("llm.listenIpInfo", "10.0.0.1:26003"),
        ("llm.LocalCommRes", ""), ("llm.MemoryUtilization", "0.95"),
    ]


def test_verified_empty_options():
    assert LLMConfig().generate_options() == {"llm.MemoryUtilization": "0.95"}


def test_generate_options_returns_same_dict_mutated_in_place():
    cfg = LLMConfig()
    first = cfg.generate_options()
    assert cfg.gen_options() is first
    assert cfg.options is first
    cfg.device_id = 1
    second = cfg.generate_options()
    assert second is first
    assert first["ge.exec.deviceId"] == "1"
    # keys are never removed, even when the property is put back to "not set"
    cfg.local_comm_res = "x"
    cfg.generate_options()
    cfg.local_comm_res = None
    assert cfg.generate_options()["llm.LocalCommRes"] == "x"


# ------------------------------------------------------------------------ defaults

DEFAULTS = [
    ("ge_options", {}),
    ("device_id", None),
    ("sync_kv_timeout", None),
    ("deploy_res_path", ""),
    ("buf_pool_cfg", ""),
    ("mem_pool_cfg", ""),
    ("host_mem_pool_cfg", ""),
    ("enable_cache_manager", False),
    ("enable_remote_cache_accessible", False),
    ("listen_ip_info", ""),
    ("link_total_time", 0),
    ("link_retry_count", 1),
    ("rdma_traffic_class", None),
    ("rdma_service_level", None),
    ("local_comm_res", ""),
    ("transfer_backend", ""),
    ("global_resource_config", ""),
    ("enable_switch_role", False),
    ("cluster_info", ""),
    ("output_max_size", None),
    ("mem_utilization", 0.95),
    ("options", {}),
]


@pytest.mark.parametrize("name,default", DEFAULTS, ids=[d[0] for d in DEFAULTS])
def test_getter_default(name, default):
    assert getattr(LLMConfig(), name) == default


# ----------------------------------------------------------------- option emission

POOL = '{"memory_size": 67108864}'

EMITTED = [
    ("ge_options", {"ge.a": "1", "ge.b": "x"}, {"ge.a": "1", "ge.b": "x"}),
    ("device_id", 5, {"ge.exec.deviceId": "5", "ge.session_device_id": "5"}),
    ("device_id", [2, 3], {"ge.session_device_id": "2", "ge.exec.deviceId": "2;3"}),
    ("device_id", (7,), {"ge.session_device_id": "7", "ge.exec.deviceId": "7"}),
    ("sync_kv_timeout", 1000, {"llm.SyncKvCacheWaitTime": "1000"}),
    ("sync_kv_timeout", "250", {"llm.SyncKvCacheWaitTime": "250"}),
    ("deploy_res_path", "/tmp/res", {"llm.deployResPath": "/tmp/res"}),
    ("deploy_res_path", "", {}),
    ("buf_pool_cfg", '{"buf_cfg":[]}', {"llm.BufPoolCfg": '{"buf_cfg":[]}'}),
    ("mem_pool_cfg", POOL, {"llm.MemPoolConfig": POOL}),
    ("mem_pool_cfg", "", {}),
    ("host_mem_pool_cfg", POOL, {"llm.HostMemPoolConfig": POOL}),
    ("enable_cache_manager", True, {"llm.EnableCacheManager": "1"}),
    ("enable_cache_manager", False, {"llm.EnableCacheManager": "0"}),
    ("enable_remote_cache_accessible", True, {"llm.EnableRemoteCacheAccessible": "1"}),
    ("enable_remote_cache_accessible", False, {"llm.EnableRemoteCacheAccessible": "0"}),
    ("listen_ip_info", "1.2.3.4:26000", {"llm.listenIpInfo": "1.2.3.4:26000"}),
    ("listen_ip_info", "", {}),
    ("link_total_time", 0, {"llm.LinkTotalTime": "0"}),
    ("link_total_time", 2**32 - 1, {"llm.LinkTotalTime": str(2**32 - 1)}),
    ("link_retry_count", 1, {"llm.LinkRetryCount": "1"}),
    ("link_retry_count", 100, {"llm.LinkRetryCount": "100"}),
    ("rdma_traffic_class", 132, {"llm.RdmaTrafficClass": "132"}),
    ("rdma_traffic_class", 0, {"llm.RdmaTrafficClass": "0"}),
    ("rdma_service_level", 4, {"llm.RdmaServiceLevel": "4"}),
    ("local_comm_res", "", {"llm.LocalCommRes": ""}),
    ("local_comm_res", '{"version": "1.3"}', {"llm.LocalCommRes": '{"version": "1.3"}'}),
    ("transfer_backend", "hixl", {"llm.TransferBackend": "hixl"}),
    ("transfer_backend", "", {"llm.TransferBackend": ""}),
    ("global_resource_config", "", {"llm.GlobalResourceConfig": ""}),
    ("global_resource_config", "{}", {"llm.GlobalResourceConfig": "{}"}),
    ("enable_switch_role", True, {"llm.EnableSwitchRole": "1"}),
    ("enable_switch_role", False, {}),
    ("cluster_info", '{"cluster_id": 1}', {"llm.ClusterInfo": '{"cluster_id": 1}'}),
    ("output_max_size", 1024, {"llm.OutputMaxSize": "1024"}),
    ("output_max_size", 0, {"llm.OutputMaxSize": "0"}),
]


@pytest.mark.parametrize("name,value,expected", EMITTED, ids=[f"{e[0]}={e[1]!r}" for e in EMITTED])
def test_option_emitted(name, value, expected):
    opts = dict(_config(**{name: value}).generate_options())
    assert opts.pop("llm.MemoryUtilization") == "0.95"
    assert opts == expected


def test_mem_utilization_is_always_emitted_as_its_str():
    cfg = _config(mem_utilization=0.5)
    assert cfg.generate_options() == {"llm.MemoryUtilization": "0.5"}


def test_setting_none_puts_optional_back_to_unset():
    cfg = _config(local_comm_res="", enable_cache_manager=True, transfer_backend="hixl")
    cfg.local_comm_res = None
    cfg.enable_cache_manager = None
    cfg.transfer_backend = None
    assert cfg.local_comm_res == ""
    assert cfg.enable_cache_manager is False
    assert cfg.generate_options() == {"llm.MemoryUtilization": "0.95"}


def test_full_emission_order():
    cfg = _config(
        mem_utilization=0.9, output_max_size=8, cluster_info='{"a": 1}', enable_switch_role=True,
        global_resource_config="g", transfer_backend="hixl", local_comm_res="", rdma_service_level=3,
        rdma_traffic_class=100, link_retry_count=2, link_total_time=5, listen_ip_info="1.1.1.1:1",
        enable_remote_cache_accessible=True, enable_cache_manager=True, host_mem_pool_cfg=POOL,
        mem_pool_cfg=POOL, buf_pool_cfg="b", deploy_res_path="p", sync_kv_timeout=9, device_id=[0, 1],
        ge_options={"ge.x": "y"},
    )
    assert list(cfg.generate_options()) == [
        "ge.x", "ge.session_device_id", "ge.exec.deviceId", "llm.SyncKvCacheWaitTime", "llm.deployResPath",
        "llm.BufPoolCfg", "llm.MemPoolConfig", "llm.HostMemPoolConfig", "llm.EnableCacheManager",
        "llm.EnableRemoteCacheAccessible", "llm.listenIpInfo", "llm.LinkTotalTime", "llm.LinkRetryCount",
        "llm.RdmaTrafficClass", "llm.RdmaServiceLevel", "llm.LocalCommRes", "llm.TransferBackend",
        "llm.GlobalResourceConfig", "llm.ClusterInfo", "llm.OutputMaxSize", "llm.EnableSwitchRole",
        "llm.MemoryUtilization",
    ]


def test_ge_options_override_is_first_then_typed_options_win():
    cfg = _config(ge_options={"ge.exec.deviceId": "9"}, device_id=1)
    assert cfg.generate_options()["ge.exec.deviceId"] == "1"


def test_getters_return_what_was_set():
    cfg = _config(sync_kv_timeout="42", device_id=(1, 2), link_total_time=7, enable_cache_manager=True)
    assert cfg.sync_kv_timeout == "42"
    assert cfg.device_id == (1, 2)
    assert cfg.link_total_time == 7
    assert cfg.enable_cache_manager is True


def test_cluster_info_converts_listen_ips():
    cfg = _config(cluster_info=json.dumps({"cluster_id": 1, "listen_ip_info": [{"ip": "1.2.3.4", "port": 5},
                                                                                {"ip": 7, "port": 6}]}))
    info = json.loads(cfg.cluster_info)
    assert info["listen_ip_info"][0]["ip"] == int.from_bytes(socket.inet_aton("1.2.3.4"), "little")
    assert info["listen_ip_info"][1]["ip"] == 7


# -------------------------------------------------------------------- bad setters

BAD = [
    ("ge_options", ["a"], TypeError),
    ("ge_options", None, TypeError),
    ("ge_options", {"a": 1}, TypeError),
    ("ge_options", {1: "a"}, TypeError),
    ("device_id", "0", TypeError),
    ("device_id", 1.0, TypeError),
    ("device_id", None, TypeError),
    ("device_id", [0, "1"], TypeError),
    ("device_id", -1, LLMException),
    ("device_id", [0, -1], LLMException),
    ("device_id", [], LLMException),
    ("device_id", 2**31, ValueError),
    ("device_id", [0, 2**31], ValueError),
    ("sync_kv_timeout", 1.5, TypeError),
    ("sync_kv_timeout", None, TypeError),
    ("sync_kv_timeout", "1s", LLMException),
    ("sync_kv_timeout", "-5", LLMException),
    ("sync_kv_timeout", 0, LLMException),
    ("sync_kv_timeout", -3, LLMException),
    ("sync_kv_timeout", 2**31, ValueError),
    ("sync_kv_timeout", str(2**31), ValueError),
    ("deploy_res_path", 1, TypeError),
    ("buf_pool_cfg", {}, TypeError),
    ("mem_pool_cfg", 1, TypeError),
    ("mem_pool_cfg", "not json", LLMException),
    ("host_mem_pool_cfg", '{"memory_size": 0}', LLMException),
    ("enable_cache_manager", 1, TypeError),
    ("enable_cache_manager", "1", TypeError),
    ("enable_remote_cache_accessible", 0, TypeError),
    ("listen_ip_info", 26000, TypeError),
    ("link_total_time", None, TypeError),
    ("link_total_time", "5", TypeError),
    ("link_total_time", -1, LLMException),
    ("link_total_time", 2**32, LLMException),
    ("link_retry_count", 1.0, TypeError),
    ("link_retry_count", 0, LLMException),
    ("link_retry_count", 101, LLMException),
    ("rdma_traffic_class", "132", TypeError),
    ("rdma_traffic_class", None, TypeError),
    ("rdma_traffic_class", -1, ValueError),
    ("rdma_traffic_class", 2**32, ValueError),
    ("rdma_service_level", 1.0, TypeError),
    ("rdma_service_level", -1, ValueError),
    ("local_comm_res", {}, TypeError),
    ("transfer_backend", 1, TypeError),
    ("global_resource_config", {}, TypeError),
    ("enable_switch_role", 1, TypeError),
    ("cluster_info", 1, TypeError),
    ("cluster_info", None, TypeError),
    ("cluster_info", "not json", ValueError),
    ("cluster_info", '{"listen_ip_info": [{"ip": "1.2.3", "port": 1}]}', None),  # inet_aton accepts it
    ("cluster_info", '{"listen_ip_info": [{"ip": "bad ip", "port": 1}]}', RuntimeError),
    ("output_max_size", "1", TypeError),
    ("mem_utilization", 1, TypeError),
    ("mem_utilization", None, TypeError),
    ("mem_utilization", 1.5, LLMException),
    ("mem_utilization", -0.1, LLMException),
    ("mem_utilization", float("nan"), LLMException),
]


@pytest.mark.parametrize("name,value,exc", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_bad_setter(name, value, exc):
    cfg = LLMConfig()
    before = getattr(cfg, name)
    if exc is None:
        setattr(cfg, name, value)
        return
    with pytest.raises(exc) as info:
        setattr(cfg, name, value)
    if exc is LLMException:
        assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    assert getattr(cfg, name) == before or before != before  # unchanged (nan-safe)


def test_options_is_read_only():
    with pytest.raises(AttributeError):
        LLMConfig().options = {}


def test_type_error_message_format():
    with pytest.raises(TypeError, match=r"^rdma_traffic_class only support \['int'\], but got <class 'str'>\.$"):
        LLMConfig().rdma_traffic_class = "1"
    with pytest.raises(ValueError, match=r"^rdma_traffic_class's value is out of range,-1 is not a uint32 value\.$"):
        LLMConfig().rdma_traffic_class = -1


def test_bool_accepted_where_int_checked():
    # bool is an int subclass and passes the integer checks, as upstream
    cfg = _config(rdma_service_level=True)
    assert cfg.generate_options()["llm.RdmaServiceLevel"] == "True"


# --------------------------------------------------------------- memory pool config

GOOD_POOLS = [
    ('{"memory_size": 67108864}', (67108864, 16)),
    ('{"memory_size": 1, "page_shift": 10}', (1, 10)),
    ('{"memory_size": 1024, "page_shift": 30}', (1024, 30)),
    ('{"memory_size": 4096, "page_shift": 16, "other": 1}', (4096, 16)),
    (json.dumps({"memory_size": (2**32 << 16) - 1}), ((2**32 << 16) - 1, 16)),
    (json.dumps({"memory_size": (2**32 << 30) - 1, "page_shift": 30}), ((2**32 << 30) - 1, 30)),
]


@pytest.mark.parametrize("text,expected", GOOD_POOLS)
def test_parse_mem_pool_cfg_ok(text, expected):
    assert parse_mem_pool_cfg(text) == expected
    cfg = _config(mem_pool_cfg=text, host_mem_pool_cfg=text)
    assert cfg.mem_pool_cfg == text and cfg.host_mem_pool_cfg == text


BAD_POOLS = [
    "",
    "{",
    "[]",
    "67108864",
    "{}",
    '{"page_shift": 16}',
    '{"memory_size": 0}',
    '{"memory_size": -1}',
    '{"memory_size": "1024"}',
    '{"memory_size": 1.5}',
    '{"memory_size": true}',
    '{"memory_size": null}',
    '{"memory_size": 1024, "page_shift": 9}',
    '{"memory_size": 1024, "page_shift": 31}',
    '{"memory_size": 1024, "page_shift": "16"}',
    '{"memory_size": 1024, "page_shift": 16.0}',
    '{"memory_size": 1024, "page_shift": false}',
    json.dumps({"memory_size": 2**32 << 16}),
    json.dumps({"memory_size": 2**32 << 10, "page_shift": 10}),
]


@pytest.mark.parametrize("text", BAD_POOLS)
def test_parse_mem_pool_cfg_invalid(text):
    with pytest.raises(LLMException) as info:
        parse_mem_pool_cfg(text)
    assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    if text:  # "" means "no pool" for the properties
        for prop in ("mem_pool_cfg", "host_mem_pool_cfg"):
            with pytest.raises(LLMException):
                setattr(LLMConfig(), prop, text)


def test_parse_mem_pool_cfg_non_str():
    with pytest.raises(LLMException):
        parse_mem_pool_cfg(None)  # type: ignore[arg-type]


# ------------------------------------------------------------------- LLMClusterInfo


def test_cluster_info_defaults():
    info = LLMClusterInfo()
    assert info.remote_cluster_id is None
    assert info.remote_role_type is None
    assert info.local_ip_info_list == []
    assert info.remote_ip_info_list == []


def test_cluster_info_append_ips():
    info = LLMClusterInfo()
    info.remote_cluster_id = 2**64 - 1
    info.remote_role_type = LLMRole.PROMPT
    info.append_local_ip_info("192.168.1.2", 0)
    info.append_remote_ip_info("10.0.0.1", 26000)
    info.append_remote_ip_info(16777343, 65535)
    assert info.remote_cluster_id == 2**64 - 1
    assert info.remote_role_type is LLMRole.PROMPT
    assert info.local_ip_info_list == [(int.from_bytes(bytes([192, 168, 1, 2]), "little"), 0)]
    assert info.remote_ip_info_list == [(int.from_bytes(bytes([10, 0, 0, 1]), "little"), 26000),
                                        (16777343, 65535)]
    assert trans_str_ip("127.0.0.1") == 16777343


def test_cluster_info_role_type_accepts_int():
    info = LLMClusterInfo()
    info.remote_role_type = 2
    assert info.remote_role_type == 2


CLUSTER_BAD = [
    ("remote_cluster_id", -1, ValueError),
    ("remote_cluster_id", 2**64, ValueError),
    ("remote_cluster_id", "1", TypeError),
    ("remote_cluster_id", None, TypeError),
    ("remote_role_type", "PROMPT", TypeError),
    ("remote_role_type", 1.0, TypeError),
]


@pytest.mark.parametrize("name,value,exc", CLUSTER_BAD, ids=[f"{b[0]}={b[1]!r}" for b in CLUSTER_BAD])
def test_cluster_info_bad_setter(name, value, exc):
    with pytest.raises(exc):
        setattr(LLMClusterInfo(), name, value)


APPEND_BAD = [
    ("1.2.3.4", -1, ValueError),
    ("1.2.3.4", 65536, ValueError),
    ("1.2.3.4", "80", TypeError),
    ("1.2.3.4", None, TypeError),
    (None, 80, TypeError),
    (1.5, 80, TypeError),
    (b"1.2.3.4", 80, TypeError),
    ("not an ip", 80, RuntimeError),
    ("1.2.3.4.5", 80, RuntimeError),
    ("bad", -1, ValueError),  # the port is checked before the ip string is parsed
]


@pytest.mark.parametrize("method", ["append_local_ip_info", "append_remote_ip_info"])
@pytest.mark.parametrize("ip,port,exc", APPEND_BAD)
def test_cluster_info_bad_append(method, ip, port, exc):
    info = LLMClusterInfo()
    with pytest.raises(exc) as err:
        getattr(info, method)(ip, port)
    if exc is RuntimeError:
        assert not isinstance(err.value, LLMException)
        assert str(err.value) == f"Can not parse ip str:{ip}"
    assert info.local_ip_info_list == [] and info.remote_ip_info_list == []
