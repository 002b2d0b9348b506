"""The FP4 quantizers' E2M1 rounding (gwgrad/kernels/quantize.py: ``e2m1x8``, NVFP4's fast path,
and ``e2m1_code``, the per-value path it replaced) emulated in NumPy step by step on FP32 bit
patterns, against gwgrad/formats.py's ``encode(..., "e2m1")`` (nearest, ties to even,
saturating to 6, the sign kept, NaN 0); and MXFP4's packed path (``e2m1x8_bf16x2``, the 16-bit
block amax) on every non-NaN BF16 pattern times every E8M0 scale (~4 s), and on whole blocks
against ``formats.quantize_mx`` (see the section at the end).

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


# --- MXFP4's packed path: e2m1x8_bf16x2 on BF16 pairs -------------------------------------------
#
# Emulated as the PTX does it: BF16 arithmetic (mul.rn / fma.rn.bf16x2) as the exact float64
# result rounded once to BF16 (nearest even, subnormals kept, overflow to Inf); abs / min / max
# of non-NaN values exactly; the integer steps on the 32-bit pair words (mad.hi in 64 bits).

#: quantize.E2M1_PAIR_OFFSET (not imported: this module runs without cutlass)
E2M1_PAIR_OFFSET = (0x42004200 * 0x1111) % (1 << 32)


def bf16_round(v: np.ndarray) -> np.ndarray:
    """float64 ``v`` rounded once to BF16 (8 significant bits; subnormal quantum 2**-133;
    nearest even; past the largest finite value by half an ulp or more: Inf)."""
    a = np.abs(v)
    _, e = np.frexp(a)
    quantum = np.maximum(e - 8, -133)
    with np.errstate(invalid="ignore"):
        r = np.ldexp(np.rint(np.ldexp(a, -quantum)), quantum)
    r = np.where(r >= 2.0 ** 128, np.inf, r)
    return np.copysign(r, v)


def bf16_value(h: np.ndarray) -> np.ndarray:
    """float64 value of BF16 bit patterns (uint32 holding 16 bits)."""
    return (h.astype(U32) << U32(16)).view(np.float32).astype(np.float64)


def bf16_bits(v: np.ndarray) -> np.ndarray:
    """BF16 bits (uint32) of float64 values already on the BF16 grid."""
    bits = v.astype(np.float32).view(U32)
    assert ((bits & U32(0xFFFF)) == 0).all()
    return bits >> U32(16)


def _pair_steps(h: np.ndarray, mult: float):
    """One half's BF16 steps: (y, i) bits of ``fma(t, i, 128)`` and ``i = ~max(t, 1) & 0x7F80``
    for the value of BF16 pattern ``h`` times ``mult``."""
    q = bf16_round(np.abs(bf16_value(h)) * mult)  # abs, mul.rn.bf16x2 (exact in float64)
    t = np.minimum(q, 6.0)  # min.bf16x2 (Inf: 6)
    m = bf16_bits(np.maximum(t, 1.0))  # max.bf16x2
    i = ~m & U32(0x7F80)
    y = bf16_bits(bf16_round(t * bf16_value(i) + 128.0))  # fma.rn.bf16x2: one rounding
    return y, i


def packed_words(pairs: np.ndarray, mult2: int) -> np.ndarray:
    """``e2m1x8_bf16x2`` on rows of 4 pair words (uint32, (n, 4)) with the BF16x2 multiplier
    ``mult2`` (both halves equal), as the PTX does it."""
    pairs = pairs.astype(U32)
    mult = float(bf16_value(np.array([mult2 & 0xFFFF], U32))[0])
    assert mult2 >> 16 == mult2 & 0xFFFF
    y_lo, i_lo = _pair_steps(pairs & U32(0xFFFF), mult)
    y_hi, i_hi = _pair_steps(pairs >> U32(16), mult)
    y = (y_lo | (y_hi << U32(16))).astype(np.int64)
    i = (i_lo | (i_hi << U32(16))).astype(np.int64)
    z = (y + ((i * -(1 << 26)) >> 32)) & 0xFFFFFFFF  # mad.hi.s32 z, i, -2**26, y
    acc = z[:, 3]
    for j in (2, 1, 0):  # mad.lo.u32 acc, acc, 16, z
        acc = (acc * 16 + z[:, j]) & 0xFFFFFFFF
    acc = ((acc - E2M1_PAIR_OFFSET) & 0xFFFFFFFF).astype(U32)
    assert not (acc & H).any()  # codes < 8: the sign bits are free
    odd = prmt(pairs[:, 1], pairs[:, 3], 0xFBD9)  # sign bytes of tokens 1, 3, 5, 7
    even = prmt(pairs[:, 0], pairs[:, 2], 0xFBD9)  # of tokens 0, 2, 4, 6
    acc = acc | (even & U32(0x08080808))  # lop3 0xF8: a | (b & c)
    return acc | (odd & U32(0x80808080))


def prmt(a: np.ndarray, b: np.ndarray, selector: int) -> np.ndarray:
    """``prmt.b32 d, a, b, selector`` (default mode): byte n of d is byte ``sel & 7`` of
    {b, a} (a bytes 0..3, b bytes 4..7), or with ``sel & 8`` that byte's bit 7 replicated."""
    src = (a.astype(np.uint64) | (b.astype(np.uint64) << np.uint64(32)))
    out = np.zeros(a.shape, U32)
    for n in range(4):
        sel = (selector >> (4 * n)) & 0xF
        byte = ((src >> np.uint64(8 * (sel & 7))) & np.uint64(0xFF)).astype(U32)
        if sel & 8:
            byte = np.where(byte & U32(0x80), U32(0xFF), U32(0))
        out |= byte << U32(8 * n)
    return out


