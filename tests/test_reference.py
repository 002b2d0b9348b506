"""The reference backend (what CPU arrays run on) against a direct NumPy loop, every mode."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

import gwgrad
from gwgrad import DType, from_pointer
from gwgrad.backends.reference import _fp8_table, decode, round_to_bfloat16_bits, unpack_fp4
from gwgrad.scales import assemble_blocked
from wgrad_cases import (
    TOLERANCE,
    bf16,
    bf16_problem,
    counts_to_offsets,
    host_ptrs,
    layout_a,
    layout_b,
    loop_reference,
    poisoned,
    random_counts,
    random_output,
    rel_error,
    round_like,
)

MODES = list(itertools.product(("k", "m"), ("k", "n"), ("tensor2d", "tensor_ragged"),
                               ("dense", "discrete"), ("bfloat16", "float16", "float32"),
                               (False, True)))


def _counts(rng, a_major, b_major, order, experts=4):
    # A K-major operand needs counts that are multiples of 8 (16-byte aligned TMA rows), in
    # either input order; with both operands M/N-major any count is valid.
    if "k" in (a_major, b_major):
        return random_counts(rng, experts, multiple=8)
    return random_counts(rng, experts)


def _run(rng, problem, a_major, b_major, order, mode, out_dtype, accumulate):
    a = layout_a(bf16(problem.a), problem.counts, a_major, order)
    b = layout_b(bf16(problem.b), problem.counts, b_major, order)
    shape = (problem.experts, problem.hidden, problem.intermediate)
    initial = random_output(rng, shape, out_dtype) if accumulate else poisoned(shape, out_dtype)
    expected = problem.expected()
    if accumulate:
        expected = initial.astype(np.float32).astype(np.float64) + expected
    kwargs = dict(offsets_tensor=problem.offsets, input_order=order, output_mode=mode,
                  accumulate_on_output=accumulate)
    if mode == "dense":
        out = initial.copy()
        result = gwgrad.grouped_gemm_wgrad(a.desc, b.desc, wgrad_tensor=out, **kwargs)
        assert result["wgrad_tensor"] is out
        got = out
    else:
        outputs = [np.ascontiguousarray(initial[e]) for e in range(problem.experts)]
        result = gwgrad.grouped_gemm_wgrad(a.desc, b.desc, wgrad_ptrs=host_ptrs(outputs),
                                           wgrad_dtype=out_dtype, **kwargs)
        assert result["wgrad_tensor"] is None
        got = np.stack(outputs)
    return got.astype(np.float64), expected


@pytest.mark.parametrize("a_major,b_major,order,mode,out_dtype,accumulate", MODES)
def test_every_mode_matches_numpy_loop(rng, a_major, b_major, order, mode, out_dtype, accumulate):
    counts = _counts(rng, a_major, b_major, order)
    problem = bf16_problem(rng, hidden=16, intermediate=24, counts=counts)
    got, expected = _run(rng, problem, a_major, b_major, order, mode, out_dtype, accumulate)
    assert not np.isnan(got).any()
    assert rel_error(got, expected) <= TOLERANCE[out_dtype]
    # One rounding of the exact result: at most one output ulp away from it.
    np.testing.assert_allclose(got, round_like(expected, out_dtype),
                               rtol=2.0 ** -7 if out_dtype == "bfloat16" else 2.0 ** -10,
                               atol=1e-30)
    if out_dtype == "float32":
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    empty = problem.counts == 0
    if not accumulate:
        assert (got[empty] == 0).all()


def test_empty_expert_unchanged_when_accumulating(rng):
    problem = bf16_problem(rng, counts=(16, 0, 8))
    a = layout_a(bf16(problem.a), problem.counts, "m", "tensor2d")
    b = layout_b(bf16(problem.b), problem.counts, "n", "tensor2d")
    out = random_output(rng, (3, 16, 24), "float32")
    before = out.copy()
    gwgrad.grouped_gemm_wgrad(a.desc, b.desc, offsets_tensor=problem.offsets, wgrad_tensor=out,
                              accumulate_on_output=True)
    assert np.array_equal(out[1], before[1])
    assert not np.array_equal(out[0], before[0])


@pytest.mark.parametrize("counts", [(37,), (1, 2, 3, 5, 0, 7), (0, 0, 13), (300, 257, 1)])
def test_counts_not_multiples_of_256_and_single_expert(rng, counts):
    problem = bf16_problem(rng, hidden=8, intermediate=16, counts=counts)
    a = layout_a(bf16(problem.a), problem.counts, "m", "tensor2d")
    b = layout_b(bf16(problem.b), problem.counts, "n", "tensor2d")
    (w,) = gwgrad.grouped_gemm_wgrad(a.desc, b.desc, offsets_tensor=problem.offsets,
                                     wgrad_dtype="float32")
    np.testing.assert_allclose(w, problem.expected(), rtol=1e-6, atol=1e-6)


def test_all_tokens_in_no_expert_gives_zeros(rng):
    problem = bf16_problem(rng, hidden=8, intermediate=8, counts=(0, 0))
    a = layout_a(bf16(problem.a), problem.counts, "m", "tensor2d")
    b = layout_b(bf16(problem.b), problem.counts, "n", "tensor2d")
    out = poisoned((2, 8, 8), "bfloat16")
    gwgrad.grouped_gemm_wgrad(a.desc, b.desc, offsets_tensor=problem.offsets, wgrad_tensor=out)
    assert (out.astype(np.float32) == 0).all()


def test_large_expert_uses_float32_accumulation_within_tolerance(rng):
    problem = bf16_problem(rng, hidden=256, intermediate=256, counts=(2100,))
    a = layout_a(bf16(problem.a), problem.counts, "m", "tensor2d")
    b = layout_b(bf16(problem.b), problem.counts, "n", "tensor2d")
    (w,) = gwgrad.grouped_gemm_wgrad(a.desc, b.desc, offsets_tensor=problem.offsets,
                                     wgrad_dtype="float32")
    assert rel_error(w, problem.expected()) < 1e-5


# --- rounding and decoding, against ml_dtypes / numpy -----------------------------------------

def test_bfloat16_rounding_is_round_to_nearest_even_from_float64():
    tie_plus = 1 + 2.0 ** -8 + 2.0 ** -30  # above the tie only in float64
    values = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, tie_plus, -2.5, np.inf, -np.inf, 0.0])
    got = round_to_bfloat16_bits(values).view(ml_dtypes.bfloat16).astype(np.float64)
    assert got.tolist() == [1.0, 1 + 2.0 ** -6, 1 + 2.0 ** -7, -2.5, np.inf, -np.inf, 0.0]
    assert np.isnan(round_to_bfloat16_bits(np.array([np.nan])).view(ml_dtypes.bfloat16)[0])
    randoms = np.random.default_rng(np.random.randint(1 << 31)).standard_normal(10000).astype(np.float32).astype(np.float64)
    assert np.array_equal(round_to_bfloat16_bits(randoms),
                          randoms.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))


@pytest.mark.parametrize("dtype,ml", [(DType.FLOAT8_E4M3FN, ml_dtypes.float8_e4m3fn),
                                      (DType.FLOAT8_E5M2, ml_dtypes.float8_e5m2),
                                      (DType.FLOAT8_E8M0FNU, ml_dtypes.float8_e8m0fnu)])
def test_fp8_decoding_matches_ml_dtypes(dtype, ml):
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml).astype(np.float64)
    got = _fp8_table(dtype)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])


def test_fp4_unpacking_low_nibble_first():
    raw = np.arange(256, dtype=np.uint8).reshape(16, 16)
    got = unpack_fp4(raw, axis=1)
    # ml_dtypes stores FP4 one value per byte: its decoding of the 16 codes is the table.
    table = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    assert np.array_equal(got[:, 0::2], table[raw & 0xF])
    assert np.array_equal(got[:, 1::2], table[raw >> 4])
    got0 = unpack_fp4(raw, axis=0)
    assert np.array_equal(got0[0::2], table[raw & 0xF]) and np.array_equal(got0[1::2], table[raw >> 4])


def test_decode_bfloat16_and_float16():
    values = np.random.default_rng(np.random.randint(1 << 31)).standard_normal(100)
    b = bf16(values)
    assert np.array_equal(decode(b.view(np.uint16), DType.BFLOAT16), b.astype(np.float64))
    h = values.astype(np.float16)
    assert np.array_equal(decode(h, DType.FLOAT16), h.astype(np.float64))


# --- block-scaled (more in test_reference_scaled.py: every recipe, ragged counts) --------------

def _fp8_codes(rng, shape, ml):
    # Random finite codes (NaN/inf excluded), decoded independently by ml_dtypes.
    values = (rng.standard_normal(shape) * 4).astype(np.float32).astype(ml)
    return values.view(np.uint8), values.astype(np.float64)


def _e8m0_codes(rng, shape):
    codes = rng.integers(120, 134, shape).astype(np.uint8)
    return codes, codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)


def _cpu(memory, shape, strides, dtype):
    return from_pointer(memory.ctypes.data, shape, strides, dtype, device_type="cpu", owner=memory)


def _blocked(codes, offsets, vec, which):
    """The blocked scale tensor (gwgrad/scales.py) of logical scales indexed by the global token
    block (A: (rows, T / vec), B: (T / vec, rows)); every count is a multiple of vec here."""
    per_token = codes if which == "a" else codes.T
    bounds = np.concatenate([[0], np.asarray(offsets) // vec])
    raws = [per_token[:, bounds[e]:bounds[e + 1]] for e in range(len(offsets))]
    sf = assemble_blocked(raws, per_token.shape[0])
    return sf, sf.shape


@pytest.mark.parametrize("ml,dtype", [(ml_dtypes.float8_e4m3fn, DType.FLOAT8_E4M3FN),
                                      (ml_dtypes.float8_e5m2, DType.FLOAT8_E5M2)])
@pytest.mark.parametrize("order", ["tensor2d", "tensor_ragged"])
def test_mxfp8_against_dequantized_loop(rng, ml, dtype, order):
    hidden, inter, vec = 32, 48, 32
    counts = np.array([256, 0, 512])
    offsets = counts_to_offsets(counts)
    tokens = int(counts.sum())
    a_codes, a_vals = _fp8_codes(rng, (hidden, tokens), ml)
    b_codes, b_vals = _fp8_codes(rng, (tokens, inter), ml)
    sfa_codes, sfa_vals = _e8m0_codes(rng, (hidden, tokens // vec))
    sfb_codes, sfb_vals = _e8m0_codes(rng, (tokens // vec, inter))
    a = layout_a(a_codes, counts, "k", order, dtype)
    b = layout_b(b_codes, counts, "k", order, dtype)
    sfa = _cpu(*_blocked(sfa_codes, offsets, vec, "a"), None, DType.FLOAT8_E8M0FNU)
    sfb = _cpu(*_blocked(sfb_codes, offsets, vec, "b"), None, DType.FLOAT8_E8M0FNU)
    out = poisoned((3, hidden, inter), "float32")
    gwgrad.grouped_gemm_wgrad(a.desc, b.desc, sfa, sfb, offsets, wgrad_tensor=out,
                              sf_vec_size=vec, input_order=order)
    a_deq = a_vals * np.repeat(sfa_vals, vec, axis=1)
    b_deq = b_vals * np.repeat(sfb_vals, vec, axis=0)
    np.testing.assert_allclose(out, loop_reference(a_deq, b_deq, offsets), rtol=1e-6, atol=1e-5)
    assert (out[1] == 0).all()


def test_nvfp4_with_global_scales_against_dequantized_loop(rng):
    hidden, inter, vec = 32, 64, 16
    counts = np.array([512, 256])
    offsets = counts_to_offsets(counts)
    tokens = int(counts.sum())
    table = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    a_nib = rng.integers(0, 16, (hidden, tokens)).astype(np.uint8)
    b_nib = rng.integers(0, 16, (tokens, inter)).astype(np.uint8)
    # Pack along K, low nibble first: A (hidden, tokens/2) K-major; B as (inter, tokens/2) rows.
    a_bytes = np.ascontiguousarray(a_nib[:, 0::2] | (a_nib[:, 1::2] << 4))
    b_bytes_t = np.ascontiguousarray((b_nib[0::2] | (b_nib[1::2] << 4)).T)
    a = _cpu(a_bytes, (hidden, tokens // 2), (tokens // 2, 1), DType.FLOAT4_E2M1FN_X2)
    b = _cpu(b_bytes_t, (tokens // 2, inter), (1, tokens // 2), DType.FLOAT4_E2M1FN_X2)
    sfa_codes, sfa_vals = _fp8_codes(rng, (hidden, tokens // vec), ml_dtypes.float8_e4m3fn)
    sfb_codes, sfb_vals = _fp8_codes(rng, (tokens // vec, inter), ml_dtypes.float8_e4m3fn)
    sfa = _cpu(*_blocked(sfa_codes, offsets, vec, "a"), None, DType.FLOAT8_E4M3FN)
    sfb = _cpu(*_blocked(sfb_codes, offsets, vec, "b"), None, DType.FLOAT8_E4M3FN)
    gsa = rng.uniform(0.5, 2, 2).astype(np.float32)  # one global scale per expert
    gsb = rng.uniform(0.5, 2, 2).astype(np.float32)
    out = poisoned((2, hidden, inter), "float32")
    gwgrad.grouped_gemm_wgrad(a, b, sfa, sfb, offsets, wgrad_tensor=out, global_scale_a=gsa,
                              global_scale_b=gsb, sf_vec_size=vec, input_order="tensor2d")
    a_deq = table[a_nib] * np.repeat(sfa_vals, vec, axis=1)
    b_deq = table[b_nib] * np.repeat(sfb_vals, vec, axis=0)
    alpha = gsa.astype(np.float64) * gsb.astype(np.float64)
    want = loop_reference(a_deq, b_deq, offsets) * alpha[:, None, None]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)


def test_block_scaled_scale_shape_is_checked(rng):
    counts = np.array([256])
    a_codes, _ = _fp8_codes(rng, (32, 256), ml_dtypes.float8_e4m3fn)
    b_codes, _ = _fp8_codes(rng, (256, 32), ml_dtypes.float8_e4m3fn)
    a = layout_a(a_codes, counts, "k", "tensor2d", DType.FLOAT8_E4M3FN)
    b = layout_b(b_codes, counts, "k", "tensor2d", DType.FLOAT8_E4M3FN)
    sfa_codes, _ = _e8m0_codes(rng, (32, 8))  # the old logical layout: (hidden, 256 / 32)
    sfb_codes, _ = _e8m0_codes(rng, (128, 8))
    sfa = _cpu(sfa_codes, sfa_codes.shape, None, DType.FLOAT8_E8M0FNU)
    sfb = _cpu(sfb_codes, sfb_codes.shape, None, DType.FLOAT8_E8M0FNU)
    with pytest.raises(ValueError, match=r"^sfa_tensor: expected shape \(round_up\(hidden, "
                                         r"128\), C\) = \(128, C\)"):
        gwgrad.grouped_gemm_wgrad(a.desc, b.desc, sfa, sfb, counts_to_offsets(counts),
                                  sf_vec_size=32, wgrad_dtype="float32")
