"""The adapters' ``quantize`` without a GPU: gwgrad.adapters.torch.quantize on CPU tensors and
gwgrad.adapters.cupy.quantize on NumPy arrays, bit-equal to the NumPy model
(gwgrad.quantizers.reference_quantize) for every format, ``out=`` reuse, argument errors under
the adapters' names, the torch op (opcheck, meta tensors, torch.compile), and quantize ->
wgrad_fp8 against the float64 weight gradient. CuPy's own arrays skip without CuPy and a GPU."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gwgrad  # noqa: E402
import gwgrad.adapters.cupy as gwc  # noqa: E402
import gwgrad.adapters.torch as gwt  # noqa: E402
from gwgrad import quantizers as Q  # noqa: E402
from quantize_cases import special_values  # noqa: E402
from torch.library import opcheck  # noqa: E402

CHANNELS = 40  # a multiple of 8, not of 16 or 128 (the blocked scales' rows are padded)
CASES = [(fmt, elem) for fmt, f in Q.FORMATS.items() for elem in f.elems]
DATA_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2,
               "e2m1": getattr(torch, "float4_e2m1fn_x2", torch.uint8)}
SCALE_DTYPES = {"mxfp8": getattr(torch, "float8_e8m0fnu", torch.uint8),
                "mxfp4": getattr(torch, "float8_e8m0fnu", torch.uint8),
                "nvfp4": torch.float8_e4m3fn, "per_expert_channel": torch.float32,
                "block_1x128": torch.float32}


def counts_for(fmt, units=(3, 0, 5, 1, 0, 9)):
    """Multiples of the format's count multiple, not all of 128, two empty experts (blocked:
    96, 0, 160, 32, 0, 288; FP32 recipes: 48, 0, 80, 16, 0, 144)."""
    return [u * Q.count_multiple(fmt) for u in units]


def bf16_values(rng, tokens, channels=CHANNELS, specials=True):
    """float32 values exact in BF16: tests/quantize_cases.special_values, rounded."""
    x = special_values(rng, tokens, channels, specials=specials)
    return x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def torch_inputs(rng, fmt, channels=CHANNELS, specials=True, units=(3, 0, 5, 1, 0, 9)):
    counts = counts_for(fmt, units)
    values = bf16_values(rng, sum(counts), channels, specials)
    x = torch.from_numpy(values).bfloat16()
    offsets = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    return x, offsets, values


def bits(arr) -> np.ndarray:
    """An array's bytes as unsigned integers of its width (bit-exact comparisons, NaN too)."""
    if isinstance(arr, torch.Tensor):
        arr = arr.view(torch.uint8) if arr.element_size() == 1 else arr.view(torch.int32)
        arr = arr.numpy()
    arr = np.ascontiguousarray(arr)
    return arr.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[arr.dtype.itemsize])


def assert_bits_equal(got, want):
    data, scales, gs = got
    w_data, w_scales, w_gs = want
    np.testing.assert_array_equal(bits(data), bits(w_data))
    np.testing.assert_array_equal(bits(scales), bits(w_scales))
    if w_gs is None:
        assert gs is None
    else:
        np.testing.assert_array_equal(bits(gs), bits(w_gs))


# --- torch ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,elem", CASES)
def test_torch_bit_equal_to_the_model(rng, fmt, elem):
    x, offsets, values = torch_inputs(rng, fmt)
    data, scales, gs = gwt.quantize(x, offsets, fmt, elem=elem)
    lay = Q.layout(fmt, x.shape[0], CHANNELS, offsets.shape[0], elem)
    assert data.shape == lay.data_shape and data.dtype == DATA_DTYPES[elem]
    assert scales.shape == lay.scale_shape and scales.dtype == SCALE_DTYPES[fmt]
    assert data.is_contiguous() and scales.is_contiguous()
    if fmt == "nvfp4":
        assert gs.shape == (6,) and gs.dtype == torch.float32
    else:
        assert gs is None
    assert_bits_equal((data, scales, gs), Q.reference_quantize(values, offsets.numpy(), fmt, elem))


@pytest.mark.parametrize("fmt", list(Q.FORMATS))
def test_torch_no_tokens_and_all_experts_empty(rng, fmt):
    x, offsets, values = torch_inputs(rng, fmt, units=(0, 0, 0))
    got = gwt.quantize(x, offsets, fmt)
    assert got[0].shape[1] == 0
    assert_bits_equal(got, Q.reference_quantize(values, offsets.numpy(), fmt))


