"""Blackwell (SM100 family) grouped weight-gradient GEMM: W[e] = A[:, tokens_e] @ B[tokens_e, :].

Decomposition: units of (expert, cluster m-tile, n-tile) in the longest-first order of
kernels/scheduler.py; the prep kernel (kernels/prep.py, shared with SM90) checks the offsets
and writes the per-expert token ranges and TMA descriptors before this kernel runs. The grid
has one cluster per unit; cluster launch control (scheduler.ClcUnits) makes it a dynamic
persistent schedule: a running cluster cancels the next not-yet-launched cluster and takes its
unit, so the hot experts' long units, handed out first, do not leave SMs idle at the end.

Warp roles (224 threads per CTA), after the CuTe DSL Blackwell examples
(dense_gemm_persistent_dynamic.py for CLC, moe/torch_grouped_mm.py for the 2Dx2D wgrad):
  warp 6     scheduler(): issues the CLC queries (first CTA of the cluster) and, in every CTA,
             is the only reader of the responses; decodes each unit once and publishes it to
             the other roles through a 2-stage unit ring (scheduler.publish_words /
             take_words, as on SM90), so the next query goes out while the epilogue is on the
             unit before last.
  warp 5     tma_loads(): the unit's A (tile_m x tile_k) and B (tile_n x tile_k) K-blocks
             through the expert's descriptors (zero-fill past its last token), multicast in
             the cluster.
  warp 4     mma(): tcgen05.mma into a double-buffered TMEM accumulator (2 x tile_n columns),
             so one unit's epilogue overlaps the next unit's mainloop; a 256-row tile is one
             2-CTA MMA (cta_group::2) issued by the pair's leader.
  warps 0-3  epilogue(): allocate TMEM (warp 0); per unit store_tile(): TmemAccumulator
             (tcgen05.ld) through the shared epilogue.SubtileStore (output dtype -> shared
             memory -> TMA store or reduce-add). Empty experts store zeros (nothing when
             accumulating); an MMA of the cluster whose rows lie past the output stores
             nothing.
Pipelines (make_pipelines): ab (TMA -> UMMA, transaction mbarriers), acc (UMMA -> epilogue,
TMEM stages), clc (CLC response -> every CTA's scheduler warp), unit (scheduler -> TMA, MMA,
epilogue warps) and the epilogue's TMA store groups. The block-scaled kernel
(kernels/sm100_blockscaled.py) extends this class through hooks that do not run for BF16.

Invariants: every thread first reads the prep kernel's verdict; on invalid offsets every CTA
exits before any mbarrier init, cluster barrier, TMEM allocation or CLC query, so no CTA waits
on one that left and no output byte is written. An empty unit (k_tiles 0) has no accumulator
stage: the MMA warp and the epilogue both skip it.

Compile-verified: tests/test_compile_sm100*.py (every mode and tile x cluster for sm_100a and
sm_103a; the PTX holds tcgen05.mma, cta_group::2 exactly for 256-row tiles, tcgen05.alloc /
ld / wait::ld, the CLC try_cancel and its mbarrier counts, multicast loads exactly where MMAs
share an operand, the descriptor acquire and prefetch, reduce-add exactly when accumulating,
and the offsets check before any other work); never run on an SM100 GPU
(tests/test_sm100_kernel_gpu.py is written for it). Its prep kernel, unit order, unit hand-off
and epilogue loop are shared with the SM90 kernel and run on the H200.
"""

# No `from __future__ import annotations`: the shared-storage struct built in launch() needs
# its annotations evaluated.

import enum
from typing import Optional, Tuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Int32, Int64
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.memory import SmemAllocator, TmemAllocator, get_num_tmem_alloc_cols
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum
from cutlass.utils.gemm.sm100 import (
    epilogue_smem_copy_and_partition,
    epilogue_tmem_copy_and_partition,
    transform_partitioned_tensor_layout,
)

from .entry import GroupedWgradKernel
from .epilogue import SubtileStore
from .prep import acquire_descriptor, output_ptr_ok, tma_desc_ptr_for_copy, token_origin
from .scheduler import ClcUnits, decode_unit, publish_words, take_words
from .config import (DESC_A, DESC_B, DESC_C, LoopInvariant, ProblemConfig, Workspace, ceil_div,
                     dense_output_view, expert_output_view, gemm_views)
from .tiling import (epi_buffer_sets_problem, sm100_cta_tile_m, sm100_problem,
                     unit_schedule_problem)

SMEM_CAPACITY = cutlass.memory.get_smem_capacity_in_bytes("sm_100")  # 227 KiB per CTA
CLC_RESPONSE_BYTES = 16
UNIT_STAGES = 2  # the scheduler warp's unit ring: it runs up to two units ahead of the epilogue
UNIT_WORDS = 5  # (expert (-1: no more work), unit m, unit n, first token, k tiles)
#                 (+ the hooks' unit_extra_words: the block-scaled kernel's token count)

NUM_EPI_WARPS = 4


class WarpRole(enum.IntEnum):
    """The first warp of each role (warp index in the CTA)."""

    EPILOGUE = 0  # warps 0..NUM_EPI_WARPS-1: TMEM -> output; the first allocates TMEM and
    #               issues the TMA stores
    MMA = 4  # tcgen05.mma (the leader CTA's of a pair issues it)
    TMA = 5  # TMA loads of A and B
    SCHEDULER = 6  # CLC queries (first CTA of the cluster); in every CTA, the only reader of
    #                the responses, decoding each unit once for the other roles


NUM_WARPS = NUM_EPI_WARPS + 3


class Barrier(enum.IntEnum):
    """Named barrier ids (0 is __syncthreads)."""

    EPI = 1  # the epilogue warps
    TMEM_ALLOC = 2  # the epilogue warps and the MMA warp: TMEM address handed over


