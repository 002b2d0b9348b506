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

``quantize(x, offsets, fmt, dtype="bfloat16")`` is gwgrad's grouped quantizer (gwgrad.quantize):
bfloat16 bits grouped by ``offsets`` to the block-scaled operands ``(data, scales,
global_scale)``, the FP8 / FP4 / E8M0 ones as uint8 bytes, FP32 scales as float32:

    xt, sx, _ = gwc.quantize(x_bits, offsets, "block_1x128", dtype="bfloat16")
    dyt, sdy, _ = gwc.quantize(dy_bits, offsets, "block_1x128", dtype="bfloat16")
    w = gwc.wgrad_fp8(xt.T, dyt.T, offsets, sx, sdy, scale_recipe="block_1x128", fp8="e4m3")

NumPy arrays (on the CPU) are accepted too and run on gwgrad's reference implementation, so
code written against this adapter runs in CPU-only tests.
"""

from __future__ import annotations

import sys
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from gwgrad.dtypes import OUTPUT_DTYPES, DType, as_dtype
from gwgrad.errors import ArgumentError
from gwgrad import interop
from gwgrad.interop import address_array, as_tensor_desc, stream_handle
from gwgrad.interop import numpy as np_interop
from gwgrad.plan import LaunchPlan, PlanCache, plan_for
from gwgrad.tensors import TensorDesc, from_pointer

from ._common import (FP8_DOC, FP8_RECIPES, NAMES, QUANTIZE_NAMES, adapter_names,
                      check_accumulate, experts_hidden_intermediate)

__all__ = ["wgrad", "wgrad_fp8", "quantize", "to_bfloat16_bits", "from_bfloat16_bits"]


def _cupy():
    return sys.modules.get("cupy")


def _is_cupy(arr: Any) -> bool:
    cupy = _cupy()
    return cupy is not None and isinstance(arr, cupy.ndarray)


def _xp(arr: Any):
    return _cupy() if _is_cupy(arr) else np


def _interop():
    """gwgrad.interop.cupy (CuPy arrays), imported with CuPy; None without CuPy."""
    return interop.framework("cupy")


# --- arrays -> descriptors ------------------------------------------------------------------

def _describe(arr: Any, name: str, bfloat16_bits: bool, transpose: bool = False) -> TensorDesc:
    """A TensorDesc of a CuPy / NumPy array (``bfloat16_bits``: uint16 / int16 read as
    bfloat16) or of any DLPack array in its own dtype; of ``arr.T`` when ``transpose``."""
    if _is_cupy(arr):
        return _interop().describe(arr, name, bfloat16_bits, transpose)
    if isinstance(arr, np.ndarray):
        if arr.dtype in np_interop.BITS and not bfloat16_bits:
            raise ArgumentError(name, f"expected a float array, or 16-bit integers holding "
                                      f"bfloat16 bits with dtype='bfloat16', got {arr.dtype}")
        return np_interop.describe(arr, name, bfloat16_bits=bfloat16_bits, transpose=transpose)
    desc = as_tensor_desc(arr, name)
    if transpose:
        if desc.ndim != 2:
            raise ArgumentError(name, f"expected 2 dims, got shape {desc.shape}")
        desc = TensorDesc(desc.ptr, desc.shape[::-1], desc.strides[::-1], desc.dtype,
                          desc.device_type, desc.device_id, desc.framework, desc.owner)
    return desc


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

# (signature) -> gwgrad.plan.LaunchPlan: a hit needs no validation beyond alignment.
_plans = PlanCache()


def _resolve_stream(stream: Any, device) -> int:
    if device[0] != "cuda":
        return 0
    if stream is not None:
        return stream_handle(stream, "stream")
    cupy_interop = _interop()
    return cupy_interop.current_stream(device[1]) if cupy_interop is not None else 0


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
        np_dtype = np.dtype(dtype.value)
    if device[0] != "cuda":
        return np.empty(shape, np_dtype)
    cupy_interop = _interop()
    if cupy_interop is None:
        raise RuntimeError("allocating a CUDA output needs CuPy (pip install cupy-cuda13x), or "
                           "pass out")
    return cupy_interop.empty(shape, np_dtype, device[1], stream if stream_given else None)


def _quick(arr: Any, name: str):
    """``(address, signature)`` of an array, cheaply: a CuPy / NumPy array's raw attributes
    (validated by ``_describe`` when the signature is first seen); other arrays are described
    through DLPack on every call."""
    cupy_interop = _interop()
    if cupy_interop is not None:
        quick = cupy_interop.signature(arr)
        if quick is not None:
            return quick
    elif type(arr) is np.ndarray:
        return arr.__array_interface__["data"][0], (arr.shape, arr.strides, arr.dtype, "cpu", 0)
    desc = as_tensor_desc(arr, name)
    return desc.ptr, (desc.shape, desc.strides, desc.dtype, desc.device_type, desc.device_id)


def _output_dtype(out_dtype: Any) -> Optional[DType]:
    if out_dtype is None:
        return None
    dtype = as_dtype(out_dtype, "out_dtype")
    if dtype not in OUTPUT_DTYPES:
        raise ArgumentError("out_dtype", f"expected None, 'bfloat16', 'float16' or 'float32', "
                                         f"got {dtype}")
    return dtype


def wgrad(x: Any, dy: Any, offsets: Any, *, out: Union[Any, Sequence[Any], None] = None,
          accumulate: bool = False, out_dtype: Any = None, dtype: Optional[str] = None,
          stream: Any = None, validate_offsets: bool = False) -> Union[Any, List[Any]]:
    """``W[e] = x[begin:end].T @ dy[begin:end]`` for every expert, FP32 accumulation.

    x: (tokens, hidden), dy: (tokens, intermediate), bfloat16 (see the module doc:
    ``dtype="bfloat16"`` for uint16 / int16 bits); offsets: int32 (num_experts,).
    out: None (a new (num_experts, hidden, intermediate) array of ``out_dtype``: "bfloat16"
    (default, as uint16 bits), "float16" or "float32"), an array of that shape, or a list of
    num_experts contiguous (hidden, intermediate) arrays (discrete outputs).
    accumulate: add to ``out`` instead of overwriting it. Offsets are checked on the device
    (invalid ones write nothing; the error comes from ``gwgrad.check_errors()`` or the next
    call); ``validate_offsets=True`` checks them on the host first (one sync).
    Returns ``out`` (or the new array).
    """
    bits = dtype is not None
    if bits and as_dtype(dtype, "dtype") != DType.BFLOAT16:
        raise ArgumentError("dtype", f"expected None or 'bfloat16', got {dtype!r}")
    check_accumulate(accumulate, out)
    want = _output_dtype(out_dtype)
    try:
        qx, qdy, qoff = (_quick(x, "a_tensor"), _quick(dy, "b_tensor"),
                         _quick(offsets, "offsets_tensor"))
    except ArgumentError as exc:
        raise exc.renamed(NAMES) from None
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
        except ArgumentError as exc:
            raise exc.renamed(NAMES) from None
        out_key = target[1]
    key = (qx[1], qdy[1], qoff[1], discrete, out_key, bits, want, accumulate)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _plan(x, dy, offsets, bits, want, accumulate,
                                   outs if discrete else result, target, device)
    workspace, keep = 0, None
    cupy_interop = _interop()
    if plan.workspace_bytes and stream is None and cupy_interop is not None:
        # From the pool: the launch stream's own (zero-filled once), or fresh while capturing.
        keep = cupy_interop.workspace(plan.workspace_bytes, device[1], launch_stream)
        workspace = keep.data.ptr
    # else: gwgrad's per-stream workspace (a given stream need not be CuPy's current one)
    try:
        plan.launch(qx[0], qdy[0], qoff[0], target[0], stream=launch_stream,
                    workspace=workspace, validate_offsets=validate_offsets)
    except ArgumentError as exc:  # misaligned storage, or offsets rejected by a check
        raise exc.renamed(NAMES) from None
    return outs if discrete else result


def _shape(arr: Any) -> Tuple[int, ...]:
    return tuple(getattr(arr, "shape", ()))


def _pointer_target(outs, x, dy, offsets, bits, device, stream):
    """Discrete outputs: ``((address of the int64 address array, ...), key part)``."""
    if not outs:
        raise ArgumentError("out", "expected a non-empty list of per-expert outputs, got []")
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


def _plan(x, dy, offsets, bits, want, accumulate, out, target, device) -> LaunchPlan:
    """The first call of a signature: the contract's full check, then the compiled operator."""
    with adapter_names():
        a = _describe(x, "a_tensor", bits, transpose=True)
        b = _describe(dy, "b_tensor", bits)
        off = _describe(offsets, "offsets_tensor", False)
        if isinstance(out, list):
            _check_discrete(out, x, dy, offsets, bits)
            out_dtype = _describe(out[0], "wgrad_tensor", True).dtype
            if want is not None and want != out_dtype:
                raise ArgumentError("out_dtype", f"expected None or {out_dtype} (out's dtype), "
                                                 f"got {want}")
            ptrs = from_pointer(target[0], (len(out),), (1,), DType.INT64, device[1],
                                device_type=device[0], name="wgrad_ptrs")
            return plan_for(a, b, off, wgrad_ptrs=ptrs, output_mode="discrete",
                            wgrad_dtype=out_dtype, accumulate_on_output=accumulate)
        wgrad = _describe(out, "wgrad_tensor", True)
        if want is not None and want != wgrad.dtype:
            raise ArgumentError("out_dtype", f"expected None or {wgrad.dtype} (out's dtype), "
                                             f"got {want}")
        return plan_for(a, b, off, wgrad=wgrad, accumulate_on_output=accumulate)


