"""Block-scaled inputs on the reference backend, every recipe and format (gwgrad/scales.py),
against a direct float64 loop over experts of the dequantized values.

Inputs are quantized per expert with gwgrad/formats.py's quantizers and laid out with
gwgrad/scales.py's helpers (both tested on their own in test_formats.py / test_scales.py); the
expected result decodes codes and scales with ml_dtypes, independently of the reference's
tables. Counts are ragged: empty experts, multiples of 32 (blocked) or 16 (FP32 recipes) that
are not multiples of 128.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import ml_dtypes
import numpy as np
import pytest

import gwgrad
from gwgrad import DType, from_pointer
from gwgrad import formats as F
from gwgrad import scales as S
from wgrad_cases import counts_to_offsets, layout_a, layout_b, poisoned, random_output

ML = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2,
      "e8m0": ml_dtypes.float8_e8m0fnu, "e2m1": ml_dtypes.float4_e2m1fn}
DT = {"e4m3": DType.FLOAT8_E4M3FN, "e5m2": DType.FLOAT8_E5M2, "e2m1": DType.FLOAT4_E2M1FN_X2,
      "e8m0": DType.FLOAT8_E8M0FNU}
SF_NP_VIEW = {"e8m0": ml_dtypes.float8_e8m0fnu, "e4m3": ml_dtypes.float8_e4m3fn}


def ml_values(codes, fmt):
    return np.asarray(codes, np.uint8).view(ML[fmt]).astype(np.float64)


def cpu(memory, dtype):
    memory = np.ascontiguousarray(memory)
    return from_pointer(memory.ctypes.data, memory.shape, None, dtype, device_type="cpu",
                        owner=memory)


@dataclass
class Case:
    kwargs: dict
    expected: np.ndarray  # (E, hidden, intermediate) float64
    counts: np.ndarray
    keep: List = field(default_factory=list)


def build(rng, recipe: str, a_fmt: str, b_fmt: str, counts, hidden: int = 160, inter: int = 96,
          sf_fmt: Optional[str] = None, sf_vec: int = 32, order: str = "tensor2d",
          a_major: str = "k", b_major: str = "k", global_scales: bool = False,
          extra_capacity: int = 0, flat: bool = False) -> Case:
    counts = np.asarray(counts)
    experts, tokens = len(counts), int(counts.sum())
    offsets = counts_to_offsets(counts)
    x = rng.standard_normal((hidden, tokens)) * np.exp(rng.uniform(-3, 3, (hidden, 1)))
    y = rng.standard_normal((tokens, inter)) * np.exp(rng.uniform(-3, 3, (1, inter)))
    a_codes = np.zeros((hidden, tokens), np.uint8)
    b_codes = np.zeros((inter, tokens), np.uint8)  # B transposed: tokens along axis 1
    a_deq = np.zeros((hidden, tokens))
    b_deq = np.zeros((inter, tokens))
    raw_a, raw_b = [], []
    gsa = rng.uniform(0.5, 2.0, experts).astype(np.float32)
    gsb = rng.uniform(0.5, 2.0, experts).astype(np.float32)
    nvfp4 = recipe == "blocked" and sf_fmt == "e4m3"
    begin = 0
    for e, count in enumerate(counts):
        sl = slice(begin, begin + count)
        for which, values, codes, deq, raws, fmt, gs in (
                ("a", x[:, sl], a_codes, a_deq, raw_a, a_fmt, gsa),
                ("b", y[sl].T, b_codes, b_deq, raw_b, b_fmt, gsb)):
            if recipe == "blocked":
                if nvfp4:
                    c, s, g = F.quantize_nvfp4(values)
                    gs[e] = g
                else:
                    c, s = F.quantize_mx(values, sf_vec, fmt)
                scale = np.repeat(ml_values(s, sf_fmt), sf_vec, axis=1)[:, :count]
            elif recipe == "per_expert_channel":
                c, s = F.quantize_rowwise_fp8(values, fmt)
                scale = s[:, None].astype(np.float64)
            else:
                c, s = F.quantize_rowwise_fp8(values, fmt, 128)
                scale = np.repeat(s.astype(np.float64), 128, axis=1)[:, :count]
            codes[:, sl] = c
            deq[:, sl] = ml_values(c, fmt) * scale
            raws.append(s)
        begin += count

    expected = np.zeros((experts, hidden, inter))
    begin = 0
    for e, count in enumerate(counts):
        alpha = float(gsa[e]) * float(gsb[e]) if (global_scales or nvfp4) else 1.0
        for t in range(begin, begin + count):  # the direct loop: one token at a time
            expected[e] += np.outer(a_deq[:, t], b_deq[:, t])
        expected[e] *= alpha
        begin += count

    if recipe == "blocked":
        cap_a = S.columns_needed(counts, S.column_rule("blocked", sf_vec)) + extra_capacity
        sfa = cpu(S.assemble_blocked(raw_a, hidden, capacity=cap_a), DT[sf_fmt])
        sfb = cpu(S.assemble_blocked(raw_b, inter, capacity=cap_a), DT[sf_fmt])
    elif recipe == "per_expert_channel":
        sfa, sfb = np.stack(raw_a), np.stack(raw_b)
        if flat:
            sfa, sfb = sfa.reshape(-1), sfb.reshape(-1)
    else:
        rows = S.columns_needed(counts, S.column_rule("block_1x128", 128)) + extra_capacity
        sfa = S.assemble_block_1x128(raw_a, capacity=rows)
        sfb = S.assemble_block_1x128(raw_b, capacity=rows)

    if a_fmt == "e2m1":
        a = layout_a(F.pack_fp4(a_codes, axis=1), counts // 2, "k", order, DT["e2m1"])
        b = layout_b(F.pack_fp4(b_codes.T, axis=0), counts // 2, "k", order, DT["e2m1"])
    else:
        a = layout_a(a_codes, counts, a_major, order, DT[a_fmt])
        b = layout_b(np.ascontiguousarray(b_codes.T), counts, b_major, order, DT[b_fmt])
    kwargs = dict(a_tensor=a.desc, b_tensor=b.desc, sfa_tensor=sfa, sfb_tensor=sfb,
                  offsets_tensor=offsets, input_order=order)
    if recipe == "blocked":
        kwargs["sf_vec_size"] = sf_vec
    elif recipe == "block_1x128":
        kwargs.update(sf_vec_size=128, scale_recipe=recipe)
    else:
        kwargs["scale_recipe"] = recipe
    if global_scales or nvfp4:
        kwargs.update(global_scale_a=gsa, global_scale_b=gsb)
    return Case(kwargs, expected, counts, [a, b])


def run(case: Case, out_dtype: str = "float32", **extra):
    shape = case.expected.shape
    out = poisoned(shape, out_dtype)
    gwgrad.grouped_gemm_wgrad(wgrad_tensor=out, **case.kwargs, **extra)
    return out.astype(np.float64)


def check(got, expected, rtol=1e-6):
    scale = max(float(np.abs(expected).max()), 1e-30)
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol * scale)


RAGGED_32 = (96, 0, 32, 256, 64)   # multiples of 32, not all of 128; an empty expert
RAGGED_16 = (48, 0, 144, 256, 16)  # multiples of 16, not of 128
RAGGED_64 = (192, 0, 64, 256, 64)  # multiples of 64 (FP4's rule), not all of 128


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("order,a_major,b_major", [("tensor2d", "k", "k"), ("tensor_ragged", "k", "k"),
                                                   ("tensor2d", "m", "n"), ("tensor2d", "k", "n")])
def test_mxfp8_blocked(rng, fmt, order, a_major, b_major):
    case = build(rng, "blocked", fmt, fmt, RAGGED_32, sf_fmt="e8m0", order=order,
                 a_major=a_major, b_major=b_major)
    got = run(case)
    check(got, case.expected)
    assert (got[1] == 0).all()


@pytest.mark.parametrize("order", ["tensor2d", "tensor_ragged"])
def test_nvfp4_blocked_with_per_expert_global_scales(rng, order):
    case = build(rng, "blocked", "e2m1", "e2m1", (64, 0, 192, 64), sf_fmt="e4m3", sf_vec=16,
                 order=order)
    gsa = case.kwargs["global_scale_a"]
    assert gsa.shape == (4,) and len(set(gsa.tolist())) > 1  # one global scale per expert
    check(run(case), case.expected)


@pytest.mark.parametrize("global_scales", [False, True])
def test_mxfp4_blocked(rng, global_scales):
    case = build(rng, "blocked", "e2m1", "e2m1", RAGGED_64, sf_fmt="e8m0", sf_vec=32,
                 global_scales=global_scales)
    check(run(case), case.expected)


def test_blocked_with_spare_capacity_and_bf16_output(rng):
    case = build(rng, "blocked", "e4m3", "e4m3", RAGGED_32, sf_fmt="e8m0", extra_capacity=8,
                 global_scales=True)
    got = run(case, "bfloat16")
    want = case.expected.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=2.0 ** -7, atol=1e-30)


def test_blocked_cudnn_convention_when_counts_are_multiples_of_128(rng):
    """Scales written at cuDNN's byte offsets (Mpad * begin_e / sf_vec) give the same result."""
    counts = (256, 0, 384, 128)
    case = build(rng, "blocked", "e5m2", "e5m2", counts, hidden=384, inter=64, sf_fmt="e8m0")
    sfa = case.kwargs["sfa_tensor"]
    tokens = sum(counts)
    assert sfa.shape == (384, -(-tokens // 32 // 4) * 4)  # cuDNN's exact shape
    check(run(case), case.expected)


@pytest.mark.parametrize("a_fmt,b_fmt", [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3")])
@pytest.mark.parametrize("flat", [False, True])
def test_per_expert_channel(rng, a_fmt, b_fmt, flat):
    case = build(rng, "per_expert_channel", a_fmt, b_fmt, RAGGED_16, flat=flat)
    check(run(case), case.expected)


@pytest.mark.parametrize("order,a_major,b_major", [("tensor2d", "k", "k"), ("tensor_ragged", "k", "k"),
                                                   ("tensor2d", "m", "n")])
def test_block_1x128(rng, order, a_major, b_major):
    case = build(rng, "block_1x128", "e4m3", "e5m2", RAGGED_16, order=order, a_major=a_major,
                 b_major=b_major, global_scales=True, extra_capacity=2)
    check(run(case), case.expected)


def test_block_1x128_default_sf_vec_size_and_accumulate(rng):
    case = build(rng, "block_1x128", "e4m3", "e4m3", (16, 272, 0))
    del case.kwargs["sf_vec_size"]  # the default 16 means 128 for block_1x128
    initial = random_output(rng, case.expected.shape, "float32")
    out = initial.copy()
    gwgrad.grouped_gemm_wgrad(wgrad_tensor=out, accumulate_on_output=True, **case.kwargs)
    check(out.astype(np.float64), initial.astype(np.float64) + case.expected)
    assert np.array_equal(out[2], initial[2])  # an empty expert adds nothing


def test_class_api_with_a_scale_recipe(rng):
    case = build(rng, "per_expert_channel", "e5m2", "e5m2", (32, 16, 0))
    kw = case.kwargs
    out = poisoned(case.expected.shape, "float32")
    op = gwgrad.GroupedGemmWgrad(kw["a_tensor"], kw["b_tensor"], kw["sfa_tensor"], kw["sfb_tensor"],
                                 kw["offsets_tensor"], out, scale_recipe="per_expert_channel")
    assert op.spec.scale_recipe == "per_expert_channel" and op.spec.sf_vec_size == 0
    op.compile()
    op.execute(kw["a_tensor"], kw["b_tensor"], kw["sfa_tensor"], kw["sfb_tensor"],
               kw["offsets_tensor"], out)
    check(out.astype(np.float64), case.expected)
    with pytest.raises(ValueError, match=r"^sfa_tensor: expected shape \(num_experts, hidden\)"):
        op.execute(kw["a_tensor"], kw["b_tensor"], kw["sfa_tensor"][:2], kw["sfb_tensor"],
                   kw["offsets_tensor"], out)
    with pytest.raises(ValueError, match="^scale_recipe:"):
        gwgrad.GroupedGemmWgrad(kw["a_tensor"], kw["b_tensor"], kw["sfa_tensor"],
                                kw["sfb_tensor"], kw["offsets_tensor"], out)


def test_scale_recipe_is_part_of_the_wrappers_plan_key(rng):
    case = build(rng, "block_1x128", "e4m3", "e4m3", (128, 16))
    kw = dict(case.kwargs)
    check(run(case), case.expected)
    kw["scale_recipe"] = "per_expert_channel"  # same tensors, another recipe: checked anew
    with pytest.raises(ValueError, match="^sf_vec_size:"):
        gwgrad.grouped_gemm_wgrad(wgrad_tensor=poisoned(case.expected.shape, "float32"), **kw)
    kw["scale_recipe"] = None
    with pytest.raises(ValueError, match="^scale_recipe: expected 'per_expert_channel' or "
                                         "'block_1x128'"):
        gwgrad.grouped_gemm_wgrad(wgrad_tensor=poisoned(case.expected.shape, "float32"), **kw)


def test_nan_scale_poisons_only_its_expert(rng):
    case = build(rng, "blocked", "e4m3", "e4m3", (64, 32, 0), hidden=32, inter=32, sf_fmt="e8m0")
    sfa = case.kwargs["sfa_tensor"]
    raw = np.asarray(sfa.owner)  # expert 1's first column: byte Mpad * S_1 = 128 * 4
    raw.reshape(-1)[128 * 4] = 0xFF
    got = run(case)
    assert np.isnan(got[1, 0]).all() and not np.isnan(got[1, 1:]).any()
    assert not np.isnan(got[0]).any() and (got[2] == 0).all()
    check(got[0], case.expected[0])


# --- capacity: the offsets need more scales than the tensors hold -----------------------------

def test_blocked_capacity_error_names_sfa_tensor(rng):
    # T = 128 tokens: C >= round_up(128 / 32, 4) = 4 passes the shape check; the ragged counts
    # need 4 columns per expert.
    case = build(rng, "blocked", "e4m3", "e4m3", (32, 32, 32, 32), hidden=32, inter=32,
                 sf_fmt="e8m0")
    small = np.zeros((128, 4), np.uint8)
    kw = dict(case.kwargs, sfa_tensor=cpu(small, DType.FLOAT8_E8M0FNU),
              sfb_tensor=cpu(small.copy(), DType.FLOAT8_E8M0FNU))
    out = poisoned(case.expected.shape, "float32")
    with pytest.raises(ValueError) as info:
        gwgrad.grouped_gemm_wgrad(wgrad_tensor=out, **kw)
    assert str(info.value) == ("sfa_tensor: expected at least 8 scale columns for experts 0..1 "
                               "with these offsets (sum of round_up(ceil(count/32), 4)), got 4")
    assert info.value.argument == "sfa_tensor"
    assert np.isnan(out).all()  # nothing written
    # the shape check's lower bound
    tiny = np.zeros((128, 0), np.uint8)
    with pytest.raises(ValueError, match=r"^sfa_tensor: .*C >= round_up\(ceil\(tokens_sum / 32\), "
                                         r"4\) = 4"):
        gwgrad.grouped_gemm_wgrad(wgrad_tensor=out, **dict(
            kw, sfa_tensor=cpu(tiny, DType.FLOAT8_E8M0FNU), sfb_tensor=cpu(tiny, DType.FLOAT8_E8M0FNU)))


def test_block_1x128_capacity_error_names_sfa_tensor(rng):
    case = build(rng, "block_1x128", "e4m3", "e4m3", (16, 16, 96), hidden=32, inter=32)
    kw = dict(case.kwargs, sfa_tensor=case.kwargs["sfa_tensor"][:1],
              sfb_tensor=case.kwargs["sfb_tensor"][:1])
    with pytest.raises(ValueError) as info:
        gwgrad.grouped_gemm_wgrad(wgrad_tensor=poisoned(case.expected.shape, "float32"), **kw)
    assert str(info.value) == ("sfa_tensor: expected at least 2 scale rows for experts 0..1 with "
                               "these offsets (sum of ceil(count/128)), got 1")


def test_bad_offsets_are_still_named_first(rng):
    case = build(rng, "blocked", "e4m3", "e4m3", (32, 32), hidden=32, inter=32, sf_fmt="e8m0")
    kw = dict(case.kwargs, offsets_tensor=np.array([48, 64], np.int32))
    with pytest.raises(ValueError, match=r"^offsets_tensor: .*multiple of 32"):
        gwgrad.grouped_gemm_wgrad(wgrad_tensor=poisoned(case.expected.shape, "float32"), **kw)


def test_cpu_fp8_accepts_every_fp8_tile_and_discrete_torch_outputs():
    """The CPU reference takes what some GPU kernel of the family runs (the SM90 FP8 tile
    64x192 included), and the torch adapter's wgrad_fp8 with per-expert outputs works on CPU
    tensors (its pointer array was built with CUDA calls). Both found by the fuzz suite."""
    torch = pytest.importorskip("torch")
    import gwgrad
    import gwgrad.adapters.torch as gwt

    gen = torch.Generator().manual_seed(1)
    tokens, hidden, inter, counts = 96, 32, 48, (32, 0, 64)
    offsets = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    xt = torch.randn(hidden, tokens, generator=gen).to(torch.float8_e4m3fn)
    dyt = torch.randn(inter, tokens, generator=gen).to(torch.float8_e4m3fn)
    sx = torch.rand(3, hidden, generator=gen) + 0.5
    sdy = torch.rand(3, inter, generator=gen) + 0.5
    bounds = [0, *np.cumsum(counts)]
    want = torch.stack([
        (xt.double()[:, s:e] * sx[i].double()[:, None]) @ (dyt.double()[:, s:e].T
                                                           * sdy[i].double()[None, :])
        for i, (s, e) in enumerate(zip(bounds, bounds[1:]))])
    (w,) = gwgrad.grouped_gemm_wgrad(
        a_tensor=xt, b_tensor=dyt.T, sfa_tensor=sx, sfb_tensor=sdy, offsets_tensor=offsets,
        scale_recipe="per_expert_channel", wgrad_dtype="float32",
        mma_tiler_mn=(64, 192), cluster_shape_mn=(1, 1))
    torch.testing.assert_close(torch.as_tensor(np.asarray(w)).double(), want, rtol=1e-5,
                               atol=1e-5)
    outs = [torch.full((hidden, inter), float("nan")) for _ in counts]
    gwt.wgrad_fp8(xt.T, dyt.T, offsets, sx, sdy, scale_recipe="per_expert_channel", out=outs)
    torch.testing.assert_close(torch.stack(outs).double(), want, rtol=1e-5, atol=1e-5)
