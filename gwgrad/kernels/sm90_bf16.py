"""Hopper (SM90) grouped weight-gradient GEMM: W[e] = A[:, tokens_e] @ B[tokens_e, :].

Decomposition: units of (expert, m-tile, n-tile), longest expert first, only for experts with
tokens (kernels/scheduler.py). The prep work (kernels/prep.py: ranges, order, descriptors,
offsets check) runs inside this kernel by default, each CTA going on once every expert is
prepared (prep.prep_handoff, no grid barrier); spec.launches=2 (JAX, whose workspace is not
zeroed) runs the prep kernel first. What is this module's: the WGMMA mainloop, the warp
groups' roles and hand-offs, the CTA pairs' multicast and the zero fill of empty experts.

Warp roles (384 threads, one persistent CTA per SM):
  warp 0       tma_loads(): takes units (scheduler.DynamicUnits or BalancedUnits, through the
               ClusterMailbox on a pair), publishes each to the consumer groups (the unit
               ring: publish_unit / take_unit) and loads its A (cta_m x tile_k) and B (cta_n x
               tile_k) K-blocks through the expert's descriptors (zero-fill past its last
               token), decoding the next unit and acquiring its descriptors one unit ahead.
  warps 1-3    zero_empty_experts(): TMA bulk copies of a shared line of zeros to the empty
               experts' outputs (nothing when accumulating). Group 0 keeps 40 registers.
  groups 1-2   consumer() (232 registers): per unit, unit_mainloop() (WGMMA into FP32
               registers), then store_unit() (RegisterAccumulator through the shared
               epilogue.SubtileStore: stmatrix into (64|128) x epi_tile_n sub-tiles, each
               TMA-stored or reduce-added as soon as it is staged). cooperative: both groups
               on a unit, half its rows each; with epi_buffer_sets=2 (coop_split) each stores
               its own 64 rows, the groups taking turns (EPI_ORDER), so one group's epilogue
               overlaps the other's mainloop. pingpong: each group owns every other unit and
               hands the tensor cores over (MMA_ORDER) once its last WGMMA batch is issued;
               the staging buffers are one set taken in turn (EPI_ORDER) or a set per group.
Pipelines: ab (TMA -> WGMMA, transaction mbarriers), unit (unit ids, TMA warp -> consumers),
the epilogue's TMA store groups; a pair adds the leader's unit mailbox.

Invariants: every thread reads the offsets verdict first and on invalid offsets the CTA exits
before any barrier init, load or store; a pair's CTAs walk the same units (a CTA whose part
lies past the output computes it and stores nothing); a unit's stage count is its expert's
K tiles, the same in the TMA warp and both groups.

Tiles: cooperative 128x256 and 256x128 (64 or 128 accumulators a thread per 64-row half);
pingpong 128x192 and 192x128 (192 accumulators: MAX_ACC_REGS; a group's 192 rows are three
m64 WGMMA atoms and three rows of 64-row epilogue sub-tiles), 128x128, 64x256, 64x128.

Verified on an H200: tests/test_sm90_kernel_gpu.py (TestSm90, TestSm90TwoLaunches,
TestSm90PairSharingA / B, TestSm90Tile192, TestSm90Tile192x128: every mode per cluster shape;
test_pingpong_ and test_cooperative_epilogue_buffer_set_per_group, test_single_launch_*,
test_balanced_schedule, test_zero_fill_*), tests/test_status_gpu.py (invalid offsets write
nothing), tests/test_api_gpu.py and the adapters' GPU tests. Not yet under the fuzz
(tests/test_fuzz_gpu.py), the sanitizer or the soak runs: coop_split, 192x128. PTX and cubin
checks (sm_90a, no GPU): tests/test_compile_sm90.py; structure: tests/test_kernel_structure.py.
"""

# No `from __future__ import annotations`: the shared-storage struct built in launch() needs
# its annotations evaluated.

import enum
from typing import Optional, Tuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from .config import (DESC_A, DESC_B, DESC_C, STATUS_INT32, LoopInvariant, ProblemConfig,
                     Workspace, ceil_div, dense_output_view, expert_output_view, gemm_views)
from .entry import GroupedWgradKernel
from .epilogue import SubtileStore
from .prep import acquire_descriptor, output_ptr_ok, tma_desc_ptr_for_copy, token_origin
from .scheduler import (BalancedUnits, ClusterMailbox, DynamicUnits, decode_unit, publish_words,
                        take_words, unit_tile_coords)
from .tiling import (SM90_CLUSTERS, SM90_FP8_CLUSTERS, SCHEDULE_BALANCED,
                     epi_buffer_sets_problem, unit_schedule_problem)

SMEM_CAPACITY = cutlass.memory.get_smem_capacity_in_bytes("sm_90")  # 227 KiB per CTA
UNIT_STAGES = 4  # the unit ring: units the TMA warp publishes ahead of the consumer groups
SMEM_RESERVED = 2048  # mbarriers, the unit ring, alignment
MAX_AB_STAGE = 8
#: FP32 accumulators a consumer thread may hold: 192 of its 232 registers (pingpong 128x192 and
#: 192x128), the rest the mainloop's and the epilogue's; ptxas spills nothing there
#: (tests/test_compile_sm90.py checks the cubins' local frames).
MAX_ACC_REGS = 192


WARP_SIZE = 32
WARP_GROUP_THREADS = 128


class WarpRole(enum.IntEnum):
    """Warps with a role of their own (warp index in the CTA)."""

    TMA = 0  # warp group 0's first warp: takes units, publishes them, issues the TMA loads
    ZERO = 1  # warp group 0's other warps (1-3): zero the empty experts' outputs
    MMA = 4  # first warp of the consumer warp groups (1-2: WGMMA + epilogue); the first warp
    #          of each consumer group issues its TMA stores


class Barrier(enum.IntEnum):
    """Named barrier ids (0 is __syncthreads); pingpong uses id + consumer group (0 or 1)."""

    EPI = 1  # the epilogue's threads: both consumer groups (cooperative), or one (1, 2)
    MMA_ORDER = 3  # pingpong: the tensor cores pass from one group to the other (3, 4)
    EPI_ORDER = 5  # pingpong: the epilogue staging buffers pass likewise (5, 6)
    ZERO = 7  # the three zero warps: the zero line written


# The zero fill's source (zero_empty_experts): a line of zeros in shared memory that the TMA
# unit copies to the empty experts' outputs, ZERO_LINE bytes per bulk copy, at most
# ZERO_IN_FLIGHT copies per issuing thread not yet read.
ZERO_LINE = 512
ZERO_IN_FLIGHT = 8


