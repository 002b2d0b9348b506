"""The SM100 block-scaled kernel (kernels/sm100_blockscaled.py) compiles for sm_100a without a
GPU for every format (MXFP8, NVFP4, MXFP4) in every mode of the contract on the default
tile, and in every tile x cluster its predicate accepts; its PTX holds what the kernel is built
on: the block-scaled tcgen05.mma of the format (kind::mxf8f6f4 for FP8, kind::mxf4nvf4 for FP4;
block32 / block16 scale vectors), the scale factors' tcgen05.cp, the 2-CTA MMA exactly for
256-row tiles, the whole 512-column TMEM allocation, the TMA reduce-add exactly when
accumulating, the BF16 kernel's CLC schedule and unit hand-off, and the device-side offsets
check. Rejected combinations raise a ValueError naming the argument before anything compiles.
On the 256x256, 128x256 and 128x128 tiles of each format the PTX also shows where TMEM holds
the two accumulator buffers and the scale factors (the kernel's TmemPlan: overlapping buffers
at 256 columns), the transaction bytes of a stage (from the tile shapes alone), and that the
unit hand-off keeps global loads off the MMA warp and before the epilogue's accumulator wait.

Modes are checked on the default tile and tilings on the default mode (the kernel's mode
branches and its tiling are independent compile-time choices of the same code), and a seeded
sample of 12 points of the whole product each run (the whole product is 1,450 compiles). sm_103a
builds the same kernel: one compile checks it there.

The compiles are marked ``compile`` (``python -m pytest -m compile``); the fast tier compiles
one default configuration (test_compile_smoke.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest

pytest.importorskip("cutlass")

from gwgrad.dtypes import DType  # noqa: E402
from kernel_compile import check_offsets_check_ptx, compile_ptx, spec  # noqa: E402
from test_compile_sm100 import check_schedule_counts, multicast_loads  # noqa: E402

E4M3, E5M2, FP4 = DType.FLOAT8_E4M3FN, DType.FLOAT8_E5M2, DType.FLOAT4_E2M1FN_X2
E8M0 = DType.FLOAT8_E8M0FNU
#: format -> (A dtype, B dtype, scale dtype, sf_vec_size, global scales, MMA kind, scale vector)
FORMATS = {
    "mxfp8": (E4M3, E4M3, E8M0, 32, False, "mxf8f6f4", "block32"),
    "mxfp8_e5m2": (E5M2, E5M2, E8M0, 32, True, "mxf8f6f4", "block32"),  # + global scales
    "nvfp4": (FP4, FP4, E4M3, 16, True, "mxf4nvf4", "block16"),
    "mxfp4": (FP4, FP4, E8M0, 32, False, "mxf4nvf4", "block32"),
}
MAJORS = [("m", "n"), ("k", "n"), ("m", "k"), ("k", "k")]
OTHER = list(itertools.product(["tensor2d", "tensor_ragged"], ["dense", "discrete"],
                               ["bfloat16", "float16", "float32"], [False, True]))
# FP8 in every major; FP4 K-major only (packed pairs along the token axis).
MODES = ([("mxfp8", majors, *rest) for majors in MAJORS for rest in OTHER]
         + [(fmt, ("k", "k"), *rest) for fmt in ("nvfp4", "mxfp4") for rest in OTHER]
         + [(fmt, ("k", "k"), "tensor2d", "dense", "bfloat16", False)
            for fmt in ("mxfp8_e5m2",)])
TILINGS = [(tile, cluster) for tile in ((128, 128), (128, 256), (256, 128), (256, 256))
           for cluster in ((1, 1), (2, 1), (4, 1)) if tile[0] == 128 or cluster[0] % 2 == 0]


def bs_spec(arch, fmt, **kw):
    a, b, sf, vec, gs, _, _ = FORMATS[fmt]
    kw.setdefault("a_major", "k")
    kw.setdefault("b_major", "k")
    return dataclasses.replace(spec(arch, **kw), a_dtype=a, b_dtype=b, sf_dtype=sf,
                               sf_vec_size=vec, scale_recipe="blocked", has_global_scale=gs)


def gemm_body(ptx: str) -> str:
    return [c for c in ptx.split(".entry ")[1:] if "tcgen05.mma" in c][0]


def check_blockscaled_ptx(ptx: str, fmt: str, accumulate: bool, two_cta: bool) -> None:
    kind, vec = FORMATS[fmt][5:]
    check_offsets_check_ptx(ptx, before_verdict=("barrier.cluster", "mbarrier.init",
                                                 "tcgen05.alloc", "clusterlaunchcontrol"))
    body = gemm_body(ptx)
    mmas = re.findall(r"tcgen05\.mma\.[^\s]+", body)
    # one MMA per K step of a block (4), each block-scaled with the format's kind and vector
    assert len(mmas) == 4, mmas
    group = "cta_group::2" if two_cta else "cta_group::1"
    for mma in mmas:
        assert mma.startswith(f"tcgen05.mma.{group}.kind::{kind}.block_scale.{vec}"), mma
    # scale factors staged smem -> TMEM, with the MMA's CTA group
    copies = re.findall(r"tcgen05\.cp\.[^\s]+", body)
    assert copies and all(c.startswith(f"tcgen05.cp.{group}") for c in copies), copies
    # the whole tensor memory: accumulators + one K block's scale factors
    alloc = re.search(r"tcgen05\.alloc\.(cta_group::\d)[^\[]*\[[^\]]+\],\s*(%r\d+|\d+);", body)
    assert alloc and alloc.group(1) == group, alloc
    cols = alloc.group(2)
    if cols.startswith("%r"):
        cols = re.search(re.escape(cols) + r",\s*(\d+);", body).group(1)
    assert int(cols) == 512
    assert "tcgen05.ld" in body and "tcgen05.wait::ld" in body
    # per-expert descriptors (A, B, SFA, SFB) acquired before use
    assert "fence.proxy.tensormap::generic.acquire" in body and "prefetch.tensormap" in body
    assert "clusterlaunchcontrol.try_cancel" in body
    if accumulate:
        assert "cp.reduce.async.bulk.tensor" in body and ".add." in body
    else:
        assert "cp.reduce.async.bulk" not in body


# -- TMEM: two accumulator buffers and the scale factors -------------------------------------
PLAN_TILINGS = [((256, 256), (2, 1)), ((128, 256), (1, 1)), ((128, 128), (1, 1))]
SF_FORMATS = ["mxfp8", "nvfp4", "mxfp4"]


def kernel_of(fmt, tile=None, cluster=None, **kw):
    from gwgrad.backends import finalize_spec

    s, backend = finalize_spec(bs_spec("sm_100a", fmt, tile=tile, cluster=cluster, **kw))
    return backend.make_kernel(s)


_PTX = {}


def ptx_of(fmt, tile, cluster):
    """The GEMM body of a compile, shared by the tests of this section."""
    key = (fmt, tile, cluster)
    if key not in _PTX:
        _PTX[key] = compile_ptx(bs_spec("sm_100a", fmt, tile=tile, cluster=cluster))
    return _PTX[key]


def tmem_columns_of(body: str, regs) -> list:
    """The TMEM column offsets of addresses in `regs`: each `add.s32 reg, base, C` over the
    allocation's base address (read from shared memory)."""
    bases = set(re.findall(r"ld\.shared\.b32\s+(%r\d+),\s*\[%r\d+\+\d+\];", body))
    columns = []
    for reg in regs:
        m = re.search(rf"add\.s32\s+{re.escape(reg)},\s*(%r\d+),\s*(-?\d+);", body)
        assert m and m.group(1) in bases, (reg, m and m.group(0))
        columns.append(int(m.group(2)))
    return columns


