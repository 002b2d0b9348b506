"""The host entry points of every GEMM kernel: the ``@cute.jit`` functions gwgrad compiles.

``GemmEntryPoints`` (BF16) and ``ScaledEntryPoints`` (block-scaled: the scale tensors too) turn
the entry's arguments into one call of the kernel's ``launch(...)``: raw device addresses
(``__call__``, the core's path) or tensors with static shapes (``call_tensors``, the form of
``cutlass.jax.cutlass_call``). The argument order is gwgrad's entry signature
(gwgrad/backends/_cutedsl.py ENTRY_SIGNATURE, SCALED_ENTRY_SIGNATURE).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from .prep import PrepWork

def _aligned(ptr: cute.Pointer, dtype, align: int) -> cute.Pointer:
    """`ptr` re-typed with the alignment the kernels assume (checked on the host)."""
    return cute.make_ptr(dtype, ptr.toint(), cute.AddressSpace.gmem, assumed_align=align)


class GemmEntryPoints:
    """The `@cute.jit` functions gwgrad compiles; kernels implement `launch(...)`.

    `__call__` takes raw device addresses (the core's path: one compile per static spec, any
    tokens_sum). `call_tensors` has the `(stream, *inputs, *outputs)` form of
    `cutlass.jax.cutlass_call`, where shapes are static: A and B as the caller holds them
    (their data pointers are all that is used), offsets, then the output (or, in discrete mode,
    the int64 pointer array) and the uint8 workspace; the status record's address is baked in
    (`status_address`, an int).

    `status_ptr`: gwgrad's status record (8 x int32, 16-byte aligned; host-mapped pinned
    memory, to the kernels plain global memory), where the prep kernel records invalid offsets
    (kernels/config.py has its layout).
    """

    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer,
        b_ptr: cute.Pointer,
        offsets_ptr: cute.Pointer,
        c_ptr: cute.Pointer,
        workspace_ptr: cute.Pointer,
        status_ptr: cute.Pointer,
        tokens_sum: Int32,
        grid_size: Int32,
        stream: cuda.CUstream,
    ):
        self.launch(
            a_ptr, b_ptr, offsets_ptr, c_ptr, workspace_ptr, status_ptr, tokens_sum, grid_size,
            stream,
        )

    @cute.jit
    def call_tensors(
        self,
        stream: cuda.CUstream,
        a: cute.Tensor,
        b: cute.Tensor,
        offsets: cute.Tensor,
        c: cute.Tensor,
        workspace: cute.Tensor,
        *,
        tokens_sum: cutlass.Constexpr,
        grid_size: cutlass.Constexpr,
        status_address: cutlass.Constexpr,
    ):
        ab = self.cfg.cutlass_ab_dtype
        self.launch(
            _aligned(a.iterator, ab, 16),
            _aligned(b.iterator, ab, 16),
            _aligned(offsets.iterator, Int32, 4),
            _aligned(c.iterator, c.element_type, 16),
            _aligned(workspace.iterator, cutlass.Uint8, 128),
            cute.make_ptr(Int32, status_address, cute.AddressSpace.gmem, assumed_align=16),
            Int32(tokens_sum),
            Int32(grid_size),
            stream,
        )


class ScaledEntryPoints:
    """The entry of block-scaled kernels: BF16's arguments plus the scale tensors' addresses
    (`sfa`, `sfb`; per-expert FP32 `global_scale_a/b`, 0 when absent) and `sf_capacity` (the
    scale tensors' columns or rows: gwgrad/scales.py), before the grid size. Kernels
    implement `launch(..., scales=(sfa, sfb, gsa, gsb, sf_capacity))`."""

    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer,
        b_ptr: cute.Pointer,
        offsets_ptr: cute.Pointer,
        c_ptr: cute.Pointer,
        workspace_ptr: cute.Pointer,
        status_ptr: cute.Pointer,
        tokens_sum: Int32,
        sfa_ptr: cute.Pointer,
        sfb_ptr: cute.Pointer,
        gsa_ptr: cute.Pointer,
        gsb_ptr: cute.Pointer,
        sf_capacity: Int32,
        grid_size: Int32,
        stream: cuda.CUstream,
    ):
        self.launch(
            a_ptr, b_ptr, offsets_ptr, c_ptr, workspace_ptr, status_ptr, tokens_sum, grid_size,
            stream, scales=(sfa_ptr, sfb_ptr, gsa_ptr, gsb_ptr, sf_capacity),
        )

    @cute.jit
    def call_tensors(
        self,
        stream: cuda.CUstream,
        a: cute.Tensor,
        b: cute.Tensor,
        offsets: cute.Tensor,
        sfa: cute.Tensor,
        sfb: cute.Tensor,
        gsa: cute.Tensor,
        gsb: cute.Tensor,
        c: cute.Tensor,
        workspace: cute.Tensor,
        *,
        tokens_sum: cutlass.Constexpr,
        grid_size: cutlass.Constexpr,
        status_address: cutlass.Constexpr,
        sf_capacity: cutlass.Constexpr,
    ):
        """`GemmEntryPoints.call_tensors` with the scale tensors after the offsets (global
        scales always present: ones when the caller has none) and `sf_capacity` baked in."""
        cfg = self.cfg
        self.launch(
            _aligned(a.iterator, cfg.cutlass_ab_dtype, 16),
            _aligned(b.iterator, cfg.cutlass_b_dtype, 16),
            _aligned(offsets.iterator, Int32, 4),
            _aligned(c.iterator, c.element_type, 16),
            _aligned(workspace.iterator, cutlass.Uint8, 128),
            cute.make_ptr(Int32, status_address, cute.AddressSpace.gmem, assumed_align=16),
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


class GroupedWgradKernel(PrepWork, GemmEntryPoints):
    """The base of every GEMM kernel class: the entry points, the prep work (kernels/prep.py,
    whose hooks a kernel implements) and the output's store op.

    Subclasses set `cfg`, `c_dtype` and `epi_tile` and implement `launch(...)` and
    `expert_load_atoms(a_e, b_e, tiled_mma, a_smem_layout, b_smem_layout) -> (atom_a,
    atom_b)`: the TMA load atoms of one expert's operand views (their descriptors are what
    the prep work stores).
    """

    def expert_output_tensor(self, c_e: cute.Tensor) -> cute.Tensor:
        """An expert's (hidden, intermediate) output in the form the arch's store atom takes."""
        return c_e

    def c_store_op(self):
        if self.cfg.accumulate:
            return cpasync.CopyReduceBulkTensorTileS2GOp()
        return cpasync.CopyBulkTensorTileS2GOp()
