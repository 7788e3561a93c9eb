"""``llm_datadist.utils.utils``: the argument checks behave as upstream's (return values, what is
refused and with which exception, the messages clients and upstream's tests see)."""

from __future__ import annotations

import ctypes

import pytest

from llmdd.utils.utils import (check_dict, check_inner, check_int32, check_int64, check_isinstance,
                               check_list_int32, check_list_int64, check_list_uint64,
                               check_positive_or_set_default, check_uint8, check_uint16, check_uint32, check_uint64)


# ----------------------------------------------------------------- check_isinstance

def test_check_isinstance_returns_the_value():
    value = [1, 2]
    assert check_isinstance("v", value, [list, tuple], int) is value
    assert check_isinstance("v", 3, int) == 3
    assert check_isinstance("v", None, int) is None            # None passes by default
    assert check_isinstance("v", True, int) is True            # bool is an int
    assert check_isinstance("v", (1,), (list, tuple)) == (1,)  # a tuple of classes works as a list


def test_check_isinstance_messages():
    with pytest.raises(TypeError) as info:
        check_isinstance("v", 1.0, [int, str])
    assert str(info.value) == "v only support ['int', 'str'], but got <class 'float'>."
    with pytest.raises(TypeError) as info:
        check_isinstance("v", "x", int, extra_fmt="While enable_remote_cache_accessible is True, ")
    assert str(info.value) == ("While enable_remote_cache_accessible is True, "
                               "v only support ['int'], but got <class 'str'>.")
    with pytest.raises(TypeError) as info:
        check_isinstance("v", None, int, allow_none=False)
    assert str(info.value) == "v only support ['int'], but got <class 'NoneType'>."
    with pytest.raises(TypeError) as info:
        check_isinstance("v", [1, "2"], list, int)
    assert str(info.value) == "v inner type only support [<class 'int'>], but got <class 'str'>."


def test_check_inner():
    assert check_inner("v", [1, 2], int) is None
    assert check_inner("v", [], str) is None
    with pytest.raises(TypeError) as info:
        check_inner("v", [1, 2.5], int)
    assert str(info.value) == "v inner type only support [<class 'int'>], but got <class 'float'>."


# ----------------------------------------------------------------- check_dict

def test_check_dict_accepts_and_returns_none():
    assert check_dict("d", {1: [2, 3], 4: []}, int, list, int) is None
    assert check_dict("d", {}, str, str) is None


@pytest.mark.parametrize("d, msg", [
    ({"a": [1]}, "d dict key only support <class 'int'>, but got <class 'str'>."),
    ({1: (1,)}, "d dict value only support <class 'list'>, but got <class 'tuple'>."),
    ({1: [1, "x"]}, "dict value inner type only support [<class 'int'>], but got <class 'str'>."),
])
def test_check_dict_messages(d, msg):
    with pytest.raises(TypeError) as info:
        check_dict("d", d, int, list, int)
    assert str(info.value) == msg


# ----------------------------------------------------------------- integer ranges

RANGES = [
    (check_uint8, "uint8", 0, 2**8 - 1),
    (check_uint16, "uint16", 0, 2**16 - 1),
    (check_uint32, "uint32", 0, 2**32 - 1),
    (check_int32, "int32", -(2**31), 2**31 - 1),
    (check_uint64, "uint64", 0, 2**64 - 1),
    (check_int64, "int64", -(2**63), 2**63 - 1),
]


@pytest.mark.parametrize("check, kind, low, high", RANGES)
def test_integer_checks_bounds_and_messages(check, kind, low, high):
    assert check("x", low) is None and check("x", high) is None
    for bad in (low - 1, high + 1):
        with pytest.raises(ValueError) as info:
            check("x", bad)
        assert str(info.value) == f"x's value is out of range,{bad} is not a {kind} value."
    with pytest.raises(TypeError) as info:
        check("x", 1.0)
    assert str(info.value) == "x only support ['int'], but got <class 'float'>."
    with pytest.raises(TypeError):
        check("x", None)   # these never let None through


def test_upstream_test_utils_cases():
    # upstream's tests/python/test_utils.py: every one raises ValueError
    for call in (lambda: check_uint64("cluster", -1),
                 lambda: check_int64("cluster", ctypes.c_uint64(2**64 - 1).value),
                 lambda: check_int32("cluster", ctypes.c_uint64(2**64 - 1).value),
                 lambda: check_uint32("cluster", -1),
                 lambda: check_list_int32("cluster_ids", [0, 1, ctypes.c_uint64(2**64 - 1).value]),
                 lambda: check_uint16("cluster", -1),
                 lambda: check_uint8("cluster", -1)):
        with pytest.raises(ValueError):
            call()


@pytest.mark.parametrize("check, bad, kind", [
    (check_list_int32, 2**31, "int32"), (check_list_int64, 2**63, "int64"), (check_list_uint64, -1, "uint64"),
])
def test_list_checks_name_the_argument(check, bad, kind):
    assert check("ids", [0, 1]) is None
    assert check("ids", (0,)) is None
    assert check("ids", iter([0, 1])) is None    # any iterable: the caller checks the container
    with pytest.raises(ValueError) as info:
        check("ids", [0, bad])
    assert str(info.value) == f"ids's value is out of range,{bad} is not a {kind} value."


# ----------------------------------------------------------------- check_positive_or_set_default

@pytest.mark.parametrize("value, default, expected", [
    (None, -1, -1), (None, 7, 7), (0, -1, 0), (5, -1, 5), (2**63 - 1, -1, 2**63 - 1), (True, -1, True),
])
def test_positive_or_default_accepts(value, default, expected):
    assert check_positive_or_set_default("n", value, default) == expected


def test_positive_or_default_refuses():
    with pytest.raises(ValueError) as info:
        check_positive_or_set_default("n", -1)
    assert str(info.value) == "n's value:-1 is invalid, should be >= 0"
    with pytest.raises(ValueError) as info:
        check_positive_or_set_default("n", 2**63)
    assert str(info.value) == f"n's value is out of range,{2**63} is not a int64 value."
    with pytest.raises(TypeError):
        check_positive_or_set_default("n", 1.5)