def _check_discrete(outs, x, dy, offsets, bits) -> None:
    with adapter_names():
        xd = _describe(x, "a_tensor", bits, transpose=True)
        descs = [_describe(o, "wgrad_tensor", True) for o in outs]
    experts, hidden, inter = experts_hidden_intermediate(_shape(x), _shape(dy), _shape(offsets))
    if len(descs) != experts:
        raise ArgumentError("out", f"expected {experts} per-expert outputs (one per offsets "
                                   f"entry), got {len(descs)}")
    first = descs[0]
    for e, d in enumerate(descs):
        if d.shape != (hidden, inter) or not d.is_contiguous() or d.dtype != first.dtype or \
                d.device != xd.device:
            raise ArgumentError(
                "out", f"expected every output to be a contiguous ({hidden}, {inter}) array of "
                f"one dtype on x's device, got out[{e}] of shape {d.shape}, strides {d.strides}, "
                f"dtype {d.dtype}, device {d.device}")


# --- FP8 ------------------------------------------------------------------------------------

_FP8_FORMATS = {"e4m3": DType.FLOAT8_E4M3FN, "float8_e4m3fn": DType.FLOAT8_E4M3FN,
                "e5m2": DType.FLOAT8_E5M2, "float8_e5m2": DType.FLOAT8_E5M2}


