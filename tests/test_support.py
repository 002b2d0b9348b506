"""``check_support()`` returning True means ``compile()`` succeeds: every tiling x cluster the
predicates accept compiles for its architecture (CPU, the DSL's --gpu-arch), and what they
reject is a ValueError naming the argument, on the GPU backends and on the CPU reference alike
(one predicate: gwgrad/kernels/tiling.py). The accepted combinations compile (marked ``compile``:
``python -m pytest -m compile``); the rejected ones are checked in the fast tier."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest

from gwgrad.kernels.tiling import (PROBLEMS, SM90_TILES, epi_buffer_sets_problem,
                                   unit_schedule_problem)

TILES = list(itertools.product((64, 128, 192, 256), (64, 96, 128, 160, 192, 224, 256)))
CLUSTERS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]
COMBOS = [(arch, tile, cluster) for arch in ("sm_90a", "sm_100a")
          for tile in TILES for cluster in CLUSTERS]


def _compiles_if(accepted: bool):
    """The marks of a parameter set that compiles a kernel when the predicate accepts it."""
    return [pytest.mark.compile] if accepted else []


def _spec(arch, tile, cluster, **kw):
    from kernel_compile import spec

    return spec(arch, tile=tile, cluster=cluster, **kw)


@pytest.mark.parametrize("arch,tile,cluster", [
    pytest.param(a, t, c, id=f"{a}-{t[0]}x{t[1]}-c{c[0]}{c[1]}",
                 marks=_compiles_if(PROBLEMS[a](t, c) is None)) for a, t, c in COMBOS])
def test_check_support_agrees_with_compile(arch, tile, cluster):
    pytest.importorskip("cutlass")
    from gwgrad import plan
    from gwgrad.backends import finalize_spec

    accepted = PROBLEMS[arch](tile, cluster) is None
    if not accepted:
        with pytest.raises(ValueError, match="^(mma_tiler_mn|cluster_shape_mn): "):
            finalize_spec(_spec(arch, tile, cluster))
        return
    spec, backend = finalize_spec(_spec(arch, tile, cluster, out="float32"))  # check_support
    operator = plan.CompiledOperator(spec, backend)  # compile() must succeed
    assert operator.handle is not None and operator.workspace_bytes > 0


@pytest.mark.parametrize("tile,cluster", [((100, 100), (1, 1)), ((128, 128), (3, 1)),
                                          ((512, 128), (1, 1)), ((128, 128), (2, 2))])
def test_the_cpu_reference_rejects_what_no_gpu_kernel_runs(tile, cluster):
    import numpy as np

    import gwgrad

    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = np.ones((16, 8), ml_dtypes.bfloat16)
    b = np.ones((8, 24), ml_dtypes.bfloat16)
    offsets = np.array([8], np.int32)
    with pytest.raises(ValueError, match="^(mma_tiler_mn|cluster_shape_mn): expected"):
        gwgrad.grouped_gemm_wgrad(a, b, offsets_tensor=offsets, mma_tiler_mn=tile,
                                  cluster_shape_mn=cluster)
    # A tiling some GPU kernel runs is fine on the CPU.
    (w,) = gwgrad.grouped_gemm_wgrad(a, b, offsets_tensor=offsets, mma_tiler_mn=(128, 128),
                                     cluster_shape_mn=(1, 1), wgrad_dtype="float32")
    np.testing.assert_array_equal(w, np.full((1, 16, 24), 8.0, np.float32))


SETS_COMBOS = ([("sm_90a", tile, sets) for tile in SM90_TILES for sets in (2, 3)]
               + [("sm_100a", (128, 128), 2)])


@pytest.mark.parametrize("arch,tile,sets", [
    pytest.param(a, t, s, id=f"{a}-{t[0]}x{t[1]}-sets{s}", marks=_compiles_if(
        epi_buffer_sets_problem(s, SM90_TILES[t] if a == "sm_90a" else None, cta_m=t[0]) is None))
    for a, t, s in SETS_COMBOS])
def test_epi_buffer_sets_support_agrees_with_compile(arch, tile, sets):
    """spec.epi_buffer_sets: the one predicate (tiling.epi_buffer_sets_problem) decides, and
    what it accepts compiles (a set of epilogue buffers per SM90 consumer group: pingpong,
    or cooperative on 128-row CTA tiles)."""
    pytest.importorskip("cutlass")
    from gwgrad import plan
    from gwgrad.backends import finalize_spec

    request = _spec(arch, tile, (1, 1), out="float32").with_tuning(epi_buffer_sets=sets)
    schedule = SM90_TILES[tile] if arch == "sm_90a" else None
    if epi_buffer_sets_problem(sets, schedule, cta_m=tile[0]) is not None:
        with pytest.raises(ValueError, match=rf"^epi_buffer_sets: expected 1.*got {sets}$"):
            finalize_spec(request)
        return
    spec, backend = finalize_spec(request)
    assert spec.epi_buffer_sets == sets
    operator = plan.CompiledOperator(spec, backend)
    assert operator.handle is not None and operator.workspace_bytes > 0


@pytest.mark.parametrize("tile,sets,ok", [((128, 128), 2, True), ((64, 256), 2, True),
                                          ((192, 128), 2, True), ((128, 256), 2, True),
                                          ((256, 128), 2, False), ((128, 128), 3, False)])
def test_the_cpu_reference_takes_the_epi_buffer_sets_a_gpu_kernel_runs(tile, sets, ok):
    from gwgrad.backends import finalize_spec

    request = _spec("cpu", tile, (1, 1)).with_tuning(epi_buffer_sets=sets)
    if ok:
        assert finalize_spec(request)[0].epi_buffer_sets == sets
    else:
        with pytest.raises(ValueError, match=rf"^epi_buffer_sets: expected 1.*got {sets}$"):
            finalize_spec(request)


@pytest.mark.parametrize("hidden,intermediate,tile,want", [
    (7168, 4096, (128, 128), 2),  # dsv3-fc1: 1792 128x128 tiles per expert, pingpong
    (2880, 5760, (128, 128), 2),  # gptoss-fc1: 1035
    (7168, 4096, None, 2),        # dsv3-fc1: 1792, a 1x2 pair of pingpong 128x128 CTAs
    (2048, 7168, None, 1),        # dsv3-fc2: 896
    (2048, 1536, None, 1),        # qwen3-30b-fc1: 192
    (4096, 28672, None, 2),       # mixtral-fc1: 7168, a 1x2 pair of pingpong 128x192 CTAs
    (768, 2048, None, 1),         # qwen3-30b-fc2: 96, a 1x2 pair of pingpong CTAs, < 1024
    (4096, 28672, (128, 256), 1),  # the cooperative 128x256 tile on a large output: one set
    (1536, 1024, (128, 256), 2),  # ... on <= 128 tiles per expert (fine-256e): a set per group
    (1536, 1024, (256, 128), 1),  # a 256-row cooperative CTA tile: one set (rows interleave)
    (7168, 4096, (64, 256), 2),   # a pingpong tile the caller chose, on a large output
    (7168, 4096, (192, 128), 2),
    (7168, 4096, (128, 256), 1),
    (7168, 4096, "float32", 1),   # FP32 outputs: no gain measured, one set
])
def test_the_sm90_default_epilogue_buffer_sets_follow_the_output_size(hidden, intermediate,
                                                                      tile, want):
    """SM90 BF16: a set of epilogue buffers per consumer group for 16-bit outputs of >= 1024
    128x128 tiles per expert with pingpong tiles, of <= 128 with cooperative 128-row tiles
    (docs/PERFORMANCE.md, defaults and why); a value the caller set stays."""
    pytest.importorskip("cutlass")

    from gwgrad.backends import finalize_spec
    from kernel_compile import spec

    out = tile if tile == "float32" else "bfloat16"
    tile = None if tile == "float32" else tile
    request = spec("sm_90a", hidden=hidden, intermediate=intermediate, tile=tile,
                   cluster=(1, 1) if tile else None, out=out)
    assert finalize_spec(request)[0].epi_buffer_sets == want
    if want == 2:
        chosen = request.with_tuning(epi_buffer_sets=1)
        assert finalize_spec(chosen)[0].epi_buffer_sets == 1
    for arch in ("sm_100a", "cpu"):  # no consumer groups / the reference: one set
        other = spec(arch, hidden=hidden, intermediate=intermediate)
        assert finalize_spec(other)[0].epi_buffer_sets == 1


@pytest.mark.parametrize("hidden,intermediate,experts,tokens,out,want", [
    (1536, 1024, 256, 65536, "bfloat16", ((192, 128), (1, 2))),   # fine-256e: 256 tokens
    (1536, 1024, 256, 98304, "bfloat16", ((192, 128), (1, 2))),   # 384 tokens per expert
    (768, 2048, 128, 32768, "bfloat16", ((192, 128), (1, 2))),    # qwen3-30b-fc2, 256 tokens
    (1536, 1024, 256, 0, "float16", ((192, 128), (1, 2))),        # no tokens yet: short
    (2048, 1024, 256, 65536, "bfloat16", ((128, 256), (2, 1))),   # 192 rows pad 3%
    (640, 1024, 256, 65536, "bfloat16", ((128, 256), (1, 1))),    # 5 row tiles: no pair
    (1536, 1024, 256, 65536, "float32", ((128, 128), (1, 2))),    # FP32: a pair sharing A
    (1536, 1024, 256, 65536, "accumulate32", ((128, 128), (1, 2))),
    (1536, 1024, 256, 65536, "accumulate", ((128, 128), (1, 1))),  # into BF16: not measured
    (192, 128, 16, 2048, "accumulate32", ((128, 128), (1, 1))),   # one column tile: no pair
    (192, 136, 16, 2048, "accumulate32", ((128, 128), (1, 2))),   # two (the second partial)
    (1536, 1024, 256, 131072, "bfloat16", ((128, 128), (1, 2))),  # 512 tokens per expert
    (1536, 1024, 256, 131072, "float32", ((128, 128), (1, 1))),
    (2048, 2816, 64, 16384, "bfloat16", ((128, 128), (1, 2))),    # 256 tokens, 352 tiles
    (768, 2048, 128, 131072, "bfloat16", ((128, 128), (1, 2))),   # qwen3-30b-fc2: 1024
    (1536, 1024, 256, None, "bfloat16", ((128, 128), (1, 2))),    # tokens unknown: static
])
def test_the_sm90_tiling_for_short_experts(hidden, intermediate, experts, tokens, out, want):
    """SM90 BF16: outputs of <= 128 128x128 tiles per expert with <= 384 tokens per expert on
    average take a 1x2 pair of pingpong 192x128 tiles where 192 rows fit `hidden` (16-bit
    outputs), else the cooperative 128x256 tile (a 2x1 pair of them where the pair fits the
    rows), or a 1x2 cluster (FP32 outputs of more than one 128-column tile)
    (docs/PERFORMANCE.md, defaults and why); a tiling the caller set stays, and the
    other backends keep their defaults."""
    pytest.importorskip("cutlass")
    from gwgrad.backends import finalize_spec
    from kernel_compile import spec

    acc = out.startswith("accumulate")
    dtype = {"accumulate": "bfloat16", "accumulate32": "float32"}.get(out, out)
    request = spec("sm_90a", hidden=hidden, intermediate=intermediate, experts=experts,
                   out=dtype, acc=acc)
    final = finalize_spec(request, tokens)[0]
    assert (final.mma_tiler_mn, final.cluster_shape_mn) == want
    for tile, cluster in (((128, 128), None), (None, (1, 1)), ((128, 128), (1, 1))):
        chosen = finalize_spec(spec("sm_90a", hidden=hidden, intermediate=intermediate,
                                    experts=experts, tile=tile, cluster=cluster), tokens)[0]
        assert chosen.mma_tiler_mn == (tile or (128, 128)), (tile, cluster)
        assert chosen.cluster_shape_mn == (cluster or (1, 1)), (tile, cluster)
    for arch in ("sm_100a", "cpu"):
        other = spec(arch, hidden=hidden, intermediate=intermediate, experts=experts)
        assert finalize_spec(other, tokens)[0] == finalize_spec(other)[0]


def test_the_grid_is_whole_resident_clusters(monkeypatch):
    """1x1: one CTA per SM (or per unit); clusters: whole clusters, no more than are resident
    at once (persistent, like the 1x1 grid)."""
    from types import SimpleNamespace

    from gwgrad import grid

    monkeypatch.setattr(grid, "_sm_count", lambda device: 132)
    monkeypatch.setattr(grid, "_max_active_clusters", lambda device, size: 60)
    cfg = lambda units, cm=1, cn=1: SimpleNamespace(num_units=units, cluster_m=cm, cluster_n=cn)
    assert grid.grid_size(cfg(1000), 0) == 132
    assert grid.grid_size(cfg(7), 0) == 7
    assert grid.grid_size(cfg(1000, 1, 2), 0) == 120
    assert grid.grid_size(cfg(7, 2, 1), 0) == 14  # a unit is a cluster's tile
    assert grid.grid_size(cfg(1000, 2, 2), 0) == 240
    # Without a GPU (a JAX custom call lowered with CUTE_DSL_ARCH set): the arch's SM count.
    assert grid.grid_size_for_arch(cfg(1000), "sm_90a") == 132  # the device's, when present

    def no_gpu(*device):
        raise RuntimeError("no CUDA device")

    monkeypatch.setattr(grid, "_sm_count", no_gpu)
    monkeypatch.setattr(grid, "_max_active_clusters", no_gpu)
    assert grid.grid_size_for_arch(cfg(1000), "sm_100a") == 148
    assert grid.grid_size_for_arch(cfg(1000, 2, 1), "sm_90a") == 132
    assert grid.grid_size_for_arch(cfg(7), "sm_90a") == 7


def test_launches_per_call():
    """SM90 BF16 runs in one launch by default (the prep work inside the GEMM); the other
    kernels keep the prep kernel (2); JAX's custom call asks for 2 (XLA's workspace is not
    zeroed); anything else is a ValueError naming ``launches``."""
    pytest.importorskip("cutlass")

    from gwgrad.backends import finalize_spec
    from kernel_compile import fp8_spec, spec

    assert finalize_spec(spec("sm_90a"))[0].launches == 1
    assert finalize_spec(spec("sm_90a", out="float32", acc=True, cluster=(1, 2)))[0].launches == 1
    assert finalize_spec(spec("sm_90a").with_tuning(launches=2))[0].launches == 2
    assert finalize_spec(fp8_spec("sm_90a", "per_expert_channel"))[0].launches == 2
    assert finalize_spec(spec("sm_100a"))[0].launches == 2
    for request, launches, match in (
            (fp8_spec("sm_90a", "block_1x128"), 1, r"^launches: expected 2 here \(the fp8_sm90"),
            (spec("sm_100a"), 1, r"^launches: expected 2 here \(the bf16_sm100"),
            (spec("sm_90a"), 3, r"^launches: expected 1 or 2 kernel launches per call, got 3")):
        with pytest.raises(ValueError, match=match):
            finalize_spec(request.with_tuning(launches=launches))


@pytest.mark.parametrize("arch,schedule,cluster,ok", [
    ("sm_90a", 3, (2, 1), True), ("cpu", 3, (1, 2), True),
    ("cpu", 3, (1, 1), True), ("sm_90a", 1, (1, 1), True), ("sm_90a", 0, (1, 1), True),
    ("sm_90a", 5, (1, 1), False),
    ("sm_90a", -1, (1, 1), False),
    ("sm_100a", 3, (1, 1), False), ("sm_100a", 1, (1, 1), True),
])
def test_unit_schedule_one_predicate(arch, schedule, cluster, ok):
    """spec.unit_schedule: tiling.unit_schedule_problem decides for the SM90 and SM100 kernels
    and the CPU reference alike (0 default and 1 dynamic everywhere; 3 balanced in SM90 BF16
    only); what it refuses is a ValueError naming unit_schedule, and finalize_spec resolves
    0."""
    from gwgrad.backends import finalize_spec

    assert (unit_schedule_problem(schedule, False, arch) is None) == ok
    assert unit_schedule_problem(3, True, "sm_90a") is not None  # block-scaled
    assert unit_schedule_problem(1, True, "sm_90a") is None
    if arch != "cpu":
        pytest.importorskip("cutlass")
    request = _spec(arch, (128, 128), cluster).with_tuning(unit_schedule=schedule)
    if ok:
        final = finalize_spec(request)[0].unit_schedule
        assert final == schedule if schedule else final in (1, 3)
    else:
        with pytest.raises(ValueError, match=r"^unit_schedule: expected"):
            finalize_spec(request)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "cpu"])
@pytest.mark.parametrize("schedule", [2, 4])
def test_unit_schedules_without_a_kernel_are_rejected(arch, schedule):
    """A spec carries only the dynamic (1) and balanced (3) schedules (0: the backend's
    default); the static order runs only as the balanced schedule's half. 2 and 4 are a
    ValueError naming unit_schedule, from the predicate, from finalize_spec (GPU backends and
    the CPU reference) and from the SM90 kernel's can_implement."""
    from gwgrad.backends import finalize_spec

    detail = (f"expected 0 (the backend's default), 1 (dynamic) or 3 (balanced), "
              f"got {schedule}")
    want = "^unit_schedule: " + re.escape(detail) + "$"
    assert unit_schedule_problem(schedule, False, arch) == ("unit_schedule", detail)
    if arch != "cpu":
        pytest.importorskip("cutlass")
    cluster = (1, 1) if arch == "sm_100a" else (1, 2)
    request = _spec(arch, (128, 128), cluster).with_tuning(unit_schedule=schedule)
    with pytest.raises(ValueError, match=want):
        finalize_spec(request)
    if arch == "sm_90a":
        from gwgrad.backends.bf16_sm90 import Bf16Sm90Backend
        from gwgrad.kernels.sm90_bf16 import Sm90GroupedWgrad

        final = finalize_spec(request.with_tuning(unit_schedule=1))[0]
        cfg = dataclasses.replace(Bf16Sm90Backend().config(final), unit_schedule=schedule)
        assert Sm90GroupedWgrad.can_implement(cfg)[0] == "unit_schedule"
        with pytest.raises(ValueError, match=want):
            Sm90GroupedWgrad(cfg)


