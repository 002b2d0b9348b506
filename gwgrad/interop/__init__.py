"""Framework interop, in one place: how to describe an array, find a framework's current
stream, allocate an output or a workspace on a stream, and keep memory alive for a stream.

One module per framework (``torch``, ``cupy``, ``numpy``; ``jax``: its XLA FFI custom calls,
imported by the JAX adapter), ``dlpack`` for any other producer, ``buffer`` for gwgrad's own
CUDA memory (raw pointers, JAX arrays). No framework
is ever imported here: a framework's module is used only once the framework itself has been
imported by the caller (an array of it cannot exist before). The core (``gwgrad.api``,
``gwgrad.plan``) and the adapters call these functions; nothing else knows a framework.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Optional, Sequence, Tuple

from .. import cuda
from ..dtypes import DType, as_dtype
from ..errors import ArgumentError
from ..tensors import TensorDesc, contiguous_strides, from_pointer
from .buffer import DeviceBuffer, address_array, workspace
from .dlpack import framework_of, from_dlpack

__all__ = ["as_tensor_desc", "quick", "signature", "from_dlpack", "from_pointer", "framework", "stream_handle",
           "resolve_stream", "allocate", "pointer_array", "address_array", "keep_alive",
           "workspace", "DeviceBuffer"]


_modules: dict = {}


def framework(name: str):
    """gwgrad's interop module for framework ``name`` ("torch", "cupy", "numpy") if that
    framework is imported in this process, else None (it is never imported here)."""
    module = _modules.get(name)
    if module is None:
        if name not in sys.modules:
            return None
        module = _modules[name] = importlib.import_module(f"{__name__}.{name}")
    return module


# --- quick signatures: the per-call path of a cached plan -----------------------------------

def _quick_torch(t):
    return t.data_ptr(), (t.shape, t.stride(), t.dtype, t.device)


def _quick_numpy(a):
    return a.__array_interface__["data"][0], (a.shape, a.strides, a.dtype, "cpu")


def signature(desc: Optional[TensorDesc]) -> Optional[tuple]:
    """Everything the contract's check reads from a descriptor but its address (None: None)."""
    if desc is None:
        return None
    return (desc.shape, desc.strides, desc.dtype, desc.device_type, desc.device_id)


def _quick_desc(d: TensorDesc):
    return d.ptr, signature(d)


_QUICK: dict = {TensorDesc: _quick_desc}


def _quick_reader(kind: type):
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(kind, torch.Tensor):
        return _quick_torch
    np = sys.modules.get("numpy")
    if np is not None and kind is np.ndarray:
        return _quick_numpy
    cupy = sys.modules.get("cupy")
    if cupy is not None and kind is cupy.ndarray:
        return framework("cupy").signature
    return None


def quick(obj: Any, name: str) -> Tuple[int, Any]:
    """``(address, key)`` of an array argument, cheaply: ``key`` determines everything the
    contract's check reads from it (shape, strides, dtype, device) but not its address, so a
    cache keyed by it needs no validation on a hit. torch tensors, NumPy / CuPy arrays and
    TensorDescs are read from their attributes; other arrays are described (DLPack) each
    call. None gives ``(0, None)``."""
    if obj is None:
        return 0, None
    kind = type(obj)
    reader = _QUICK.get(kind, False)
    if reader is False:
        reader = _QUICK[kind] = _quick_reader(kind)
    if reader is not None:
        return reader(obj)
    return _quick_desc(as_tensor_desc(obj, name))


def as_tensor_desc(obj: Any, name: str) -> Optional[TensorDesc]:
    """Describe ``obj`` as a TensorDesc; None stays None.

    Accepts a ``TensorDesc``, a torch tensor or NumPy array (read directly: the hot path;
    ml_dtypes' bfloat16 / float8 arrays work), any other object with ``__dlpack__`` (CuPy,
    JAX, ...; read with ctypes) or ``__cuda_array_interface__``. Raises ``ArgumentError``
    naming ``name`` for objects that are not arrays or whose dtype or device gwgrad cannot take.
    """
    if obj is None or isinstance(obj, TensorDesc):
        return obj
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return framework("torch").describe(obj, name)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        return framework("numpy").describe(obj, name)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return from_dlpack(obj, name)
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cuda_array_interface(obj, name)
    raise ArgumentError(
        name, "expected an array with __dlpack__ (torch, CuPy, JAX, NumPy), an object with "
        f"__cuda_array_interface__ or a gwgrad.TensorDesc, got {type(obj).__name__}")