class Sm100GroupedWgrad(GroupedWgradKernel):
    """One compiled kernel per ProblemConfig (its tile_m is the cluster's M extent)."""

    #: Words per unit in the unit ring: UNIT_WORDS, then unit_extra_words'.
    unit_word_count = UNIT_WORDS

    def __init__(self, cfg: ProblemConfig, mma_tiler_mn: Tuple[int, int]):
        reason = self.can_implement(cfg, mma_tiler_mn)
        if reason is not None:
            raise ValueError(f"{reason[0]}: {reason[1]}")
        self.cfg = cfg
        self.mma_tiler_mn = tuple(mma_tiler_mn)
        self.use_2cta_instrs = mma_tiler_mn[0] == 256
        self.cluster_shape_mn = (cfg.cluster_m, cfg.cluster_n)
        self.acc_dtype = cutlass.Float32
        self.ab_dtype = cfg.cutlass_ab_dtype  # A's (and B's, unless b_dtype differs)
        self.b_dtype = cfg.cutlass_b_dtype
        self.c_dtype = cfg.cutlass_c_dtype
        self.cta_group = tcgen05.CtaGroup.TWO if self.use_2cta_instrs else tcgen05.CtaGroup.ONE
        self.num_threads = 32 * NUM_WARPS
        self.num_epi_threads = 32 * NUM_EPI_WARPS
        # Accumulator pipeline stages, each its own TMEM buffer of tile_n columns (the
        # block-scaled kernel overlaps two buffers on one stage where two do not fit).
        self.acc_stage = 2
        self.overlapping_accum = False
        self.arch = "sm_100"

    @staticmethod
    def can_implement(
        cfg: ProblemConfig, mma_tiler_mn: Tuple[int, int]
    ) -> Optional[Tuple[str, str]]:
        """(argument, detail) of the first reason this kernel cannot run `cfg`, or None.
        (cfg.epi_tile_n is not used: the epilogue tile is the DSL's choice for the MMA tile.)"""
        problem = sm100_problem(tuple(mma_tiler_mn), (cfg.cluster_m, cfg.cluster_n))
        if problem is not None:
            return problem
        problem = (epi_buffer_sets_problem(cfg.epi_buffer_sets, None)
                   or unit_schedule_problem(cfg.unit_schedule, bool(cfg.scale_recipe),
                                           "sm_100a"))
        if problem is not None:
            return problem
        if (cfg.tile_m != sm100_cta_tile_m(mma_tiler_mn) * cfg.cluster_m
                or cfg.tile_n != mma_tiler_mn[1]):
            return ("mma_tiler_mn", f"internal: the unit tile {cfg.tile_m}x{cfg.tile_n} must be "
                                    f"the cluster's tile for {tuple(mma_tiler_mn)}")
        return None

    # ------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------
    def _setup(self):
        cfg = self.cfg
        self.a_major_mode = OperandMajorMode.K if cfg.a_major == "k" else OperandMajorMode.MN
        self.b_major_mode = OperandMajorMode.K if cfg.b_major == "k" else OperandMajorMode.MN
        self.c_layout = LayoutEnum.ROW_MAJOR
        tiled_mma = self.make_tiled_mma(self.cta_group, self.mma_tiler_mn)
        mma_inst_k = cute.size(tiled_mma.shape_mnk, mode=[2])
        self.mma_tiler = (*self.mma_tiler_mn, mma_inst_k * 4)  # 4 MMA instructions per K block
        if self.mma_tiler[2] != cfg.tile_k:
            raise ValueError(f"internal: the K block must be {cfg.tile_k} tokens, the MMA's is "
                             f"{self.mma_tiler[2]}")
        atom_thr = cute.size(tiled_mma.thr_id.shape)
        self.cta_tile_shape_mnk = (self.mma_tiler[0] // atom_thr, self.mma_tiler[1], self.mma_tiler[2])
        # MMA tiles covering one expert's output rows, and the MMAs a cluster runs side by
        # side along M: an MMA of the cluster past the output's tiles stores nothing.
        self.mma_tiles_m = ceil_div(cfg.hidden, self.mma_tiler[0])
        self.mmas_per_cluster_m = cfg.cluster_m // atom_thr
        self.cluster_layout_vmnk = cute.tiled_divide(
            cute.make_layout((*self.cluster_shape_mn, 1)), (tiled_mma.thr_id.shape,)
        )
        # The same shape as plain ints, usable inside any kernel region (the prep kernel).
        self.cluster_shape_vmnk = (
            atom_thr, self.cluster_shape_mn[0] // atom_thr, self.cluster_shape_mn[1], 1
        )
        self.num_mcast_ctas_a = cute.size(self.cluster_layout_vmnk.shape[2])
        self.num_mcast_ctas_b = cute.size(self.cluster_layout_vmnk.shape[1])
        self.is_a_mcast = self.num_mcast_ctas_a > 1
        self.is_b_mcast = self.num_mcast_ctas_b > 1
        self.epi_tile = sm100_utils.compute_epilogue_tile_shape(
            self.cta_tile_shape_mnk, self.use_2cta_instrs, self.c_layout, self.c_dtype
        )
        # Stages: 2 epilogue buffers, the rest of shared memory to the A/B ring.
        c_smem_one = sm100_utils.make_smem_layout_epi(self.c_dtype, self.c_layout, self.epi_tile, 1)
        a_one = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, self.ab_dtype, 1)
        b_one = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, self.b_dtype, 1)
        # One stage: A and B K-blocks (and a block-scaled kernel's scale factors).
        ab_bytes = (cute.size_in_bytes(self.ab_dtype, a_one) + cute.size_in_bytes(self.b_dtype, b_one)
                    + self.scale_stage_bytes(tiled_mma, 1))
        c_bytes = cute.size_in_bytes(self.c_dtype, c_smem_one)
        reserved = 1024
        self.epi_stage = 2
        self.ab_stage = (SMEM_CAPACITY - reserved - self.epi_stage * c_bytes) // ab_bytes
        self.epi_stage += (
            SMEM_CAPACITY - reserved - self.ab_stage * ab_bytes - self.epi_stage * c_bytes
        ) // c_bytes
        self.setup_scales(tiled_mma)
        self.a_smem_layout_staged = sm100_utils.make_smem_layout_a(
            tiled_mma, self.mma_tiler, self.ab_dtype, self.ab_stage
        )
        self.b_smem_layout_staged = sm100_utils.make_smem_layout_b(
            tiled_mma, self.mma_tiler, self.b_dtype, self.ab_stage
        )
        self.epi_smem_layout_staged = sm100_utils.make_smem_layout_epi(
            self.c_dtype, self.c_layout, self.epi_tile, self.epi_stage
        )
        tCtAcc_fake = self.acc_fragment(tiled_mma)
        self.num_tmem_alloc_cols = self.tmem_columns(tCtAcc_fake)
        a_copy = cute.size_in_bytes(self.ab_dtype, cute.slice_(self.a_smem_layout_staged, (None, None, None, 0)))
        b_copy = cute.size_in_bytes(self.b_dtype, cute.slice_(self.b_smem_layout_staged, (None, None, None, 0)))
        # One stage's TMA transaction bytes, over the CTAs of an MMA (scale factors included).
        self.tma_bytes = (a_copy + b_copy + self.scale_stage_bytes(tiled_mma, 1)) * atom_thr
        return tiled_mma

    # Hooks of the block-scaled kernel (kernels/sm100_blockscaled.py); BF16 has no scales.
    def make_tiled_mma(self, cta_group, mma_tiler_mn):
        return sm100_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.b_dtype, self.a_major_mode, self.b_major_mode,
            self.acc_dtype, cta_group, mma_tiler_mn,
        )

    def scale_stage_bytes(self, tiled_mma, stages: int) -> int:
        """Shared-memory bytes of `stages` pipeline stages of scale factors."""
        return 0

    def setup_scales(self, tiled_mma) -> None:
        """Scale-factor layouts, once the stage count (self.ab_stage) is known."""

    def tmem_columns(self, tCtAcc_fake) -> int:
        """TMEM columns to allocate: the accumulator stages (the DSL's rounding)."""
        return get_num_tmem_alloc_cols(tCtAcc_fake)

    def acc_fragment(self, tiled_mma):
        """The accumulator buffers' (fake) TMEM tensor: (MMA, MMA_M, MMA_N, buffer), one
        buffer per stage."""
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        return tiled_mma.make_fragment_C(cute.append(acc_shape, self.acc_stage))

    def acc_buffer(self, acc_state, producer: bool):
        """The TMEM buffer of the accumulator stage `acc_state` (the MMA warp's producer state
        or the epilogue's consumer state): the stage's own."""
        return acc_state.index

    def _load_ops(self, tiled_mma):
        a_op = sm100_utils.cluster_shape_to_tma_atom_A(self.cluster_shape_mn, tiled_mma.thr_id)
        b_op = sm100_utils.cluster_shape_to_tma_atom_B(self.cluster_shape_mn, tiled_mma.thr_id)
        return a_op, b_op

    @staticmethod
    def _with_batch_mode(t: cute.Tensor) -> cute.Tensor:
        """(rows, tokens) -> (rows, tokens, 1): the MNKL form the SM100 helpers take."""
        return cute.make_tensor(
            t.iterator, cute.make_layout((*t.shape, 1), stride=(*t.stride, 0))
        )

    def launch(self, a_ptr, b_ptr, offsets_ptr, c_ptr, workspace_ptr, status_ptr, tokens_sum,
               grid_size, stream, scales=None):
        """Prep + GEMM on `stream`. `grid_size` is unused: CLC needs one cluster per unit.
        `scales`: block-scaled kernels' (sfa, sfb, gsa, gsb, sf_capacity) addresses."""
        cfg = self.cfg
        tiled_mma = self._setup()
        mA2, mB2 = gemm_views(cfg, a_ptr, b_ptr, tokens_sum)
        mA, mB = self._with_batch_mode(mA2), self._with_batch_mode(mB2)
        offsets = cute.make_tensor(offsets_ptr, cute.make_layout(cfg.num_experts))
        a_smem_layout = cute.slice_(self.a_smem_layout_staged, (None, None, None, 0))
        b_smem_layout = cute.slice_(self.b_smem_layout_staged, (None, None, None, 0))
        epi_smem_layout = cute.select(self.epi_smem_layout_staged, mode=[0, 1])
        a_op, b_op = self._load_ops(tiled_mma)
        tma_atom_a, tma_tensor_a = cute.nvgpu.make_tiled_tma_atom_A(
            a_op, mA, a_smem_layout, self.mma_tiler, tiled_mma, self.cluster_shape_vmnk
        )
        tma_atom_b, tma_tensor_b = cute.nvgpu.make_tiled_tma_atom_B(
            b_op, mB, b_smem_layout, self.mma_tiler, tiled_mma, self.cluster_shape_vmnk
        )
        if cutlass.const_expr(cfg.output_mode == "dense"):
            mC = dense_output_view(cfg, c_ptr)
            wgrad_ptrs = cute.make_tensor(
                cute.recast_ptr(workspace_ptr, dtype=Int64), cute.make_layout(1)
            )
        else:
            # Only types and coordinates come from this atom: every store uses an expert's
            # descriptor from the workspace.
            mC = self._with_batch_mode(
                expert_output_view(cfg, cute.recast_ptr(workspace_ptr, dtype=self.c_dtype))
            )
            wgrad_ptrs = cute.make_tensor(
                cute.recast_ptr(c_ptr, dtype=Int64), cute.make_layout(cfg.num_experts)
            )
        tma_atom_c, tma_tensor_c = cpasync.make_tiled_tma_atom(
            self.c_store_op(), mC, epi_smem_layout, self.epi_tile
        )

        scale_sources, scale_views, sf_capacity = None, None, None
        if cutlass.const_expr(scales is not None):
            scale_sources, scale_views = self.scale_sources(scales, tiled_mma)
            sf_capacity = scales[4]
        self.launch_prep(
            mA2, mB2, offsets, tokens_sum, wgrad_ptrs, workspace_ptr, status_ptr, tiled_mma,
            a_smem_layout, b_smem_layout, epi_smem_layout, stream, sf_capacity=sf_capacity,
            scale_views=scale_views,
        )
        cluster_size = cfg.cluster_m * cfg.cluster_n
        args = (
            tiled_mma, tma_atom_a, tma_tensor_a, tma_atom_b, tma_tensor_b, tma_atom_c,
            tma_tensor_c, wgrad_ptrs, workspace_ptr, self.cluster_layout_vmnk,
            self.a_smem_layout_staged, self.b_smem_layout_staged, self.epi_smem_layout_staged,
            self.epi_tile,
        )
        if cutlass.const_expr(scales is None):
            kernel = self.kernel(*args)
        else:
            kernel = self.kernel_scaled(*args, *scale_sources)
        kernel.launch(
            grid=(cfg.num_units * cluster_size, 1, 1),
            block=(self.num_threads, 1, 1),
            cluster=(*self.cluster_shape_mn, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    def expert_output_tensor(self, c_e):
        return self._with_batch_mode(c_e)

    @cute.jit
    def expert_load_atoms(self, a_e, b_e, tiled_mma, a_smem_layout, b_smem_layout):
        a_op, b_op = self._load_ops(tiled_mma)
        atom_a, _ = cute.nvgpu.make_tiled_tma_atom_A(
            a_op, self._with_batch_mode(a_e), a_smem_layout, self.mma_tiler, tiled_mma,
            self.cluster_shape_vmnk,
        )
        atom_b, _ = cute.nvgpu.make_tiled_tma_atom_B(
            b_op, self._with_batch_mode(b_e), b_smem_layout, self.mma_tiler, tiled_mma,
            self.cluster_shape_vmnk,
        )
        return atom_a, atom_b

    # ------------------------------------------------------------------------------------
    # GEMM kernel
    # ------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        mA_coord: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_coord: cute.Tensor,
        tma_atom_c: cute.CopyAtom,
        mC_coord: cute.Tensor,
        wgrad_ptrs: cute.Tensor,
        workspace_ptr: cute.Pointer,
        cluster_layout_vmnk: cute.Layout,
        a_smem_layout_staged: cute.ComposedLayout,
        b_smem_layout_staged: cute.ComposedLayout,
        epi_smem_layout_staged: cute.ComposedLayout,
        epi_tile: cute.Tile,
    ):
        ws = Workspace(self.cfg, workspace_ptr)
        # The prep kernel's offsets verdict (it ran before this kernel on the stream). Every
        # thread of every CTA reads it first: with invalid offsets every CTA of every cluster
        # exits before any cluster barrier, mbarrier init, TMEM allocation or CLC query, so
        # the protocols stay consistent (no CTA waits on a peer that left), no cluster is
        # cancelled (each launched cluster exits at once) and nothing is stored.
        if ws.verdict[0] != 0:
            self.gemm_cta(
                tiled_mma, tma_atom_a, mA_coord, tma_atom_b, mB_coord, tma_atom_c, mC_coord,
                wgrad_ptrs, ws, cluster_layout_vmnk, a_smem_layout_staged, b_smem_layout_staged,
                epi_smem_layout_staged, epi_tile, None,
            )

    @cute.jit
    def gemm_cta(
        self, tiled_mma, tma_atom_a, mA_coord, tma_atom_b, mB_coord, tma_atom_c, mC_coord,
        wgrad_ptrs, ws, cluster_layout_vmnk, a_smem_layout_staged, b_smem_layout_staged,
        epi_smem_layout_staged, epi_tile, scales,
    ):
        """One CTA's whole work (valid offsets only): the shared setup, then each warp's role
        (scheduler, tma_loads, mma, epilogue). `scales`: None for BF16; the block-scaled
        kernel's scale sources (its `scale_sources`)."""
        cfg = self.cfg
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        use_2cta_instrs = cute.size(tiled_mma.thr_id.shape) == 2
        atom_thr = cute.size(tiled_mma.thr_id.shape)

        bidx, _, _ = cute.arch.block_idx()
        mma_tile_coord_v = bidx % atom_thr
        is_leader_cta = mma_tile_coord_v == 0
        cta_rank_in_cluster = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        is_first_cta_in_cluster = cta_rank_in_cluster == 0
        block_in_cluster_coord_vmnk = cluster_layout_vmnk.get_flat_coord(cta_rank_in_cluster)
        cta_m_in_cluster = cta_rank_in_cluster % cfg.cluster_m

        smem = SmemAllocator()
        storage = smem.allocate(self.storage_type())

        cluster_size = cute.size(cluster_layout_vmnk)
        (ab_producer, ab_consumer, acc_pipeline, clc_pipeline, unit_pipeline, unit_slots,
         tmem) = self.make_pipelines(storage, cluster_layout_vmnk, use_2cta_instrs)
        pipeline_init_arrive(cluster_shape_mn=self.cluster_shape_mn, is_relaxed=True)

        sA = smem.allocate_tensor(
            element_type=self.ab_dtype, layout=a_smem_layout_staged.outer,
            byte_alignment=128, swizzle=a_smem_layout_staged.inner,
        )
        sB = smem.allocate_tensor(
            element_type=self.b_dtype, layout=b_smem_layout_staged.outer,
            byte_alignment=128, swizzle=b_smem_layout_staged.inner,
        )
        smem_scales = None
        if cutlass.const_expr(scales is not None):
            smem_scales = self.scale_buffers(smem, scales)
        a_mcast_mask = None
        b_mcast_mask = None
        if cutlass.const_expr(self.is_a_mcast or self.is_b_mcast or self.use_2cta_instrs):
            a_mcast_mask = cpasync.create_tma_multicast_mask(
                cluster_layout_vmnk, block_in_cluster_coord_vmnk, mcast_mode=2
            )
            b_mcast_mask = cpasync.create_tma_multicast_mask(
                cluster_layout_vmnk, block_in_cluster_coord_vmnk, mcast_mode=1
            )
        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        tCtAcc_fake = self.acc_fragment(tiled_mma)
        thr_mma = tiled_mma.get_slice(mma_tile_coord_v)
        a_cta_layout = cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, 0, None, 0)).shape)
        b_cta_layout = cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, None, 0, 0)).shape)

        clc_response_ptr = storage.clc_response.data_ptr()
        pipeline_init_wait(cluster_shape_mn=self.cluster_shape_mn)

        if warp_idx == WarpRole.SCHEDULER:
            # From the cluster's own unit on; every unit it reads goes to the unit ring.
            units = ClcUnits(clc_pipeline, clc_response_ptr, cluster_size, bidx // cluster_size)
            self.scheduler(units, unit_pipeline, unit_slots, ws, is_first_cta_in_cluster)
        if warp_idx == WarpRole.TMA:
            self.tma_loads(
                tma_atom_a, mA_coord, tma_atom_b, mB_coord, sA, sB, thr_mma, ab_producer,
                unit_pipeline, unit_slots, ws, a_cta_layout, b_cta_layout,
                block_in_cluster_coord_vmnk, a_mcast_mask, b_mcast_mask, cta_m_in_cluster,
                atom_thr, scales, smem_scales, mma_tile_coord_v, cta_rank_in_cluster,
            )
        if warp_idx == WarpRole.MMA:
            self.mma(
                tiled_mma, tCrA, tCrB, tCtAcc_fake, tmem, ab_consumer, acc_pipeline,
                unit_pipeline, unit_slots, is_leader_cta, smem_scales,
            )

        sC = smem.allocate_tensor(
            element_type=self.c_dtype, layout=epi_smem_layout_staged.outer,
            byte_alignment=128, swizzle=epi_smem_layout_staged.inner,
        )

        if warp_idx < WarpRole.EPILOGUE + NUM_EPI_WARPS:
            self.epilogue(
                tma_atom_c, mC_coord, sC, thr_mma, tmem, tCtAcc_fake, acc_pipeline,
                unit_pipeline, unit_slots, ws, wgrad_ptrs, tidx, warp_idx,
                epi_tile, use_2cta_instrs, cta_m_in_cluster, atom_thr, scales,
            )

    def storage_type(self):
        """The kernel's shared-memory struct of barriers and slots (the tiles are allocated
        after it)."""

        @cute.struct
        class SharedStorage:
            ab_full_mbar_ptr: cute.struct.MemRange[Int64, self.ab_stage * 2]
            acc_full_mbar_ptr: cute.struct.MemRange[Int64, self.acc_stage * 2]
            clc_mbar_ptr: cute.struct.MemRange[Int64, 2]
            clc_response: cute.struct.Align[cute.struct.MemRange[Int32, 4], CLC_RESPONSE_BYTES]
            unit_mbar_ptr: cute.struct.MemRange[Int64, UNIT_STAGES * 2]
            unit_slots: cute.struct.MemRange[Int32, UNIT_STAGES * self.unit_word_count]
            tmem_dealloc_mbar: Int64
            tmem_holding_buf: Int32

        return SharedStorage

    @cute.jit
    def make_pipelines(self, storage, cluster_layout_vmnk, use_2cta_instrs):
        """The CTA's pipelines in `storage`: ab (TMA -> MMA), acc (MMA -> epilogue, TMEM
        stages), clc (CLC responses -> every CTA's scheduler warp), the unit ring and its
        slots, and the TMEM allocator."""
        cluster_size = cute.size(cluster_layout_vmnk)
        ab_producer, ab_consumer = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_full_mbar_ptr.data_ptr(),
            num_stages=self.ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.num_mcast_ctas_a + self.num_mcast_ctas_b - 1
            ),
            tx_count=self.tma_bytes,
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        ).make_participants()
        # The acc "empty" barrier counts threads: every epilogue thread of the pair releases
        # the stage (after its own tcgen05.wait::ld), 128 of them remotely from the peer CTA
        # in 2-CTA. Kept deliberately: cuDNN frontend's wgrad kernel and torch_grouped_mm,
        # the grouped references, do the same; it is one release per unit (not per K block);
        # the warp-counted form (the dense example's: 4 warps x 2 CTAs, elect_one after the
        # warp-synchronous tcgen05.wait::ld) saves ~250 DSMEM arrives per unit, which cannot
        # be measured without an SM100 GPU, and would change the release protocol of a
        # kernel that has never run. docs/BLACKWELL.md lists it to measure on hardware.
        acc_pipeline = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_full_mbar_ptr.data_ptr(),
            num_stages=self.acc_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.num_epi_threads * (2 if use_2cta_instrs else 1)
            ),
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        )
        clc_pipeline = pipeline.PipelineClcFetchAsync.create(
            barrier_storage=storage.clc_mbar_ptr.data_ptr(),
            num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # The scheduler warp of every CTA of the cluster (the other roles take units from
            # their CTA's scheduler through the unit ring).
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * cluster_size),
            tx_count=CLC_RESPONSE_BYTES,
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        )
        # Scheduler warp -> TMA, MMA and epilogue warps of this CTA: each unit decoded once.
        unit_pipeline = pipeline.PipelineAsync.create(
            barrier_storage=storage.unit_mbar_ptr.data_ptr(),
            num_stages=UNIT_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, 32 * (2 + NUM_EPI_WARPS)
            ),
            defer_sync=True,
        )
        unit_slots = cute.make_tensor(
            storage.unit_slots.data_ptr(),
            cute.make_layout((self.unit_word_count, UNIT_STAGES)),
        )
        tmem = TmemAllocator(
            storage.tmem_holding_buf.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(
                barrier_id=int(Barrier.TMEM_ALLOC), num_threads=self.num_epi_threads + 32
            ),
            allocator_warp_id=int(WarpRole.EPILOGUE),
            is_two_cta=use_2cta_instrs,
            two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_mbar.ptr,
        )
        return (ab_producer, ab_consumer, acc_pipeline, clc_pipeline, unit_pipeline, unit_slots,
                tmem)

    # ------------------------------------------------------------------------------------
    # warp roles
    # ------------------------------------------------------------------------------------
    @cute.jit
    def scheduler(self, units, unit_pipeline, unit_slots, ws, is_first_cta_in_cluster):
        """Scheduler warp: takes the units from cluster launch control (scheduler.ClcUnits:
        the first CTA of the cluster issues the queries; in every CTA this warp is the only
        reader of the responses, so the CLC slot is free again as soon as every CTA's
        scheduler has read it), decodes each unit once and publishes it to the TMA, MMA and
        epilogue warps through the unit ring, ending with a unit of expert -1. With two ring
        stages the next query goes out while the epilogue still works on the unit before last
        (cuDNN frontend's wgrad kernel does the same)."""
        lane = cute.arch.lane_idx()
        unit_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, UNIT_STAGES)
        unit, walk = units.first_unit()
        publish_words(unit_pipeline, unit_state, unit_slots,
                      self.unit_words(unit, cutlass.Boolean(True), ws), lane)
        unit_state.advance()
        valid = cutlass.Boolean(True)
        if is_first_cta_in_cluster:
            query = units.first_query()
            while valid:
                units.query(query)
                query.advance()
                unit, valid, walk = units.next_unit(unit, walk, lane)
                publish_words(unit_pipeline, unit_state, unit_slots,
                              self.unit_words(unit, valid, ws), lane)
                unit_state.advance()
            units.finish_queries(query)
        else:
            while valid:
                unit, valid, walk = units.next_unit(unit, walk, lane)
                publish_words(unit_pipeline, unit_state, unit_slots,
                              self.unit_words(unit, valid, ws), lane)
                unit_state.advance()

    @cute.jit
    def unit_words(self, unit, valid, ws):
        """The unit ring's words of a unit: (expert, unit m, unit n, first token, k tiles);
        expert -1 once there is no more work."""
        cfg = self.cfg
        # A failed cancel's response holds no unit: decode an in-range one, then drop it.
        expert, unit_m, unit_n, begin, k_tiles = decode_unit(
            cfg, cutlass.max(cutlass.min(unit, cfg.num_units - 1), 0), ws
        )
        extra = self.unit_extra_words(ws, expert, begin)
        if not valid:
            expert = Int32(-1)
        return (expert, unit_m, unit_n, begin, k_tiles, *extra)

    def unit_extra_words(self, ws, expert, begin):
        """Words a hook adds to each unit (after UNIT_WORDS), decoded by the scheduler warp
        so no other role reads them from global memory: none for BF16."""
        return ()

    @cute.jit
    def take_unit(self, unit_pipeline, unit_state, unit_slots):
        """The next unit from the scheduler warp: (expert, unit m, unit n, first token,
        k tiles, state); expert < 0 means no more work."""
        words, unit_state = take_words(unit_pipeline, unit_state, unit_slots, UNIT_WORDS)
        return words[0], words[1], words[2], words[3], words[4], unit_state

    @cute.jit
    def take_mma_unit(self, unit_pipeline, unit_state, unit_slots):
        """The MMA warp's view of the next unit: (expert, k tiles, tokens, state); `tokens`
        is the expert's token count from the unit words where a hook publishes it
        (block-scaled), else 0 (unused)."""
        words, unit_state = take_words(unit_pipeline, unit_state, unit_slots,
                                            self.unit_word_count)
        tokens = Int32(0)
        if cutlass.const_expr(self.unit_word_count > UNIT_WORDS):
            tokens = words[UNIT_WORDS]
        return words[0], words[4], tokens, unit_state

    @cute.jit
    def tma_loads(
        self, tma_atom_a, mA_coord, tma_atom_b, mB_coord, sA, sB, thr_mma, ab_producer,
        unit_pipeline, unit_slots, ws, a_cta_layout, b_cta_layout,
        block_in_cluster_coord_vmnk, a_mcast_mask, b_mcast_mask, cta_m_in_cluster,
        atom_thr: cutlass.Constexpr, scales, smem_scales, mma_tile_coord_v, cta_rank_in_cluster,
    ):
        """TMA warp: each unit's A and B K-blocks (and scale factors) through the expert's
        descriptors."""
        cfg = self.cfg
        sf_loads = None
        if cutlass.const_expr(scales is not None):
            sf_loads = self.scale_load_partitions(
                scales, smem_scales, thr_mma, a_cta_layout, a_mcast_mask, mma_tile_coord_v,
                cta_rank_in_cluster, block_in_cluster_coord_vmnk,
            )
        last_expert = Int32(-1)
        unit_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, UNIT_STAGES)
        expert, unit_m, unit_n, begin, k_tiles, unit_state = self.take_unit(
            unit_pipeline, unit_state, unit_slots
        )
        while expert >= 0:
            if expert != last_expert and k_tiles > 0:
                # Device-written descriptors: acquire fence + prefetch per expert (the
                # examples' prefetch_descriptor is for host descriptors). An empty unit
                # loads nothing: its expert's descriptors are neither fenced nor prefetched
                # (and last_expert stays the last expert whose were).
                acquire_descriptor(ws, expert, DESC_A)
                acquire_descriptor(ws, expert, DESC_B)
                if cutlass.const_expr(scales is not None):
                    acquire_descriptor(ws, expert, cfg.desc_sfa)
                    acquire_descriptor(ws, expert, cfg.desc_sfb)
                last_expert = expert
            desc_a = tma_desc_ptr_for_copy(ws.desc_ptr(expert, DESC_A))
            desc_b = tma_desc_ptr_for_copy(ws.desc_ptr(expert, DESC_B))
            k0 = token_origin(begin, cfg.a_ragged_block)
            kb0 = token_origin(begin, cfg.b_ragged_block)
            gA = cute.local_tile(
                cute.domain_offset((0, k0, 0), mA_coord),
                cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None),
            )
            gB = cute.local_tile(
                cute.domain_offset((0, kb0, 0), mB_coord),
                cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None),
            )
            tAsA, tAgA = cpasync.tma_partition(
                tma_atom_a, block_in_cluster_coord_vmnk[2], a_cta_layout,
                cute.group_modes(sA, 0, 3), cute.group_modes(thr_mma.partition_A(gA), 0, 3),
            )
            tBsB, tBgB = cpasync.tma_partition(
                tma_atom_b, block_in_cluster_coord_vmnk[1], b_cta_layout,
                cute.group_modes(sB, 0, 3), cute.group_modes(thr_mma.partition_B(gB), 0, 3),
            )
            mma_m = (unit_m * cfg.cluster_m + cta_m_in_cluster) // atom_thr
            tAgA_slice = tAgA[(None, mma_m, None, 0)]
            tBgB_slice = tBgB[(None, unit_n, None, 0)]

            ab_producer.reset()
            peek = ab_producer.try_acquire()
            for k_tile in cutlass.range(0, k_tiles, 1, unroll=1):
                handle = ab_producer.acquire_and_advance(peek)
                cute.copy(
                    tma_atom_a, tAgA_slice[(None, handle.count)], tAsA[(None, handle.index)],
                    tma_bar_ptr=handle.barrier, tma_desc_ptr=desc_a, mcast_mask=a_mcast_mask,
                )
                cute.copy(
                    tma_atom_b, tBgB_slice[(None, handle.count)], tBsB[(None, handle.index)],
                    tma_bar_ptr=handle.barrier, tma_desc_ptr=desc_b, mcast_mask=b_mcast_mask,
                )
                if cutlass.const_expr(scales is not None):
                    self.load_scales(sf_loads, ws, expert, mma_m, unit_n, handle)
                peek = cutlass.Boolean(1)
                if handle.count + 1 < k_tiles:
                    peek = ab_producer.try_acquire()

            expert, unit_m, unit_n, begin, k_tiles, unit_state = self.take_unit(
                unit_pipeline, unit_state, unit_slots
            )
        ab_producer.tail()

    @cute.jit
    def mma(
        self, tiled_mma, tCrA, tCrB, tCtAcc_fake, tmem, ab_consumer, acc_pipeline,
        unit_pipeline, unit_slots, is_leader_cta, smem_scales,
    ):
        """MMA warp: tcgen05.mma of each unit into the next TMEM accumulator stage (the
        leader CTA of a pair issues it), one K block at a time (mma_block). Everything it
        needs of a unit comes in the unit words (no global-memory read per unit).
        (`smem_scales`: what the block-scaled kernel's hooks read.)"""
        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
        tCtAcc_base = cute.make_tensor(tmem_ptr, tCtAcc_fake.layout)
        block_state = self.mma_block_state(tiled_mma, tmem_ptr, tCtAcc_base, smem_scales)
        acc_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Producer, self.acc_stage
        )
        unit_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, UNIT_STAGES)
        expert, k_tiles, tokens, unit_state = self.take_mma_unit(
            unit_pipeline, unit_state, unit_slots
        )
        while expert >= 0:
            if is_leader_cta:
                tCtAcc = tCtAcc_base[(None, None, None, self.acc_buffer(acc_state, True))]
                ab_consumer.reset()
                peek = cutlass.Boolean(1)
                if k_tiles > 0:
                    peek = ab_consumer.try_wait()
                    acc_pipeline.producer_acquire(acc_state)
                for k_tile in cutlass.range(0, k_tiles, 1, unroll=1):
                    handle = ab_consumer.wait_and_advance(peek)
                    # (rebound: the block sets fields of the MMA, loop-carried state)
                    tiled_mma = self.mma_block(tiled_mma, tCtAcc, tCrA, tCrB, handle.index,
                                               k_tile, block_state, tokens)
                    handle.release()
                    peek = cutlass.Boolean(1)
                    if handle.count + 1 < k_tiles:
                        peek = ab_consumer.try_wait()
                if k_tiles > 0:
                    acc_pipeline.producer_commit(acc_state)
            # An empty unit produces no accumulator: both sides skip its stage.
            if k_tiles > 0:
                acc_state.advance()

            expert, k_tiles, tokens, unit_state = self.take_mma_unit(
                unit_pipeline, unit_state, unit_slots
            )
        acc_pipeline.producer_tail(acc_state)

    # MMA hooks (the block-scaled kernel's scale factors); BF16: one gemm per K block.
    def mma_block_state(self, tiled_mma, tmem_ptr, tCtAcc_base, smem_scales):
        """What mma_block needs besides the operands, built once per CTA (None for BF16)."""
        return None

    @cute.jit
    def mma_block(self, tiled_mma, tCtAcc, tCrA, tCrB, stage, k_tile, block_state, tokens):
        """The MMAs of one K block (shared-memory stage `stage`) into the accumulator;
        returns the MMA with the fields it set."""
        tiled_mma.set(tcgen05.Field.ACCUMULATE, k_tile != 0)
        crd = (None, None, None, stage)
        cute.gemm(tiled_mma, tCtAcc, tCrA[crd], tCrB[crd], tCtAcc)
        return tiled_mma

    @cute.jit
    def epilogue(
        self, tma_atom_c, mC_coord, sC, thr_mma, tmem, tCtAcc_fake, acc_pipeline,
        unit_pipeline, unit_slots, ws, wgrad_ptrs, tidx, warp_idx, epi_tile,
        use_2cta_instrs: cutlass.Constexpr, cta_m_in_cluster, atom_thr: cutlass.Constexpr,
        scales,
    ):
        """Epilogue warps: the first allocates TMEM; each unit's accumulator goes TMEM ->
        registers -> (times the expert's global-scale product alpha, block-scaled kernels
        with global scales) -> output dtype -> shared memory -> TMA store (store_tile); TMEM
        is freed at the end."""
        cfg = self.cfg
        tmem.allocate(self.num_tmem_alloc_cols)
        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
        tCtAcc_base = cute.make_tensor(tmem_ptr, tCtAcc_fake.layout)
        acc_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Consumer, self.acc_stage
        )
        (subtile_store, tiled_copy_t2r, tTR_tAcc_base, tTR_rAcc, bSG_sC,
         bSG_gC_all) = self.epilogue_setup(tma_atom_c, mC_coord, sC, thr_mma, tCtAcc_base, tidx,
                                           epi_tile, use_2cta_instrs)
        n_done = Int32(0)
        unit_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, UNIT_STAGES)
        expert, unit_m, unit_n, begin, k_tiles, unit_state = self.take_unit(
            unit_pipeline, unit_state, unit_slots
        )
        while expert >= 0:
            mma_m = (unit_m * cfg.cluster_m + cta_m_in_cluster) // atom_thr
            store = self.unit_stored(wgrad_ptrs, expert, mma_m, k_tiles)
            # alpha_e does not depend on the accumulator: its loads go out before the wait.
            alpha = None
            if cutlass.const_expr(scales is not None):
                alpha = self.unit_alpha(scales, expert)
            if k_tiles > 0:
                acc_pipeline.consumer_wait(acc_state)
            if store:
                if cutlass.const_expr(cfg.output_mode == "dense"):
                    bSG_gC = bSG_gC_all[(None, None, None, mma_m, unit_n, expert)]
                    self.store_tile(
                        subtile_store, tTR_tAcc_base, acc_pipeline, acc_state, k_tiles,
                        tiled_copy_t2r, tTR_rAcc, bSG_sC, bSG_gC, None, warp_idx, n_done, alpha,
                    )
                else:
                    bSG_gC = bSG_gC_all[(None, None, None, mma_m, unit_n, 0)]
                    if warp_idx == WarpRole.EPILOGUE:
                        acquire_descriptor(ws, expert, DESC_C)
                    desc_c = tma_desc_ptr_for_copy(ws.desc_ptr(expert, DESC_C))
                    self.store_tile(
                        subtile_store, tTR_tAcc_base, acc_pipeline, acc_state, k_tiles,
                        tiled_copy_t2r, tTR_rAcc, bSG_sC, bSG_gC, desc_c, warp_idx, n_done,
                        alpha,
                    )
                n_done += 1
            # Every epilogue thread releases the stage (as torch_grouped_mm does); an empty
            # unit has no accumulator stage to wait for or release. With overlapping buffers
            # store_tile released it early (after the sub-tiles the next buffer overlaps);
            # a unit it did not store releases here.
            if k_tiles > 0:
                if cutlass.const_expr(self.overlapping_accum):
                    if not store:
                        acc_pipeline.consumer_release(acc_state)
                else:
                    # This thread's TMEM loads are complete before the MMA may overwrite
                    # the stage.
                    cute.arch.fence_view_async_tmem_load()
                    acc_pipeline.consumer_release(acc_state)
                acc_state.advance()

            expert, unit_m, unit_n, begin, k_tiles, unit_state = self.take_unit(
                unit_pipeline, unit_state, unit_slots
            )
        subtile_store.store_pipeline.producer_tail()
        tmem.relinquish_alloc_permit()
        tmem.free(tmem_ptr)

    @cute.jit
    def epilogue_setup(self, tma_atom_c, mC_coord, sC, thr_mma, tCtAcc_base, tidx, epi_tile,
                       use_2cta_instrs: cutlass.Constexpr):
        """The epilogue warps' copies (the DSL's SM100 helpers): TMEM -> registers
        (tcgen05.ld: the tiled copy, its TMEM partition (..., buffer) and FP32 registers),
        registers -> shared memory (in the SubtileStore) and the TMA partitions of the
        staging buffers and of the output ((..., mma m, n, expert))."""
        store_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stage,
            producer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.num_epi_threads
            ),
        )
        epi_bar = pipeline.NamedBarrier(barrier_id=int(Barrier.EPI), num_threads=self.num_epi_threads)
        tCtAcc_transformed = transform_partitioned_tensor_layout(tCtAcc_base)
        gC_mnl = cute.local_tile(
            mC_coord, cute.slice_(self.mma_tiler, (None, None, 0)), (None, None, None)
        )
        tCgC_transformed = transform_partitioned_tensor_layout(thr_mma.partition_C(gC_mnl))
        tiled_copy_t2r, tTR_tAcc_base, tTR_rAcc = epilogue_tmem_copy_and_partition(
            self, tidx, tCtAcc_transformed, tCgC_transformed, epi_tile, use_2cta_instrs
        )
        tTR_rC = cute.make_rmem_tensor(tTR_rAcc.shape, self.c_dtype)
        tiled_copy_r2s, tRS_rC, tRS_sC = epilogue_smem_copy_and_partition(
            self, tiled_copy_t2r, tTR_rC, tidx, sC
        )
        tCgC_epi = cute.flat_divide(tCgC_transformed, epi_tile)
        bSG_sC, bSG_gC_all = cpasync.tma_partition(
            tma_atom_c, 0, cute.make_layout(1),
            cute.group_modes(sC, 0, 2), cute.group_modes(tCgC_epi, 0, 2),
        )
        subtile_store = SubtileStore(self.c_dtype, tiled_copy_r2s, tRS_rC, tRS_sC, tma_atom_c,
                                     self.epi_stage, store_pipeline, epi_bar)
        return subtile_store, tiled_copy_t2r, tTR_tAcc_base, tTR_rAcc, bSG_sC, bSG_gC_all

    @cute.jit
    def unit_stored(self, wgrad_ptrs, expert, mma_m, k_tiles):
        """Whether this CTA stores its MMA tile `mma_m` of the unit."""
        cfg = self.cfg
        store = True
        if cutlass.const_expr(cfg.accumulate):
            store = k_tiles > 0  # adding zeros changes nothing
        if cutlass.const_expr(cfg.output_mode == "discrete"):
            store = store and output_ptr_ok(wgrad_ptrs, expert)
        if cutlass.const_expr(self.mmas_per_cluster_m > 1):
            # Rows past the output: with a single MMA tile along M that tile mode has one
            # element and the index would alias the first tile (stored, or added, twice).
            store = store and mma_m < self.mma_tiles_m
        return store

    @cute.jit
    def store_tile(
        self, subtile_store, tTR_tAcc_base, acc_pipeline, acc_state, k_tiles, tiled_copy_t2r,
        tTR_rAcc, bSG_sC, bSG_gC, desc_c, warp_idx, n_done, alpha,
    ):
        """The unit's accumulator from TMEM (TmemAccumulator: times `alpha` unless None) to
        the output, sub-tile by sub-tile (epilogue.SubtileStore; the stores issued by the
        first epilogue warp)."""
        acc_buf = self.acc_buffer(acc_state, False)
        tTR_tAcc = tTR_tAcc_base[(None, None, None, None, None, acc_buf)]
        tTR_tAcc = cute.group_modes(tTR_tAcc, 3, cute.rank(tTR_tAcc))
        bSG_gC = cute.group_modes(bSG_gC, 1, cute.rank(bSG_gC))
        subtiles = cute.size(tTR_tAcc.shape, mode=[3])
        accumulator = TmemAccumulator(
            tiled_copy_t2r, tTR_tAcc, tTR_rAcc, subtile_store.tiled_copy_r2s, bSG_gC, acc_buf,
            subtiles, k_tiles, alpha, acc_pipeline, acc_state,
            self.acc_release_subtile if self.overlapping_accum else None,
        )
        subtile_store.store_tile(accumulator, bSG_sC, subtiles, False, n_done * subtiles, 0,
                                 desc_c, warp_idx == WarpRole.EPILOGUE)