@pytest.mark.parametrize("recipe,hidden,intermediate,tile,cluster", [
    ("per_expert_channel", 512, 768, (128, 192), (2, 1)),
    ("per_expert_channel", 384, 768, (128, 192), (1, 1)),  # 3 row tiles: a pair's CTA idle
    ("per_expert_channel", 2944, 768, (128, 192), (2, 1)),  # 23 row tiles: >= 16, it fits
    ("block_1x128", 512, 768, (128, 192), (1, 1)),
    ("per_expert_channel", 512, 128, (128, 128), (1, 1)),
    ("block_1x128", 512, 128, (128, 128), (1, 1)),
    ("blocked", 512, 768, (64, 128), (1, 1)), ("blocked", 512, 128, (64, 128), (1, 1)),
])
@pytest.mark.parametrize("tokens_per_expert", [None, 512, 4096])
def test_fp8_sm90_default_tiling(recipe, hidden, intermediate, tile, cluster, tokens_per_expert):
    """The SM90 FP8 defaults (measured, backends/fp8_sm90.py): 128x192 for the channel and
    1x128 recipes (128x128 on outputs of one 128-column tile), the channel recipe on a 2x1
    pair where the pair fits the hidden extent, the pingpong 64x128 for MXFP8, one staging
    set, whatever the call's tokens past the short experts' 384."""
    from gwgrad.backends import finalize_spec
    from kernel_compile import fp8_spec

    request = fp8_spec("sm_90a", recipe, hidden=hidden, intermediate=intermediate)
    tokens = None if tokens_per_expert is None else tokens_per_expert * request.num_experts
    spec, _ = finalize_spec(request, tokens)
    assert (spec.mma_tiler_mn, spec.cluster_shape_mn, spec.epi_buffer_sets) == (tile, cluster, 1)