def bulk_store_from_shared(gaddr: Int64, saddr: Int32, size: Int32, *, loc=None,
                           ip=None) -> None:
    """``size`` bytes (a multiple of 16) from shared address ``saddr`` to global ``gaddr``
    (both 16-byte aligned) by the TMA unit, in the calling thread's current bulk group
    (``cp.async.bulk.global.shared::cta.bulk_group``). The DSL's ``cpasync.CopyBulkS2GOp``
    issues the same instruction through a copy atom of a static size; the zero fill's last
    line of an expert is shorter, so it would need a second atom and tensors around raw
    addresses."""
    llvm.inline_asm(None, [Int64(gaddr).ir_value(loc=loc, ip=ip),
                           Int32(saddr).ir_value(loc=loc, ip=ip),
                           Int32(size).ir_value(loc=loc, ip=ip)],
                    "cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], $2;", "l,r,r",
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def store_shared_zeros_16b(saddr: Int32, *, loc=None, ip=None) -> None:
    """16 zero bytes at shared address ``saddr`` (16-byte aligned)."""
    llvm.inline_asm(None, [Int32(saddr).ir_value(loc=loc, ip=ip)],
                    "st.shared.v4.b32 [$0], {0, 0, 0, 0};", "r",
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)



class Sm90GroupedWgrad(GroupedWgradKernel):
    """One compiled kernel per ProblemConfig; entry points in GemmEntryPoints."""

    def __init__(self, cfg: ProblemConfig):
        reason = self.can_implement(cfg)
        if reason is not None:
            raise ValueError(f"{reason[0]}: {reason[1]}")
        self.cfg = cfg
        self.pingpong = cfg.schedule == "pingpong"
        self.acc_dtype = cutlass.Float32
        self.ab_dtype = cfg.cutlass_ab_dtype
        self.c_dtype = cfg.cutlass_c_dtype
        # A unit is the cluster's tile; each CTA computes its (cta_m x cta_n) part. A 1x2
        # cluster multicasts A (both CTAs' tiles share its rows), a 2x1 cluster B.
        self.cluster_mn = (cfg.cluster_m, cfg.cluster_n)
        self.cluster_size = cfg.cluster_m * cfg.cluster_n
        self.cta_m, self.cta_n = cfg.tile_m // cfg.cluster_m, cfg.tile_n // cfg.cluster_n
        #: CTA tiles covering one expert's output (m, n): a cluster's CTA past them stores
        #: nothing.
        self.cta_tiles = (ceil_div(cfg.hidden, self.cta_m), ceil_div(cfg.intermediate, self.cta_n))
        self.num_mcast_a, self.num_mcast_b = cfg.cluster_n, cfg.cluster_m
        self.tile_shape_mnk = (self.cta_m, self.cta_n, cfg.tile_k)
        self.num_threads = 3 * WARP_GROUP_THREADS  # a producer group, two consumer groups
        self.num_mma_threads = 2 * WARP_GROUP_THREADS
        self.load_regs = 40
        self.mma_regs = 232

    # ------------------------------------------------------------------------------------
    # what a config can run (pure host code, no tracing)
    # ------------------------------------------------------------------------------------
    @staticmethod
    def scale_stage_bytes(cfg: ProblemConfig) -> int:
        """Bytes of scales one pipeline stage holds: none here; the scaled kernel's hook
        (kernels/sm90_fp8.py)."""
        return 0

    @classmethod
    def stage_bytes(cls, cfg: ProblemConfig) -> int:
        """Bytes one A/B pipeline stage of a CTA holds (the scaled kernel's scales included);
        with a cluster, a CTA's tile is the unit tile over the cluster shape, and its stage
        receives the whole CTA tile (its own multicast slice and its peer's)."""
        ab = cfg.tile_k * (cfg.tile_m // cfg.cluster_m * cfg.cutlass_ab_dtype.width
                           + cfg.tile_n // cfg.cluster_n * cfg.cutlass_b_dtype.width) // 8
        return ab + cls.scale_stage_bytes(cfg)

    @classmethod
    def epilogue_plan(cls, cfg: ProblemConfig) -> Tuple[Tuple[int, int], int, int]:
        """(epi_tile, epi_stage, ab_stage) of a config.

        Epilogue sub-tile: 128 rows cooperative, 64 pingpong or with a set per consumer
        group; columns cfg.epi_tile_n, or by default 64 for 16-bit outputs (half the barrier
        rounds of 32) and 32 for FP32, so that the staging buffers leave four A/B stages.
        epi_stage buffers per set, cfg.epi_buffer_sets sets (2 gives each consumer group its
        own; cooperative: two buffers each, so that the cooperative 128x256 tile keeps four
        A/B stages). The A/B ring takes what shared memory the epilogue buffers leave."""
        c_width = cfg.cutlass_c_dtype.width
        cta_m, cta_n = cfg.tile_m // cfg.cluster_m, cfg.tile_n // cfg.cluster_n
        epi_n = min(cfg.epi_tile_n or (64 if c_width == 16 else 32), cta_n)
        per_group = cfg.schedule == "pingpong" or cfg.epi_buffer_sets == 2
        epi_m = min(64 if per_group else 128, cta_m)
        epi_stage = 4 if c_width == 16 else 2
        if cfg.schedule != "pingpong" and cfg.epi_buffer_sets == 2:
            epi_stage = 2
        ab_bytes = cls.stage_bytes(cfg)
        c_bytes = epi_m * epi_n * c_width // 8
        epi_bytes = cfg.epi_buffer_sets * epi_stage * c_bytes
        ab_stage = (SMEM_CAPACITY - SMEM_RESERVED - epi_bytes) // ab_bytes
        return (epi_m, epi_n), epi_stage, min(ab_stage, MAX_AB_STAGE)

    @classmethod
    def can_implement(cls, cfg: ProblemConfig) -> Optional[Tuple[str, str]]:
        """(argument, detail) of the first reason this kernel cannot run `cfg`, or None."""
        pingpong = cfg.schedule == "pingpong"
        cluster = (cfg.cluster_m, cfg.cluster_n)
        clusters = SM90_FP8_CLUSTERS if cfg.scale_recipe else SM90_CLUSTERS
        if cluster not in clusters:
            return ("cluster_shape_mn",
                    f"the SM90 kernel runs {', '.join(map(str, clusters))} clusters, got "
                    f"{cluster}")
        cta_m, cta_n = cfg.tile_m // cfg.cluster_m, cfg.tile_n // cfg.cluster_n
        # Each consumer warp group's accumulator must fit its registers.
        acc_per_thread = cta_m * cta_n // (128 if pingpong else 256)
        if acc_per_thread > MAX_ACC_REGS:
            return ("mma_tiler_mn",
                    f"{cta_m}x{cta_n} needs {acc_per_thread} accumulator registers per "
                    f"thread with the {cfg.schedule} schedule; at most {MAX_ACC_REGS} fit")
        # Rows of a CTA tile: a pingpong group's m64 WGMMA atoms (1, 2 or 3), or the two
        # cooperative groups' halves.
        rows = (64, 128, 192) if pingpong else (128, 256)
        if cta_m not in rows or cta_n not in (64, 128, 192, 256):
            return ("mma_tiler_mn",
                    f"{cfg.schedule} tiles are {'|'.join(map(str, rows))} x 64..256, got "
                    f"{cta_m}x{cta_n}")
        problem = (epi_buffer_sets_problem(cfg.epi_buffer_sets, cfg.schedule, cta_m)
                   or unit_schedule_problem(cfg.unit_schedule, bool(cfg.scale_recipe)))
        if problem is not None:
            return problem
        epi_tile, _, ab_stage = cls.epilogue_plan(cfg)
        if cfg.epi_tile_n and (cfg.epi_tile_n % 32 or cta_n % epi_tile[1]):
            return ("epi_tile_n",
                    f"expected a multiple of 32 that divides the tile's {cta_n} columns "
                    f"(or 0: the default), got {cfg.epi_tile_n}")
        if ab_stage < 2:
            return ("mma_tiler_mn",
                    f"{cta_m}x{cta_n} leaves < 2 pipeline stages in shared memory")
        return None

    # ------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------
    def _setup(self):
        """Tiled MMA, shared-memory layouts, stage counts (traced in launch())."""
        cfg = self.cfg
        a_layout = LayoutEnum.ROW_MAJOR if cfg.a_major == "k" else LayoutEnum.COL_MAJOR
        b_layout = LayoutEnum.ROW_MAJOR if cfg.b_major == "k" else LayoutEnum.COL_MAJOR
        self.a_layout, self.b_layout = a_layout, b_layout
        self.c_layout = LayoutEnum.ROW_MAJOR
        self.tiled_mma = self.make_tiled_mma()
        self.epi_tile, self.epi_stage, self.ab_stage = self.epilogue_plan(cfg)

        self.a_smem_layout_staged = sm90_utils.make_smem_layout_a(
            a_layout, self.tile_shape_mnk, self.ab_dtype, self.ab_stage
        )
        self.b_smem_layout_staged = sm90_utils.make_smem_layout_b(
            b_layout, self.tile_shape_mnk, cfg.cutlass_b_dtype, self.ab_stage
        )
        # epi_stage buffers per set; with a set per consumer group, group g uses set g.
        self.epi_split = cfg.epi_buffer_sets == 2
        # Cooperative groups with a set each store their own 64 rows of the tile, in turn
        # (consumer(): the staggered epilogue).
        self.coop_split = self.epi_split and not self.pingpong
        self.epi_smem_layout_staged = sm90_utils.make_smem_layout_epi(
            self.c_dtype, self.c_layout, self.epi_tile, self.epi_stage * cfg.epi_buffer_sets
        )
        self.tma_bytes = self.stage_bytes(cfg)  # one stage's TMA transaction (scales included)

    def make_tiled_mma(self, groups=None, n=None):
        """The WGMMA tiling: one warp group per 64 rows (two side by side, cooperative).
        ``groups=1``: one warp group's tiling whatever the schedule (the staggered
        cooperative epilogue partitions a group's 64 rows with it: a cooperative thread's
        accumulator fragment is that of its thread in one group over those rows)."""
        groups = groups or (1 if self.pingpong else 2)
        return sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.cfg.cutlass_b_dtype,
            self.a_layout.sm90_mma_major_mode(),
            self.b_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            (groups, 1, 1),
            tiler_mn=(64, n or self.cta_n),
        )

    def launch(self, a_ptr, b_ptr, offsets_ptr, c_ptr, workspace_ptr, status_ptr, tokens_sum,
               grid_size, stream, scales=None, sf_capacity=None):
        """Launch prep + GEMM on `stream` (traced inside the entry points of GemmEntryPoints).
        `c_ptr` is the dense output, or in discrete mode the int64 array of per-expert output
        addresses. `scales`: block-scaled kernels' (sfa, sfb, gsa, gsb, sf_capacity)
        (ScaledEntryPoints; kernels/sm90_fp8.py), None for BF16. `sf_capacity` without
        `scales`: the capacity the prep kernel checks for cfg.checked_scales (two launches;
        the two-pass MXFP8 path, kernels/sm90_mxfp8_bf16.py)."""
        cfg = self.cfg
        self._setup()
        mA, mB = gemm_views(cfg, a_ptr, b_ptr, tokens_sum)
        offsets = cute.make_tensor(offsets_ptr, cute.make_layout(cfg.num_experts))
        a_smem_layout = cute.slice_(self.a_smem_layout_staged, (None, None, 0))
        b_smem_layout = cute.slice_(self.b_smem_layout_staged, (None, None, 0))
        epi_smem_layout = cute.slice_(self.epi_smem_layout_staged, (None, None, 0))
        (tma_atom_a, tma_tensor_a), (tma_atom_b, tma_tensor_b) = self.load_atoms(
            mA, mB, a_smem_layout, b_smem_layout
        )
        if cutlass.const_expr(cfg.output_mode == "dense"):
            mC = dense_output_view(cfg, c_ptr)
            wgrad_ptrs = cute.make_tensor(
                cute.recast_ptr(workspace_ptr, dtype=Int64), cute.make_layout(1)
            )
        else:
            # The host-side atom only fixes types and coordinates; its own descriptor (over
            # the workspace) is never used: every store goes through an expert's descriptor.
            mC = expert_output_view(cfg, cute.recast_ptr(workspace_ptr, dtype=self.c_dtype))
            wgrad_ptrs = cute.make_tensor(
                cute.recast_ptr(c_ptr, dtype=Int64), cute.make_layout(cfg.num_experts)
            )
        tma_atom_c, tma_tensor_c = cpasync.make_tiled_tma_atom(
            self.c_store_op(), mC, epi_smem_layout, self.epi_tile
        )

        scale_sources = None
        if cutlass.const_expr(scales is not None):
            scale_sources = self.scale_sources(scales)
            sf_capacity = scales[4]
        single = cfg.launches == 1  # the prep work inside this kernel (BF16 only)
        if cutlass.const_expr(not single):
            self.launch_prep(
                mA, mB, offsets, tokens_sum, wgrad_ptrs, workspace_ptr, status_ptr,
                self.tiled_mma, a_smem_layout, b_smem_layout, epi_smem_layout, stream,
                sf_capacity,
            )
        self.shared_storage = self.storage_type()
        # The output's base for the zero fill of empty experts (dense mode; in discrete mode
        # their addresses come from wgrad_ptrs).
        c_out = wgrad_ptrs
        if cutlass.const_expr(cfg.output_mode == "dense"):
            c_out = cute.make_tensor(c_ptr, cute.make_layout(1))
        args = (
            tma_atom_a, tma_tensor_a, tma_atom_b, tma_tensor_b, tma_atom_c, tma_tensor_c,
            wgrad_ptrs, c_out, workspace_ptr, self.tiled_mma,
            self.a_smem_layout_staged, self.b_smem_layout_staged, self.epi_smem_layout_staged,
        )
        if cutlass.const_expr(scales is None):
            status = cute.make_tensor(
                cute.recast_ptr(status_ptr, dtype=Int32), cute.make_layout(STATUS_INT32)
            )
            kernel = self.kernel(*args, mA, mB, offsets, tokens_sum, status)
        else:
            kernel = self.kernel_scaled(*args, *scale_sources)
        kernel.launch(
            grid=(grid_size, 1, 1),  # whole clusters (backends' grid_size)
            block=(self.num_threads, 1, 1),
            cluster=(self.cluster_size, 1, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    def load_atoms(self, a, b, a_smem_layout, b_smem_layout):
        """The TMA load atoms (and TMA tensors) of A and B over `a` / `b` (the call's views,
        or one expert's in the prep kernel: the same boxes). The operand a CTA pair shares
        is multicast: each CTA of the pair loads one slice of it for both."""
        def atom(x, smem_layout, rows, mcast):
            op = (cpasync.CopyBulkTensorTileG2SMulticastOp() if mcast > 1
                  else cpasync.CopyBulkTensorTileG2SOp())
            kwargs = {"num_multicast": mcast} if mcast > 1 else {}
            return cpasync.make_tiled_tma_atom(op, x, smem_layout, (rows, self.cfg.tile_k),
                                               **kwargs)

        return (atom(a, a_smem_layout, self.cta_m, self.num_mcast_a),
                atom(b, b_smem_layout, self.cta_n, self.num_mcast_b))

    def storage_type(self):
        """The kernel's shared-memory struct."""

        @cute.struct
        class SharedStorage:
            ab_mbar: cute.struct.MemRange[Int64, self.ab_stage * 2]
            unit_mbar: cute.struct.MemRange[Int64, UNIT_STAGES * 2]
            unit_slots: cute.struct.MemRange[Int32, UNIT_STAGES * 4]  # 16 B: 3 words used
            # The zero fill's source line (in the padding before sA's 1024-byte alignment).
            zero_line: cute.struct.Align[cute.struct.MemRange[Int32, ZERO_LINE // 4], 128]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_smem_layout_staged)], 1024
            ]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_smem_layout_staged)], 1024
            ]
            sC: cute.struct.Align[
                cute.struct.MemRange[self.c_dtype, cute.cosize(self.epi_smem_layout_staged)], 1024
            ]

        if cutlass.const_expr(self.cluster_size == 1):
            return SharedStorage

        @cute.struct
        class ClusterStorage:
            gemm: SharedStorage
            # The unit mailbox (scheduler.ClusterMailbox): full barriers (the peers'), empty
            # barriers (the leader's), one 16-byte slot per stage.
            mbox_mbar: cute.struct.MemRange[Int64, ClusterMailbox.STAGES * 2]
            mbox_slots: cute.struct.Align[
                cute.struct.MemRange[Int32, ClusterMailbox.STAGES * 4], 16
            ]

        return ClusterStorage

    # ------------------------------------------------------------------------------------
    # prep kernel hooks (the kernel itself is prep.PrepWork.prep_kernel)
    # ------------------------------------------------------------------------------------
    @cute.jit
    def expert_load_atoms(self, a_e, b_e, tiled_mma, a_smem_layout, b_smem_layout):
        (atom_a, _), (atom_b, _) = self.load_atoms(a_e, b_e, a_smem_layout, b_smem_layout)
        return atom_a, atom_b

    # ------------------------------------------------------------------------------------
    # GEMM kernel
    # ------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
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
        mA: cute.Tensor,
        mB: cute.Tensor,
        offsets: cute.Tensor,
        tokens_sum: Int32,
        status: cute.Tensor,
    ):
        ws = Workspace(self.cfg, workspace_ptr)
        if cutlass.const_expr(self.cfg.launches == 1):
            # The prep kernel's work, by this grid's warps, up to the hand-off.
            self.prep_in_kernel(
                mA, mB, offsets, tokens_sum, wgrad_ptrs, workspace_ptr, status, tiled_mma,
                cute.slice_(a_smem_layout_staged, (None, None, 0)),
                cute.slice_(b_smem_layout_staged, (None, None, 0)),
                cute.slice_(epi_smem_layout_staged, (None, None, 0)),
                self.epi_tile, Int32(0), self.num_threads // 32,
            )
        # The offsets verdict (of the prep kernel, which ran before this kernel on the stream,
        # or of this grid's prep work, complete after the hand-off). Every thread reads it
        # before touching shared memory, barriers or the output: with invalid offsets the
        # whole CTA exits at once, so no store and no half-initialized pipeline.
        if ws.verdict[0] != 0:
            self.gemm_cta(
                tma_atom_a, mA_coord, tma_atom_b, mB_coord, tma_atom_c, mC_coord, wgrad_ptrs,
                c_out, ws,
                tiled_mma, a_smem_layout_staged, b_smem_layout_staged, epi_smem_layout_staged,
                None,
            )

    @cute.jit
    def gemm_cta(
        self, tma_atom_a, mA_coord, tma_atom_b, mB_coord, tma_atom_c, mC_coord, wgrad_ptrs,
        c_out, ws,
        tiled_mma, a_smem_layout_staged, b_smem_layout_staged, epi_smem_layout_staged, scales,
    ):
        """One CTA's whole work (valid offsets only). `scales`: None for BF16; the scaled
        kernel's scale sources (kernels/sm90_fp8.py), handed to its hooks."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warp_group_idx = cute.arch.make_warp_uniform(tidx // WARP_GROUP_THREADS)

        smem = SmemAllocator()
        all_storage = smem.allocate(self.shared_storage)
        storage = self.gemm_storage(all_storage)
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_mbar.data_ptr(),
            num_stages=self.ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # One arrive per consumer warp that reads a stage, in every CTA whose producer
            # writes into it: the CTA itself, and its pair peer (the shared operand's other
            # slice, multicast).
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, (4 if self.pingpong else 8) * self.cluster_size,
            ),
            tx_count=self.tma_bytes,
            cta_layout_vmnk=self.cluster_layout_vmnk(),
            defer_sync=True,
        )
        unit_pipeline = pipeline.PipelineAsync.create(
            barrier_storage=storage.unit_mbar.data_ptr(),
            num_stages=UNIT_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads),
            defer_sync=True,
        )
        unit_slots = cute.make_tensor(
            storage.unit_slots.data_ptr(), cute.make_layout((4, UNIT_STAGES))
        )
        mailbox = self.mailbox(all_storage)
        if cutlass.const_expr(mailbox is not None):
            # Published to the cluster by the cluster barrier below.
            mailbox.init_barriers(warp_idx == 0 and tidx == 0)
        pipeline_init_arrive(cluster_shape_mn=self.cluster_mn, is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_layout_staged.outer, swizzle=a_smem_layout_staged.inner)
        sB = storage.sB.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner)
        sC = storage.sC.get_tensor(
            epi_smem_layout_staged.outer, swizzle=epi_smem_layout_staged.inner
        )
        smem_scales = self.scale_buffers(all_storage)
        pipeline_init_wait(cluster_shape_mn=self.cluster_mn)

        if warp_group_idx == 0:
            cute.arch.setmaxregister_decrease(self.load_regs)
            if warp_idx == WarpRole.TMA:
                self.tma_loads(
                    tma_atom_a, mA_coord, tma_atom_b, mB_coord, sA, sB,
                    ab_pipeline, unit_pipeline, unit_slots, ws, scales, smem_scales, mailbox,
                )
            elif cutlass.const_expr(not self.cfg.accumulate):
                self.zero_empty_experts(ws, c_out, wgrad_ptrs, tidx - WARP_SIZE,
                                        storage.zero_line.data_ptr())
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self.consumer(
                tiled_mma, tma_atom_c, mC_coord, wgrad_ptrs, sA, sB, sC,
                ab_pipeline, unit_pipeline, unit_slots, ws, tidx, warp_idx, warp_group_idx - 1,
                scales, smem_scales,
            )

    def cluster_layout_vmnk(self):
        """The cluster as (v, m, n, k) CTAs: (1, cluster_m, cluster_n, 1)."""
        return cute.make_layout((1, *self.cluster_mn, 1))

    @cute.jit
    def cluster_coord(self):
        """(this CTA's (v, m, n, k) coordinate in its cluster, the cluster's index, the number
        of clusters); None, block index, grid size without a cluster."""
        if cutlass.const_expr(self.cluster_size == 1):
            return None, Int32(cute.arch.block_idx()[0]), Int32(cute.arch.grid_dim()[0])
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        coord = self.cluster_layout_vmnk().get_flat_coord(rank)
        return (coord, Int32(cute.arch.block_idx()[0]) // self.cluster_size,
                Int32(cute.arch.grid_dim()[0]) // self.cluster_size)

    @cute.jit
    def cta_tile(self, coord, tile_m, tile_n):
        """The CTA's (m, n) tile of the unit tile (tile_m, tile_n) (unit tiles count cluster
        tiles; the CTA takes its cluster coordinate's part)."""
        if cutlass.const_expr(self.cluster_size == 1):
            return tile_m, tile_n
        return (tile_m * self.cluster_mn[0] + coord[1], tile_n * self.cluster_mn[1] + coord[2])

    # Hooks of the scaled kernel (kernels/sm90_fp8.py); BF16 has no scales.
    def gemm_storage(self, storage):
        """This kernel's fields of the shared storage (the scaled kernel and clusters nest
        them)."""
        if cutlass.const_expr(self.cluster_size > 1):
            return storage.gemm
        return storage

    def mailbox(self, storage):
        """Clusters: the unit mailbox (scheduler.ClusterMailbox) in `storage`; else None."""
        if cutlass.const_expr(self.cluster_size == 1):
            return None
        full = storage.mbox_mbar.data_ptr()
        return ClusterMailbox(full, full + ClusterMailbox.STAGES, storage.mbox_slots.data_ptr(),
                              self.cluster_size)

    def scale_buffers(self, storage):
        """The shared-memory scale buffers in `storage` (None: none)."""
        return None

    # ------------------------------------------------------------------------------------
    def unit_scheduler(self, ws, first, grid, mailbox):
        """The unit schedule of cfg.unit_schedule (kernels/scheduler.py), from unit `first`
        (this CTA's or cluster's index) among `grid` CTAs (clusters)."""
        if cutlass.const_expr(self.cfg.unit_schedule == SCHEDULE_BALANCED):
            return BalancedUnits(self.cfg, ws, first, grid, mailbox)
        return DynamicUnits(ws, first, grid, mailbox)

    @cute.jit
    def tma_loads(
        self, tma_atom_a, mA_coord, tma_atom_b, mB_coord, sA, sB,
        ab_pipeline, unit_pipeline, unit_slots, ws, scales, smem_scales, mailbox=None,
    ):
        """Warp TMA: takes units from the unit scheduler, publishes each to the consumer
        groups (the unit ring) and loads its A and B K-blocks (and scales) into the A/B ring;
        a cluster's CTAs walk the same units and multicast the shared operand."""
        cfg = self.cfg
        lane = cute.arch.lane_idx()
        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
        unit_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, UNIT_STAGES)
        coord, first, grid = self.cluster_coord()
        a_mask, b_mask = None, None
        a_part, b_part = (0, cute.make_layout(1)), (0, cute.make_layout(1))
        if cutlass.const_expr(self.cluster_size > 1):
            # A pair multicasts one operand: A along N (1x2), B along M (2x1).
            layout = self.cluster_layout_vmnk()
            if cutlass.const_expr(self.num_mcast_a > 1):
                a_mask = cpasync.create_tma_multicast_mask(layout, coord, mcast_mode=2)
                a_part = (coord[2], cute.make_layout(self.num_mcast_a))
            elif cutlass.const_expr(self.num_mcast_b > 1):
                b_mask = cpasync.create_tma_multicast_mask(layout, coord, mcast_mode=1)
                b_part = (coord[1], cute.make_layout(self.num_mcast_b))
        # Units are decoded one ahead: the next unit's counter atomic, its workspace reads and
        # its descriptors' acquire + prefetch overlap the current unit's loads, so the TMA
        # ring does not run dry at unit boundaries.
        expert, unit_m, unit_n, begin, k_tiles = decode_unit(
            cfg, cutlass.min(first, cfg.num_units - 1), ws
        )
        self.acquire_descriptors(ws, expert)
        # Only the experts with tokens get units (ranks 0 .. live-1); warps ZERO.. zero the
        # others' outputs (zero_empty_experts), or there is nothing to add when accumulating.
        live_units = ws.live[0] * cfg.tiles_per_expert
        units = self.unit_scheduler(ws, first, grid, mailbox)  # balanced: decided here
        unit, walk = units.first_unit()
        while unit < live_units:
            self.publish_unit(unit_pipeline, unit_state, unit_slots, unit, expert, k_tiles, lane)
            unit_state.advance()
            nxt, _, walk = units.next_unit(unit, walk, lane)
            n_expert, n_unit_m, n_unit_n, n_begin, n_k_tiles = decode_unit(
                cfg, cutlass.min(nxt, cfg.num_units - 1), ws
            )
            if n_expert != expert:
                self.acquire_descriptors(ws, n_expert)

            desc_a = tma_desc_ptr_for_copy(ws.desc_ptr(expert, DESC_A))
            desc_b = tma_desc_ptr_for_copy(ws.desc_ptr(expert, DESC_B))
            tAsA, tAgA = self.operand_tiles(tma_atom_a, mA_coord, sA, self.cta_m,
                                            token_origin(begin, cfg.a_ragged_block), a_part)
            tBsB, tBgB = self.operand_tiles(tma_atom_b, mB_coord, sB, self.cta_n,
                                            token_origin(begin, cfg.b_ragged_block), b_part)
            tile_m, tile_n = self.cta_tile(coord, unit_m, unit_n)
            unit_sf = None
            if cutlass.const_expr(scales is not None):
                unit_sf = self.unit_scale_origin(ws, expert, tile_m, tile_n)
            for kt in cutlass.range(k_tiles, unroll=1):
                ab_pipeline.producer_acquire(ab_state)
                bar = ab_pipeline.producer_get_barrier(ab_state)
                cute.copy(
                    tma_atom_a, tAgA[(None, tile_m, kt)], tAsA[(None, ab_state.index)],
                    tma_bar_ptr=bar, tma_desc_ptr=desc_a, mcast_mask=a_mask,
                )
                cute.copy(
                    tma_atom_b, tBgB[(None, tile_n, kt)], tBsB[(None, ab_state.index)],
                    tma_bar_ptr=bar, tma_desc_ptr=desc_b, mcast_mask=b_mask,
                )
                if cutlass.const_expr(scales is not None):
                    self.load_scales(scales, smem_scales, bar, ab_state.index, unit_sf, kt)
                ab_pipeline.producer_commit(ab_state)
                ab_state.advance()
            unit = nxt
            expert, unit_m, unit_n, begin, k_tiles = n_expert, n_unit_m, n_unit_n, n_begin, n_k_tiles
        # Tell the consumers there is no more work.
        self.publish_unit(unit_pipeline, unit_state, unit_slots, unit, Int32(-1), Int32(0), lane)
        ab_pipeline.producer_tail(ab_state)
        # Clusters: the leader stays until every peer has taken every unit it sent, as
        # producer_tail does for the stages.
        units.finish(walk, lane)

    @cute.jit
    def zero_empty_experts(self, ws, c_out, wgrad_ptrs, tid, zero_line):
        """Warps ZERO..ZERO+2 (``tid`` 0..95 among them): zero the outputs of the experts
        without tokens (ranks live .. E-1) with TMA bulk copies of a line of zeros in shared
        memory (``zero_line``, ZERO_LINE bytes), each expert's output split over the whole
        grid in lines (lane 0 of zero warp w of CTA b copies lines 3b + w + k * 3 * grid),
        at most ZERO_IN_FLIGHT copies in flight per warp. The units of those experts are
        never handed out, so no consumer spends an epilogue on them, and these copies
        overlap the other units' math. Discrete outputs whose address is null or misaligned
        are skipped, as in the epilogue."""
        cfg = self.cfg
        expert_bytes = cfg.hidden * cfg.intermediate * (cfg.cutlass_c_dtype.width // 8)
        lines = (expert_bytes + ZERO_LINE - 1) // ZERO_LINE
        line_addr = Int32(zero_line.toint())
        if tid < ZERO_LINE // 16:
            store_shared_zeros_16b(line_addr + tid * 16)
        # The line is written through the generic proxy and read by the TMA unit (async).
        cute.arch.fence_proxy("async.shared", space="cta")
        pipeline.NamedBarrier(int(Barrier.ZERO), 3 * WARP_SIZE).arrive_and_wait()
        if tid % WARP_SIZE == 0:
            first = Int32(cute.arch.block_idx()[0]) * 3 + tid // WARP_SIZE
            step = Int32(cute.arch.grid_dim()[0]) * 3
            for rank in range(ws.live[0], cfg.num_experts):
                expert = ws.order[rank]
                base = Int64(0)
                ok = True
                if cutlass.const_expr(cfg.output_mode == "dense"):
                    base = c_out.iterator.toint() + Int64(expert) * expert_bytes
                else:
                    ok = output_ptr_ok(wgrad_ptrs, expert)
                    base = wgrad_ptrs[expert]
                if ok:
                    for line in range(first, lines, step):
                        # 64-bit: an expert's output may pass 2 GiB.
                        offset = Int64(line) * ZERO_LINE
                        size = Int32(cutlass.min(Int64(ZERO_LINE), expert_bytes - offset))
                        bulk_store_from_shared(base + offset, line_addr, size)
                        cute.arch.cp_async_bulk_commit_group()
                        cute.arch.cp_async_bulk_wait_group(ZERO_IN_FLIGHT, read=True)
            # The line must stay until the TMA unit has read it for every copy.
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def operand_tiles(self, tma_atom, mX_coord, sX, rows: cutlass.Constexpr, k0, part):
        """TMA partitions of one operand's (rows x 64) K-blocks, from token coordinate k0.
        `part`: (this CTA's coordinate, layout) among the CTAs that multicast it ((0, 1):
        none)."""
        gX = cute.local_tile(
            cute.domain_offset((0, k0), mX_coord), (rows, self.cfg.tile_k), (None, None)
        )
        return cpasync.tma_partition(
            tma_atom, part[0], part[1],
            cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2),
        )

    @cute.jit
    def acquire_descriptors(self, ws, expert):
        """The prep kernel rewrote the expert's descriptors in place since any earlier launch
        that used this workspace: drop stale cached copies, then warm the descriptor cache."""
        for slot in cutlass.range_constexpr(2):
            acquire_descriptor(ws, expert, slot)

    @cute.jit
    def publish_unit(self, unit_pipeline, unit_state, unit_slots, unit, expert, k_tiles, lane):
        """A unit's words for the consumer groups: (unit, expert, k_tiles)."""
        publish_words(unit_pipeline, unit_state, unit_slots, (unit, expert, k_tiles), lane)

    @cute.jit
    def take_unit(self, unit_pipeline, unit_state, unit_slots):
        """Next published unit: (unit, expert, k_tiles); expert < 0 means no more work."""
        words, unit_state = take_words(unit_pipeline, unit_state, unit_slots, 3)
        return words[0], words[1], words[2], unit_state

    @cute.jit
    def skip(self, ab_read, ab_release, k_tiles):
        """Pingpong: step over the K blocks of the peer group's unit."""
        ab_read.advance(k_tiles)
        ab_release.advance(k_tiles)
        return ab_read, ab_release

    # ------------------------------------------------------------------------------------
    @cute.jit
    def consumer(
        self, tiled_mma, tma_atom_c, mC_coord, wgrad_ptrs, sA, sB, sC,
        ab_pipeline, unit_pipeline, unit_slots, ws, tidx, warp_idx, mma_group,
        scales, smem_scales,
    ):
        """Consumer warp group `mma_group` (0 or 1): per unit it takes, the mainloop into its
        registers, then the store of the tile (store_unit). cooperative: both groups on each
        unit; pingpong: every other unit each, the tensor cores (MMA_ORDER) and a shared set
        of staging buffers (EPI_ORDER) passed from group to group; coop_split: the groups'
        epilogues take turns (EPI_ORDER)."""
        cfg = self.cfg
        mma_tidx, epi_tidx, epi_bar, store_warp = self.consumer_threads(tidx, mma_group)
        thr_mma = tiled_mma.get_slice(mma_tidx)
        tile_mn = cute.slice_(self.tile_shape_mnk, (None, None, 0))

        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        split = None
        if cutlass.const_expr(scales is not None):
            split = self.split_operands(sA, sB, mma_tidx)
        acc_shape = thr_mma.partition_shape_C(tile_mn)
        acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
        subtile_store, tRS_rAcc, tRS_rSub = self.epilogue_setup(
            tiled_mma, tma_atom_c, sC, acc, epi_tidx, epi_bar
        )
        store_pipeline = subtile_store.store_pipeline

        if cutlass.const_expr(cfg.output_mode == "dense"):
            gC = cute.local_tile(mC_coord, (self.cta_m, self.cta_n, 1), (None, None, None))
        else:
            gC = cute.local_tile(mC_coord, tile_mn, (None, None))

        ab_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        ab_release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        unit_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, UNIT_STAGES)
        orders = self.group_orders(mma_group)
        mma_order_self, mma_order_peer, epi_order_self, epi_order_peer = orders
        is_store_warp = warp_idx == store_warp
        # Epilogue staging: one set both groups take in turn (EPI_ORDER, drained at each
        # hand-off), or a set per group (epi_split: no hand-off; the epilogues overlap).
        epi_base = 0
        if cutlass.const_expr(self.epi_split):
            epi_base = mma_group * self.epi_stage
        epi_ordered = self.pingpong and not self.epi_split
        # coop_split: the groups' epilogues take turns (EPI_ORDER, no drain: each has its own
        # buffers). At the first unit group 1 waits out group 0's epilogue, so group 0 starts
        # the next unit's mainloop that much ahead; from then on each group's epilogue runs
        # while the other group finishes (or starts) a mainloop: the tensor cores do not wait
        # for the epilogue, as with pingpong, at the cooperative tile's operand traffic. The
        # A/B stages a group is ahead by stay held until the other group releases them.
        epi_turns = epi_ordered or self.coop_split

        ab_read, ab_release, unit, expert, k_tiles, unit_state = self.first_group_unit(
            mma_group, orders, ab_read, ab_release, unit_pipeline, unit_state, unit_slots
        )

        coord, _, _ = self.cluster_coord()
        n_done = Int32(0)
        while expert >= 0:
            tile_m, tile_n = self.cta_tile(
                coord, *unit_tile_coords(cfg, unit % cfg.tiles_per_expert)
            )
            if cutlass.const_expr(self.pingpong):
                mma_order_self.arrive_and_wait()
            ab_read, ab_release = self.unit_mainloop(
                tiled_mma, thr_mma, acc, tCrA, tCrB, ab_pipeline, ab_read, ab_release, k_tiles,
                smem_scales, expert, tile_m, tile_n, mma_order_peer, scales, split,
            )
            if cutlass.const_expr(scales is not None):
                self.scale_output(acc, thr_mma, scales, ws, expert, tile_m, tile_n, k_tiles)

            store = self.unit_stored(wgrad_ptrs, expert, tile_m, tile_n, k_tiles)
            if cutlass.const_expr(epi_turns):
                epi_order_self.arrive_and_wait()
            n_done = self.store_unit(
                subtile_store, store, gC, ws, expert, tile_m, tile_n, mma_group, tRS_rAcc,
                tRS_rSub, sC, is_store_warp, n_done, epi_base,
            )
            if cutlass.const_expr(epi_ordered):
                # The peer group reuses the same staging buffers: let our stores drain first.
                if is_store_warp:
                    store_pipeline.producer_tail()
            if cutlass.const_expr(epi_turns):
                epi_order_peer.arrive()

            unit, expert, k_tiles, unit_state = self.take_unit(
                unit_pipeline, unit_state, unit_slots
            )
            if cutlass.const_expr(self.pingpong):
                # Skip the peer group's unit.
                ab_read, ab_release, unit, expert, k_tiles, unit_state = self.skip_peer_unit(
                    ab_read, ab_release, unit, expert, k_tiles, unit_pipeline, unit_state,
                    unit_slots,
                )

        if is_store_warp:
            store_pipeline.producer_tail()

    @cute.jit
    def consumer_threads(self, tidx, mma_group):
        """A consumer thread's (index in the tiled MMA, index in the epilogue's copy, the
        epilogue's barrier, the warp that issues its TMA stores). Each consumer group runs an
        epilogue of its own with pingpong, or cooperative with a set of staging buffers per
        group (coop_split: each stores its 64 rows); else both groups share one."""
        # Thread index inside the tiled MMA: both groups (cooperative) or one (pingpong).
        mma_tidx = tidx - WARP_GROUP_THREADS
        epi_bar = pipeline.NamedBarrier(
            barrier_id=int(Barrier.EPI), num_threads=self.num_mma_threads
        )
        store_warp = int(WarpRole.MMA)  # the first consumer warp issues the TMA stores
        if cutlass.const_expr(self.pingpong):
            mma_tidx = tidx % WARP_GROUP_THREADS
        epi_tidx = mma_tidx
        if cutlass.const_expr(self.pingpong or self.coop_split):
            epi_tidx = tidx % WARP_GROUP_THREADS
            epi_bar = pipeline.NamedBarrier(
                barrier_id=int(Barrier.EPI) + mma_group, num_threads=WARP_GROUP_THREADS
            )
            store_warp = int(WarpRole.MMA) + 4 * mma_group
        return mma_tidx, epi_tidx, epi_bar, store_warp

    @cute.jit
    def epilogue_setup(self, tiled_mma, tma_atom_c, sC, acc, epi_tidx, epi_bar):
        """The consumer's epilogue (register -> shared memory with stmatrix): (the
        SubtileStore, the accumulator retiled for its copy, one sub-tile's FP32 registers)."""
        per_group = self.pingpong or self.coop_split
        tiled_copy_r2s = self.epilogue_copy(tiled_mma)
        thr_copy_r2s = tiled_copy_r2s.get_slice(epi_tidx)
        tRS_sC = thr_copy_r2s.partition_D(sC)
        tRS_rAcc = tiled_copy_r2s.retile(acc)
        sub_shape = cute.shape(thr_copy_r2s.partition_S(sC))
        tRS_rSub = cute.make_rmem_tensor(sub_shape[:3], self.acc_dtype)  # one sub-tile, FP32
        tRS_rC = cute.make_rmem_tensor(sub_shape[:3], self.c_dtype)
        store_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stage,
            producer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, WARP_GROUP_THREADS if per_group else self.num_mma_threads
            ),
        )
        subtile_store = SubtileStore(self.c_dtype, tiled_copy_r2s, tRS_rC, tRS_sC, tma_atom_c,
                                     self.epi_stage, store_pipeline, epi_bar)
        return subtile_store, tRS_rAcc, tRS_rSub

    def epilogue_copy(self, tiled_mma):
        """The epilogue's register -> shared-memory copy (stmatrix) of the accumulator of
        ``tiled_mma`` (with coop_split, of one group's 64 rows). Retiled with it, a thread's
        accumulator holds sub-tile i (row-major over the tile's epi_tile sub-tiles) as its
        i-th run of values, what RegisterAccumulator reads (tests/test_compile_sm90.py checks
        it for each tile)."""
        copy_atom_r2s = sm90_utils.sm90_get_smem_store_op(
            self.c_layout, elem_ty_d=self.c_dtype, elem_ty_acc=self.acc_dtype
        )
        copy_atom_c = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4), self.c_dtype
        )
        epi_mma = self.make_tiled_mma(groups=1) if self.coop_split else tiled_mma
        tiled_copy_c_atom = cute.make_tiled_copy_C_atom(copy_atom_c, epi_mma)
        return cute.make_tiled_copy_S(copy_atom_r2s, tiled_copy_c_atom)

    def group_orders(self, mma_group):
        """Pingpong and coop_split hand-offs between the consumer groups, (MMA_ORDER, its
        peer's, EPI_ORDER, its peer's) of group `mma_group`: both groups meet at each (one
        arrives, one waits)."""
        both = self.num_mma_threads
        return (pipeline.NamedBarrier(int(Barrier.MMA_ORDER) + mma_group, both),
                pipeline.NamedBarrier(int(Barrier.MMA_ORDER) + 1 - mma_group, both),
                pipeline.NamedBarrier(int(Barrier.EPI_ORDER) + mma_group, both),
                pipeline.NamedBarrier(int(Barrier.EPI_ORDER) + 1 - mma_group, both))

    @cute.jit
    def first_group_unit(self, mma_group, orders, ab_read, ab_release, unit_pipeline,
                         unit_state, unit_slots):
        """A consumer group's first unit and the start signals of the hand-offs: coop_split,
        group 0 stores first; pingpong, group 0 takes the first unit and the first turns,
        group 1 the second unit (it skips the first one's stages)."""
        mma_order_self, _, epi_order_self, _ = orders
        unit, expert, k_tiles, unit_state = self.take_unit(
            unit_pipeline, unit_state, unit_slots
        )
        if cutlass.const_expr(self.coop_split):
            if mma_group == 0:
                epi_order_self.arrive()
        if cutlass.const_expr(self.pingpong):
            if mma_group == 0:
                mma_order_self.arrive()
                if cutlass.const_expr(not self.epi_split):
                    epi_order_self.arrive()
            else:
                ab_read, ab_release, unit, expert, k_tiles, unit_state = self.skip_peer_unit(
                    ab_read, ab_release, unit, expert, k_tiles, unit_pipeline, unit_state,
                    unit_slots,
                )
        return ab_read, ab_release, unit, expert, k_tiles, unit_state

    @cute.jit
    def skip_peer_unit(self, ab_read, ab_release, unit, expert, k_tiles, unit_pipeline,
                       unit_state, unit_slots):
        """Pingpong: unless the unit just taken ends the work (expert < 0), step over its K
        blocks (the peer group's unit) and take the next one."""
        if expert >= 0:
            ab_read, ab_release = self.skip(ab_read, ab_release, k_tiles)
            unit, expert, k_tiles, unit_state = self.take_unit(
                unit_pipeline, unit_state, unit_slots
            )
        return ab_read, ab_release, unit, expert, k_tiles, unit_state

    @cute.jit
    def unit_mainloop(self, tiled_mma, thr_mma, acc, tCrA, tCrB, ab_pipeline, ab_read,
                      ab_release, k_tiles, smem_scales, expert, tile_m, tile_n, mma_order_peer,
                      scales, split):
        """The unit's accumulator (BF16: mainloop; FP8: the scaled kernel's scaled_mainloop);
        pingpong: the tensor cores passed to the peer group once the last batch is issued."""
        if cutlass.const_expr(scales is None):
            ab_read, ab_release = self.mainloop(
                tiled_mma, acc, tCrA, tCrB, ab_pipeline, ab_read, ab_release, k_tiles
            )
            # Pingpong: the peer group may issue its first WGMMAs while this unit's last
            # batch is still in the tensor pipe (as CUTLASS's pingpong kernel does), so
            # the tensor cores do not drain at each hand-off; then wait for that batch.
            if cutlass.const_expr(self.pingpong):
                mma_order_peer.arrive()
            ab_release = self.mainloop_tail(ab_pipeline, ab_release, k_tiles)
        else:
            ab_read, ab_release = self.scaled_mainloop(
                tiled_mma, thr_mma, acc, tCrA, tCrB, ab_pipeline, ab_read, ab_release,
                k_tiles, smem_scales, expert, tile_m, tile_n, scales, split,
            )
            if cutlass.const_expr(self.pingpong):
                mma_order_peer.arrive()
        return ab_read, ab_release

    @cute.jit
    def unit_stored(self, wgrad_ptrs, expert, tile_m, tile_n, k_tiles):
        """Whether this CTA stores its tile (tile_m, tile_n) of the unit."""
        cfg = self.cfg
        store = True
        if cutlass.const_expr(cfg.accumulate):
            store = k_tiles > 0  # adding zeros changes nothing
        if cutlass.const_expr(self.cluster_size > 1):
            # A CTA whose part of the cluster's unit lies past the output stores nothing:
            # where the output has a single CTA tile along the pair, that tile mode has
            # one element and its coordinate does not move past the output (it aliases
            # the first tile: stored twice, or added twice when accumulating).
            store = store and tile_m < self.cta_tiles[0] and tile_n < self.cta_tiles[1]
        if cutlass.const_expr(cfg.output_mode == "discrete"):
            store = store and output_ptr_ok(wgrad_ptrs, expert)
        return store

    @cute.jit
    def store_unit(self, subtile_store, store, gC, ws, expert, tile_m, tile_n, mma_group,
                   tRS_rAcc, tRS_rSub, sC, is_store_warp, n_done, epi_base):
        """When `store`: this group's part of the tile to the dense output or the expert's
        (its descriptor acquired by the store warp). Returns the tiles stored so far."""
        if store:
            if cutlass.const_expr(self.cfg.output_mode == "dense"):
                gC_tile = self.group_rows(gC[(None, None, 0, tile_m, tile_n, expert)],
                                          mma_group)
                self.store_tile(subtile_store, gC_tile, None, tRS_rAcc, tRS_rSub, sC,
                                is_store_warp, n_done, epi_base)
            else:
                gC_tile = self.group_rows(gC[(None, None, tile_m, tile_n)], mma_group)
                if is_store_warp:
                    cpasync.fence_tma_desc_acquire(ws.desc_ptr(expert, DESC_C))
                desc_c = tma_desc_ptr_for_copy(ws.desc_ptr(expert, DESC_C))
                self.store_tile(subtile_store, gC_tile, desc_c, tRS_rAcc, tRS_rSub, sC,
                                is_store_warp, n_done, epi_base)
            n_done += 1
        return n_done

    def group_rows(self, gC_tile, mma_group):
        """The part of a CTA's output tile that a consumer group's epilogue stores: all of
        it, or with coop_split the group's 64 rows."""
        if cutlass.const_expr(self.coop_split):
            return cute.local_tile(gC_tile, (64, self.cta_n), (mma_group, 0))
        return gC_tile

    @cute.jit
    def mainloop(self, tiled_mma, acc, tCrA, tCrB, ab_pipeline, ab_read, ab_release, k_tiles):
        """acc = sum over the unit's K blocks; one WGMMA batch kept in flight. Returns with
        the last batch possibly still in flight: mainloop_tail waits for it."""
        num_k_blocks = cute.size(tCrA, mode=[2])
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.fence()
        for kt in cutlass.range(k_tiles, unroll=1):
            ab_pipeline.consumer_wait(ab_read)
            for kb in cutlass.range_constexpr(num_k_blocks):
                coord = (None, None, kb, ab_read.index)
                cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
            warpgroup.commit_group()
            ab_read.advance()
            if kt > 0:
                # The batch before this one is done reading its stage: hand it back.
                warpgroup.wait_group(1)
                ab_pipeline.consumer_release(ab_release)
                ab_release.advance()
        # Returned so that the caller's loop carries the advanced states: the DSL only threads
        # values rebound in the loop body itself, not attributes changed inside a helper.
        return ab_read, ab_release

    @cute.jit
    def mainloop_tail(self, ab_pipeline, ab_release, k_tiles):
        """After mainloop: wait for the unit's last WGMMA batch (acc complete) and hand its
        stage back."""
        warpgroup.wait_group(0)
        if k_tiles > 0:
            ab_pipeline.consumer_release(ab_release)
            ab_release.advance()
        return ab_release

    @cute.jit
    def store_tile(self, subtile_store, gC_tile, desc_c, tRS_rAcc, tRS_rSub, sC, is_store_warp,
                   n_done, epi_base):
        """Store the accumulator (`tRS_rAcc`, registers) to `gC_tile` through the staging
        buffers epi_base .. epi_base + epi_stage - 1 (epilogue.SubtileStore)."""
        gC_epi = cute.zipped_divide(gC_tile, self.epi_tile)
        bSG_sC, bSG_gC = cpasync.tma_partition(
            subtile_store.tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_epi
        )
        subtiles = cute.size(gC_epi, mode=[1])
        epi_shape = gC_epi.shape[1]
        epi_layout = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
        subtile_store.store_tile(
            RegisterAccumulator(tRS_rAcc, tRS_rSub, bSG_gC, epi_layout), bSG_sC, subtiles, True,
            n_done * subtiles, epi_base, desc_c, is_store_warp,
        )


class RegisterAccumulator(LoopInvariant):
    """The epilogue's view of a WGMMA accumulator (epilogue.SubtileStore): registers
    `tRS_rAcc` (retiled for the register -> shared copy), sub-tile i the i-th run of
    size(tRS_rSub) values, copied into `tRS_rSub`; sub-tile i of the output tile is
    `bSG_gC` at `epi_layout`'s i-th coordinate (row-major over the sub-tiles)."""

    def __init__(self, tRS_rAcc, tRS_rSub, bSG_gC, epi_layout):
        self.tRS_rAcc, self.tRS_rSub, self.bSG_gC, self.epi_layout = (
            tRS_rAcc, tRS_rSub, bSG_gC, epi_layout)

    @cute.jit
    def load(self, sub: cutlass.Constexpr):
        size = cute.size(self.tRS_rSub)
        for v in cutlass.range_constexpr(size):
            self.tRS_rSub[v] = self.tRS_rAcc[sub * size + v]
        return self.tRS_rSub.load(), sub

    @cute.jit
    def target(self, position: cutlass.Constexpr):
        return self.bSG_gC[(None, self.epi_layout.get_hier_coord(position))]