@pytest.mark.parametrize("elem", ["e5m2", torch.float8_e5m2, "float8_e5m2"])
def test_torch_elem_spellings(rng, elem):
    x, offsets, values = torch_inputs(rng, "block_1x128")
    data, scales, _ = gwt.quantize(x, offsets, "block_1x128", elem=elem)
    assert data.dtype == torch.float8_e5m2
    assert_bits_equal((data, scales, None),
                      Q.reference_quantize(values, offsets.numpy(), "block_1x128", "e5m2"))


@pytest.mark.parametrize("fmt,elem", CASES)
def test_torch_out_is_written_and_returned(rng, fmt, elem):
    x, offsets, values = torch_inputs(rng, fmt)
    want = Q.reference_quantize(values, offsets.numpy(), fmt, elem)
    out = gwt.quantize(x, offsets, fmt, elem=elem)
    for t in out:  # garbage everywhere: every byte must be written again
        if t is not None:
            t.view(torch.uint8).fill_(0xFF)
    got = gwt.quantize(x, offsets, fmt, elem=elem, out=out)
    assert all(g is o for g, o in zip(got, out))
    assert_bits_equal(got, want)
    # FP8 / FP4 / E8M0 outputs may be uint8 tensors of the same shape
    raw = tuple(None if t is None else
                t if t.dtype == torch.float32 else torch.full(t.shape, 0xFF, dtype=torch.uint8)
                for t in out)
    got = gwt.quantize(x, offsets, fmt, elem=elem, out=raw)
    assert all(g is o for g, o in zip(got, raw))
    assert_bits_equal(got, want)
    if fmt != "nvfp4":  # (data, scales) for the formats without global scales
        got = gwt.quantize(x, offsets, fmt, elem=elem, out=list(out[:2]))
        assert got[0] is out[0] and got[1] is out[1] and got[2] is None


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "block_1x128"])
def test_torch_out_with_a_larger_scale_capacity(rng, fmt):
    x, offsets, values = torch_inputs(rng, fmt)
    lay = Q.layout(fmt, x.shape[0], CHANNELS, offsets.shape[0])
    capacity = lay.scale_capacity + 8
    big = Q.layout(fmt, x.shape[0], CHANNELS, offsets.shape[0], scale_capacity=capacity)
    data, _, gs = gwt.quantize(x, offsets, fmt)
    scales = torch.full(big.scale_shape, 0xFF, dtype=torch.uint8)
    if fmt == "block_1x128":
        scales = torch.full(big.scale_shape, float("nan"))
    got = gwt.quantize(x, offsets, fmt, out=(data, scales, gs))
    assert got[1] is scales
    assert_bits_equal(got, Q.reference_quantize(values, offsets.numpy(), fmt,
                                                scale_capacity=capacity))