@pytest.mark.parametrize("recipe,hidden,tile,cluster,sets", [
    ("per_expert_channel", 1536, (128, 192), (2, 1), 2),  # fine-256e
    ("block_1x128", 1536, (128, 192), (2, 1), 2),
    ("block_1x128", 384, (128, 192), (1, 1), 2),  # 3 row tiles: no pair; still two sets
    ("blocked", 1536, (64, 128), (1, 1), 1),  # MXFP8: its pingpong tile, one set
])
def test_fp8_sm90_short_expert_tiling(recipe, hidden, tile, cluster, sets):
    """Short experts (<= 384 tokens, <= 128 output tiles each; tokens known) on the FP32
    recipes: the cooperative 128x192 on a 2x1 pair where it fits the hidden extent, a staging
    set per consumer group (16-bit outputs); FP32 outputs keep one set."""
    from gwgrad.backends import finalize_spec
    from kernel_compile import fp8_spec

    request = fp8_spec("sm_90a", recipe, hidden=hidden, intermediate=1024, experts=256)
    spec, _ = finalize_spec(request, 256 * 256)
    assert (spec.mma_tiler_mn, spec.cluster_shape_mn, spec.epi_buffer_sets) == (
        tile, cluster, sets)
    f32 = finalize_spec(fp8_spec("sm_90a", recipe, hidden=hidden, intermediate=1024,
                                 experts=256, out="float32", acc=True), 256 * 256)[0]
    assert f32.epi_buffer_sets == 1


