"""Engine options as upstream's native layer reads them (items checked at ``init``).

* ``llm.RdmaTrafficClass`` / ``llm.RdmaServiceLevel``: unsigned 32-bit numbers for upstream's
  default link managers; bounded only by the hixl backend (TC in [0, 255] and a multiple of 4,
  SL in [0, 7]).  Upstream's own test set-up uses 100 for both.
* ``llm.LocalCommRes`` version 1.0 with ``server_count`` / ``status`` / ``rank_id``: upstream's
  reader ignores keys it does not use, and its tests use that form.
* ``ge.exec.deviceId``: numbers separated by ``;``.
"""

from __future__ import annotations

import json

import pytest

from llmdd import LlmConfig, LLMDataDist, LLMException, LLMRole, LLMStatusCode
from llmdd._base.options import EngineOptions, prepare_engine_options
from llmdd._base.ranktable import parse_local_comm_res, parse_rank_table

pytestmark = pytest.mark.timeout(60)

PARAM = LLMStatusCode.LLM_PARAM_INVALID
CM = {"llm.EnableCacheManager": "1"}
HIXL = {"llm.TransferBackend": "hixl", "llm.listenIpInfo": "127.0.0.1:1"}

# upstream's test_enable_local_comm_res set-up, verbatim in meaning
UPSTREAM_LOCAL_COMM_RES = json.dumps({
    "server_count": "1",
    "server_list": [{"device": [{"device_id": "0", "device_ip": "1.1.1.1"}], "server_id": "127.0.0.1"}],
    "status": "completed",
    "version": "1.0",
})


@pytest.fixture(autouse=True)
def _no_engine_left():
    yield
    live = LLMDataDist.llm_engine_instance
    if live is not None:
        live.finalize()


def _parse(extra: dict) -> EngineOptions:
    return EngineOptions.parse(prepare_engine_options({**CM, **extra}, LLMRole.PROMPT), LLMRole.PROMPT)


def _refused(extra: dict) -> LLMException:
    with pytest.raises(LLMException) as info:
        _parse(extra)
    assert info.value.status_code is PARAM
    return info.value


@pytest.mark.parametrize("value", ["0", "7", "8", "100", str(2**32 - 1)])
def test_service_level_is_an_unsigned_number_by_default(value):
    assert _parse({"llm.RdmaServiceLevel": value}).rdma_service_level == int(value)


@pytest.mark.parametrize("value", ["0", "130", "256", "100", str(2**32 - 1)])
def test_traffic_class_is_an_unsigned_number_by_default(value):
    assert _parse({"llm.RdmaTrafficClass": value}).rdma_traffic_class == int(value)


@pytest.mark.parametrize("key", ["llm.RdmaServiceLevel", "llm.RdmaTrafficClass"])
@pytest.mark.parametrize("value", [str(2**32), "-1", "1.5", "x", "True", ""])
def test_not_a_uint32_is_refused_in_every_mode(key, value):
    _refused({key: value})
    _refused({key: value, **HIXL})


@pytest.mark.parametrize("value, ok", [("0", True), ("7", True), ("8", False), ("100", False)])
def test_hixl_backend_bounds_service_level(value, ok):
    extra = {"llm.RdmaServiceLevel": value, **HIXL}
    if ok:
        assert _parse(extra).rdma_service_level == int(value)
    else:
        assert "[0, 7]" in str(_refused(extra))


@pytest.mark.parametrize("value, ok", [("0", True), ("100", True), ("252", True), ("130", False), ("256", False)])
def test_hixl_backend_bounds_traffic_class(value, ok):
    extra = {"llm.RdmaTrafficClass": value, **HIXL}
    if ok:
        assert _parse(extra).rdma_traffic_class == int(value)
    else:
        assert "multiple of 4" in str(_refused(extra))


def test_upstream_test_setup_initializes():
    # upstream's LlmLocalCommResSt.setUp: service level and traffic class 100, a 1.0 local_comm_res
    config = LlmConfig()
    config.device_id = 0
    config.rdma_service_level = 100
    config.rdma_traffic_class = 100
    config.listen_ip_info = "127.0.0.1:0"
    config.local_comm_res = UPSTREAM_LOCAL_COMM_RES
    options = config.generate_options()
    assert options["llm.RdmaServiceLevel"] == "100" and options["llm.RdmaTrafficClass"] == "100"
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.init(options)
    try:
        assert dd.cache_manager is not None
    finally:
        dd.finalize()


def test_local_comm_res_1_0_ignores_keys_it_does_not_use():
    res = parse_local_comm_res(UPSTREAM_LOCAL_COMM_RES)
    assert res.version == "1.0" and [(d.device_id, d.device_ip) for d in res.devices] == [(0, "1.1.1.1")]
    with_rank = json.loads(UPSTREAM_LOCAL_COMM_RES)
    with_rank["server_list"][0]["device"][0]["rank_id"] = "0"
    assert parse_local_comm_res(json.dumps(with_rank)).devices[0].device_id == 0


@pytest.mark.parametrize("version", ["1.0", "1.2"])
def test_local_comm_res_device_ip_is_optional(version):
    # upstream's comm-res reader requires device_id only; device_ip / device_port are optional
    doc = {"version": version, "server_list": [{"device": [{"device_id": "0"}], "server_id": "127.0.0.1"}]}
    res = parse_local_comm_res(json.dumps(doc))
    assert [(d.device_id, d.device_ip) for d in res.devices] == [(0, "")]
    assert _parse({"llm.LocalCommRes": json.dumps(doc)}).local_comm_res == json.dumps(doc)
    # control: a rank table (which llmdd reaches members through) still needs device_ip
    table = {"version": version, "server_count": "1", "status": "completed",
             "server_list": [{"device": [{"device_id": "0", "rank_id": "0"}], "server_id": "127.0.0.1"}]}
    with pytest.raises(LLMException) as info:
        parse_rank_table(json.dumps(table))
    assert info.value.status_code is PARAM and "device_ip" in str(info.value)


@pytest.mark.parametrize("doc", [
    {"version": "1.0", "server_count": "1"},                                            # no server_list
    {"version": "1.0", "server_list": [{"device": [{"device_ip": "1.1.1.1"}]}]},        # no device_id
    {"version": "1.1", "server_list": []},                                              # unknown version
])
def test_local_comm_res_1_0_still_needs_what_upstream_reads(doc):
    with pytest.raises(LLMException) as info:
        _parse({"llm.LocalCommRes": json.dumps(doc)})
    assert info.value.status_code is PARAM


@pytest.mark.parametrize("value, ok", [("0", True), ("3", True), ("0;1", True), ("True", False), ("", False),
                                       ("a", False), ("0;", False), ("-1", False)])
def test_device_id_option_is_numbers(value, ok):
    if ok:
        _parse({"ge.exec.deviceId": value})
    else:
        assert "ge.exec.deviceId" in str(_refused({"ge.exec.deviceId": value}))
