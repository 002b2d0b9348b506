"""BF16 backend for the Blackwell SM100 family: the tcgen05 + TMEM kernel of
kernels/sm100_bf16.py (dynamic persistent scheduling through cluster launch control)."""

from __future__ import annotations

from ..kernels.tiling import sm100_cta_tile_m, sm100_problem
from ..spec import StaticSpec
from . import _cutedsl
from .tuning_rules import SM100


class Bf16Sm100Backend(_cutedsl.CuteDslBackend):
    name = "bf16_sm100"
    tuning_rules = SM100

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
