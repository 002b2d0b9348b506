"""gwgrad/formats.py: decoding against ml_dtypes, encoding (nearest, ties to even, saturating),
FP4 packing, and the quantizers (round trip within the format's precision, zero blocks, NaN)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from gwgrad import DType
from gwgrad import formats as F
from gwgrad.backends import reference

ML = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2,
      "e8m0": ml_dtypes.float8_e8m0fnu, "e2m1": ml_dtypes.float4_e2m1fn}
MANT_BITS = {"e4m3": 3, "e5m2": 2, "e2m1": 1}
EMIN = {"e4m3": -6, "e5m2": -14, "e2m1": 0}  # smallest normal exponent


def ml_values(codes, fmt):
    """float64 values of codes, decoded by ml_dtypes (one code per byte, E2M1 included)."""
    return np.asarray(codes, np.uint8).view(ML[fmt]).astype(np.float64)


def nearest_even(q, fmt):
    """float64 value nearest to each q among the format's finite values (decoded by ml_dtypes),
    ties to the even code: a brute-force search, independent of formats.encode (ml_dtypes'
    own float64 cast rounds through float32, i.e. twice)."""
    codes = np.arange(16 if fmt == "e2m1" else 256)
    values = ml_values(codes, fmt)
    keep = np.isfinite(values)
    codes, values = codes[keep], values[keep]
    dist = np.abs(q.reshape(-1, 1) - values[None, :])
    best = dist.min(axis=1, keepdims=True)
    candidates = np.where(dist == best, codes[None, :], 1 << 20)
    even = np.where((candidates % 2 == 0) & (candidates < 1 << 20), candidates, 1 << 20).min(axis=1)
    pick = np.where(even < 1 << 20, even, candidates.min(axis=1))
    return ml_values(pick.astype(np.uint8), fmt).reshape(q.shape)


def same(a, b):
    return np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(a[~np.isnan(a)],
                                                                          b[~np.isnan(b)])


@pytest.mark.parametrize("fmt,dtype", [("e4m3", DType.FLOAT8_E4M3FN), ("e5m2", DType.FLOAT8_E5M2),
                                       ("e8m0", DType.FLOAT8_E8M0FNU)])
def test_fp8_tables_match_ml_dtypes(fmt, dtype):
    codes = np.arange(256, dtype=np.uint8)
    want = ml_values(codes, fmt)
    assert same(F.fp8_table(dtype), want) and same(F.fp8_table(fmt), want)
    assert same(F.decode_codes(codes, fmt), want)
    assert reference._fp8_table is F.fp8_table  # the reference decodes with these tables


def test_e2m1_values_match_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    assert np.array_equal(F.FP4_VALUES, ml_values(codes, "e2m1"))
    assert np.array_equal(np.signbit(F.FP4_VALUES), np.signbit(ml_values(codes, "e2m1")))
    assert np.array_equal(F.decode_codes(codes, "e2m1"), F.FP4_VALUES)


def test_pack_fp4_low_nibble_is_the_even_token(rng):
    codes = rng.integers(0, 16, (6, 10)).astype(np.uint8)
    packed = F.pack_fp4(codes, axis=1)
    assert packed.shape == (6, 5)
    assert np.array_equal(packed & 0xF, codes[:, 0::2]) and np.array_equal(packed >> 4, codes[:, 1::2])
    assert np.array_equal(F.unpack_fp4(packed, axis=1), F.FP4_VALUES[codes])
    packed0 = F.pack_fp4(codes.T, axis=0)
    assert np.array_equal(packed0, packed.T)
    assert np.array_equal(F.unpack_fp4(packed0, axis=0), F.FP4_VALUES[codes.T])
    with pytest.raises(ValueError, match="even"):
        F.pack_fp4(codes[:, :3], axis=1)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
def test_encode_is_round_to_nearest_even_like_ml_dtypes(rng, fmt):
    # float32 values: ml_dtypes converts float64 through float32 (rounding twice)
    x = (rng.standard_normal(50000) * np.exp(rng.uniform(-25, 12, 50000))).astype(np.float32)
    x = x[np.abs(x) <= F.FMAX[fmt]].astype(np.float64)
    # exact ties: midpoints between neighbouring values
    values = np.unique(np.abs(F.decode_codes(np.arange(256 if fmt != "e2m1" else 16), fmt)))
    values = values[np.isfinite(values)]
    mids = (values[:-1] + values[1:]) / 2
    x = np.concatenate([x, mids, -mids, values, -values])
    got = ml_values(F.encode(x, fmt), fmt)
    assert np.array_equal(got, x.astype(ML[fmt]).astype(np.float64))


def test_encode_ties_saturation_nan_and_sign():
    e4m3 = lambda v: F.decode_codes(F.encode(np.array(v, float), "e4m3"), "e4m3").tolist()
    # one rounding from float64: just above a tie goes up (through float32 it would tie to even)
    e5m2 = F.decode_codes(F.encode(np.array([1.625 + 2.0 ** -30, 1.625]), "e5m2"), "e5m2")
    assert e5m2.tolist() == [1.75, 1.5]
    assert e4m3([1 + 1 / 16, 1 + 3 / 16, 1000.0, np.inf, -np.inf, 464.0]) == \
        [1.0, 1.25, 448.0, 448.0, -448.0, 448.0]
    assert F.encode(np.array([-0.0]), "e4m3")[0] == 0x80
    assert F.encode(np.array([np.nan]), "e4m3")[0] & 0x7F == 0x7F
    assert F.encode(np.array([np.nan]), "e5m2")[0] & 0x7F == 0x7F
    assert F.decode_codes(F.encode(np.array([1e6, -np.inf]), "e5m2"), "e5m2").tolist() == [57344.0, -57344.0]
    e2m1 = lambda v: F.decode_codes(F.encode(np.array(v, float), "e2m1"), "e2m1").tolist()
    assert e2m1([0.25, 0.75, 2.5, 3.5, 5.0, 7.0, -9.0, np.nan]) == [0.0, 1.0, 2.0, 4.0, 4.0, 6.0, -6.0, 0.0]
    e8m0 = F.encode(np.array([1.0, 2.0 ** -5, 1.4, 1.6, 0.0, 2.0 ** -140, 2.0 ** 200, np.inf,
                              -1.0, np.nan, 1.5, 3.0]), "e8m0")
    assert e8m0.tolist() == [127, 122, 127, 128, 0, 0, 254, 254, 255, 255, 128, 128]
    with pytest.raises(ValueError, match="fmt"):
        F.encode(np.zeros(1), "e3m4")


def _mx_bound_ok(x, deq, shared, fmt):
    """|deq - x| within half an ulp of the element format at scale 2**shared, or saturated."""
    m, emin = MANT_BITS[fmt], EMIN[fmt]
    q = np.abs(x) / np.exp2(shared)
    sat = q > F.FMAX[fmt]
    err = np.abs(deq - x)
    bound = 2.0 ** -(m + 1) * np.abs(x) + np.exp2(shared + emin - m - 1)
    ok = np.where(sat, deq == np.sign(x) * F.FMAX[fmt] * np.exp2(shared), err <= bound)
    return bool(ok.all())


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("sf_vec,count", [(32, 96), (32, 80), (16, 48), (32, 0)])
def test_quantize_mx_round_trip(rng, fmt, sf_vec, count):
    rows = 24
    x = rng.standard_normal((rows, count)) * np.exp(rng.uniform(-30, 30, (rows, 1)))
    codes, scales = F.quantize_mx(x, sf_vec, fmt)
    nblocks = -(-count // sf_vec)
    assert codes.shape == (rows, count) and scales.shape == (rows, nblocks)
    assert codes.dtype == scales.dtype == np.uint8
    # scale exponent: floor(log2(amax of the block)) - emax, independently
    for j in range(nblocks):
        amax = np.abs(x[:, j * sf_vec:(j + 1) * sf_vec]).max(axis=1)
        want = np.clip(np.floor(np.log2(amax)) - F.EMAX[fmt], -127, 127) + 127
        assert np.array_equal(scales[:, j], want.astype(np.uint8))
    shared = np.repeat(ml_values(scales, "e8m0"), sf_vec, axis=1)[:, :count]
    deq = ml_values(codes, fmt) * shared
    assert _mx_bound_ok(x, deq, np.log2(shared), fmt)
    # the codes are the element format's rounding of x / scale (where it does not saturate)
    q = x / shared
    inside = np.abs(q) <= F.FMAX[fmt]
    assert np.array_equal(ml_values(codes, fmt)[inside], nearest_even(q[inside], fmt))


def test_quantize_mx_zero_block_nan_and_inf():
    x = np.ones((2, 96))
    x[0, :32] = 0.0            # a zero block: the smallest scale, zero codes
    x[1, 40] = np.nan          # NaN and Inf make their block's scale NaN
    x[0, 70] = -np.inf
    for fmt in ("e4m3", "e5m2", "e2m1"):
        codes, scales = F.quantize_mx(x, 32, fmt)
        assert scales[0, 0] == 0 and (ml_values(codes[0, :32], fmt) == 0).all()
        assert scales[1, 1] == 255 and scales[0, 2] == 255
        deq = ml_values(codes, fmt) * np.repeat(ml_values(scales, "e8m0"), 32, axis=1)
        assert np.isnan(deq[1, 32:64]).all() and np.isnan(deq[0, 64:]).all()
        assert not np.isnan(deq[0, :64]).any() and not np.isnan(deq[1, :32]).any()
        assert np.allclose(deq[1, 64:], 1.0)
    # tiny blocks clamp to the smallest exponent; huge ones to the largest
    codes, scales = F.quantize_mx(np.full((1, 32), 2.0 ** -140), 32, "e4m3")
    assert scales[0, 0] == 0
    codes, scales = F.quantize_mx(np.full((1, 32), 2.0 ** 140), 32, "e4m3")
    assert scales[0, 0] == 254


def bf16_values(x):
    """x rounded to BF16 values (what the GPU quantizers take), as float64."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def test_quantize_nvfp4_round_trip(rng):
    rows, count = 16, 80  # 5 blocks of 16 tokens
    x = bf16_values(rng.standard_normal((rows, count)) * np.exp(rng.uniform(-3, 3, (rows, 1))))
    f32 = np.float32
    codes, scales, g = F.quantize_nvfp4(x)
    assert isinstance(g, np.float32) and g == f32(np.abs(x).max()) / f32(448 * 6)
    assert codes.shape == (rows, count) and scales.shape == (rows, 5)
    amax = np.abs(x).reshape(rows, 5, 16).max(axis=2)
    s = (amax.astype(f32) / (f32(6) * g)).astype(np.float64)  # FP32 arithmetic, as the GPU
    assert np.array_equal(ml_values(scales, "e4m3"), nearest_even(s, "e4m3"))
    block_scale = np.repeat(ml_values(scales, "e4m3").astype(f32) * g, 16, axis=1)
    deq = ml_values(codes, "e2m1") * block_scale
    # E2M1 has one mantissa bit: half an ulp is 1/4 of the value (normal) or 1/4 of the
    # scale (subnormal); the E4M3 rounding of the block scale may saturate by 1/16 more.
    assert (np.abs(deq - x) <= 0.25 * np.abs(x) + 0.5 * block_scale).all()
    q = (x.astype(f32) * (f32(1) / block_scale)).astype(np.float64)
    inside = np.abs(q) <= 6
    assert np.array_equal(ml_values(codes, "e2m1")[inside], nearest_even(q[inside], "e2m1"))
    # zero, empty and non-finite experts
    codes, scales, g = F.quantize_nvfp4(np.zeros((4, 32)))
    assert g == 1.0 and (codes == 0).all() and (ml_values(scales, "e4m3") == 0).all()
    codes, scales, g = F.quantize_nvfp4(np.zeros((4, 0)))
    assert g == 1.0 and scales.shape == (4, 0)
    bad = np.ones((2, 32))
    bad[1, 3] = np.inf
    codes, scales, g = F.quantize_nvfp4(bad)
    assert np.isnan(g) and np.isnan(ml_values(scales, "e4m3")[1, 0])
    codes, scales, g = F.quantize_nvfp4(bad, global_scale=0.5)
    assert g == 0.5 and np.isnan(ml_values(scales, "e4m3")[1, 0])
    assert not np.isnan(ml_values(scales, "e4m3")[0]).any()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("block,count", [(None, 70), (128, 300), (128, 128), (None, 0)])
