"""Argument checks with the contract's exception types and messages.

* a wrong type raises ``TypeError`` ("<name> only support ['int'], but got <class 'float'>.");
* an integer out of its range raises ``ValueError``
  ("<name>'s value is out of range,<v> is not a uint32 value.");
* semantic checks live with their callers and raise ``LLMException(LLM_PARAM_INVALID)``.

``bool`` is an ``int`` subclass and passes the integer checks, as upstream.
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = [
    "check_isinstance",
    "check_int",
    "check_uint64",
    "check_int64",
    "check_int32",
    "check_uint32",
    "check_uint16",
    "check_uint8",
    "check_dict",
    "check_list_of",
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


def _names(classes: Any) -> list[str]:
    if not isinstance(classes, (list, tuple)):
        classes = [classes]
    return [c.__name__ for c in classes]


def check_isinstance(name: str, value: Any, classes: Any, inner_class: Any = None,
                     extra_fmt: str = "", allow_none: bool = True) -> None:
    """TypeError unless ``value`` is an instance of ``classes`` (None passes by default).

    With ``inner_class``, every element of the (list/tuple) value must be of it.
    """
    if value is None and allow_none:
        return
    cls_tuple = tuple(classes) if isinstance(classes, (list, tuple)) else (classes,)
    if not isinstance(value, cls_tuple):
        raise TypeError(f"{name} only support {_names(classes)}, but got {type(value)}.{extra_fmt}")
    if inner_class is not None:
        inner = tuple(inner_class) if isinstance(inner_class, (list, tuple)) else (inner_class,)
        for item in value:
            if not isinstance(item, inner):
                raise TypeError(f"{name} element only support {_names(inner_class)}, "
                                f"but got {type(item)}.{extra_fmt}")


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


def check_dict(name: str, d: Any, k_cls: Any, v_cls: Any, v_inner_cls: Any = None) -> None:
    check_isinstance(name, d, dict, allow_none=False)
    for k, v in d.items():
        check_isinstance(f"{name} key", k, k_cls, allow_none=False)
        check_isinstance(f"{name} value", v, v_cls, inner_class=v_inner_cls, allow_none=False)


def check_list_of(name: str, values: Any, kind: str, containers: tuple = (list, tuple)) -> None:
    """TypeError unless a list/tuple; each element checked as integer ``kind``."""
    if not isinstance(values, containers):
        raise TypeError(f"{name} only support {_names(list(containers))}, but got {type(values)}.")
    for i, v in enumerate(values):
        check_int(f"{name}[{i}]", v, kind)


def check_list_uint64(name: str, values: Iterable[int]) -> None:
    check_list_of(name, values, "uint64")


def check_list_int64(name: str, values: Iterable[int]) -> None:
    check_list_of(name, values, "int64")


def check_list_int32(name: str, values: Iterable[int]) -> None:
    check_list_of(name, values, "int32")


def check_positive_or_set_default(name: str, value: Any, default: int = -1) -> int:
    if value is None:
        return default
    check_int64(name, value)
    if value <= 0:
        raise ValueError(f"{name}'s value must be positive, but got {value}.")
    return value
