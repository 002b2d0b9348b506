"""Blackwell (SM100 family) block-scaled grouped weight-gradient GEMM: MXFP8, NVFP4 and MXFP4.

    W[e] = alpha_e * sum over the expert's tokens t of (A[:, t] * SFA) (x) (B[t, :] * SFB)

with tcgen05's block-scaled MMA (kind::mxf8f6f4 for MXFP8, kind::mxf4nvf4 for NVFP4 and MXFP4,
`block_scale` with the scale factors in TMEM). alpha_e = global_scale_a[e] *
global_scale_b[e] when the spec has global scales (NVFP4), else 1.

Decomposition, warp roles, pipelines, schedule, epilogue and the skip on invalid offsets are
those of the SM100 BF16 kernel (kernels/sm100_bf16.py), which this class extends through its
hooks. Where it differs, after the CuTe DSL example dense_blockscaled_gemm_persistent.py:
  K blocks     4 MMA instructions: 128 tokens for FP8 (K=32 each), 256 for FP4 (K=64 each).
  prep kernel  also writes each expert's SFA and SFB descriptors (slots desc_sfa / desc_sfb):
               its chunk of the blocked 32x4x4 layout (gwgrad/scales.py) starts at
               round_up(rows, 128) * sf_base[e] bytes (sf_base: the prefix sum of the padded
               scale columns of the experts before it) and spans exactly its C_e columns: a
               load past them is zero-filled by TMA, never another expert's scales. Every
               slot is written in full, fields then zeros (prep.write_descriptor).
  TMA warp     per stage, with A and B: the m-tile's SFA and the n-tile's SFB atoms of the K
               block on the same transaction barrier, multicast as the example does (SFA like
               A; SFB over the cluster's M extent).
  MMA warp     per stage: tcgen05.cp (4x32x128b) of the stage's scale factors smem -> TMEM
               (columns after the accumulators), then one block-scaled MMA per K=inst_k step.
               A step whose first token is past the expert's last is not issued, so the last
               block's padding scale columns never reach an MMA; counts are multiples of 32
               (MXFP8) and 64 (FP4) (gwgrad/offsets.py), so every issued step lies wholly
               inside the expert. The token count comes in the unit words (a sixth word the
               scheduler warp decodes): the MMA warp reads no global memory per unit. Tests
               issue every step (cfg.every_mma_step) to see the per-expert TMA bounds alone.
  TMEM         512 columns (TmemPlan): two accumulator buffers, then the SFA and SFB columns
               of one K block. With tile_n = 256 two whole buffers leave no room for the
               scale factors, so the buffers overlap on the scale factors' column count, as in
               CUTLASS's dense_blockscaled_gemm_persistent.py and cuDNN frontend's wgrad
               kernel: buffer 0 at column 0, buffer 1 at 256 - sf_columns, the scale factors
               in the last sf_columns; one pipeline stage whose phase picks the buffer. The
               epilogue reads buffer 0 from its last sub-tile down (the shared columns first)
               and releases the stage once it holds the shared columns, so the next unit's
               MMAs run while the rest of the tile is stored.
  epilogue     multiplies the FP32 accumulator by alpha_e (loaded before the accumulator
               wait) before the cast or the reduce-add.

Compile-verified for sm_100a by tests/test_compile_sm100_blockscaled.py, in the `compile`
marker tier (left out of a plain `python -m pytest`; `-m compile` runs it): on the default
256x256 tile on (2, 1), every mode of the contract for MXFP8 (e4m3) and, K-major, for NVFP4
and MXFP4, and one for e5m2; every tile x cluster the
predicate accepts for MXFP8, NVFP4 and MXFP4 in one mode; 12 seeded points of the format x
mode x tiling x cluster product per run (the whole product is not compiled in CI); NVFP4
once for sm_103a. The PTX checks: the format's block-scaled tcgen05.mma kind and scale
vector, tcgen05.cp, cta_group::2 exactly for 256-row tiles, the 512-column allocation, the
reduce store exactly when accumulating, the CLC and unit-ring counts; on 256x256, 128x256 and
128x128 for each format, the scale factors' TMEM columns and the accumulator buffers against
TmemPlan and the stage's expect_tx bytes against the tile shapes. The fast tier compiles the
default MXFP8 configuration once (tests/test_compile_smoke.py). Never run on an SM100 GPU
(tests/test_sm100_blockscaled_gpu.py is written for it; docs/BLACKWELL.md gives the order).
The prep kernel's ranges, offsets check, scale-column prefix sum and capacity check are the
SM90 FP8 kernel's, run on the H200 by tests/test_fp8_sm90_gpu.py.
"""