def test_torch_argument_errors(rng):
    x, offsets, _ = torch_inputs(rng, "mxfp8")
    data, scales, _ = gwt.quantize(x, offsets, "mxfp8")
    errors = [
        (r"^x: expected a torch.Tensor, got list",
         lambda: gwt.quantize(x.tolist(), offsets, "mxfp8")),
        (r"^offsets: expected a torch.Tensor, got ndarray",
         lambda: gwt.quantize(x, offsets.numpy(), "mxfp8")),
        (r"^x: expected a 2-D bfloat16 .* got 2-D float32",
         lambda: gwt.quantize(x.float(), offsets, "mxfp8")),
        (r"^x: expected a 2-D bfloat16", lambda: gwt.quantize(x[None], offsets, "mxfp8")),
        (r"^x: expected a row-major", lambda: gwt.quantize(x.t().contiguous().t(), offsets,
                                                            "mxfp8")),
        (r"^x: expected a token count .* multiple of 32",
         lambda: gwt.quantize(x[:-16], offsets, "mxfp8")),
        (r"^x: expected a channel count .* multiple of 8",
         lambda: gwt.quantize(x[:, :36].contiguous(), offsets, "mxfp8")),
        (r"^offsets: expected a 1-D int32", lambda: gwt.quantize(x, offsets.long(), "mxfp8")),
        (r"^offsets: expected a 1-D int32", lambda: gwt.quantize(x, offsets[:0], "mxfp8")),
        (r"^offsets: expected a 1-D int32", lambda: gwt.quantize(x, offsets[None], "mxfp8")),
        (r"^fmt: expected one of 'mxfp8', .* got 'fp8'", lambda: gwt.quantize(x, offsets, "fp8")),
        (r"^fmt: expected one of", lambda: gwt.quantize(x, offsets, None)),
        (r"^elem: expected e2m1 for mxfp4, got 'e5m2'",
         lambda: gwt.quantize(x, offsets, "mxfp4", elem="e5m2")),
        (r"^elem: expected e4m3 or e5m2 for mxfp8",
         lambda: gwt.quantize(x, offsets, "mxfp8", elem="e2m1")),
        (r"^elem: expected e4m3 or e5m2 for block_1x128",
         lambda: gwt.quantize(x, offsets, "block_1x128", elem=torch.float16)),
        (r"^out: expected None or a \(data, scales, global_scale\) tuple, got Tensor",
         lambda: gwt.quantize(x, offsets, "mxfp8", out=data)),
        (r"^out: expected None or a .* tuple, got tuple of length 1",
         lambda: gwt.quantize(x, offsets, "mxfp8", out=(data,))),
        (r"^out\[0\] \(data\): expected a torch.Tensor, got ndarray",
         lambda: gwt.quantize(x, offsets, "mxfp8", out=(data.view(torch.uint8).numpy(), scales))),
        (r"^out\[1\] \(scales\): expected a torch.Tensor, got NoneType",
         lambda: gwt.quantize(x, offsets, "mxfp8", out=(data, None, None))),
        (r"^out\[0\] \(data\): expected shape \(40, 576\), got \(40, 560\)",
         lambda: gwt.quantize(x, offsets, "mxfp8", out=(data[:, :560], scales, None))),
        (r"^out\[0\] \(data\): expected shape",
         lambda: gwt.quantize(x, offsets, "mxfp8", out=(data.t(), scales, None))),
        (r"^out\[0\] \(data\): expected float8_e4m3fn or uint8, got float8_e5m2",
         lambda: gwt.quantize(x, offsets, "mxfp8", out=(data.view(torch.float8_e5m2), scales))),
        (r"^out\[0\] \(data\): expected float8_e5m2 or uint8, got float8_e4m3fn",
         lambda: gwt.quantize(x, offsets, "mxfp8", elem="e5m2", out=(data, scales))),
        (r"^out\[1\] \(scales\): expected shape \(128, ",
         lambda: gwt.quantize(x, offsets, "mxfp8", out=(data, scales[:64]))),
        (r"^out\[1\] \(scales\): expected a scale capacity of at least 20",
         lambda: gwt.quantize(x, offsets, "mxfp8", out=(data, scales[:, :16].contiguous()))),
        (r"^out\[1\] \(scales\): expected float8_e8m0fnu or uint8, got float32",
         lambda: gwt.quantize(x, offsets, "mxfp8", out=(data, torch.zeros(scales.shape)))),
        (r"^out\[2\] \(global_scale\): expected None \(mxfp8 has no global_scale\)",
         lambda: gwt.quantize(x, offsets, "mxfp8", out=(data, scales, torch.zeros(6)))),
        (r"^out\[0\] \(data\): expected a contiguous",
         lambda: gwt.quantize(x, offsets, "mxfp8",
                              out=(torch.empty(576, 40, dtype=torch.uint8).t(), scales))),
    ]
    assert issubclass(gwgrad.ArgumentError, ValueError)
    for pattern, call in errors:
        with pytest.raises(gwgrad.ArgumentError, match=pattern):
            call()


def test_torch_nvfp4_and_fp32_scale_errors(rng):
    x, offsets, _ = torch_inputs(rng, "nvfp4")
    data, scales, gs = gwt.quantize(x, offsets, "nvfp4")
    with pytest.raises(ValueError, match=r"^out\[2\] \(global_scale\): expected a float32 "
                                         r"\(num_experts,\) tensor \(nvfp4's"):
        gwt.quantize(x, offsets, "nvfp4", out=(data, scales))  # would allocate: refused
    with pytest.raises(ValueError, match=r"^out\[2\] \(global_scale\): expected shape \(6,\)"):
        gwt.quantize(x, offsets, "nvfp4", out=(data, scales, gs[:5]))
    with pytest.raises(ValueError, match=r"^out\[2\] \(global_scale\): expected float32"):
        gwt.quantize(x, offsets, "nvfp4", out=(data, scales, gs.double()))
    with pytest.raises(ValueError, match=r"^out\[2\] \(global_scale\): expected None or a "
                                         r"torch.Tensor, got list"):
        gwt.quantize(x, offsets, "nvfp4", out=(data, scales, [1.0] * 6))
    x, offsets, _ = torch_inputs(rng, "per_expert_channel")
    data, scales, _ = gwt.quantize(x, offsets, "per_expert_channel")
    with pytest.raises(ValueError, match=r"^out\[1\] \(scales\): expected float32, got uint8"):
        gwt.quantize(x, offsets, "per_expert_channel",
                     out=(data, scales.view(torch.uint8).view(scales.shape[0], -1)[:, :40]))
    with pytest.raises(ValueError, match=r"^out\[1\] \(scales\): expected shape \(6, 40\)"):
        gwt.quantize(x, offsets, "per_expert_channel", out=(data, scales[:5]))


