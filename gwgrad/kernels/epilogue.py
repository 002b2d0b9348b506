"""The epilogue's store of a unit's accumulator tile, one loop for every GEMM kernel.

A unit's tile is stored in sub-tiles (the kernel's ``epi_tile``): each sub-tile's FP32 values
go from where the accumulator lives into registers, are converted to the output dtype, copied
into the next of the staging buffers in shared memory (``SubtileStore``: stmatrix on SM90, the
DSL's register -> shared copy on SM100) and stored by one warp with a TMA store, or a TMA
reduce-add when accumulating (store_subtile), through the dense output's descriptor or an
expert's (discrete outputs). Two named-barrier rounds per sub-tile: the staging buffer is
complete before its store is issued, and the store warp's acquire of the next buffer (the
store group ``stages`` back has read its buffer) comes before anyone writes it.

What differs by architecture is passed in (``store_tile``'s ``accumulator``):

  load(sub) -> (values, position)   sub-tile ``sub``'s FP32 values (a TensorSSA in the register
                                    -> shared copy's layout) and its position in the tile:
                                    registers on SM90 (the WGMMA fragment), TMEM on SM100
                                    (tcgen05.ld; the block-scaled kernel's overlapping buffers
                                    read in another order and release the TMEM stage early)
  target(position) -> tensor        the global sub-tile a TMA store writes

and whether the sub-tile loop is unrolled at compile time (SM90: a register fragment is only
indexed by constants) or a loop (SM100: TMEM addresses may be computed).

Verified on an H200 through the SM90 kernels' GPU tests (every output dtype, dense and
discrete, accumulating; tests/test_sm90_kernel_gpu.py test_pingpong_ and
test_cooperative_epilogue_buffer_set_per_group for the buffer sets); PTX (no GPU):
tests/test_compile_sm90.py (the epilogue's barrier and drain counts), tests/test_compile_sm100*.py
(reduce-add exactly when accumulating; the overlapping buffers' early release).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .config import LoopInvariant


@cute.jit
def store_subtile(tma_atom_c, sC_buf, gC_sub, desc_c, store_pipeline):
    """The epilogue's store of one staged sub-tile, issued by one warp: shared memory
    `sC_buf` -> global `gC_sub` with a TMA store, or a TMA reduce-add when accumulating (the
    atom's op: GroupedWgradKernel.c_store_op), through the atom's dense descriptor (`desc_c`
    None) or through an expert's descriptor in the workspace (discrete mode:
    prep.tma_desc_ptr_for_copy); then the store group is committed and a staging buffer
    acquired for reuse."""
    if cutlass.const_expr(desc_c is None):
        cute.copy(tma_atom_c, sC_buf, gC_sub)
    else:
        cute.copy(tma_atom_c, sC_buf, gC_sub, tma_desc_ptr=desc_c)
    store_pipeline.producer_commit()
    store_pipeline.producer_acquire()


class SubtileStore(LoopInvariant):
    """The staging side of an epilogue, set up once per CTA role: the register -> shared copy
    (`tiled_copy_r2s`, its output-dtype registers `tRS_rC` and staging partition `tRS_sC`,
    (..., buffer)), the store atom `tma_atom_c`, `stages` staging buffers per set, the store
    groups (`store_pipeline`) and the barrier of the threads that stage a sub-tile
    (`epi_bar`)."""

    def __init__(self, c_dtype, tiled_copy_r2s, tRS_rC, tRS_sC, tma_atom_c, stages: int,
                 store_pipeline, epi_bar):
        self.c_dtype, self.tiled_copy_r2s, self.tRS_rC, self.tRS_sC = (
            c_dtype, tiled_copy_r2s, tRS_rC, tRS_sC)
        self.tma_atom_c, self.stages = tma_atom_c, stages
        self.store_pipeline, self.epi_bar = store_pipeline, epi_bar

    @cute.jit
    def store_tile(self, accumulator, bSG_sC, subtiles: cutlass.Constexpr,
                   unrolled: cutlass.Constexpr, first_buffer, buffer_base, desc_c, is_store_warp):
        """Store a unit's tile, `subtiles` sub-tiles from `accumulator` (module doc), through
        the staging buffers buffer_base + (first_buffer + i) % stages (first_buffer: the
        sub-tiles this role stored before, so consecutive stores never share a buffer) whose
        TMA partition is `bSG_sC` ((..., buffer)); `is_store_warp`: this thread's warp issues
        the TMA stores."""
        if cutlass.const_expr(unrolled):
            for sub in cutlass.range_constexpr(subtiles):
                self.store_one(accumulator, bSG_sC, sub, first_buffer, buffer_base, desc_c,
                               is_store_warp)
        else:
            for sub in cutlass.range(subtiles):
                self.store_one(accumulator, bSG_sC, sub, first_buffer, buffer_base, desc_c,
                               is_store_warp)

    @cute.jit
    def store_one(self, accumulator, bSG_sC, sub, first_buffer, buffer_base, desc_c,
                  is_store_warp):
        """Sub-tile `sub`: load, convert, stage, store."""
        values, position = accumulator.load(sub)
        self.tRS_rC.store(values.to(self.c_dtype))
        buf = buffer_base + (first_buffer + sub) % self.stages
        cute.copy(self.tiled_copy_r2s, self.tRS_rC, self.tRS_sC[(None, None, None, buf)])
        # Register -> shared writes (generic proxy) before the TMA store (async proxy).
        cute.arch.fence_proxy("async.shared", space="cta")
        self.epi_bar.arrive_and_wait()
        if is_store_warp:
            store_subtile(self.tma_atom_c, bSG_sC[(None, buf)],
                          accumulator.target(position), desc_c, self.store_pipeline)
        self.epi_bar.arrive_and_wait()
