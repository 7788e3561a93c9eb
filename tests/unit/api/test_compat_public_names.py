"""Upstream's public module paths and names, reachable as attributes of ``llmdd`` (``import llmdd as
llm_datadist``) and through the drop-in alias (``import llm_datadist``), the same objects both ways.

The expected names are those upstream's Python package defines (hicann/hixl, see docs/compat.md).
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import llmdd
import llmdd.compat
from llmdd import DataType, LLMDataDist, LLMException, LLMRole, LLMStatusCode

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

#: upstream's llm_datadist.v2_list, in its order
UPSTREAM_V2_LIST = [
    "LLMClusterInfo", "LLMStatusCode", "LLMException", "LLMRole", "LlmConfig", "LLMConfig", "DataType", "Status",
    "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache", "Cache", "BlocksCacheKey", "LLMDataDist",
    "Placement", "RegisterMemStatus", "LayerSynchronizer", "TransferConfig", "CacheTask",
    "TransferWithCacheKeyConfig", "Memtype", "MemInfo",
]

#: module path -> the public names upstream defines there (functions, classes, constants)
UPSTREAM_MODULES = {
    "status": ["LLMStatusCode", "LLMException", "Status", "code_2_status", "handle_llm_status", "raise_if_false",
               "raise_if_true"],
    "configs": ["LLMRole", "trans_str_ip", "LLMClusterInfo", "LlmConfig"],
    "data_type": ["DataType", "python_dtype_2_dwrapper_dtype", "get_python_dtype_from_wrapper_dtype",
                  "dtype_to_np_dtype", "valid_np_dtypes", "np_dtype_to_dtype"],
    "utils.log": ["LOG_FORMAT", "get_logger", "info", "warn", "error"],
    "utils.utils": ["check_inner", "check_dict", "check_isinstance", "check_uint64", "check_int64",
                    "check_positive_or_set_default", "check_int32", "check_uint32", "check_list_int32",
                    "check_list_int64", "check_list_uint64", "check_uint16", "check_uint8"],
    "v2.cache_manager": ["CacheManager"],
    "v2.config": ["ClusterConfig", "EngineConfig"],
    "v2.llm_datadist": ["LLMDataDist"],
    "v2.llm_types": ["PushType", "RegisterMemStatus", "Memtype", "MemInfo", "int_to_mem_status_dict", "Placement",
                     "CacheDesc", "Cache", "BlocksCacheKey", "CacheKey", "CacheKeyByIdAndIndex", "KvCache",
                     "LayerSynchronizer", "check_layer_range", "TransferWithCacheKeyConfig", "TransferConfig",
                     "CacheTask"],
    "v2.llm_utils": ["clone_cache_desc", "verify_cache_shape", "to_data_type", "is_invalid_id", "is_valid_id",
                     "calc_tensor_size", "CacheDescParser", "pack_cache_desc", "pack_cache_key",
                     "pack_cache_key_by_id", "pack_block_cache_key", "pack_mem_info", "TransferCacheParameters",
                     "layer_range_to_tensor_indices", "parse_listen_ip_info"],
}

#: names upstream defines that llmdd deliberately does not provide (docs/deviations.md)
NOT_PROVIDED = {"v2.llm_utils": ["TransferCacheJob", "TransferAsyncThread", "transfer_cache_async"]}


@pytest.fixture
def alias():
    llmdd.compat.install_alias()
    try:
        yield importlib.import_module("llm_datadist")
    finally:
        llmdd.compat.uninstall_alias()


def _attr_path(root, path: str):
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def test_v2_list_is_upstreams():
    assert llmdd.v2_list == UPSTREAM_V2_LIST
    for name in llmdd.v2_list:
        assert getattr(llmdd, name) is not None


def test_v2_list_from_import_through_the_alias(alias):
    namespace: dict = {}
    exec("from llm_datadist import v2_list", namespace)
    assert namespace["v2_list"] is llmdd.v2_list


@pytest.mark.parametrize("path", sorted(UPSTREAM_MODULES))
def test_module_is_an_attribute_after_import_llmdd(path):
    module = _attr_path(llmdd, path)
    assert module is importlib.import_module(f"llmdd.{path}")
    for name in UPSTREAM_MODULES[path]:
        assert getattr(module, name) is not None, f"llmdd.{path}.{name}"


@pytest.mark.parametrize("path", sorted(UPSTREAM_MODULES))
def test_module_through_the_alias_is_the_same_object(alias, path):
    aliased = importlib.import_module(f"llm_datadist.{path}")
    assert aliased is importlib.import_module(f"llmdd.{path}")
    assert _attr_path(alias, path) is aliased
    for name in UPSTREAM_MODULES[path]:
        namespace: dict = {}
        exec(f"from llm_datadist.{path} import {name}", namespace)
        assert namespace[name] is getattr(aliased, name)


@pytest.mark.parametrize("path, name", [(p, n) for p, names in NOT_PROVIDED.items() for n in names])
def test_native_only_names_say_why(path, name):
    module = importlib.import_module(f"llmdd.{path}")
    with pytest.raises(AttributeError, match="native transfer_cache_v2"):
        getattr(module, name)
    with pytest.raises(AttributeError, match="has no attribute"):
        getattr(module, "no_such_name")  # control: other names fail the ordinary way


def test_alias_distribution_in_a_fresh_interpreter():
    code = textwrap.dedent("""
        from llm_datadist import v2_list, LLMDataDist
        from llm_datadist.v2.llm_utils import parse_listen_ip_info
        from llm_datadist.v2.config import EngineConfig
        from llm_datadist.v2.llm_types import check_layer_range
        from llm_datadist.configs import trans_str_ip
        from llm_datadist.utils.utils import check_inner
        from llm_datadist.utils import log
        import llm_datadist, llmdd
        assert llm_datadist is llmdd and len(v2_list) == 23
        print(parse_listen_ip_info("10.1.2.3:26000"), trans_str_ip("1.0.0.0"), log.get_logger().name)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "compat", "llm-datadist-alias", "src"),
                                                       os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "('10.1.2.3', 26000) 1 LLM_DATADIST"


