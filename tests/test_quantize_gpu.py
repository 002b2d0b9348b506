"""The GPU quantizers (gwgrad/kernels/quantize.py through gwgrad.quantize) on an SM90+ GPU:
every format bit-exact against the NumPy model (gwgrad.quantizers.reference_quantize, built on
gwgrad/formats.py) on random BF16 data spanning many magnitudes, with empty experts, counts
that are not multiples of 128, NaN / Inf / denormal / huge inputs, outputs NaN-poisoned inside
guard memory that must stay untouched; invalid offsets and a too-small scale capacity; CUDA
graph replays with new offsets; and quantize -> FP8 GEMM against the BF16 weight gradient."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gwgrad  # noqa: E402
from gwgrad import quantizers as Q  # noqa: E402
from gwgrad import scales as S  # noqa: E402
from quantize_cases import special_values, tiny_expert_values  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available()
                       or torch.cuda.get_device_capability()[0] < 9,
                       reason="needs an SM90+ GPU"),
]

GUARD = 4096  # bytes of guard memory on each side of an output
SENTINEL = 0xA5
CASES = [(fmt, elem) for fmt, f in Q.FORMATS.items() for elem in f.elems]


def bf16_input(rng, tokens, channels, specials=True):
    """(BF16 CUDA tensor, its float64 values) of tests/quantize_cases.special_values."""
    x = special_values(rng, tokens, channels, specials=specials)
    xt = torch.from_numpy(x.astype(np.float32)).bfloat16()  # round to nearest even
    values = xt.double().numpy()
    xt = xt.cuda()
    return xt, values


def counts_for(rng, experts, multiple, tokens_per=160):
    counts = rng.integers(0, 2 * tokens_per // multiple + 1, experts) * multiple
    counts[0] = 0
    if experts > 2:
        counts[2] = 0
    return counts


def guarded(shape, dtype):
    """A poisoned (0xFF: NaN in every float format) output inside sentinel-filled guards."""
    itemsize = dtype.itemsize
    n = int(np.prod(shape)) * itemsize
    buf = torch.full((GUARD + n + GUARD,), SENTINEL, dtype=torch.uint8, device="cuda")
    buf[GUARD:GUARD + n] = 0xFF
    view = buf[GUARD:GUARD + n].view(dtype).view(shape)
    return buf, view


def check_guards(buf, name):
    host = buf.cpu().numpy()
    assert (host[:GUARD] == SENTINEL).all(), f"{name}: write before the output"
    assert (host[-GUARD:] == SENTINEL).all(), f"{name}: write after the output"


def torch_dtype(d):
    from gwgrad.interop.torch import native_dtype

    return native_dtype(d)


def outputs(lay):
    bufs, views = {}, {}
    specs = {"data": (lay.data_shape, lay.data_dtype), "scales": (lay.scale_shape, lay.scale_dtype)}
    if lay.global_shape is not None:
        specs["global_scale"] = (lay.global_shape, gwgrad.DType.FLOAT32)
    for name, (shape, dtype) in specs.items():
        bufs[name], views[name] = guarded(shape, torch_dtype(dtype))
    return bufs, views


def host_bytes(t):
    return t.contiguous().view(torch.uint8).cpu().numpy()


def compare(views, want, fmt, offsets_host, tokens, capacity):
    """The outputs against the model's: data and global scales whole; scales up to what the
    experts use (the rest of a scale tensor is never written: it must keep its poison)."""
    want_data, want_scales, want_gs = want
    got = host_bytes(views["data"]).reshape(want_data.shape)
    # Token columns: compared where exactly one expert's (sanitized) range covers them;
    # columns no expert covers keep their poison (invalid offsets can leave gaps, and can
    # make ranges overlap: codes there are unspecified).
    begin, end = Q._counts(np.asarray(offsets_host), tokens, Q.count_multiple(fmt))
    cover = np.zeros(tokens + 1, np.int64)
    np.add.at(cover, begin, 1)
    np.add.at(cover, end, -1)
    cover = np.cumsum(cover)[:tokens]
    pack = 2 if want_data.shape[1] * 2 == tokens and tokens else 1
    cover = cover[::pack]
    assert (got[:, cover == 0] == 0xFF).all(), "data: a token no expert owns was written"
    got, want_data = got[:, cover == 1], want_data[:, cover == 1]
    bad = np.argwhere(got != want_data)
    assert bad.size == 0, f"data: {len(bad)} codes differ, first {bad[:4].tolist()}: " \
        f"got {got[tuple(bad[0])]:#x} want {want_data[tuple(bad[0])]:#x}"
    f = Q.FORMATS[fmt]
    got_s = host_bytes(views["scales"]).reshape(-1)
    want_s = np.ascontiguousarray(want_scales).view(np.uint8).reshape(-1)
    used = want_s.size
    if f.recipe != "per_expert_channel":
        begin, end = Q._counts(np.asarray(offsets_host), tokens, Q.count_multiple(fmt))
        rule = S.column_rule(f.recipe, f.sf_vec)
        needed = S.columns_needed((end - begin).tolist(), rule)
        lay = Q.layout(fmt, tokens, want_data.shape[0], len(offsets_host), None, capacity)
        cap = lay.scale_capacity
        per_column = (want_scales.shape[0] if f.recipe == "blocked" else
                      want_scales.shape[1] * 4)
        used = min(needed, cap) * per_column
    bad = np.flatnonzero(got_s[:used] != want_s[:used])
    assert bad.size == 0, f"scales: {len(bad)} of {used} bytes differ, first at {bad[:4].tolist()}"
    assert (got_s[used:] == 0xFF).all(), "scales: bytes past the experts' scales were written"
    if want_gs is not None:
        got_g = views["global_scale"].cpu().numpy()
        assert np.array_equal(got_g.view(np.uint32), want_gs.view(np.uint32)), (got_g, want_gs)


def run_and_compare(x, values, offsets_host, fmt, elem, capacity=None):
    tokens, channels = values.shape
    experts = len(offsets_host)
    lay = Q.layout(fmt, tokens, channels, experts, elem, capacity)
    bufs, views = outputs(lay)
    offsets = torch.tensor(np.asarray(offsets_host), dtype=torch.int32, device="cuda")
    gwgrad.quantize(x, offsets, fmt, elem=elem, data=views["data"], scales=views["scales"],
                    global_scale=views.get("global_scale"))
    torch.cuda.synchronize()
    gwgrad.check_errors()
    want = Q.reference_quantize(values, np.asarray(offsets_host), fmt, elem, capacity)
    for name in bufs:
        check_guards(bufs[name], name)
    compare(views, want, fmt, offsets_host, tokens, capacity)
    return views


@pytest.mark.parametrize("fmt,elem", CASES)
def test_bit_exact(rng, fmt, elem):
    multiple = Q.count_multiple(fmt)
    counts = counts_for(rng, 7, multiple)
    channels = 200  # neither a multiple of 64 nor of 128: partial channel blocks, pad rows
    x, values = bf16_input(rng, int(counts.sum()), channels)
    run_and_compare(x, values, np.cumsum(counts), fmt, elem)


@pytest.mark.parametrize("fmt,elem,experts", [
    ("mxfp8", "e4m3", 256), ("nvfp4", "e2m1", 256), ("per_expert_channel", "e5m2", 256),
    ("block_1x128", "e4m3", 256), ("mxfp8", "e5m2", 1000), ("block_1x128", "e4m3", 1000)])
def test_many_experts_large(rng, fmt, elem, experts):
    """Many experts (the prep kernel's scan over several chunks, its binary search), a
    zipf-like spread (one expert with thousands of tokens, many empty), 1024 channels."""
    multiple = Q.count_multiple(fmt)
    w = 1.0 / np.arange(1, experts + 1) ** 1.2
    counts = (np.floor(w / w.sum() * 16384 / multiple) * multiple).astype(np.int64)
    rng.shuffle(counts)
    x, values = bf16_input(rng, int(counts.sum()), 1024, specials=False)
    run_and_compare(x, values, np.cumsum(counts), fmt, elem)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_tiny_expert(rng, fmt):
    """An expert of BF16 denormals and +-0 beside normal ones: NVFP4's blocks get an infinite
    multiplier (0 * Inf is NaN, code 0: the quantizer's per-value path, not the fast one);
    MXFP4's the largest scale (2**127)."""
    counts = np.array([64, 96, 32])
    channels = 136
    values = special_values(rng, int(counts.sum()), channels, specials=False)
    values[64:160] = tiny_expert_values(rng, 96, channels)
    xt = torch.from_numpy(values.astype(np.float32)).bfloat16()
    values = xt.double().numpy()
    run_and_compare(xt.cuda(), values, np.cumsum(counts), fmt, "e2m1")


@pytest.mark.parametrize("fmt,elem", CASES)
def test_no_tokens(rng, fmt, elem):
    x, values = bf16_input(rng, 0, 64)
    run_and_compare(x, values, np.zeros(3, np.int64), fmt, elem)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "per_expert_channel", "block_1x128"])
