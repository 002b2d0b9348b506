"""DLPack with ctypes alone: describe any ``__dlpack__`` producer without a framework, and
export gwgrad's own buffers (``DeviceBuffer``) so that any framework adopts them without a copy.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Dict, Optional, Sequence, Tuple

from ..dtypes import DType
from ..errors import ArgumentError
from ..tensors import TensorDesc, contiguous_strides

__all__ = ["from_dlpack", "export_dlpack", "wants_versioned", "DL_CPU", "DL_CUDA"]

# --- reading --------------------------------------------------------------------------------

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_DLPACK_READ_ONLY = 1 << 0
_DLPACK_IS_COPIED = 1 << 1  # writes would go to a private copy, never back to the caller's array



def _pyapi(name: str, restype, *argtypes):
    # A private prototype: ``ctypes.pythonapi.X`` is one shared object whose argtypes other
    # modules may set differently.
    return ctypes.PYFUNCTYPE(restype, *argtypes)((name, ctypes.pythonapi))


_capsule_name = _pyapi("PyCapsule_GetName", ctypes.c_char_p, ctypes.py_object)
_capsule_pointer = _pyapi("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)

# (type code, bits, lanes) -> DType. FP4 comes packed two per byte (torch's float4_e2m1fn_x2).
_DLPACK_DTYPES = {
    (4, 16, 1): DType.BFLOAT16,
    (2, 16, 1): DType.FLOAT16,
    (2, 32, 1): DType.FLOAT32,
    (2, 64, 1): DType.FLOAT64,
    (0, 32, 1): DType.INT32,
    (0, 64, 1): DType.INT64,
    (1, 8, 1): DType.UINT8,
    (10, 8, 1): DType.FLOAT8_E4M3FN,
    (12, 8, 1): DType.FLOAT8_E5M2,
    (14, 8, 1): DType.FLOAT8_E8M0FNU,
    (17, 4, 2): DType.FLOAT4_E2M1FN_X2,
}
DL_CPU, DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


def _export_capsule(obj: Any, device_type: int):
    # stream=-1 asks a CUDA producer not to synchronize: gwgrad only reads metadata here, and
    # ordering against the launch stream is the caller's business (as with raw pointers).
    attempts = [{"max_version": (1, 3)}, {}]
    if device_type in (DL_CUDA, _DL_CUDA_MANAGED):
        attempts = [{"stream": -1, "max_version": (1, 3)}, {"stream": -1}] + attempts
    for kwargs in attempts[:-1]:
        try:
            return obj.__dlpack__(**kwargs)
        except (TypeError, ValueError, BufferError):  # a producer without these keywords
            continue
    return obj.__dlpack__()


def from_dlpack(obj: Any, name: str = "tensor", framework: Optional[str] = None) -> TensorDesc:
    """Describe an object with ``__dlpack__`` / ``__dlpack_device__`` without copying it.

    The capsule is read and released at once; ``owner`` keeps ``obj`` (and so its memory)
    alive.
    """
    try:
        dev_type, dev_id = (int(v) for v in obj.__dlpack_device__())
    except Exception as exc:
        raise ArgumentError(name, f"__dlpack_device__() failed: {exc}") from exc
    try:
        capsule = _export_capsule(obj, dev_type)
    except Exception as exc:
        raise ArgumentError(name, f"cannot be exported through DLPack: {exc}") from exc
    raw_name = _capsule_name(capsule)
    flags = 0
    if raw_name == b"dltensor_versioned":
        managed = _DLManagedTensorVersioned.from_address(_capsule_pointer(capsule, raw_name))
        if managed.version.major > 1:
            raise ArgumentError(
                name, f"DLPack version {managed.version.major}.{managed.version.minor} is newer "
                "than the 1.x gwgrad reads")
        flags = int(managed.flags)
        tensor = managed.dl_tensor
    elif raw_name == b"dltensor":
        tensor = _DLManagedTensor.from_address(_capsule_pointer(capsule, raw_name)).dl_tensor
    else:
        raise ArgumentError(name, f"__dlpack__() returned a capsule named {raw_name!r}, expected "
                            "'dltensor' or 'dltensor_versioned'")

    code = (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes)
    dtype = _DLPACK_DTYPES.get(code)
    if dtype is None:
        hint = ""
        if code[0] == 17:
            hint = " (pass FP4 packed two values per byte, as torch.float4_e2m1fn_x2)"
        raise ArgumentError(
            name, f"unsupported DLPack dtype (code={code[0]}, bits={code[1]}, lanes={code[2]})"
            f"{hint}")
    ndim = int(tensor.ndim)
    shape = tuple(int(tensor.shape[i]) for i in range(ndim))
    if tensor.strides:
        strides = tuple(int(tensor.strides[i]) for i in range(ndim))
    else:  # DLPack < 1.2 allowed NULL strides for row-major dense data
        strides = contiguous_strides(shape)
    ptr = int(tensor.data or 0) + int(tensor.byte_offset)
    device_type = int(tensor.device.device_type)
    device_id = int(tensor.device.device_id)
    del capsule  # releases the producer's export; obj still owns the memory

    if device_type in (DL_CUDA, _DL_CUDA_MANAGED):
        kind = "cuda"
    elif device_type in (DL_CPU, _DL_CUDA_HOST):
        kind, device_id = "cpu", 0
    else:
        raise ArgumentError(name, f"expected a CUDA or CPU array, got DLPack device type "
                                  f"{device_type}")
    return TensorDesc(ptr, shape, strides, dtype, kind, device_id,
                      framework or framework_of(obj), obj,
                      bool(flags & (_DLPACK_READ_ONLY | _DLPACK_IS_COPIED)))


def framework_of(obj: Any) -> Optional[str]:
    """"torch", "cupy", "numpy", "jax" or None, from the object's type (nothing imported)."""
    root = type(obj).__module__.split(".", 1)[0]
    if root in ("jax", "jaxlib"):
        return "jax"
    return root if root in ("torch", "cupy", "numpy") else None


# --- export (written with ctypes: no framework needed) --------------------------------------

_DLPACK_CODES = {dtype: code for code, dtype in _DLPACK_DTYPES.items()}

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
    tensor.device.device_type = DL_CUDA if device_type == "cuda" else DL_CPU
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


def wants_versioned(max_version: Optional[Tuple[int, int]]) -> bool:
    return max_version is not None and tuple(max_version)[0] >= 1


