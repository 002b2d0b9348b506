"""What a GEMM kernel compiles in (ProblemConfig), the workspace it shares with its prep work
(layout and the typed Workspace view), the status record's layout, and the GEMM-domain views
of the caller's storage. Arch-neutral: every GEMM kernel and the prep work read these.

Workspace (``ProblemConfig.workspace_bytes`` bytes, 128-byte aligned):

    counter   int32      byte 0: the dynamic unit schedule's counter, reset to 0 (expert 0)
    verdict   int32      byte 4: 1 when the offsets are valid, 0 when not (expert 0, every launch)
    prep      int32[2]   bytes 8, 12 (single launch only): the next expert a prep warp takes,
                         and the experts prepared (then also the CTAs past the hand-off). Both
                         must be 0 before a workspace's first launch (gwgrad zero-fills the
                         workspaces it allocates) and every launch leaves them 0, so any later
                         launch, of any grid size, may reuse it.
    live      int32      byte 16: experts with tokens (expert 0). They hold ranks 0..live-1, so
                         units past live * tiles_per_expert belong to empty experts (the SM90
                         kernels hand out only the others, and zero the empty experts' outputs
                         with plain stores from otherwise idle warps).
    spread    int32      byte 24 (balanced schedule only): the largest count minus the smallest
                         nonzero one (expert 0)
    tokens    int32      byte 28 (balanced schedule only): the sanitized counts' sum (expert 0)
              (bytes 20 and 32..127 of this 128-byte block are unused: the other words keep
              their offsets)
    ranges    int32[2E]  sanitized (begin, end) token range of every expert
    order     int32[E]   expert of each rank (longest first)
    sf_base   int32[E]   (block-scaled) first scale column / row of every expert
    descs     128 B each per expert: TMA descriptors for A and B, and for the output in
              discrete mode (slots DESC_A, DESC_B, DESC_C; SM100 block-scaled adds
              desc_sfa, desc_sfb)

gwgrad/plan.py restates this layout without the DSL (workspace_bytes_bound).

Status record (8 x int32, 16-byte aligned; host-mapped pinned memory, to the kernels plain
global memory), where the prep work records invalid offsets (kernels/prep.py, check_offsets):

    [0] code: 0 none; 1 a negative count (offsets[0] < 0 or decreasing offsets); 2 the last
        offset != tokens_sum; 3 a count not a multiple of count_multiple (and the codes of
        gwgrad/offsets.py for scales too small and invalid output addresses)
    [1] expert  [2] offsets[expert]  [3] prev(expert)  [4] tokens_sum  [5] count_multiple
    [6..7] reserved, 0

Verified: tests/test_cudnn_api.py (test_workspace_size_bounds_every_kernel: ProblemConfig's
workspace against gwgrad/plan.py's bound, every format family and mode), the kernels' GPU
tests through every launch, tests/test_cudnn_api_gpu.py on an H200.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ..scales import column_rule
from .tiling import SCHEDULE_BALANCED
from .types import CUTLASS_TYPES

DESC_BYTES = 128
# The block of counters (module doc): bytes 0 counter, 4 verdict, 8 and 12 the prep hand-off,
# 16 live, 24 spread, 28 tokens; 20 and 32..127 unused.
COUNTER_BYTES = 128
VERDICT_BYTE = 4
PREP_NEXT_BYTE = 8  # single launch: the next expert a prep warp takes (0 between launches)
PREP_DONE_BYTE = 12  # ... experts prepared, then + CTAs past the hand-off (0 between launches)
LIVE_BYTE = 16  # experts with tokens (ranks 0 .. live-1 of the unit order; the rest are empty)
SPREAD_BYTE = 24  # balanced schedule: the largest count minus the smallest nonzero one
TOKENS_BYTE = 28  # balanced schedule: the tokens of all experts (sanitized counts)
# The status record (see module doc): 8 int32, 16-byte aligned.
STATUS_INT32 = 8
(STATUS_CODE, STATUS_EXPERT, STATUS_VALUE, STATUS_PREV, STATUS_TOKENS_SUM,
 STATUS_MULTIPLE) = range(6)


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


@dataclass(frozen=True)
class ProblemConfig:
    """What a kernel compiles in (derived from gwgrad's StaticSpec, arch-neutral)."""

    hidden: int
    intermediate: int
    num_experts: int
    a_major: str  # "k" | "m"
    b_major: str  # "k" | "n"
    input_order: str  # "tensor2d" | "tensor_ragged"
    output_mode: str  # "dense" | "discrete"
    accumulate: bool
    ab_dtype: str  # "bfloat16"
    c_dtype: str  # "bfloat16" | "float16" | "float32"
    tile_m: int
    tile_n: int
    tile_k: int = 64
    cluster_m: int = 1
    cluster_n: int = 1
    schedule: str = "cooperative"  # SM90: "cooperative" | "pingpong"
    group_m: int = 16  # m-tiles per raster band (see unit_tile_coords)
    epi_tile_n: int = 0  # columns of one epilogue sub-tile; 0: the kernel's default
    # SM90 pingpong: epilogue staging buffer sets (1: shared by the consumer groups in turn;
    # 2: one per group, their epilogues overlap). Other kernels take 1.
    epi_buffer_sets: int = 1
    # Every expert's token count must be a multiple of this (gwgrad.offsets.token_count_multiple,
    # the one rule): with a K-major operand TMA needs 16-byte aligned rows. Others fail the
    # offsets check and are treated as empty (kernels/prep.py, sanitizing).
    count_multiple: int = 1
    # Block-scaled inputs (gwgrad/scales.py): B's dtype when it differs from A's (FP8 mixes),
    # the scale recipe ("" for BF16), tokens per scale (sf_vec_size) and global scales.
    b_dtype: str = ""
    scale_recipe: str = ""
    sf_vec: int = 0
    has_global_scale: bool = False
    # The scale recipe whose tensors the prep work checks (their capacity against the
    # counts) for a kernel that does not read them itself: the BF16 kernel of the two-pass
    # MXFP8 path (kernels/sm90_mxfp8_bf16.py); "" elsewhere (scale_recipe is checked).
    checked_scales: str = ""
    # SM100 block-scaled: the prep kernel also writes each expert's scale-factor descriptors
    # (slots desc_sfa / desc_sfb, over the expert's chunk of the blocked layout).
    sf_descriptors: bool = False
    # SM100 block-scaled: the scale dtype ("float8_e8m0fnu" | "float8_e4m3fn"; "" elsewhere),
    # checked against sf_vec by the kernel's can_implement rather than inferred from it.
    sf_dtype: str = ""
    # Kernel launches per call: 2, the prep kernel then the GEMM; 1, the GEMM does the prep
    # work itself before a hand-off (prep.PrepWork.prep_in_kernel; SM90 BF16). The
    # single launch needs the workspace's hand-off words zero before its first use.
    launches: int = 2
    # How the producer takes units (tiling.UNIT_SCHEDULES: 1 dynamic, 3 balanced; 3 in the
    # SM90 BF16 kernel only).
    unit_schedule: int = 1
    # Tests only (backends/blockscaled_sm100.py EVERY_MMA_STEP, never a spec's): the SM100
    # block-scaled MMA warp issues every K step of an expert's last K block, not only those
    # that start inside the expert, so that the per-expert TMA bounds alone (zero fill past
    # the expert's last token) keep another expert's tokens out of its sum.
    every_mma_step: bool = False

    # -- scales ------------------------------------------------------------------------
    @property
    def sf_rule(self):
        """(tokens per scale column, column padding) when experts find their scales by a
        prefix sum of columns (the workspace's sf_base), else None."""
        return column_rule(self.scale_recipe or self.checked_scales or None, self.sf_vec)

    # -- static tiling ------------------------------------------------------------------
    @property
    def tiles_m(self) -> int:
        return ceil_div(self.hidden, self.tile_m)

    @property
    def tiles_n(self) -> int:
        return ceil_div(self.intermediate, self.tile_n)

    @property
    def raster_group(self) -> int:
        return max(1, min(self.group_m, self.tiles_m))

    @property
    def tiles_per_expert(self) -> int:
        return self.tiles_m * self.tiles_n

    @property
    def num_units(self) -> int:
        """Units the unit space can hold: a tile per expert."""
        return self.num_experts * self.tiles_per_expert

    # -- ragged blocks ------------------------------------------------------------------
    @property
    def a_ragged_block(self) -> bool:
        """A's experts are separate K-contiguous blocks (own base and row stride)."""
        return self.input_order == "tensor_ragged" and self.a_major == "k"

    @property
    def b_ragged_block(self) -> bool:
        return self.input_order == "tensor_ragged" and self.b_major == "k"

    # -- workspace layout ---------------------------------------------------------------
    @property
    def desc_slots(self) -> int:
        """Descriptor slots per expert: A, B, (C: discrete outputs), (SFA, SFB)."""
        return (3 if self.output_mode == "discrete" else 2) + (2 if self.sf_descriptors else 0)

    @property
    def desc_sfa(self) -> int:
        return 3 if self.output_mode == "discrete" else 2

    @property
    def desc_sfb(self) -> int:
        return self.desc_sfa + 1

    @property
    def ranges_offset(self) -> int:
        return COUNTER_BYTES

    @property
    def order_offset(self) -> int:
        return COUNTER_BYTES + 8 * self.num_experts

    @property
    def sf_base_offset(self) -> int:
        return self.order_offset + 4 * self.num_experts

    @property
    def counts_words(self) -> bool:
        """The prep work writes the counts' spread and tokens words (the balanced unit
        schedule)."""
        return self.unit_schedule == SCHEDULE_BALANCED

    @property
    def desc_offset(self) -> int:
        end = self.sf_base_offset + (4 * self.num_experts if self.sf_rule else 0)
        return ceil_div(end, DESC_BYTES) * DESC_BYTES

    @property
    def workspace_bytes(self) -> int:
        return self.desc_offset + self.num_experts * self.desc_slots * DESC_BYTES

    @property
    def cutlass_ab_dtype(self):
        return CUTLASS_TYPES[self.ab_dtype]

    @property
    def cutlass_b_dtype(self):
        return CUTLASS_TYPES[self.b_dtype or self.ab_dtype]

    @property
    def cutlass_c_dtype(self):
        return CUTLASS_TYPES[self.c_dtype]



DESC_A, DESC_B, DESC_C = 0, 1, 2


# ----------------------------------------------------------------------------------------
# GEMM-domain views of the caller's storage
# ----------------------------------------------------------------------------------------


def gemm_views(cfg: ProblemConfig, a_ptr, b_ptr, tokens_sum: Int32):
    """A as (hidden, tokens_sum) and B as (intermediate, tokens_sum): the K mode is the token
    axis for both, with the strides the contract allows for each major."""
    m, n = cfg.hidden, cfg.intermediate
    t64 = Int64(tokens_sum)
    if cfg.a_major == "k":
        a_layout = cute.make_layout((m, tokens_sum), stride=(t64, 1))
    else:
        a_layout = cute.make_layout((m, tokens_sum), stride=(1, m))
    if cfg.b_major == "k":
        b_layout = cute.make_layout((n, tokens_sum), stride=(t64, 1))
    else:
        b_layout = cute.make_layout((n, tokens_sum), stride=(1, n))
    return cute.make_tensor(a_ptr, a_layout), cute.make_tensor(b_ptr, b_layout)


def dense_output_view(cfg: ProblemConfig, c_ptr):
    """The stacked (E, hidden, intermediate) output as (hidden, intermediate, E)."""
    m, n, e = cfg.hidden, cfg.intermediate, cfg.num_experts
    return cute.make_tensor(c_ptr, cute.make_layout((m, n, e), stride=(n, 1, m * n)))


def expert_output_view(cfg: ProblemConfig, c_ptr):
    m, n = cfg.hidden, cfg.intermediate
    return cute.make_tensor(c_ptr, cute.make_layout((m, n), stride=(n, 1)))


# ----------------------------------------------------------------------------------------
# Workspace access; objects the kernels' loops use
# ----------------------------------------------------------------------------------------


class Workspace:
    """Typed views of the workspace (see module doc). Built inside kernels from one pointer."""

    def __init__(self, cfg: ProblemConfig, base: cute.Pointer):
        self.cfg = cfg
        self.base = base  # Uint8 gmem pointer, 128-byte aligned
        e = cfg.num_experts
        self.counter = cute.make_tensor(
            cute.recast_ptr(base, dtype=Int32), cute.make_layout(1)
        )
        self.verdict = cute.make_tensor(
            cute.recast_ptr(base + VERDICT_BYTE, dtype=Int32), cute.make_layout(1)
        )
        self.live = cute.make_tensor(
            cute.recast_ptr(base + LIVE_BYTE, dtype=Int32), cute.make_layout(1)
        )
        self.prep_next = cute.recast_ptr(base + PREP_NEXT_BYTE, dtype=Int32)
        self.prep_done = cute.recast_ptr(base + PREP_DONE_BYTE, dtype=Int32)
        self.ranges = cute.make_tensor(
            cute.recast_ptr(base + cfg.ranges_offset, dtype=Int32), cute.make_layout(2 * e)
        )
        self.order = cute.make_tensor(
            cute.recast_ptr(base + cfg.order_offset, dtype=Int32), cute.make_layout(e)
        )
        # First scale column (blocked) or row (block_1x128) of every expert: a prefix sum.
        self.sf_base = cute.make_tensor(
            cute.recast_ptr(base + cfg.sf_base_offset, dtype=Int32), cute.make_layout(e)
        )
        self.spread = cute.make_tensor(
            cute.recast_ptr(base + SPREAD_BYTE, dtype=Int32), cute.make_layout(1)
        )
        self.tokens = cute.make_tensor(
            cute.recast_ptr(base + TOKENS_BYTE, dtype=Int32), cute.make_layout(1)
        )

    # Kernels carry a Workspace through dynamic loops: it is rebuilt from its base pointer.
    def __extract_mlir_values__(self):
        return cutlass.extract_mlir_values(self.base)

    def __new_from_mlir_values__(self, values):
        return Workspace(self.cfg, cutlass.new_from_mlir_values(self.base, values))

    def desc_ptr(self, expert: Int32, slot: int) -> cute.Pointer:
        off = self.cfg.desc_offset + (Int64(expert) * self.cfg.desc_slots + slot) * DESC_BYTES
        return (self.base + off).align(DESC_BYTES)


class LoopInvariant:
    """An object whose values are all set before the dynamic loops that use it and never
    change in them: it carries no value through them (the DSL asks every object a loop body
    calls a method of for the values to carry)."""

    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self