@pytest.mark.parametrize("hidden,intermediate,experts,tokens,out,acc,tile,cluster,schedule", [
    # 16-bit outputs where 192 rows fit hidden and 128 rows do not: pingpong 192x128 alone
    (2880, 5760, 32, 65536, "float16", False, (192, 128), (1, 1), 1),  # gptoss-fc1: 15 exact
    # 16-bit outputs: 1x2 pairs of pingpong CTAs, balanced
    (768, 2048, 128, 131072, "bfloat16", False, (128, 128), (1, 2), 3),  # qwen3-30b-fc2
    (2048, 2816, 64, 32768, "bfloat16", False, (128, 128), (1, 2), 3),  # dsv2lite-fc1
    # 192-wide column tiles where they pad intermediate by <= 1%: 1x2 pairs of 128x192
    (4096, 28672, 8, 32768, "bfloat16", False, (128, 192), (1, 2), 3),  # mixtral-fc1: 0.45%
    (2048, 1536, 128, 131072, "bfloat16", False, (128, 192), (1, 2), 3),  # qwen3-30b-fc1
    (640, 32768, 8, 65536, "bfloat16", False, (128, 192), (1, 2), 3),  # 171 tiles: odd, >= 16
    (768, 384, 128, 131072, "bfloat16", False, (128, 192), (1, 2), 3),  # 2 tiles of 192
    # else 1x2 pairs of 128x128 below 4096 tiles
    (7168, 4096, 32, 65536, "bfloat16", False, (128, 128), (1, 2), 3),  # dsv3-fc1: 3.1% pad
    (2048, 7168, 32, 65536, "bfloat16", False, (128, 128), (1, 2), 3),  # dsv3-fc2: 1.8% pad
    (1536, 1024, 256, 65536, "bfloat16", False, (192, 128), (1, 2), 3),  # fine-256e: short
    (768, 2048, 128, 131072, "bfloat16", True, (128, 128), (1, 1), 1),  # 16-bit accumulate
    (768, 128, 128, 131072, "bfloat16", False, (128, 128), (1, 1), 1),  # one column tile
    (768, 640, 128, 131072, "bfloat16", False, (128, 128), (1, 1), 1),  # 5 column tiles: odd
    # FP32 outputs: pairs from 1024 tiles per expert, balanced; short experts' pairs dynamic
    (7168, 4096, 32, 65536, "float32", True, (128, 128), (1, 2), 3),  # dsv3-fc1
    (4096, 28672, 8, 32768, "float32", True, (128, 128), (1, 2), 3),  # mixtral-fc1
    (768, 2048, 128, 131072, "float32", True, (128, 128), (1, 1), 1),  # qwen3-30b-fc2
    (1536, 1024, 256, 65536, "float32", True, (128, 128), (1, 2), 1),  # fine-256e: short
])
def test_sm90_bf16_default_tiling(hidden, intermediate, experts, tokens, out, acc, tile,
                                  cluster, schedule):
    """The SM90 BF16 defaults (the SM90_BF16 rules, backends/tuning_rules.py) on the
    benchmark's shapes (docs/PERFORMANCE.md, defaults and why): CTA pairs with the balanced
    schedule where they measured faster, the 1x1 dynamic kernel elsewhere, never a pair over an
    odd count (below 16) of 128-wide tiles along the pair."""
    from gwgrad.backends import finalize_spec

    from kernel_compile import spec

    request = spec("sm_90a", hidden=hidden, intermediate=intermediate, experts=experts,
                   out=out, acc=acc)
    final = finalize_spec(request, tokens)[0]
    assert (final.mma_tiler_mn, final.cluster_shape_mn, final.unit_schedule) == (
        tile, cluster, schedule)
    if final.unit_schedule != 1:  # a schedule the caller sets stays (dynamic pair)
        dyn = finalize_spec(request.with_tuning(unit_schedule=1), tokens)[0]
        assert dyn.cluster_shape_mn == cluster and dyn.unit_schedule == 1


