"""Device memory gwgrad allocates itself, with the CUDA runtime (no framework): ``DeviceBuffer``
(outputs for raw pointers and JAX arrays, adoptable by any framework through DLPack or
``__cuda_array_interface__``), per-stream workspaces and per-stream address arrays.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, Sequence, Tuple

import numpy as np

from .. import cuda
from ..dtypes import DType, as_dtype
from ..tensors import TensorDesc, contiguous_strides, from_pointer
from .dlpack import DL_CUDA, export_dlpack, wants_versioned

__all__ = ["DeviceBuffer", "workspace", "release_workspaces", "address_array"]

_TYPESTR = {
    DType.FLOAT16: "<f2", DType.FLOAT32: "<f4", DType.FLOAT64: "<f8", DType.INT32: "<i4",
    DType.INT64: "<i8", DType.UINT8: "|u1",
}


class DeviceBuffer:
    """A dense, row-major CUDA array allocated with cudaMalloc and freed when unreferenced."""

    def __init__(self, shape: Sequence[int], dtype: Any, device_id: int = 0):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = as_dtype(dtype, "dtype")
        self.device_id = int(device_id)
        self.strides = contiguous_strides(self.shape)
        count = 1
        for s in self.shape:
            count *= s
        self.nbytes = count * self.dtype.itemsize
        # cudaMalloc(0) is legal but gives no address; keep one byte so ptr is never null.
        self.ptr = cuda.malloc(max(self.nbytes, 1), self.device_id)
        # cudaFree synchronizes the device, so work still reading this memory completes first.
        self._finalizer = weakref.finalize(self, _free_quietly, self.ptr, self.device_id)

    def __repr__(self) -> str:
        return (f"DeviceBuffer(shape={self.shape}, dtype={self.dtype}, device=cuda:{self.device_id}, "
                f"ptr={self.ptr:#x})")

    @property
    def desc(self) -> TensorDesc:
        return TensorDesc(self.ptr, self.shape, self.strides, self.dtype, "cuda", self.device_id,
                          None, self)

    @property
    def __cuda_array_interface__(self) -> dict:
        # bfloat16 / FP8 have no standard typestr: they go out as raw bytes of their size.
        typestr = _TYPESTR.get(self.dtype, f"|V{self.dtype.itemsize}")
        return {"shape": self.shape, "typestr": typestr, "data": (self.ptr, False),
                "strides": None, "version": 3}

    def __dlpack_device__(self) -> Tuple[int, int]:
        return (DL_CUDA, self.device_id)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        # gwgrad's own work on this buffer is enqueued on the launch stream, which the caller
        # chose; the consumer's stream is its to order against, so no synchronization here.
        if copy:
            raise BufferError("DeviceBuffer.__dlpack__ cannot copy")
        if dl_device is not None and tuple(dl_device) != (DL_CUDA, self.device_id):
            raise BufferError(f"DeviceBuffer lives on cuda:{self.device_id}, not {dl_device}")
        return export_dlpack(self, self.ptr, self.shape, self.strides, self.dtype, "cuda",
                             self.device_id, wants_versioned(max_version))


def _free_quietly(ptr: int, device_id: int) -> None:
    try:
        cuda.free(ptr, device_id)
    except Exception:  # at interpreter exit the runtime may already be gone
        pass


# --- workspaces -----------------------------------------------------------------------------

_workspaces: Dict[Tuple[int, int, str], DeviceBuffer] = {}
_workspaces_lock = threading.Lock()


def workspace(device_id: int, stream: int, nbytes: int, purpose: str = "kernel") -> int:
    """Address of at least ``nbytes`` of device memory reserved for launches on ``stream``,
    zero-filled when allocated (single-launch GEMMs need their grid-barrier words zero before
    the first launch; every launch leaves them zero again).

    One allocation per (device, stream, purpose), grown when needed. Launches on one stream
    run in order, so reusing it for the next launch is safe; growing frees the old buffer with
    cudaFree, which waits for the work still using it. Returns 0 for ``nbytes == 0``. Grow it
    before a CUDA-graph capture (cudaMalloc is not capturable).
    """
    if nbytes <= 0:
        return 0
    key = (device_id, stream, purpose)
    with _workspaces_lock:
        buf = _workspaces.get(key)
        if buf is None or buf.nbytes < nbytes:
            if buf is not None:
                _workspaces.pop(key)
                del buf
            granule = 1 << 20
            buf = DeviceBuffer((-(-nbytes // granule) * granule,), DType.UINT8, device_id)
            cuda.memset(buf.ptr, buf.nbytes, device_id)
            _workspaces[key] = buf
        return buf.ptr


def release_workspaces() -> None:
    """Free every cached workspace (they are rebuilt on demand)."""
    with _workspaces_lock:
        _workspaces.clear()


def address_array(addresses: Sequence[int], device_id: int, stream: int) -> TensorDesc:
    """Host int64 ``addresses`` copied to a per-stream scratch buffer on CUDA device
    ``device_id``, enqueued on ``stream``: the next call on the same stream overwrites it
    only after this call's kernel has read it (stream order)."""
    host = np.ascontiguousarray(addresses, dtype=np.int64)
    address = workspace(device_id, stream, host.nbytes, purpose="wgrad_ptrs")
    with cuda.on_device(device_id):
        cuda.memcpy_h2d(address, host.ctypes.data, host.nbytes, stream)
    return from_pointer(address, host.shape, (1,), DType.INT64, device_id, name="wgrad_ptrs")
