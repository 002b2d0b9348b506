"""Rules on offsets values (and discrete output addresses).

``token_count_multiple`` is the one place that says which per-expert token counts a spec
accepts (the kernels get it from here). Every CUDA launch checks the offsets on the device
(the prep kernel; a failed check makes the GEMM write nothing and is reported through
gwgrad/status.py); ``validate_offsets=True`` also checks them here on the host before
launching: one small copy on the call's stream and a synchronization (skipped during CUDA-graph
capture). Both report the same problem with the same message (``problem_detail``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from . import scales
from .dtypes import DType
from .errors import ArgumentError
from .spec import StaticSpec
from .tensors import TensorDesc


def token_count_multiple(spec: StaticSpec) -> int:
    """Each expert's token count (offsets[e] - offsets[e-1]) must be a multiple of this.

    Block-scaled inputs: with ``blocked`` scales 32 for FP8 (MXFP8: whole 32-token scale
    blocks, 16-byte TMA rows; an expert's scales start at a prefix sum of its predecessors',
    gwgrad/scales.py) and 64 for packed FP4 (NVFP4, MXFP4: one K=64 step of the block-scaled
    MMA, so that no MMA step of an expert reads a padding scale column, whatever bytes the
    padding holds; cuDNN's kernel is only right for multiples of 4 * sf_vec_size, 64 / 128);
    16 with the FP32 recipes (``per_expert_channel``, ``block_1x128``: FP8 operands, 16-byte
    TMA rows). BF16 kernels take
    any count when both operands are M/N-major (the token axis is the strided one). A K-major
    operand has the token axis contiguous: TMA needs each expert's rows to start and end on
    16-byte boundaries there (and a ``tensor_ragged`` block has a row stride of ``count``
    elements), so counts must be multiples of 8.
    """
    if spec.is_block_scaled:
        if spec.scale_recipe in (scales.PER_EXPERT_CHANNEL, scales.BLOCK_1X128):
            return 16
        return blocked_count_multiple(spec.a_dtype)
    if "k" in (spec.a_major, spec.b_major):
        return 16 // spec.a_dtype.itemsize
    return 1


def blocked_count_multiple(elem: DType) -> int:
    """Token-count multiple of ``blocked`` scales with operands of dtype ``elem`` (the rule
    above; the GPU quantizers of those formats share it)."""
    return 64 if elem == DType.FLOAT4_E2M1FN_X2 else 32


def tokens_sum_multiple(spec: StaticSpec) -> int:
    """tokens_sum must be a multiple of this (a shape rule, checked on every call): the counts'
    rule summed up, e.g. a K-major ``tensor2d`` operand's row stride of ``tokens_sum``
    elements is then 16-byte aligned as TMA needs."""
    return token_count_multiple(spec)


#: Verdict codes of an offsets check, shared with the kernels' prep kernel, which records the
#: first problem it finds in gwgrad's status record (gwgrad/status.py) in the same order as
#: ``find_problem``: a negative count first, then the last offset, then a count's multiple,
#: then (recipes whose experts' scales start at a prefix sum, gwgrad/scales.py) the first expert
#: whose scales end past the scale tensors' capacity.
NEGATIVE_COUNT, LAST_NOT_TOKENS_SUM, COUNT_NOT_MULTIPLE = 1, 2, 3
#: The experts' scale columns (gwgrad/scales.py) do not fit the scale tensors (names sfa_tensor).
SCALES_TOO_SMALL = 4
#: Discrete output: an expert's address in ``wgrad_ptrs`` is null or not 16-byte aligned (names
#: wgrad_ptrs; checked after the offsets, like the host's check_values).
OUTPUT_PTR_INVALID = 5


def problem_argument(code: int, name: str = "offsets_tensor") -> str:
    """The argument a problem is reported under: ``sfa_tensor`` for ``SCALES_TOO_SMALL``
    (the scale tensors are too small for these offsets), ``wgrad_ptrs`` for
    ``OUTPUT_PTR_INVALID``, else ``name``."""
    if code == SCALES_TOO_SMALL:
        return "sfa_tensor"
    return "wgrad_ptrs" if code == OUTPUT_PTR_INVALID else name


def ptr_detail(expert: int, address: int, name: str = "wgrad_ptrs") -> str:
    """The message of an invalid per-expert output address (host and device checks)."""
    return (f"expected a non-null, 16-byte aligned address per expert, got "
            f"{name}[{expert}] = {address:#x}")


def find_problem(offsets: np.ndarray, tokens_sum: int, multiple: int,
                 rule: Optional[Tuple[int, int]] = None,
                 capacity: int = 0) -> Optional[Tuple[int, int, int, int]]:
    """``(code, expert, offsets[expert], previous offset)`` of the first problem, or None.

    ``rule``: ``scales.column_rule(recipe, sf_vec_size)`` of a recipe with a scale capacity
    (``capacity``: columns of ``blocked``, rows of ``block_1x128`` scales); then the first
    expert e with ``sum_{i<=e} C_i > capacity`` gives ``(SCALES_TOO_SMALL, e, sum_{i<=e} C_i,
    capacity)``, after the other checks.
    """
    values = np.asarray(offsets, dtype=np.int64).reshape(-1)
    prev = np.concatenate([[0], values[:-1]])
    counts = values - prev
    bad = np.flatnonzero(counts < 0)
    if bad.size:
        e = int(bad[0])
        return NEGATIVE_COUNT, e, int(values[e]), int(prev[e])
    if values[-1] != tokens_sum:
        e = values.size - 1
        return LAST_NOT_TOKENS_SUM, e, int(values[e]), int(prev[e])
    if multiple > 1:
        bad = np.flatnonzero(counts % multiple)
        if bad.size:
            e = int(bad[0])
            return COUNT_NOT_MULTIPLE, e, int(values[e]), int(prev[e])
    if rule is not None:
        tokens, pad = rule
        columns = -(-counts // tokens)
        columns = -(-columns // pad) * pad
        cumulative = np.cumsum(columns)
        bad = np.flatnonzero(cumulative > capacity)
        if bad.size:
            e = int(bad[0])
            return SCALES_TOO_SMALL, e, int(cumulative[e]), int(capacity)
    return None


def problem_detail(code: int, expert: int, value: int, prev: int, tokens_sum: int,
                   multiple: int, name: str = "offsets_tensor",
                   rule: Optional[Tuple[int, int]] = None) -> str:
    """The message (after ``problem_argument(code, name): ``) for a problem found by
    ``find_problem`` or a kernel. For ``SCALES_TOO_SMALL`` ``value`` / ``prev`` are the
    columns needed / the capacity; ``rule``: the recipe's column rule when known (a device
    record has only the count multiple, which tells the recipe: 32 blocked, 16 block_1x128)."""
    e = expert
    if code == NEGATIVE_COUNT:
        if e == 0:
            return f"expected offsets >= 0, got {name}[0] = {value}"
        return (f"expected non-decreasing offsets, got {name}[{e}] = {value} after "
                f"{name}[{e - 1}] = {prev}")
    if code == LAST_NOT_TOKENS_SUM:
        return (f"expected the last offset to equal tokens_sum = {tokens_sum}, got "
                f"{name}[{e}] = {value}")
    if code == COUNT_NOT_MULTIPLE:
        return (f"expected every expert's token count to be a multiple of {multiple} "
                f"({_multiple_reason(multiple)}), got {value - prev} tokens for expert {e}")
    if code == SCALES_TOO_SMALL:
        experts = "expert 0" if e == 0 else f"experts 0..{e}"
        if rule is not None:
            tokens, pad = rule
        else:
            tokens, pad = ("sf_vec_size", 4) if multiple != 16 else (scales.BLOCK_TOKENS, 1)
        if pad == 1:
            what, formula = "scale rows", f"sum of ceil(count/{tokens})"
        else:
            what, formula = "scale columns", f"sum of round_up(ceil(count/{tokens}), {pad})"
        return (f"expected at least {value} {what} for {experts} with these offsets "
                f"({formula}), got {prev}")
    if code == OUTPUT_PTR_INVALID:  # the address's low and high 32 bits
        return ptr_detail(e, (prev & 0xFFFFFFFF) << 32 | (value & 0xFFFFFFFF))
    return f"invalid offsets (problem code {code} for expert {e})"


def _multiple_reason(multiple: int) -> str:
    if multiple == 64:
        return ("packed FP4 inputs: one K=64 step of the block-scaled MMA, so that no step reads "
                "a padding scale column")
    if multiple >= 32:
        return "block-scaled inputs: whole scale blocks and 16-byte aligned TMA rows"
    if multiple == 16:
        return "FP8 inputs with FP32 scales: 16-byte aligned TMA rows"
    return "a K-major a_tensor/b_tensor: 16-byte aligned TMA rows"


def check_offsets_values(offsets: np.ndarray, tokens_sum: int, spec: StaticSpec,
                         name: str = "offsets_tensor", capacity: Optional[int] = None) -> None:
    """Raise ArgumentError naming ``name`` unless the offsets describe ``tokens_sum`` tokens;
    with the scale tensors' ``capacity`` (``validation.scale_capacity``) of a recipe that has
    one, also naming ``sfa_tensor`` when the experts' scales need more."""
    multiple = token_count_multiple(spec)
    rule = None
    if capacity is not None:
        rule = scales.column_rule(spec.scale_recipe, spec.sf_vec_size)
    problem = find_problem(offsets, tokens_sum, multiple, rule, capacity or 0)
    if problem is not None:
        raise ArgumentError(problem_argument(problem[0], name),
                            problem_detail(*problem, tokens_sum, multiple, name, rule=rule))