def _want_words(pairs: np.ndarray, s: int) -> np.ndarray:
    """formats.encode's codes of ``x * 2**-s`` (quantize_mx's element step), packed as the
    kernel's words: nibble j pair j's low value, nibble j + 4 its high value."""
    lo = bf16_value(pairs & U32(0xFFFF))
    hi = bf16_value(pairs >> U32(16))
    c_lo = formats.encode(np.ldexp(lo, -s), "e2m1").astype(U32)
    c_hi = formats.encode(np.ldexp(hi, -s), "e2m1").astype(U32)
    want = np.zeros(pairs.shape[0], U32)
    for j in range(4):
        want |= (c_lo[:, j] << U32(4 * j)) | (c_hi[:, j] << U32(4 * j + 16))
    return want


def _mult2(s: int) -> int:
    """BF16x2 bits of ``2**-s``: the kernel's ``(127 - s) << 7`` a half for s <= 125 (every
    BF16 amax: s = floor(log2 amax) - 2 <= 125), the subnormal 2**-127 for s = 127."""
    h = (127 - s) << 7 if s < 127 else 0x0040
    return h | (h << 16)


def _every_bf16_pairs() -> np.ndarray:
    """Every non-NaN BF16 pattern in the low halves and in the high halves (two fixed
    shuffles: a word's eight values have unrelated signs and sizes), as rows of 4 pair words
    (two zero pairs of padding)."""
    h = np.arange(1 << 16, dtype=U32)
    h = h[(h & U32(0x7FFF)) <= U32(0x7F80)]  # 65282: NaNs are in forced blocks
    shuffle = np.random.default_rng(2026)
    pairs = shuffle.permutation(h) | (shuffle.permutation(h) << U32(16))
    pairs = np.concatenate([pairs, np.zeros(-pairs.size % 4, U32)])
    return pairs.reshape(-1, 4)


def test_prmt():
    a, b = np.array([0x11A2B3C4], U32), np.array([0xD5E6F708], U32)
    assert prmt(a, b, 0x5410)[0] == 0xF708B3C4 and prmt(a, b, 0x7632)[0] == 0xD5E611A2
    assert prmt(a, b, 0xFBD9)[0] == 0xFF00FFFF  # bytes 1, 5, 3, 7: B3, F7, 11, D5


def test_bf16_round():
    """bf16_round against the integer rounding of FP32 bits (normal range) and by hand."""
    rng = np.random.default_rng(7)
    bits = rng.integers(0x00800000, 0x7F7F0000, 200_000, dtype=np.int64).astype(U32)
    want = ((bits + U32(0x7FFF) + ((bits >> U32(16)) & U32(1))) & U32(0xFFFF0000))
    got = bf16_round(bits.view(np.float32).astype(np.float64)).astype(np.float32).view(U32)
    assert np.array_equal(got, want)
    cases = {2.0 ** -134: 0.0, 3 * 2.0 ** -135: 2.0 ** -133, 2.0 ** -133 * 2.5: 2.0 ** -132,
             2.0 ** 128: np.inf, 2.0 ** 128 - 2.0 ** 119: np.inf,
             2.0 ** 128 - 2.0 ** 120: 2.0 ** 128 - 2.0 ** 120, 136.0: 136.0, 128.5: 128.0}
    for v, r in cases.items():
        assert bf16_round(np.array([v]))[0] == r and bf16_round(np.array([-v]))[0] == -r, v


@pytest.mark.parametrize("codes", [range(0, 64), range(64, 128), range(128, 192),
                                   range(192, 255)], ids=["0-63", "64-127", "128-191",
                                                          "192-254"])
