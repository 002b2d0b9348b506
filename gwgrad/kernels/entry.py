"""The host entry points of every GEMM kernel: the ``@cute.jit`` functions gwgrad compiles.

``GemmEntryPoints`` (BF16) and ``ScaledEntryPoints`` (block-scaled: the scale tensors too) turn
the entry's raw device addresses into one call of the kernel's ``launch(...)``. The argument
order is gwgrad's entry signature (gwgrad/kernels/compiler.py). JAX's custom calls enter
through kernels/ffi_entry.py.
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
    tokens_sum).

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