def check_ptr_values(ptrs: np.ndarray, name: str = "wgrad_ptrs") -> None:
    """One non-null, 16-byte aligned output address per expert."""
    values = np.asarray(ptrs, dtype=np.int64).reshape(-1)
    bad = np.flatnonzero((values == 0) | (values % 16 != 0))
    if bad.size:
        e = int(bad[0])
        raise ArgumentError(name, ptr_detail(e, int(values[e]) & (2**64 - 1), name))


def _read(desc: TensorDesc, np_dtype, stream: int) -> np.ndarray:
    from . import cuda
    from .hostview import strided_view

    if not desc.is_cuda:
        return strided_view(desc.ptr, desc.shape, desc.strides, np_dtype).copy()
    out = np.empty(desc.shape, dtype=np_dtype)
    if out.nbytes:
        with cuda.on_device(desc.device_id):
            cuda.memcpy_d2h(out.ctypes.data, desc.ptr, out.nbytes, stream)
    return out


def check_values(spec: StaticSpec, offsets: TensorDesc, tokens_sum: int,
                 wgrad_ptrs: Optional[TensorDesc] = None, stream: int = 0, *,
                 capacity: Optional[int] = None) -> bool:
    """Check offsets (and wgrad_ptrs) values; False when skipped during stream capture.

    Device-resident values are copied on ``stream`` (so after whatever produced them) and
    read after one synchronization. ``capacity``: the scale tensors' capacity
    (``validation.scale_capacity``), checked against the offsets too (None: not checked).
    """
    from . import cuda

    on_device = offsets.is_cuda or (wgrad_ptrs is not None and wgrad_ptrs.is_cuda)
    if on_device:
        device_id = offsets.device_id if offsets.is_cuda else wgrad_ptrs.device_id
        with cuda.on_device(device_id):
            if cuda.stream_is_capturing(stream):
                return False
    offsets_host = _read(offsets, np.int32, stream)
    ptrs_host = _read(wgrad_ptrs, np.int64, stream) if wgrad_ptrs is not None else None
    if on_device:
        with cuda.on_device(device_id):
            cuda.synchronize(stream)
    check_offsets_values(offsets_host, tokens_sum, spec, capacity=capacity)
    if ptrs_host is not None:
        check_ptr_values(ptrs_host)
    return True