def _fp8_operand(arr: Any, name: str, fmt: Optional[str]) -> TensorDesc:
    """The contract's operand (``arr.T`` for x) of an FP8 array: uint8 bits flagged with
    ``fmt``, or an array whose own dtype is FP8 (``fmt`` None)."""
    desc = _describe(arr, name, False, transpose=name == "a_tensor")
    if desc.dtype == DType.UINT8:
        if fmt not in _FP8_FORMATS:
            raise ArgumentError(name, f"expected uint8 FP8 bits flagged with fp8='e4m3' or "
                                      f"'e5m2', got fp8={fmt!r}")
        desc = TensorDesc(desc.ptr, desc.shape, desc.strides, _FP8_FORMATS[fmt],
                          desc.device_type, desc.device_id, desc.framework, desc.owner)
    return desc


def wgrad_fp8(x: Any, dy: Any, offsets: Any, x_scale: Any, dy_scale: Any, *, scale_recipe: str,
              fp8: Union[str, Tuple[str, str], None] = None, out: Any = None,
              accumulate: bool = False, out_dtype: Any = None, x_global_scale: Any = None,
              dy_global_scale: Any = None, stream: Any = None,
              validate_offsets: bool = False) -> Any:
    import gwgrad

    if scale_recipe not in FP8_RECIPES:
        raise ArgumentError("scale_recipe", f"expected one of {sorted(FP8_RECIPES)}, got "
                                            f"{scale_recipe!r}")
    check_accumulate(accumulate, out)
    fx, fdy = fp8 if isinstance(fp8, (tuple, list)) else (fp8, fp8)
    want = _output_dtype(out_dtype)
    with adapter_names():
        a = _fp8_operand(x, "a_tensor", fx)
        b = _fp8_operand(dy, "b_tensor", fdy)
        device = (a.device_type, a.device_id)
        launch_stream = _resolve_stream(stream, device)
        result = out
        if out is None:
            shape = experts_hidden_intermediate(_shape(x), _shape(dy), _shape(offsets))
            result = _empty(x, shape, want or DType.BFLOAT16, device, launch_stream,
                            stream is not None)
        wgrad = _describe(result, "wgrad_tensor", True)
        if want is not None and want != wgrad.dtype:
            raise ArgumentError("out_dtype", f"expected None or {wgrad.dtype} (out's dtype), "
                                             f"got {want}")
        gwgrad.grouped_gemm_wgrad(
            a, b, _describe(x_scale, "sfa_tensor", False), _describe(dy_scale, "sfb_tensor", False),
            _describe(offsets, "offsets_tensor", False), wgrad_tensor=wgrad,
            global_scale_a=None if x_global_scale is None else _describe(
                x_global_scale, "global_scale_a", False),
            global_scale_b=None if dy_global_scale is None else _describe(
                dy_global_scale, "global_scale_b", False),
            accumulate_on_output=accumulate, sf_vec_size=FP8_RECIPES[scale_recipe],
            current_stream=launch_stream, validate_offsets=validate_offsets,
            scale_recipe=scale_recipe)
    return result


