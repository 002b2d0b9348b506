"""Block-scaled backend for the Blackwell SM100 family: MXFP8, NVFP4 and MXFP4 through the
tcgen05 block-scaled kernel of kernels/sm100_blockscaled.py (the SM100 BF16 kernel's
schedule, warp roles and epilogue; compile-verified only, never run on an SM100 GPU). FP8 with
FP32 scale factors runs on SM90 only: gwgrad.errors.UnsupportedError (a NotImplementedError)."""

from __future__ import annotations

import dataclasses

from ..errors import fail, unsupported
from ..kernels.tiling import sm100_blockscaled_problem, sm100_cta_tile_m
from ..scales import BLOCKED
from ..spec import StaticSpec
from . import _cutedsl
from .tuning_rules import SM100
from .base import SM90_ARCHS


class BlockScaledSm100Backend(_cutedsl.CuteDslBackend):
    name = "blockscaled_sm100"
    tuning_rules = SM100

    def check_spec(self, spec: StaticSpec) -> None:
        if spec.scale_recipe not in (None, BLOCKED):
            # FP32 scale factors: SM90's FP8 kernel promotes them on the CUDA cores; the
            # tcgen05 block-scaled MMA reads E8M0 / E4M3 scale factors only. That kernel
            # reads K-major FP8 only: other majors are a ValueError (its predicate) there.
            if spec.a_major == "k" and spec.b_major == "k":
                unsupported("sfa_tensor", f"float32 scale factors ({spec.scale_recipe})",
                            SM90_ARCHS, spec.arch, "SM100's block-scaled MMA reads E8M0 / E4M3 "
                            "scale factors (the blocked recipe) only")
            fail("a_tensor" if spec.a_major != "k" else "b_tensor",
                 f"K-major (token-contiguous) FP8 operands with float32 scale factors "
                 f"({spec.scale_recipe}: SM90's FP8 kernel, the only one that takes them)",
                 f"{spec.a_major}/{spec.b_major}-major operands")
        _cutedsl.check_scaled_spec(spec)

    def tiling_problem(self, spec: StaticSpec):
        return sm100_blockscaled_problem(spec.mma_tiler_mn, spec.cluster_shape_mn)

    def kernel_problem(self, spec: StaticSpec):
        from ..kernels.sm100_blockscaled import Sm100BlockScaledGroupedWgrad

        return Sm100BlockScaledGroupedWgrad.can_implement(self.config(spec),
                                                          tuple(spec.mma_tiler_mn))

    #: Tests only (tests/test_sm100_blockscaled_gpu.py, set by monkeypatch with the plan
    #: caches cleared): kernels issue every MMA step of a K block (ProblemConfig.every_mma_step),
    #: compiled and cached under keys of their own.
    EVERY_MMA_STEP = False

    def config(self, spec: StaticSpec):
        from ..kernels.sm100_blockscaled import TILE_K, operand_family

        unit_m = sm100_cta_tile_m(spec.mma_tiler_mn) * spec.cluster_shape_mn[0]
        cfg = _cutedsl.problem_config(spec, "sm100", unit_tile_m=unit_m)
        return dataclasses.replace(cfg, tile_k=TILE_K[operand_family(cfg.ab_dtype)],
                                   sf_descriptors=True,
                                   sf_dtype=spec.sf_dtype.value if spec.sf_dtype else "",
                                   every_mma_step=self.EVERY_MMA_STEP)

    def cache_key(self, spec: StaticSpec):
        key = super().cache_key(spec)
        return key + ("every_mma_step",) if self.EVERY_MMA_STEP else key

    def make_kernel(self, spec: StaticSpec):
        from ..kernels.sm100_blockscaled import Sm100BlockScaledGroupedWgrad

        return Sm100BlockScaledGroupedWgrad(self.config(spec), tuple(spec.mma_tiler_mn))
