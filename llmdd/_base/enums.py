"""Enums of the contract: roles, placements, data types, memory types, statuses."""

from __future__ import annotations

import enum

__all__ = [
    "LLMRole",
    "Placement",
    "DataType",
    "Memtype",
    "RegisterMemStatus",
    "PushType",
    "int_to_mem_status_dict",
    "DTYPE_ITEMSIZE",
    "dtype_to_np_dtype",
    "np_dtype_to_dtype",
    "get_python_dtype_from_wrapper_dtype",
    "python_dtype_2_dwrapper_dtype",
]


class LLMRole(enum.IntEnum):
    PROMPT = 1
    DECODER = 2
    MIX = 3

    def __str__(self) -> str:
        return f"LLMRole.{self.name}"


ROLE_TO_STR = {LLMRole.PROMPT: "Prompt", LLMRole.DECODER: "Decoder", LLMRole.MIX: "Mix"}


class Placement(enum.IntEnum):
    HOST = 0
    DEVICE = 1

    def __str__(self) -> str:
        return f"Placement.{self.name}"


class DataType(enum.Enum):
    """Element types, valued with upstream's ``ge::DataType`` numbers."""

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_BF16 = 27
    DT_INT8 = 2
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT8 = 4
    DT_INT32 = 3
    DT_INT64 = 9
    DT_UINT32 = 8
    DT_UINT64 = 10
    DT_BOOL = 12
    DT_DOUBLE = 11
    DT_STRING = 13


#: bytes per element; DT_STRING has no fixed size
DTYPE_ITEMSIZE = {
    DataType.DT_FLOAT: 4, DataType.DT_INT32: 4, DataType.DT_UINT32: 4,
    DataType.DT_FLOAT16: 2, DataType.DT_BF16: 2, DataType.DT_INT16: 2, DataType.DT_UINT16: 2,
    DataType.DT_INT8: 1, DataType.DT_UINT8: 1, DataType.DT_BOOL: 1,
    DataType.DT_INT64: 8, DataType.DT_UINT64: 8, DataType.DT_DOUBLE: 8,
}

#: upstream keeps a map from its own dtype to the native wrapper's; here they are the same values
python_dtype_2_dwrapper_dtype = {dt: dt.value for dt in DataType}
_wrapper_to_python = {v: k for k, v in python_dtype_2_dwrapper_dtype.items()}


def get_python_dtype_from_wrapper_dtype(wrapper_dtype: int) -> DataType:
    try:
        return _wrapper_to_python[wrapper_dtype]
    except KeyError:
        raise ValueError(f"The data type {wrapper_dtype} is not supported.") from None


def _np_maps():
    import numpy as np

    to_np = {
        DataType.DT_FLOAT: np.float32, DataType.DT_FLOAT16: np.float16,
        DataType.DT_BF16: np.float16,  # as upstream: numpy has no bfloat16
        DataType.DT_INT8: np.int8, DataType.DT_INT16: np.int16, DataType.DT_UINT16: np.uint16,
        DataType.DT_UINT8: np.uint8, DataType.DT_INT32: np.int32, DataType.DT_INT64: np.int64,
        DataType.DT_UINT32: np.uint32, DataType.DT_UINT64: np.uint64, DataType.DT_BOOL: np.bool_,
        DataType.DT_DOUBLE: np.float64, DataType.DT_STRING: np.bytes_,
    }
    from_np: dict[object, DataType] = {}
    for dt, npt in to_np.items():
        if dt is not DataType.DT_BF16:
            from_np[np.dtype(npt)] = dt
    from_np.setdefault(np.dtype(np.str_), DataType.DT_STRING)  # llmdd: unicode text is a string tensor too
    return to_np, from_np


def __getattr__(name: str):
    # numpy maps are built lazily on first access, as upstream does
    if name in ("dtype_to_np_dtype", "np_dtype_to_dtype", "valid_np_dtypes"):
        to_np, from_np = _np_maps()
        globals()["dtype_to_np_dtype"] = to_np
        globals()["np_dtype_to_dtype"] = from_np
        globals()["valid_np_dtypes"] = list(to_np.values())  # numpy types, one per DataType, as upstream
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Memtype(enum.Enum):
    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


class RegisterMemStatus(enum.Enum):
    OK = 0
    PREPARING = 1
    FAILED = 2


int_to_mem_status_dict = {0: RegisterMemStatus.OK, 1: RegisterMemStatus.PREPARING, 2: RegisterMemStatus.FAILED}


class PushType(enum.Enum):
    """Internal: how a push addresses its destination."""

    NO_CACHE_KEY = 0
    BLOCKS_CACHE_KEY = 1
    CACHE_KEY_BY_ID = 2
