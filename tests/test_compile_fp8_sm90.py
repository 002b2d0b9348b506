"""The SM90 FP8 kernel (kernels/sm90_fp8.py) compiles for sm_90a without a GPU for every scale
recipe and mode; its PTX holds FP8 WGMMA, the offsets check and, for the recipes whose scales
change along the tokens, the per-stage TMA loads of the scales. Unsupported inputs are refused
by check_support with the argument named."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("cutlass")

from kernel_compile import check_offsets_check_ptx, compile_ptx, fp8_spec, kernel_bodies  # noqa: E402

RECIPES = ["per_expert_channel", "block_1x128", "blocked"]
MODES = [
    dict(),
    dict(mode="discrete", out="float32", acc=True, order="tensor_ragged"),
    dict(out="float16", acc=True, global_scales=True),
]


def tma_loads(gemm: str) -> int:
    return len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", gemm))


@pytest.mark.compile
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("case", range(len(MODES)))
def test_recipe_compiles_with_fp8_wgmma(recipe, case):
    kw = dict(MODES[case])
    ptx = compile_ptx(fp8_spec("sm_90a", recipe, **kw))
    check_offsets_check_ptx(ptx)
    _, gemm = kernel_bodies(ptx)
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", gemm)
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16" not in gemm
    # A and B (the channel recipe's default 2x1 pair multicasts B), plus the scales of each
    # stage when they change along the tokens.
    assert tma_loads(gemm) + multicast_loads(gemm) == (2 if recipe == "per_expert_channel" else 4)
    if kw.get("acc"):
        assert "cp.reduce.async.bulk.tensor" in gemm


@pytest.mark.compile
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("tile", [(64, 128), (128, 192)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_fp8_tiles_compile(recipe, tile):
    ptx = compile_ptx(fp8_spec("sm_90a", recipe, tile=tile, cluster=(1, 1)))
    _, gemm = kernel_bodies(ptx)
    # Channel and 1x128 scales: each K block's WGMMAs run over the tile's two column halves
    # (one promoted while the other runs); MXFP8 promotes whole-tile instructions.
    n = tile[1] if recipe == "blocked" else tile[1] // 2
    assert re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32", gemm) == [str(n)] * (
        4 if recipe == "blocked" else 8)
    if recipe != "blocked":
        # Two commit groups per K block, each waited for with one group still in flight
        # (plus the unit's last wait for none).
        assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+1;", gemm)) == 2
        assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+0;", gemm)) == 1
    if recipe == "blocked" and tile[1] == 192:  # B scale atoms straddling 128-row blocks
        assert tma_loads(gemm) == 5


def multicast_loads(gemm: str) -> int:
    return len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global\S*multicast",
                          gemm))


@pytest.mark.compile
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("cluster", [(1, 2), (2, 1)], ids=["1x2", "2x1"])
def test_pairs_multicast_the_shared_operand_only(recipe, cluster):
    """A CTA pair multicasts the operand its CTAs share (A on 1x2, B on 2x1); each CTA loads
    the other operand and its own tile's scales without multicast."""
    tile = (64, 128) if recipe == "blocked" else (128, 192)
    ptx = compile_ptx(fp8_spec("sm_90a", recipe, tile=tile, cluster=cluster))
    _, gemm = kernel_bodies(ptx)
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", gemm)
    assert "barrier.cluster.arrive" in gemm
    assert multicast_loads(gemm) == 1
    assert tma_loads(gemm) == (1 if recipe == "per_expert_channel" else 3)


@pytest.mark.compile
@pytest.mark.parametrize("recipe,tile,cluster", [
    ("per_expert_channel", (128, 192), (2, 1)),
    ("block_1x128", (128, 128), (1, 2)),
], ids=["channel-128x192-2x1", "1x128-128x128-1x2"])
def test_cooperative_epilogue_buffer_set_per_group(recipe, tile, cluster):
    """epi_buffer_sets=2 on the FP8 cooperative tiles: as in the BF16 kernel, each consumer
    group stores its own 64 rows through its own staging buffers (128-thread barriers instead
    of 256-thread ones) and the groups take turns (one 256-thread wait per unit); the scaled
    mainloop is untouched; ptxas spills nothing."""
    from kernel_compile import compile_cubin, cubin_resources

    base = fp8_spec("sm_90a", recipe, hidden=1536, intermediate=1024, experts=64, tile=tile,
                    cluster=cluster).with_tuning(epi_buffer_sets=1)
    shared = compile_ptx(base)
    split = compile_ptx(base.with_tuning(epi_buffer_sets=2))
    assert re.findall(r"bar\.sync\s+\d+, 256;", shared)
    assert not re.findall(r"bar\.sync\s+\d+, 256;", split)
    assert re.findall(r"bar\.sync\s+%r\d+, 128;", split)
    assert len(re.findall(r"bar\.sync\s+%r\d+, 256;", split)) == 1  # its turn
    assert shared.count("wgmma.mma_async") == split.count("wgmma.mma_async")
    assert max(cubin_resources(compile_cubin(base.with_tuning(epi_buffer_sets=2)))["frame"]) == 0


@pytest.mark.compile
def test_mixed_e4m3_e5m2():
    ptx = compile_ptx(fp8_spec("sm_90a", "per_expert_channel", a="e4m3", b="e5m2"))
    assert "f32.e4m3.e5m2" in ptx


@pytest.mark.parametrize("which,major", [("a_tensor", dict(a_major="m")),
                                         ("b_tensor", dict(b_major="n"))])
def test_mn_major_fp8_is_refused(which, major):
    from gwgrad.backends import finalize_spec

    with pytest.raises(ValueError, match=f"{which}.*K-major"):
        finalize_spec(fp8_spec("sm_90a", "block_1x128", **major))


def test_fp4_needs_sm100():
    import dataclasses

    from gwgrad.backends import finalize_spec
    from gwgrad.dtypes import DType

    nvfp4 = dataclasses.replace(fp8_spec("sm_90a", "blocked"), a_dtype=DType.FLOAT4_E2M1FN_X2,
                                b_dtype=DType.FLOAT4_E2M1FN_X2, sf_dtype=DType.FLOAT8_E4M3FN,
                                sf_vec_size=16, has_global_scale=True)
    with pytest.raises(RuntimeError, match="sm_90a"):
        finalize_spec(nvfp4)


@pytest.mark.parametrize("tile", [(128, 256), (256, 128), (64, 256)])
def test_tiles_without_room_for_two_accumulators(tile):
    from gwgrad.backends import finalize_spec

    with pytest.raises(ValueError, match="mma_tiler_mn"):
        finalize_spec(fp8_spec("sm_90a", "per_expert_channel", tile=tile, cluster=(1, 1)))
