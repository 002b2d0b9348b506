"""gwgrad.adapters.jax.quantize on an SM90+ GPU: the custom call (the quantizer's call_tensors
entry as an XLA FFI module) under jit gives gwgrad.quantize's bits (torch tensors, the core's
path) and the NumPy model's, whole arrays, for every format, on BF16 data spanning many
magnitudes with NaN / Inf / denormals, empty experts and counts that are not multiples of
128; other counts through the same executable; invalid offsets; quantize -> wgrad_fp8 in one
jitted function."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import gwgrad  # noqa: E402
from gwgrad import quantizers as Q  # noqa: E402
from quantize_cases import special_values  # noqa: E402
import gwgrad.adapters.jax as gwj  # noqa: E402
from jax_gpu import gpus, module_marks  # noqa: E402

pytestmark = module_marks(300)

CHANNELS = 200  # neither a multiple of 64 nor of 128: partial channel blocks, padded rows
CASES = [(fmt, elem) for fmt, f in Q.FORMATS.items() for elem in f.elems]


def _torch():
    """torch with an SM90+ GPU (gwgrad.quantize on torch tensors is the core's path)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs an SM90+ GPU (the quantizers)")
    return torch


def counts_for(fmt, units=(0, 5, 0, 31, 1, 9, 2)):
    """Multiples of the format's count multiple, not all of 128, with empty experts."""
    return [u * Q.count_multiple(fmt) for u in units]


def bf16_bits(rng, tokens, channels=CHANNELS, specials=True, wide=True):
    """BF16 bits (uint16) of tests/quantize_cases.special_values."""
    x = special_values(rng, tokens, channels, specials=specials, wide=wide)
    # Rounded on the host (ml_dtypes: nearest even, denormals kept), never on a device.
    return x.astype(np.float32).astype(jnp.bfloat16).view(np.uint16)


def values_of(bits16: np.ndarray) -> np.ndarray:
    return (bits16.astype(np.uint32) << 16).view(np.float32)


def on_gpu(bits16: np.ndarray):
    return jax.lax.bitcast_convert_type(jax.device_put(bits16, gpus()[0]), jnp.bfloat16)


def bits(arr) -> np.ndarray:
    arr = np.asarray(arr)
    return arr.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[arr.dtype.itemsize])


def core(torch, bits16, offsets, fmt, elem):
    """gwgrad.quantize on torch tensors of the same bits, into zeroed outputs (uint8 bytes or
    float32): NumPy arrays (data, scales, global scale or None)."""
    tokens, channels = bits16.shape
    lay = Q.layout(fmt, tokens, channels, len(offsets), elem)
    x = torch.from_numpy(bits16.view(np.int16)).cuda().view(torch.bfloat16)
    o = torch.from_numpy(np.asarray(offsets, np.int32)).cuda()
    data = torch.zeros(lay.data_shape, dtype=torch.uint8, device="cuda")
    fp32 = lay.scale_dtype == gwgrad.DType.FLOAT32
    scales = torch.zeros(lay.scale_shape, dtype=torch.float32 if fp32 else torch.uint8,
                         device="cuda")
    gs = None
    if lay.global_shape is not None:
        gs = torch.zeros(lay.global_shape, dtype=torch.float32, device="cuda")
    gwgrad.quantize(x, o, fmt, elem=elem, data=data, scales=scales, global_scale=gs)
    torch.cuda.synchronize()
    return data.cpu().numpy(), scales.cpu().numpy(), None if gs is None else gs.cpu().numpy()


def assert_same_bits(got, want, what, names=("data", "scales", "global_scale")):
    for name, g, w in zip(names, got, want):
        if w is None:
            assert g is None, f"{what}: {name}"
            continue
        g, w = bits(g), bits(w)
        assert g.shape == w.shape, f"{what}: {name} shape {g.shape} != {w.shape}"
        bad = np.argwhere(g != w)
        assert bad.size == 0, (f"{what}: {name}: {len(bad)} elements differ, first "
                               f"{bad[:4].tolist()}")


@pytest.mark.parametrize("fmt,elem", CASES)
def test_jit_bits_equal_the_core(rng, fmt, elem):
    torch = _torch()
    counts = counts_for(fmt)
    offsets = np.cumsum(counts).astype(np.int32)
    x16 = bf16_bits(rng, int(offsets[-1]))
    x = on_gpu(x16)
    f = jax.jit(lambda x, o: gwj.quantize(x, o, fmt, elem=elem))
    got = f(x, jnp.asarray(offsets))
    assert got[0].devices() == {gpus()[0]}
    assert got[0].dtype == {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}.get(
        elem, jnp.uint8)
    assert_same_bits(got, core(torch, x16, offsets, fmt, elem), "core")
    # The NumPy model too, whole arrays (the scales past the experts' ones are zeros).
    assert_same_bits(got, Q.reference_quantize(values_of(x16), offsets, fmt, elem), "model")
    # Same shapes, other counts: the same executable.
    other = np.cumsum(counts_for(fmt, (9, 0, 30, 0, 0, 8, 1))).astype(np.int32)
    got = f(x, jnp.asarray(other))
    assert_same_bits(got, core(torch, x16, other, fmt, elem), "core, other counts")
    assert f._cache_size() == 1
    gwgrad.check_errors()  # nothing recorded


