"""CuPy interop: arrays (with bfloat16 travelling as uint16 bits, CuPy having no bfloat16),
CuPy's current stream, its memory pool on a stream.

Imported only once CuPy is; NumPy arrays given to the CuPy adapter go through here too
(they run on the reference backend).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import cupy
import numpy as np

from ..dtypes import DType
from ..errors import ArgumentError
from ..tensors import TensorDesc
from .numpy import BITS, describe_array
from .numpy import describe as describe_numpy

__all__ = ["BITS", "native_dtype", "describe", "signature", "current_stream", "empty",
           "workspace"]

#: DType -> the NumPy/CuPy dtype of its storage (bfloat16: its bits).
_NATIVE = {DType.FLOAT16: np.dtype(np.float16), DType.FLOAT32: np.dtype(np.float32),
           DType.BFLOAT16: np.dtype(np.uint16), DType.INT32: np.dtype(np.int32),
           DType.INT64: np.dtype(np.int64)}


def native_dtype(dtype: DType, name: str = "out_dtype") -> np.dtype:
    try:
        return _NATIVE[dtype]
    except KeyError:
        raise ArgumentError(name, f"expected bfloat16, float16 or float32, got {dtype}") from None


def describe(arr: Any, name: str, bfloat16_bits: bool = False,
             transpose: bool = False) -> TensorDesc:
    """A TensorDesc of a CuPy or NumPy array (of ``arr.T`` when ``transpose``);
    ``bfloat16_bits``: read uint16 / int16 as bfloat16."""
    if isinstance(arr, cupy.ndarray):
        return describe_array(arr, name, arr.data.ptr, "cuda", arr.data.device_id, "cupy",
                              bfloat16_bits=bfloat16_bits, transpose=transpose)
    return describe_numpy(arr, name, bfloat16_bits=bfloat16_bits, transpose=transpose)


def signature(arr: Any) -> Optional[Tuple[int, tuple]]:
    """``(address, (shape, strides, dtype, device_type, device_id))`` of a CuPy / NumPy array
    from its raw attributes (a cache key: checked by ``describe`` when first seen); None for
    other arrays."""
    kind = type(arr)
    if kind is cupy.ndarray:
        return arr.data.ptr, (arr.shape, arr.strides, arr.dtype, "cuda", arr.data.device_id)
    if kind is np.ndarray:
        return arr.__array_interface__["data"][0], (arr.shape, arr.strides, arr.dtype, "cpu", 0)
    return None


def current_stream(device_id: int) -> int:
    return cupy.cuda.get_current_stream(device_id).ptr


def empty(shape: Sequence[int], dtype: np.dtype, device_id: int, stream: Optional[int]):
    """A CuPy array from the pool of ``device_id``, on ``stream`` (None: the current one)."""
    with cupy.cuda.Device(device_id):
        if stream is not None:  # the pool orders reuse by stream
            with cupy.cuda.ExternalStream(stream):
                return cupy.empty(tuple(shape), dtype)
        return cupy.empty(tuple(shape), dtype)


# (device, stream) -> the eager workspace of that stream (launches on it run in order).
_workspaces: dict = {}


def workspace(nbytes: int, device_id: int, stream: int) -> Any:
    """A zero-filled uint8 array from the pool for launches on ``stream`` (CuPy's current
    stream on ``device_id``): one per stream, kept and grown, except while ``stream`` is being captured into a
    CUDA graph: then a fresh one, zeroed on the stream (a node of the graph), which the caller
    holds until the launch is enqueued (the pool frees it in stream order)."""
    if cupy.cuda.get_current_stream(device_id).is_capturing():
        with cupy.cuda.Device(device_id):
            return cupy.zeros(nbytes, dtype=cupy.uint8)
    key = (device_id, stream)
    ws = _workspaces.get(key)
    if ws is None or ws.nbytes < nbytes:
        with cupy.cuda.Device(device_id):
            ws = _workspaces[key] = cupy.zeros(max(nbytes, 1 << 16), dtype=cupy.uint8)
    return ws
