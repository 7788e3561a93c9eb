"""``llm_datadist.data_type``: ``DataType`` and its tables.

``dtype_to_np_dtype``, ``np_dtype_to_dtype`` and ``valid_np_dtypes`` are built on first access
(numpy is imported then, not at import of this module), as upstream does.
"""

from llmdd._base import enums as _enums
from llmdd._base.enums import DataType, get_python_dtype_from_wrapper_dtype, python_dtype_2_dwrapper_dtype

__all__ = ["DataType", "python_dtype_2_dwrapper_dtype", "get_python_dtype_from_wrapper_dtype"]

_LAZY = ("dtype_to_np_dtype", "np_dtype_to_dtype", "valid_np_dtypes")


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(_enums, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__} has no attribute {name}")
