"""Grouped quantizers: a training step's BF16 ``x`` (tokens, hidden) or ``dy`` (tokens,
intermediate), grouped by expert through the device ``offsets``, to every block-scaled input the
weight-gradient kernels take, in one call, without a host synchronization.

Formats (``fmt``; data dtype, scales, scale layout of gwgrad/scales.py):

==================== ============= ====================================== ====================
fmt                  data          scales                                  consumer recipe
==================== ============= ====================================== ====================
"mxfp8"              e4m3 / e5m2   E8M0 per 32 tokens, blocked             ``blocked``, sf 32
"mxfp4"              packed e2m1   E8M0 per 32 tokens, blocked             ``blocked``, sf 32
"nvfp4"              packed e2m1   E4M3 per 16 tokens, blocked, + the      ``blocked``, sf 16
                                   per-expert FP32 global scale
"per_expert_channel" e4m3 / e5m2   FP32 (E, channels)                      ``per_expert_channel``
"block_1x128"        e4m3 / e5m2   FP32 (R, channels), 128 tokens per row  ``block_1x128``
==================== ============= ====================================== ====================

``data`` is ``(channels, tokens)`` with the tokens contiguous (packed FP4: ``(channels,
tokens // 2)`` bytes), the K-major operand Hopper's and Blackwell's tensor cores read: pass
``data.T`` (a ``(tokens, channels)`` view) as the GEMM's ``x`` / ``dy``. Rounding, scale choice
and NaN / Inf handling are gwgrad/formats.py's models, which the GPU kernels match bit for bit.

Counts: every expert's token count must be a multiple of ``token_count_multiple`` of the
consuming GEMM (32 for blocked scales, 16 for the FP32 recipes); a count that is not (or a
negative one, or one past the tokens) is quantized as an empty expert, and the GEMM's own
offsets check reports the offsets. Decreasing offsets can make experts' ranges overlap: the
outputs are then unspecified, but nothing is written outside them. Scale capacity: ``layout(...)`` gives the scale tensor a size that holds
any valid counts (``round_up(ceil(T / sf_vec) + 3E, 4)`` blocked columns, ``ceil(T / 128) + E``
1x128 rows);
the kernels never write past a given scale tensor.

Paths: CUDA arrays run the CuTe DSL kernels of gwgrad/kernels/quantize.py through gwgrad.plan
(compiled once per (channels, experts, format, arch), kept on disk by gwgrad.kernel_cache; any
token count; a cached kernel runs without importing the DSL); CPU arrays run the NumPy model
(``reference_quantize``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import formats, interop, plan, scales as sc
from .api import TupleDict
from .dtypes import DType
from .errors import fail
from .tensors import TensorDesc
from .validation import check_aligned

__all__ = ["FORMATS", "QuantizedLayout", "layout", "quantize", "reference_quantize"]


@dataclass(frozen=True)
class Format:
    recipe: str  # the GEMM's scale_recipe
    sf_vec: int  # tokens per scale (0: per_expert_channel)
    elems: Tuple[str, ...]  # element formats; the first is the default
    scale_dtype: DType
    global_scale: bool


FORMATS: Dict[str, Format] = {
    "mxfp8": Format(sc.BLOCKED, 32, ("e4m3", "e5m2"), DType.FLOAT8_E8M0FNU, False),
    "mxfp4": Format(sc.BLOCKED, 32, ("e2m1",), DType.FLOAT8_E8M0FNU, False),
    "nvfp4": Format(sc.BLOCKED, 16, ("e2m1",), DType.FLOAT8_E4M3FN, True),
    "per_expert_channel": Format(sc.PER_EXPERT_CHANNEL, 0, ("e4m3", "e5m2"), DType.FLOAT32,
                                 False),
    "block_1x128": Format(sc.BLOCK_1X128, 128, ("e4m3", "e5m2"), DType.FLOAT32, False),
}

_ELEM_DTYPES = {"e4m3": DType.FLOAT8_E4M3FN, "e5m2": DType.FLOAT8_E5M2,
                "e2m1": DType.FLOAT4_E2M1FN_X2}


def _format(fmt: Any) -> Format:
    found = FORMATS.get(fmt) if isinstance(fmt, str) else None
    if found is None:
        fail("fmt", f"one of {', '.join(repr(f) for f in FORMATS)}", repr(fmt))
    return found


def _elem(fmt: str, elem: Optional[str]) -> str:
    f = _format(fmt)
    if elem is None:
        return f.elems[0]
    text = str(elem).removeprefix("torch.").removeprefix("DType.").lower()
    name = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}.get(text, text)
    if name not in f.elems:
        fail("elem", f"{' or '.join(f.elems)} for {fmt}", repr(elem))
    return name


def count_multiple(fmt: str) -> int:
    """Every expert's token count must be a multiple of this: 32 with blocked scales (whole
    scale blocks), 16 with the FP32 recipes. The FP4 GEMM (SM100) takes multiples of 64 only
    (gwgrad.offsets.token_count_multiple: no MMA step may read a padding scale column)."""
    return 32 if _format(fmt).recipe == sc.BLOCKED else 16


@dataclass(frozen=True)
class QuantizedLayout:
    """Shapes and dtypes of one quantizer call's outputs (``scale_capacity``: the columns
    (blocked) or rows (block_1x128) of the scale tensor; 0 for per_expert_channel)."""

    fmt: str
    elem: str
    data_shape: Tuple[int, int]
    data_dtype: DType
    scale_shape: Tuple[int, int]
    scale_dtype: DType
    global_shape: Optional[Tuple[int]]
    scale_capacity: int


def layout(fmt: str, tokens: int, channels: int, num_experts: int, elem: Optional[str] = None,
           scale_capacity: Optional[int] = None) -> QuantizedLayout:
    """The outputs of quantizing a ``(tokens, channels)`` input of ``num_experts`` experts.
    ``scale_capacity`` defaults to the bound that holds any valid counts (module doc)."""
    f = _format(fmt)
    elem = _elem(fmt, elem)
    if tokens % count_multiple(fmt):
        fail("x", f"a token count (x.shape[0]) that is a multiple of {count_multiple(fmt)} "
                  f"({fmt}: every expert's count is)", tokens)
    data_shape = (channels, tokens // 2 if elem == "e2m1" else tokens)
    if f.recipe == sc.BLOCKED:
        bound = sc.round_up(-(-tokens // f.sf_vec) + 3 * num_experts, sc.ATOM_COLS)
        minimum = sc.round_up(-(-tokens // f.sf_vec), sc.ATOM_COLS)
    elif f.recipe == sc.BLOCK_1X128:
        bound = -(-tokens // sc.BLOCK_TOKENS) + num_experts
        minimum = -(-tokens // sc.BLOCK_TOKENS)
    else:
        bound = minimum = 0
    capacity = bound if scale_capacity is None else int(scale_capacity)
    if capacity < minimum:
        fail("scales", f"a scale capacity of at least {minimum}", capacity)
    if f.recipe == sc.BLOCKED:
        scale_shape = (sc.round_up(channels, sc.ATOM_ROWS), capacity)
    elif f.recipe == sc.BLOCK_1X128:
        scale_shape = (capacity, channels)
    else:
        scale_shape = (num_experts, channels)
    return QuantizedLayout(fmt, elem, data_shape, _ELEM_DTYPES[elem], scale_shape,
                           f.scale_dtype, (num_experts,) if f.global_scale else None,
                           0 if f.recipe == sc.PER_EXPERT_CHANNEL else capacity)


# --- the NumPy model, grouped -------------------------------------------------------------------

def _counts(offsets: np.ndarray, tokens: int, multiple: int) -> Tuple[np.ndarray, np.ndarray]:
    """(begin, end) per expert, sanitized as the kernels do (kernels/prep.sanitized_range):
    each offset clamped into [0, tokens], ``begin_e`` the clamped ``offsets[e-1]``, ``end_e``
    at least ``begin_e``, a count not a multiple of ``multiple`` made empty. Valid offsets
    give the experts' ranges; invalid ones may give overlapping ranges, for which the GPU's
    outputs are unspecified (experts share tokens, and their tiles can outnumber the grid's
    ``ceil(T / 128) + E`` rows) but stay inside the output tensors; the GEMM's offsets check
    reports such offsets."""
    clamped = np.clip(np.asarray(offsets, dtype=np.int64), 0, tokens)
    begin = np.concatenate([[0], clamped[:-1]])
    end = np.maximum(clamped, begin)
    bad = (end - begin) % multiple != 0
    end = np.where(bad, begin, end)
    return begin, end


def reference_quantize(x: Any, offsets: Any, fmt: str, elem: Optional[str] = None,
                       scale_capacity: Optional[int] = None
                       ) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """The outputs of ``quantize`` for a host ``x`` (tokens, channels) of float values (BF16
    values for bit-exactness with the GPU) and host ``offsets``: ``(data, scales,
    global_scale)`` as NumPy arrays (data uint8; scales uint8 codes or float32; global scale
    float32 or None), built expert by expert with gwgrad/formats.py."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        fail("x", "a (tokens, channels) array", f"shape {x.shape}")
    tokens, channels = x.shape
    offsets = np.asarray(offsets).reshape(-1)
    f = _format(fmt)
    lay = layout(fmt, tokens, channels, offsets.size, elem, scale_capacity)
    elem = lay.elem
    begin, end = _counts(offsets, tokens, count_multiple(fmt))
    codes = np.zeros((channels, tokens), np.uint8)
    scales = np.zeros(lay.scale_shape, np.uint8 if f.recipe == sc.BLOCKED else np.float32)
    gs = np.ones(lay.global_shape, np.float32) if f.global_scale else None
    column = 0
    for e, (b, n) in enumerate(zip(begin, end)):
        xe = x[b:n].T  # (channels, count)
        if f.recipe == sc.BLOCKED:
            if f.global_scale:
                c, s, g = formats.quantize_nvfp4(xe)
                gs[e] = g
            else:
                c, s = formats.quantize_mx(xe, f.sf_vec, elem)
            codes[:, b:n] = c
            chunk = sc.to_blocked(s).reshape(-1) if s.shape[1] else np.zeros(0, np.uint8)
            mpad = lay.scale_shape[0]
            cols = chunk.size // mpad
            # The blocked tensor's bytes are addressed flat (gwgrad/scales.py): the expert's
            # chunk starts at byte Mpad * S_e; bytes past the tensor (Mpad * capacity) are not
            # written, as in the kernel.
            flat = scales.reshape(-1)
            keep = max(0, min(cols, lay.scale_capacity - column))
            flat[mpad * column:mpad * (column + keep)] = chunk[:mpad * keep]
            column += cols
        elif f.recipe == sc.BLOCK_1X128:
            c, s = formats.quantize_rowwise_fp8(xe, elem, sc.BLOCK_TOKENS)
            codes[:, b:n] = c
            rows = s.shape[1]
            keep = max(0, min(rows, lay.scale_capacity - column))
            scales[column:column + keep] = s.T[:keep]
            column += rows
        else:
            c, s = formats.quantize_rowwise_fp8(xe, elem)
            codes[:, b:n] = c
            scales[e] = s
    if elem == "e2m1":
        codes = formats.pack_fp4(codes, axis=1)
    return codes, scales, gs


