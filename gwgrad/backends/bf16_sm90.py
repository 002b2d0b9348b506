"""BF16 backend for Hopper (SM90): the WGMMA + TMA kernel of kernels/sm90_bf16.py."""

from __future__ import annotations

from ..kernels.tiling import sm90_problem, sm90_schedule
from ..spec import StaticSpec
from . import _cutedsl

#: 128x128 tiles per expert from which the cooperative 128x256 tile is the default.
WIDE_OUTPUT_TILES = 4096


class Bf16Sm90Backend(_cutedsl.CuteDslBackend):
    name = "bf16_sm90"

    def default_tiling(self, spec: StaticSpec):
        # Measured on an H200 (docs/PERF_NOTES.md, README Performance): pingpong 128x128 hides
        # each tile's epilogue behind the other warp group's mainloop and wins wherever an
        # expert's output has fewer than ~4096 such tiles (every benchmark row but one, by up
        # to 6%); on very wide outputs (mixtral-fc1: 7168 tiles per expert) the cooperative
        # 128x256 tile's lower L2 traffic wins by 8%.
        tiles = -(-spec.hidden // 128) * -(-spec.intermediate // 128)
        if tiles >= WIDE_OUTPUT_TILES:
            return (128, 256), (1, 1)
        return (128, 128), (1, 1)

    def default_tuning(self, spec: StaticSpec):
        # Bands of 16 m-tiles (L2 reuse of the K panels); epilogue sub-tiles of 64 columns for
        # 16-bit outputs (half the barrier rounds of 32: +2-4% on the H200 rows), 32 for FP32
        # so that the staging buffers leave four A/B stages.
        return 16, (64 if spec.wgrad_dtype.itemsize == 2 else 32)

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
        """The kernel object (its `call_tensors` entry serves cutlass.jax.cutlass_call)."""
        from ..kernels.sm90_bf16 import Sm90GroupedWgrad

        return Sm90GroupedWgrad(self.config(spec))