class TmemAccumulator(LoopInvariant):
    """The epilogue's view of a unit's accumulator in TMEM (epilogue.SubtileStore): sub-tile
    i is read by tcgen05.ld (`tiled_copy_t2r`, `tTR_tAcc` (..., sub-tile)) into `tTR_rAcc`
    and multiplied by `alpha` (None: 1); an empty unit (k_tiles 0) stores zeros.

    Overlapping accumulator buffers (`release_subtile` not None: block-scaled, tile_n = 256;
    see acc_fragment there): buffer 0's sub-tiles go last to first, buffer 1's first to
    last, so the columns the two buffers share come first; once those are in registers
    (after sub-tile `release_subtile`) this thread releases the stage and the MMA warp may
    start the next unit in the other buffer while the rest of this one is stored. The staging
    buffer follows the issue order, so consecutive stores never share one."""

    def __init__(self, tiled_copy_t2r, tTR_tAcc, tTR_rAcc, tiled_copy_r2s, bSG_gC, acc_buf,
                 subtiles, k_tiles, alpha, acc_pipeline, acc_state, release_subtile):
        self.tiled_copy_t2r, self.tTR_tAcc, self.tTR_rAcc = tiled_copy_t2r, tTR_tAcc, tTR_rAcc
        self.tiled_copy_r2s, self.bSG_gC, self.acc_buf = tiled_copy_r2s, bSG_gC, acc_buf
        self.subtiles, self.k_tiles, self.alpha = subtiles, k_tiles, alpha
        self.acc_pipeline, self.acc_state = acc_pipeline, acc_state
        self.release_subtile = release_subtile

    @cute.jit
    def load(self, sub):
        overlapping = self.release_subtile is not None
        real = sub
        if cutlass.const_expr(overlapping):
            if self.acc_buf == 0:
                real = self.subtiles - 1 - sub
        acc_vec = cute.zeros_like(self.tiled_copy_r2s.retile(self.tTR_rAcc))
        if self.k_tiles > 0:
            cute.copy(self.tiled_copy_t2r, self.tTR_tAcc[(None, None, None, real)], self.tTR_rAcc)
            if cutlass.const_expr(overlapping):
                if sub == self.release_subtile:
                    # This thread's TMEM loads of the shared columns are complete.
                    cute.arch.fence_view_async_tmem_load()
                    self.acc_pipeline.consumer_release(self.acc_state)
            acc_vec = self.tiled_copy_r2s.retile(self.tTR_rAcc).load()
            if cutlass.const_expr(self.alpha is not None):
                acc_vec = acc_vec * self.alpha
        return acc_vec, real

    @cute.jit
    def target(self, position):
        return self.bSG_gC[(None, position)]
