"""The reference backend: the exact semantics, in NumPy, on host memory.

For expert e with ``begin = offsets[e-1]`` (0 for e = 0) and ``end = offsets[e]``:

    W[e] = A[:, begin:end] @ B[begin:end, :]

computed in float64 (float32 once an expert's product gets large), then rounded once to the
output dtype; with ``accumulate`` the output becomes ``round(float32(W_old) + product)``. An
empty expert writes zeros (or leaves the output as it was when accumulating).

Where expert e's operand block lives:

* ``tensor2d``: the declared strides of the global 2-D tensors.
* ``tensor_ragged``, operand whose unit-stride axis is K: per-expert blocks concatenated in
  memory. A's block starts at element ``begin * hidden`` and is ``(hidden, count)`` with
  strides ``(count, 1)``; B's starts at ``begin * intermediate`` and is
  ``(count, intermediate)`` with strides ``(1, count)``.
* ``tensor_ragged``, operand whose unit-stride axis is M (A) or N (B): the same memory as
  ``tensor2d`` with the canonical strides ``(1, hidden)`` / ``(intermediate, 1)``.

Block-scaled inputs (the reference's logical scale layout; the GPU kernels document their
own): packed FP4 holds two values per byte along K, low nibble first. ``sfa_tensor`` is
``(hidden, ceil(tokens_sum / sf_vec_size))`` and ``sfb_tensor`` is
``(ceil(tokens_sum / sf_vec_size), intermediate)``, any strides; the scale of A[m, k] is
``sfa[m, k // sf_vec_size]`` with k the global token index (expert e's K blocks start at
``begin / sf_vec_size``; ragged inputs use the same scale tensors). Global scales, when
given, multiply the product: ``W[e] = (A * sfa) @ (B * sfb) * global_scale_a * global_scale_b``.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np

from ..dtypes import DType
from ..errors import ArgumentError
from ..kernels.tiling import sm90_problem, sm100_problem
from ..hostview import RAW_NUMPY, host_view, strided_view
from ..offsets import check_offsets_values, check_ptr_values
from ..spec import StaticSpec
from ..tensors import TensorDesc
from .base import Backend, LaunchArgs

# Past this many multiply-adds per expert, float32 matmul keeps CPU tests fast enough.
_FLOAT64_LIMIT = 1 << 27


@functools.lru_cache(maxsize=None)
def _fp8_table(dtype: DType) -> np.ndarray:
    """float64 value of each of the 256 codes of an 8-bit float type."""
    codes = np.arange(256)
    if dtype == DType.FLOAT8_E8M0FNU:
        table = np.ldexp(1.0, codes - 127)
        table[255] = np.nan
        return table
    if dtype == DType.FLOAT8_E4M3FN:
        mant_bits, bias = 3, 7
    else:  # FLOAT8_E5M2
        mant_bits, bias = 2, 15
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes & 0x7F) >> mant_bits
    mant = codes & ((1 << mant_bits) - 1)
    scale = float(1 << mant_bits)
    value = np.where(exp == 0, np.ldexp(mant / scale, 1 - bias),
                     np.ldexp(1.0 + mant / scale, exp - bias))
    value = sign * value
    top = (1 << (7 - mant_bits)) - 1
    if dtype == DType.FLOAT8_E4M3FN:  # no infinities; only S.1111.111 is NaN
        value[(exp == top) & (mant == 7)] = np.nan
    else:
        value[(exp == top) & (mant == 0)] = sign[(exp == top) & (mant == 0)] * np.inf
        value[(exp == top) & (mant != 0)] = np.nan
    return value


_FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def unpack_fp4(raw: np.ndarray, axis: int) -> np.ndarray:
    """Values of packed E2M1 bytes, doubling ``axis``: the low nibble comes first."""
    low = _FP4_VALUES[raw & 0x0F]
    high = _FP4_VALUES[raw >> 4]
    out = np.stack([low, high], axis=axis + 1)
    shape = list(raw.shape)
    shape[axis] *= 2
    return out.reshape(shape)


def decode(raw: np.ndarray, dtype: DType) -> np.ndarray:
    """float64 values of raw elements as ``host_view`` returns them (FP4 excluded)."""
    if dtype == DType.BFLOAT16:
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype in (DType.FLOAT8_E4M3FN, DType.FLOAT8_E5M2, DType.FLOAT8_E8M0FNU):
        return _fp8_table(dtype)[raw]
    return raw.astype(np.float64)


def round_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """uint16 bits of float64 ``values`` rounded once to bfloat16, to nearest even.

    Done on the float64 bits rather than with ml_dtypes, whose float64 -> bfloat16 cast goes
    through float32 and so rounds twice (1 + 2**-8 + 2**-30 would become 1.0, not 1 + 2**-7).
    Exact in bfloat16's normal range; float32-subnormal results may round twice.
    """
    v = np.ascontiguousarray(values, dtype=np.float64)
    bits = v.view(np.uint64)
    keep_lsb = (bits >> 45) & 1  # 52 - 7 mantissa bits are dropped
    rounded = ((bits + ((1 << 44) - 1) + keep_lsb) >> 45) << 45
    with np.errstate(over="ignore"):  # past bfloat16's range is inf, as it should be
        as_f32 = rounded.view(np.float64).astype(np.float32)  # exact: 8 significant bits remain
    out = (as_f32.view(np.uint32) >> 16).astype(np.uint16)
    return np.where(np.isnan(v), np.uint16(0x7FC0), out)


def encode(values: np.ndarray, dtype: DType) -> np.ndarray:
    """Round float64 ``values`` once to ``dtype``, as the raw elements ``host_view`` holds."""
    if dtype == DType.BFLOAT16:
        return round_to_bfloat16_bits(values)
    return np.asarray(values).astype(RAW_NUMPY[dtype])


class ReferenceBackend(Backend):
    """Computes on the host, synchronously; what CPU arrays run on."""

    name = "reference"

    def check_support(self, spec: StaticSpec) -> None:
        if not spec.is_cpu:
            raise RuntimeError(f"the reference backend runs on the CPU, not on {spec.arch}")
        # A tiling no GPU kernel runs is an error here too: code tested on the CPU must not
        # fail on a GPU for its arguments.
        problems = [problem(spec.mma_tiler_mn, spec.cluster_shape_mn)
                    for problem in (sm90_problem, sm100_problem)]
        if all(problems):
            argument, detail = problems[0]
            raise ArgumentError(argument, f"{detail} (and on SM100: {problems[1][1]})")

    def compile(self, spec: StaticSpec) -> Any:
        return spec

    def launch(self, compiled: Any, spec: StaticSpec, args: LaunchArgs) -> None:
        offsets = host_view(args.offsets).astype(np.int64)
        # The GPU kernels stay in bounds whatever the offsets hold; on the host a bad offset
        # would read or write outside the arrays, so the reference always checks them.
        check_offsets_values(offsets, args.tokens_sum, spec)
        if spec.is_block_scaled:
            _check_scales(spec, args)
        outputs = _output_views(spec, args)
        scale = 1.0
        if spec.has_global_scale:
            scale = float(host_view(args.global_scale_a).reshape(-1)[0]) * \
                float(host_view(args.global_scale_b).reshape(-1)[0])

        for e in range(spec.num_experts):
            begin = int(offsets[e - 1]) if e else 0
            end = int(offsets[e])
            out = outputs[e]
            if end == begin:
                if not spec.accumulate:
                    out[...] = encode(np.zeros(out.shape), spec.wgrad_dtype)
                continue
            a = _operand_block(spec, args.a, "a", begin, end)
            b = _operand_block(spec, args.b, "b", begin, end)
            if spec.is_block_scaled:
                a = a * _scale_block(spec, args.sfa, "a", begin, end)
                b = b * _scale_block(spec, args.sfb, "b", begin, end)
            if spec.hidden * spec.intermediate * (end - begin) > _FLOAT64_LIMIT:
                product = (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float64)
            else:
                product = a @ b
            if scale != 1.0:
                product = product * scale
            if spec.accumulate:
                product = decode(out, spec.wgrad_dtype).astype(np.float32).astype(np.float64) + product
            out[...] = encode(product, spec.wgrad_dtype)


def _output_views(spec: StaticSpec, args: LaunchArgs) -> list:
    h, n = spec.hidden, spec.intermediate
    raw = RAW_NUMPY[spec.wgrad_dtype]
    if spec.output_mode == "dense":
        stacked = host_view(args.wgrad)
        return [stacked[e] for e in range(spec.num_experts)]
    ptrs = host_view(args.wgrad_ptrs).astype(np.int64)
    check_ptr_values(ptrs)
    return [strided_view(int(p), (h, n), (n, 1), raw) for p in ptrs]


def _operand_block(spec: StaticSpec, desc: TensorDesc, which: str, begin: int, end: int) -> np.ndarray:
    """Expert [begin, end)'s block of A (hidden, count) or B (count, intermediate), float64."""
    pack = 2 if desc.dtype == DType.FLOAT4_E2M1FN_X2 else 1
    raw_dtype = RAW_NUMPY[desc.dtype]
    major = spec.a_major if which == "a" else spec.b_major
    width = spec.hidden if which == "a" else spec.intermediate
    count = (end - begin) // pack
    first = begin // pack
    if spec.input_order == "tensor_ragged":
        if major == "k":
            offset = first * width * raw_dtype.itemsize
            shape = (width, count) if which == "a" else (count, width)
            strides = (count, 1) if which == "a" else (1, count)
            raw = strided_view(desc.ptr + offset, shape, strides, raw_dtype)
        else:
            tokens = desc.shape[1] if which == "a" else desc.shape[0]
            shape = (width, tokens) if which == "a" else (tokens, width)
            strides = (1, width) if which == "a" else (width, 1)
            whole = strided_view(desc.ptr, shape, strides, raw_dtype)
            raw = whole[:, first:first + count] if which == "a" else whole[first:first + count]
    else:
        whole = host_view(desc)
        raw = whole[:, first:first + count] if which == "a" else whole[first:first + count]
    if pack == 2:
        return unpack_fp4(raw, axis=1 if which == "a" else 0)
    return decode(raw, desc.dtype)


def _check_scales(spec: StaticSpec, args: LaunchArgs) -> None:
    blocks = -(-args.tokens_sum // spec.sf_vec_size)
    for desc, name, shape in ((args.sfa, "sfa_tensor", (spec.hidden, blocks)),
                              (args.sfb, "sfb_tensor", (blocks, spec.intermediate))):
        if desc is None or desc.shape != shape:
            got = "None" if desc is None else f"shape {desc.shape}"
            raise ArgumentError(name, f"expected shape {shape} (the reference backend's logical "
                                      f"scale layout, sf_vec_size = {spec.sf_vec_size}), got {got}")


def _scale_block(spec: StaticSpec, desc: Optional[TensorDesc], which: str, begin: int,
                 end: int) -> np.ndarray:
    scales = decode(host_view(desc), desc.dtype)
    k = np.arange(begin, end) // spec.sf_vec_size
    return scales[:, k] if which == "a" else scales[k, :]
