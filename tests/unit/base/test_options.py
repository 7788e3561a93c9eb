"""Engine options (spec 4.1): ``prepare_engine_options`` (upstream's ``_setup_engine_option``),
``parse_listen_ip_info`` and ``EngineOptions.parse`` as pure functions, table-driven."""

from __future__ import annotations

import pytest

from llmdd import LLMException, LLMRole, LLMStatusCode
from llmdd._base.options import (
    DEFAULT_SYNC_KV_TIMEOUT_MS,
    EngineOptions,
    parse_listen_ip_info,
    prepare_engine_options,
)

PARAM = LLMStatusCode.LLM_PARAM_INVALID
CM = {"llm.EnableCacheManager": "1"}


# ----------------------------------------------------------------- injection (spec 4.1 steps 1-7)

@pytest.mark.parametrize("role, text", [
    (LLMRole.PROMPT, "Prompt"), (LLMRole.DECODER, "Decoder"), (LLMRole.MIX, "Mix"),
])
def test_role_is_injected(role, text):
    assert prepare_engine_options({}, role)["llm.Role"] == text


def test_role_overrides_a_caller_value():
    assert prepare_engine_options({"llm.Role": "Mix"}, LLMRole.DECODER)["llm.Role"] == "Decoder"


@pytest.mark.parametrize("given, expected", [
    # LocalCommRes present: both flags injected when absent
    ({"llm.LocalCommRes": ""},
     {"llm.EnableCacheManager": "1", "llm.EnableRemoteCacheAccessible": "1"}),
    # present values are kept
    ({"llm.LocalCommRes": "", "llm.EnableRemoteCacheAccessible": "0"},
     {"llm.EnableCacheManager": "1", "llm.EnableRemoteCacheAccessible": "0"}),
    ({"llm.LocalCommRes": "", "llm.EnableCacheManager": "1"},
     {"llm.EnableCacheManager": "1", "llm.EnableRemoteCacheAccessible": "1"}),
    # no LocalCommRes: nothing is injected
    ({}, {"llm.EnableCacheManager": None, "llm.EnableRemoteCacheAccessible": None}),
    (CM, {"llm.EnableCacheManager": "1", "llm.EnableRemoteCacheAccessible": None}),
    # TransferBackend injects RemoteCacheAccessible
    ({**CM, "llm.TransferBackend": "hixl", "llm.listenIpInfo": "127.0.0.1:1"},
     {"llm.EnableRemoteCacheAccessible": "1", "llm.ListenIp": "127.0.0.1", "llm.ListenPort": "1"}),
    # listen info split into ListenIp/ListenPort (cache mode)
    ({**CM, "llm.listenIpInfo": "10.0.0.1:26003"},
     {"llm.ListenIp": "10.0.0.1", "llm.ListenPort": "26003", "llm.listenIpInfo": "10.0.0.1:26003"}),
    ({"llm.LocalCommRes": "", "llm.listenIpInfo": "127.0.0.1:0"},
     {"llm.ListenIp": "127.0.0.1", "llm.ListenPort": "0"}),
    # not cache mode: listen info is not split
    ({"llm.listenIpInfo": "10.0.0.1:26003"}, {"llm.ListenIp": None, "llm.ListenPort": None}),
])
def test_injection(given, expected):
    out = prepare_engine_options(given, LLMRole.PROMPT)
    for key, value in expected.items():
        assert out.get(key) == value, key
    for key, value in given.items():  # nothing the caller set is dropped
        assert out[key] == value


def test_input_dict_is_not_mutated():
    # LLMConfig.generate_options() returns its internal dict: init must work on a copy
    given = {"llm.LocalCommRes": "", "llm.listenIpInfo": "127.0.0.1:5"}
    snapshot = dict(given)
    out = prepare_engine_options(given, LLMRole.PROMPT)
    assert given == snapshot and out is not given


@pytest.mark.parametrize("given, needle", [
    ({"llm.LocalCommRes": "", "llm.EnableCacheManager": "0"}, "EnableCacheManager"),
    ({"llm.TransferBackend": "hixl", "llm.listenIpInfo": "127.0.0.1:1"}, "EnableCacheManager"),
    ({**CM, "llm.TransferBackend": "hixl", "llm.EnableRemoteCacheAccessible": "0",
      "llm.listenIpInfo": "127.0.0.1:1"}, "EnableRemoteCacheAccessible"),
    ({**CM, "llm.TransferBackend": "hixl"}, "listenIpInfo"),
    ({"llm.LocalCommRes": "", "llm.TransferBackend": "hixl"}, "listenIpInfo"),
    ({**CM, "llm.listenIpInfo": "127.0.0.1"}, "listenIpInfo"),
    ({**CM, "llm.listenIpInfo": "127.0.0.1:1:2"}, "listenIpInfo"),
    ({**CM, "llm.listenIpInfo": "::1:80"}, "listenIpInfo"),
    ({"ge.flowGraphMemMaxSize": "1024,2048"}, "flowGraphMemMaxSize"),
    ({"ge.flowGraphMemMaxSize": "12a"}, "flowGraphMemMaxSize"),
    ({"ge.flowGraphMemMaxSize": ""}, "flowGraphMemMaxSize"),
])
def test_prerequisites_refused(given, needle):
    with pytest.raises(LLMException) as info:
        prepare_engine_options(given, LLMRole.PROMPT)
    assert info.value.status_code is PARAM
    assert needle in str(info.value)


