"""Hopper (SM90) FP8 grouped weight-gradient GEMM with scales (gwgrad/scales.py's recipes).

Everything but the mainloop and the scales is the BF16 kernel's (kernels/sm90_bf16.py, which
this class extends through its hooks, its stage bytes through scale_stage_bytes): the unit
schedule (kernels/scheduler.py), the prep work (kernels/prep.py), the offsets verdict and
skip, the TMA warp, both consumer schedules and the epilogue (kernels/epilogue.py).

Operands: FP8 E4M3 / E5M2 (A and B may differ), both K-major (token-contiguous): Hopper's FP8
WGMMA reads K-major shared memory only. K blocks are 128 tokens (128-byte rows, 128B swizzle),
four WGMMA instructions of K=32 each.

Work split, warp roles, pipelines: those of the BF16 kernel (warp group 0: the TMA warp and
the zero warps; consumer warp groups 1-2, cooperative 128xN or pingpong 64xN tiles). The TMA
warp also loads each stage's scales with TMA on the stage's barrier (transaction bytes
include them):
  block_1x128: the m-tile's row of A scales and the n-tile's row of B scales for the stage's
               128 tokens (FP32; row sf_base[e] + k-block, sf_base from the prep kernel's
               prefix sum of ceil(count/128));
  blocked:     the 512-byte atoms of the blocked layout holding the tile's rows for the
               stage's four 32-token scale columns (one for A, one or two for B).
Consumers (2xAcc): each 128-token K block is accumulated by WGMMA into a temporary FP32
accumulator, then promoted into the main one on CUDA cores:
  per_expert_channel: acc += tmp (one FADD per element and K block); the channel scales
                      sfa[e, m] * sfb[e, n] (read from global memory while the unit's last
                      batch runs) multiply the result once, before the epilogue;
  block_1x128:        acc += tmp * (sfa[m] * sfb[n]) per K block;
  blocked (MXFP8):    every 32-token K=32 instruction is promoted with its own E8M0 scales
                      (decoded 2^(e-127); 0x00 = 2^-127, 0xFF = NaN).
Channel and 1x128: a K block's WGMMAs run as two commit groups over the tile's column halves
(m64 x n/2 instructions), each into its half of the temporary; a group waits for one half
while the other is in flight and promotes it, so its own next batch overlaps its promotion
(wait_group(1) twice per K block); a stage is released once both its halves are promoted.
MXFP8 waits for each instruction (wait_group(0)); the other group's WGMMAs fill the gap.
Global scales (per expert) multiply the accumulator before the epilogue. An empty expert
stores zeros (nothing when accumulating), whatever its scales hold.

Epilogue staging: one set shared by both groups, or (epi_buffer_sets=2) a set per consumer
group; on a cooperative 128-row tile each group then stores its own 64 rows in turn, the scales
applied to its accumulator first (the BF16 kernel's coop_split).

Clusters: the BF16 kernel's CTA pairs, (1, 2) multicasting A and (2, 1) B; a CTA's tile is the
unit tile over the cluster shape, and each CTA loads its own tile's scales (not multicast) on
its own stage barrier, whose transaction bytes count them (scale_stage_bytes).

Verified on an H200: tests/test_fp8_sm90_gpu.py (every recipe and mode, pingpong and
cooperative tiles, 1x1 and both pairs (test_recipe_modes_on_pairs, test_recipe_tilings_on_pairs),
mixed E4M3 / E5M2, special E8M0 codes, a staging set per cooperative group
(test_cooperative_epilogue_buffer_set_per_group); too-small scales and invalid offsets write
nothing).
PTX checks (sm_90a, no GPU): tests/test_compile_fp8_sm90.py.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import dsl_user_op

from ..kernels.tiling import SM90_FP8_TILES
from ..scales import ATOM_BYTES, ATOM_ROWS, BLOCK_1X128, BLOCKED, PER_EXPERT_CHANNEL
from .config import ProblemConfig, Workspace, ceil_div
from .entry import ScaledEntryPoints
from .prep import scale_columns
from .sm90_bf16 import Sm90GroupedWgrad

FP8_TILE_K = 128


def sf_atoms(rows: int) -> int:
    """Blocked-layout atoms (128 rows each) that one tile of `rows` rows can touch."""
    return max(ceil_div((k * rows) % ATOM_ROWS + rows, ATOM_ROWS) for k in range(ATOM_ROWS))


def cta_shape(cfg: ProblemConfig):
    """A CTA's (rows, columns): the unit tile over the cluster shape."""
    return cfg.tile_m // cfg.cluster_m, cfg.tile_n // cfg.cluster_n