def test_packed_every_bf16_every_scale(codes):
    """Every non-NaN BF16 pattern (65282, in both halves of the pair words) against every
    finite E8M0 scale ``2**s`` (codes 0..254, s = code - 127), products of any size
    included (past 6: saturation; overflowing BF16: Inf, saturation too): the packed words
    equal formats.encode's codes of ``x * 2**-s``. The kernel's scales are codes 0..252
    (253, 254 need an amax of 2**128 or more); 254 multiplies by the BF16 subnormal 2**-127."""
    pairs = _every_bf16_pairs()
    for code in codes:
        s = code - 127
        got = packed_words(pairs, _mult2(s))
        want = _want_words(pairs, s)
        assert np.array_equal(got, want), (code, int(np.count_nonzero(got != want)))


def packed_block(values: np.ndarray):
    """tile_packed + quantize + store_codes on one block of 32 BF16 values (float64, one
    channel): (E8M0 code, 4 words of codes), emulated (the forced zero words of a NaN / Inf
    block included)."""
    bits = bf16_bits(values.astype(np.float64))
    # tile_packed's prmt(lo, hi, 0x5410) of the shared words (the even channel's halves
    # low; the odd channel's, by 0x7632, the same values)
    words = bits | (U32(0xABCD) << U32(16))  # the other channel's half: ignored
    pairs = np.array([prmt(words[8 * w + k: 8 * w + k + 1], words[8 * w + k + 4: 8 * w + k + 5],
                           0x5410)[0] for w in range(4) for k in range(4)], U32)
    lo, hi = pairs & U32(0xFFFF), pairs >> U32(16)
    s16 = lambda h: h.astype(np.int64) - ((h.astype(np.int64) & 0x8000) << 1)  # noqa: E731
    mu_lo, mu_hi = lo.max(), hi.max()  # max.u16x2 chain
    ms_lo, ms_hi = s16(lo).max(), s16(hi).max()  # max.s16x2 chain
    m_lo = max(int(mu_lo) & 0x7FFF, ms_lo)  # max.s16x2(mu & 0x7FFF7FFF, ms)
    m_hi = max(int(mu_hi) & 0x7FFF, ms_hi)
    m = max((m_lo & 0xFFFF) << 16, (m_hi & 0xFFFF) << 16)  # max.u32(m << 16, m & 0xFFFF0000)
    if m >= 0x7F800000:
        return 255, np.zeros(4, U32)
    s = max((m >> 23) - 127 - 2, -127)
    mult = (127 - s) << 23
    words = packed_words(pairs.reshape(4, 4), mult | (mult >> 16))
    return s + 127, words


def _block_cases(rng, n: int) -> np.ndarray:
    """Blocks of 32 BF16 values: random magnitudes over every binade (subnormals, zeros of
    both signs, a NaN / Inf here and there, near-equal values, all-zero and all-negative
    blocks)."""
    blocks = []
    for b in range(n):
        exp = rng.integers(-140, 130)
        x = rng.standard_normal(32) * 2.0 ** exp * rng.choice([1.0, 1e-3, 1e3], 32)
        kind = b % 8
        if kind == 1:
            x[rng.integers(0, 32)] = rng.choice([np.nan, np.inf, -np.inf, -np.nan])
        elif kind == 2:
            x[:] = rng.choice([0.0, -0.0], 32)
        elif kind == 3:
            x = -np.abs(x)
        elif kind == 4:
            x[rng.integers(0, 32, 8)] = 0.0
            x[rng.integers(0, 32, 4)] = -0.0
        elif kind == 5:  # exact E2M1 midpoints times a power of two
            x = rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 5.5, 7.5], 32) \
                * rng.choice([1.0, -1.0], 32) * 2.0 ** rng.integers(-133, 126)
        with np.errstate(over="ignore", invalid="ignore"):
            x32 = x.astype(np.float32)
        b32 = x32.view(U32)
        rounded = (b32 + U32(0x7FFF) + ((b32 >> U32(16)) & U32(1))) >> U32(16)  # to BF16
        blocks.append(bf16_value(np.where(np.isnan(x32), b32 >> U32(16), rounded)))
    return np.array(blocks)


def test_packed_blocks_match_quantize_mx(rng):
    """The packed path on whole blocks (the amax by 16-bit unsigned / signed maxima, the
    scale, the words, NaN / Inf blocks forced to 0) against formats.quantize_mx."""
    blocks = _block_cases(rng, 4000)
    blocks = blocks[~np.isnan(blocks).all(axis=1)]
    codes, scales = formats.quantize_mx(blocks, 32, "e2m1")
    for b in range(blocks.shape[0]):
        scale, words = packed_block(blocks[b])
        assert scale == scales[b, 0], (b, blocks[b])
        want = np.zeros(4, U32)
        for k in range(32):
            want[k // 8] |= U32(codes[b, k]) << U32(4 * (k % 8))
        assert np.array_equal(words, want), (b, blocks[b])
