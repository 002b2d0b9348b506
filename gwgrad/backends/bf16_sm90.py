"""BF16 backend for Hopper (SM90): the WGMMA + TMA kernel of kernels/sm90_bf16.py."""

from __future__ import annotations

from typing import Tuple

from ..spec import StaticSpec
from . import _cutedsl

#: (tile_m, tile_n) -> schedule. 128x128 and 64xN tiles run one tile per consumer warp group
#: (pingpong); 128x256 and 256x128 split one tile over both groups (cooperative).
SM90_TILES = {
    (128, 256): "cooperative",
    (256, 128): "cooperative",
    (128, 192): "cooperative",
    (128, 128): "pingpong",
    (64, 256): "pingpong",
    (64, 128): "pingpong",
}


#: 128x128 tiles per expert from which the cooperative 128x256 tile is the default.
WIDE_OUTPUT_TILES = 4096


def sm90_schedule(mma_tiler_mn: Tuple[int, int]) -> str:
    try:
        return SM90_TILES[tuple(mma_tiler_mn)]
    except KeyError:
        raise ValueError(
            f"mma_tiler_mn: the SM90 BF16 kernel supports {sorted(SM90_TILES)}, got {tuple(mma_tiler_mn)}"
        ) from None


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

    def check_support(self, spec: StaticSpec) -> None:
        _cutedsl.check_bf16_spec(spec)
        schedule = sm90_schedule(spec.mma_tiler_mn)
        if tuple(spec.cluster_shape_mn) != (1, 1):
            raise ValueError(
                f"cluster_shape_mn: the SM90 BF16 kernel runs (1, 1) clusters, got {tuple(spec.cluster_shape_mn)}"
            )
        from ..kernels.sm90_bf16 import Sm90GroupedWgrad

        # Constructing the kernel object checks tile/register/shared-memory limits.
        Sm90GroupedWgrad(_cutedsl.problem_config(spec, schedule))

    def workspace_bytes(self, spec: StaticSpec) -> int:
        return _cutedsl.problem_config(spec, sm90_schedule(spec.mma_tiler_mn)).workspace_bytes

    def make_kernel(self, spec: StaticSpec):
        """The kernel object (its `call_tensors` entry serves cutlass.jax.cutlass_call)."""
        from ..kernels.sm90_bf16 import Sm90GroupedWgrad

        return Sm90GroupedWgrad(_cutedsl.problem_config(spec, sm90_schedule(spec.mma_tiler_mn)))
