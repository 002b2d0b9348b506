"""FP8 backend for Hopper (SM90): the scaled WGMMA kernel of kernels/sm90_fp8.py, for the three
scale recipes of gwgrad/scales.py (MXFP8's blocked E8M0 scales, per-expert channel scales,
1x128 blocks). FP4 formats need SM100's block-scaled tensor cores, and so does MXFP8 with an
M/N-major operand: those raise gwgrad.errors.UnsupportedError (a NotImplementedError).

MXFP8 runs either kernel, by ``Tuning.mainloop``: 1 the promoting kernel here, 2 the two-pass
``Mxfp8Bf16Sm90Backend`` below (kernels/sm90_mxfp8_bf16.py), the default where gwgrad sizes
the workspace (``backends.mxfp8_two_pass``)."""

from __future__ import annotations

import dataclasses

from ..dtypes import DType
from ..errors import fail, unsupported
from ..kernels.tiling import SM90_FP8_TILES, sm90_fp8_problem, sm90_problem, sm90_schedule
from ..scales import BLOCKED
from ..spec import StaticSpec
from . import _cutedsl
from .base import SM100_ARCHS
from .tuning_rules import SM90_FP8, SM90_MXFP8_BF16


class Fp8Sm90Backend(_cutedsl.CuteDslBackend):
    name = "fp8_sm90"
    tuning_rules = SM90_FP8

    def check_spec(self, spec: StaticSpec) -> None:
        for name, dtype in (("a_tensor", spec.a_dtype), ("b_tensor", spec.b_dtype)):
            if dtype == DType.FLOAT4_E2M1FN_X2:
                # Hopper has no block-scaled FP4 tensor cores; the SM100 kernel runs it.
                unsupported(name, f"{dtype} (NVFP4/MXFP4)", SM100_ARCHS, spec.arch)
        # Hopper's FP8 WGMMA reads K-major shared memory only. MXFP8 with an M/N-major
        # operand runs on SM100 (its kernel reads either major); with FP32 scale factors no
        # GPU kernel takes one (SM100's takes no FP32 scales): a ValueError, as in the
        # kernel's own predicate (can_implement).
        for name, major, word in (("a_tensor", spec.a_major, "M-major"),
                                  ("b_tensor", spec.b_major, "N-major")):
            if major == "k":
                continue
            if spec.scale_recipe == BLOCKED:
                dtype = spec.a_dtype if name == "a_tensor" else spec.b_dtype
                unsupported(name, f"an {word} {dtype} operand (MXFP8)", SM100_ARCHS, spec.arch,
                            "Hopper's FP8 WGMMA reads K-major operands only")
            fail(name, "a K-major (token-contiguous) FP8 operand: Hopper's FP8 WGMMA reads "
                 "K-major shared memory only (quantize x and dy transposed, as (hidden, tokens) "
                 "/ (intermediate, tokens) rows)", f"an {word} one")
        _cutedsl.check_scaled_spec(spec)

    def tiling_problem(self, spec: StaticSpec):
        return sm90_fp8_problem(spec.mma_tiler_mn, spec.cluster_shape_mn)

    def kernel_problem(self, spec: StaticSpec):
        from ..kernels.sm90_fp8 import Sm90ScaledGroupedWgrad

        return Sm90ScaledGroupedWgrad.can_implement(self.config(spec))

    def config(self, spec: StaticSpec):
        from ..kernels.sm90_fp8 import FP8_TILE_K

        schedule = SM90_FP8_TILES[tuple(spec.mma_tiler_mn)]
        return dataclasses.replace(_cutedsl.cluster_problem_config(spec, schedule),
                                   tile_k=FP8_TILE_K)

    def make_kernel(self, spec: StaticSpec):
        from ..kernels.sm90_fp8 import Sm90ScaledGroupedWgrad

        return Sm90ScaledGroupedWgrad(self.config(spec))


class Mxfp8Bf16Sm90Backend(_cutedsl.CuteDslBackend):
    """MXFP8 on SM90 in two passes (``Tuning.mainloop = 2``): the operands dequantized to BF16
    in the workspace, then the BF16 kernel (kernels/sm90_mxfp8_bf16.py has the design and its
    budget). Its tilings and tuning rules are the BF16 kernel's; its workspace grows with the
    call's tokens (``workspace_per_token``), which the contract's workspace size does not take:
    the default only where gwgrad sizes the workspace (``backends.mxfp8_two_pass``)."""

    name = "mxfp8_bf16_sm90"
    tuning_rules = SM90_MXFP8_BF16

    def mainloops(self):
        return (2,)

    def check_spec(self, spec: StaticSpec) -> None:
        if spec.scale_recipe != BLOCKED:
            fail("mainloop", f"1 with {spec.scale_recipe} scales (mainloop=2 dequantizes "
                 "MXFP8: blocked E8M0 scales)", spec.mainloop)
        Fp8Sm90Backend.check_spec(self, spec)

    def tiling_problem(self, spec: StaticSpec):
        return sm90_problem(spec.mma_tiler_mn, spec.cluster_shape_mn)

    def kernel_problem(self, spec: StaticSpec):
        from ..kernels.sm90_mxfp8_bf16 import Sm90DequantGroupedWgrad

        return Sm90DequantGroupedWgrad.can_implement(self.config(spec))

    def config(self, spec: StaticSpec):
        return _cutedsl.cluster_problem_config(spec, sm90_schedule(spec.mma_tiler_mn))

    def workspace_bytes(self, spec: StaticSpec) -> int:
        from ..kernels.sm90_mxfp8_bf16 import workspace_base

        return workspace_base(self.config(spec))

    def make_kernel(self, spec: StaticSpec):
        from ..kernels.sm90_mxfp8_bf16 import Sm90DequantGroupedWgrad

        return Sm90DequantGroupedWgrad(self.config(spec))
