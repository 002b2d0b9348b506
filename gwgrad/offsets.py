"""Rules on offsets values (and discrete output addresses), checked on the host.

``token_count_multiple`` is the one place that says which per-expert token counts a spec
accepts. The values are read from host memory directly, or from device memory by one small
copy on the call's stream in eager mode; CUDA-graph capture and ``validate_offsets=False``
skip that copy (the kernels stay in bounds whatever the offsets hold).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

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


def check_offsets_values(offsets: np.ndarray, tokens_sum: int, spec: StaticSpec,
                         name: str = "offsets_tensor") -> None:
    """Raise ValueError naming ``name`` unless the offsets describe ``tokens_sum`` tokens."""
    values = np.asarray(offsets, dtype=np.int64).reshape(-1)
    counts = np.diff(values, prepend=0)
    bad = np.flatnonzero(counts < 0)
    if bad.size:
        e = int(bad[0])
        if e == 0:
            raise ValueError(f"{name}: expected offsets >= 0, got {name}[0] = {values[0]}")
        raise ValueError(f"{name}: expected non-decreasing offsets, got {name}[{e}] = {values[e]} "
                         f"after {name}[{e - 1}] = {values[e - 1]}")
    if values[-1] != tokens_sum:
        raise ValueError(f"{name}: expected the last offset to equal tokens_sum = {tokens_sum}, "
                         f"got {name}[{values.size - 1}] = {values[-1]}")
    multiple = token_count_multiple(spec)
    if multiple > 1:
        bad = np.flatnonzero(counts % multiple)
        if bad.size:
            e = int(bad[0])
            why = ("block-scaled inputs" if spec.is_block_scaled else
                   "a K-major a_tensor/b_tensor (16-byte aligned TMA rows)")
            raise ValueError(f"{name}: expected every expert's token count to be a multiple of "
                             f"{multiple} for {why}, got {counts[e]} tokens for expert {e}")


def check_ptr_values(ptrs: np.ndarray, name: str = "wgrad_ptrs") -> None:
    """One non-null, 16-byte aligned output address per expert."""
    values = np.asarray(ptrs, dtype=np.int64).reshape(-1)
    bad = np.flatnonzero((values == 0) | (values % 16 != 0))
    if bad.size:
        e = int(bad[0])
        raise ValueError(f"{name}: expected a non-null, 16-byte aligned address per expert, got "
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
