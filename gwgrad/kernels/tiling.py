"""Which tilings each kernel implements: pure predicates, no CuTe DSL import.

The backends' ``check_support`` (and through it ``compile``), the reference backend (so that a
tiling that no GPU kernel runs is rejected on the CPU too) and the tests use these; the kernel
modules import them rather than restating the rules.
"""

from __future__ import annotations

from typing import Optional, Tuple

Pair = Tuple[int, int]

#: SM90 (mma_tiler_mn) -> schedule. 128x192, 192x128, 128x128 and 64xN tiles run one tile per
#: consumer warp group (pingpong); 128x256 and 256x128 split one tile over both (cooperative).
#: A consumer thread holds at most 192 FP32 accumulators (128x192 and 192x128 pingpong).
SM90_TILES = {
    (128, 256): "cooperative",
    (256, 128): "cooperative",
    (128, 192): "pingpong",
    (192, 128): "pingpong",
    (128, 128): "pingpong",
    (64, 256): "pingpong",
    (64, 128): "pingpong",
}
#: SM90 FP8 (scaled) tiles: a second FP32 accumulator per thread (2xAcc) halves what fits.
SM90_FP8_TILES = {
    (128, 128): "cooperative",
    (128, 192): "cooperative",
    (64, 128): "pingpong",
    (64, 192): "pingpong",
}
#: SM90 BF16 clusters: a CTA pair along N shares A (1, 2) or along M shares B (2, 1), loaded
#: once from L2 by TMA multicast. The scaled FP8 kernel runs the pairs too (each CTA loads its
#: own scales).
SM90_CLUSTERS = ((1, 1), (1, 2), (2, 1))
SM90_FP8_CLUSTERS = SM90_CLUSTERS
SM100_CLUSTERS = ((1, 1), (2, 1), (4, 1))
SM100_BLOCKSCALED_TILES = ((128, 128), (128, 256), (256, 128), (256, 256))


def sm90_problem(mma_tiler_mn: Pair, cluster_shape_mn: Pair) -> Optional[Tuple[str, str]]:
    """(argument, detail) of the first reason the SM90 kernel cannot run this tiling, or None."""
    if tuple(mma_tiler_mn) not in SM90_TILES:
        return "mma_tiler_mn", (f"expected one of {sorted(SM90_TILES)} on SM90, got "
                                f"{tuple(mma_tiler_mn)}")
    if tuple(cluster_shape_mn) not in SM90_CLUSTERS:
        return "cluster_shape_mn", (f"expected one of {list(SM90_CLUSTERS)} on SM90, got "
                                    f"{tuple(cluster_shape_mn)}")
    return None


def sm90_schedule(mma_tiler_mn: Pair) -> str:
    return SM90_TILES[tuple(mma_tiler_mn)]


def epi_buffer_sets_problem(sets: int, schedule: Optional[str],
                            cta_m: int = 128) -> Optional[Tuple[str, str]]:
    """(argument, detail) unless a kernel with ``schedule`` ("cooperative" | "pingpong" on
    SM90; None: SM100, no consumer groups) runs ``sets`` sets of epilogue staging buffers
    (0: the default, 1). 2 gives each SM90 consumer group a set of its own: pingpong groups
    then overlap their epilogues; cooperative groups of a 128-row CTA tile (``cta_m``) store
    their own 64 rows in turn (the BF16 and the scaled FP8 kernels alike)."""
    if sets in (0, 1) or (sets == 2 and schedule == "pingpong"):
        return None
    if sets == 2 and schedule == "cooperative":
        if cta_m != 128:
            return "epi_buffer_sets", (f"expected 1 with a cooperative CTA tile of {cta_m} "
                                       f"rows (2 needs 128: each consumer group stores 64 "
                                       f"contiguous rows), got 2")
        return None
    if sets == 2:
        return "epi_buffer_sets", ("expected 1 with the SM100 kernel, which runs one epilogue "
                                   "at a time (2, a set of epilogue buffers per consumer "
                                   "group, needs an SM90 tile), got 2")
    return "epi_buffer_sets", ("expected 1, or 2 with an SM90 tile (a set of epilogue "
                               f"buffers per consumer group), got {sets}")


#: spec.unit_schedule: how a CTA (cluster) takes its output-tile units. DEFAULT (0) is resolved by
#: the backend (finalize_spec); DYNAMIC: the first unit is the block's (cluster's) index, the
#: next ones come from an atomic counter (a cluster's leader takes them and hands them to its
#: peers); BALANCED: a static order (units b, b + grid, b + 2 * grid, ... with no counter and
#: no hand-off) on a launch whose expert counts are balanced (the largest minus the smallest
#: nonzero count at most BALANCED_SPREAD of one CTA's share of the work), else DYNAMIC,
#: decided by the kernel from the counts (no host sync). The static order runs only as that
#: half of BALANCED; 2 and 4 are not schedules.
UNIT_SCHEDULES = {0: "default", 1: "dynamic", 3: "balanced"}
SCHEDULE_DEFAULT, SCHEDULE_DYNAMIC, SCHEDULE_BALANCED = 0, 1, 3
#: BALANCED's bound: units are handed out longest expert first, so a static order leaves any
#: two CTAs' work within one unit's length of each other (the largest count minus the
#: smallest): static when that is at most 1/BALANCED_SPREAD of a CTA's share.
BALANCED_SPREAD = 50