# ----------------------------------------------------------------- numpy table

def test_bytes_is_the_string_dtype_both_ways():
    from llmdd import data_type

    assert data_type.dtype_to_np_dtype[DataType.DT_STRING] is np.bytes_
    assert data_type.np_dtype_to_dtype[np.dtype(np.bytes_)] is DataType.DT_STRING
    assert data_type.valid_np_dtypes == list(data_type.dtype_to_np_dtype.values())
    assert np.bytes_ in data_type.valid_np_dtypes
    # bfloat16 has no numpy type: written as float16, never read back as BF16 (upstream's table)
    assert data_type.dtype_to_np_dtype[DataType.DT_BF16] is np.float16
    assert data_type.np_dtype_to_dtype[np.dtype(np.float16)] is DataType.DT_FLOAT16


def test_wrapper_dtype_round_trip_and_refusal():
    from llmdd import data_type

    for dt in DataType:
        assert data_type.get_python_dtype_from_wrapper_dtype(data_type.python_dtype_2_dwrapper_dtype[dt]) is dt
    with pytest.raises(ValueError, match=r"^The data type 999 is not supported\.$"):
        data_type.get_python_dtype_from_wrapper_dtype(999)


# ----------------------------------------------------------------- status

def test_status_code_is_an_int_enum_printing_its_name():
    assert LLMStatusCode.LLM_SUCCESS == 0 and LLMStatusCode.LLM_PARAM_INVALID == 0x5010B005
    assert str(LLMStatusCode.LLM_TIMEOUT) == "LLMStatusCode.LLM_TIMEOUT"
    assert llmdd.status.code_2_status(0x5010B006) is LLMStatusCode.LLM_ENGINE_FINALIZED
    assert llmdd.status.code_2_status(12345) is LLMStatusCode.LLM_FAILED
    with pytest.raises(LLMException, match=r"^\[x\] failed, error code is LLMStatusCode.LLM_TIMEOUT, y\.$") as info:
        llmdd.status.handle_llm_status(int(LLMStatusCode.LLM_TIMEOUT), "[x]", "y")
    assert info.value.status_code is LLMStatusCode.LLM_TIMEOUT
    llmdd.status.handle_llm_status(0, "[x]", "y")  # control: success raises nothing


# ----------------------------------------------------------------- configs.trans_str_ip

@pytest.mark.parametrize("ip, expected", [("127.0.0.1", 0x0100007F), ("1.2.3.4", 0x04030201), (7, 7), (True, True)])
def test_trans_str_ip(ip, expected):
    assert llmdd.configs.trans_str_ip(ip) == expected


def test_trans_str_ip_refuses_a_bad_string():
    with pytest.raises(RuntimeError, match=r"^Can not parse ip str:1\.2\.3\.x$"):
        llmdd.configs.trans_str_ip("1.2.3.x")


# ----------------------------------------------------------------- utils.log

def test_log_helpers_use_the_llm_datadist_logger(caplog):
    log = llmdd.utils.log
    logger = log.get_logger()
    assert logger is logging.getLogger("LLM_DATADIST") and log.get_logger() is logger
    handlers_before = list(logger.handlers)
    with caplog.at_level(logging.INFO, logger="LLM_DATADIST"):
        log.info("i %d", 1)
        log.warn("w %s", "x")
        log.error("e")
    got = [(r.levelno, r.getMessage(), os.path.basename(r.pathname))
           for r in caplog.records if r.name == "LLM_DATADIST"]
    here = os.path.basename(__file__)
    assert got == [(logging.INFO, "i 1", here), (logging.WARNING, "w x", here), (logging.ERROR, "e", here)]
    assert logger.handlers == handlers_before  # llmdd attaches no handler (docs/deviations.md)
    assert "%(funcName)s" in log.LOG_FORMAT


# ----------------------------------------------------------------- check_link_status

def test_check_link_status_in_cache_manager_mode():
    dd = LLMDataDist(LLMRole.DECODER, 3)
    with pytest.raises(RuntimeError, match="^llm datadist is not initialized$"):
        dd.check_link_status(1)
    dd.init({"llm.EnableCacheManager": "1"})
    try:
        with pytest.raises(LLMException) as info:
            dd.check_link_status(1)
        assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
        assert str(info.value) == "check_link_status is not supported when llm.EnableCacheManager is configured."
    finally:
        dd.finalize()


def test_check_layer_range_as_upstream():
    check = llmdd.v2.llm_types.check_layer_range
    assert check("r", None) is None
    assert check("r", range(0, 3)) is None
    for bad, msg in [(range(0, 4, 2), "check r.step == 1 failed"), (range(2, 2), "check 0 <= range.start"),
                     (range(-1, 2), "check 0 <= range.start")]:
        with pytest.raises(LLMException, match=msg) as info:
            check("r", bad)
        assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(TypeError):
        check("r", [0, 1])
    with pytest.raises(TypeError):
        check("r", None, allow_none=False)