def test_torch_devices_and_meta_tensors(rng):
    x, offsets, _ = torch_inputs(rng, "block_1x128")
    with pytest.raises(ValueError, match=r"^offsets: expected a tensor on cpu like x .* got "
                                         r"one on meta"):
        gwt.quantize(x, offsets.to("meta"), "block_1x128")
    data, scales, _ = gwt.quantize(x, offsets, "block_1x128")
    with pytest.raises(ValueError, match=r"^out\[1\] \(scales\): expected a tensor on cpu like x"):
        gwt.quantize(x, offsets, "block_1x128", out=(data, scales.to("meta")))
    meta = (x.to("meta"), offsets.to("meta"))
    with pytest.raises(ValueError, match=r"^fmt: expected one of"):  # checked on meta too
        gwt.quantize(*meta, "fp8", out=(data.to("meta"), scales.to("meta")))
    with pytest.raises(ValueError, match=r"^elem: expected e4m3 or e5m2 for block_1x128"):
        gwt.quantize(*meta, "block_1x128", elem="e2m1", out=(data.to("meta"), scales.to("meta")))
    # all on meta: shapes and dtypes through the op's fake kernel
    for fmt, elem in CASES:
        got = gwt.quantize(x.to("meta"), offsets.to("meta"), fmt, elem=elem)
        lay = Q.layout(fmt, x.shape[0], CHANNELS, offsets.shape[0], elem)
        assert got[0].is_meta and got[0].shape == lay.data_shape
        assert got[0].dtype == DATA_DTYPES[elem] and got[1].dtype == SCALE_DTYPES[fmt]
        assert got[1].shape == lay.scale_shape
        assert (got[2] is None) == (fmt != "nvfp4")


def test_torch_op_schema_and_opcheck(rng):
    schema = str(torch.ops.gwgrad.quantize_into.default._schema)
    assert ("Tensor(a!) data, Tensor(b!) scales, Tensor(c!)? global_scale) -> ()") in schema
    for fmt in Q.FORMATS:
        x, offsets, _ = torch_inputs(rng, fmt, specials=False, units=(1, 0, 5))
        data, scales, gs = gwt.quantize(x, offsets, fmt)

        def raw(t):  # opcheck compares outputs with allclose, which FP8 CPU tensors lack
            return t if t is None or t.dtype == torch.float32 else t.view(torch.uint8)

        for device in ("cpu", "meta"):
            args = [t if t is None else raw(t).to(device) for t in (data, scales, gs)]
            opcheck(torch.ops.gwgrad.quantize_into.default,
                    (x.to(device), offsets.to(device), fmt, None, *args))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile(rng, backend):
    x, offsets, _ = torch_inputs(rng, "block_1x128", channels=48, specials=False)
    dy = torch.from_numpy(bf16_values(rng, x.shape[0], 32, specials=False)).bfloat16()

    def step(x, dy, offsets):
        xt, sx, _ = gwt.quantize(x, offsets, "block_1x128")
        dyt, sdy, _ = gwt.quantize(dy, offsets, "mxfp8")  # (a format the GEMM doesn't take)
        q = gwt.quantize(dy, offsets, "block_1x128")
        w = gwt.wgrad_fp8(xt.t(), q[0].t(), offsets, sx, q[1], scale_recipe="block_1x128",
                          out_dtype=torch.float32)
        return w, dyt.view(torch.uint8), sdy.view(torch.uint8)

    want = step(x, dy, offsets)
    got = torch.compile(step, backend=backend, fullgraph=True)(x, dy, offsets)
    for g, w in zip(got, want):
        assert torch.equal(g, w)

    def into(dy, offsets, out):  # given outputs (E8M0 scales as uint8: see quantize's doc)
        gwt.quantize(dy, offsets, "mxfp8", out=out)

    out = (torch.zeros(dy.shape[1], dy.shape[0], dtype=torch.float8_e4m3fn),
           torch.zeros_like(want[2]))
    torch.compile(into, backend=backend, fullgraph=True)(dy, offsets, out)
    assert torch.equal(out[0].view(torch.uint8), want[1]) and torch.equal(out[1], want[2])


