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

from .errors import ArgumentError
from .spec import StaticSpec
from .tensors import TensorDesc


def token_count_multiple(spec: StaticSpec) -> int:
    """Each expert's token count (offsets[e] - offsets[e-1]) must be a multiple of this.

    The contract's 256 stays for block-scaled inputs (scale-factor blocks and the legacy
    kernel's tiles). BF16 kernels take any count when both operands are M/N-major (the token
    axis is the strided one). A K-major operand has the token axis contiguous: TMA needs each
    expert's rows to start and end on 16-byte boundaries there (and a ``tensor_ragged`` block
    has a row stride of ``count`` elements), so counts must be multiples of 8.
    """
    if spec.is_block_scaled:
        return 256
    if "k" in (spec.a_major, spec.b_major):
        return 16 // spec.a_dtype.itemsize
    return 1


def tokens_sum_multiple(spec: StaticSpec) -> int:
    """tokens_sum must be a multiple of this (a shape rule, checked on every call): the counts'
    rule summed up, e.g. a K-major ``tensor2d`` operand's row stride of ``tokens_sum``
    elements is then 16-byte aligned as TMA needs."""
    return token_count_multiple(spec)


#: Verdict codes of an offsets check, shared with the kernels' prep kernel, which records the
#: first problem it finds in gwgrad's status record (gwgrad/status.py) in the same order as
#: ``find_problem``: a negative count first, then the last offset, then a count's multiple.
NEGATIVE_COUNT, LAST_NOT_TOKENS_SUM, COUNT_NOT_MULTIPLE = 1, 2, 3


def find_problem(offsets: np.ndarray, tokens_sum: int,
                 multiple: int) -> Optional[Tuple[int, int, int, int]]:
    """``(code, expert, offsets[expert], previous offset)`` of the first problem, or None."""
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
    return None


def problem_detail(code: int, expert: int, value: int, prev: int, tokens_sum: int,
                   multiple: int, name: str = "offsets_tensor") -> str:
    """The message (after ``name: ``) for a problem found by ``find_problem`` or a kernel."""
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
    return f"invalid offsets (problem code {code} for expert {e})"


def _multiple_reason(multiple: int) -> str:
    if multiple >= 128:
        return "block-scaled inputs"
    return "a K-major a_tensor/b_tensor: 16-byte aligned TMA rows"


def check_offsets_values(offsets: np.ndarray, tokens_sum: int, spec: StaticSpec,
                         name: str = "offsets_tensor") -> None:
    """Raise ArgumentError naming ``name`` unless the offsets describe ``tokens_sum`` tokens."""
    multiple = token_count_multiple(spec)
    problem = find_problem(offsets, tokens_sum, multiple)
    if problem is not None:
        raise ArgumentError(name, problem_detail(*problem, tokens_sum, multiple, name))


def check_ptr_values(ptrs: np.ndarray, name: str = "wgrad_ptrs") -> None:
    """One non-null, 16-byte aligned output address per expert."""
    values = np.asarray(ptrs, dtype=np.int64).reshape(-1)
    bad = np.flatnonzero((values == 0) | (values % 16 != 0))
    if bad.size:
        e = int(bad[0])
        raise ArgumentError(name, f"expected a non-null, 16-byte aligned address per expert, got "
                                  f"{name}[{e}] = {int(values[e]):#x}")


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
                 wgrad_ptrs: Optional[TensorDesc] = None, stream: int = 0) -> bool:
    """Check offsets (and wgrad_ptrs) values; False when skipped during stream capture.

    Device-resident values are copied on ``stream`` (so after whatever produced them) and
    read after one synchronization.
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
    check_offsets_values(offsets_host, tokens_sum, spec)
    if ptrs_host is not None:
        check_ptr_values(ptrs_host)
    return True
