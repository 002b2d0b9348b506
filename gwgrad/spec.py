"""The static spec: everything a compiled kernel bakes in, the problem and its tuning. It is the
cache key of operators, of compiled kernels in memory and on disk.

``tokens_sum``, the offsets values and every pointer are *not* in it: one compiled kernel
serves every token count and distribution.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

from .dtypes import DType

INPUT_ORDERS = ("tensor2d", "tensor_ragged")
OUTPUT_MODES = ("dense", "discrete")
A_MAJORS = ("k", "m")
B_MAJORS = ("k", "n")


@dataclass(frozen=True)
class Tuning:
    """How a kernel runs a problem: any tuning the backend accepts (``check_support``) computes
    the same result. None / 0: the backend's default, filled in by ``backends.finalize_spec``
    from its rule table (gwgrad/backends/tuning_rules.py). Part of the spec, so part of every
    cache key; never read from the environment.

    ``mma_tiler_mn``, ``cluster_shape_mn``: the MMA tile and the CTA cluster (which each
    kernel runs: kernels/tiling.py). ``raster_group``: m-tiles per raster band of the unit
    order. ``epi_tile_n``: columns of one epilogue sub-tile (0 after finalizing: the kernel's
    own choice, SM100). ``epi_buffer_sets``: sets of epilogue staging buffers (SM90: 1, one
    set; 2, a set per consumer group: pingpong groups' epilogues overlap, cooperative groups
    of a 128-row tile store their 64 rows in turn, each overlapping the other's mainloop).
    ``unit_schedule``: how CTAs (clusters) take their units (kernels/tiling.py
    UNIT_SCHEDULES): 1 dynamic (an atomic counter); 3 balanced (SM90 BF16: a static order,
    CTA b taking units b, b + grid, ... with no counter and, on a cluster, no hand-off from
    its leader, on a launch whose expert counts are balanced, else dynamic, decided in the
    kernel). ``mainloop``: how SM90 runs MXFP8 (the ``blocked`` recipe with FP8 operands): 1,
    the promoting kernel (FP8 WGMMA per 32-token block, each result scaled on CUDA cores:
    kernels/sm90_fp8.py); 2, two passes (the operands dequantized to BF16 in the workspace, then
    the BF16 kernel: kernels/sm90_mxfp8_bf16.py); every other kernel runs 1 only.
    ``launches``: kernel launches per call: 2, a prep kernel (the experts' ranges,
    order, descriptors and the offsets check) then the GEMM; 1, the GEMM does that work
    itself before a hand-off (half the host launch cost; needs a workspace whose first 16
    bytes are zero before its first use, which gwgrad's own workspaces are; JAX's custom call
    asks for 2: XLA's workspace is not zeroed).
    """

    mma_tiler_mn: Optional[Tuple[int, int]] = None
    cluster_shape_mn: Optional[Tuple[int, int]] = None
    raster_group: int = 0
    epi_tile_n: int = 0
    epi_buffer_sets: int = 0
    unit_schedule: int = 0
    launches: int = 0
    mainloop: int = 0

    def __post_init__(self) -> None:
        for name in ("mma_tiler_mn", "cluster_shape_mn"):  # hashable, whatever was passed
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))


#: The tuning's field names, in order.
TUNING_FIELDS = tuple(f.name for f in dataclasses.fields(Tuning))


@dataclass(frozen=True)
class StaticSpec:
    """The problem (dims, dtypes, majors, modes, scales, arch) and its ``tuning``, the one place
    the tuning is kept. Read a tuning field as ``spec.mma_tiler_mn`` (a read-only view of
    ``spec.tuning``); change it with ``spec.with_tuning(mma_tiler_mn=...)``."""

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
    sf_vec_size: int
    arch: str  # "sm_90a", "sm_100a", ... or "cpu" for the reference backend
    # Block-scaled only: scale-factor dtype and whether global scales are passed.
    sf_dtype: Optional[DType] = None
    has_global_scale: bool = False
    # Block-scaled only: which scales (gwgrad/scales.py: "blocked", "per_expert_channel",
    # "block_1x128"); None for BF16.
    scale_recipe: Optional[str] = None
    tuning: Tuning = Tuning()

    def with_tuning(self, **fields) -> "StaticSpec":
        """This spec with the named tuning fields replaced (``Tuning``'s names)."""
        return dataclasses.replace(self, tuning=dataclasses.replace(self.tuning, **fields))

    @property
    def mma_tiler_mn(self) -> Optional[Tuple[int, int]]:
        return self.tuning.mma_tiler_mn

    @property
    def cluster_shape_mn(self) -> Optional[Tuple[int, int]]:
        return self.tuning.cluster_shape_mn

    @property
    def raster_group(self) -> int:
        return self.tuning.raster_group

    @property
    def epi_tile_n(self) -> int:
        return self.tuning.epi_tile_n

    @property
    def epi_buffer_sets(self) -> int:
        return self.tuning.epi_buffer_sets

    @property
    def unit_schedule(self) -> int:
        return self.tuning.unit_schedule

    @property
    def launches(self) -> int:
        return self.tuning.launches

    @property
    def mainloop(self) -> int:
        return self.tuning.mainloop

    @property
    def is_block_scaled(self) -> bool:
        return self.a_dtype != DType.BFLOAT16

    @property
    def is_cpu(self) -> bool:
        return self.arch == "cpu"
