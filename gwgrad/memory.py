"""Device memory gwgrad allocates itself: outputs for callers without an array framework,
and per-stream workspaces.

``DeviceBuffer`` is a dense CUDA array that any framework can adopt without a copy
(``__cuda_array_interface__``, ``__dlpack__``); it frees itself when the last reference (its
own or a consumer's DLPack import) goes away.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import weakref
from typing import Any, Dict, Optional, Sequence, Tuple

from . import cuda
from .dtypes import DType, as_dtype
from .tensors import TensorDesc, _contiguous_strides

# --- DLPack export (written with ctypes: no framework needed) ------------------------------

from .tensors import (  # noqa: E402  (the struct layouts live with the reader)
    _DLManagedTensor,
    _DLManagedTensorVersioned,
    _DLPACK_DTYPES,
    _pyapi,
)

_DLPACK_CODES = {dtype: code for code, dtype in _DLPACK_DTYPES.items()}
_DL_CPU, _DL_CUDA = 1, 2

_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

_capsule_new = _pyapi("PyCapsule_New", ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
                      ctypes.c_void_p)
# The destructor gets the capsule as a raw PyObject*: these two take it as an address.
_capsule_is_valid = _pyapi("PyCapsule_IsValid", ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)
_capsule_get_pointer = _pyapi("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_char_p)
# Capsules keep a pointer to their name, not a copy: these objects live as long as the module.
_NAME_LEGACY = b"dltensor"
_NAME_VERSIONED = b"dltensor_versioned"

# Exports alive until their deleter runs: the struct, its shape/strides arrays and the owner.
_exports: Dict[int, Tuple[Any, ...]] = {}
_exports_lock = threading.Lock()


@_DELETER
def _delete_export(address: int) -> None:
    with _exports_lock:
        _exports.pop(address, None)


def _destroy_capsule(name: bytes):
    @_CAPSULE_DESTRUCTOR
    def destroy(capsule: int) -> None:
        # A consumer renames the capsule ("used_dltensor") and calls the deleter itself;
        # a capsule still carrying its name was never consumed, so release it here.
        if _capsule_is_valid(capsule, name):
            _delete_export(_capsule_get_pointer(capsule, name))
    return destroy


_DESTROY_LEGACY = _destroy_capsule(_NAME_LEGACY)
_DESTROY_VERSIONED = _destroy_capsule(_NAME_VERSIONED)


def export_dlpack(owner: Any, ptr: int, shape: Sequence[int], strides: Sequence[int],
                  dtype: DType, device_type: str, device_id: int, versioned: bool) -> Any:
    """A DLPack capsule over memory that ``owner`` keeps alive."""
    ndim = len(shape)
    shape_arr = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides_arr = (ctypes.c_int64 * max(ndim, 1))(*strides)
    managed = _DLManagedTensorVersioned() if versioned else _DLManagedTensor()
    tensor = managed.dl_tensor
    tensor.data = ptr or None
    tensor.device.device_type = _DL_CUDA if device_type == "cuda" else _DL_CPU
    tensor.device.device_id = device_id if device_type == "cuda" else 0
    tensor.ndim = ndim
    tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes = _DLPACK_CODES[dtype]
    tensor.shape = ctypes.cast(shape_arr, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = ctypes.cast(strides_arr, ctypes.POINTER(ctypes.c_int64))
    tensor.byte_offset = 0
    managed.deleter = ctypes.cast(_delete_export, ctypes.c_void_p).value
    if versioned:
        managed.version.major, managed.version.minor = 1, 0
        managed.flags = 0
    address = ctypes.addressof(managed)
    with _exports_lock:
        _exports[address] = (managed, shape_arr, strides_arr, owner)
    if versioned:
        return _capsule_new(address, _NAME_VERSIONED,
                            ctypes.cast(_DESTROY_VERSIONED, ctypes.c_void_p).value)
    return _capsule_new(address, _NAME_LEGACY, ctypes.cast(_DESTROY_LEGACY, ctypes.c_void_p).value)


def _wants_versioned(max_version: Optional[Tuple[int, int]]) -> bool:
    return max_version is not None and tuple(max_version)[0] >= 1


# --- DeviceBuffer ---------------------------------------------------------------------------

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
        self.strides = _contiguous_strides(self.shape)
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
        return (_DL_CUDA, self.device_id)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        # gwgrad's own work on this buffer is enqueued on the launch stream, which the caller
        # chose; the consumer's stream is its to order against, so no synchronization here.
        if copy:
            raise BufferError("DeviceBuffer.__dlpack__ cannot copy")
        if dl_device is not None and tuple(dl_device) != (_DL_CUDA, self.device_id):
            raise BufferError(f"DeviceBuffer lives on cuda:{self.device_id}, not {dl_device}")
        return export_dlpack(self, self.ptr, self.shape, self.strides, self.dtype, "cuda",
                             self.device_id, _wants_versioned(max_version))


def _free_quietly(ptr: int, device_id: int) -> None:
    try:
        cuda.free(ptr, device_id)
    except Exception:  # at interpreter exit the runtime may already be gone
        pass


# --- workspaces -----------------------------------------------------------------------------

_workspaces: Dict[Tuple[int, int, str], DeviceBuffer] = {}
_workspaces_lock = threading.Lock()


def workspace(device_id: int, stream: int, nbytes: int, purpose: str = "kernel") -> int:
    """Address of at least ``nbytes`` of device memory reserved for launches on ``stream``.

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
            buf = _workspaces[key] = DeviceBuffer(
                (-(-nbytes // granule) * granule,), DType.UINT8, device_id)
        return buf.ptr


def release_workspaces() -> None:
    """Free every cached workspace (they are rebuilt on demand)."""
    with _workspaces_lock:
        _workspaces.clear()


def launch_workspace(like: "TensorDesc", stream: int, nbytes: int):
    """(address, release) of a workspace for one launch on ``stream``; call ``release()``
    right after enqueueing the launch.

    torch operands: torch's caching allocator on the launch stream (stream-ordered, and
    graph-private while a CUDA graph is captured). Otherwise, during capture: a
    cudaMallocAsync / cudaFreeAsync pair that becomes memory nodes of the graph; in eager
    mode: gwgrad's cached per-stream workspace (``workspace``).
    """
    torch = sys.modules.get("torch")
    owner = like.owner
    if torch is not None and isinstance(owner, torch.Tensor) and owner.is_cuda:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=owner.device)

        def release() -> None:
            if stream != torch.cuda.current_stream(owner.device).cuda_stream:
                buf.record_stream(torch.cuda.ExternalStream(stream, device=owner.device))

        return buf.data_ptr(), release
    if cuda.stream_is_capturing(stream):
        with cuda.on_device(like.device_id):
            ptr = cuda.malloc_async(nbytes, stream)
        return ptr, lambda: cuda.free_async(ptr, stream)
    return workspace(like.device_id, stream, nbytes), lambda: None