def test_quantize_rowwise_fp8_round_trip(rng, fmt, block, count):
    rows = 12
    x = bf16_values(rng.standard_normal((rows, count)) * np.exp(rng.uniform(-5, 5, (rows, 1))))
    f32 = np.float32
    codes, scales = F.quantize_rowwise_fp8(x, fmt, block)
    assert codes.shape == (rows, count) and scales.dtype == np.float32
    if block is None:
        assert scales.shape == (rows,)
        amax = np.abs(x).max(axis=1, initial=0.0)
        per_token = np.repeat(scales[:, None].astype(np.float64), count, axis=1)
    else:
        nblocks = -(-count // block)
        assert scales.shape == (rows, nblocks)
        padded = np.zeros((rows, nblocks * block))
        padded[:, :count] = np.abs(x)
        amax = padded.reshape(rows, nblocks, block).max(axis=2)
        per_token = np.repeat(scales.astype(np.float64), block, axis=1)[:, :count]
    # FP32 arithmetic, as the GPU: amax / fmax, at least the smallest normal
    want = np.where(amax > 0, np.maximum(amax.astype(f32) / f32(F.FMAX[fmt]), f32(2.0 ** -126)),
                    1.0)
    assert np.array_equal(scales, want.astype(np.float32))
    q = (x.astype(f32) * (f32(1) / per_token.astype(f32))).astype(np.float64)
    inside = np.abs(q) <= F.FMAX[fmt]
    # only an amax element can land past the largest value (the FP32 scale rounded down)
    assert (~inside).sum() <= scales.size
    assert (np.abs(q[~inside]) <= F.FMAX[fmt] * (1 + 2.0 ** -23)).all()
    assert np.array_equal(ml_values(codes, fmt)[inside], nearest_even(q[inside], fmt))
    deq = ml_values(codes, fmt) * per_token
    m = MANT_BITS[fmt]
    # (+ 2**-21 |x|: the FP32 reciprocal and product before the FP8 rounding)
    assert (np.abs(deq - x) <= (2.0 ** -(m + 1) + 2.0 ** -21) * np.abs(x)
            + per_token * 2.0 ** (EMIN[fmt] - m - 1)
            + per_token * 2.0 ** -m * F.FMAX[fmt] * (~inside)).all()


def test_quantize_rowwise_fp8_zero_and_nan():
    x = np.ones((3, 256))
    x[0] = 0.0
    x[1, 200] = np.nan
    codes, scales = F.quantize_rowwise_fp8(x, "e4m3", 128)
    assert (scales[0] == 1.0).all() and (codes[0] == 0).all()
    assert np.isnan(scales[1, 1]) and scales[1, 0] == np.float32(1 / 448)
    codes, scales = F.quantize_rowwise_fp8(x, "e4m3")
    assert scales[0] == 1.0 and np.isnan(scales[1]) and scales[2] == np.float32(1 / 448)
    with pytest.raises(ValueError, match="elem"):
        F.quantize_rowwise_fp8(x, "e2m1")
    with pytest.raises(ValueError, match="elem"):
        F.quantize_mx(x, 32, "e8m0")
    with pytest.raises(ValueError, match="x"):
        F.quantize_mx(np.ones(4), 32, "e4m3")


def test_dequantize_blocks_helper(rng):
    x = rng.standard_normal((4, 70))
    codes, scales = F.quantize_mx(x, 32, "e4m3")
    deq = F.dequantize_blocks(codes, "e4m3", scales, 32, "e8m0")
    want = ml_values(codes, "e4m3") * np.repeat(ml_values(scales, "e8m0"), 32, axis=1)[:, :70]
    assert np.array_equal(deq, want)
    codes, s = F.quantize_rowwise_fp8(x, "e5m2")
    assert np.array_equal(F.dequantize_blocks(codes, "e5m2", s, 70),
                          ml_values(codes, "e5m2") * s[:, None].astype(np.float64))
