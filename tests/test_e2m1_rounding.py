"""The FP4 quantizers' E2M1 rounding (gwgrad/kernels/quantize.py: ``e2m1x8``, the fast path, and
``e2m1_code``, the per-value path it replaced) emulated in NumPy step by step on FP32 bit
patterns, against gwgrad/formats.py's ``encode(..., "e2m1")`` (nearest, ties to even,
saturating to 6, the sign kept, NaN 0).

Every FP32 operation of the kernel is emulated exactly: ``min.f32`` / ``max.f32`` / ``abs`` of
non-NaN values are NumPy float32's; ``fma.rn.f32(t, 2**-22, E)`` with ``E`` a power of two in
[1, 4] and ``0 <= t <= 6`` is ``E + k`` ulps of ``E`` with ``k = rint(2t / E)``: the exact sum
``E + t * 2**-22`` lies in ``[E, E + 3 ulp(E)]``, inside E's binade, where the FP32 grid is
``E + j ulp(E)`` and ties go to the even ``j`` (E's mantissa is 0); ``2t / E`` is a
power-of-two scaling of an FP32 value, exact in float64, and ``np.rint`` rounds half to even.
(``test_fma_emulation`` checks this against exact rational arithmetic.) The integer steps are
uint32 NumPy operations, the funnel shifts written out.

Default: every positive pattern whose exponent field is within 2 of E2M1's range (0.25 .. 6:
fields 123..131), plus random patterns of both signs and every exponent (zeros, subnormals,
Inf) and of the near range; < 10 s. ``GWGRAD_E2M1_FULL=1``: all 2**32 patterns (NaNs: the kernel never rounds a NaN
product on the fast path, see ``e2m1x8``), chunked, ~4 minutes of CPU (6 wall here); with
``GWGRAD_E2M1_FULL=encode`` each chunk is also compared with ``formats.encode`` itself (~15
minutes on one core)."""

from __future__ import annotations

import os
from fractions import Fraction

import numpy as np
import pytest

from gwgrad import formats
from quantize_cases import tiny_expert_values

#: quantize.E2M1_PACK_OFFSET (not imported: this module runs without cutlass)
E2M1_PACK_OFFSET = (0x4AFFFF00 * 0x11111111) % (1 << 32)

U32 = np.uint32
H = U32(0x88888888)


def _f32(bits: np.ndarray) -> np.ndarray:
    return bits.astype(U32).view(np.float32)


def _steps(bits: np.ndarray):
    """``e2m1x8``'s per-value steps on FP32 patterns (multiplier 1): ``z``, the word added at
    the value's nibble (``0x4AFFFF00 + code``), as uint32."""
    q = _f32(bits)
    with np.errstate(invalid="ignore"):
        t = np.minimum(np.abs(q), np.float32(6.0))
    m = np.maximum(t, np.float32(1.0)).view(U32)
    i = ~m & U32(0x7F800000)  # 2 / E
    # fma.rn.f32(t, i, 2**23): t * i = 2t / E is exact (a power-of-two scaling, <= 4), and
    # 2**23 + it rounds to the integer grid (ulp 1), ties to the even integer: 2**23 + rint.
    k = np.rint(t.astype(np.float64) * i.view(np.float32).astype(np.float64))
    y = U32(0x4B000000) + k.astype(U32)
    # mad.hi.s32(i, -1024, y): the high word of the signed 64-bit product, plus y
    hi = (i.astype(np.int64) * -1024) >> 32
    return (y.astype(np.int64) + hi).astype(np.int64).astype(U32)


def fast_nibbles(bits: np.ndarray) -> np.ndarray:
    """The nibble ``e2m1x8`` builds for each FP32 value (the product ``q``; its sign is the
    value's, the multiplier being positive): ``z - 0x4AFFFF00`` (the per-word offset
    subtraction, on one value) with the sign bit."""
    code = _steps(bits) - U32(0x4AFFFF00)
    assert (code <= 7).all()  # no carries between the nibbles
    return code | ((bits.astype(U32) >> U32(31)) << U32(3))


def pack_word(values: np.ndarray) -> np.ndarray:
    """``e2m1x8``'s word for rows of 8 FP32 values (bits) with multiplier 1: the Horner
    accumulation of ``z`` (mad.lo, mod 2**32), the offset, the funnel shifts of the signs, as
    the PTX does them."""
    values = values.astype(U32)
    z = _steps(values.reshape(-1)).reshape(values.shape)
    acc = z[:, 7].copy()
    for j in reversed(range(7)):  # mad.lo.u32 acc, acc, 16, z
        acc = acc * U32(16) + z[:, j]
    signs = np.zeros(values.shape[0], U32)
    for j in reversed(range(8)):  # shf.l.wrap signs, v, signs, 4
        signs = (signs << U32(4)) | (values[:, j] >> U32(28))
    codes = acc - U32(E2M1_PACK_OFFSET)
    return (codes & ~H) | (signs & H)  # lop3 0xD8