def test_torch_under_a_dispatch_mode_goes_through_the_op(rng):
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x, offsets, values = torch_inputs(rng, "nvfp4")
    with Log():
        got = gwt.quantize(x, offsets, "nvfp4")
    assert any("gwgrad.quantize_into" in name for name in seen)
    assert_bits_equal(got, Q.reference_quantize(values, offsets.numpy(), "nvfp4"))


@pytest.mark.parametrize("recipe", ["per_expert_channel", "block_1x128"])
def test_torch_quantize_then_wgrad_fp8(rng, recipe):
    """The example's step on the CPU: within a few percent of the float64 x.T @ dy."""
    hidden, inter = 64, 48
    counts = [u * 16 for u in (9, 0, 17, 1, 12)]  # experts of several 128-token blocks
    offsets = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    tokens = sum(counts)
    x = torch.from_numpy(rng.standard_normal((tokens, hidden)).astype(np.float32)).bfloat16()
    dy = torch.from_numpy(rng.standard_normal((tokens, inter)).astype(np.float32)).bfloat16()
    xt, sx, _ = gwt.quantize(x, offsets, recipe)
    dyt, sdy, _ = gwt.quantize(dy, offsets, recipe)
    w = gwt.wgrad_fp8(xt.t(), dyt.t(), offsets, sx, sdy, scale_recipe=recipe,
                      out_dtype=torch.float32)
    bounds = [0] + offsets.tolist()
    want = torch.stack([x[s:e].double().T @ dy[s:e].double() for s, e in zip(bounds, bounds[1:])])
    err = float((w.double() - want).norm() / want.norm())
    assert err < 0.06, err  # E4M3 keeps 3 mantissa bits: a few percent
    assert torch.all(w[1] == 0)  # the empty expert
    for e, (s, t) in enumerate(zip(bounds, bounds[1:])):
        if t > s:
            assert float((w[e].double() - want[e]).norm() / want[e].norm()) < 0.06


# --- CuPy adapter (NumPy arrays: the same path on the NumPy model) ---------------------------

def numpy_inputs(rng, fmt, units=(3, 0, 5, 1, 0, 9)):
    counts = counts_for(fmt, units)
    values = bf16_values(rng, sum(counts))
    return gwc.to_bfloat16_bits(values), np.cumsum(counts).astype(np.int32), values


@pytest.mark.parametrize("fmt,elem", CASES)
def test_cupy_adapter_bit_equal_to_the_model(rng, fmt, elem):
    x_bits, offsets, values = numpy_inputs(rng, fmt)
    want = Q.reference_quantize(values, offsets, fmt, elem)
    got = gwc.quantize(x_bits, offsets, fmt, elem=elem, dtype="bfloat16")
    lay = Q.layout(fmt, x_bits.shape[0], CHANNELS, offsets.shape[0], elem)
    assert got[0].dtype == np.uint8 and got[0].shape == lay.data_shape
    assert got[1].shape == lay.scale_shape
    assert got[1].dtype == (np.float32 if lay.scale_dtype.value == "float32" else np.uint8)
    assert_bits_equal(got, want)
    # native bfloat16 (ml_dtypes) needs no flag; int16 bits take it too
    assert_bits_equal(gwc.quantize(x_bits.view(ml_dtypes.bfloat16), offsets, fmt, elem=elem),
                      want)
    assert_bits_equal(gwc.quantize(x_bits.view(np.int16), offsets, fmt, elem=elem,
                                   dtype="bfloat16"), want)
    # out: written and returned
    for t in got:
        if t is not None:
            t.view(np.uint8)[...] = 0xFF
    again = gwc.quantize(x_bits, offsets, fmt, elem=elem, dtype="bfloat16", out=got)
    assert all(a is g for a, g in zip(again, got))
    assert_bits_equal(again, want)


