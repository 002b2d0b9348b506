"""gwgrad/quantizers.py on the CPU: ``layout`` (shapes, dtypes, scale capacity, errors);
``reference_quantize`` against the per-expert models of gwgrad/formats.py placed with the
layouts of gwgrad/scales.py (read back with ``read_blocked`` and the 1x128 rows ``S_e + j``)
on BF16 data with empty experts and counts that are not multiples of 128; invalid offsets
(empty experts, never an error); a scale capacity below the counts' need (only the scales past
it dropped); zero padding of the blocked scales; NaN / Inf (NaN scales and codes, never a
silent finite value); BF16 denormals (kept, scaled as the models say); and ``gwgrad.quantize``
on NumPy arrays (allocated or given outputs, argument errors naming the argument)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import gwgrad
from gwgrad import formats as F
from gwgrad import quantizers as Q
from gwgrad import scales as S
from gwgrad.dtypes import DType
from gwgrad.errors import ArgumentError

BF16 = ml_dtypes.bfloat16
CASES = [(fmt, elem) for fmt, f in Q.FORMATS.items() for elem in f.elems]
BLOCKED = [fmt for fmt, f in Q.FORMATS.items() if f.recipe == S.BLOCKED]
CAPACITY_FORMATS = [fmt for fmt, f in Q.FORMATS.items() if f.recipe != S.PER_EXPERT_CHANNEL]
ML = {DType.FLOAT8_E4M3FN: ml_dtypes.float8_e4m3fn, DType.FLOAT8_E5M2: ml_dtypes.float8_e5m2,
      DType.FLOAT8_E8M0FNU: ml_dtypes.float8_e8m0fnu, DType.FLOAT32: np.float32}
SCALE_FMT = {DType.FLOAT8_E8M0FNU: "e8m0", DType.FLOAT8_E4M3FN: "e4m3"}


# --- helpers ------------------------------------------------------------------------------------

def bf16_data(rng, tokens, channels, spread=20.0):
    """Random BF16 (tokens, channels): normal values times per-channel magnitudes 2**±spread.
    Returns (the bfloat16 array, its float64 values)."""
    x = rng.standard_normal((tokens, channels)) * np.exp2(rng.uniform(-spread, spread,
                                                                      (1, channels)))
    xb = x.astype(np.float32).astype(BF16)
    return xb, xb.astype(np.float64)


def draw_counts(rng, experts, multiple):
    """Counts, multiples of ``multiple``: experts 0 and 3 empty, expert 1 short (3 multiples),
    expert 2 past one 128-token tile; the rest random; the last one not a multiple of 128."""
    counts = rng.integers(1, 14, experts) * multiple
    counts[0] = counts[3] = 0
    counts[1] = 3 * multiple
    counts[2] = 128 + multiple
    if counts[-1] % 128 == 0:
        counts[-1] += multiple
    return counts.astype(np.int64)


def ranges(offsets, tokens, multiple):
    """(begin, end) per expert as the kernels sanitize offsets (kernels/prep.py): written out
    here, one expert at a time, independently of quantizers._counts."""
    out = []
    for e, o in enumerate(offsets):
        begin = 0 if e == 0 else min(max(int(offsets[e - 1]), 0), tokens)
        end = max(min(max(int(o), 0), tokens), begin)
        if (end - begin) % multiple:
            end = begin
        out.append((begin, end))
    return out


def unpack(data, elem):
    """(channels, tokens) codes, one per element (E2M1 unpacked, low nibble the even token)."""
    data = np.asarray(data).view(np.uint8)
    if elem != "e2m1":
        return data
    codes = np.empty((data.shape[0], 2 * data.shape[1]), np.uint8)
    codes[:, 0::2] = data & 0x0F
    codes[:, 1::2] = data >> 4
    return codes


def scale_bytes(scales):
    """The scale tensor's bytes, flat (blocked chunks are addressed flat: gwgrad/scales.py)."""
    return np.ascontiguousarray(scales).view(np.uint8).reshape(-1)


def f32_bits(a):
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32)


def model(fmt, elem, xe):
    """The per-expert model of gwgrad/formats.py for ``xe`` (channels, count):
    (codes, scales, global scale or None)."""
    f = Q.FORMATS[fmt]
    if fmt == "nvfp4":
        return F.quantize_nvfp4(xe)
    if f.recipe == S.BLOCKED:
        return F.quantize_mx(xe, f.sf_vec, elem) + (None,)
    block = S.BLOCK_TOKENS if f.recipe == S.BLOCK_1X128 else None
    return F.quantize_rowwise_fp8(xe, elem, block) + (None,)