def scale_stage_bytes(cfg: ProblemConfig) -> int:
    """Bytes of scales one pipeline stage of a CTA holds (each CTA of a cluster loads its
    own tile's scales; only the A/B operands are multicast)."""
    rows, cols = cta_shape(cfg)
    if cfg.scale_recipe == BLOCK_1X128:
        return 4 * (rows + cols)
    if cfg.scale_recipe == BLOCKED:
        return ATOM_BYTES * (sf_atoms(rows) + sf_atoms(cols))
    return 0


@dsl_user_op
def float_from_bits(bits: Int32, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.bitcast(Float32.mlir_type, Int32(bits).ir_value(loc=loc, ip=ip),
                                loc=loc, ip=ip))


@cute.jit
def e8m0_byte_value(word: Int32, byte: cutlass.Constexpr) -> Float32:
    """2^(code-127) for the E8M0 code in byte `byte` of `word`: the code shifted straight into
    FP32's exponent field (one shift and one mask), then the two codes that are no power of two
    there: 0x00 is 2^-127 (an FP32 denormal, 0x00400000) and 0xFF NaN (0x7FC00000), each the
    masked bits with bit 22 set."""
    shift = 23 - 8 * byte
    moved = word >> -shift if shift < 0 else word << shift
    bits = moved & 0x7F800000
    special = Int32(bits == 0) | Int32(bits == 0x7F800000)
    return float_from_bits(bits | (special << 22))


@cute.jit
def atom_word(row: Int32) -> Int32:
    """The int32 word of a blocked-layout atom holding row `row`'s four scale bytes."""
    return (row & 31) * 4 + ((row >> 5) & 3)


