"""Upstream's enums, status helpers and small classes, name for name and value for value
(upstream hicann/hixl at 9ed283b27309, src/python/llm_datadist)."""

from __future__ import annotations

import enum

import pytest

import llmdd
from llmdd import (DataType, LLMDataDist, LLMException, LLMRole, LLMStatusCode, Memtype, Placement,
                   RegisterMemStatus, Status)
from llmdd.status import raise_if_false, raise_if_true
from llmdd.v2.llm_types import PushType, int_to_mem_status_dict

#: upstream's LLMStatusCode members, in its order (values: upstream's native ge::Status numbers)
STATUS_NAMES = [
    "LLM_SUCCESS", "LLM_FAILED", "LLM_PARAM_INVALID", "LLM_WAIT_PROCESS_TIMEOUT", "LLM_KV_CACHE_NOT_EXIST",
    "LLM_REPEAT_REQUEST", "LLM_REQUEST_ALREADY_COMPLETED", "LLM_ENGINE_FINALIZED", "LLM_NOT_YET_LINK",
    "LLM_ALREADY_LINK", "LLM_LINK_FAILED", "LLM_UNLINK_FAILED", "LLM_NOTIFY_PROMPT_UNLINK_FAILED",
    "LLM_CLUSTER_NUM_EXCEED_LIMIT", "LLM_PROCESSING_LINK", "LLM_DEVICE_OUT_OF_MEMORY", "LLM_PREFIX_ALREADY_EXIST",
    "LLM_PREFIX_NOT_EXIST", "LLM_SEQ_LENOVERLIMIT", "LLM_NO_FREE_BLOCK", "LLM_BLOCKS_OUT_OF_MEMORY",
    "LLM_EXIST_LINK", "LLM_FEATURE_NOT_ENABLED", "LLM_TIMEOUT", "LLM_LINK_BUSY", "LLM_OUT_OF_MEMORY",
    "LLM_DEVICE_MEM_ERROR", "LLM_SUSPECT_REMOTE_ERROR", "LLM_UNKNOWN_ERROR",
]


def test_status_code_members():
    assert set(LLMStatusCode.__members__) == set(STATUS_NAMES)
    assert issubclass(LLMStatusCode, enum.IntEnum)
    assert LLMStatusCode.LLM_SUCCESS == 0 and LLMStatusCode.LLM_UNKNOWN_ERROR == -1
    assert LLMStatusCode.LLM_ENGINE_FINALIZED == 0x5010B006 and LLMStatusCode.LLM_LINK_BUSY == 0x5010B01B
    assert all(str(m) == f"LLMStatusCode.{m.name}" for m in LLMStatusCode)


def test_status_class():
    ok, bad = Status(LLMStatusCode.LLM_SUCCESS), Status(LLMStatusCode.LLM_TIMEOUT)
    assert ok.is_ok() and ok.status_code is LLMStatusCode.LLM_SUCCESS
    assert not bad.is_ok() and bad.status_code is LLMStatusCode.LLM_TIMEOUT


def test_exception_default_and_given_status():
    assert LLMException("x").status_code is LLMStatusCode.LLM_SUCCESS      # upstream's default
    err = LLMException("a", "b", status_code=LLMStatusCode.LLM_NOT_YET_LINK)
    assert err.args == ("a", "b") and err.status_code is LLMStatusCode.LLM_NOT_YET_LINK
    assert isinstance(err, RuntimeError)


def test_raise_if_helpers_format_and_status():
    assert raise_if_false(True, "never {0}", 1) is None
    assert raise_if_true(False, "never") is None
    with pytest.raises(LLMException) as info:
        raise_if_false(False, "bad {0} of {name}", 3, name="x")
    assert str(info.value) == "bad 3 of x" and info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as info:
        raise_if_true(True, "busy", status_code=LLMStatusCode.LLM_LINK_BUSY)
    assert info.value.status_code is LLMStatusCode.LLM_LINK_BUSY


@pytest.mark.parametrize("cls, kind, members", [
    (LLMRole, enum.IntEnum, {"PROMPT": 1, "DECODER": 2, "MIX": 3}),
    (Placement, enum.IntEnum, {"HOST": 0, "DEVICE": 1}),
    (Memtype, enum.Enum, {"MEM_TYPE_DEVICE": 0, "MEM_TYPE_HOST": 1}),
    (RegisterMemStatus, enum.Enum, {"OK": 0, "PREPARING": 1, "FAILED": 2}),
    (PushType, enum.Enum, {"NO_CACHE_KEY": 0, "BLOCKS_CACHE_KEY": 1, "CACHE_KEY_BY_ID": 2}),
    (DataType, enum.Enum, {"DT_FLOAT": 0, "DT_FLOAT16": 1, "DT_INT8": 2, "DT_INT32": 3, "DT_UINT8": 4,
                           "DT_INT16": 6, "DT_UINT16": 7, "DT_UINT32": 8, "DT_INT64": 9, "DT_UINT64": 10,
                           "DT_DOUBLE": 11, "DT_BOOL": 12, "DT_STRING": 13, "DT_BF16": 27}),
])
def test_enums(cls, kind, members):
    assert issubclass(cls, kind)
    assert {m.name: m.value for m in cls} == members


def test_int_enums_print_their_qualified_name():
    assert str(LLMRole.DECODER) == "LLMRole.DECODER" and str(Placement.HOST) == "Placement.HOST"


def test_int_to_mem_status_dict():
    assert int_to_mem_status_dict == {0: RegisterMemStatus.OK, 1: RegisterMemStatus.PREPARING,
                                      2: RegisterMemStatus.FAILED}


def test_llmdatadist_public_methods_are_upstreams():
    upstream = {"init", "link", "unlink", "query_register_mem_status", "cache_manager", "finalize",
                "check_link_status", "link_clusters", "unlink_clusters", "switch_role", "kv_cache_manager",
                "cluster_id"}
    assert upstream <= set(dir(LLMDataDist))


def test_cache_manager_public_methods_are_upstreams():
    upstream = {"check_cache_key", "allocate_blocks_cache", "allocate_cache", "copy_blocks", "copy_cache",
                "deallocate_blocks_cache", "deallocate_cache", "pull_blocks", "pull_cache", "register_cache",
                "register_blocks_cache", "unregister_cache", "remove_cache_key", "remap_registered_memory",
                "set_is_call_linked", "swap_blocks", "transfer_cache_async", "push_cache", "push_blocks"}
    assert upstream <= set(dir(llmdd.v2.cache_manager.CacheManager))


def test_cache_manager_check_cache_key_is_static():
    from llmdd import CacheKey

    llmdd.v2.cache_manager.CacheManager.check_cache_key(CacheKey(1, req_id=2))
    with pytest.raises(LLMException) as info:
        llmdd.v2.cache_manager.CacheManager.check_cache_key(CacheKey(1, req_id=2**64 - 1))
    assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
