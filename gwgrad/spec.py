"""The static spec: everything a compiled kernel bakes in, tuning included. It is the cache key
of operators, of compiled kernels in memory and on disk.

``tokens_sum``, the offsets values and every pointer are *not* in it: one compiled kernel
serves every token count and distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from .dtypes import DType

INPUT_ORDERS = ("tensor2d", "tensor_ragged")
OUTPUT_MODES = ("dense", "discrete")
A_MAJORS = ("k", "m")
B_MAJORS = ("k", "n")


@dataclass(frozen=True)
class StaticSpec:
    hidden: int
    intermediate: int
    num_experts: int
    a_dtype: DType
    b_dtype: DType
    wgrad_dtype: DType
    acc_dtype: DType
    a_major: str  # "k": (tokens_sum, 1) strides; "m": (1, hidden)
    b_major: str  # "k": (1, tokens_sum) strides; "n": (intermediate, 1)
    input_order: str  # "tensor2d" | "tensor_ragged"
    output_mode: str  # "dense" | "discrete"
    accumulate: bool
    mma_tiler_mn: Tuple[int, int]
    cluster_shape_mn: Tuple[int, int]
    sf_vec_size: int
    arch: str  # "sm_90a", "sm_100a", ... or "cpu" for the reference backend
    # Block-scaled only: scale-factor dtype and whether global scales are passed.
    sf_dtype: Optional[DType] = None
    has_global_scale: bool = False
    # Block-scaled only: which scales (gwgrad/scales.py: "blocked", "per_expert_channel",
    # "block_1x128"); None for BF16.
    scale_recipe: Optional[str] = None
    # Tuning, with mma_tiler_mn and cluster_shape_mn (0 / None: the backend's default, filled
    # in by backends.finalize_spec): m-tiles per raster band of the unit order, columns of one
    # epilogue sub-tile, sets of epilogue staging buffers (SM90: 1, one set; 2, a set per
    # consumer group: pingpong groups' epilogues overlap, cooperative groups of a 128-row tile
    # store their 64 rows in turn, each overlapping the other's mainloop). Part of the spec,
    # so part of every cache key; never read from the environment.
    raster_group: int = 0
    epi_tile_n: int = 0
    epi_buffer_sets: int = 0
    # Kernel launches per call (0: the backend's default): 2, a prep kernel (the experts'
    # ranges, order, descriptors and the offsets check) then the GEMM; 1, the GEMM does that
    # work itself before a hand-off (half the host launch cost; needs a workspace whose
    # first 16 bytes are zero before its first use, which gwgrad's own workspaces are). Not
    # tuning: JAX's custom call asks for 2 (XLA's workspace is not zeroed).
    launches: int = 0
    # How CTAs (clusters) take their units (tuning; kernels/tiling.py UNIT_SCHEDULES): 0, the
    # backend's default; 1 dynamic (an atomic counter); 3 balanced (SM90 BF16: a static order,
    # CTA b taking units b, b + grid, ... with no counter and, on a cluster, no hand-off from
    # its leader, on a launch whose expert counts are balanced, else dynamic, decided in the
    # kernel).
    unit_schedule: int = 0

    @property
    def is_block_scaled(self) -> bool:
        return self.a_dtype != DType.BFLOAT16

    @property
    def is_cpu(self) -> bool:
        return self.arch == "cpu"
