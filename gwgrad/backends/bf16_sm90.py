"""BF16 backend for Hopper (SM90): the WGMMA + TMA kernel of kernels/sm90_bf16.py."""

from __future__ import annotations

from ..kernels.tiling import (SCHEDULE_BALANCED, SCHEDULE_DYNAMIC, SM90_TILES,
                              epi_buffer_sets_problem, sm90_problem, sm90_schedule)
from ..spec import StaticSpec
from . import _cutedsl

#: 128x128 tiles per expert from which the cooperative 128x256 tile is the default.
WIDE_OUTPUT_TILES = 4096
#: 128x128 tiles per expert from which pingpong tiles default to a set of epilogue buffers
#: per consumer group (spec.epi_buffer_sets=2).
EPI_SPLIT_TILES = 1024
#: Short experts: at most this many tokens per expert on average, on outputs of at most
#: SHORT_OUTPUT_TILES 128x128 tiles per expert, take the cooperative 128x256 tile (16-bit
#: outputs) or 1x2 clusters (FP32 outputs) (Bf16Sm90Backend.tiling_for_tokens).
SHORT_EXPERT_TOKENS = 384
SHORT_OUTPUT_TILES = 128


def _output_tiles(spec: StaticSpec) -> int:
    """128x128 tiles of one expert's output."""
    return -(-spec.hidden // 128) * -(-spec.intermediate // 128)


def _pair_fits(extent: int) -> bool:
    """Whether a pair of 128-wide CTA tiles along an output extent (``spec.intermediate``: a
    1x2 pair; ``spec.hidden``: a 2x1 pair) covers it with at most 1/16 of the pairs' CTAs
    idle (an odd count of 128-wide tiles leaves the last pair's second CTA without a tile: it
    computes and stores nothing)."""
    tiles = -(-extent // 128)
    return tiles >= 2 and (tiles % 2 == 0 or tiles >= 16)


class Bf16Sm90Backend(_cutedsl.CuteDslBackend):
    name = "bf16_sm90"

    def default_tiling(self, spec: StaticSpec):
        # By 128x128 output tiles per expert (measurements: docs/PERFORMANCE.md):
        # - pingpong 128x128 hides each tile's epilogue behind the other group's mainloop;
        # - from WIDE_OUTPUT_TILES the cooperative 128x256 tile's lower L2 traffic wins;
        # - a CTA pair multicasts the operand its CTAs share (half its L2 reads): a 2x1 pair
        #   of cooperative 128x256 CTAs for 16-bit outputs of EPI_SPLIT_TILES..WIDE_OUTPUT_TILES
        #   (the least energy per call, which sets the time at the H200's power limit), a 1x2
        #   pair of 128x128 for 16-bit outputs below EPI_SPLIT_TILES and FP32 outputs from it;
        #   elsewhere the pairs measure slower.
        tiles = _output_tiles(spec)
        # Pairs only when the caller chose neither field: a tile (or a cluster) the caller
        # chose gets the 1x1 rule for the other field.
        if spec.mma_tiler_mn is None and spec.cluster_shape_mn is None:
            sixteen_bit = spec.wgrad_dtype.itemsize == 2 and not spec.accumulate
            if (sixteen_bit and EPI_SPLIT_TILES <= tiles < WIDE_OUTPUT_TILES
                    and _pair_fits(spec.hidden)):
                return (128, 256), (2, 1)
            if _pair_fits(spec.intermediate):
                if spec.wgrad_dtype.itemsize == 4:
                    if tiles >= EPI_SPLIT_TILES:
                        return (128, 128), (1, 2)
                elif sixteen_bit and tiles < EPI_SPLIT_TILES:
                    return (128, 128), (1, 2)
        if tiles >= WIDE_OUTPUT_TILES:
            return (128, 256), (1, 1)
        return (128, 128), (1, 1)

    def default_unit_schedule(self, spec: StaticSpec):
        # Balanced (static on a launch whose counts are balanced, else dynamic) for CTA pairs,
        # where the static order measures faster on balanced counts. Dynamic for 1x1 CTAs
        # (a static order moves several times the DRAM bytes: CTAs drift apart and stop
        # sharing operand panels in L2) and for the short-expert FP32 pairs of
        # tiling_for_tokens (slower static).
        if (sorted(spec.cluster_shape_mn) != [1, 2]
                or (spec.wgrad_dtype.itemsize == 4 and _output_tiles(spec) < EPI_SPLIT_TILES)):
            return SCHEDULE_DYNAMIC
        return SCHEDULE_BALANCED

    def tiling_for_tokens(self, spec: StaticSpec, tokens_sum: int):
        # Many short experts with small outputs (fine-grained MoE): each 128x128 unit's
        # mainloop is a few k-blocks, so the per-unit fixed cost (pipeline fill, the epilogue
        # hand-off, the next unit's wait) and the operand traffic per output byte dominate.
        # 16-bit outputs take the cooperative 128x256 tile (half the units), FP32 outputs a
        # 1x2 pair of 128x128 multicasting A (128x256's FP32 epilogue is not overlapped);
        # past SHORT_EXPERT_TOKENS or SHORT_OUTPUT_TILES both lose (docs/PERFORMANCE.md).
        if (_output_tiles(spec) > SHORT_OUTPUT_TILES
                or tokens_sum > SHORT_EXPERT_TOKENS * spec.num_experts):
            return None
        # 16-bit outputs: a 2x1 pair of them (B multicast) where the pair fits, with a set of
        # staging buffers per consumer group (default_epi_buffer_sets).
        if spec.wgrad_dtype.itemsize == 2 and not spec.accumulate:
            return (128, 256), ((2, 1) if _pair_fits(spec.hidden) else (1, 1))
        if spec.wgrad_dtype.itemsize == 4 and spec.intermediate > 128:
            return (128, 128), (1, 2)
        # Accumulating into 16 bits: the general default (the short-expert variants are untimed
        # there). An output of one 128-column tile: the pair's second CTA would have no
        # columns of its own (it computes and stores nothing).
        return None

    def default_tuning(self, spec: StaticSpec):
        # Bands of 16 m-tiles (L2 reuse of the K panels); epilogue sub-tiles of 64 columns for
        # 16-bit outputs (half the barrier rounds of 32), 32 for FP32 so that the staging
        # buffers leave four A/B stages.
        return 16, (64 if spec.wgrad_dtype.itemsize == 2 else 32)

    def default_epi_buffer_sets(self, spec: StaticSpec):
        # 16-bit outputs only (FP32 outputs lose no A/B stage to a second set and gain
        # nothing). Pingpong tiles from EPI_SPLIT_TILES per expert: a set per consumer group
        # lets both groups' epilogues overlap (no EPI_ORDER hand-off, no store drain per unit)
        # at the cost of one A/B stage, which costs more than it gives on smaller outputs.
        # Cooperative 128-row CTA tiles up to SHORT_OUTPUT_TILES (short experts): each group
        # stores its own 64 rows while the other computes (coop_split); on larger outputs the
        # saved cycles are spent at the H200's power limit, so one set. Measurements:
        # docs/PERFORMANCE.md. (A tile this kernel lacks gets 1 here and its ValueError from
        # check_support.)
        schedule = SM90_TILES.get(tuple(spec.mma_tiler_mn))
        if spec.wgrad_dtype.itemsize != 2 or spec.accumulate:
            return 1
        if schedule == "cooperative":
            # Where the kernel runs two (tiling.epi_buffer_sets_problem: 128-row CTA tiles).
            runs = epi_buffer_sets_problem(2, schedule, False, spec.mma_tiler_mn[0]) is None
            return 2 if runs and _output_tiles(spec) <= SHORT_OUTPUT_TILES else 1
        if schedule != "pingpong":
            return 1
        return 2 if _output_tiles(spec) >= EPI_SPLIT_TILES else 1

    def single_launch_problem(self, spec: StaticSpec):
        # None: one launch by default (the prep work inside the GEMM, before a hand-off),
        # so the host pays one cudaLaunchKernelEx per call instead of two (docs/PERFORMANCE.md,
        # host overhead).
        return None

    def tiling_problem(self, spec: StaticSpec):
        return sm90_problem(spec.mma_tiler_mn, spec.cluster_shape_mn)

    def kernel_problem(self, spec: StaticSpec):
        from ..kernels.sm90_bf16 import Sm90GroupedWgrad

        # Registers, shared-memory stages, epilogue width.
        return Sm90GroupedWgrad.can_implement(self.config(spec))

    def config(self, spec: StaticSpec):
        # A unit is the cluster's tile (a 1x2 or 2x1 CTA pair shares one operand).
        (m, n), (cm, cn) = spec.mma_tiler_mn, spec.cluster_shape_mn
        return _cutedsl.problem_config(spec, sm90_schedule(spec.mma_tiler_mn), m * cm, n * cn)

    def make_kernel(self, spec: StaticSpec):
        """The kernel object (the JAX custom call wraps it: kernels/ffi_entry.py)."""
        from ..kernels.sm90_bf16 import Sm90GroupedWgrad

        return Sm90GroupedWgrad(self.config(spec))
