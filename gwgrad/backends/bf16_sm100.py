"""BF16 backend for the Blackwell SM100 family: the tcgen05 + TMEM kernel of
kernels/sm100_bf16.py (dynamic persistent scheduling through cluster launch control)."""

from __future__ import annotations

from ..kernels.tiling import sm100_cta_tile_m, sm100_problem
from ..spec import StaticSpec
from . import _cutedsl


class Bf16Sm100Backend(_cutedsl.CuteDslBackend):
    name = "bf16_sm100"

    def default_tiling(self, spec: StaticSpec):
        # The Blackwell examples' workhorse: a 256-row 2-CTA MMA on a (2, 1) cluster; its two
        # 256-column accumulators fill the 512 TMEM columns. Narrow outputs take 128 columns.
        if spec.intermediate <= 128:
            return (256, 128), (2, 1)
        return (256, 256), (2, 1)

    def default_tuning(self, spec: StaticSpec):
        # The epilogue sub-tile comes from the DSL's SM100 helper (epi_tile_n stays 0).
        return 16, 0

    def tiling_problem(self, spec: StaticSpec):
        return sm100_problem(spec.mma_tiler_mn, spec.cluster_shape_mn)

    def kernel_problem(self, spec: StaticSpec):
        from ..kernels.sm100_bf16 import Sm100GroupedWgrad

        return Sm100GroupedWgrad.can_implement(self.config(spec), tuple(spec.mma_tiler_mn))

    def config(self, spec: StaticSpec):
        unit_m = sm100_cta_tile_m(spec.mma_tiler_mn) * spec.cluster_shape_mn[0]
        return _cutedsl.problem_config(spec, "sm100", unit_tile_m=unit_m)

    def make_kernel(self, spec: StaticSpec):
        """The kernel object (the JAX custom call wraps it: kernels/ffi_entry.py)."""
        from ..kernels.sm100_bf16 import Sm100GroupedWgrad

        return Sm100GroupedWgrad(self.config(spec), tuple(spec.mma_tiler_mn))
