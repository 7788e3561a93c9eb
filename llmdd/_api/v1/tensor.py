"""``TensorDesc`` and ``Tensor`` of the legacy v1 API (host-side tensors, e.g. from ``get_cache_tensors``).

Upstream wraps a native GE tensor; here a ``Tensor`` owns a C-contiguous numpy buffer (a copy
of the data it was built from).  ``numpy()`` gives that buffer in the tensor's shape
(``copy=False``: a view, ``copy=True``: a copy).  Upstream's special cases are kept:
``DT_BF16`` reads back as float32 (the bf16 bits widened), ``DT_FLOAT16`` as float16, and a
string tensor (numpy ``str``/``bytes`` data, ``DT_STRING``) reads back only with ``copy=True``.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

from llmdd._base.lazy import np

from llmdd._base import enums as _enums
from llmdd._base.enums import DataType, get_python_dtype_from_wrapper_dtype
from llmdd._base.status import LLMException, LLMStatusCode
from llmdd._base.validation import check_isinstance

__all__ = ["TensorDesc", "Tensor"]


class TensorDesc:
    """``TensorDesc(dtype, shape)``: the data type and dimensions of a :class:`Tensor`."""

    def __init__(self, dtype: DataType, shape: Union[List[int], Tuple[int, ...]]) -> None:
        check_isinstance("dtype", dtype, DataType)
        check_isinstance("shape", shape, [list, tuple], int)
        self._dtype = dtype
        self._shape = list(shape) if shape is not None else None

    @property
    def dtype(self) -> DataType:
        return self._dtype

    @property
    def shape(self) -> List[int]:
        return self._shape

    def __str__(self) -> str:
        return f"TensorDesc(dtype={self.dtype}, shape={self.shape})"

    __repr__ = __str__


def _np_maps():
    return _enums.dtype_to_np_dtype, _enums.np_dtype_to_dtype


def _is_text(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.str_) or np.issubdtype(dtype, np.bytes_)


class Tensor:
    """``Tensor(data, tensor_desc=None)`` from a C-contiguous numpy array (copied) or another ``Tensor``."""

    _desc: TensorDesc
    _buf: np.ndarray

    def __init__(self, data: Union[np.ndarray, "Tensor", int], tensor_desc: Optional[TensorDesc] = None) -> None:
        check_isinstance("data", data, [np.ndarray, Tensor, int])
        check_isinstance("tensor_desc", tensor_desc, TensorDesc)
        if isinstance(data, Tensor):
            self._desc = data._desc
            self._buf = data._buf.copy()
        elif isinstance(data, np.ndarray):
            self._desc, self._buf = self._from_ndarray(data, tensor_desc)
        else:
            raise LLMException("Tensor(int) wraps a native tensor handle of upstream's wrapper; llmdd has no native "
                               "tensors: build a Tensor from a numpy array.",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)

    @staticmethod
    def from_tensor_tuple(tensor_tuple: Tuple[int, int, List[int]]) -> "Tensor":
        """Upstream builds a Tensor from its wrapper's ``(tensor handle, dtype, shape)`` tuple; the
        desc is checked here, and the handle is refused as in ``Tensor(int)``."""

        check_isinstance("tensor_tuple", tensor_tuple, (tuple, list), allow_none=False)
        if len(tensor_tuple) != 3:
            raise LLMException(f"tensor_tuple must be (tensor_id, dtype, shape), got {tensor_tuple!r}",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        desc = TensorDesc(get_python_dtype_from_wrapper_dtype(tensor_tuple[1]), tensor_tuple[2])
        return Tensor(tensor_tuple[0], desc)

    @classmethod
    def _from_buffer(cls, raw: np.ndarray, desc: TensorDesc) -> "Tensor":
        """A tensor owning ``raw`` (uint8 bytes of ``desc``'s shape and dtype); no copy."""
        obj = cls.__new__(cls)
        obj._desc = desc
        obj._buf = raw
        return obj

    @staticmethod
    def _from_ndarray(data: np.ndarray, desc: Optional[TensorDesc]) -> tuple[TensorDesc, np.ndarray]:
        to_np, from_np = _np_maps()
        if desc is not None:
            if list(data.shape) != desc.shape:
                raise RuntimeError(f"The shape of data:{data.shape} is not same as tensor_desc shape:{desc.shape}")
            expected = to_np.get(desc.dtype)
            if desc.dtype is DataType.DT_STRING:
                if not _is_text(data.dtype):
                    raise RuntimeError(f"The dtype of data:{data.dtype} is not same as tensor_desc dtype:{desc.dtype}")
            elif expected is None or data.dtype != np.dtype(expected):
                raise RuntimeError(f"The dtype of data:{data.dtype} is not same as tensor_desc dtype:{desc.dtype}")
        elif _is_text(data.dtype):
            desc = TensorDesc(DataType.DT_STRING, list(data.shape))
        elif data.dtype in from_np:
            desc = TensorDesc(from_np[data.dtype], list(data.shape))
        else:
            raise RuntimeError(f"The dtype of data:{data.dtype} is not valid, only support {list(from_np)}")
        if not data.flags.c_contiguous:
            raise RuntimeError("The data is not c_contiguous")
        if desc.dtype is DataType.DT_STRING:
            return desc, np.array(data.astype(np.bytes_), copy=True)
        return desc, np.array(data, copy=True)

    @property
    def tensor_desc(self) -> TensorDesc:
        return self._desc

    def numpy(self, copy: bool = False) -> np.ndarray:
        """The data as a numpy array of the tensor's shape (a view unless ``copy``)."""
        check_isinstance("copy", copy, bool, allow_none=False)
        desc = self._desc
        if desc.dtype is DataType.DT_STRING:
            if not copy:
                raise RuntimeError("String tensor only support when param copy is True.")
            return np.array([b.decode("utf-8", "replace") for b in self._buf.reshape(-1)]).reshape(desc.shape)
        buf = self._buf
        if desc.dtype is DataType.DT_BF16:
            # the bf16 bits widened to float32: always a new array, as upstream
            return (buf.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(desc.shape)
        to_np, _ = _np_maps()
        target = np.dtype(to_np[desc.dtype])
        arr = (buf if buf.dtype == target else buf.view(target)).reshape(desc.shape)
        return arr.copy() if copy else arr

    def __str__(self) -> str:
        return f"Tensor({self.numpy(self._desc.dtype is DataType.DT_STRING)},tensor_desc={self._desc})"

    __repr__ = __str__
