"""BF16 backend for Hopper (SM90): the WGMMA + TMA kernel of kernels/sm90_bf16.py."""

from __future__ import annotations

from ..kernels.tiling import sm90_problem, sm90_schedule
from ..spec import StaticSpec
from . import _cutedsl
from .tuning_rules import SM90_BF16


class Bf16Sm90Backend(_cutedsl.CuteDslBackend):
    name = "bf16_sm90"
    tuning_rules = SM90_BF16

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
        return _cutedsl.cluster_problem_config(spec, sm90_schedule(spec.mma_tiler_mn))

    def make_kernel(self, spec: StaticSpec):
        """The kernel object (the JAX custom call wraps it: kernels/ffi_entry.py)."""
        from ..kernels.sm90_bf16 import Sm90GroupedWgrad

        return Sm90GroupedWgrad(self.config(spec))
