"""Tensor descriptors: what gwgrad needs to know about an array, from DLPack or a raw pointer.

``as_tensor_desc`` accepts anything the public API takes as a tensor argument: a
``TensorDesc``, a torch tensor (read directly: the hot path), a NumPy array (read directly, so
ml_dtypes' bfloat16 / float8 arrays work), any other object with ``__dlpack__`` (CuPy, JAX,
...; the capsule is read with ctypes, torch is not needed) or ``__cuda_array_interface__``.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Tuple

from .dtypes import DType, as_dtype


@dataclass(frozen=True)
class TensorDesc:
    """A strided array in device or host memory.

    ``strides`` count elements (bytes for packed FP4, whose shape also counts bytes).
    ``framework`` names where it came from ("torch", "cupy", "jax", "numpy") or is None for a
    raw pointer; ``owner`` keeps the source object alive and lets adapters allocate alike.
    ``read_only`` is set when the producer says the memory must not be written.
    """

    ptr: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    dtype: DType
    device_type: str  # "cuda" or "cpu"
    device_id: int = 0
    framework: Optional[str] = None
    owner: Any = field(default=None, compare=False, repr=False)
    read_only: bool = field(default=False, compare=False)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    @property
    def device(self) -> str:
        return f"{self.device_type}:{self.device_id}" if self.is_cuda else "cpu"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def is_contiguous(self) -> bool:
        """Row-major dense, ignoring the strides of size-1 axes (as torch and NumPy do)."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size == 0:
                return True
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


def _contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def from_pointer(
    ptr: int,
    shape: Sequence[int],
    strides: Optional[Sequence[int]],
    dtype: Any,
    device_id: int = 0,
    *,
    device_type: str = "cuda",
    owner: Any = None,
    name: str = "tensor",
) -> TensorDesc:
    """Describe memory at address ``ptr``: ``strides`` in elements (None: row-major dense).

    ``device_type="cpu"`` describes host memory (what the reference backend reads).
    """
    if isinstance(ptr, bool) or not isinstance(ptr, int) or ptr < 0:
        raise ValueError(f"{name}: expected a non-negative integer address, got {ptr!r}")
    try:
        shape_t = tuple(int(s) for s in shape)
    except TypeError:
        raise ValueError(f"{name}: expected shape to be a sequence of ints, got {shape!r}") from None
    if any(s < 0 for s in shape_t):
        raise ValueError(f"{name}: expected non-negative sizes, got shape {shape_t}")
    if strides is None:
        strides_t = _contiguous_strides(shape_t)
    else:
        strides_t = tuple(int(s) for s in strides)
        if len(strides_t) != len(shape_t):
            raise ValueError(
                f"{name}: expected {len(shape_t)} strides for shape {shape_t}, got {strides_t}")
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"{name}: expected device_type 'cuda' or 'cpu', got {device_type!r}")
    if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
        raise ValueError(f"{name}: expected a non-negative device ordinal, got {device_id!r}")
    return TensorDesc(ptr, shape_t, strides_t, as_dtype(dtype, f"{name} dtype"), device_type,
                      device_id if device_type == "cuda" else 0, None, owner)


# --- DLPack ---------------------------------------------------------------------------------

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
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


def _export_capsule(obj: Any, device_type: int):
    # stream=-1 asks a CUDA producer not to synchronize: gwgrad only reads metadata here, and
    # ordering against the launch stream is the caller's business (as with raw pointers).
    attempts = [{"max_version": (1, 3)}, {}]
    if device_type in (_DL_CUDA, _DL_CUDA_MANAGED):
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
        raise ValueError(f"{name}: __dlpack_device__() failed: {exc}") from exc
    try:
        capsule = _export_capsule(obj, dev_type)
    except Exception as exc:
        raise ValueError(f"{name}: cannot be exported through DLPack: {exc}") from exc
    raw_name = _capsule_name(capsule)
    flags = 0
    if raw_name == b"dltensor_versioned":
        managed = _DLManagedTensorVersioned.from_address(_capsule_pointer(capsule, raw_name))
        if managed.version.major > 1:
            raise ValueError(
                f"{name}: DLPack version {managed.version.major}.{managed.version.minor} is newer "
                "than the 1.x gwgrad reads")
        flags = int(managed.flags)
        tensor = managed.dl_tensor
    elif raw_name == b"dltensor":
        tensor = _DLManagedTensor.from_address(_capsule_pointer(capsule, raw_name)).dl_tensor
    else:
        raise ValueError(f"{name}: __dlpack__() returned a capsule named {raw_name!r}, "
                         "expected 'dltensor' or 'dltensor_versioned'")

    code = (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes)
    dtype = _DLPACK_DTYPES.get(code)
    if dtype is None:
        hint = ""
        if code[0] == 17:
            hint = " (pass FP4 packed two values per byte, as torch.float4_e2m1fn_x2)"
        raise ValueError(
            f"{name}: unsupported DLPack dtype (code={code[0]}, bits={code[1]}, lanes={code[2]})"
            f"{hint}")
    ndim = int(tensor.ndim)
    shape = tuple(int(tensor.shape[i]) for i in range(ndim))
    if tensor.strides:
        strides = tuple(int(tensor.strides[i]) for i in range(ndim))
    else:  # DLPack < 1.2 allowed NULL strides for row-major dense data
        strides = _contiguous_strides(shape)
    ptr = int(tensor.data or 0) + int(tensor.byte_offset)
    device_type = int(tensor.device.device_type)
    device_id = int(tensor.device.device_id)
    del capsule  # releases the producer's export; obj still owns the memory

    if device_type in (_DL_CUDA, _DL_CUDA_MANAGED):
        kind = "cuda"
    elif device_type in (_DL_CPU, _DL_CUDA_HOST):
        kind, device_id = "cpu", 0
    else:
        raise ValueError(f"{name}: expected a CUDA or CPU array, got DLPack device type {device_type}")
    return TensorDesc(ptr, shape, strides, dtype, kind, device_id,
                      framework or _framework_of(obj), obj,
                      bool(flags & (_DLPACK_READ_ONLY | _DLPACK_IS_COPIED)))