def expert_scales(out, fmt, spans, channels):
    """Each expert's scales read back from the grouped scale tensor: blocked with
    scales.read_blocked, 1x128 rows S_e + j, per_expert_channel row e."""
    f = Q.FORMATS[fmt]
    _, scales, _ = out
    counts = [end - begin for begin, end in spans]
    if f.recipe == S.BLOCKED:
        return S.read_blocked(scales, counts, f.sf_vec, channels)
    if f.recipe == S.BLOCK_1X128:
        starts = S.column_starts(counts, (S.BLOCK_TOKENS, 1))
        return [scales[starts[e]:starts[e + 1]].T for e in range(len(counts))]
    return [scales[e] for e in range(len(counts))]


def check_against_models(out, values, spans, fmt, elem):
    """Every expert's codes, scales and global scale are its model's; tokens of no expert
    have code 0 (tokens of two experts, from invalid offsets, are unspecified)."""
    tokens, channels = values.shape
    data, scales, gs = out
    f = Q.FORMATS[fmt]
    capacity = (scales.shape[1] if f.recipe == S.BLOCKED else
                scales.shape[0] if f.recipe == S.BLOCK_1X128 else None)
    lay = Q.layout(fmt, tokens, channels, len(spans), elem, capacity)
    assert data.shape == lay.data_shape and data.dtype == np.uint8
    assert scales.shape == lay.scale_shape
    codes = unpack(data, elem)
    cover = np.zeros(tokens, int)
    for begin, end in spans:
        cover[begin:end] += 1
    assert (codes[:, cover == 0] == 0).all()
    got_scales = expert_scales(out, fmt, spans, channels)
    for e, (begin, end) in enumerate(spans):
        c, s, g = model(fmt, elem, values[begin:end].T)
        once = cover[begin:end] == 1
        assert np.array_equal(codes[:, begin:end][:, once], c[:, once]), f"expert {e}: codes"
        if s.dtype == np.float32:
            assert np.array_equal(f32_bits(got_scales[e]), f32_bits(s)), f"expert {e}: scales"
        else:
            assert np.array_equal(got_scales[e], s), f"expert {e}: scales"
        if fmt == "nvfp4":
            assert f32_bits(gs[e]) == f32_bits(g), f"expert {e}: global scale"
    if fmt != "nvfp4":
        assert gs is None


def dequantize(out, values, spans, fmt, elem):
    """float64 (channels, tokens) values the GEMM reads: code times scale (times NVFP4's global
    scale), per expert; NaN outside every expert."""
    tokens, channels = values.shape
    f = Q.FORMATS[fmt]
    codes = unpack(out[0], elem)
    deq = np.full((channels, tokens), np.nan)
    got_scales = expert_scales(out, fmt, spans, channels)
    for e, (begin, end) in enumerate(spans):
        if end == begin:
            continue
        s = got_scales[e]
        if f.recipe == S.BLOCKED:
            s = F.decode_codes(s, SCALE_FMT[f.scale_dtype])
            if fmt == "nvfp4":
                s = s * np.float64(out[2][e])
        s = np.asarray(s, np.float64)
        if s.ndim == 1:
            s = s[:, None]
        block = f.sf_vec if f.sf_vec else end - begin
        per_token = np.repeat(s, block, axis=1)[:, :end - begin]
        deq[:, begin:end] = F.decode_codes(codes[:, begin:end], elem) * per_token
    return deq


# --- layout ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,elem", CASES)
@pytest.mark.parametrize("tokens,channels,experts", [(0, 8, 1), (96, 40, 3), (4096, 200, 9),
                                                     (16384, 1024, 256)])