def test_invalid_offsets_stay_inside(rng, fmt):
    """Invalid offsets never fail here and never move a byte outside the outputs. Without
    overlapping ranges (negative, past the end, misaligned) the result is the model's (same
    sanitizing: those experts are empty); overlapping ranges (decreasing offsets, int32
    extremes) leave the outputs unspecified (the GEMM's offsets check reports them), so only
    the guards are checked there."""
    multiple = Q.count_multiple(fmt)
    tokens = 8 * 128
    x, values = bf16_input(rng, tokens, 200)
    elem = Q.FORMATS[fmt].elems[0]
    for offsets in ([-64, 256, 100000, tokens],  # negative, past the end
                    [multiple // 2, 3 * multiple, 5 * multiple + 3, tokens]):  # misaligned
        run_and_compare(x, values, np.asarray(offsets), fmt, elem)
    for offsets in ([256, 128, 512, tokens], [2**31 - 1, -2**31, 0, tokens]):  # overlapping
        lay = Q.layout(fmt, tokens, 200, 4, elem)
        bufs, views = outputs(lay)
        gwgrad.quantize(x, torch.tensor(offsets, dtype=torch.int32, device="cuda"), fmt,
                        elem=elem, data=views["data"], scales=views["scales"],
                        global_scale=views.get("global_scale"))
        torch.cuda.synchronize()
        for name in bufs:
            check_guards(bufs[name], name)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "block_1x128"])