def _from_cuda_array_interface(obj: Any, name: str) -> TensorDesc:
    import numpy as np

    cai = obj.__cuda_array_interface__
    ptr, read_only = cai["data"]
    shape = tuple(int(s) for s in cai["shape"])
    np_dtype = np.dtype(cai["typestr"])
    dtype = as_dtype(np_dtype, name)
    if cai.get("strides") is None:
        strides = contiguous_strides(shape)
    else:
        strides = tuple(int(s) // np_dtype.itemsize for s in cai["strides"])
    device_id = cuda.pointer_device(int(ptr)) if ptr else 0
    return TensorDesc(int(ptr), shape, strides, dtype, "cuda", device_id,
                      framework_of(obj), obj, bool(read_only))


# --- streams ---------------------------------------------------------------------------------

def stream_handle(stream: Any, name: str = "current_stream") -> int:
    """The ``cudaStream_t`` value of ``stream``.

    Accepts an int (0 is the legacy default stream), an object implementing
    ``__cuda_stream__`` (cuda.core's protocol: it returns ``(version, handle)``), torch
    streams (``.cuda_stream``), CuPy streams (``.ptr``) and cuda-bindings stream objects
    (``int(stream)``).
    """
    if isinstance(stream, bool):
        raise ArgumentError(name, f"expected a CUDA stream handle, got {stream!r}")
    if isinstance(stream, int):
        if stream < 0:
            raise ArgumentError(name, f"expected a non-negative cudaStream_t value, got {stream}")
        return stream
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        value = protocol() if callable(protocol) else protocol
        if isinstance(value, tuple) and len(value) == 2:
            value = value[1]
        return int(value)
    for attr in ("cuda_stream", "ptr", "handle"):
        value = getattr(stream, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    try:
        return int(stream)
    except Exception:
        raise ArgumentError(
            name, "expected None, an int cudaStream_t, an object with __cuda_stream__, or a "
            f"torch / CuPy stream, got {type(stream).__name__}") from None


def resolve_stream(stream: Any, framework_name: Optional[str], device_id: int) -> int:
    """The stream a call runs on: ``stream`` if given, else the framework's current stream.

    With no stream and an array from torch or CuPy, the work goes where that framework would
    put its own next kernel, so it is ordered after the producer of the inputs. Otherwise the
    legacy default stream (0) is used.
    """
    if stream is not None:
        return stream_handle(stream)
    if framework_name in ("torch", "cupy"):
        module = framework(framework_name)
        if module is not None:
            return int(module.current_stream(device_id))
    return 0


# --- memory ----------------------------------------------------------------------------------

def allocate(ref: TensorDesc, shape: Sequence[int], dtype: DType,
             stream: int) -> Tuple[Any, TensorDesc]:
    """An uninitialized array like ``ref``'s (framework and device), allocated on ``stream``;
    returns (array, desc). CuPy has no bfloat16 and raw pointers / JAX have no allocator of
    their own: those get a ``DeviceBuffer``; CPU arrays a NumPy array."""
    fw = ref.framework
    torch_ = framework("torch") if fw == "torch" else None
    cupy_ = framework("cupy") if fw == "cupy" and ref.is_cuda and dtype != DType.BFLOAT16 else None
    if torch_ is not None:
        out = torch_.empty(shape, dtype, ref, stream)
    elif cupy_ is not None:
        out = cupy_.empty(shape, cupy_.native_dtype(dtype, "wgrad_dtype"), ref.device_id, stream)
    elif not ref.is_cuda:
        from . import numpy as np_interop

        out = np_interop.empty(shape, dtype)
    else:
        out = DeviceBuffer(shape, dtype, ref.device_id)
    return out, as_tensor_desc(out, "wgrad_tensor")


def pointer_array(stacked: TensorDesc, stream: int) -> TensorDesc:
    """The int64 per-expert addresses into a stacked (num_experts, hidden, intermediate) output.

    torch builds them with a device kernel (so this also works under CUDA-graph capture);
    otherwise they are copied from the host into a per-stream scratch buffer, which the next
    call on the same stream may overwrite only after this call's kernel (stream order).
    """
    import numpy as np

    step = stacked.strides[0] * stacked.dtype.itemsize
    addresses = stacked.ptr + step * np.arange(stacked.shape[0], dtype=np.int64)
    if not stacked.is_cuda:
        return as_tensor_desc(addresses, "wgrad_ptrs")
    torch_ = framework("torch") if stacked.framework == "torch" else None
    if torch_ is not None:
        return torch_.stacked_pointer_array(stacked, stream)
    return address_array(addresses, stacked.device_id, stream)


def keep_alive(desc: Optional[TensorDesc], stream: int) -> None:
    """Keep ``desc``'s memory from being reused before the work enqueued on ``stream`` is done
    (torch's record_stream; other frameworks order frees by their own stream, or hold the
    owner for the caller)."""
    if desc is None or not desc.is_cuda or desc.framework != "torch":
        return
    torch_ = framework("torch")
    if torch_ is not None and isinstance(desc.owner, sys.modules["torch"].Tensor):
        torch_.record_stream(desc.owner, stream)
