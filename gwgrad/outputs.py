"""Output storage the wrapper creates when the caller passes none.

The output is allocated in the framework of ``a_tensor`` (torch, CuPy, NumPy), so callers
get back the kind of array they gave; raw pointers and JAX arrays get a ``DeviceBuffer``.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Sequence, Tuple

import numpy as np

from . import memory
from .dtypes import DType
from .tensors import TensorDesc, as_tensor_desc, from_pointer

# CuPy has no bfloat16; it gets a DeviceBuffer for that.
_CUPY_DTYPES = {DType.FLOAT16: np.float16, DType.FLOAT32: np.float32, DType.INT64: np.int64}


def _numpy_dtype(dtype: DType):
    if dtype == DType.BFLOAT16:
        try:
            import ml_dtypes
        except ImportError:
            raise RuntimeError("a bfloat16 NumPy output needs the ml_dtypes package "
                               "(pip install ml_dtypes), or pass wgrad_tensor") from None
        return ml_dtypes.bfloat16
    return np.dtype(dtype.value)


def _torch_stream_context(torch: Any, ref: TensorDesc, stream: int):
    # Allocate on the launch stream: torch's caching allocator then keeps the memory from other
    # streams until the work enqueued there is done.
    if not ref.is_cuda or stream == torch.cuda.current_stream(ref.device_id).cuda_stream:
        return contextlib.nullcontext()
    device = torch.device("cuda", ref.device_id)
    return torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device))


def allocate(ref: TensorDesc, shape: Sequence[int], dtype: DType, stream: int) -> Tuple[Any, TensorDesc]:
    """An uninitialized array like ``ref``'s (framework and device); returns (array, desc)."""
    shape = tuple(shape)
    framework = ref.framework
    if framework == "torch" and "torch" in sys.modules:
        torch = sys.modules["torch"]
        device = torch.device("cuda", ref.device_id) if ref.is_cuda else torch.device("cpu")
        with _torch_stream_context(torch, ref, stream):
            out = torch.empty(shape, dtype=getattr(torch, dtype.value), device=device)
    elif framework == "cupy" and ref.is_cuda and dtype in _CUPY_DTYPES and "cupy" in sys.modules:
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(ref.device_id), cupy.cuda.ExternalStream(stream):
            out = cupy.empty(shape, dtype=_CUPY_DTYPES[dtype])
    elif not ref.is_cuda:
        out = np.empty(shape, dtype=_numpy_dtype(dtype))
    else:
        out = memory.DeviceBuffer(shape, dtype, ref.device_id)
    return out, as_tensor_desc(out, "wgrad_tensor")


def pointer_array(stacked: TensorDesc, stream: int) -> TensorDesc:
    """The int64 per-expert addresses into a stacked (num_experts, hidden, intermediate) output.

    torch builds them with a device kernel (so this also works under CUDA-graph capture);
    otherwise they are copied from the host into a per-stream scratch buffer, which the next
    call on the same stream may overwrite only after this call's kernel (stream order).
    """
    experts = stacked.shape[0]
    step = stacked.strides[0] * stacked.dtype.itemsize
    if not stacked.is_cuda:
        host = stacked.ptr + step * np.arange(experts, dtype=np.int64)
        return as_tensor_desc(host, "wgrad_ptrs")
    if stacked.framework == "torch" and "torch" in sys.modules:
        torch = sys.modules["torch"]
        with _torch_stream_context(torch, stacked, stream):
            ptrs = torch.arange(experts, dtype=torch.int64,
                                device=torch.device("cuda", stacked.device_id)) * step + stacked.ptr
        return as_tensor_desc(ptrs, "wgrad_ptrs")
    return address_array(stacked.ptr + step * np.arange(experts, dtype=np.int64),
                         stacked.device_id, stream)


def address_array(addresses: np.ndarray, device_id: int, stream: int) -> TensorDesc:
    """Host int64 ``addresses`` copied to a per-stream scratch buffer on CUDA device
    ``device_id``, enqueued on ``stream``: the next call on the same stream overwrites it
    only after this call's kernel has read it (stream order)."""
    host = np.ascontiguousarray(addresses, dtype=np.int64)
    address = memory.workspace(device_id, stream, host.nbytes, purpose="wgrad_ptrs")
    from . import cuda

    with cuda.on_device(device_id):
        cuda.memcpy_h2d(address, host.ctypes.data, host.nbytes, stream)
    return from_pointer(address, host.shape, (1,), DType.INT64, device_id, name="wgrad_ptrs")