# No `from __future__ import annotations`: the DSL reads kernel parameter annotations.

from dataclasses import dataclass
from typing import Optional, Tuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass import Float32, Int16, Int32, Int64
from cutlass.cute.nvgpu import cpasync, tcgen05

from ..scales import ATOM_ROWS, BLOCKED
from .config import ProblemConfig, Workspace
from .entry import ScaledEntryPoints
from .prep import scale_columns, tma_desc_ptr_for_copy, write_descriptor
from .sm100_bf16 import UNIT_WORDS, Sm100GroupedWgrad
from .tiling import sm100_blockscaled_problem
from .types import cutlass_type

TMEM_COLUMNS = 512  # all of an SM's tensor memory: accumulators + one K block's scale factors
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
FP4_DTYPE = "float4_e2m1fn_x2"
#: Tokens per K block (four MMA instructions) by operand family.
TILE_K = {"fp8": 128, "fp4": 256}
#: Scale dtype of each sf_vec_size: E4M3 with 16-token blocks (NVFP4), E8M0 with 32 (MX).
SF_DTYPES = {16: "float8_e4m3fn", 32: "float8_e8m0fnu"}
SF_ATOM_ROWS = 128  # rows of one tcgen05.cp (32x128b.warpx4): 4 columns of 4 scale bytes


@dataclass(frozen=True)
class TmemPlan:
    """Where the accumulator buffers and one K block's scale factors sit in the 512 TMEM
    columns (per CTA; a 2-CTA MMA's pair has the same plan in each CTA).

    Two accumulator buffers of tile_n columns, then the SFA and SFB columns. Where that does
    not fit (tile_n = 256) the two buffers overlap on `overlap` = sf_columns columns, as in
    CUTLASS's dense_blockscaled_gemm_persistent.py, grouped_blockscaled_gemm.py and cuDNN
    frontend's wgrad kernel: buffer 0 at column 0, buffer 1 at tile_n - sf_columns, the
    scale factors in the last sf_columns; one pipeline stage, the buffer picked by its phase
    (the MMA warp's producer phase ^ 1, the epilogue's consumer phase), and the epilogue
    releases the stage as soon as it has read the shared columns (TmemAccumulator)."""

    tile_n: int
    sf_columns: int  # SFA + SFB columns of one K block
    sfa_columns: int

    @property
    def overlapping(self) -> bool:
        return 2 * self.tile_n + self.sf_columns > TMEM_COLUMNS

    @property
    def acc_stages(self) -> int:
        """Accumulator pipeline stages (mbarrier pairs)."""
        return 1 if self.overlapping else 2

    @property
    def buffer_stride(self) -> int:
        """Columns from accumulator buffer 0 to buffer 1."""
        return self.tile_n - self.sf_columns if self.overlapping else self.tile_n

    @property
    def overlap(self) -> int:
        """Columns the two buffers share (the last of buffer 0, the first of buffer 1)."""
        return self.tile_n - self.buffer_stride

    @property
    def sf_base(self) -> int:
        """First scale-factor column: right after buffer 1."""
        return self.buffer_stride + self.tile_n

    def release_subtile(self, epi_tile_n: int) -> int:
        """The epilogue sub-tile after whose TMEM load the stage is released: the sub-tiles
        0..this, in the buffer's read order, cover the shared columns."""
        return self.overlap // epi_tile_n