def unit_schedule_problem(unit_schedule: int, block_scaled: bool,
                          arch: str = "sm_90a") -> Optional[Tuple[str, str]]:
    """(argument, detail) unless ``unit_schedule`` runs: DEFAULT and DYNAMIC everywhere;
    BALANCED in the SM90 BF16 kernel."""
    if unit_schedule not in UNIT_SCHEDULES:
        return "unit_schedule", ("expected 0 (the backend's default), 1 (dynamic) or 3 "
                                 f"(balanced), got {unit_schedule!r}")
    if unit_schedule in (SCHEDULE_DEFAULT, SCHEDULE_DYNAMIC):
        return None
    name = UNIT_SCHEDULES[unit_schedule]
    if block_scaled or arch not in ("sm_90a", "cpu"):
        what = "block-scaled inputs" if block_scaled else arch
        return "unit_schedule", (f"expected 0 or 1 (dynamic): a {name} schedule runs in the SM90 "
                                 f"BF16 kernel only, not for {what}; got {unit_schedule}")
    return None


def any_gpu_epi_buffer_sets_problem(sets: int, mma_tiler_mn: Pair,
                                    block_scaled: bool) -> Optional[Tuple[str, str]]:
    """epi_buffer_sets_problem for the SM90 kernel of the family that runs ``mma_tiler_mn``
    (a CTA's tile on SM90, whatever the cluster) (what the CPU reference accepts)."""
    tiles = SM90_FP8_TILES if block_scaled else SM90_TILES
    return epi_buffer_sets_problem(sets, tiles.get(tuple(mma_tiler_mn)), mma_tiler_mn[0])


def sm90_fp8_problem(mma_tiler_mn: Pair, cluster_shape_mn: Pair) -> Optional[Tuple[str, str]]:
    """(argument, detail) of the first reason the SM90 FP8 kernel cannot run this tiling."""
    if tuple(mma_tiler_mn) not in SM90_FP8_TILES:
        return "mma_tiler_mn", (f"expected one of {sorted(SM90_FP8_TILES)} for FP8 on SM90, "
                                f"got {tuple(mma_tiler_mn)}")
    if tuple(cluster_shape_mn) not in SM90_FP8_CLUSTERS:
        return "cluster_shape_mn", (f"expected one of {list(SM90_FP8_CLUSTERS)} for FP8 on "
                                    f"SM90, got {tuple(cluster_shape_mn)}")
    return None


def sm100_problem(mma_tiler_mn: Pair, cluster_shape_mn: Pair) -> Optional[Tuple[str, str]]:
    """(argument, detail) of the first reason the SM100 kernel cannot run this tiling, or None."""
    m, n = mma_tiler_mn
    if m not in (128, 256):
        return "mma_tiler_mn", f"expected tile M 128 or 256 on SM100, got {m}"
    if n < 64 or n > 256 or n % 32 != 0:
        return "mma_tiler_mn", f"expected tile N a multiple of 32 in [64, 256] on SM100, got {n}"
    if tuple(cluster_shape_mn) not in SM100_CLUSTERS:
        return "cluster_shape_mn", (f"expected (1, 1), (2, 1) or (4, 1) on SM100 (clusters "
                                    f"along M), got {tuple(cluster_shape_mn)}")
    if m == 256 and cluster_shape_mn[0] % 2:
        return "cluster_shape_mn", ("expected an even cluster M for a 256-row tile (a 2-CTA "
                                    f"MMA), got {tuple(cluster_shape_mn)}")
    return None


def sm100_blockscaled_problem(mma_tiler_mn: Pair,
                              cluster_shape_mn: Pair) -> Optional[Tuple[str, str]]:
    """(argument, detail) of the first reason the SM100 block-scaled kernel cannot run this
    tiling: the contract's tiles ({128, 256} x {128, 256}: one scale-factor atom column per
    128 rows and columns) on the BF16 kernel's clusters."""
    if tuple(mma_tiler_mn) not in SM100_BLOCKSCALED_TILES:
        return "mma_tiler_mn", (f"expected one of {list(SM100_BLOCKSCALED_TILES)} for "
                                f"block-scaled inputs on SM100, got {tuple(mma_tiler_mn)}")
    return sm100_problem(mma_tiler_mn, cluster_shape_mn)


def sm100_cta_tile_m(mma_tiler_mn: Pair) -> int:
    """Rows of one CTA's share of an MMA tile (a 256-row tile spans a CTA pair)."""
    return mma_tiler_mn[0] // (2 if mma_tiler_mn[0] == 256 else 1)


def any_gpu_tiling_problem(mma_tiler_mn: Pair, cluster_shape_mn: Pair,
                           block_scaled: bool) -> Optional[Tuple[str, str]]:
    """None when some GPU kernel of the family runs this tiling (what the CPU reference
    accepts, so that code tested on the CPU does not fail on a GPU), else the first
    architecture's reason with the others' appended."""
    checks = ((sm90_fp8_problem, sm100_blockscaled_problem) if block_scaled
              else (sm90_problem, sm100_problem))
    problems = [check(mma_tiler_mn, cluster_shape_mn) for check in checks]
    if not all(problems):
        return None
    argument, detail = problems[0]
    return argument, f"{detail} (and on SM100: {problems[1][1]})"


#: Architecture -> its tiling predicate.
PROBLEMS = {"sm_90a": sm90_problem, "sm_100a": sm100_problem, "sm_103a": sm100_problem}