@pytest.mark.parametrize("fmt", SF_FORMATS)
@pytest.mark.parametrize("tile", sorted({t for t, _ in TILINGS}), ids=lambda t: "x".join(map(str, t)))
def test_tmem_plan_fits_512_columns(fmt, tile):
    """Both accumulator buffers and one K block's scale factors fit the 512 TMEM columns;
    at 256 columns the buffers overlap on exactly the scale factors' column count (the
    references' overlapping accumulator), elsewhere they are disjoint."""
    from gwgrad.kernels.sm100_blockscaled import TMEM_COLUMNS, tmem_plan

    vec, family = FORMATS[fmt][3], ("fp4" if FORMATS[fmt][0] == FP4 else "fp8")
    tile_k = {"fp8": 128, "fp4": 256}[family]
    plan = tmem_plan(tile, vec, tile_k)
    # SFA: a CTA's 128 rows; SFB: the n-tile rounded up to 128; tile_k / vec columns per 128
    assert plan.sf_columns == (128 + max(tile[1], 128)) // 128 * (tile_k // vec)
    buffers = [set(range(b, b + tile[1])) for b in (0, plan.buffer_stride)]
    sf = set(range(plan.sf_base, plan.sf_base + plan.sf_columns))
    assert max(sf) < TMEM_COLUMNS and not sf & (buffers[0] | buffers[1])
    assert plan.overlapping == (tile[1] == 256)
    assert len(buffers[0] & buffers[1]) == (plan.sf_columns if plan.overlapping else 0)
    assert plan.acc_stages == (1 if plan.overlapping else 2)
    if plan.overlapping:  # nothing left over: SF in the last columns
        assert plan.sf_base + plan.sf_columns == TMEM_COLUMNS
        # the sub-tiles read before the release cover the shared columns (32-column sub-tiles)
        assert (plan.release_subtile(32) + 1) * 32 >= plan.overlap
    kernel = kernel_of(fmt, tile, (2, 1) if tile[0] == 256 else (1, 1))
    assert (kernel.acc_stage, kernel.overlapping_accum) == (plan.acc_stages, plan.overlapping)