@pytest.mark.parametrize("value", [1024, None, b"1024"])
def test_flow_graph_mem_max_size_must_be_str(value):
    with pytest.raises(TypeError):
        prepare_engine_options({"ge.flowGraphMemMaxSize": value}, LLMRole.PROMPT)


def test_flow_graph_mem_max_size_single_pool_accepted():
    assert prepare_engine_options({"ge.flowGraphMemMaxSize": "2147483648"}, LLMRole.PROMPT)[
        "ge.flowGraphMemMaxSize"] == "2147483648"


# ----------------------------------------------------------------- listen ip info

@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:26000", ("127.0.0.1", 26000)),
    ("0.0.0.0:0", ("0.0.0.0", 0)),
    ("localhost:65535", ("localhost", 65535)),
])
def test_parse_listen_ip_info(text, expected):
    assert parse_listen_ip_info(text) == expected


@pytest.mark.parametrize("text", [
    "127.0.0.1", "127.0.0.1:1:2", ":80", "127.0.0.1:", "127.0.0.1:x", "127.0.0.1:65536", "127.0.0.1:-1", "", 26000,
    None,
])
def test_parse_listen_ip_info_refused(text):
    with pytest.raises(LLMException) as info:
        parse_listen_ip_info(text)
    assert info.value.status_code is PARAM


# ----------------------------------------------------------------- EngineOptions.parse

def _parse(extra: dict) -> EngineOptions:
    return EngineOptions.parse(prepare_engine_options({**CM, **extra}, LLMRole.DECODER), LLMRole.DECODER)


def test_parse_defaults():
    opts = _parse({})
    assert opts.cache_mode and not opts.remote_cache_accessible
    assert opts.sync_kv_timeout_ms == DEFAULT_SYNC_KV_TIMEOUT_MS == 1000
    assert opts.listen is None and opts.local_comm_res is None and opts.transfer_backend is None
    assert (opts.link_total_time_s, opts.link_retry_count, opts.rdma_traffic_class, opts.rdma_service_level) == (
        None, None, None, None)
    assert opts.role is LLMRole.DECODER and opts.raw["llm.Role"] == "Decoder"


@pytest.mark.parametrize("extra, attr, expected", [
    ({"llm.SyncKvCacheWaitTime": "33064"}, "sync_kv_timeout_ms", 33064),
    ({"llm.SyncKvCacheWaitTime": "2147483647"}, "sync_kv_timeout_ms", 2**31 - 1),
    ({"llm.listenIpInfo": "127.0.0.1:26001"}, "listen", ("127.0.0.1", 26001)),
    ({"llm.EnableRemoteCacheAccessible": "1"}, "remote_cache_accessible", True),
    ({"llm.LocalCommRes": ""}, "local_comm_res", ""),
    ({"llm.LocalCommRes": '{"version": "1.3"}'}, "local_comm_res", '{"version": "1.3"}'),
    ({"llm.LinkTotalTime": "0"}, "link_total_time_s", 0),
    ({"llm.LinkTotalTime": str(2**32 - 1)}, "link_total_time_s", 2**32 - 1),
    ({"llm.LinkRetryCount": "1"}, "link_retry_count", 1),
    ({"llm.LinkRetryCount": "100"}, "link_retry_count", 100),
    ({"llm.RdmaTrafficClass": "132"}, "rdma_traffic_class", 132),
    ({"llm.RdmaServiceLevel": "7"}, "rdma_service_level", 7),
    ({"llm.TransferBackend": "hixl", "llm.listenIpInfo": "127.0.0.1:1"}, "transfer_backend", "hixl"),
])
def test_parse_values(extra, attr, expected):
    assert getattr(_parse(extra), attr) == expected


@pytest.mark.parametrize("extra", [
    {"llm.SyncKvCacheWaitTime": "0"},
    {"llm.SyncKvCacheWaitTime": "-5"},
    {"llm.SyncKvCacheWaitTime": "2147483648"},
    {"llm.SyncKvCacheWaitTime": "1.5"},
    {"llm.SyncKvCacheWaitTime": "abc"},
    {"llm.LinkTotalTime": "-1"},
    {"llm.LinkTotalTime": str(2**32)},
    {"llm.LinkRetryCount": "0"},
    {"llm.LinkRetryCount": "101"},
    {"llm.RdmaTrafficClass": str(2**32)},
    {"llm.RdmaServiceLevel": "-1"},
    {"llm.RdmaTrafficClass": "256", "llm.TransferBackend": "hixl", "llm.listenIpInfo": "127.0.0.1:1"},
    {"llm.RdmaServiceLevel": "8", "llm.TransferBackend": "hixl", "llm.listenIpInfo": "127.0.0.1:1"},
    {"llm.LocalCommRes": "not json"},
    {"llm.LocalCommRes": '{"version": "9.9"}'},
    {"llm.LocalCommRes": "[1, 2]"},
])
def test_parse_refused(extra):
    with pytest.raises(LLMException) as info:
        _parse(extra)
    assert info.value.status_code is PARAM


def test_parse_is_frozen():
    opts = _parse({})
    with pytest.raises(AttributeError):
        opts.sync_kv_timeout_ms = 5  # type: ignore[misc]
