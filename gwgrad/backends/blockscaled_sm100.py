"""Block-scaled backend for the Blackwell SM100 family: MXFP8, NVFP4 and MXFP4 through the
tcgen05 block-scaled kernel of kernels/sm100_blockscaled.py (the SM100 BF16 kernel's
schedule, warp roles and epilogue; compile-verified only, never run on an SM100 GPU)."""

from __future__ import annotations

import dataclasses

from ..kernels.tiling import sm100_blockscaled_problem, sm100_cta_tile_m
from ..spec import StaticSpec
from . import _cutedsl


class BlockScaledSm100Backend(_cutedsl.CuteDslBackend):
    name = "blockscaled_sm100"

    def check_spec(self, spec: StaticSpec) -> None:
        _cutedsl.check_scaled_spec(spec)

    def default_tiling(self, spec: StaticSpec):
        # The contract's default: a 256x256 2-CTA MMA on a (2, 1) cluster (one accumulator
        # stage: its 256 columns and the scale factors share the 512 TMEM columns).
        if spec.intermediate <= 128:
            return (256, 128), (2, 1)
        return (256, 256), (2, 1)

    def default_tuning(self, spec: StaticSpec):
        return 16, 0  # the epilogue sub-tile comes from the DSL's SM100 helper

    def tiling_problem(self, spec: StaticSpec):
        return sm100_blockscaled_problem(spec.mma_tiler_mn, spec.cluster_shape_mn)

    def kernel_problem(self, spec: StaticSpec):
        from ..kernels.sm100_blockscaled import Sm100BlockScaledGroupedWgrad

        return Sm100BlockScaledGroupedWgrad.can_implement(self.config(spec),
                                                          tuple(spec.mma_tiler_mn))

    def config(self, spec: StaticSpec):
        from ..kernels.sm100_blockscaled import TILE_K, operand_family

        unit_m = sm100_cta_tile_m(spec.mma_tiler_mn) * spec.cluster_shape_mn[0]
        cfg = _cutedsl.problem_config(spec, "sm100", unit_tile_m=unit_m)
        return dataclasses.replace(cfg, tile_k=TILE_K[operand_family(cfg.ab_dtype)],
                                   sf_descriptors=True)

    def make_kernel(self, spec: StaticSpec):
        from ..kernels.sm100_blockscaled import Sm100BlockScaledGroupedWgrad

        return Sm100BlockScaledGroupedWgrad(self.config(spec), tuple(spec.mma_tiler_mn))
