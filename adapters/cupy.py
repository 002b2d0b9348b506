"""gwgrad for CuPy: CuPy arrays in and out, on CuPy's current stream.

    import gwgrad.adapters.cupy as gwc
    w = gwc.wgrad(x_bits, dy_bits, offsets, dtype="bfloat16", out_dtype="float32")

``x`` is (tokens, hidden) and ``dy`` (tokens, intermediate), as a training step holds them
(``x.T`` is then the contract's M-major ``a_tensor``, ``dy`` its N-major ``b_tensor``: the
fastest layout, no copy). ``offsets`` is int32 (num_experts,), the cumulative token counts.

bfloat16. CuPy has no bfloat16 dtype, so bfloat16 data travels as its raw bits:

* inputs: uint16 (or int16) CuPy arrays holding bfloat16 bits, flagged with
  ``dtype="bfloat16"``; the flag is required (a uint16 array is not silently read as
  floats). Arrays that are bfloat16 themselves (an ml_dtypes bfloat16 array, or any
  DLPack-capable bfloat16 array such as a torch CUDA tensor) need no flag.
* outputs: a bfloat16 result comes back as a uint16 CuPy array of bits (or in x's own
  dtype when x is natively bfloat16); a given ``out`` of uint16 / int16 is read as
  bfloat16 bits. ``to_bfloat16_bits`` / ``from_bfloat16_bits`` convert float32 <-> bits.

Streams: the work goes on ``stream`` (anything ``gwgrad`` accepts: an int ``cudaStream_t``,
a CuPy stream, ...) or by default on CuPy's current stream of x's device; new outputs and the
workspace come from CuPy's memory pool on that stream. No host synchronization (offsets
are read by the kernel on the device; ``validate_offsets=True`` checks them on the host
first), except that discrete outputs' addresses are copied from the host each call.

NumPy arrays (on the CPU) are accepted too and run on gwgrad's reference implementation, so
code written against this adapter runs in CPU-only tests.
"""

from __future__ import annotations

import sys
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from gwgrad.dtypes import DType, as_dtype
from gwgrad.outputs import address_array
from gwgrad.prepared import prepare_call
from gwgrad.streams import stream_handle
from gwgrad.tensors import TensorDesc, as_tensor_desc, from_pointer

from ._common import adapter_message, adapter_names, experts_hidden_intermediate

__all__ = ["wgrad", "to_bfloat16_bits", "from_bfloat16_bits"]

_BITS = (np.dtype(np.uint16), np.dtype(np.int16))
_OUT_NUMPY = {DType.FLOAT16: np.float16, DType.FLOAT32: np.float32}


def _cupy():
    return sys.modules.get("cupy")


def _is_cupy(arr: Any) -> bool:
    cupy = _cupy()
    return cupy is not None and isinstance(arr, cupy.ndarray)


def _xp(arr: Any):
    return _cupy() if _is_cupy(arr) else np


# --- arrays -> (address, signature) ---------------------------------------------------------

