"""Argument checks with the contract's exception types and messages.

* a wrong type raises ``TypeError`` ("<name> only support ['int'], but got <class 'float'>.");
* an integer out of its range raises ``ValueError``
  ("<name>'s value is out of range,<v> is not a uint32 value.");
* semantic checks live with their callers and raise ``LLMException(LLM_PARAM_INVALID)``.

The functions upstream's ``llm_datadist.utils.utils`` defines behave as there (return values,
what they refuse, messages); ``check_int`` is llmdd's own helper.

``bool`` is an ``int`` subclass and passes the integer checks, as upstream.
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = [
    "check_inner",
    "check_isinstance",
    "check_int",
    "check_uint64",
    "check_int64",
    "check_int32",
    "check_uint32",
    "check_uint16",
    "check_uint8",
    "check_dict",
    "check_list_uint64",
    "check_list_int64",
    "check_list_int32",
    "check_positive_or_set_default",
    "UINT64_MAX",
    "INVALID_ID",
]

UINT64_MAX = 2**64 - 1
INVALID_ID = UINT64_MAX

_RANGES = {
    "uint64": (0, 2**64 - 1),
    "int64": (-(2**63), 2**63 - 1),
    "int32": (-(2**31), 2**31 - 1),
    "uint32": (0, 2**32 - 1),
    "uint16": (0, 2**16 - 1),
    "uint8": (0, 2**8 - 1),
}


def _as_list(classes: Any) -> list:
    return list(classes) if isinstance(classes, (list, tuple)) else [classes]


def check_inner(arg_name: str, arg_value: Any, inner_class: Any) -> None:
    """TypeError unless every element of ``arg_value`` is an ``inner_class``.

    The message names the class list as upstream prints it (``[<class 'int'>]``).
    """
    for item in arg_value:
        if not isinstance(item, inner_class):
            raise TypeError(f"{arg_name} inner type only support {[inner_class]}, but got {type(item)}.")


def check_isinstance(arg_name: str, arg_value: Any, classes: Any, inner_class: Any = None,
                     extra_fmt: str = "", allow_none: bool = True) -> Any:
    """Return ``arg_value`` if it is an instance of one of ``classes`` (None passes when
    ``allow_none``), else TypeError.  ``extra_fmt`` prefixes the message; with
    ``inner_class`` the elements of the matched value are checked by :func:`check_inner`.
    """
    if allow_none and arg_value is None:
        return arg_value
    classes = _as_list(classes)
    for cls in classes:
        if isinstance(arg_value, cls):
            if inner_class:
                check_inner(arg_name, arg_value, tuple(inner_class) if isinstance(inner_class, list) else inner_class)
            return arg_value
    raise TypeError(f"{extra_fmt}{arg_name} only support {[c.__name__ for c in classes]}, "
                    f"but got {type(arg_value)}.")


def check_int(name: str, value: Any, kind: str) -> None:
    if not isinstance(value, int):
        raise TypeError(f"{name} only support ['int'], but got {type(value)}.")
    low, high = _RANGES[kind]
    if not low <= value <= high:
        raise ValueError(f"{name}'s value is out of range,{value} is not a {kind} value.")


def check_uint64(name: str, value: Any) -> None:
    check_int(name, value, "uint64")


def check_int64(name: str, value: Any) -> None:
    check_int(name, value, "int64")


def check_int32(name: str, value: Any) -> None:
    check_int(name, value, "int32")


def check_uint32(name: str, value: Any) -> None:
    check_int(name, value, "uint32")


def check_uint16(name: str, value: Any) -> None:
    check_int(name, value, "uint16")


def check_uint8(name: str, value: Any) -> None:
    check_int(name, value, "uint8")


def check_dict(arg_name: str, arg_value: Any, k_class: Any, v_class: Any, v_inner_class: Any = None) -> None:
    """Every key must be a ``k_class`` and every value a ``v_class`` (TypeError); with
    ``v_inner_class`` the elements of each value too.  The caller checks that it is a dict."""
    for k, v in arg_value.items():
        if not isinstance(k, k_class):
            raise TypeError(f"{arg_name} dict key only support {k_class}, but got {type(k)}.")
        if not isinstance(v, v_class):
            raise TypeError(f"{arg_name} dict value only support {v_class}, but got {type(v)}.")
        if v_inner_class is not None:
            check_inner("dict value", v, v_inner_class)


def check_list_uint64(name: str, values: Iterable[int]) -> None:
    """Each element a uint64 (the caller checks the container); errors name ``name`` itself."""
    for value in values:
        check_uint64(name, value)


def check_list_int64(name: str, values: Iterable[int]) -> None:
    for value in values:
        check_int64(name, value)


def check_list_int32(name: str, values: Iterable[int]) -> None:
    for value in values:
        check_int32(name, value)


def check_positive_or_set_default(name: str, value: Any, default: int = -1) -> int:
    """``default`` for None; else an int64 that is not negative (0 passes), returned as is."""
    if value is None:
        return default
    check_int64(name, value)
    if value < 0:
        raise ValueError(f"{name}'s value:{value} is invalid, should be >= 0")
    return value
