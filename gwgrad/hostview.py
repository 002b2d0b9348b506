"""NumPy views of host memory described by a ``TensorDesc`` (no copy)."""

from __future__ import annotations

import ctypes

import numpy as np

from .dtypes import DType
from .tensors import TensorDesc

#: How each dtype's bits are held in NumPy without ml_dtypes: 16-bit floats other than FP16,
#: FP8 and packed FP4 stay raw integers and are decoded by the reference backend.
RAW_NUMPY = {
    DType.BFLOAT16: np.dtype(np.uint16),
    DType.FLOAT16: np.dtype(np.float16),
    DType.FLOAT32: np.dtype(np.float32),
    DType.FLOAT64: np.dtype(np.float64),
    DType.INT32: np.dtype(np.int32),
    DType.INT64: np.dtype(np.int64),
    DType.UINT8: np.dtype(np.uint8),
    DType.FLOAT8_E4M3FN: np.dtype(np.uint8),
    DType.FLOAT8_E5M2: np.dtype(np.uint8),
    DType.FLOAT8_E8M0FNU: np.dtype(np.uint8),
    DType.FLOAT4_E2M1FN_X2: np.dtype(np.uint8),
}


def strided_view(ptr: int, shape, strides, np_dtype) -> np.ndarray:
    """A writable view of host memory at ``ptr`` with ``strides`` in elements."""
    np_dtype = np.dtype(np_dtype)
    shape, strides = tuple(int(s) for s in shape), tuple(int(s) for s in strides)
    if 0 in shape:
        return np.empty(shape, np_dtype)
    if ptr == 0:
        raise ValueError("cannot view a null host address")
    low = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    high = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0)
    count = high - low + 1
    buffer = (ctypes.c_char * (count * np_dtype.itemsize)).from_address(ptr + low * np_dtype.itemsize)
    base = np.frombuffer(buffer, dtype=np_dtype, count=count)
    return np.lib.stride_tricks.as_strided(
        base[-low:], shape, tuple(s * np_dtype.itemsize for s in strides))


def host_view(desc: TensorDesc) -> np.ndarray:
    """``desc``'s elements (raw bits for bfloat16, FP8 and FP4) as a NumPy view."""
    if desc.is_cuda:
        raise ValueError(f"host_view needs host memory, got a tensor on {desc.device}")
    return strided_view(desc.ptr, desc.shape, desc.strides, RAW_NUMPY[desc.dtype])