def _info(arr: Any, name: str, bfloat16_bits: bool, transpose: bool = False):
    """``(address, (shape, strides, dtype, device_type, device_id), array)`` of ``arr``.

    ``bfloat16_bits``: read a uint16 / int16 array as bfloat16. Strides count elements.
    ``transpose``: describe ``arr.T`` (x -> A) without making a view.
    """
    if _is_cupy(arr) or isinstance(arr, np.ndarray):
        dtype = arr.dtype
        if dtype in _BITS:
            if not bfloat16_bits:
                raise ValueError(f"{name}: expected a float array, or 16-bit integers holding "
                                 f"bfloat16 bits with dtype='bfloat16', got {dtype}")
            gw_dtype = DType.BFLOAT16
        else:
            gw_dtype = as_dtype(dtype, name)
        if any(s % dtype.itemsize for s in arr.strides):
            raise ValueError(f"{name}: strides {arr.strides} (bytes) are not multiples of the "
                             f"element size {dtype.itemsize}")
        strides = tuple(s // dtype.itemsize for s in arr.strides)
        shape = tuple(arr.shape)
        if _is_cupy(arr):
            address, device = arr.data.ptr, ("cuda", arr.data.device_id)
        else:
            address, device = arr.ctypes.data, ("cpu", 0)
    else:  # any DLPack / CUDA-array-interface array (torch, JAX, ...): its own dtype
        desc = as_tensor_desc(arr, name)
        address, shape, strides, gw_dtype = desc.ptr, desc.shape, desc.strides, desc.dtype
        device = (desc.device_type, desc.device_id)
    if transpose:
        if len(shape) != 2:
            raise ValueError(f"{name}: expected 2 dims, got shape {shape}")
        shape, strides = shape[::-1], strides[::-1]
    return address, (shape, strides, gw_dtype) + device, arr


def _desc(info, name: str) -> TensorDesc:
    address, (shape, strides, dtype, device_type, device_id), arr = info
    return from_pointer(address, shape, strides, dtype, device_id, device_type=device_type,
                        owner=arr, name=name)


# --- bfloat16 bits --------------------------------------------------------------------------

def to_bfloat16_bits(values: Any) -> Any:
    """float32 (CuPy or NumPy) -> uint16 bfloat16 bits, rounded to nearest even."""
    xp = _xp(values)
    u = xp.ascontiguousarray(values, dtype=xp.float32).view(xp.uint32)
    rounded = (u + (((u >> 16) & 1) + 0x7FFF)) >> 16
    bits = rounded.astype(xp.uint16)
    return xp.where(xp.isnan(values), xp.uint16(0x7FC0), bits)


def from_bfloat16_bits(bits: Any) -> Any:
    """uint16 / int16 bfloat16 bits (CuPy or NumPy) -> float32 values."""
    xp = _xp(bits)
    u = xp.ascontiguousarray(bits).view(xp.uint16).astype(xp.uint32) << 16
    return u.view(xp.float32)


# --- the call -------------------------------------------------------------------------------

_prepared: dict = {}


def _resolve_stream(stream: Any, device) -> int:
    if device[0] != "cuda":
        return 0
    if stream is not None:
        return stream_handle(stream, "stream")
    cupy = _cupy()
    if cupy is None:
        return 0
    return cupy.cuda.get_current_stream(device[1]).ptr


def _empty(x: Any, shape: Tuple[int, ...], dtype: DType, device, stream: int,
           stream_given: bool):
    """A new output in x's kind of array: CuPy on CUDA, NumPy on the CPU. bfloat16 comes in
    x's dtype when x holds bfloat16 (bits or native), else as uint16 bits."""
    if dtype == DType.BFLOAT16:
        np_dtype = np.dtype(np.uint16)
        x_dtype = getattr(x, "dtype", None)
        if isinstance(x_dtype, np.dtype) and x_dtype.name in ("uint16", "int16", "bfloat16"):
            np_dtype = x_dtype
    else:
        np_dtype = _OUT_NUMPY[dtype]
    if device[0] != "cuda":
        return np.empty(shape, np_dtype)
    cupy = _cupy()
    if cupy is None:
        raise RuntimeError("allocating a CUDA output needs CuPy (pip install cupy-cuda13x), or "
                           "pass out")
    with cupy.cuda.Device(device[1]):
        if stream_given:  # allocate where the kernel writes it: the pool orders reuse by stream
            with cupy.cuda.ExternalStream(stream):
                return cupy.empty(shape, np_dtype)
        return cupy.empty(shape, np_dtype)


def _quick(arr: Any, name: str):
    """``(address, signature)`` of an array, cheaply: a CuPy / NumPy array's raw attributes
    (validated by ``_info`` when the signature is first seen); other arrays are described
    through DLPack on every call."""
    cupy = _cupy()
    kind = type(arr)
    if cupy is not None and kind is cupy.ndarray:
        return arr.data.ptr, (arr.shape, arr.strides, arr.dtype, "cuda", arr.data.device_id)
    if kind is np.ndarray:
        return arr.__array_interface__["data"][0], (arr.shape, arr.strides, arr.dtype, "cpu", 0)
    desc = as_tensor_desc(arr, name)
    return desc.ptr, (desc.shape, desc.strides, desc.dtype, desc.device_type, desc.device_id)


def wgrad(x: Any, dy: Any, offsets: Any, *, out: Union[Any, Sequence[Any], None] = None,
          accumulate: bool = False, out_dtype: Any = None, dtype: Optional[str] = None,
          stream: Any = None, validate_offsets: bool = False) -> Union[Any, List[Any]]:
    """``W[e] = x[begin:end].T @ dy[begin:end]`` for every expert, FP32 accumulation.

    x: (tokens, hidden), dy: (tokens, intermediate), bfloat16 (see the module doc:
    ``dtype="bfloat16"`` for uint16 / int16 bits); offsets: int32 (num_experts,).
    out: None (a new (num_experts, hidden, intermediate) array of ``out_dtype``: "bfloat16"
    (default, as uint16 bits), "float16" or "float32"), an array of that shape, or a list of
    num_experts contiguous (hidden, intermediate) arrays (discrete outputs).
    accumulate: add to ``out`` instead of overwriting it. Returns ``out`` (or the new array).
    """
    bits = dtype is not None
    if bits and dtype != "bfloat16" and as_dtype(dtype, "dtype") != DType.BFLOAT16:
        raise ValueError(f"dtype: expected None or 'bfloat16', got {dtype!r}")
    if accumulate and out is None:
        raise ValueError("out: expected an initialized output to accumulate into "
                         "(accumulate=True adds to it), got None")
    want = None if out_dtype is None else as_dtype(out_dtype, "out_dtype")
    try:
        qx, qdy, qoff = (_quick(x, "a_tensor"), _quick(dy, "b_tensor"),
                         _quick(offsets, "offsets_tensor"))
    except ValueError as exc:
        raise ValueError(adapter_message(str(exc))) from exc
    device = qx[1][3:]
    launch_stream = _resolve_stream(stream, device)

    discrete = isinstance(out, (list, tuple))
    if discrete:
        outs = list(out)
        target, out_key = _pointer_target(outs, x, dy, offsets, bits, device, launch_stream)
    else:
        result = out
        if out is None:
            shape = experts_hidden_intermediate(_shape(x), _shape(dy), _shape(offsets))
            result = _empty(x, shape, want or DType.BFLOAT16, device, launch_stream,
                            stream is not None)
        try:
            target = _quick(result, "wgrad_tensor")
        except ValueError as exc:
            raise ValueError(adapter_message(str(exc))) from exc
        out_key = target[1]
    key = (qx[1], qdy[1], qoff[1], discrete, out_key, bits, want, accumulate)
    call = _prepared.get(key)
    if call is None:
        call = _prepared[key] = _prepare(x, dy, offsets, bits, want, accumulate,
                                         outs if discrete else result, target, device)
    workspace = 0
    cupy = _cupy()
    if call.workspace_bytes and stream is None and cupy is not None:
        # From the pool, on the current (= launch) stream, freed in stream order.
        if cupy.cuda.runtime.getDevice() == device[1]:
            ws = cupy.empty(call.workspace_bytes, dtype=cupy.uint8)
        else:
            with cupy.cuda.Device(device[1]):
                ws = cupy.empty(call.workspace_bytes, dtype=cupy.uint8)
        workspace = ws.data.ptr
    # else: gwgrad's per-stream workspace (a given stream need not be CuPy's current one)
    try:
        call.launch(qx[0], qdy[0], qoff[0], target[0], launch_stream, workspace,
                    validate_offsets=validate_offsets)
    except ValueError as exc:
        raise ValueError(adapter_message(str(exc))) from exc
    return outs if discrete else result


def _shape(arr: Any) -> Tuple[int, ...]:
    return tuple(getattr(arr, "shape", ()))


def _pointer_target(outs, x, dy, offsets, bits, device, stream):
    """Discrete outputs: ``((address of the int64 address array, ...), key part)``."""
    if not outs:
        raise ValueError("out: expected a non-empty list of per-expert outputs, got []")
    with adapter_names():
        quick = [_quick(o, "wgrad_tensor") for o in outs]
    first = quick[0][1]
    experts = _shape(offsets)[0] if len(_shape(offsets)) == 1 else None
    if len(outs) != experts or any(q[1] != first for q in quick):
        _check_discrete(outs, x, dy, offsets, bits)  # raises the precise error
    addresses = np.array([q[0] for q in quick], dtype=np.int64)
    if device[0] == "cuda":
        return (address_array(addresses, device[1], stream).ptr, addresses), (len(outs), first)
    return (addresses.ctypes.data, addresses), (len(outs), first)


def _prepare(x, dy, offsets, bits, want, accumulate, out, target, device):
    """The first call of a signature: the contract's full check, then the compiled operator."""
    with adapter_names():
        xi = _info(x, "a_tensor", bits, transpose=True)
        dyi = _info(dy, "b_tensor", bits)
        offi = _info(offsets, "offsets_tensor", False)
        a, b, off = _desc(xi, "a_tensor"), _desc(dyi, "b_tensor"), _desc(offi, "offsets_tensor")
        if isinstance(out, list):
            _check_discrete(out, x, dy, offsets, bits)
            out_dtype = _info(out[0], "wgrad_tensor", True)[1][2]
            if want is not None and want != out_dtype:
                raise ValueError(f"out_dtype: expected None or {out_dtype} (out's dtype), got "
                                 f"{want}")
            ptrs = from_pointer(target[0], (len(out),), (1,), DType.INT64, device[1],
                                device_type=device[0], name="wgrad_ptrs")
            return prepare_call(a, b, off, wgrad_ptrs=ptrs, output_mode="discrete",
                                wgrad_dtype=out_dtype, accumulate_on_output=accumulate)
        wgrad = _desc(_info(out, "wgrad_tensor", True), "wgrad_tensor")
        if want is not None and want != wgrad.dtype:
            raise ValueError(f"out_dtype: expected None or {wgrad.dtype} (out's dtype), got {want}")
        return prepare_call(a, b, off, wgrad=wgrad, accumulate_on_output=accumulate)


def _check_discrete(outs, x, dy, offsets, bits) -> None:
    with adapter_names():
        xi = _info(x, "a_tensor", bits, transpose=True)
        infos = [_info(o, "wgrad_tensor", True) for o in outs]
    experts, hidden, inter = experts_hidden_intermediate(_shape(x), _shape(dy), _shape(offsets))
    if len(infos) != experts:
        raise ValueError(f"out: expected {experts} per-expert outputs (one per offsets entry), "
                         f"got {len(infos)}")
    dtype, device = infos[0][1][2], xi[1][3:]
    for e, (_, (shape, strides, o_dtype, *o_device), _) in enumerate(infos):
        contiguous = TensorDesc(0, shape, strides, o_dtype, "cpu").is_contiguous()
        if shape != (hidden, inter) or not contiguous or o_dtype != dtype or \
                tuple(o_device) != device:
            raise ValueError(
                f"out: expected every output to be a contiguous ({hidden}, {inter}) array of "
                f"one dtype on x's device, got out[{e}] of shape {shape}, strides {strides}, "
                f"dtype {o_dtype}, device {o_device[0]}:{o_device[1]}")