def test_layout_shapes(fmt, elem, tokens, channels, experts):
    f = Q.FORMATS[fmt]
    tokens = tokens // 32 * 32  # a multiple of every format's count multiple
    lay = Q.layout(fmt, tokens, channels, experts, elem)
    assert (lay.fmt, lay.elem) == (fmt, elem)
    assert lay.data_shape == (channels, tokens // 2 if elem == "e2m1" else tokens)
    assert lay.data_dtype == {"e4m3": DType.FLOAT8_E4M3FN, "e5m2": DType.FLOAT8_E5M2,
                              "e2m1": DType.FLOAT4_E2M1FN_X2}[elem]
    assert lay.scale_dtype == f.scale_dtype
    assert lay.global_shape == ((experts,) if fmt == "nvfp4" else None)
    if f.recipe == S.BLOCKED:
        bound = S.round_up(-(-tokens // f.sf_vec) + 3 * experts, 4)
        assert lay.scale_shape == (S.round_up(channels, 128), bound)
        assert lay.scale_capacity == bound
    elif f.recipe == S.BLOCK_1X128:
        bound = -(-tokens // 128) + experts
        assert lay.scale_shape == (bound, channels)
        assert lay.scale_capacity == bound
    else:
        assert lay.scale_shape == (experts, channels)
        assert lay.scale_capacity == 0
    assert Q.layout(fmt, tokens, channels, experts) == Q.layout(fmt, tokens, channels, experts,
                                                                f.elems[0])


@pytest.mark.parametrize("fmt", CAPACITY_FORMATS)
def test_layout_capacity_holds_any_valid_counts(rng, fmt):
    f = Q.FORMATS[fmt]
    m = Q.count_multiple(fmt)
    rule = S.column_rule(f.recipe, f.sf_vec)
    for experts in (1, 2, 7, 64):
        # every expert as short as allowed: the most padding per token
        draws = [np.full(experts, m)] + [rng.integers(0, 40, experts) * m for _ in range(20)]
        for counts in draws:
            tokens = int(counts.sum())
            lay = Q.layout(fmt, tokens, 64, experts)
            assert S.columns_needed(counts.tolist(), rule) <= lay.scale_capacity
    lay = Q.layout(fmt, 1024, 64, 4, scale_capacity=100)
    assert lay.scale_capacity == 100
    assert lay.scale_shape == ((128, 100) if f.recipe == S.BLOCKED else (100, 64))


def test_count_multiple_is_the_consuming_gemms():
    from kernel_compile import fp8_spec

    from gwgrad.offsets import token_count_multiple

    for fmt, f in Q.FORMATS.items():
        assert Q.count_multiple(fmt) == token_count_multiple(fp8_spec("sm_90a", f.recipe))


@pytest.mark.parametrize("call,argument", [
    (lambda: Q.layout("mxfp8", 100, 64, 2), "x"),  # not a multiple of 32
    (lambda: Q.layout("nvfp4", 48, 64, 2), "x"),
    (lambda: Q.layout("block_1x128", 40, 64, 2), "x"),  # not a multiple of 16
    (lambda: Q.layout("mxfp8", 1024, 64, 2, scale_capacity=28), "scales"),  # < 32 columns
    (lambda: Q.layout("nvfp4", 1024, 64, 2, scale_capacity=63), "scales"),
    (lambda: Q.layout("block_1x128", 1040, 64, 2, scale_capacity=8), "scales"),  # < 9 rows
    (lambda: Q.layout("mxfp9", 64, 64, 2), "fmt"),
    (lambda: Q.layout("MXFP8", 64, 64, 2), "fmt"),
    (lambda: Q.layout(None, 64, 64, 2), "fmt"),
    (lambda: Q.layout(8, 64, 64, 2), "fmt"),
    (lambda: Q.layout("mxfp8", 64, 64, 2, elem="e2m1"), "elem"),
    (lambda: Q.layout("nvfp4", 64, 64, 2, elem="e4m3"), "elem"),
    (lambda: Q.layout("per_expert_channel", 64, 64, 2, elem="e2m1"), "elem"),
    (lambda: Q.layout("block_1x128", 64, 64, 2, elem="int8"), "elem"),
], ids=lambda v: "" if callable(v) else v)
def test_layout_errors_name_the_argument(call, argument):
    with pytest.raises(ValueError) as err:
        call()
    assert isinstance(err.value, ArgumentError) and err.value.argument == argument
    assert str(err.value).startswith(f"{argument}: expected ")


def test_layout_elem_aliases():
    assert Q.layout("mxfp8", 64, 64, 2, elem="float8_e5m2").elem == "e5m2"
    assert Q.layout("per_expert_channel", 64, 64, 2, elem="float8_e4m3fn").elem == "e4m3"


# --- reference_quantize against the per-expert models -------------------------------------------

@pytest.mark.parametrize("fmt,elem", CASES)
def test_reference_is_the_per_expert_models(rng, fmt, elem):
    """200 channels (two 128-row atoms of blocked scales, one of them padding), 7 experts."""
    m = Q.count_multiple(fmt)
    counts = draw_counts(rng, 7, m)
    offsets = np.cumsum(counts)
    xb, values = bf16_data(rng, int(counts.sum()), 200)
    values[:, 5] = 0.0  # an all-zero channel: zero blocks
    out = Q.reference_quantize(values, offsets, fmt, elem)
    spans = ranges(offsets, values.shape[0], m)
    assert spans == [(int(o - c), int(o)) for o, c in zip(offsets, counts)]
    check_against_models(out, values, spans, fmt, elem)
    # Dequantized, the experts come back within the element format's precision.
    deq = dequantize(out, values, spans, fmt, elem)
    tol = {"e4m3": 0.05, "e5m2": 0.1, "e2m1": 0.25}[elem]
    for begin, end in spans:
        if end > begin:
            ref = values[begin:end].T
            assert np.linalg.norm(deq[:, begin:end] - ref) <= tol * np.linalg.norm(ref)


@pytest.mark.parametrize("fmt", list(Q.FORMATS))
def test_invalid_offsets_quantize_as_empty_experts(rng, fmt):
    """Decreasing, negative, past-the-end, misaligned and int32-extreme offsets never raise:
    the experts they leave without a valid range are empty (no scale columns or rows, scale
    1.0 or global scale 1.0), the other ones are their models, tokens of no expert code 0."""
    m = Q.count_multiple(fmt)
    tokens, channels = 8 * 128, 64
    xb, values = bf16_data(rng, tokens, channels)
    cases = [
        [256, 128, 512, tokens],  # decreasing: expert 1 empty (2 overlaps 0)
        [-64, 256, 100000, tokens],  # negative, past the end (clamped to tokens)
        [m // 2, 3 * m, 5 * m + 3, tokens],  # misaligned counts: empty
        [2 ** 31 - 1, -2 ** 31, 0, tokens],
        [128, 256, 384, 512],  # tokens past the last offset: in no expert
        [0, 0, 0, 0],
    ]
    for offsets in cases:
        offsets = np.asarray(offsets, np.int64)
        spans = ranges(offsets, tokens, m)
        f = Q.FORMATS[fmt]
        default = Q.reference_quantize(values, offsets, fmt)
        # Overlapping ranges may need more scale columns than the capacity that holds any
        # valid counts (those past it are dropped: test_small_scale_capacity_...); give room.
        capacity = None
        if f.recipe != S.PER_EXPERT_CHANNEL:
            needed = S.columns_needed([end - begin for begin, end in spans],
                                      S.column_rule(f.recipe, f.sf_vec))
            capacity = max(needed, Q.layout(fmt, tokens, channels, len(spans)).scale_capacity)
        out = Q.reference_quantize(values, offsets, fmt, scale_capacity=capacity)
        check_against_models(out, values, spans, fmt, Q.FORMATS[fmt].elems[0])
        assert np.array_equal(default[0], out[0])
        for e, (begin, end) in enumerate(spans):
            if end == begin and fmt == "per_expert_channel":
                assert (out[1][e] == 1.0).all()
            if end == begin and fmt == "nvfp4":
                assert out[2][e] == 1.0
        if f.recipe != S.PER_EXPERT_CHANNEL:  # empty experts own no scale columns / rows
            rule = S.column_rule(f.recipe, f.sf_vec)
            used = S.columns_needed([end - begin for begin, end in spans], rule)
            per_unit = out[1].shape[0] if f.recipe == S.BLOCKED else 4 * channels
            assert not scale_bytes(out[1])[used * per_unit:].any()
        # the NumPy path of gwgrad.quantize: the same, no error
        got = gwgrad.quantize(xb, offsets.astype(np.int32), fmt)
        for g, want in zip(got, default):
            if want is not None:
                assert np.array_equal(np.asarray(g).view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("fmt", CAPACITY_FORMATS)
def test_small_scale_capacity_drops_only_the_scales_past_it(rng, fmt):
    """The scale tensor's bytes (blocked: addressed flat, expert e's chunk from byte
    Mpad * S_e; 1x128: rows) are the full-capacity result's, cut at the capacity; codes and
    global scales are unchanged. 200 channels: a blocked chunk spans two 128-row atoms, so a
    cut inside an expert's chunk splits its rows too."""
    f = Q.FORMATS[fmt]
    m = Q.count_multiple(fmt)
    counts = np.array([m, 4 * 128 + m, 2 * m, 0, 3 * 128 + m, 5 * m])
    offsets = np.cumsum(counts)
    tokens = int(counts.sum())
    xb, values = bf16_data(rng, tokens, 200, spread=4.0)
    full = Q.reference_quantize(values, offsets, fmt)
    rule = S.column_rule(f.recipe, f.sf_vec)
    needed = S.columns_needed(counts.tolist(), rule)
    per_unit = full[1].shape[0] if f.recipe == S.BLOCKED else full[1].shape[1] * 4
    full_bytes = scale_bytes(full[1])
    minimum = (S.round_up(-(-tokens // f.sf_vec), 4) if f.recipe == S.BLOCKED
               else -(-tokens // S.BLOCK_TOKENS))
    assert minimum < needed  # counts that need more than the lower bound
    for capacity in sorted({minimum, minimum + 1, (minimum + needed) // 2, needed - 1, needed,
                            needed + 5}):
        small = Q.reference_quantize(values, offsets, fmt, scale_capacity=capacity)
        assert small[1].shape == Q.layout(fmt, tokens, 200, len(counts),
                                          scale_capacity=capacity).scale_shape
        assert np.array_equal(small[0], full[0])
        if fmt == "nvfp4":
            assert np.array_equal(f32_bits(small[2]), f32_bits(full[2]))
        got = scale_bytes(small[1])
        kept = min(capacity, needed) * per_unit
        assert np.array_equal(got[:kept], full_bytes[:kept])
        assert not got[kept:].any()
        if capacity < needed:
            assert full_bytes[kept:needed * per_unit].any()  # something was dropped
        # gwgrad.quantize takes the capacity from a given scale tensor
        scales = np.full(small[1].shape, 0xFF, np.uint8) if f.recipe == S.BLOCKED else \
            np.full(small[1].shape, np.nan, np.float32)
        gwgrad.quantize(xb, offsets.astype(np.int32), fmt, scales=scales)
        assert np.array_equal(scales.view(np.uint8), small[1].view(np.uint8))
    with pytest.raises(ValueError, match="^scales: "):
        Q.reference_quantize(values, offsets, fmt, scale_capacity=minimum - 1)


@pytest.mark.parametrize("fmt", BLOCKED)
def test_blocked_padding_bytes_are_zero(rng, fmt):
    """Rows past the channels and columns past an expert's tokens (C_e is a multiple of 4) hold
    code 0, never NaN; so do the columns past the experts' (up to the capacity). Nonzero data:
    every real scale code is nonzero."""
    f = Q.FORMATS[fmt]
    counts = draw_counts(rng, 6, Q.count_multiple(fmt))
    offsets = np.cumsum(counts)
    channels = 136
    xb, values = bf16_data(rng, int(counts.sum()), channels, spread=2.0)
    out = Q.reference_quantize(values, offsets, fmt)
    mpad = S.round_up(channels, 128)
    rule = S.column_rule(f.recipe, f.sf_vec)
    widths = [S.expert_columns(int(c), rule) for c in counts]
    # each expert's whole (Mpad, C_e) chunk, padding included
    chunks = S.read_blocked(out[1], [w * f.sf_vec for w in widths], f.sf_vec, mpad)
    for e, (chunk, count) in enumerate(zip(chunks, counts)):
        real = -(-int(count) // f.sf_vec)
        assert chunk.shape == (mpad, widths[e])
        assert (chunk[:channels, :real] != 0).all(), e
        assert not chunk[channels:].any() and not chunk[:, real:].any(), e
    assert not scale_bytes(out[1])[mpad * sum(widths):].any()  # flat: chunks from byte 0


# --- NaN, Inf, denormals ------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,elem", CASES)
def test_nan_and_inf_poison_their_blocks(rng, fmt, elem):
    """A block holding NaN / +Inf / -Inf gets the NaN scale (E8M0 0xFF, E4M3 0x7F, FP32 NaN;
    NVFP4: the expert's global scale and all its block scales), FP8 codes 0x7F: every value it
    dequantizes to is NaN, no non-finite input becomes a finite value, other blocks stay
    finite."""
    f = Q.FORMATS[fmt]
    counts = np.array([64, 0, 160, 96, 128])
    offsets = np.cumsum(counts)
    tokens, channels = int(counts.sum()), 48
    xb, values = bf16_data(rng, tokens, channels, spread=3.0)
    spans = ranges(offsets, tokens, Q.count_multiple(fmt))
    poison = [(10, 3, np.nan), (64 + 40, 10, np.inf), (224 + 70, 20, -np.inf),
              (64 + 150, 3, np.nan)]
    for t, c, v in poison:
        values[t, c] = v
    out = Q.reference_quantize(values, offsets, fmt, elem)
    check_against_models(out, values, spans, fmt, elem)
    # the NaN mask: the poisoned value's block (sf_vec or 128 tokens of its channel, the
    # channel's whole expert for per_expert_channel, NVFP4's whole expert)
    mask = np.zeros((channels, tokens), bool)
    for t, c, _ in poison:
        e = next(i for i, (b, n) in enumerate(spans) if b <= t < n)
        begin, end = spans[e]
        if fmt == "nvfp4":
            mask[:, begin:end] = True
        elif f.recipe == S.PER_EXPERT_CHANNEL:
            mask[c, begin:end] = True
        else:
            block = f.sf_vec
            first = begin + (t - begin) // block * block
            mask[c, first:min(first + block, end)] = True
    deq = dequantize(out, values, spans, fmt, elem)
    assert np.array_equal(np.isnan(deq), mask)
    assert np.isfinite(deq[~mask]).all()
    codes = unpack(out[0], elem)
    if elem != "e2m1":
        assert (codes[mask] == 0x7F).all()
    else:
        assert (codes[mask] == 0).all()  # E2M1 has no NaN: the scale carries it
    got_scales = expert_scales(out, fmt, spans, channels)
    for e, (begin, end) in enumerate(spans):
        if end == begin:
            continue
        s = np.asarray(got_scales[e])
        block = f.sf_vec if f.sf_vec else end - begin
        bad = mask[:channels, begin:end][:, ::block]  # one entry per scale
        if s.ndim == 1:
            s, bad = s[:, None], bad[:, :1]
        if f.scale_dtype == DType.FLOAT32:
            assert np.array_equal(np.isnan(s), bad)
        else:
            nan_code = 0xFF if f.scale_dtype == DType.FLOAT8_E8M0FNU else 0x7F
            assert np.array_equal(s == nan_code, bad)
        if fmt == "nvfp4":
            assert np.isnan(out[2][e]) == bad.any()


def test_nan_and_inf_of_the_numpy_path(rng):
    xb, values = bf16_data(rng, 64, 16, spread=2.0)
    xb[3, 2] = np.inf
    xb[40, 5] = np.nan
    values = xb.astype(np.float64)
    offsets = np.array([64], np.int32)
    for fmt, elem in CASES:
        got = gwgrad.quantize(xb, offsets, fmt, elem=elem)
        want = Q.reference_quantize(values, offsets, fmt, elem)
        for g, w in zip(got, want):
            if w is not None:
                assert np.array_equal(np.asarray(g).view(np.uint8), w.view(np.uint8)), fmt


@pytest.mark.parametrize("fmt,elem", CASES)
def test_bf16_denormals(fmt, elem):
    """BF16 denormals are values, never flushed: an all-denormal block gets the smallest scale
    (E8M0 2**-127; the FP32 recipes' floor 2**-126) and codes of the denormals divided by it;
    next to a normal value they round as any small value. Hand-computed scales, codes by
    formats.encode; gwgrad.quantize (through ml_dtypes bfloat16) agrees."""
    tokens, channels = 128, 8
    x = np.zeros((tokens, channels))
    x[:, 0] = 2.0 ** -130
    x[:, 1] = np.where(np.arange(tokens) % 2, -1.0, 1.0) * 2.0 ** -133  # the smallest BF16
    x[:, 2] = 2.0 ** -127 * (1 + np.arange(tokens) % 7 / 8)
    x[:, 3] = 2.0 ** -130
    x[::32, 3] = 1.0  # a normal value in every 32-token block
    x[5, 4] = 2.0 ** -128  # one denormal among zeros
    xb = x.astype(BF16)
    assert np.array_equal(xb.astype(np.float64), x)  # exact BF16 values
    offsets = np.array([tokens], np.int32)
    out = Q.reference_quantize(x, offsets, fmt, elem)
    check_against_models(out, x, [(0, tokens)], fmt, elem)
    codes = unpack(out[0], elem)
    f = Q.FORMATS[fmt]
    if fmt == "nvfp4":
        g = out[2][0]
        assert g == np.float32(1.0) / np.float32(2688.0) and g > 0  # amax 1.0
    elif f.recipe == S.BLOCKED:
        raw = S.read_blocked(out[1], [tokens], f.sf_vec, channels)[0]
        for c in (0, 1, 2, 4):  # all-denormal blocks: the smallest scale, 2**-127
            assert (raw[c] == 0).all()
            assert np.array_equal(codes[c], F.encode(x[:, c] * 2.0 ** 127, elem))
        assert (raw[3] == 127 - F.EMAX[elem]).all()  # amax 1.0
        assert np.array_equal(codes[3], F.encode(x[:, 3] * 2.0 ** F.EMAX[elem], elem))
        if elem != "e2m1":
            assert codes[0].all() and codes[1].all()  # not flushed to zero
    else:
        s = out[1][0]  # expert 0 (per_expert_channel) or its block 0 (1x128)
        for c in (0, 1, 2, 4):  # amax / fmax below the floor: scale 2**-126
            assert s[c] == np.float32(2.0 ** -126)
            assert np.array_equal(codes[c], F.encode(x[:, c] * 2.0 ** 126, elem))
            assert codes[c, 5 if c == 4 else 0] != 0
    got = gwgrad.quantize(xb, offsets, fmt, elem=elem)
    for g, w in zip(got, out):
        if w is not None:
            assert np.array_equal(np.asarray(g).view(np.uint8), w.view(np.uint8))


# --- gwgrad.quantize on NumPy arrays ------------------------------------------------------------

@pytest.mark.parametrize("fmt,elem", CASES)
def test_quantize_allocates_numpy_outputs(rng, fmt, elem):
    counts = draw_counts(rng, 5, Q.count_multiple(fmt))
    offsets = np.cumsum(counts).astype(np.int32)
    xb, values = bf16_data(rng, int(counts.sum()), 72)
    result = gwgrad.quantize(xb, offsets, fmt, elem=elem)
    assert list(result) == [result["data"], result["scales"], result["global_scale"]]
    data, scales, gs = result
    lay = Q.layout(fmt, xb.shape[0], 72, 5, elem)
    want = Q.reference_quantize(values, offsets, fmt, elem)
    assert isinstance(data, np.ndarray) and data.shape == lay.data_shape
    assert data.dtype in (np.dtype(np.uint8), np.dtype(ML.get(lay.data_dtype, np.uint8)))
    assert np.array_equal(data.view(np.uint8), want[0])
    assert isinstance(scales, np.ndarray) and scales.shape == lay.scale_shape
    assert scales.dtype in (np.dtype(np.uint8), np.dtype(ML[lay.scale_dtype]))
    assert np.array_equal(scales.view(np.uint8), want[1].view(np.uint8))
    if fmt == "nvfp4":
        assert gs.shape == (5,) and gs.dtype == np.float32
        assert np.array_equal(f32_bits(gs), f32_bits(want[2]))
    else:
        assert gs is None


@pytest.mark.parametrize("fmt,elem", CASES)
def test_quantize_writes_into_given_outputs(rng, fmt, elem):
    counts = draw_counts(rng, 5, Q.count_multiple(fmt))
    offsets = np.cumsum(counts).astype(np.int32)
    xb, values = bf16_data(rng, int(counts.sum()), 64)
    lay = Q.layout(fmt, xb.shape[0], 64, 5, elem)
    want = Q.reference_quantize(values, offsets, fmt, elem)
    # uint8 bytes, or the format's own dtype where NumPy has one (ml_dtypes)
    for typed in (False, True):
        data = np.full(lay.data_shape, 0xFF, np.uint8)
        if typed and elem != "e2m1":
            data = data.view(ML[lay.data_dtype])
        if lay.scale_dtype == DType.FLOAT32:
            scales = np.full(lay.scale_shape, np.nan, np.float32)
        else:
            scales = np.full(lay.scale_shape, 0xFF, np.uint8)
            if typed:
                scales = scales.view(ML[lay.scale_dtype])
        gs = np.full(5, np.nan, np.float32) if fmt == "nvfp4" else None
        result = gwgrad.quantize(xb, offsets, fmt, elem=elem, data=data, scales=scales,
                                 global_scale=gs)
        assert result["data"] is data and result["scales"] is scales
        assert result["global_scale"] is gs
        assert np.array_equal(data.view(np.uint8), want[0])
        assert np.array_equal(scales.view(np.uint8), want[1].view(np.uint8))
        if gs is not None:
            assert np.array_equal(f32_bits(gs), f32_bits(want[2]))


def test_quantize_no_tokens():
    xb = np.zeros((0, 16), BF16)
    offsets = np.zeros(3, np.int32)
    for fmt, elem in CASES:
        data, scales, gs = gwgrad.quantize(xb, offsets, fmt, elem=elem)
        assert data.shape == Q.layout(fmt, 0, 16, 3, elem).data_shape
        if fmt == "per_expert_channel":
            assert (scales == 1.0).all()
        else:
            assert not np.asarray(scales).view(np.uint8).any()
        if fmt == "nvfp4":
            assert (gs == 1.0).all()


def _x(tokens=64, channels=16):
    return np.zeros((tokens, channels), BF16)


OFF = np.array([32, 64], np.int32)
READ_ONLY = np.zeros((16, 64), np.uint8)
READ_ONLY.flags.writeable = False

ERRORS = [
    ("x float32", lambda: gwgrad.quantize(_x().astype(np.float32), OFF, "mxfp8"), "x"),
    ("x 1-D", lambda: gwgrad.quantize(_x()[:, 0].copy(), OFF, "mxfp8"), "x"),
    ("x 3-D", lambda: gwgrad.quantize(_x()[None], OFF, "mxfp8"), "x"),
    ("x column-major", lambda: gwgrad.quantize(np.asfortranarray(_x()), OFF, "mxfp8"), "x"),
    ("x channels 12", lambda: gwgrad.quantize(_x(64, 12), OFF, "mxfp8"), "x"),
    ("x tokens 48", lambda: gwgrad.quantize(_x(48), OFF, "mxfp8"), "x"),
    ("x None", lambda: gwgrad.quantize(None, OFF, "mxfp8"), "x"),
    ("x list", lambda: gwgrad.quantize([[0.0] * 8] * 32, OFF, "mxfp8"), "x"),
    ("offsets int64", lambda: gwgrad.quantize(_x(), OFF.astype(np.int64), "mxfp8"), "offsets"),
    ("offsets 2-D", lambda: gwgrad.quantize(_x(), OFF.reshape(1, 2), "mxfp8"), "offsets"),
    ("offsets empty", lambda: gwgrad.quantize(_x(), OFF[:0], "mxfp8"), "offsets"),
    ("offsets None", lambda: gwgrad.quantize(_x(), None, "mxfp8"), "offsets"),
    ("offsets strided", lambda: gwgrad.quantize(_x(), np.repeat(OFF, 2)[::2], "mxfp8"),
     "offsets"),
    ("offsets list", lambda: gwgrad.quantize(_x(), [32, 64], "mxfp8"), "offsets"),
    ("fmt", lambda: gwgrad.quantize(_x(), OFF, "fp8"), "fmt"),
    ("elem", lambda: gwgrad.quantize(_x(), OFF, "mxfp4", elem="e4m3"), "elem"),
    ("data shape", lambda: gwgrad.quantize(_x(), OFF, "mxfp8",
                                           data=np.zeros((16, 32), np.uint8)), "data"),
    ("data FP4 shape", lambda: gwgrad.quantize(_x(), OFF, "nvfp4",
                                               data=np.zeros((16, 64), np.uint8)), "data"),
    ("data dtype", lambda: gwgrad.quantize(_x(), OFF, "mxfp8",
                                           data=np.zeros((16, 64), np.int8)), "data"),
    ("data e5m2 for e4m3", lambda: gwgrad.quantize(
        _x(), OFF, "mxfp8", data=np.zeros((16, 64), ml_dtypes.float8_e5m2)), "data"),
    ("data read-only", lambda: gwgrad.quantize(_x(), OFF, "mxfp8", data=READ_ONLY), "data"),
    ("data transposed", lambda: gwgrad.quantize(_x(), OFF, "mxfp8",
                                                data=np.zeros((64, 16), np.uint8).T), "data"),
    ("scales rows", lambda: gwgrad.quantize(_x(), OFF, "mxfp8",
                                            scales=np.zeros((16, 8), np.uint8)), "scales"),
    ("scales capacity", lambda: gwgrad.quantize(_x(), OFF, "mxfp8",
                                                scales=np.zeros((128, 0), np.uint8)), "scales"),
    ("scales 1-D", lambda: gwgrad.quantize(_x(), OFF, "mxfp8",
                                           scales=np.zeros(128 * 8, np.uint8)), "scales"),
    ("scales float32 for E8M0", lambda: gwgrad.quantize(
        _x(), OFF, "mxfp8", scales=np.zeros((128, 8), np.float32)), "scales"),
    ("scales uint8 for FP32", lambda: gwgrad.quantize(
        _x(), OFF, "per_expert_channel", scales=np.zeros((2, 16), np.uint8)), "scales"),
    ("scales 1x128 rows", lambda: gwgrad.quantize(
        _x(), OFF, "block_1x128", scales=np.zeros((0, 16), np.float32)), "scales"),
    ("scales E4M3 for E8M0", lambda: gwgrad.quantize(
        _x(), OFF, "mxfp8", scales=np.zeros((128, 8), ml_dtypes.float8_e4m3fn)), "scales"),
    ("global_scale for mxfp8", lambda: gwgrad.quantize(
        _x(), OFF, "mxfp8", global_scale=np.zeros(2, np.float32)), "global_scale"),
    ("global_scale shape", lambda: gwgrad.quantize(
        _x(), OFF, "nvfp4", global_scale=np.zeros(3, np.float32)), "global_scale"),
    ("global_scale dtype", lambda: gwgrad.quantize(
        _x(), OFF, "nvfp4", global_scale=np.zeros(2, np.float64)), "global_scale"),
]


@pytest.mark.parametrize("case", ERRORS, ids=[c[0] for c in ERRORS])
def test_quantize_argument_errors(case):
    _, call, argument = case
    with pytest.raises(ValueError) as err:
        call()
    assert isinstance(err.value, ArgumentError) and err.value.argument == argument, err.value
    assert str(err.value).startswith(f"{argument}: ")


@pytest.mark.parametrize("name", ["x", "data", "scales", "offsets", "global_scale"])
def test_quantize_misaligned_cuda_address_names_the_argument(monkeypatch, name):
    """The GPU path's alignment rules (16 bytes for the vector loads and stores, 4 for the
    int32 / float32 words), checked before any compile or launch: raw CUDA descriptors with
    one address off by 4 (2 for 4-byte words), the launch itself stubbed out."""
    from gwgrad import backends
    from gwgrad.tensors import TensorDesc

    launched = []

    class Plan:  # gwgrad.plan.QuantizePlan's interface
        workspace_bytes = 4096

        def launch(self, *args):
            launched.append(args)

    monkeypatch.setattr(Q.plan, "quantize_plan", lambda request, tokens, device: Plan())
    monkeypatch.setattr(backends, "detect_arch", lambda device: "sm_90a")
    monkeypatch.setattr(Q.interop, "workspace", lambda *a, **k: 1 << 40)
    tokens, channels, experts = 64, 128, 2
    lay = Q.layout("nvfp4", tokens, channels, experts)

    def desc(base, shape, dtype):
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
        return TensorDesc(base, tuple(shape), strides, dtype, "cuda", 0)

    shift = {"x": 4, "data": 4, "scales": 4, "offsets": 2, "global_scale": 2}
    bases = {n: (1 << 30) * (i + 1) + (shift[n] if n == name else 0)
             for i, n in enumerate(shift)}
    args = dict(
        data=desc(bases["data"], lay.data_shape, DType.UINT8),
        scales=desc(bases["scales"], lay.scale_shape, DType.UINT8),
        global_scale=desc(bases["global_scale"], lay.global_shape, DType.FLOAT32))
    x = desc(bases["x"], (tokens, channels), DType.BFLOAT16)
    offsets = desc(bases["offsets"], (experts,), DType.INT32)
    with pytest.raises(ValueError, match=rf"^{name}: expected a \d+-byte aligned"):
        gwgrad.quantize(x, offsets, "nvfp4", stream=0, **args)
    assert not launched
    bases[name] -= shift[name]  # aligned: the call goes through to the (stubbed) launch
    gwgrad.quantize(desc(bases["x"], (tokens, channels), DType.BFLOAT16),
                    desc(bases["offsets"], (experts,), DType.INT32), "nvfp4", stream=0,
                    data=desc(bases["data"], lay.data_shape, DType.UINT8),
                    scales=desc(bases["scales"], lay.scale_shape, DType.UINT8),
                    global_scale=desc(bases["global_scale"], lay.global_shape, DType.FLOAT32))
    assert len(launched) == 1