def tmem_plan(mma_tiler_mn: Tuple[int, int], sf_vec: int, tile_k: int) -> TmemPlan:
    """The TMEM plan of a block-scaled tile (pure arithmetic; setup_scales checks it against
    the DSL's TMEM layouts). Per CTA: SFA covers its 128 rows, SFB the n-tile rounded up to
    128 (SFB's 1-CTA MMA); each 128 rows take tile_k / sf_vec columns (4 scale bytes a
    column per row group of a 32x128b.warpx4 copy)."""
    cta_m = mma_tiler_mn[0] // (2 if mma_tiler_mn[0] == 256 else 1)
    sfb_n = -(-mma_tiler_mn[1] // SF_ATOM_ROWS) * SF_ATOM_ROWS
    per_rows = tile_k // sf_vec
    sfa = cta_m // SF_ATOM_ROWS * per_rows
    sfb = sfb_n // SF_ATOM_ROWS * per_rows
    return TmemPlan(tile_n=mma_tiler_mn[1], sf_columns=sfa + sfb, sfa_columns=sfa)


def operand_family(dtype: str) -> str:
    return "fp4" if dtype == FP4_DTYPE else "fp8"


class Sm100BlockScaledGroupedWgrad(ScaledEntryPoints, Sm100GroupedWgrad):
    """One compiled kernel per ProblemConfig (scale_recipe "blocked", sf_descriptors set)."""

    #: The unit words carry the expert's token count (the MMA warp's step skip).
    unit_word_count = UNIT_WORDS + 1

    def __init__(self, cfg: ProblemConfig, mma_tiler_mn: Tuple[int, int]):
        super().__init__(cfg, mma_tiler_mn)  # runs can_implement (this class's)
        self.sf_vec = cfg.sf_vec
        self.sf_dtype = cutlass_type(cfg.sf_dtype)
        # Two accumulator buffers: separate stages where 2 x tile_n columns leave room for
        # the scale factors, else two overlapping buffers on one stage (TmemPlan).
        self.tmem_plan = tmem_plan(tuple(mma_tiler_mn), cfg.sf_vec, cfg.tile_k)
        self.acc_stage = self.tmem_plan.acc_stages
        self.overlapping_accum = self.tmem_plan.overlapping

    @staticmethod
    def can_implement(
        cfg: ProblemConfig, mma_tiler_mn: Tuple[int, int]
    ) -> Optional[Tuple[str, str]]:
        """(argument, detail) of the first reason this kernel cannot run `cfg`, or None."""
        if cfg.scale_recipe != BLOCKED:
            return ("scale_recipe", f"expected the blocked scale layout (MXFP8 / NVFP4 / MXFP4) "
                                    f"on SM100, got {cfg.scale_recipe!r}")
        a, b = cfg.ab_dtype, cfg.b_dtype or cfg.ab_dtype
        for name, dtype in (("a_tensor", a), ("b_tensor", b)):
            if dtype not in FP8_DTYPES + (FP4_DTYPE,):
                return (name, f"expected float8_e4m3fn, float8_e5m2 or float4_e2m1fn_x2, got "
                              f"{dtype}")
        if operand_family(a) != operand_family(b):
            return ("b_tensor", f"expected the same format family as a_tensor ({a}), got {b}")
        family = operand_family(a)
        if family == "fp8" and cfg.sf_vec != 32:
            return ("sf_vec_size", f"expected 32 for FP8 operands (MXFP8), got {cfg.sf_vec}")
        if family == "fp4" and cfg.sf_vec not in (16, 32):
            return ("sf_vec_size", f"expected 16 (NVFP4) or 32 (MXFP4) for FP4 operands, got "
                                   f"{cfg.sf_vec}")
        if cfg.sf_dtype != SF_DTYPES[cfg.sf_vec]:
            return ("sf_dtype", f"expected {SF_DTYPES[cfg.sf_vec]} scales with sf_vec_size "
                                f"{cfg.sf_vec}, got {cfg.sf_dtype or 'none'}")
        if family == "fp4":
            for name, major in (("a_tensor", cfg.a_major), ("b_tensor", cfg.b_major)):
                if major != "k":
                    return (name, "expected a K-major (token-contiguous) FP4 operand: packed "
                                  "E2M1 pairs lie along the token axis")
        if cfg.tile_k != TILE_K[family]:
            return ("mma_tiler_mn", f"internal: K blocks are {TILE_K[family]} tokens for "
                                    f"{family}, got {cfg.tile_k}")
        if not cfg.sf_descriptors:
            return ("sf_vec_size", "internal: the config must ask for scale descriptors")
        problem = sm100_blockscaled_problem(tuple(mma_tiler_mn), (cfg.cluster_m, cfg.cluster_n))
        if problem is not None:
            return problem
        return Sm100GroupedWgrad.can_implement(cfg, mma_tiler_mn)

    # ------------------------------------------------------------------------------------
    # host side: hooks of the SM100 base
    # ------------------------------------------------------------------------------------
    def make_tiled_mma(self, cta_group, mma_tiler_mn):
        return sm100_utils.make_blockscaled_trivial_tiled_mma(
            self.ab_dtype, self.b_dtype, self.a_major_mode, self.b_major_mode,
            self.sf_dtype, self.sf_vec, cta_group, mma_tiler_mn,
        )

    def _sfb_tiler_mn(self):
        """SFB's MMA shape: one CTA's rows, tile_n rounded up to 128 (the example's)."""
        return (self.mma_tiler_mn[0] // (2 if self.use_2cta_instrs else 1),
                cute.round_up(self.mma_tiler_mn[1], 128))

    def scale_stage_bytes(self, tiled_mma, stages: int) -> int:
        sfa = blockscaled_utils.make_smem_layout_sfa(tiled_mma, self.mma_tiler, self.sf_vec, stages)
        sfb = blockscaled_utils.make_smem_layout_sfb(tiled_mma, self.mma_tiler, self.sf_vec, stages)
        return cute.size_in_bytes(self.sf_dtype, sfa) + cute.size_in_bytes(self.sf_dtype, sfb)

    def setup_scales(self, tiled_mma) -> None:
        self.sfa_smem_layout_staged = blockscaled_utils.make_smem_layout_sfa(
            tiled_mma, self.mma_tiler, self.sf_vec, self.ab_stage
        )
        self.sfb_smem_layout_staged = blockscaled_utils.make_smem_layout_sfb(
            tiled_mma, self.mma_tiler, self.sf_vec, self.ab_stage
        )
        sfb_mn = self._sfb_tiler_mn()
        self.mma_tiler_sfb = (*sfb_mn, self.mma_tiler[2])
        # SFB's MMA is a 1-CTA one: every CTA of the cluster's M extent shares the n-tile.
        self.cluster_shape_sfb_vmnk = (1, self.cluster_shape_mn[0], self.cluster_shape_mn[1], 1)
        # The plan's scale-factor columns are the DSL's TMEM layouts' (what mma_block_state
        # builds), and the overlapping buffers' epilogue order works on whole columns.
        plan = self.tmem_plan
        sfa_cols = self._tmem_columns(blockscaled_utils.make_tmem_layout_sfa(
            tiled_mma, self.mma_tiler, self.sf_vec,
            cute.slice_(self.sfa_smem_layout_staged, (None, None, None, 0))))
        sfb_cols = self._tmem_columns(blockscaled_utils.make_tmem_layout_sfb(
            tiled_mma, self.mma_tiler, self.sf_vec,
            cute.slice_(self.sfb_smem_layout_staged, (None, None, None, 0))))
        if (sfa_cols, sfa_cols + sfb_cols) != (plan.sfa_columns, plan.sf_columns):
            raise ValueError(f"internal: TMEM scale columns {sfa_cols} + {sfb_cols}, the plan "
                             f"says {plan.sfa_columns} of {plan.sf_columns}")
        if plan.sf_base + plan.sf_columns > TMEM_COLUMNS:
            raise ValueError(f"internal: the TMEM plan {plan} needs more than 512 columns")
        epi_n = cute.size(self.epi_tile[1])
        self.acc_release_subtile = plan.release_subtile(epi_n)
        if plan.overlapping and (self.epi_tile[0] if isinstance(self.epi_tile[0], int)
                                 else cute.size(self.epi_tile[0])) != self.cta_tile_shape_mnk[0]:
            raise ValueError("internal: overlapping accumulators need epilogue sub-tiles of "
                             "whole TMEM columns")
        if plan.overlapping and self.acc_release_subtile >= plan.tile_n // epi_n:
            raise ValueError("internal: the shared accumulator columns span every sub-tile")

    def _tmem_columns(self, sf_layout) -> int:
        """TMEM columns of a scale-factor layout (find_tmem_tensor_col_offset's arithmetic:
        the 32-bit cosize's column half)."""
        return cute.cosize(cute.recast_layout(32, self.sf_dtype.width, sf_layout)) & 0xFFFF

    def acc_fragment(self, tiled_mma):
        """Two accumulator buffers; overlapping ones tile_n - sf_columns columns apart
        (TmemPlan)."""
        if not self.overlapping_accum:
            return super().acc_fragment(tiled_mma)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        fake = tiled_mma.make_fragment_C(cute.append(acc_shape, 2))
        column = fake.stride[0][1]
        return cute.make_tensor(fake.iterator, cute.make_layout(
            fake.shape, stride=(*fake.stride[:3], self.tmem_plan.buffer_stride * column)))

    def acc_buffer(self, acc_state, producer: bool):
        """Overlapping buffers share one pipeline stage: its phase picks the buffer (the
        producer state starts at phase 1, the consumer's at 0: both begin with buffer 0)."""
        if not self.overlapping_accum:
            return acc_state.index
        return acc_state.phase ^ 1 if producer else acc_state.phase

    def tmem_columns(self, tCtAcc_fake) -> int:
        return TMEM_COLUMNS

    def make_tiled_mma_sfb(self):
        return sm100_utils.make_blockscaled_trivial_tiled_mma(
            self.ab_dtype, self.b_dtype, self.a_major_mode, self.b_major_mode,
            self.sf_dtype, self.sf_vec, tcgen05.CtaGroup.ONE, self._sfb_tiler_mn(),
        )

    def _scale_load_ops(self, tiled_mma):
        sfa_op = sm100_utils.cluster_shape_to_tma_atom_A(self.cluster_shape_mn, tiled_mma.thr_id)
        sfb_op = sm100_utils.cluster_shape_to_tma_atom_SFB(self.cluster_shape_mn, tiled_mma.thr_id)
        return sfa_op, sfb_op

    def _blocked_view(self, ptr, rows: int, tokens):
        """A (rows, tokens) scale-factor tensor in the blocked layout (rows padded to 128)."""
        layout = blockscaled_utils.tile_atom_to_shape_SF(
            (cute.round_up(rows, ATOM_ROWS), tokens, 1), self.sf_vec
        )
        return cute.make_tensor(ptr, layout)

    def scale_sources(self, scales, tiled_mma):
        """(kernel arguments, prep-kernel arguments) of the scale factors and global scales.
        The TMA atoms built here give the kernel its types and coordinates only: every load
        uses an expert's descriptor from the workspace."""
        cfg = self.cfg
        sfa_ptr, sfb_ptr, gsa_ptr, gsb_ptr, capacity = scales
        # The whole tensors (capacity columns; at least one atom so the atoms are valid).
        tokens = cutlass.max(capacity, 4) * self.sf_vec
        mSFA = self._blocked_view(cute.recast_ptr(sfa_ptr, dtype=self.sf_dtype), cfg.hidden, tokens)
        mSFB = self._blocked_view(
            cute.recast_ptr(sfb_ptr, dtype=self.sf_dtype), cfg.intermediate, tokens
        )
        tiled_mma_sfb = self.make_tiled_mma_sfb()
        sfa_smem_layout = cute.slice_(self.sfa_smem_layout_staged, (None, None, None, 0))
        sfb_smem_layout = cute.slice_(self.sfb_smem_layout_staged, (None, None, None, 0))
        atom_sfa, tma_sfa, atom_sfb, tma_sfb = self.scale_atoms(
            mSFA, mSFB, tiled_mma, tiled_mma_sfb, sfa_smem_layout, sfb_smem_layout
        )
        gsa = cute.make_tensor(cute.recast_ptr(gsa_ptr, dtype=Float32),
                               cute.make_layout(cfg.num_experts))
        gsb = cute.make_tensor(cute.recast_ptr(gsb_ptr, dtype=Float32),
                               cute.make_layout(cfg.num_experts))
        sources = (tiled_mma_sfb, atom_sfa, tma_sfa, atom_sfb, tma_sfb,
                   self.sfa_smem_layout_staged, self.sfb_smem_layout_staged, gsa, gsb)
        views = (mSFA, mSFB, tiled_mma_sfb, sfa_smem_layout, sfb_smem_layout)
        return sources, views

    @cute.jit
    def scale_atoms(self, mSFA, mSFB, tiled_mma, tiled_mma_sfb, sfa_smem_layout,
                    sfb_smem_layout):
        """TMA load atoms (and coordinate tensors) of scale-factor tensors."""
        sfa_op, sfb_op = self._scale_load_ops(tiled_mma)
        atom_sfa, tma_sfa = cute.nvgpu.make_tiled_tma_atom_A(
            sfa_op, mSFA, sfa_smem_layout, self.mma_tiler, tiled_mma, self.cluster_shape_vmnk,
            internal_type=Int16,
        )
        atom_sfb, tma_sfb = cute.nvgpu.make_tiled_tma_atom_B(
            sfb_op, mSFB, sfb_smem_layout, self.mma_tiler_sfb, tiled_mma_sfb,
            self.cluster_shape_sfb_vmnk, internal_type=Int16,
        )
        return atom_sfa, tma_sfa, atom_sfb, tma_sfb

    # ------------------------------------------------------------------------------------
    # prep kernel: the common per-expert work, then the expert's scale descriptors
    # ------------------------------------------------------------------------------------
    @cute.kernel
    def prep_kernel_scaled(
        self,
        mA: cute.Tensor,
        mB: cute.Tensor,
        offsets: cute.Tensor,
        tokens_sum: Int32,
        wgrad_ptrs: cute.Tensor,
        workspace_ptr: cute.Pointer,
        status: cute.Tensor,
        tiled_mma: cute.TiledMma,
        a_smem_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
        epi_smem_layout: cute.ComposedLayout,
        epi_tile: cute.Tile,
        sf_capacity: Int32,
        mSFA: cute.Tensor,
        mSFB: cute.Tensor,
        tiled_mma_sfb: cute.TiledMma,
        sfa_smem_layout: cute.Layout,
        sfb_smem_layout: cute.Layout,
    ):
        cfg = self.cfg
        ws, expert, begin, end, columns_before = self.prep_body(
            mA, mB, offsets, tokens_sum, wgrad_ptrs, workspace_ptr, status, tiled_mma,
            a_smem_layout, b_smem_layout, epi_smem_layout, epi_tile, sf_capacity,
            cute.arch.block_idx()[0],
        )
        # The expert's chunk: its C_e columns (one atom for an empty expert, whose descriptor
        # is never used) at round_up(rows, 128) * sf_base[e] bytes.
        columns = cutlass.max(scale_columns(cfg, end - begin), 4)
        tokens = columns * self.sf_vec
        sfa_e = self._blocked_view(
            mSFA.iterator + Int64(cute.round_up(cfg.hidden, ATOM_ROWS)) * columns_before,
            cfg.hidden, tokens,
        )
        sfb_e = self._blocked_view(
            mSFB.iterator + Int64(cute.round_up(cfg.intermediate, ATOM_ROWS)) * columns_before,
            cfg.intermediate, tokens,
        )
        atom_sfa, _, atom_sfb, _ = self.scale_atoms(
            sfa_e, sfb_e, tiled_mma, tiled_mma_sfb, sfa_smem_layout, sfb_smem_layout
        )
        write_descriptor(atom_sfa, ws.desc_ptr(expert, cfg.desc_sfa))
        write_descriptor(atom_sfb, ws.desc_ptr(expert, cfg.desc_sfb))
        # Order the descriptor writes before the GEMM kernel's tensormap-proxy reads.
        cpasync.fence_tma_desc_release()

    # ------------------------------------------------------------------------------------
    # GEMM kernel
    # ------------------------------------------------------------------------------------
    @cute.kernel
    def kernel_scaled(
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
        tiled_mma_sfb: cute.TiledMma,
        tma_atom_sfa: cute.CopyAtom,
        mSFA_coord: cute.Tensor,
        tma_atom_sfb: cute.CopyAtom,
        mSFB_coord: cute.Tensor,
        sfa_smem_layout_staged: cute.Layout,
        sfb_smem_layout_staged: cute.Layout,
        gsa: cute.Tensor,
        gsb: cute.Tensor,
    ):
        ws = Workspace(self.cfg, workspace_ptr)
        # The offsets verdict, as in the BF16 kernel (module doc there).
        if ws.verdict[0] != 0:
            self.gemm_cta(
                tiled_mma, tma_atom_a, mA_coord, tma_atom_b, mB_coord, tma_atom_c, mC_coord,
                wgrad_ptrs, ws, cluster_layout_vmnk, a_smem_layout_staged, b_smem_layout_staged,
                epi_smem_layout_staged, epi_tile,
                (tiled_mma_sfb, tma_atom_sfa, mSFA_coord, tma_atom_sfb, mSFB_coord,
                 sfa_smem_layout_staged, sfb_smem_layout_staged, gsa, gsb),
            )

    @cute.jit
    def scale_buffers(self, smem, scales):
        """This CTA's staged SFA and SFB buffers in shared memory."""
        sSFA = smem.allocate_tensor(element_type=self.sf_dtype, layout=scales[5],
                                    byte_alignment=128)
        sSFB = smem.allocate_tensor(element_type=self.sf_dtype, layout=scales[6],
                                    byte_alignment=128)
        return sSFA, sSFB

    # -- TMA warp ------------------------------------------------------------------------
    @cute.jit
    def scale_load_partitions(
        self, scales, smem_scales, thr_mma, a_cta_layout, a_mcast_mask, mma_tile_coord_v,
        cta_rank_in_cluster, block_in_cluster_coord_vmnk,
    ):
        """The TMA partitions of the scale factors (chunk-local K coordinates, so built once)
        and their multicast masks."""
        tiled_mma_sfb, atom_sfa, mSFA, atom_sfb, mSFB = (
            scales[0], scales[1], scales[2], scales[3], scales[4]
        )
        sSFA, sSFB = smem_scales
        gSFA = cute.local_tile(
            mSFA, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None)
        )
        tAsSFA, tAgSFA = cpasync.tma_partition(
            atom_sfa, block_in_cluster_coord_vmnk[2], a_cta_layout,
            cute.group_modes(sSFA, 0, 3), cute.group_modes(thr_mma.partition_A(gSFA), 0, 3),
        )
        cluster_layout_sfb_vmnk = cute.tiled_divide(
            cute.make_layout((*self.cluster_shape_mn, 1)), (tiled_mma_sfb.thr_id.shape,)
        )
        coord_sfb_vmnk = cluster_layout_sfb_vmnk.get_flat_coord(cta_rank_in_cluster)
        thr_mma_sfb = tiled_mma_sfb.get_slice(mma_tile_coord_v)
        gSFB = cute.local_tile(
            mSFB, cute.slice_(self.mma_tiler_sfb, (0, None, None)), (None, None, None)
        )
        tBsSFB, tBgSFB = cpasync.tma_partition(
            atom_sfb, coord_sfb_vmnk[1],
            cute.make_layout(cute.slice_(cluster_layout_sfb_vmnk, (0, None, 0, 0)).shape),
            cute.group_modes(sSFB, 0, 3), cute.group_modes(thr_mma_sfb.partition_B(gSFB), 0, 3),
        )
        sfb_mcast_mask = None
        if cutlass.const_expr(self.is_a_mcast or self.is_b_mcast or self.use_2cta_instrs):
            sfb_mcast_mask = cpasync.create_tma_multicast_mask(
                cluster_layout_sfb_vmnk, coord_sfb_vmnk, mcast_mode=1
            )
        return (
            atom_sfa, cute.filter_zeros(tAsSFA), cute.filter_zeros(tAgSFA), a_mcast_mask,
            atom_sfb, cute.filter_zeros(tBsSFB), cute.filter_zeros(tBgSFB), sfb_mcast_mask,
        )

    @cute.jit
    def load_scales(self, sf_loads, ws, expert, mma_m, unit_n, handle):
        """One stage's SFA and SFB atoms, through the expert's scale descriptors, on the
        stage's barrier (its transaction bytes count them)."""
        cfg = self.cfg
        atom_sfa, tAsSFA, tAgSFA, sfa_mask, atom_sfb, tBsSFB, tBgSFB, sfb_mask = sf_loads
        desc_sfa = tma_desc_ptr_for_copy(ws.desc_ptr(expert, cfg.desc_sfa))
        desc_sfb = tma_desc_ptr_for_copy(ws.desc_ptr(expert, cfg.desc_sfb))
        cute.copy(
            atom_sfa, tAgSFA[(None, mma_m, handle.count, 0)], tAsSFA[(None, handle.index)],
            tma_bar_ptr=handle.barrier, tma_desc_ptr=desc_sfa, mcast_mask=sfa_mask,
        )
        cute.copy(
            atom_sfb, tBgSFB[(None, unit_n, handle.count, 0)], tBsSFB[(None, handle.index)],
            tma_bar_ptr=handle.barrier, tma_desc_ptr=desc_sfb, mcast_mask=sfb_mask,
        )

    # -- MMA warp ------------------------------------------------------------------------
    def s2t_copy_and_partition(self, sSF, tSF):
        """tcgen05.cp (4x32x128b) of scale factors: the tiled copy and its smem (as
        descriptors, per stage) and TMEM partitions."""
        sSF_compact = cute.filter_zeros(sSF)
        tSF_compact = cute.filter_zeros(tSF)
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(self.cta_group), self.sf_dtype)
        tiled_copy = tcgen05.make_s2t_copy(atom, tSF_compact)
        thr_copy = tiled_copy.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(tiled_copy, thr_copy.partition_S(sSF_compact))
        return tiled_copy, src, thr_copy.partition_D(tSF_compact)

    @cute.jit
    def mma_block_state(self, tiled_mma, tmem_ptr, tCtAcc_base, smem_scales):
        """The scale factors' TMEM tensors (after the accumulator columns) and their
        tcgen05.cp copies from the shared-memory stages."""
        sSFA, sSFB = smem_scales
        acc_cols = self.tmem_plan.sf_base  # after both accumulator buffers (TmemPlan)
        tCtSFA = cute.make_tensor(
            cute.recast_ptr(tmem_ptr + acc_cols, dtype=self.sf_dtype),
            blockscaled_utils.make_tmem_layout_sfa(
                tiled_mma, self.mma_tiler, self.sf_vec,
                cute.slice_(sSFA.layout, (None, None, None, 0)),
            ),
        )
        sfa_cols = tcgen05.find_tmem_tensor_col_offset(tCtSFA)
        tCtSFB = cute.make_tensor(
            cute.recast_ptr(tmem_ptr + acc_cols + sfa_cols, dtype=self.sf_dtype),
            blockscaled_utils.make_tmem_layout_sfb(
                tiled_mma, self.mma_tiler, self.sf_vec,
                cute.slice_(sSFB.layout, (None, None, None, 0)),
            ),
        )
        copy_sfa, tCsSFA_s2t, tCtSFA_s2t = self.s2t_copy_and_partition(sSFA, tCtSFA)
        copy_sfb, tCsSFB_s2t, tCtSFB_s2t = self.s2t_copy_and_partition(sSFB, tCtSFB)
        return (tCtSFA, tCtSFB, copy_sfa, tCsSFA_s2t, tCtSFA_s2t, copy_sfb, tCsSFB_s2t,
                tCtSFB_s2t)

    @cute.jit
    def unit_extra_words(self, ws, expert, begin):
        """The expert's token count, for the MMA warp's step skip (mma_block)."""
        return (ws.ranges[2 * expert + 1] - begin,)

    @cute.jit
    def mma_block(self, tiled_mma, tCtAcc, tCrA, tCrB, stage, k_tile, block_state, tokens):
        """One K block: its scale factors smem -> TMEM, then the block-scaled MMA of each
        K step that starts inside the expert (module doc)."""
        cfg = self.cfg
        (tCtSFA, tCtSFB, copy_sfa, tCsSFA_s2t, tCtSFA_s2t, copy_sfb, tCsSFB_s2t,
         tCtSFB_s2t) = block_state
        s2t_stage = (None, None, None, None, stage)
        cute.copy(copy_sfa, tCsSFA_s2t[s2t_stage], tCtSFA_s2t)
        cute.copy(copy_sfb, tCsSFB_s2t[s2t_stage], tCtSFB_s2t)
        num_steps = cute.size(tCrA, mode=[2])
        step_tokens = cfg.tile_k // num_steps
        first = k_tile * cfg.tile_k
        for step in cutlass.range_constexpr(num_steps):
            issue = first + step * step_tokens < tokens
            if cutlass.const_expr(cfg.every_mma_step):
                issue = True  # tests only (ProblemConfig.every_mma_step)
            if issue:
                tiled_mma.set(tcgen05.Field.ACCUMULATE, first + step > 0)
                tiled_mma.set(tcgen05.Field.SFA, tCtSFA[(None, None, step)].iterator)
                tiled_mma.set(tcgen05.Field.SFB, tCtSFB[(None, None, step)].iterator)
                crd = (None, None, step, stage)
                cute.gemm(tiled_mma, tCtAcc, tCrA[crd], tCrB[crd], tCtAcc)
        return tiled_mma

    # -- epilogue ------------------------------------------------------------------------
    @cute.jit
    def unit_alpha(self, scales, expert):
        """alpha_e = global_scale_a[e] * global_scale_b[e] (None without global scales)."""
        alpha = None
        if cutlass.const_expr(self.cfg.has_global_scale):
            gsa, gsb = scales[7], scales[8]
            alpha = gsa[expert] * gsb[expert]
        return alpha