wgrad_fp8.__doc__ = FP8_DOC + """

    CuPy has no FP8 dtypes: FP8 data travels as uint8 bits flagged with ``fp8`` ("e4m3" or
    "e5m2", or a pair for x and dy); arrays that are FP8 themselves (ml_dtypes NumPy arrays,
    DLPack FP8 arrays) need no flag. out: None (a new dense array of ``out_dtype``; bfloat16
    as uint16 bits) or a dense (num_experts, hidden, intermediate) array (per-expert outputs:
    the core API's ``wgrad_ptrs``). Runs on ``stream`` or CuPy's current stream; NumPy arrays
    run the reference."""


# --- quantize: BF16 x grouped by expert to block-scaled operands ----------------------------

def quantize(x: Any, offsets: Any, fmt: str, *, elem: Optional[str] = None,
             out: Optional[Sequence[Any]] = None, dtype: Optional[str] = None,
             stream: Any = None) -> Tuple[Any, Any, Optional[Any]]:
    """Quantize ``x`` (tokens, channels), bfloat16, row-major (``dtype="bfloat16"`` for uint16
    / int16 bits, as in ``wgrad``), grouped by expert through ``offsets`` (int32
    (num_experts,), the cumulative token counts; read on the device, never on the host) into
    ``fmt``: "mxfp8", "mxfp4", "nvfp4", "per_expert_channel" or "block_1x128"
    (gwgrad/quantizers.py; ``elem``: "e4m3" (default) or "e5m2" for the FP8 formats).

    Returns ``(data, scales, global_scale)`` as CuPy arrays (NumPy for NumPy inputs), shapes
    from ``gwgrad.quantizers.layout(fmt, tokens, channels, num_experts, elem)``; CuPy has no
    FP8 / FP4 / E8M0 dtypes, so those come as their bytes:

    * ``data`` uint8 (channels, tokens), tokens contiguous: FP8 codes (``wgrad_fp8(data.T,
      ..., fp8=elem)``), or packed E2M1 (channels, tokens // 2) for mxfp4 / nvfp4;
    * ``scales`` uint8 E8M0 (mxfp8, mxfp4) / E4M3 (nvfp4) codes in the blocked layout
      (round_up(channels, 128), capacity), or float32 (num_experts, channels)
      (per_expert_channel) / (capacity, channels) (block_1x128), ``wgrad_fp8``'s scales;
    * ``global_scale`` float32 (num_experts,) for nvfp4, else None.

    out: None (new arrays from CuPy's pool on the launch stream) or a ``(data, scales,
    global_scale)`` tuple to write into (a previous call's result; FP8 / FP4 / E8M0 outputs
    may also be arrays of those dtypes, e.g. ml_dtypes NumPy arrays). Every expert's count
    must be a multiple of ``gwgrad.quantizers.count_multiple(fmt)``, and so must ``tokens``
    (a count that is not, or invalid offsets, are quantized as an empty expert). Runs on
    ``stream`` or CuPy's current stream, without a host synchronization (the workspace:
    gwgrad's per-stream buffer); NumPy arrays run the NumPy model, bit-equal to the kernel.
    """
    import gwgrad
    from gwgrad import quantizers

    bits = dtype is not None
    if bits and as_dtype(dtype, "dtype") != DType.BFLOAT16:
        raise ArgumentError("dtype", f"expected None or 'bfloat16', got {dtype!r}")
    if elem is not None and not isinstance(elem, str):
        try:
            elem = np.dtype(elem).name  # an ml_dtypes float8 dtype -> "float8_e4m3fn"
        except TypeError:
            pass  # gwgrad.quantizers names elem in its error
    xd = _describe(x, "x", bits)
    od = _describe(offsets, "offsets", False)
    device = (xd.device_type, xd.device_id)
    launch_stream = _resolve_stream(stream, device)
    if out is None:
        if xd.ndim != 2:
            raise ArgumentError("x", f"expected a 2-D bfloat16 (tokens, channels) array, got "
                                     f"{xd.ndim}-D {xd.dtype}")
        if od.ndim != 1:
            raise ArgumentError("offsets", f"expected a 1-D int32 array of at least one "
                                           f"expert, got {od.ndim}-D {od.dtype}")
        lay = quantizers.layout(fmt, xd.shape[0], xd.shape[1], od.shape[0], elem)
        outs = tuple(None if shape is None else
                     _empty(x, shape, DType.FLOAT32 if kind == DType.FLOAT32 else DType.UINT8,
                            device, launch_stream, stream is not None)
                     for shape, kind in ((lay.data_shape, lay.data_dtype),
                                         (lay.scale_shape, lay.scale_dtype),
                                         (lay.global_shape, DType.FLOAT32)))
    else:
        if not isinstance(out, (tuple, list)) or len(out) not in (2, 3):
            raise ArgumentError("out", f"expected None or a (data, scales, global_scale) tuple, "
                                       f"got {type(out).__name__}"
                                       + (f" of length {len(out)}"
                                          if isinstance(out, (tuple, list)) else ""))
        outs = (*out, None) if len(out) == 2 else tuple(out)
        f = quantizers.FORMATS.get(fmt) if isinstance(fmt, str) else None
        if outs[2] is None and f is not None and f.global_scale:
            raise ArgumentError(QUANTIZE_NAMES["global_scale"], f"expected a float32 "
                                f"(num_experts,) array ({fmt}'s per-expert global scales), "
                                f"got None")
        if outs[0] is None or outs[1] is None:
            name = QUANTIZE_NAMES["data" if outs[0] is None else "scales"]
            raise ArgumentError(name, "expected an array, got None")
    descs = [None if o is None else _describe(o, QUANTIZE_NAMES[name], False)
             for name, o in zip(("data", "scales", "global_scale"), outs)]
    with adapter_names(QUANTIZE_NAMES):
        gwgrad.quantize(xd, od, fmt, elem=elem, data=descs[0], scales=descs[1],
                        global_scale=descs[2], stream=launch_stream)
    return outs
