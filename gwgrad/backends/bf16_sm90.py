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
        # Measured on an H200 (docs/PERF_NOTES.md, README Performance): pingpong 128x128 hides
        # each tile's epilogue behind the other warp group's mainloop and wins wherever an
        # expert's output has fewer than ~4096 such tiles (every benchmark row but one, by up
        # to 6%); on very wide outputs (mixtral-fc1: 7168 tiles per expert) the cooperative
        # 128x256 tile's lower L2 traffic wins by 8%.
        # Session 13: a 1x2 pair of pingpong 128x128 CTAs (A multicast) with the balanced unit
        # schedule (static on balanced counts, default_unit_schedule), gwgrad's variants
        # alone (docs/results/h200_bench_tune_unit_schedule*.json), x this 1x1 default:
        # - 16-bit outputs: +0.2..+4.9% on zipf and -0.7..+1.4% uniform on outputs of < 1024
        #   tiles per expert (qwen3-30b, dsv3-fc2, dsv2lite-fc1) and +1.2..+1.6% on >= 4096
        #   (mixtral-fc1, against 128x256); in between (dsv3-fc1, gptoss-fc1) +2.9..+3.1%
        #   uniform but -1.6..-2.1% zipf: not taken there.
        # - FP32 outputs (accumulating): +9.3..+10.4% uniform and -0.1..+0.1% zipf from 1024
        #   tiles per expert (dsv3-fc1, gptoss-fc1; mixtral-fc1 +8.3% / +6.9% against
        #   128x256); below, -5..-6% uniform (qwen3-30b): not taken.
        # Session 17: in between (1024-4095 tiles per expert: dsv3-fc1, gptoss-fc1) a 2x1
        # pair of cooperative 128x256 CTAs (a 256x256 cluster tile, B multicast), measured
        # where the call's energy counts, at the H200's 700 W power limit: timed in 2 s
        # windows each followed by the row's dense GEMM (a training step's mix,
        # tools/energy_bench.py --mix, h200_energy_mix_s17.json and _after_s17.json), its
        # share of the step 4.1-8.3% faster than the 1x1 default on both rows, uniform and zipf
        # (the 1x2 pair: +1.2..+2.3% uniform, -0.4..-2.5% zipf), and 1.4-5.9% alone. The
        # interleaved bench ranks it 0.96-1.00x (each 12 ms sample runs at a clock that the
        # neighbouring samples' power set: it counts cycles, not energy; PERF_NOTES).
        # Session 18, the same mix on the other rows (h200_energy_mix_*_s18.json): on very
        # wide outputs (>= 4096 tiles per expert, mixtral-fc1) the cooperative 128x256 1x1
        # tile again, 1.4% / 2.5% faster than the 1x2 pair (uniform / zipf; identical
        # variants agree within 0.2% there); below 1024 tiles the 1x2 pair stays (the 2x1
        # pair of 128x256 and the 128x256 tile within -0.9..+3.0%, mixed); FP32 outputs keep
        # theirs (the 1x2 pair from 1024 tiles 1.5-4.7% ahead of the 1x1 and 128x256 tiles).
        tiles = _output_tiles(spec)
        # Pairs only when the caller chose neither field: a tile (or a cluster) the caller
        # chose gets the 1x1 defaults it had before pairs were a default.
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
        # Balanced (static on a launch whose counts are balanced, else dynamic) for CTA pairs:
        # static pairs ran 1.00-1.09x dynamic ones on the uniform rows with 16-bit outputs and
        # 1.01-1.04x with FP32 accumulation on outputs of >= 1024 tiles per expert; static
        # 1x1 CTAs ran 0.67-0.84x (docs/PERF_NOTES.md, session 13), quads have not run
        # statically, and the short-expert FP32 pairs (tiling_for_tokens) ran 0.89x static on
        # fine-256e uniform: dynamic there.
        if (sorted(spec.cluster_shape_mn) != [1, 2] or spec.split_tokens
                or (spec.wgrad_dtype.itemsize == 4 and _output_tiles(spec) < EPI_SPLIT_TILES)):
            return SCHEDULE_DYNAMIC
        return SCHEDULE_BALANCED

    def tiling_for_tokens(self, spec: StaticSpec, tokens_sum: int):
        # Many short experts with small outputs (fine-grained MoE): each 128x128 unit's
        # mainloop is a few k-blocks, so the per-unit fixed cost (pipeline fill, the epilogue
        # hand-off, the next unit's wait) and the operand traffic per output byte dominate.
        # Measured on an H200, gwgrad's variants alone (docs/PERF_NOTES.md, session 7), at
        # 128-384 tokens per expert on 96 tiles per expert: 16-bit outputs gain +0..+31% with
        # the cooperative 128x256 tile (half the units; fine-256e +6% / +22%, uniform / zipf),
        # FP32 outputs +1..+7% with a 1x2 cluster multicasting A (128x256 was -5% uniform
        # there: its FP32 epilogue is not overlapped). Not taken: 512 tokens per expert
        # (128x256 -5% / +8%), or 256 tokens on 352 or 1792 tiles per expert (-3..-10%).
        if (_output_tiles(spec) > SHORT_OUTPUT_TILES
                or tokens_sum > SHORT_EXPERT_TOKENS * spec.num_experts):
            return None
        # Session 18: on 16-bit outputs a 2x1 pair of them (B multicast) where the pair fits,
        # with a set of staging buffers per consumer group (default_epi_buffer_sets).
        if spec.wgrad_dtype.itemsize == 2 and not spec.accumulate:
            return (128, 256), ((2, 1) if _pair_fits(spec.hidden) else (1, 1))
        if spec.wgrad_dtype.itemsize == 4 and spec.intermediate > 128:
            return (128, 128), (1, 2)
        # Accumulating into 16 bits: not measured. An output of one 128-column tile: the
        # pair's second CTA would have no columns of its own (it computes and stores nothing).
        return None

    def default_tuning(self, spec: StaticSpec):
        # Bands of 16 m-tiles (L2 reuse of the K panels); epilogue sub-tiles of 64 columns for
        # 16-bit outputs (half the barrier rounds of 32: +2-4% on the H200 rows), 32 for FP32
        # so that the staging buffers leave four A/B stages.
        return 16, (64 if spec.wgrad_dtype.itemsize == 2 else 32)

    def default_epi_buffer_sets(self, spec: StaticSpec):
        # Pingpong, 16-bit outputs of >= EPI_SPLIT_TILES tiles per expert: a set of staging
        # buffers per consumer group, so the two groups' epilogues overlap (no EPI_ORDER
        # hand-off, no store drain per unit), at the cost of one A/B stage (6 -> 5). Measured
        # on an H200 with gwgrad's variants timed alone (docs/PERF_NOTES.md, session 6):
        # +1..+3% on dsv3-fc1 and gptoss-fc1 (1792 and 1035 tiles per expert), -1..-2% on
        # qwen3-30b and dsv2lite-fc1 (96-352 tiles), where the lost stage costs more than the
        # overlap gives. FP32 outputs (no stage lost) showed no gain beyond the full bench's
        # noise: one set. (A tile this kernel lacks gets 1 here and its ValueError from
        # check_support.)
        # Session 18, cooperative tiles: a set per group lets each group store its own 64 rows
        # while the other computes (kernels/sm90_bf16.py, coop_split). fine-256e (256 tokens
        # per expert, 96 tiles), the short-expert tiling's 128x256 1x1 and 2x1 pair, timed
        # against one set (h200_energy_mix_fine256e_split_s18.json, h200_bench_tune_*_s18):
        # 1.2% / 0.5% and 1.4% / 1.4% faster in the training-step mix (uniform / zipf; the
        # 2x1 pair alone: -0.5% / +0.6%), 6.8% / 2.0% and 5.4% / 2.7% in the interleaved tune;
        # on the large outputs (dsv3-fc1, gptoss-fc1, mixtral-fc1) -1.2..+1.6% in the mix,
        # where the tensor cores' saved cycles are spent at the power limit: one set there.
        schedule = SM90_TILES.get(tuple(spec.mma_tiler_mn))
        if spec.wgrad_dtype.itemsize != 2 or spec.accumulate:
            return 1
        if schedule == "cooperative":
            # Where the kernel runs two (tiling.epi_buffer_sets_problem: 128-row CTA tiles, no
            # K split).
            runs = epi_buffer_sets_problem(2, schedule, spec.split_tokens, False,
                                           spec.mma_tiler_mn[0]) is None
            return 2 if runs and _output_tiles(spec) <= SHORT_OUTPUT_TILES else 1
        if schedule != "pingpong":
            return 1
        return 2 if _output_tiles(spec) >= EPI_SPLIT_TILES else 1

    def single_launch_problem(self, spec: StaticSpec):
        # None: one launch by default (the prep work inside the GEMM, before a hand-off),
        # so the host pays one cudaLaunchKernelEx per call instead of two (docs/PERF_NOTES.md,
        # the host path).
        return None

    def tiling_problem(self, spec: StaticSpec):
        return sm90_problem(spec.mma_tiler_mn, spec.cluster_shape_mn)

    def kernel_problem(self, spec: StaticSpec):
        from ..kernels.sm90_bf16 import Sm90GroupedWgrad

        # Registers, shared-memory stages, epilogue width.
        return Sm90GroupedWgrad.can_implement(self.config(spec))

    def config(self, spec: StaticSpec):
        # A unit is the cluster's tile (a 1x2 or 2x1 CTA pair shares one operand, a 2x2 quad
        # both).
        (m, n), (cm, cn) = spec.mma_tiler_mn, spec.cluster_shape_mn
        return _cutedsl.problem_config(spec, sm90_schedule(spec.mma_tiler_mn), m * cm, n * cn)

    def make_kernel(self, spec: StaticSpec):
        """The kernel object (its `call_tensors` entry serves cutlass.jax.cutlass_call)."""
        from ..kernels.sm90_bf16 import Sm90GroupedWgrad

        return Sm90GroupedWgrad(self.config(spec))