@pytest.mark.compile
@pytest.mark.parametrize("fmt", SF_FORMATS)
@pytest.mark.parametrize("tile,cluster", PLAN_TILINGS, ids=lambda v: "x".join(map(str, v)))
def test_accumulators_and_scale_factors_in_tmem(fmt, tile, cluster):
    """In the PTX: the 512-column allocation; the tcgen05.cp destinations of one K block are
    the plan's scale-factor columns (disjoint 4-column blocks, all >= both accumulator
    buffers, < 512, SFA + SFB columns in all); the accumulator pipeline's stage count (its
    "empty" mbarriers); with overlapping buffers, the MMA's accumulator address is the base
    plus the phase times the plan's buffer stride, and the epilogue waits for its TMEM loads
    and releases the stage before its first TMA store (early release)."""
    from gwgrad.kernels.sm100_blockscaled import TMEM_COLUMNS, tmem_plan
    from test_compile_sm100 import mbarrier_init_counts

    kernel = kernel_of(fmt, tile, cluster)
    plan = tmem_plan(tile, kernel.cfg.sf_vec, kernel.cfg.tile_k)
    ptx = ptx_of(fmt, tile, cluster)
    check_blockscaled_ptx(ptx, fmt, False, two_cta=tile[0] == 256)  # + the 512 columns
    body = gemm_body(ptx)
    copies = tmem_columns_of(body, re.findall(r"tcgen05\.cp\.[^\s]+\s+\[(%r\d+)\]", body))
    assert sorted(copies) == list(range(plan.sf_base, plan.sf_base + plan.sf_columns, 4))
    assert min(copies) >= plan.buffer_stride + tile[1] and max(copies) + 4 <= TMEM_COLUMNS
    atom_thr = 2 if tile[0] == 256 else 1
    assert mbarrier_init_counts(ptx).count(128 * atom_thr) == plan.acc_stages
    mma_d = re.findall(r"tcgen05\.mma\.[^\s]+\s+\[(%r\d+)\]", body)
    assert len(set(mma_d)) == 1
    if plan.overlapping:
        assert re.search(rf"mad\.lo\.s32\s+{re.escape(mma_d[0])},\s*%r\d+,\s*"
                         rf"{plan.buffer_stride},\s*%r\d+;", body), mma_d
        epi = body[body.index("tcgen05.ld."):]
        store = re.search(r"cp\.(reduce\.)?async\.bulk\.tensor\.\dd\.global\.shared", epi)
        wait = epi.find("tcgen05.wait::ld")
        assert 0 <= wait < store.start()
        assert re.search(r"mbarrier\.arrive\.shared(::cluster)?\.b64", epi[wait:store.start()])
    else:
        assert plan.sf_base >= 2 * tile[1]