@pytest.mark.parametrize("fmt", list(Q.FORMATS))
def test_no_tokens_and_one_expert(rng, fmt):
    torch = _torch()
    elem = Q.FORMATS[fmt].elems[0]
    empty, zeros = np.zeros((0, 64), np.uint16), np.zeros(3, np.int32)
    got = jax.jit(lambda x, o: gwj.quantize(x, o, fmt))(on_gpu(empty), jnp.asarray(zeros))
    assert_same_bits(got, core(torch, empty, zeros, fmt, elem), "no tokens")
    assert_same_bits(got, Q.reference_quantize(values_of(empty), zeros, fmt, elem), "model")
    x16 = bf16_bits(rng, 8 * 128, specials=False)
    one = np.array([x16.shape[0]], np.int32)
    got = jax.jit(lambda x, o: gwj.quantize(x, o, fmt))(on_gpu(x16), jnp.asarray(one))
    assert_same_bits(got, core(torch, x16, one, fmt, elem), "one expert")


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "per_expert_channel", "block_1x128"])
def test_invalid_offsets(rng, fmt):
    """Decreasing, negative, past-the-end and misaligned offsets: those experts are empty (no
    error: the GEMM reports offsets). The model's bits where exactly one sanitized range
    covers a token (codes of uncovered or shared tokens are unspecified) and in every
    scale byte (the CUDA lowering zeroes those the kernel leaves)."""
    _torch()
    multiple = Q.count_multiple(fmt)
    tokens = 8 * 128
    x16 = bf16_bits(rng, tokens, 96)
    f = jax.jit(lambda x, o: gwj.quantize(x, o, fmt))
    for offsets in ([256, 128, 512, tokens], [-64, 256, 100000, tokens],
                    [multiple // 2, 3 * multiple, 5 * multiple + 3, tokens]):
        offsets = np.asarray(offsets, np.int32)
        data, scales, gs = f(on_gpu(x16), jnp.asarray(offsets))
        want = Q.reference_quantize(values_of(x16), offsets, fmt)
        begin, end = Q._counts(offsets, tokens, multiple)
        cover = np.zeros(tokens + 1, np.int64)
        np.add.at(cover, begin, 1)
        np.add.at(cover, end, -1)
        cover = np.cumsum(cover)[:tokens]
        keep = cover[:: tokens // want[0].shape[1]] == 1
        np.testing.assert_array_equal(bits(data)[:, keep], want[0][:, keep])
        assert_same_bits((scales, gs), want[1:], f"offsets {offsets.tolist()}",
                         ("scales", "global_scale"))


@pytest.mark.parametrize("recipe", ["per_expert_channel", "block_1x128"])
def test_quantize_feeds_wgrad_fp8(rng, recipe):
    """x and dy quantized and their FP8 weight gradient in one jitted function (SM90): the
    float64 loop over the model's operands, dequantized."""
    torch = _torch()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU (the FP8 GEMM)")
    counts = [512, 0, 1008, 16, 272]
    offsets = np.cumsum(counts).astype(np.int32)
    x16 = bf16_bits(rng, int(offsets[-1]), 256, specials=False, wide=False)
    dy16 = bf16_bits(rng, int(offsets[-1]), 384, specials=False, wide=False)

    def step(x, dy, o):
        xt, xs, _ = gwj.quantize(x, o, recipe)
        dyt, dys, _ = gwj.quantize(dy, o, recipe, elem="e5m2")
        return gwj.wgrad_fp8(xt, dyt, o, xs, dys, scale_recipe=recipe, out_dtype=jnp.float32)

    w = np.asarray(jax.jit(step)(on_gpu(x16), on_gpu(dy16), jnp.asarray(offsets)), np.float64)
    t = np.arange(int(offsets[-1]))
    owner = np.searchsorted(offsets, t, side="right")
    begins = np.concatenate([[0], offsets[:-1]])

    def dequantized(b16, elem):
        data, s, _ = Q.reference_quantize(values_of(b16), offsets, recipe, elem)
        fp8 = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}[elem]
        v = np.asarray(jnp.asarray(data).view(fp8).astype(jnp.float32), np.float64)
        if recipe == "per_expert_channel":
            return v * s[owner].T
        starts = np.concatenate([[0], np.cumsum(-(-np.asarray(counts) // 128))[:-1]])
        return v * s[starts[owner] + (t - begins[owner]) // 128].T

    xd, dyd = dequantized(x16, "e4m3"), dequantized(dy16, "e5m2")
    b = [0] + list(offsets)
    want = np.stack([xd[:, s:e] @ dyd[:, s:e].T for s, e in zip(b, b[1:])])
    # Hopper's FP8 WGMMA adds each 128-token block in reduced precision before the FP32
    # promotion: the FP8 GPU tests' tolerance (tests/test_fp8_sm90_gpu.py).
    assert np.linalg.norm(w - want) / np.linalg.norm(want) < 2e-3
    assert not w[1].any()
    gwgrad.check_errors()