# --- the GPU path -------------------------------------------------------------------------------

def request(fmt: str, elem: str, channels: int, num_experts: int,
            arch: str) -> plan.QuantizeRequest:
    """The quantizer kernel of a call, as gwgrad.plan keys its compiled operator."""
    f = _format(fmt)
    return plan.QuantizeRequest(channels=channels, num_experts=num_experts, recipe=f.recipe,
                                elem=elem, sf_vec=f.sf_vec, count_multiple=count_multiple(fmt),
                                arch=arch)


def kernel_config(fmt: str, elem: str, channels: int, num_experts: int):
    """The kernel's ``QuantizeConfig`` of a call (imports the DSL)."""
    return request(fmt, elem, channels, num_experts, "").config()


def compile_quantizer(cfg, arch: str, extra_options: str = "") -> Any:
    """``cute.compile`` of the quantizer of ``cfg`` for ``arch`` (no cache; the compile tests
    read ``.artifacts.PTX`` with ``extra_options="--keep-ptx"``)."""
    from .kernels import compiler

    return compiler.compile_quantizer(cfg, arch, extra_options)


def _check(desc: Optional[TensorDesc], name: str, shape, dtypes, x: TensorDesc,
           contiguous: bool = True) -> None:
    if desc is None:
        fail(name, "an array", None)
    if tuple(desc.shape) != tuple(shape):
        fail(name, f"shape {tuple(shape)}", tuple(desc.shape))
    if desc.dtype not in dtypes:
        fail(name, " or ".join(str(d) for d in dtypes), desc.dtype)
    if (desc.device_type, desc.device_id) != (x.device_type, x.device_id):
        fail(name, f"an array on {x.device} (x's device)", desc.device)
    if contiguous and not desc.is_contiguous():
        fail(name, "a contiguous (row-major) array", f"strides {desc.strides}")
    if desc.read_only:
        fail(name, "a writable array", "a read-only one")


