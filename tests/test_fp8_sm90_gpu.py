"""The SM90 FP8 kernel (kernels/sm90_fp8.py) on an H100/H200, through the public API, for every
scale recipe (gwgrad/scales.py) and output mode, against float64 products of the dequantized
inputs. Outputs are NaN-poisoned (random when accumulating) inside guard memory that must stay
untouched. The blocked (MXFP8) scale bytes are placed here with the layout's byte formula,
independently of gwgrad's own layout helpers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gwgrad  # noqa: E402
from gwgrad import scales as S  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs an SM90 GPU",
    ),
]

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
GUARD = 4096  # elements of guard memory on each side of an output
SENTINEL = 7.0


# --- inputs ----------------------------------------------------------------------------------

def fp8_values(shape, dtype, gen):
    """Random FP8 values (randn, rounded by torch) as the FP8 tensor."""
    return torch.randn(shape, generator=gen, device="cuda").mul_(2.0).to(dtype)


def operands(hidden, inter, counts, a_fmt, b_fmt, order, gen):
    """K-major A (hidden, T) and B (T, intermediate) as the contract declares them (tensor_ragged:
    per-expert K-contiguous blocks inside), with per-expert float64 views (A_e, B_e)."""
    t = int(sum(counts))
    starts = [0] + list(itertools.accumulate(counts))[:-1]
    flat_a = fp8_values(hidden * t, FP8[a_fmt], gen)
    flat_b = fp8_values(inter * t, FP8[b_fmt], gen)
    a = flat_a.view(hidden, t)
    b = flat_b.view(inter, t).t()
    if order == "tensor_ragged":
        a_parts = [flat_a[s * hidden:(s + c) * hidden].view(hidden, c) for s, c in zip(starts, counts)]
        b_parts = [flat_b[s * inter:(s + c) * inter].view(inter, c).t() for s, c in zip(starts, counts)]
    else:
        a_parts = [a[:, s:s + c] for s, c in zip(starts, counts)]
        b_parts = [b[s:s + c, :] for s, c in zip(starts, counts)]
    return a, b, [p.double() for p in a_parts], [p.double() for p in b_parts]


def blocked_scales(raws, rows, capacity):
    """E8M0 scale bytes (round_up(rows,128), capacity) of per-expert raw codes (rows, cols_e),
    placed byte by byte with the layout formula (gwgrad/scales.py); padding bytes are 0."""
    mpad = S.round_up(rows, 128)
    out = np.zeros(mpad * capacity, dtype=np.uint8)
    start = 0
    m = np.arange(rows)[:, None]
    for raw in raws:
        cols = raw.shape[1]
        c_e = S.round_up(cols, 4)
        j = np.arange(cols)[None, :]
        off = (mpad * start + 512 * ((m >> 7) * (c_e >> 2) + (j >> 2)) + 16 * (m & 31)
               + 4 * ((m >> 5) & 3) + (j & 3))
        out[off] = raw
        start += c_e
    return torch.from_numpy(out.reshape(mpad, capacity)).cuda().view(torch.float8_e8m0fnu)


def scale_inputs(recipe, hidden, inter, counts, gen, rng, extra=0):
    """(sfa, sfb, per-expert (A-scale, B-scale) float64 expansions to (hidden, k_e) / (k_e, inter))."""
    e = len(counts)
    expand = []
    if recipe == "per_expert_channel":
        sfa = torch.rand(e, hidden, generator=gen, device="cuda") + 0.25
        sfb = torch.rand(e, inter, generator=gen, device="cuda") + 0.25
        for x, c in enumerate(counts):
            expand.append((sfa[x].double()[:, None].expand(hidden, c),
                           sfb[x].double()[None, :].expand(c, inter)))
        return sfa, sfb, expand
    if recipe == "block_1x128":
        blocks = [-(-c // 128) for c in counts]
        rows = sum(blocks) + extra
        sfa = torch.rand(rows, hidden, generator=gen, device="cuda") + 0.25
        sfb = torch.rand(rows, inter, generator=gen, device="cuda") + 0.25
        first = 0
        for nb, c in zip(blocks, counts):
            idx = first + torch.arange(c, device="cuda") // 128
            expand.append((sfa[idx].double().t(), sfb[idx].double()))
            first += nb
        return sfa, sfb, expand
    # blocked MXFP8: E8M0 codes 2^-5 .. 2^3 per 32 tokens of each expert (products stay well
    # inside FP16's range for the FP16 outputs)
    raws_a = [rng.integers(122, 131, size=(hidden, -(-c // 32)), dtype=np.uint8) for c in counts]
    raws_b = [rng.integers(122, 131, size=(inter, -(-c // 32)), dtype=np.uint8) for c in counts]
    capacity = S.columns_needed(counts, (32, 4)) + 4 * extra
    sfa = blocked_scales(raws_a, hidden, capacity)
    sfb = blocked_scales(raws_b, inter, capacity)
    for ra, rb, c in zip(raws_a, raws_b, counts):
        va = torch.from_numpy(np.ldexp(1.0, ra.astype(np.int64) - 127)).cuda()
        vb = torch.from_numpy(np.ldexp(1.0, rb.astype(np.int64) - 127)).cuda()
        k = torch.arange(c, device="cuda") // 32
        expand.append((va[:, k], vb[:, k].t()))
    return sfa, sfb, expand


def guarded(shape, dtype, fill):
    """A tensor of `shape` inside a buffer with GUARD elements of SENTINEL on each side."""
    n = int(np.prod(shape))
    buf = torch.full((n + 2 * GUARD,), SENTINEL, dtype=dtype, device="cuda")
    view = buf[GUARD:GUARD + n].view(shape)
    view.copy_(fill)
    return buf, view


def guards_intact(buf):
    return bool((buf[:GUARD] == SENTINEL).all() and (buf[-GUARD:] == SENTINEL).all())


# --- the check -------------------------------------------------------------------------------

def run_case(seed, recipe, counts, *, hidden=256, inter=384, out_dtype=torch.bfloat16,
             mode="dense", accumulate=False, order="tensor2d", a_fmt="e4m3", b_fmt="e4m3",
             global_scales=False, tiling=None, cluster=None, extra=0, tol=None,
             caller_workspace=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rng = np.random.default_rng(seed)
    e = len(counts)
    a, b, a_parts, b_parts = operands(hidden, inter, counts, a_fmt, b_fmt, order, gen)
    sfa, sfb, expand = scale_inputs(recipe, hidden, inter, counts, gen, rng, extra)
    offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device="cuda")
    gsa = gsb = None
    if global_scales:
        gsa = torch.rand(e, generator=gen, device="cuda") + 0.5
        gsb = torch.rand(e, generator=gen, device="cuda") + 0.5
    if accumulate:
        init = torch.randn(e, hidden, inter, generator=gen, device="cuda").to(out_dtype)
    else:
        init = torch.full((e, hidden, inter), float("nan"), device="cuda", dtype=out_dtype)
    kwargs = dict(a_tensor=a, b_tensor=b, sfa_tensor=sfa, sfb_tensor=sfb, offsets_tensor=offs,
                  global_scale_a=gsa, global_scale_b=gsb, accumulate_on_output=accumulate,
                  input_order=order, sf_vec_size={"blocked": 32, "block_1x128": 128}.get(recipe, 16),
                  scale_recipe=None if recipe == "blocked" else recipe, mma_tiler_mn=tiling,
                  cluster_shape_mn=cluster, validate_offsets=True)
    if caller_workspace:  # the contract's size (MXFP8 then runs the promoting kernel)
        kwargs["descriptor_workspace"] = torch.empty(
            gwgrad.get_grouped_gemm_wgrad_workspace_size_sm100(e, output_mode=mode),
            dtype=torch.uint8, device="cuda")
    if mode == "dense":
        buf, out = guarded((e, hidden, inter), out_dtype, init)
        gwgrad.grouped_gemm_wgrad(output_mode="dense", wgrad_tensor=out, **kwargs)
        bufs, outs = [buf], list(out.unbind(0))
    else:
        pairs = [guarded((hidden, inter), out_dtype, init[x]) for x in range(e)]
        bufs, outs = [p[0] for p in pairs], [p[1] for p in pairs]
        ptrs = torch.tensor([o.data_ptr() for o in outs], dtype=torch.int64, device="cuda")
        gwgrad.grouped_gemm_wgrad(output_mode="discrete", wgrad_ptrs=ptrs,
                                  wgrad_dtype=out_dtype, **kwargs)
    torch.cuda.synchronize()
    gwgrad.check_errors()
    assert all(guards_intact(buf) for buf in bufs), "memory around the output was written"
    if tol is None:
        tol = 2e-3 if out_dtype == torch.float32 else 1e-2
    for x in range(e):
        sa, sb = expand[x]
        ref = (a_parts[x] * sa) @ (b_parts[x] * sb)
        if global_scales:
            ref = ref * (gsa[x].double() * gsb[x].double())
        if accumulate:
            ref = ref + init[x].double()
        got = outs[x].double()
        assert not torch.isnan(got).any(), f"expert {x} (count {counts[x]}): not fully written"
        denom = ref.norm().item()
        err = (got - ref).norm().item() / (denom if denom > 0 else 1.0)
        assert err <= tol, f"expert {x} (count {counts[x]}): relative error {err:.2e} > {tol}"


RECIPES = ["per_expert_channel", "block_1x128", "blocked"]
# Counts that are multiples of 32 but not all of 128 (and, for the FP32 recipes, of 16 only),
# with an empty expert.
COUNTS = {"blocked": [256, 0, 96, 416, 32, 160],
          "block_1x128": [256, 0, 80, 400, 16, 176],
          "per_expert_channel": [256, 0, 80, 400, 16, 176]}
MODES = [
    dict(mode="dense", out_dtype=torch.bfloat16),
    dict(mode="dense", out_dtype=torch.float16, accumulate=True, order="tensor_ragged"),
    dict(mode="dense", out_dtype=torch.float32, accumulate=True),
    dict(mode="discrete", out_dtype=torch.float32, accumulate=True, order="tensor_ragged"),
    dict(mode="discrete", out_dtype=torch.bfloat16, global_scales=True),
]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("case", range(len(MODES)))
def test_recipe_modes(seed, recipe, case):
    run_case(seed, recipe, COUNTS[recipe], **MODES[case])
    if recipe == "blocked":  # the promoting kernel too: a caller-owned workspace keeps it
        run_case(seed, recipe, COUNTS[recipe], caller_workspace=True, **MODES[case])


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("tiling", [(64, 128), (128, 192)])
def test_recipe_tilings(seed, recipe, tiling):
    # Hidden / intermediate that are not multiples of the tile: partial tiles, B scale atoms
    # straddling 128-row blocks (192-wide tiles).
    run_case(seed, recipe, COUNTS[recipe], hidden=208, inter=400, tiling=tiling,
             global_scales=True, extra=1)


#: Each recipe's default tile, for the CTA pairs.
PAIR_TILES = {"blocked": (64, 128), "block_1x128": (128, 192), "per_expert_channel": (128, 192)}


@pytest.mark.parametrize("cluster", [(1, 2), (2, 1)], ids=["1x2", "2x1"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("case", range(len(MODES)))
def test_recipe_modes_on_pairs(seed, recipe, case, cluster):
    """Every mode on a CTA pair (the shared operand multicast, each CTA's own scales)."""
    run_case(seed, recipe, COUNTS[recipe], tiling=PAIR_TILES[recipe], cluster=cluster,
             **MODES[case])


@pytest.mark.parametrize("cluster", [(1, 2), (2, 1)], ids=["1x2", "2x1"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("tiling", [(64, 128), (128, 192)])
def test_recipe_tilings_on_pairs(seed, recipe, tiling, cluster):
    # Partial tiles, and a pair whose second CTA lies past the output's edge (it computes and
    # stores nothing).
    run_case(seed, recipe, COUNTS[recipe], hidden=208, inter=400, tiling=tiling,
             cluster=cluster, global_scales=True, extra=1)


@pytest.fixture
def two_staging_sets(monkeypatch):
    """The FP8 backend's defaults with a set of epilogue staging buffers per consumer group
    (epi_buffer_sets=2, not a wrapper argument): a rule put first in its table; no operator or
    plan compiled before or after it is reused."""
    from gwgrad import plan as gwplan
    from gwgrad.backends import fp8_sm90
    from gwgrad.backends.tuning_rules import SM90_FP8, Rule

    gwplan.clear_cache()
    first = Rule.parse("fp8-test-two-sets: -> epi_buffer_sets=2")
    monkeypatch.setattr(fp8_sm90.Fp8Sm90Backend, "tuning_rules", (first,) + SM90_FP8)
    yield
    gwplan.clear_cache()


@pytest.mark.parametrize("tiling,cluster", [((128, 192), (2, 1)), ((128, 128), (1, 2)),
                                            ((128, 192), (1, 1))],
                         ids=["128x192-2x1", "128x128-1x2", "128x192"])
@pytest.mark.parametrize("recipe", ["per_expert_channel", "block_1x128"])
@pytest.mark.parametrize("case", [0, 3, 4])
def test_cooperative_epilogue_buffer_set_per_group(seed, two_staging_sets, recipe, tiling,
                                                    cluster, case):
    """Each cooperative consumer group stores its own 64 rows through its own staging
    buffers, in turn (epi_buffer_sets=2), in the scaled kernel: 16-bit, FP32 accumulated and
    discrete outputs, partial tiles (hidden 208: the last 128-row tile's second group has 16
    rows), a pair whose second CTA lies past the output's edge."""
    run_case(seed, recipe, COUNTS[recipe], hidden=208, inter=400, tiling=tiling,
             cluster=cluster, extra=1, **MODES[case])


@pytest.mark.parametrize("recipe", ["per_expert_channel", "block_1x128"])
def test_mixed_fp8_formats(seed, recipe):
    run_case(seed, recipe, COUNTS[recipe], a_fmt="e4m3", b_fmt="e5m2",
             out_dtype=torch.float32)


def test_mxfp8_e5m2(seed):
    run_case(seed, "blocked", COUNTS["blocked"], a_fmt="e5m2", b_fmt="e5m2")


def test_mxfp8_cudnn_shaped_scales(seed):
    # Every count a multiple of 128: cuDNN's (round_up(M,128), round_up(T/32, 4)) tensors are
    # exactly the per-expert layout.
    run_case(seed, "blocked", [256, 128, 0, 384])


def special_scale_codes_call(seed, workspace):
    """MXFP8 scales holding E8M0's special codes, through the wrapper: expert 0's first scale
    column of A is 0x00 (2^-127) against 0xFE (2^127) in B; row 5 of expert 1's A scales holds
    0xFF (NaN) in its second column. `workspace`: a caller-owned one of the contract's size
    (the promoting kernel), else gwgrad's own (the two-pass path). Returns (counts, a, b, the
    experts' operand parts, A's and B's raw codes per expert, the output); the memory around
    the output is checked."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rng = np.random.default_rng(seed)
    counts, hidden, inter = [96, 64, 128], 128, 128
    a, b, a_parts, b_parts = operands(hidden, inter, counts, "e4m3", "e4m3", "tensor2d", gen)
    raws_a = [rng.integers(122, 131, size=(hidden, -(-c // 32)), dtype=np.uint8) for c in counts]
    raws_b = [rng.integers(122, 131, size=(inter, -(-c // 32)), dtype=np.uint8) for c in counts]
    raws_a[0][:, 0] = 0x00
    raws_b[0][:, 0] = 0xFE
    raws_a[1][5, 1] = 0xFF
    capacity = S.columns_needed(counts, (32, 4))
    sfa = blocked_scales(raws_a, hidden, capacity)
    sfb = blocked_scales(raws_b, inter, capacity)
    offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device="cuda")
    buf, out = guarded((3, hidden, inter), torch.float32,
                       torch.full((3, hidden, inter), float("nan"), device="cuda"))
    ws = None
    if workspace:
        ws = torch.empty(gwgrad.get_grouped_gemm_wgrad_workspace_size_sm100(len(counts)),
                         dtype=torch.uint8, device="cuda")
    gwgrad.grouped_gemm_wgrad(a, b, sfa, sfb, offs, wgrad_tensor=out, sf_vec_size=32,
                              descriptor_workspace=ws)
    torch.cuda.synchronize()
    gwgrad.check_errors()
    assert guards_intact(buf), "memory around the output was written"
    return counts, a, b, (a_parts, b_parts), (raws_a, raws_b), out


def test_mxfp8_special_scale_codes(seed):
    """The promoting kernel (a caller-owned workspace of the contract's size keeps it; gwgrad's
    own workspace runs the two-pass path, tests/test_mxfp8_bf16_sm90_gpu.py): E8M0 0x00 is
    2^-127 (an FP32 denormal, not 0) and 0xFF is NaN (special_scale_codes_call), so expert 0's
    first 32 tokens count with weight exactly 1, and expert 1's output row 5 is NaN and every
    other row is not."""
    counts, _, _, (a_parts, b_parts), (raws_a, raws_b), out = special_scale_codes_call(
        seed, workspace=True)
    for x, c in enumerate(counts):
        k = np.arange(c) // 32
        va = np.ldexp(1.0, raws_a[x].astype(np.int64) - 127)[:, k]
        vb = np.ldexp(1.0, raws_b[x].astype(np.int64) - 127)[:, k]
        va[raws_a[x][:, k] == 0xFF] = np.nan
        ref = ((a_parts[x] * torch.from_numpy(va).cuda())
               @ (b_parts[x] * torch.from_numpy(vb).cuda().t()))
        got = out[x].double()
        nan_rows = torch.isnan(ref).all(dim=1)
        assert torch.equal(torch.isnan(got), torch.isnan(ref)), f"expert {x}: NaN pattern differs"
        assert int(nan_rows.sum()) == (1 if x == 1 else 0)
        keep = ~nan_rows
        err = (got[keep] - ref[keep]).norm().item() / ref[keep].norm().item()
        assert err <= 2e-3, f"expert {x}: relative error {err:.2e}"


def test_scales_too_small_write_nothing(seed):
    """Counts of 32 with cuDNN-sized scale tensors: the experts' chunks need more columns than
    the tensors hold; the device check refuses, the output keeps every byte."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rng = np.random.default_rng(seed)
    counts, hidden, inter = [32, 32, 64], 128, 128
    a, b, _, _ = operands(hidden, inter, counts, "e4m3", "e4m3", "tensor2d", gen)
    t = sum(counts)
    cap = S.round_up(-(-t // 32), 4)  # 4 columns; the experts need 4 + 4 + 4
    raws = [rng.integers(120, 135, size=(hidden, 4), dtype=np.uint8)]
    sfa = blocked_scales(raws, hidden, cap)
    sfb = blocked_scales(raws, inter, cap)
    offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device="cuda")
    out = torch.randn(3, hidden, inter, generator=gen, device="cuda")
    before = out.clone()
    gwgrad.grouped_gemm_wgrad(a, b, sfa, sfb, offs, wgrad_tensor=out, sf_vec_size=32,
                              accumulate_on_output=True)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="sfa_tensor"):
        gwgrad.check_errors()
    assert torch.equal(out, before)


# --- the adapters: the same bits as the core ------------------------------------------------

@pytest.mark.parametrize("recipe", ["per_expert_channel", "block_1x128"])
def test_adapters_match_the_core(seed, recipe):
    """torch's and CuPy's wgrad_fp8 (x, dy as token-contiguous (tokens, rows) views) give the
    core wrapper's bits on the same inputs, into new outputs and accumulating."""
    import gwgrad.adapters.torch as gwt

    gen = torch.Generator(device="cuda").manual_seed(seed)
    rng = np.random.default_rng(seed)
    counts, hidden, inter = COUNTS[recipe], 256, 384
    a, b, _, _ = operands(hidden, inter, counts, "e4m3", "e5m2", "tensor2d", gen)
    sfa, sfb, _ = scale_inputs(recipe, hidden, inter, counts, gen, rng)
    offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device="cuda")
    e = len(counts)
    gsa = torch.rand(e, generator=gen, device="cuda") + 0.5
    gsb = torch.rand(e, generator=gen, device="cuda") + 0.5
    core = torch.empty(e, hidden, inter, device="cuda", dtype=torch.float32)
    gwgrad.grouped_gemm_wgrad(a, b, sfa, sfb, offs, wgrad_tensor=core, global_scale_a=gsa,
                              global_scale_b=gsb, scale_recipe=recipe,
                              sf_vec_size=128 if recipe == "block_1x128" else 16)
    x, dy = a.t(), b  # (tokens, hidden) / (tokens, intermediate), token-contiguous
    got = gwt.wgrad_fp8(x, dy, offs, sfa, sfb, scale_recipe=recipe, out_dtype=torch.float32,
                        x_global_scale=gsa, dy_global_scale=gsb)
    torch.cuda.synchronize()
    assert torch.equal(got, core)
    acc = torch.randn(e, hidden, inter, generator=gen, device="cuda")
    want = acc.clone()
    gwgrad.grouped_gemm_wgrad(a, b, sfa, sfb, offs, wgrad_tensor=want, global_scale_a=gsa,
                              global_scale_b=gsb, scale_recipe=recipe, accumulate_on_output=True,
                              sf_vec_size=128 if recipe == "block_1x128" else 16)
    outs = list(acc.clone().unbind(0))
    gwt.wgrad_fp8(x, dy, offs, sfa, sfb, scale_recipe=recipe, out=outs, accumulate=True,
                  x_global_scale=gsa, dy_global_scale=gsb)
    torch.cuda.synchronize()
    assert torch.equal(torch.stack(outs), want)

    cp = pytest.importorskip("cupy")
    import gwgrad.adapters.cupy as gwc

    xb = cp.asarray(a.view(torch.uint8)).T
    dyb = cp.asarray(b.view(torch.uint8))
    got_cp = gwc.wgrad_fp8(xb, dyb, cp.asarray(offs), cp.asarray(sfa), cp.asarray(sfb),
                           scale_recipe=recipe, fp8=("e4m3", "e5m2"), out_dtype="float32",
                           x_global_scale=cp.asarray(gsa), dy_global_scale=cp.asarray(gsb))
    cp.cuda.get_current_stream().synchronize()
    assert torch.equal(torch.as_tensor(got_cp, device="cuda"), core)
    gwgrad.check_errors()


@pytest.mark.parametrize("recipe", RECIPES)
def test_invalid_offsets_write_nothing(seed, recipe):
    """A count that is not a multiple of token_count_multiple (16 / 32), then decreasing
    offsets: the device check refuses both launches, an accumulated FP32 output keeps every
    byte, and the ValueError names offsets_tensor."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rng = np.random.default_rng(seed)
    counts = [64, 128, 64]
    hidden, inter = 128, 128
    a, b, _, _ = operands(hidden, inter, counts, "e4m3", "e4m3", "tensor2d", gen)
    sfa, sfb, _ = scale_inputs(recipe, hidden, inter, counts, gen, rng, extra=2)
    out = torch.randn(3, hidden, inter, generator=gen, device="cuda")
    before = out.clone()
    kwargs = dict(wgrad_tensor=out, accumulate_on_output=True,
                  sf_vec_size={"blocked": 32, "block_1x128": 128}.get(recipe, 16),
                  scale_recipe=None if recipe == "blocked" else recipe)
    for bad in ([8, 200, 256], [128, 64, 256]):
        offs = torch.tensor(bad, dtype=torch.int32, device="cuda")
        gwgrad.grouped_gemm_wgrad(a, b, sfa, sfb, offs, **kwargs)
        torch.cuda.synchronize()
        with pytest.raises(ValueError, match="offsets_tensor"):
            gwgrad.check_errors()
    assert torch.equal(out, before)


def test_mxfp8_default_kernel_follows_the_workspace(seed):
    """MXFP8 through the wrapper: gwgrad's own workspace runs the two-pass path
    (backends.mxfp8_two_pass), a caller-owned one of the contract's size the promoting kernel;
    both against float64, one plan each."""
    from gwgrad import plan as gwplan

    gwplan.clear_cache()
    run_case(seed, "blocked", COUNTS["blocked"])
    kernels = {type(op.backend).__name__ for op in gwplan._compiled.values()}
    assert kernels == {"Mxfp8Bf16Sm90Backend"}, kernels
    gwplan.clear_cache()
    run_case(seed, "blocked", COUNTS["blocked"], caller_workspace=True)
    kernels = {type(op.backend).__name__ for op in gwplan._compiled.values()}
    assert kernels == {"Fp8Sm90Backend"}, kernels
    gwplan.clear_cache()