def test_small_scale_capacity(rng, fmt):
    """A scale tensor too small for the counts: only the scales that fit are written."""
    multiple = Q.count_multiple(fmt)
    counts = np.array([4, 3, 0, 5]) * 128 + multiple
    x, values = bf16_input(rng, int(counts.sum()), 200)  # two row atoms of blocked scales
    f = Q.FORMATS[fmt]
    minimum = (-(-int(counts.sum()) // (f.sf_vec)))
    capacity = -(-minimum // 4) * 4 if f.recipe == "blocked" else minimum
    run_and_compare(x, values, np.cumsum(counts), fmt, f.elems[0], capacity)


@pytest.mark.parametrize("fmt", ["mxfp8", "per_expert_channel", "nvfp4"])
def test_cuda_graph_replays_with_new_offsets(rng, fmt):
    elem = Q.FORMATS[fmt].elems[0]
    multiple = Q.count_multiple(fmt)
    tokens, channels, experts = 16 * 64, 128, 6
    x, values = bf16_input(rng, tokens, channels, specials=False)
    lay = Q.layout(fmt, tokens, channels, experts, elem)
    _, views = outputs(lay)
    offsets = torch.zeros(experts, dtype=torch.int32, device="cuda")

    def draw():
        cuts = np.sort(rng.integers(0, tokens // multiple + 1, experts - 1)) * multiple
        return np.append(cuts, tokens)

    offsets.copy_(torch.tensor(draw(), dtype=torch.int32))
    call = lambda: gwgrad.quantize(x, offsets, fmt, elem=elem, data=views["data"],  # noqa: E731
                                   scales=views["scales"], global_scale=views.get("global_scale"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm: compile, workspace
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # Capture on a stream of the tensors' device: torch.cuda.graph's default capture
    # stream is made once per process, on the device current at its first use.
    with torch.cuda.graph(graph, stream=stream):
        call()
    for _ in range(4):
        new = draw()
        offsets.copy_(torch.tensor(new, dtype=torch.int32))
        views["data"].view(torch.uint8).fill_(0xFF)
        views["scales"].view(torch.uint8).fill_(0xFF)
        graph.replay()
        torch.cuda.synchronize()
        compare(views, Q.reference_quantize(values, new, fmt, elem), fmt, new, tokens, None)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                    reason="the FP8 GEMM runs on SM90")
@pytest.mark.parametrize("fmt", ["per_expert_channel", "block_1x128", "mxfp8"])
def test_quantize_then_fp8_gemm(rng, fmt):
    """quantize(x), quantize(dy) -> the FP8 GEMM within 6% (relative Frobenius error) of the
    BF16 weight gradient of the same BF16 inputs (E4M3 keeps 3 mantissa bits)."""
    import gwgrad.adapters.torch as gwt

    multiple = Q.count_multiple(fmt)
    experts, hidden, inter = 6, 512, 384
    counts = counts_for(rng, experts, multiple, 320)
    offsets = torch.tensor(np.cumsum(counts), dtype=torch.int32, device="cuda")
    tokens = int(counts.sum())
    gen = torch.Generator(device="cuda").manual_seed(int(rng.integers(1 << 31)))
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    dy = torch.randn(tokens, inter, device="cuda", generator=gen).bfloat16()
    qx = gwgrad.quantize(x, offsets, fmt)
    qdy = gwgrad.quantize(dy, offsets, fmt)
    f = Q.FORMATS[fmt]
    # The contract's call: A = x.T (hidden, tokens) = qx's data, B = dy (tokens, inter).
    w = gwgrad.grouped_gemm_wgrad(
        qx["data"], qdy["data"].t(), qx["scales"], qdy["scales"], offsets,
        wgrad_dtype=gwgrad.DType.FLOAT32, sf_vec_size=f.sf_vec or 16,
        scale_recipe=f.recipe)["wgrad_tensor"]
    ref = gwt.wgrad(x, dy, offsets, out_dtype=torch.float32)
    gwgrad.check_errors()
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.all(w[e] == 0)
            continue
        err = ((w[e] - ref[e]).norm() / ref[e].norm()).item()
        assert err < 0.06, (e, err)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "per_expert_channel", "block_1x128"])
def test_adapters_bit_equal_to_core(rng, fmt):
    """The torch adapter (eager and its gwgrad::quantize_into op) and the CuPy adapter give
    the core's bytes on CUDA."""
    import gwgrad.adapters.torch as gwt

    multiple = Q.count_multiple(fmt)
    counts = counts_for(rng, 5, multiple)
    x, values = bf16_input(rng, int(counts.sum()), 136)
    offsets = torch.tensor(np.cumsum(counts), dtype=torch.int32, device="cuda")
    core = gwgrad.quantize(x, offsets, fmt)
    # Scale bytes past the experts' are never written (uninitialized in every output here).
    f = Q.FORMATS[fmt]
    used = None
    if f.recipe != "per_expert_channel":
        rule = S.column_rule(f.recipe, f.sf_vec)
        per_column = (core["scales"].shape[0] if f.recipe == "blocked"
                      else core["scales"].shape[1] * 4)
        used = S.columns_needed(counts.tolist(), rule) * per_column

    def cut(b, i):
        return b.reshape(-1)[:used] if i == 1 and used is not None else b.reshape(-1)

    want = [None if t is None else cut(host_bytes(t), i) for i, t in
            enumerate((core["data"], core["scales"], core["global_scale"]))]
    eager = gwt.quantize(x, offsets, fmt)
    outs = tuple(torch.empty_like(t) if t is not None else None for t in eager)
    torch.ops.gwgrad.quantize_into(x, offsets, fmt, None, *outs)
    torch.cuda.synchronize()
    for got in (eager, outs):
        for i, (g, w) in enumerate(zip(got, want)):
            assert (g is None) == (w is None)
            if w is not None:
                assert np.array_equal(cut(host_bytes(g), i), w), i
    cupy = pytest.importorskip("cupy")
    import gwgrad.adapters.cupy as gwc

    xc = cupy.asarray(x.view(torch.int16)).view(cupy.uint16)
    oc = cupy.asarray(offsets)
    res = gwc.quantize(xc, oc, fmt, dtype="bfloat16")
    cupy.cuda.runtime.deviceSynchronize()
    for i, (g, w) in enumerate(zip(res, want)):
        if w is not None:
            assert np.array_equal(cut(cupy.asnumpy(g).view(np.uint8), i), w), i