def _framework_of(obj: Any) -> Optional[str]:
    root = type(obj).__module__.split(".", 1)[0]
    if root in ("jax", "jaxlib"):
        return "jax"
    return root if root in ("torch", "cupy", "numpy") else None


# --- direct readers for the common cases ----------------------------------------------------

_torch_dtypes: Optional[dict] = None


def _torch_dtype_map(torch) -> dict:
    global _torch_dtypes
    if _torch_dtypes is None:
        table = {}
        for dtype in DType:
            tdt = getattr(torch, dtype.value, None)
            if tdt is not None:
                table[tdt] = dtype
        _torch_dtypes = table
    return _torch_dtypes


def _from_torch(t: Any, torch: Any, name: str) -> TensorDesc:
    dtype = _torch_dtype_map(torch).get(t.dtype)
    if dtype is None:
        raise ValueError(f"{name}: unsupported dtype {t.dtype}")
    device = t.device
    if device.type == "cuda":
        kind, index = "cuda", device.index if device.index is not None else 0
    elif device.type == "cpu":
        kind, index = "cpu", 0
    else:
        raise ValueError(f"{name}: expected a CUDA or CPU tensor, got device {device}")
    return TensorDesc(t.data_ptr(), tuple(t.shape), t.stride(), dtype, kind, index, "torch", t)


def _from_numpy(a: Any, name: str) -> TensorDesc:
    try:
        dtype = as_dtype(a.dtype, name)
    except ValueError:
        hint = " (pass FP4 packed two values per byte, as torch.float4_e2m1fn_x2)" \
            if "float4" in a.dtype.name else ""
        raise ValueError(f"{name}: unsupported dtype {a.dtype.name}{hint}") from None
    itemsize = a.dtype.itemsize
    if any(s % itemsize for s in a.strides):
        raise ValueError(f"{name}: strides {a.strides} (bytes) are not multiples of the "
                         f"element size {itemsize}")
    return TensorDesc(a.__array_interface__["data"][0], tuple(a.shape),
                      tuple(s // itemsize for s in a.strides), dtype, "cpu", 0, "numpy", a,
                      not a.flags.writeable)


def _from_cuda_array_interface(obj: Any, name: str) -> TensorDesc:
    import numpy as np

    cai = obj.__cuda_array_interface__
    ptr, read_only = cai["data"]
    shape = tuple(int(s) for s in cai["shape"])
    np_dtype = np.dtype(cai["typestr"])
    dtype = as_dtype(np_dtype, name)
    if cai.get("strides") is None:
        strides = _contiguous_strides(shape)
    else:
        strides = tuple(int(s) // np_dtype.itemsize for s in cai["strides"])
    from . import cuda

    device_id = cuda.pointer_device(int(ptr)) if ptr else 0
    return TensorDesc(int(ptr), shape, strides, dtype, "cuda", device_id,
                      _framework_of(obj), obj, bool(read_only))


def as_tensor_desc(obj: Any, name: str) -> Optional[TensorDesc]:
    """Describe ``obj`` (see the module docstring); None stays None.

    Raises ValueError naming ``name`` for objects that are not arrays or whose dtype or device
    gwgrad cannot take.
    """
    if obj is None or isinstance(obj, TensorDesc):
        return obj
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _from_torch(obj, torch, name)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        return _from_numpy(obj, name)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return from_dlpack(obj, name)
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cuda_array_interface(obj, name)
    raise ValueError(
        f"{name}: expected an array with __dlpack__ (torch, CuPy, JAX, NumPy), an object with "
        f"__cuda_array_interface__ or a gwgrad.TensorDesc, got {type(obj).__name__}")