def test_sm90_bf16_pairs_only_when_the_tiling_is_left_open():
    """A caller who sets the tile (or the cluster) gets the 1x1 defaults of before: the tile
    alone runs without a cluster, a 1x1 cluster alone gets the 1x1 default tile (128x256 on a
    wide output), with the dynamic schedule."""
    from gwgrad.backends import finalize_spec

    from kernel_compile import spec

    mid = dict(hidden=7168, intermediate=4096, experts=32)  # dsv3-fc1: a 1x2 pair by default
    wide = dict(hidden=4096, intermediate=28672, experts=8)  # mixtral-fc1: a 1x2 pair of 128x192
    paired = finalize_spec(spec("sm_90a", **mid))[0]
    assert (paired.mma_tiler_mn, paired.cluster_shape_mn) == ((128, 128), (1, 2))
    assert finalize_spec(spec("sm_90a", **wide))[0].cluster_shape_mn == (1, 2)
    for tile in ((128, 256), (128, 128)):
        tile_only = finalize_spec(spec("sm_90a", tile=tile, **mid))[0]
        assert tile_only.cluster_shape_mn == (1, 1) and tile_only.unit_schedule == 1
    cluster_only = finalize_spec(spec("sm_90a", cluster=(1, 1), **mid))[0]
    assert cluster_only.mma_tiler_mn == (128, 128) and cluster_only.unit_schedule == 1
    cluster_only = finalize_spec(spec("sm_90a", cluster=(1, 1), **wide))[0]
    assert cluster_only.mma_tiler_mn == (128, 256) and cluster_only.unit_schedule == 1
    pair = finalize_spec(spec("sm_90a", cluster=(1, 2), **wide))[0]
    assert pair.mma_tiler_mn == (128, 256) and pair.unit_schedule == 3


@pytest.mark.parametrize("arch", ["cpu", "sm_90a"])
@pytest.mark.parametrize("tile", [(128, 128), (128, 192)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_a_set_per_cooperative_group_runs_with_fp8_inputs(arch, tile):
    """epi_buffer_sets=2 on the FP8 cooperative tiles (128 rows: each consumer group stores
    its 64) is accepted by the GPU backend and the CPU reference alike; the SM100 block-scaled
    kernel, one epilogue at a time, refuses it (ValueError naming the argument)."""

    if arch != "cpu":
        pytest.importorskip("cutlass")
    from gwgrad.backends import finalize_spec
    from kernel_compile import fp8_spec

    request = fp8_spec(arch, "block_1x128", tile=tile, cluster=(1, 1))
    assert finalize_spec(request.with_tuning(epi_buffer_sets=2))[0].epi_buffer_sets == 2
    blackwell = fp8_spec("sm_100a", "blocked", tile=(256, 128), cluster=(2, 1))
    with pytest.raises(ValueError, match=r"^epi_buffer_sets: expected 1 with the SM100 kernel"):
        finalize_spec(blackwell.with_tuning(epi_buffer_sets=2))
