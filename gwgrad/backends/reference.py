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

Block-scaled inputs (every recipe and format of gwgrad/scales.py, in the layouts the GPU
kernels read; decoding tables in gwgrad/formats.py): packed FP4 holds two values per byte along
K, low nibble first; A and B may be different FP8 types with FP32 scales. Each operand is
dequantized with the scales of the expert's own tokens:

* ``blocked``: token ``begin + t`` of expert e takes scale column ``t // sf_vec_size`` of the
  expert's blocked chunk (``scales.read_blocked``: the chunk starts at byte ``Mpad * S_e``,
  ``S_e`` the prefix sum of ``round_up(ceil(count_i / sf_vec_size), 4)``);
* ``per_expert_channel``: ``sfa[e, m]`` and ``sfb[e, n]``;
* ``block_1x128``: row ``S_e + t // 128`` of ``sfa`` / ``sfb``, ``S_e`` the prefix sum of
  ``ceil(count_i / 128)``.

Then ``W[e] = alpha_e * deq(A_e) @ deq(B_e)`` with ``alpha_e = global_scale_a[e] *
global_scale_b[e]`` (1 without global scales), in float64 and rounded once to the output
dtype like BF16 inputs. The offsets are checked with the scale tensors' capacity: experts
whose scales do not fit raise ``ArgumentError`` naming ``sfa_tensor`` (the device check's
``SCALES_TOO_SMALL``). A NaN scale (E8M0 0xFF, E4M3 0x7F) makes its block NaN.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import scales
from ..dtypes import DType
from ..errors import ArgumentError
from ..formats import FP4_VALUES as _FP4_VALUES, fp8_table as _fp8_table, unpack_fp4  # noqa: F401
from ..kernels.tiling import (any_gpu_epi_buffer_sets_problem, any_gpu_tiling_problem,
                              unit_schedule_problem)
from ..hostview import RAW_NUMPY, host_view, strided_view
from ..offsets import check_offsets_values, check_ptr_values
from ..spec import StaticSpec
from ..tensors import TensorDesc
from ..validation import scale_capacity
from .base import Backend, LaunchArgs

# Past this many multiply-adds per expert, float32 matmul keeps CPU tests fast enough.
_FLOAT64_LIMIT = 1 << 27


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
        problem = (any_gpu_tiling_problem(spec.mma_tiler_mn, spec.cluster_shape_mn,
                                          spec.is_block_scaled)
                   or any_gpu_epi_buffer_sets_problem(spec.epi_buffer_sets, spec.mma_tiler_mn,
                                                      spec.is_block_scaled)
                   or unit_schedule_problem(spec.unit_schedule, spec.is_block_scaled, "cpu"))
        if problem is not None:
            raise ArgumentError(*problem)

    def compile(self, spec: StaticSpec) -> Any:
        return spec

    def launch(self, compiled: Any, spec: StaticSpec, args: LaunchArgs) -> None:
        offsets = host_view(args.offsets).astype(np.int64)
        # The GPU kernels stay in bounds whatever the offsets hold; on the host a bad offset
        # would read or write outside the arrays, so the reference always checks them.
        capacity = None
        if spec.is_block_scaled:
            _check_scales(spec, args)
            if scales.column_rule(spec.scale_recipe, spec.sf_vec_size) is not None:
                capacity = scale_capacity(spec, args.sfa)
        check_offsets_values(offsets, args.tokens_sum, spec, capacity=capacity)
        outputs = _output_views(spec, args)
        counts = np.diff(offsets, prepend=0)
        scale_a = scale_b = None
        if spec.is_block_scaled:
            scale_a = _ScaleReader(spec, args.sfa, "a", counts)
            scale_b = _ScaleReader(spec, args.sfb, "b", counts)
        alpha = np.ones(spec.num_experts)
        if spec.has_global_scale:
            alpha = (host_view(args.global_scale_a).reshape(-1).astype(np.float64) *
                     host_view(args.global_scale_b).reshape(-1).astype(np.float64))

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
                a = a * scale_a.expert(e)
                b = b * scale_b.expert(e)
            if spec.hidden * spec.intermediate * (end - begin) > _FLOAT64_LIMIT:
                product = (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float64)
            else:
                product = a @ b
            if alpha[e] != 1.0:
                product = product * alpha[e]
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
    for desc, name in ((args.sfa, "sfa_tensor"), (args.sfb, "sfb_tensor")):
        if desc is None:
            raise ArgumentError(name, "expected a scale tensor for block-scaled inputs, got None")
    if spec.has_global_scale:
        for desc, name in ((args.global_scale_a, "global_scale_a"),
                           (args.global_scale_b, "global_scale_b")):
            if desc is None or desc.numel != spec.num_experts:
                got = "None" if desc is None else f"shape {desc.shape}"
                raise ArgumentError(name, f"expected a float32 ({spec.num_experts},) tensor, "
                                          f"got {got}")


class _ScaleReader:
    """One operand's float64 scales per expert, broadcast to its block: (hidden, count) for A,
    (count, intermediate) for B."""

    def __init__(self, spec: StaticSpec, desc: TensorDesc, which: str, counts: np.ndarray):
        self.which = which
        self.counts = [int(c) for c in counts]
        self.width = spec.hidden if which == "a" else spec.intermediate
        self.recipe = spec.scale_recipe or scales.BLOCKED
        raw = host_view(desc)
        if self.recipe == scales.BLOCKED:
            self.vec = spec.sf_vec_size
            codes = scales.read_blocked(raw, self.counts, self.vec, self.width)
            self.per_expert = [decode(c, desc.dtype) for c in codes]  # (width, blocks)
        elif self.recipe == scales.PER_EXPERT_CHANNEL:
            values = decode(np.ascontiguousarray(raw), desc.dtype)
            self.per_expert = list(values.reshape(spec.num_experts, self.width)[:, :, None])
            self.vec = None
        else:  # block_1x128: rows S_e .. S_e + ceil(count_e / 128) - 1
            values = decode(np.ascontiguousarray(raw), desc.dtype)
            starts = scales.column_starts(self.counts, (scales.BLOCK_TOKENS, 1))
            self.per_expert = [values[starts[e]:starts[e + 1]].T
                               for e in range(len(self.counts))]
            self.vec = scales.BLOCK_TOKENS

    def expert(self, e: int) -> np.ndarray:
        s = self.per_expert[e]
        if self.vec is not None:
            s = np.repeat(s, self.vec, axis=1)[:, :self.counts[e]]
        return s if self.which == "a" else s.T