def quantize(x: Any, offsets: Any, fmt: str, *, elem: Optional[str] = None, data: Any = None,
             scales: Any = None, global_scale: Any = None, stream: Any = None) -> TupleDict:
    """Quantize ``x`` (tokens, channels), BF16, row-major, grouped by expert through
    ``offsets`` (int32, (E,), device-resident: never read on the host for CUDA arrays) into
    ``fmt`` (module doc). Outputs are written into ``data`` / ``scales`` / ``global_scale``
    when given (shapes and dtypes: ``layout``; FP8 / FP4 / E8M0 outputs may also be uint8
    arrays of the same shape), else allocated in ``x``'s framework on ``stream`` (default: the
    framework's current stream). Returns ``TupleDict(data=..., scales=..., global_scale=...)``
    (``global_scale`` None but for NVFP4)."""
    f = _format(fmt)
    elem = _elem(fmt, elem)
    xd = interop.as_tensor_desc(x, "x")
    od = interop.as_tensor_desc(offsets, "offsets")
    if xd is None:
        fail("x", "a (tokens, channels) array", None)
    if xd.ndim != 2 or xd.dtype != DType.BFLOAT16:
        fail("x", "a 2-D bfloat16 (tokens, channels) array", f"{xd.ndim}-D {xd.dtype}")
    if not xd.is_contiguous():
        fail("x", "a row-major (channels contiguous) array", f"strides {xd.strides}")
    if od is None or od.ndim != 1 or od.dtype != DType.INT32 or od.shape[0] < 1:
        fail("offsets", "a 1-D int32 array of at least one expert",
             None if od is None else f"{od.ndim}-D {od.dtype} of shape {od.shape}")
    if (od.device_type, od.device_id) != (xd.device_type, xd.device_id):
        fail("offsets", f"an array on {xd.device} (x's device)", od.device)
    if od.strides[0] != 1 and od.shape[0] > 1:
        fail("offsets", "a contiguous array", f"stride {od.strides[0]}")
    tokens, channels = xd.shape
    experts = od.shape[0]
    if channels % 8 or channels == 0:
        fail("x", "a channel count (x.shape[1]) that is a positive multiple of 8", channels)
    sd = interop.as_tensor_desc(scales, "scales")
    capacity = None
    if sd is not None and f.recipe == sc.BLOCKED and sd.ndim == 2:
        capacity = sd.shape[1]
    elif sd is not None and f.recipe == sc.BLOCK_1X128 and sd.ndim == 2:
        capacity = sd.shape[0]
    lay = layout(fmt, tokens, channels, experts, elem, capacity)
    stream_h = interop.resolve_stream(stream, xd.framework, xd.device_id) if xd.is_cuda else 0

    dd = interop.as_tensor_desc(data, "data")
    gd = interop.as_tensor_desc(global_scale, "global_scale")
    outs = []
    for name, desc, shape, dtype in (("data", dd, lay.data_shape, lay.data_dtype),
                                     ("scales", sd, lay.scale_shape, lay.scale_dtype),
                                     ("global_scale", gd, lay.global_shape, DType.FLOAT32)):
        if shape is None:
            if desc is not None:
                fail(name, f"None ({fmt} has no {name})", "an array")
            outs.append((None, None))
            continue
        if desc is None:
            if xd.framework != "torch" and dtype != DType.FLOAT32 and (
                    xd.is_cuda or dtype == DType.FLOAT4_E2M1FN_X2):
                dtype = DType.UINT8  # arrays without FP8 / FP4 / E8M0 types get the bytes
            cupy_ = interop.framework("cupy") if xd.framework == "cupy" and xd.is_cuda else None
            if cupy_ is not None:  # CuPy's allocator, in bytes or float32 (no FP8 types)
                out = cupy_.empty(shape, np.dtype(np.uint8 if dtype == DType.UINT8
                                                  else np.float32), xd.device_id, stream_h)
                desc = interop.as_tensor_desc(out, name)
            else:
                out, desc = interop.allocate(xd, shape, dtype, stream_h)
        else:
            out = desc.owner if desc.owner is not None else desc
            allowed = (dtype,) if dtype in (DType.FLOAT32,) else (dtype, DType.UINT8)
            _check(desc, name, shape, allowed, xd)
        outs.append((out, desc))
    (data_out, data_d), (scales_out, scales_d), (gs_out, gs_d) = outs

    if not xd.is_cuda:
        _run_reference(xd, od, fmt, elem, lay, data_d, scales_d, gs_d)
    else:
        # The kernel's vector loads and stores (16 bytes), int32 / float32 words (4).
        for name, d, nbytes in (("x", xd, 16), ("data", data_d, 16), ("scales", scales_d, 16),
                                ("offsets", od, 4), ("global_scale", gs_d, 4)):
            check_aligned(d, name, nbytes)
        from .errors import UnsupportedError

        try:
            arch = plan.target_arch(xd.device_id)
        except UnsupportedError as exc:  # named after the GEMM's a_tensor: here it is x
            raise exc.renamed({"a_tensor": "x"}) from None
        # Tile rows (>= 1: with no tokens, row 0 still writes the empty experts' scales).
        call = plan.quantize_plan(request(fmt, elem, channels, experts, arch), tokens,
                                  xd.device_id)
        # Workspace (the tile table, amaxes): torch's allocator when x is torch's (CUDA-graph
        # capturable), else gwgrad's per-stream buffer (grow it before a capture).
        torch_ = interop.framework("torch") if xd.framework == "torch" else None
        if torch_ is not None:
            ws = torch_.workspace(xd.device_id, stream_h, call.workspace_bytes, "quantize")
        else:
            ws = interop.workspace(xd.device_id, stream_h, call.workspace_bytes, "quantize")
        call.launch(stream_h, xd.ptr, od.ptr, data_d.ptr, scales_d.ptr,
                    gs_d.ptr if gs_d is not None else 0, ws, lay.scale_capacity)
        for d in (data_d, scales_d, gs_d):
            interop.keep_alive(d, stream_h)
    return TupleDict(data=data_out, scales=scales_out, global_scale=gs_out)


def _run_reference(xd, od, fmt, elem, lay, data_d, scales_d, gs_d) -> None:
    """CPU arrays: the NumPy model, written into the outputs."""
    from .backends.reference import decode
    from .hostview import host_view

    x = decode(host_view(xd), DType.BFLOAT16)
    offsets = host_view(od)
    codes, s, g = reference_quantize(x, offsets, fmt, elem, lay.scale_capacity or None)
    host_view(data_d).view(np.uint8)[...] = codes
    target = host_view(scales_d)
    target.view(s.dtype)[...] = s
    if gs_d is not None:
        host_view(gs_d)[...] = g
