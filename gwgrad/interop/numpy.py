"""NumPy interop: host arrays (ml_dtypes' bfloat16 / FP8 included) for the reference backend."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..dtypes import DType, as_dtype
from ..errors import ArgumentError
from ..tensors import TensorDesc

__all__ = ["BITS", "describe", "describe_array", "numpy_dtype", "empty"]


#: Integer dtypes that may carry bfloat16 bits (flagged by the caller: CuPy has no bfloat16).
BITS = (np.dtype(np.uint16), np.dtype(np.int16))


def describe_array(arr, name: str, address: int, device_type: str, device_id: int,
                   framework: str, *, bfloat16_bits: bool = False,
                   transpose: bool = False) -> TensorDesc:
    """A TensorDesc of any array with NumPy's ``dtype`` / ``shape`` / byte ``strides``
    (NumPy, CuPy); ``bfloat16_bits``: read uint16 / int16 as bfloat16; ``transpose``: of
    ``arr.T`` without a view."""
    dtype = arr.dtype
    if dtype in BITS and bfloat16_bits:
        gw_dtype = DType.BFLOAT16
    elif dtype in BITS and framework == "cupy":
        raise ArgumentError(name, f"expected a float array, or 16-bit integers holding "
                                  f"bfloat16 bits with dtype='bfloat16', got {dtype}")
    else:
        try:
            gw_dtype = as_dtype(dtype, name)
        except ValueError:
            hint = (" (pass FP4 packed two values per byte, as torch.float4_e2m1fn_x2)"
                    if "float4" in dtype.name else "")
            raise ArgumentError(name, f"unsupported dtype {dtype.name}{hint}") from None
    itemsize = dtype.itemsize
    if any(s % itemsize for s in arr.strides):
        raise ArgumentError(name, f"strides {arr.strides} (bytes) are not multiples of the "
                                  f"element size {itemsize}")
    shape, strides = tuple(arr.shape), tuple(s // itemsize for s in arr.strides)
    if transpose:
        if len(shape) != 2:
            raise ArgumentError(name, f"expected 2 dims, got shape {shape}")
        shape, strides = shape[::-1], strides[::-1]
    read_only = framework == "numpy" and not arr.flags.writeable
    return TensorDesc(address, shape, strides, gw_dtype, device_type, device_id, framework, arr,
                      read_only)


def describe(a: np.ndarray, name: str, *, bfloat16_bits: bool = False,
             transpose: bool = False) -> TensorDesc:
    return describe_array(a, name, a.__array_interface__["data"][0], "cpu", 0, "numpy",
                          bfloat16_bits=bfloat16_bits, transpose=transpose)


def numpy_dtype(dtype: DType):
    if dtype == DType.BFLOAT16:
        try:
            import ml_dtypes
        except ImportError:
            raise RuntimeError("a bfloat16 NumPy output needs the ml_dtypes package "
                               "(pip install ml_dtypes), or pass wgrad_tensor") from None
        return ml_dtypes.bfloat16
    return np.dtype(dtype.value)


def empty(shape: Sequence[int], dtype: DType) -> np.ndarray:
    return np.empty(tuple(shape), dtype=numpy_dtype(dtype))
