"""``llm_datadist.data_type``."""

from .. import _enums
from .._enums import DataType, get_python_dtype_from_wrapper_dtype, python_dtype_2_dwrapper_dtype  # noqa: F401


def __getattr__(name: str):
    if name in ("dtype_to_np_dtype", "np_dtype_to_dtype", "valid_np_dtypes"):
        return getattr(_enums, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