def old_codes(bits: np.ndarray) -> np.ndarray:
    """``e2m1_code`` (the per-value path, kept for infinite multipliers), emulated."""
    q = bits.astype(U32)
    a = q & U32(0x7FFFFFFF)
    rounded = (a + U32(0x1FFFFF) + ((a >> U32(22)) & U32(1))) >> U32(22)
    code = np.minimum(rounded.astype(np.int64) - 252, 7)
    # fma.rn(a, 2, 2**23) - 2**23: 2|q| < 2 rounded to an integer (exact in float64)
    below = a < U32(0x3F800000)
    small = np.rint(2.0 * _f32(np.where(below, a, U32(0))).astype(np.float64)).astype(np.int64)
    code = np.where(below, small, code)
    code = (code | ((q >> U32(28)) & U32(8)).astype(np.int64)) * (a <= U32(0x7F800000))
    return code.astype(U32)


#: E2M1's midpoints (0.25 .. 5) and whether a tie there rounds up (to the even code).
_MIDPOINTS = [(0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
              (3.5, True), (5.0, False)]


def threshold_codes(bits: np.ndarray) -> np.ndarray:
    """formats.encode's E2M1 codes by counting the midpoints passed (a fast, independent
    statement of nearest / ties to even / saturation; checked against encode below)."""
    q = _f32(bits)
    with np.errstate(invalid="ignore"):
        a = np.abs(q)
        code = np.zeros(bits.shape, U32)
        for m, up in _MIDPOINTS:
            code += (a >= np.float32(m)) if up else (a > np.float32(m))
    code = code | ((bits.astype(U32) >> U32(31)) << U32(3))
    return np.where(np.isnan(q), U32(0), code)


def encode_codes(bits: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # signalling NaNs to float64
        values = _f32(bits).astype(np.float64)
    return formats.encode(values, "e2m1").astype(U32)


#: Exponent fields checked exhaustively by default: E2M1's range (0.25 .. 6: 125..129) and two
#: binades either side.
NEAR_EXPONENTS = range(123, 132)


def _exponent_patterns(exp: int, sign: int = 0) -> np.ndarray:
    """Every pattern of one exponent field and sign (2**23)."""
    return (U32(sign << 31) | U32(exp << 23)) | np.arange(1 << 23, dtype=U32)


def _near_sample(rng, n: int) -> np.ndarray:
    exps = rng.integers(NEAR_EXPONENTS.start, NEAR_EXPONENTS.stop, n).astype(U32)
    return (exps << U32(23)) | rng.integers(0, 1 << 24, n).astype(U32) & U32(0x807FFFFF)


def _random_patterns(rng, n: int) -> np.ndarray:
    bits = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(U32)
    specials = np.array([0, 0x80000000, 1, 0x80000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF,
                         0x7F800000, 0xFF800000, 0x3E800000, 0x3F400000, 0x3FA00000,
                         0x3FE00000, 0x40200000, 0x40600000, 0x40A00000, 0x40C00000,
                         0x40E00000, 0x40F00000, 0x41000000], U32)
    return np.concatenate([bits, specials, specials ^ U32(0x80000000)])


def _not_nan(bits: np.ndarray) -> np.ndarray:
    return bits[(bits & U32(0x7FFFFFFF)) <= U32(0x7F800000)]


def test_threshold_reference_is_encode(rng):
    bits = np.concatenate([_random_patterns(rng, 400_000),
                           U32(0x3E000000) + np.arange(0, 0x2C00000, 37, dtype=U32)])
    bits = np.concatenate([bits, bits | U32(0x80000000)])
    assert np.array_equal(threshold_codes(bits), encode_codes(bits))


@pytest.mark.parametrize("exp", NEAR_EXPONENTS)
def test_fast_path_near_range_exhaustive(exp):
    """Every positive pattern of the exponent (the sign is handled apart from the magnitude:
    negatives are in the random test and the full sweep)."""
    bits = _exponent_patterns(exp)
    want = threshold_codes(bits)
    assert np.array_equal(fast_nibbles(bits), want)
    assert np.array_equal(old_codes(bits), want)


def test_fast_path_random_and_special(rng):
    bits = _not_nan(np.concatenate([_random_patterns(rng, 1_000_000),
                                    _near_sample(rng, 1_000_000)]))
    want = encode_codes(bits)
    assert np.array_equal(fast_nibbles(bits), want)
    assert np.array_equal(old_codes(bits), want)


def test_nan_products_need_the_per_value_path():
    """The fast path would give a NaN product 7 (``min.f32`` drops the NaN): the kernel never
    lets one reach it (forced blocks; NVFP4's infinite multipliers take ``e2m1_code``)."""
    nans = np.array([0x7FC00000, 0x7FFFFFFF, 0xFFC00000, 0x7F800001], U32)
    assert (old_codes(nans) == 0).all() and (encode_codes(nans) == 0).all()


def test_nvfp4_infinite_multiplier_case(rng):
    """tests/quantize_cases.tiny_expert_values (the GPU test of the per-value path) does reach
    NVFP4's infinite multipliers in the model: every block's ``1 / (scale * g)`` overflows,
    and the codes are 0 for +-0 (no sign), 7 with the sign otherwise."""
    x = tiny_expert_values(rng, 96, 64).T  # (channels, tokens), as the model takes them
    codes, scales, g = formats.quantize_nvfp4(x)
    denom = formats.fp8_table("e4m3")[scales].astype(np.float32) * g
    assert (denom > 0).all() and np.isfinite(denom).all()
    with np.errstate(over="ignore"):
        assert np.isinf(np.float32(1.0) / denom).all()
    zero = x == 0
    assert zero.any() and (np.signbit(x) & zero).any()
    assert (codes[zero] == 0).all()
    assert np.array_equal(codes[~zero], np.where(np.signbit(x[~zero]), 15, 7))


def test_packed_words(rng):
    """The funnel-shift packing and the per-word fix-up: nibble k of the word is value k's."""
    near = _near_sample(rng, 8 * 50_000)
    bits = np.concatenate([near, _not_nan(_random_patterns(rng, 8 * 50_000))])
    bits = bits[: bits.size // 8 * 8].reshape(-1, 8)
    want = np.zeros(bits.shape[0], U32)
    codes = encode_codes(bits.reshape(-1)).reshape(bits.shape)
    for j in range(8):
        want |= codes[:, j] << U32(4 * j)
    assert np.array_equal(pack_word(bits), want)


def test_fma_emulation(rng):
    """``fma.rn.f32(t, 2 / E, 2**23) == 2**23 + rint(2t / E)``, against exact rationals."""
    bits = np.concatenate([_near_sample(rng, 3000) & U32(0x7FFFFFFF),
                           rng.integers(0, 0x40C00001, 3000, dtype=np.int64).astype(U32)])
    t = np.minimum(_f32(bits), np.float32(6.0))
    m = np.maximum(t, np.float32(1.0)).view(U32)
    i = ~m & U32(0x7F800000)
    k = np.rint(t.astype(np.float64) * i.view(np.float32).astype(np.float64))
    for ti, ii, ki in zip(t.tolist(), i.tolist(), k.tolist()):
        exact = Fraction(ti) * Fraction(np.uint32(ii).view(np.float32).item())
        j, rem = divmod(exact, 1)  # the grid of 2**23 + j (ulp 1), ties to even j
        j = int(j)
        if rem * 2 > 1 or (rem * 2 == 1 and j % 2):
            j += 1
        assert j == ki, (ti, ii)
        # and i is 2 / E, E the power of two of max(t, 1)'s binade
        big_e = Fraction(2) ** (int(np.float32(max(ti, 1.0)).view(np.uint32)) // (1 << 23) - 127)
        assert Fraction(np.uint32(ii).view(np.float32).item()) == 2 / big_e


def _sweep_chunk(args):
    start, size, with_encode = args
    bits = np.arange(start, start + size, dtype=np.uint64).astype(U32)
    bits = _not_nan(bits)
    want = threshold_codes(bits)
    bad = int(np.count_nonzero(fast_nibbles(bits) != want))
    bad_old = int(np.count_nonzero(old_codes(bits) != want))
    bad_ref = int(np.count_nonzero(encode_codes(bits) != want)) if with_encode else 0
    return bad, bad_old, bad_ref, int(bits.size)


@pytest.mark.skipif(not os.environ.get("GWGRAD_E2M1_FULL"),
                    reason="set GWGRAD_E2M1_FULL=1 (or =encode) for all 2**32 patterns")
def test_fast_path_all_fp32_patterns():
    with_encode = os.environ["GWGRAD_E2M1_FULL"] == "encode"
    chunk = 1 << 24
    totals = [0, 0, 0, 0]
    for start in range(0, 1 << 32, chunk):
        for i, n in enumerate(_sweep_chunk((start, chunk, with_encode))):
            totals[i] += n
    bad, bad_old, bad_ref, checked = totals
    assert checked == (1 << 32) - 2 * ((1 << 23) - 1)  # every non-NaN pattern
    assert (bad, bad_old, bad_ref) == (0, 0, 0), totals