class Sm90ScaledGroupedWgrad(ScaledEntryPoints, Sm90GroupedWgrad):
    """The scaled kernel of one ProblemConfig (cfg.scale_recipe set)."""

    def __init__(self, cfg: ProblemConfig):
        super().__init__(cfg)
        self.recipe = cfg.scale_recipe

    scale_stage_bytes = staticmethod(scale_stage_bytes)

    @classmethod
    def can_implement(cls, cfg: ProblemConfig):
        if cfg.scale_recipe not in (BLOCKED, PER_EXPERT_CHANNEL, BLOCK_1X128):
            return ("scale_recipe", f"expected a scale recipe for FP8 inputs, got "
                                    f"{cfg.scale_recipe!r}")
        for name, dtype in (("a_tensor", cfg.ab_dtype), ("b_tensor", cfg.b_dtype or cfg.ab_dtype)):
            if dtype not in ("float8_e4m3fn", "float8_e5m2"):
                return (name, f"expected float8_e4m3fn or float8_e5m2 operands on SM90, got "
                              f"{dtype}")
        for name, major in (("a_tensor", cfg.a_major), ("b_tensor", cfg.b_major)):
            if major != "k":
                return (name, "expected a K-major (token-contiguous) FP8 operand: Hopper's FP8 "
                              "WGMMA reads K-major shared memory only (quantize x and dy "
                              "transposed, as (hidden, tokens) / (intermediate, tokens) rows)")
        if cfg.scale_recipe == BLOCKED and cfg.sf_vec != 32:
            return ("sf_vec_size", f"expected 32 (MXFP8) on SM90, got {cfg.sf_vec}")
        if cfg.tile_k != FP8_TILE_K:
            return ("mma_tiler_mn", f"FP8 K blocks are {FP8_TILE_K} tokens, got {cfg.tile_k}")
        schedule = SM90_FP8_TILES.get(cta_shape(cfg))
        if schedule is None or schedule != cfg.schedule:
            return ("mma_tiler_mn", f"expected one of {sorted(SM90_FP8_TILES)} for FP8 on SM90 "
                                    f"(two FP32 accumulators per thread), got "
                                    f"{cta_shape(cfg)}")
        return super().can_implement(cfg)

    # ------------------------------------------------------------------------------------
    # host side: the scale sources (traced in launch())
    # ------------------------------------------------------------------------------------
    def scale_sources(self, scales):
        """TMA atoms + coordinate tensors of the per-stage scale loads, and plain views of
        the scale tensors and global scales for the consumers."""
        cfg = self.cfg
        sfa_ptr, sfb_ptr, gsa_ptr, gsb_ptr, capacity = scales
        m, n, e = cfg.hidden, cfg.intermediate, cfg.num_experts
        if cutlass.const_expr(self.recipe == BLOCKED):
            # Atoms of 128 int32 words; (rows/128) * (columns/4) of them.
            quads = capacity // 4
            mSFA = cute.make_tensor(
                cute.recast_ptr(sfa_ptr, dtype=Int32),
                cute.make_layout((ATOM_ROWS, ceil_div(m, ATOM_ROWS) * quads), stride=(1, ATOM_ROWS)),
            )
            mSFB = cute.make_tensor(
                cute.recast_ptr(sfb_ptr, dtype=Int32),
                cute.make_layout((ATOM_ROWS, ceil_div(n, ATOM_ROWS) * quads), stride=(1, ATOM_ROWS)),
            )
            box_a, box_b = ATOM_ROWS, ATOM_ROWS
        elif cutlass.const_expr(self.recipe == BLOCK_1X128):
            mSFA = cute.make_tensor(cute.recast_ptr(sfa_ptr, dtype=Float32),
                                    cute.make_layout((m, capacity), stride=(1, m)))
            mSFB = cute.make_tensor(cute.recast_ptr(sfb_ptr, dtype=Float32),
                                    cute.make_layout((n, capacity), stride=(1, n)))
            box_a, box_b = self.cta_m, self.cta_n
        else:
            # per_expert_channel: the consumers read the scales directly; these atoms are
            # built (over the (E, rows) tensors) only to keep one kernel signature.
            mSFA = cute.make_tensor(cute.recast_ptr(sfa_ptr, dtype=Float32),
                                    cute.make_layout((m, e), stride=(1, m)))
            mSFB = cute.make_tensor(cute.recast_ptr(sfb_ptr, dtype=Float32),
                                    cute.make_layout((n, e), stride=(1, n)))
            box_a, box_b = self.cta_m, self.cta_n
        atom_sfa, tma_sfa = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mSFA, cute.make_layout((box_a, 1)), (box_a, 1)
        )
        atom_sfb, tma_sfb = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mSFB, cute.make_layout((box_b, 1)), (box_b, 1)
        )
        sfa = cute.make_tensor(cute.recast_ptr(sfa_ptr, dtype=Float32), cute.make_layout(e * m))
        sfb = cute.make_tensor(cute.recast_ptr(sfb_ptr, dtype=Float32), cute.make_layout(e * n))
        gsa = cute.make_tensor(cute.recast_ptr(gsa_ptr, dtype=Float32), cute.make_layout(e))
        gsb = cute.make_tensor(cute.recast_ptr(gsb_ptr, dtype=Float32), cute.make_layout(e))
        return atom_sfa, tma_sfa, atom_sfb, tma_sfb, sfa, sfb, gsa, gsb

    def storage_type(self):
        base = Sm90GroupedWgrad.storage_type(self)
        if self.recipe == PER_EXPERT_CHANNEL:
            return base
        words_a, words_b, dtype = self._scale_words()

        @cute.struct
        class ScaledStorage:
            gemm: base
            sSFA: cute.struct.Align[cute.struct.MemRange[dtype, words_a * self.ab_stage], 128]
            sSFB: cute.struct.Align[cute.struct.MemRange[dtype, words_b * self.ab_stage], 128]

        return ScaledStorage

    def _scale_words(self):
        if self.recipe == BLOCKED:
            return (ATOM_ROWS * sf_atoms(self.cta_m), ATOM_ROWS * sf_atoms(self.cta_n), Int32)
        return self.cta_m, self.cta_n, Float32

    # ------------------------------------------------------------------------------------
    # GEMM kernel
    # ------------------------------------------------------------------------------------
    @cute.kernel
    def kernel_scaled(
        self,
        tma_atom_a: cute.CopyAtom,
        mA_coord: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_coord: cute.Tensor,
        tma_atom_c: cute.CopyAtom,
        mC_coord: cute.Tensor,
        wgrad_ptrs: cute.Tensor,
        c_out: cute.Tensor,
        workspace_ptr: cute.Pointer,
        tiled_mma: cute.TiledMma,
        a_smem_layout_staged: cute.ComposedLayout,
        b_smem_layout_staged: cute.ComposedLayout,
        epi_smem_layout_staged: cute.ComposedLayout,
        atom_sfa: cute.CopyAtom,
        mSFA_coord: cute.Tensor,
        atom_sfb: cute.CopyAtom,
        mSFB_coord: cute.Tensor,
        sfa: cute.Tensor,
        sfb: cute.Tensor,
        gsa: cute.Tensor,
        gsb: cute.Tensor,
    ):
        ws = Workspace(self.cfg, workspace_ptr)
        # The offsets verdict, as in the BF16 kernel (module doc there).
        if ws.verdict[0] != 0:
            self.gemm_cta(
                tma_atom_a, mA_coord, tma_atom_b, mB_coord, tma_atom_c, mC_coord, wgrad_ptrs,
                c_out, ws,
                tiled_mma, a_smem_layout_staged, b_smem_layout_staged, epi_smem_layout_staged,
                (atom_sfa, mSFA_coord, atom_sfb, mSFB_coord, sfa, sfb, gsa, gsb),
            )

    def _base_storage(self, storage):
        """The BF16 kernel's struct (the scale buffers nest it; clusters nest it further)."""
        return storage if self.recipe == PER_EXPERT_CHANNEL else storage.gemm

    def gemm_storage(self, storage):
        """The BF16 kernel's pipeline and tile fields of the shared storage."""
        return Sm90GroupedWgrad.gemm_storage(self, self._base_storage(storage))

    def mailbox(self, storage):
        return Sm90GroupedWgrad.mailbox(self, self._base_storage(storage))

    def scale_buffers(self, storage):
        if cutlass.const_expr(self.recipe == PER_EXPERT_CHANNEL):
            return None
        words_a, words_b, _ = self._scale_words()
        stages = self.ab_stage
        if cutlass.const_expr(self.recipe == BLOCKED):
            atoms_a, atoms_b = words_a // ATOM_ROWS, words_b // ATOM_ROWS
            sSFA = storage.sSFA.get_tensor(cute.make_layout((ATOM_ROWS, 1, atoms_a * stages)))
            sSFB = storage.sSFB.get_tensor(cute.make_layout((ATOM_ROWS, 1, atoms_b * stages)))
        else:
            sSFA = storage.sSFA.get_tensor(cute.make_layout((words_a, 1, stages)))
            sSFB = storage.sSFB.get_tensor(cute.make_layout((words_b, 1, stages)))
        return sSFA, sSFB

    # -- TMA warp ------------------------------------------------------------------------
    @cute.jit
    def unit_scale_origin(self, ws, expert, tile_m, tile_n):
        """Per unit: where its scales start (the coordinates load_scales adds k-blocks to)."""
        cfg = self.cfg
        base = ws.sf_base[expert]
        origin = (base, tile_m, tile_n)  # block_1x128: row sf_base[e] + k-block of the tile
        if cutlass.const_expr(self.recipe == BLOCKED):
            count = ws.ranges[2 * expert + 1] - ws.ranges[2 * expert]
            quads = scale_columns(cfg, count) // 4  # atoms per 128-row block of this expert
            first = base // 4
            row_blocks_a = ceil_div(cfg.hidden, ATOM_ROWS)
            row_blocks_b = ceil_div(cfg.intermediate, ATOM_ROWS)
            a0 = row_blocks_a * first + (tile_m * self.cta_m) // ATOM_ROWS * quads
            nb0 = (tile_n * self.cta_n) // ATOM_ROWS
            b0 = row_blocks_b * first + nb0 * quads
            # A second B atom past the last row block repeats the last one (never used).
            b1 = row_blocks_b * first + cutlass.min(nb0 + 1, row_blocks_b - 1) * quads
            origin = (a0, b0, b1)
        return origin

    @cute.jit
    def load_scales(self, scales, smem_scales, bar, stage, unit_sf, kt):
        if cutlass.const_expr(self.recipe != PER_EXPERT_CHANNEL):
            cfg = self.cfg
            atom_sfa, mSFA, atom_sfb, mSFB = scales[0], scales[1], scales[2], scales[3]
            sSFA, sSFB = smem_scales
            box_a = cute.size(sSFA, mode=[0])
            box_b = cute.size(sSFB, mode=[0])
            tAs, tAg = cpasync.tma_partition(
                atom_sfa, 0, cute.make_layout(1), cute.group_modes(sSFA, 0, 2),
                cute.group_modes(cute.local_tile(mSFA, (box_a, 1), (None, None)), 0, 2),
            )
            tBs, tBg = cpasync.tma_partition(
                atom_sfb, 0, cute.make_layout(1), cute.group_modes(sSFB, 0, 2),
                cute.group_modes(cute.local_tile(mSFB, (box_b, 1), (None, None)), 0, 2),
            )
            if cutlass.const_expr(self.recipe == BLOCKED):
                atoms_a = sf_atoms(self.cta_m)
                atoms_b = sf_atoms(self.cta_n)
                a0, b0, b1 = unit_sf
                cute.copy(atom_sfa, tAg[(None, 0, a0 + kt)], tAs[(None, stage * atoms_a)],
                          tma_bar_ptr=bar)
                cute.copy(atom_sfb, tBg[(None, 0, b0 + kt)], tBs[(None, stage * atoms_b)],
                          tma_bar_ptr=bar)
                if cutlass.const_expr(atoms_b > 1):
                    cute.copy(atom_sfb, tBg[(None, 0, b1 + kt)],
                              tBs[(None, stage * atoms_b + 1)], tma_bar_ptr=bar)
            else:
                row, tile_m, tile_n = unit_sf
                cute.copy(atom_sfa, tAg[(None, tile_m, row + kt)], tAs[(None, stage)],
                          tma_bar_ptr=bar)
                cute.copy(atom_sfb, tBg[(None, tile_n, row + kt)], tBs[(None, stage)],
                          tma_bar_ptr=bar)

    # -- consumers -----------------------------------------------------------------------
    def split_operands(self, sA, sB, mma_tidx):
        """The channel and 1x128 recipes' WGMMA over half the tile's columns: (its tiled MMA,
        A fragment, B fragment (..., half, k-block, stage)); None for MXFP8."""
        if cutlass.const_expr(self.recipe == BLOCKED):
            return None
        half_n = self.cta_n // 2
        half_mma = self.make_tiled_mma(n=half_n)
        thr = half_mma.get_slice(mma_tidx)
        halves_b = cute.flat_divide(sB, (half_n, self.cfg.tile_k))
        return (half_mma, half_mma.make_fragment_A(thr.partition_A(sA)),
                [half_mma.make_fragment_B(thr.partition_B(halves_b[(None, None, h, 0, None)]))
                 for h in range(2)])

    @cute.jit
    def promote(self, acc, tmp, coords, smem_scales, stage, half: cutlass.Constexpr):
        """acc += tmp (times the stage's 1x128 scale products) over the accumulator values of
        column half `half` (values 0 .. n/2-1 of a thread hold the first half: a WGMMA
        fragment's values run over the columns last)."""
        count = cute.size(acc) // 2
        for j in cutlass.range_constexpr(count):
            i = half * count + j
            if cutlass.const_expr(self.recipe == BLOCK_1X128):
                sSFA, sSFB = smem_scales
                m, n = coords[i]
                acc[i] = acc[i] + tmp[i] * (sSFA[(m, 0, stage)] * sSFB[(n, 0, stage)])
            else:
                acc[i] = acc[i] + tmp[i]

    @cute.jit
    def scaled_mainloop(self, tiled_mma, thr_mma, acc, tCrA, tCrB, ab_pipeline, ab_read,
                        ab_release, k_tiles, smem_scales, expert, tile_m, tile_n, scales, split):
        """acc = the unit's sum, promoted from a temporary WGMMA accumulator (module doc).

        Channel and 1x128 scales: each K block's WGMMAs run as two batches over the halves of
        the tile's columns, each into its half of the temporary; a half is promoted while the
        other half's batch runs (one batch always in flight), and a stage is released once
        both its halves are promoted. MXFP8: every 32-token instruction is promoted with its
        own scales, after waiting for it (the other warp group's WGMMAs keep the tensor cores
        busy meanwhile)."""
        cfg = self.cfg
        num_k_blocks = cute.size(tCrA, mode=[2])
        tmp = cute.make_rmem_tensor(acc.layout, self.acc_dtype)
        coords = thr_mma.partition_C(cute.make_identity_tensor((self.cta_m, self.cta_n)))
        acc.fill(0.0)
        if cutlass.const_expr(self.recipe == BLOCKED):
            for kt in cutlass.range(k_tiles, unroll=1):
                ab_pipeline.consumer_wait(ab_read)
                stage = ab_read.index
                sSFA, sSFB = smem_scales
                atoms_a = sf_atoms(self.cta_m)
                atoms_b = sf_atoms(self.cta_n)
                row_a = (tile_m * self.cta_m) % ATOM_ROWS
                n0 = tile_n * self.cta_n
                nb0 = n0 // ATOM_ROWS
                # Each element's two scale words (the four 32-token columns of this stage),
                # read once per stage: the compiler merges the repeated rows and columns.
                words = []
                for i in cutlass.range_constexpr(cute.size(acc)):
                    m, n = coords[i]
                    nn = n0 + n
                    words.append((
                        sSFA[(atom_word(row_a + m), 0, stage * atoms_a)],
                        sSFB[(atom_word(nn % ATOM_ROWS), 0,
                              stage * atoms_b + nn // ATOM_ROWS - nb0)],
                    ))
                for kb in cutlass.range_constexpr(num_k_blocks):
                    warpgroup.fence()
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                    cute.gemm(tiled_mma, tmp, tCrA[(None, None, kb, stage)],
                              tCrB[(None, None, kb, stage)], tmp)
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        word_a, word_b = words[i]
                        scale = e8m0_byte_value(word_a, kb) * e8m0_byte_value(word_b, kb)
                        acc[i] = acc[i] + tmp[i] * scale
                # The stage's operands and scales are consumed: hand it back.
                ab_pipeline.consumer_release(ab_read)
                ab_read.advance()
                ab_release.advance()
        else:
            half_mma, hA, hB = split
            # The temporary's halves as the half-width MMA's fragments.
            half_shape = half_mma.get_slice(0).partition_shape_C((self.cta_m, self.cta_n // 2))
            count = cute.size(acc) // 2
            halves = [cute.make_tensor(tmp.iterator + h * count, cute.make_layout(half_shape))
                      for h in range(2)]
            prev = Int32(0)
            for kt in cutlass.range(k_tiles, unroll=1):
                ab_pipeline.consumer_wait(ab_read)
                stage = ab_read.index
                for half in cutlass.range_constexpr(2):
                    warpgroup.fence()
                    for kb in cutlass.range_constexpr(num_k_blocks):
                        half_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
                        cute.gemm(half_mma, halves[half], hA[(None, None, kb, stage)],
                                  hB[half][(None, None, kb, stage)], halves[half])
                    warpgroup.commit_group()
                    if cutlass.const_expr(half == 0):
                        # The previous stage's second half (its batch issued before this one).
                        if kt > 0:
                            warpgroup.wait_group(1)
                            self.promote(acc, tmp, coords, smem_scales, prev, 1)
                            ab_pipeline.consumer_release(ab_release)
                            ab_release.advance()
                    else:
                        warpgroup.wait_group(1)
                        self.promote(acc, tmp, coords, smem_scales, stage, 0)
                prev = stage
                ab_read.advance()
            if k_tiles > 0:
                factors = None
                if cutlass.const_expr(self.recipe == PER_EXPERT_CHANNEL):
                    # The channel scales are read while the last batch runs.
                    factors = self.channel_factors(coords, scales, expert, tile_m, tile_n)
                warpgroup.wait_group(0)
                self.promote(acc, tmp, coords, smem_scales, prev, 1)
                ab_pipeline.consumer_release(ab_release)
                ab_release.advance()
                if cutlass.const_expr(self.recipe == PER_EXPERT_CHANNEL):
                    rows, cols, alpha = factors
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        acc[i] = acc[i] * (rows[i] * cols[i] * alpha)
        return ab_read, ab_release

    @cute.jit
    def global_scale(self, scales, expert):
        alpha = Float32(1.0)
        if cutlass.const_expr(self.cfg.has_global_scale):
            gsa, gsb = scales[6], scales[7]
            alpha = gsa[expert] * gsb[expert]
        return alpha

    @cute.jit
    def channel_factors(self, coords, scales, expert, tile_m, tile_n):
        """Each accumulator value's row and column channel scales, and the global scale."""
        cfg = self.cfg
        sfa, sfb = scales[4], scales[5]
        m0 = expert * cfg.hidden
        n0 = expert * cfg.intermediate
        rows, cols = [], []
        for i in cutlass.range_constexpr(cute.size(coords)):
            m, n = coords[i]
            # Rows / columns past the output's edge are clipped by the store: read the last
            # channel's scale for them, never past the expert's row.
            rows.append(sfa[m0 + cutlass.min(tile_m * self.cta_m + m, cfg.hidden - 1)])
            cols.append(sfb[n0 + cutlass.min(tile_n * self.cta_n + n, cfg.intermediate - 1)])
        return rows, cols, self.global_scale(scales, expert)

    @cute.jit
    def scale_output(self, acc, thr_mma, scales, ws, expert, tile_m, tile_n, k_tiles):
        """Global scales, once per unit, for the 1x128 and MXFP8 recipes (the channel recipe's
        mainloop applies its scales and the global ones); an empty expert keeps zeros."""
        if cutlass.const_expr(self.cfg.has_global_scale and self.recipe != PER_EXPERT_CHANNEL):
            if k_tiles > 0:
                alpha = self.global_scale(scales, expert)
                for i in cutlass.range_constexpr(cute.size(acc)):
                    acc[i] = acc[i] * alpha