def test_cupy_adapter_quantize_then_wgrad_fp8(rng):
    hidden, inter = 64, 48
    counts = [u * 16 for u in (9, 0, 17, 1)]
    offsets = np.cumsum(counts).astype(np.int32)
    x = gwc.to_bfloat16_bits(rng.standard_normal((sum(counts), hidden)).astype(np.float32))
    dy = gwc.to_bfloat16_bits(rng.standard_normal((sum(counts), inter)).astype(np.float32))
    xf, dyf = (gwc.from_bfloat16_bits(v).astype(np.float64) for v in (x, dy))
    bounds = [0] + list(offsets)
    want = np.stack([xf[s:e].T @ dyf[s:e] for s, e in zip(bounds, bounds[1:])])
    for recipe in ("per_expert_channel", "block_1x128"):
        xt, sx, _ = gwc.quantize(x, offsets, recipe, dtype="bfloat16")
        dyt, sdy, _ = gwc.quantize(dy, offsets, recipe, dtype="bfloat16")
        w = gwc.wgrad_fp8(xt.T, dyt.T, offsets, sx, sdy, scale_recipe=recipe, fp8="e4m3",
                          out_dtype="float32")
        assert np.linalg.norm(w - want) / np.linalg.norm(want) < 0.06
        assert not w[1].any()


def test_cupy_adapter_argument_errors(rng):
    x, offsets, _ = numpy_inputs(rng, "mxfp8")
    data, scales, _ = gwc.quantize(x, offsets, "mxfp8", dtype="bfloat16")
    errors = [
        (r"^x: expected a float array, or 16-bit integers holding bfloat16 bits with "
         r"dtype='bfloat16'", lambda: gwc.quantize(x, offsets, "mxfp8")),
        (r"^dtype: expected None or 'bfloat16'",
         lambda: gwc.quantize(x, offsets, "mxfp8", dtype="float16")),
        (r"^x: expected a 2-D bfloat16 .* float32",
         lambda: gwc.quantize(x.astype(np.float32), offsets, "mxfp8", dtype="bfloat16")),
        (r"^x: expected a 2-D bfloat16",
         lambda: gwc.quantize(x[None], offsets, "mxfp8", dtype="bfloat16")),
        (r"^x: expected an array with __dlpack__",
         lambda: gwc.quantize(x.tolist(), offsets, "mxfp8", dtype="bfloat16")),
        (r"^offsets: expected a 1-D int32",
         lambda: gwc.quantize(x, offsets.astype(np.int64), "mxfp8", dtype="bfloat16")),
        (r"^fmt: expected one of", lambda: gwc.quantize(x, offsets, "fp8", dtype="bfloat16")),
        (r"^elem: expected e2m1 for mxfp4",
         lambda: gwc.quantize(x, offsets, "mxfp4", elem="e4m3", dtype="bfloat16")),
        (r"^out: expected None or a \(data, scales, global_scale\) tuple, got ndarray",
         lambda: gwc.quantize(x, offsets, "mxfp8", dtype="bfloat16", out=data)),
        (r"^out\[0\] \(data\): expected shape \(40, 576\), got \(40, 560\)",
         lambda: gwc.quantize(x, offsets, "mxfp8", dtype="bfloat16",
                              out=(data[:, :560], scales))),
        (r"^out\[1\] \(scales\): expected float8_e8m0fnu or uint8, got float32",
         lambda: gwc.quantize(x, offsets, "mxfp8", dtype="bfloat16",
                              out=(data, scales.astype(np.float32)))),
        (r"^out\[1\] \(scales\): expected an array, got None",
         lambda: gwc.quantize(x, offsets, "mxfp8", dtype="bfloat16", out=(data, None, None))),
        (r"^out\[2\] \(global_scale\): expected a float32 \(num_experts,\) array",
         lambda: gwc.quantize(x, offsets, "nvfp4", dtype="bfloat16", out=(data, scales))),
    ]
    for pattern, call in errors:
        with pytest.raises(gwgrad.ArgumentError, match=pattern):
            call()


def test_cupy_arrays_in_and_out(rng):
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - CuPy imports but no CUDA driver / GPU
        pytest.skip("CuPy has no usable GPU")
    if not gwgrad.cuda.available():
        pytest.skip("needs a usable CUDA GPU")
    x, offsets, values = numpy_inputs(rng, "mxfp8")
    got = gwc.quantize(cupy.asarray(x), cupy.asarray(offsets), "mxfp8", dtype="bfloat16")
    assert all(isinstance(t, cupy.ndarray) for t in got[:2]) and got[2] is None
    assert got[0].dtype == cupy.uint8 and got[1].dtype == cupy.uint8
    assert_bits_equal(tuple(None if t is None else cupy.asnumpy(t) for t in got),
                      Q.reference_quantize(values, offsets, "mxfp8"))
