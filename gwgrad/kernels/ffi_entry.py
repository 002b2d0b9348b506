"""The JAX adapter's entry into a GEMM kernel: the XLA FFI form ``(stream, *buffers)`` that
``compiler.compile_ffi`` compiles into a module kept in gwgrad.kernel_cache, so that a later
process makes the custom call without the CuTe DSL.

Such a module must not hold anything of the process that compiled it. The raw-address entry
takes the status record's address at every launch; here the buffers are all XLA gives, so the
call takes a *status block* (int32 (STATUS_WORDS,), an input aliased to an output): XLA fills
it from a constant of the lowered computation, words [0..7] zero and [8], [9] the low and high
halves of the address of the lowering process's status record (gwgrad/status.py; 0: none). The
prep kernel records a problem in the block's first eight words (a status record in device
memory, zero before the call), then ``forward_status`` (one thread, after the GEMM) copies a
recorded problem into the process's record with the prep kernel's protocol: a GPU-scope
compare-and-swap of word [0] from 0 elects one writer, which writes [1..4], [6..7], then after
a system-scope fence [5] (non-zero: complete) and fences again.

Buffers (``bf16``): a, b, offsets, the status block, the output (the dense weight gradients;
when accumulating, the input aliased to it) and the uint8 workspace; ``scaled`` adds sfa, sfb,
gsa, gsb (global scales always present: ones when the caller has none) after the offsets.
Constants: tokens_sum, grid_size and, block-scaled, sf_capacity. Verified by
tests/test_adapter_jax_gpu.py (results, invalid offsets reported) on an H200.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from .entry import _aligned

#: int32 words of the status block: the record [0..7], the host record's address [8..9].
STATUS_WORDS = 16
_RECORD_WORDS = 8
_CODE, _MULTIPLE = 0, 5
_ADDRESS_LOW, _ADDRESS_HIGH = 8, 9


class GemmFfiEntry:
    """The FFI entries of one GEMM kernel object (a ``make_kernel`` result: ``launch(...)``
    and ``cfg``)."""

    def __init__(self, kernel):
        self.kernel = kernel

    @cute.jit
    def bf16(
        self,
        stream,
        a: cute.Tensor,
        b: cute.Tensor,
        offsets: cute.Tensor,
        block: cute.Tensor,
        c: cute.Tensor,
        workspace: cute.Tensor,
        *,
        tokens_sum: cutlass.Constexpr,
        grid_size: cutlass.Constexpr,
    ):
        ab = self.kernel.cfg.cutlass_ab_dtype
        self.kernel.launch(
            _aligned(a.iterator, ab, 16),
            _aligned(b.iterator, ab, 16),
            _aligned(offsets.iterator, Int32, 4),
            _aligned(c.iterator, c.element_type, 16),
            _aligned(workspace.iterator, cutlass.Uint8, 128),
            _aligned(block.iterator, Int32, 16),
            Int32(tokens_sum),
            Int32(grid_size),
            stream,
        )
        self.forward_status(block).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

    @cute.jit
    def scaled(
        self,
        stream,
        a: cute.Tensor,
        b: cute.Tensor,
        offsets: cute.Tensor,
        sfa: cute.Tensor,
        sfb: cute.Tensor,
        gsa: cute.Tensor,
        gsb: cute.Tensor,
        block: cute.Tensor,
        c: cute.Tensor,
        workspace: cute.Tensor,
        *,
        tokens_sum: cutlass.Constexpr,
        grid_size: cutlass.Constexpr,
        sf_capacity: cutlass.Constexpr,
    ):
        cfg = self.kernel.cfg
        self.kernel.launch(
            _aligned(a.iterator, cfg.cutlass_ab_dtype, 16),
            _aligned(b.iterator, cfg.cutlass_b_dtype, 16),
            _aligned(offsets.iterator, Int32, 4),
            _aligned(c.iterator, c.element_type, 16),
            _aligned(workspace.iterator, cutlass.Uint8, 128),
            _aligned(block.iterator, Int32, 16),
            Int32(tokens_sum),
            Int32(grid_size),
            stream,
            scales=(
                _aligned(sfa.iterator, sfa.element_type, 16),
                _aligned(sfb.iterator, sfb.element_type, 16),
                _aligned(gsa.iterator, cutlass.Float32, 4),
                _aligned(gsb.iterator, cutlass.Float32, 4),
                Int32(sf_capacity),
            ),
        )
        self.forward_status(block).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

    @cute.kernel
    def forward_status(self, block: cute.Tensor):
        """Thread 0: a problem the prep kernel recorded in ``block`` goes to the status record
        at the address in words [8], [9] (module doc)."""
        if cute.arch.thread_idx()[0] == 0:
            code = block[_CODE]
            low = Int64(block[_ADDRESS_LOW]) & Int64(0xFFFFFFFF)
            address = (Int64(block[_ADDRESS_HIGH]) << 32) | low
            if code != 0 and address != 0:
                record = cute.make_tensor(
                    cute.make_ptr(Int32, address, cute.AddressSpace.gmem, assumed_align=16),
                    cute.make_layout(_RECORD_WORDS))
                old = cute.arch.atomic_cas(record.iterator + _CODE, cmp=Int32(0), val=code,
                                           scope="gpu")
                if old == 0:
                    for i in cutlass.range_constexpr(1, _MULTIPLE):
                        record[i] = block[i]
                    record[6] = Int32(0)
                    record[7] = Int32(0)
                    cute.arch.fence_acq_rel_sys()
                    record[_MULTIPLE] = block[_MULTIPLE]
                    cute.arch.fence_acq_rel_sys()