def expected_stage_bytes(fmt, tile):
    """Transaction bytes of one K block, from the tile shapes alone: per CTA of the MMA, its
    rows of A and its share of B's columns (tile_k tokens each, 4 or 8 bits), SFA of its
    128 rows and SFB of the n-tile rounded up to 128 (tile_k / vec scale bytes a row)."""
    a, _, _, vec, *_ = FORMATS[fmt]
    bits, tile_k = (4, 256) if a == FP4 else (8, 128)
    atom_thr = 2 if tile[0] == 256 else 1
    cta_m, cta_n = tile[0] // atom_thr, tile[1] // atom_thr
    ab = (cta_m + cta_n) * tile_k * bits // 8
    sf = (cta_m + max(tile[1], 128)) * (tile_k // vec)
    return atom_thr * (ab + sf)


@pytest.mark.compile
@pytest.mark.parametrize("fmt", SF_FORMATS)
@pytest.mark.parametrize("tile,cluster", PLAN_TILINGS, ids=lambda v: "x".join(map(str, v)))
def test_transaction_bytes_match_the_tiles(fmt, tile, cluster):
    """The ab stage's mbarrier.arrive.expect_tx carries exactly the A, B, SFA and SFB bytes a
    stage's TMA loads deliver (the other expect_tx is the CLC response's 16 bytes): too few
    and the MMA reads a stage early, too many and it waits forever."""
    body = gemm_body(ptx_of(fmt, tile, cluster))
    consts = dict(re.findall(r"mov\.b32\s+(%r\d+),\s*(\d+);", body))
    tx = [int(consts.get(arg, arg)) for arg in
          re.findall(r"mbarrier\.arrive\.expect_tx[^\]]*\],\s*([^;]+);", body)]
    assert sorted(tx) == [16, expected_stage_bytes(fmt, tile)], tx


@pytest.mark.compile
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_mma_warp_takes_the_token_count_from_the_unit_words(fmt):
    """No global load in the MMA warp, from its TMEM hand-off to its last commit: the
    expert's token count (the step skip) comes in the unit words."""
    body = gemm_body(ptx_of(fmt, (256, 256), (2, 1)))
    cp = body.index("tcgen05.cp")
    mma = body[body.rindex("bar.sync \t2, 160;", 0, cp):body.rindex("tcgen05.commit")]
    assert not re.findall(r"ld\.global[^;]*;", mma)


@pytest.mark.compile
def test_alpha_is_loaded_before_the_accumulator_wait():
    """The epilogue's loads of NVFP4's global scales go out before it waits for the
    accumulator (they do not depend on it)."""
    body = gemm_body(ptx_of("nvfp4", (256, 256), (2, 1)))
    epi = body[body.index("tcgen05.alloc"):]
    first_ld = epi.index("tcgen05.ld.")
    wait = epi.rindex("mbarrier.try_wait", 0, first_ld)
    loads = [m.start() for m in re.finditer(r"ld\.global\.b32", epi[:first_ld])]
    assert len(loads) >= 2 and loads[1] < wait


@pytest.mark.compile
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_empty_units_skip_the_descriptor_fences(fmt):
    """The TMA warp fences and prefetches an expert's descriptors only for a unit with K
    blocks: the branch around the first acquire also tests k_tiles < 1."""
    body = gemm_body(ptx_of(fmt, (256, 256), (2, 1)))
    fence = body.index("fence.proxy.tensormap::generic.acquire")
    branch = re.findall(r"@(%p\d+) bra", body[:fence])[-1]
    pred = re.search(rf"or\.pred\s+{branch},\s*(%p\d+),\s*(%p\d+);", body)
    assert pred, branch
    tests = [re.search(rf"setp\.[\w.]+\s+{p},[^;]+;", body).group(0) for p in pred.groups()]
    assert any(re.search(r"setp\.lt\.s32\s+%p\d+,\s*%r\d+,\s*1;", t) for t in tests), tests


@pytest.mark.parametrize("fmt,sf", [("nvfp4", "float8_e8m0fnu"), ("mxfp4", "float8_e4m3fn"),
                                    ("mxfp8", "float8_e4m3fn"), ("mxfp8", "")])
def test_kernel_checks_the_scale_dtype(fmt, sf):
    """The config carries the scale dtype; the kernel refuses one that does not pair with
    sf_vec_size (validation refuses it first; this is the kernel's own check)."""
    from gwgrad.kernels.sm100_blockscaled import Sm100BlockScaledGroupedWgrad as K

    kernel = kernel_of(fmt)
    assert kernel.cfg.sf_dtype == FORMATS[fmt][2].value
    bad = dataclasses.replace(kernel.cfg, sf_dtype=sf)
    assert K.can_implement(bad, kernel.mma_tiler_mn)[0] == "sf_dtype"
    with pytest.raises(ValueError, match="^sf_dtype: "):
        K(bad, kernel.mma_tiler_mn)


@pytest.mark.compile
@pytest.mark.parametrize("fmt,majors,order,mode,out,acc", MODES,
                         ids=lambda v: v if isinstance(v, str) else str(v))
def test_every_mode_compiles(fmt, majors, order, mode, out, acc):
    s = bs_spec("sm_100a", fmt, a_major=majors[0], b_major=majors[1], order=order, mode=mode,
                out=out, acc=acc)
    ptx = compile_ptx(s)
    check_blockscaled_ptx(ptx, fmt, acc, two_cta=True)  # default: 256 x 256 on (2, 1)
    check_schedule_counts(ptx, 2)


@pytest.mark.compile
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("tile,cluster", TILINGS, ids=lambda v: "x".join(map(str, v)))
def test_every_tiling_compiles(tile, cluster, fmt):
    acc = tile[1] == 128
    ptx = compile_ptx(bs_spec("sm_100a", fmt, tile=tile, cluster=cluster, acc=acc))
    check_blockscaled_ptx(ptx, fmt, acc, two_cta=tile[0] == 256)
    # multicast TMA loads exactly when the cluster has several CTAs along M: they share the
    # n-tile's SFB (SFB's MMA is a 1-CTA one, as in the CuTe DSL example), and B too when
    # several MMAs of the cluster share it
    assert bool(multicast_loads(ptx)) == (cluster[0] > 1), (tile, cluster)
    check_schedule_counts(ptx, cluster[0] * cluster[1])


@pytest.mark.compile
def test_sampled_mode_x_tiling_product(rng):
    """A seeded sample of the whole format x mode x tiling x cluster product (the tests above
    cover its two faces; this draws interior points, different each run, the seed printed on
    failure)."""
    product = [(m, t) for m in MODES for t in TILINGS]
    for i in rng.choice(len(product), size=12, replace=False):
        (fmt, majors, order, mode, out, acc), (tile, cluster) = product[int(i)]
        s = bs_spec("sm_100a", fmt, a_major=majors[0], b_major=majors[1], order=order, mode=mode,
                    out=out, acc=acc, tile=tile, cluster=cluster)
        ptx = compile_ptx(s)
        check_blockscaled_ptx(ptx, fmt, acc, two_cta=tile[0] == 256)
        check_schedule_counts(ptx, cluster[0] * cluster[1])


@pytest.mark.compile
def test_sm103a_compiles():
    """sm_103a (B300) builds the sm_100a kernel: NVFP4 (its FP4 MMA kind) on the default
    configuration compiles for it with the same instructions."""
    ptx = compile_ptx(bs_spec("sm_103a", "nvfp4"))
    assert re.search(r"^\.target\s+sm_103a\b", ptx, re.M)
    check_blockscaled_ptx(ptx, "nvfp4", False, two_cta=True)
    check_schedule_counts(ptx, 2)


def test_workspace_holds_scale_descriptors():
    """Four descriptor slots per expert (A, B, SFA, SFB), five with discrete outputs."""
    from gwgrad.backends import finalize_spec

    for mode, slots in (("dense", 4), ("discrete", 5)):
        s, backend = finalize_spec(bs_spec("sm_100a", "nvfp4", mode=mode))
        cfg = backend.config(s)
        assert cfg.desc_slots == slots and cfg.sf_descriptors
        assert (cfg.desc_sfa, cfg.desc_sfb) == (slots - 2, slots - 1)
        assert backend.workspace_bytes(s) == cfg.desc_offset + s.num_experts * slots * 128
        assert cfg.tile_k == 256 and cfg.count_multiple == 64
    s, backend = finalize_spec(bs_spec("sm_100a", "mxfp8"))
    assert backend.config(s).tile_k == 128 and backend.config(s).count_multiple == 32


@pytest.mark.parametrize("fmt,change,match", [
    ("nvfp4", dict(a_major="m"), "^a_tensor: .*K-major"),
    ("mxfp4", dict(b_major="n"), "^b_tensor: .*K-major"),
    ("mxfp8", dict(tile=(128, 192), cluster=(1, 1)), "^mma_tiler_mn: "),
    ("mxfp8", dict(tile=(128, 64), cluster=(1, 1)), "^mma_tiler_mn: "),
    ("nvfp4", dict(tile=(256, 128), cluster=(1, 1)), "^cluster_shape_mn: "),
    ("mxfp4", dict(tile=(128, 128), cluster=(1, 2)), "^cluster_shape_mn: "),
])
def test_rejected_before_compiling(fmt, change, match):
    from gwgrad.backends import finalize_spec
    from gwgrad.kernels import compiler

    before = compiler.compile_count
    with pytest.raises(ValueError, match=match):
        finalize_spec(bs_spec("sm_100a", fmt, **change))
    assert compiler.compile_count == before


def test_mixed_fp4_and_fp8_is_rejected_naming_b_tensor():
    from gwgrad.backends import finalize_spec

    s = dataclasses.replace(bs_spec("sm_100a", "mxfp4"), b_dtype=E4M3)
    with pytest.raises(ValueError, match="^b_tensor: "):
        finalize_spec(s)


def mma_region(body: str) -> str:
    """The MMA warp's loop: from its last named barrier before the first tcgen05.cp to its last
    commit."""
    cp = body.index("tcgen05.cp")
    return body[body.rindex("bar.sync \t2, 160;", 0, cp):body.rindex("tcgen05.commit")]


@pytest.mark.compile
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_every_mma_step_switch_drops_the_step_skip(fmt, monkeypatch):
    """The tests-only switch (BlockScaledSm100Backend.EVERY_MMA_STEP) issues the four MMA steps
    of a K block unconditionally: its MMA loop has the same MMAs and none of the per-step
    branches the default takes around them (a step starting past the expert's last token), so
    a GPU test with it sees the per-expert TMA bounds alone."""
    from gwgrad.backends.blockscaled_sm100 import BlockScaledSm100Backend

    default = mma_region(gemm_body(compile_ptx(bs_spec("sm_100a", fmt, tile=(256, 256),
                                                       cluster=(2, 1)))))
    monkeypatch.setattr(BlockScaledSm100Backend, "EVERY_MMA_STEP", True)
    every = mma_region(gemm_body(compile_ptx(bs_spec("sm_100a", fmt, tile=(256, 256),
                                                     cluster=(2, 1)))))
    mmas = [len(re.findall(r"tcgen05\.mma\.", r)) for r in (default, every)]
    branches = [len(re.findall(r"@!?%p\d+ bra", r)) for r in (default, every)]
    assert mmas[0] == mmas[1] >= 4, mmas
    assert branches[0] - branches[1] >= 4, branches
