"""gwgrad.adapters.cupy: NumPy arrays take the same path as CuPy arrays (bfloat16 bits flagged
with dtype="bfloat16", every output kind, accumulate, discrete lists, errors), on the reference
backend without CuPy and, parametrized by array module, on a GPU with CuPy (gwgrad's kernels;
marked ``gpu``, skipped without one). On the GPU only: a non-default stream and DLPack
bfloat16 arrays. Small shapes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import gwgrad
import gwgrad.adapters.cupy as gwc

try:
    import cupy
except ImportError:
    cupy = None

try:
    import pytest_timeout  # noqa: F401

    _timeout = [pytest.mark.timeout(120)]
except ImportError:
    _timeout = []


def _has_gpu():
    try:
        return cupy is not None and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no driver
        return False


GPU = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="needs CuPy with a GPU"),
       *_timeout]
ARRAYS = ["numpy", pytest.param("cupy", marks=GPU)]

HIDDEN, INTER = 32, 48
COUNTS = [50, 0, 70, 80]
# On the GPU: counts not multiples of 256, one empty expert, several tiles per expert.
SIZES = {"numpy": (HIDDEN, INTER, COUNTS), "cupy": (256, 384, [512, 0, 997, 3, 256])}
#: Relative error allowed on FP32 outputs: the reference's FP64 sums rounded once; the tensor
#: cores' FP32 accumulation.
FP32_TOL = {"numpy": 1e-6, "cupy": 1e-5}


def inputs(rng, counts=COUNTS, hidden=HIDDEN, inter=INTER):
    offsets = np.cumsum(counts).astype(np.int32)
    tokens = int(offsets[-1])
    x = gwc.to_bfloat16_bits(rng.standard_normal((tokens, hidden)).astype(np.float32))
    dy = gwc.to_bfloat16_bits(rng.standard_normal((tokens, inter)).astype(np.float32))
    return x, dy, offsets


def reference(x_bits, dy_bits, offsets):
    x = gwc.from_bfloat16_bits(x_bits).astype(np.float64)
    dy = gwc.from_bfloat16_bits(dy_bits).astype(np.float64)
    bounds = [0] + list(offsets)
    return np.stack([x[s:e].T @ dy[s:e] for s, e in zip(bounds, bounds[1:])])


def module_of(name):
    return cupy if name == "cupy" else np


def host(array):
    """A NumPy copy of a NumPy or CuPy array, in float64."""
    if cupy is not None and isinstance(array, cupy.ndarray):
        array = cupy.asnumpy(array)
    return np.asarray(array).astype(np.float64)


def rel_err(got, want):
    return float(np.linalg.norm(host(got) - want) / np.linalg.norm(want))


def array_inputs(rng, xp):
    """((hidden, intermediate, experts), x, dy, offsets, float64 reference): bfloat16 bits of
    the array module's problem size, in its arrays."""
    hidden, inter, counts = SIZES[xp]
    x, dy, offsets = inputs(rng, counts, hidden, inter)
    want = reference(x, dy, offsets)
    m = module_of(xp)
    return (hidden, inter, len(counts)), m.asarray(x), m.asarray(dy), m.asarray(offsets), want


def test_bfloat16_bits_round_to_nearest_even(rng):
    values = np.concatenate([rng.standard_normal(1000).astype(np.float32) * 100,
                             np.float32([0.0, -0.0, np.inf, -np.inf, 1 + 2 ** -8, 1 + 3 * 2 ** -8])])
    bits = gwc.to_bfloat16_bits(values)
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(bits, values.astype(ml_dtypes.bfloat16).view(np.uint16))
    assert gwc.to_bfloat16_bits(np.float32([np.nan]))[0] == 0x7FC0
    back = gwc.from_bfloat16_bits(bits)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, bits.view(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(gwc.from_bfloat16_bits(bits.view(np.int16)), back)


@pytest.mark.parametrize("xp", ARRAYS)
@pytest.mark.parametrize("out_dtype", ["float32", "float16", None])
def test_bits_in_each_output_dtype(rng, xp, out_dtype):
    (hidden, inter, experts), x, dy, offsets, want = array_inputs(rng, xp)
    tol = {"float32": FP32_TOL[xp], "float16": 2e-3, None: 1e-2}[out_dtype]
    w = gwc.wgrad(x, dy, offsets, dtype="bfloat16", out_dtype=out_dtype)
    assert type(w) is type(x) and w.shape == (experts, hidden, inter)
    if out_dtype is None:  # bfloat16 comes back as bits, in x's dtype
        assert w.dtype == np.uint16
        w = gwc.from_bfloat16_bits(w)
    got = host(w)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol
    assert not got[1].any()


def test_int16_bits_and_native_bfloat16(rng):
    x, dy, offsets = inputs(rng)
    want = reference(x, dy, offsets)
    w = gwc.wgrad(x.view(np.int16), dy.view(np.int16), offsets, dtype="bfloat16")
    assert w.dtype == np.int16
    w = gwc.wgrad(x.view(ml_dtypes.bfloat16), dy.view(ml_dtypes.bfloat16), offsets,
                  out_dtype="float32")  # natively bfloat16: no flag needed
    np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("xp", ARRAYS)
def test_into_accumulate_and_discrete(rng, xp):
    (hidden, inter, experts), x, dy, offsets, want = array_inputs(rng, xp)
    m, tol = module_of(xp), FP32_TOL[xp]
    out = m.full((experts, hidden, inter), np.nan, np.float32)
    assert gwc.wgrad(x, dy, offsets, dtype="bfloat16", out=out) is out
    assert rel_err(out, want) < tol
    base = m.asarray(rng.standard_normal(out.shape), np.float32)
    out[...] = base
    gwc.wgrad(x, dy, offsets, dtype="bfloat16", out=out, accumulate=True)
    assert rel_err(out, want + host(base)) < tol
    outs = [m.full((hidden, inter), np.nan, np.float32) for _ in range(experts)]
    assert gwc.wgrad(x, dy, offsets, dtype="bfloat16", out=outs) == outs
    assert rel_err(m.stack(outs), want) < tol
    gwc.wgrad(x, dy, offsets, dtype="bfloat16", out=outs, accumulate=True)
    assert rel_err(m.stack(outs), 2 * want) < tol
    bits_out = m.zeros((experts, hidden, inter), np.uint16)  # a bfloat16 output given as bits
    gwc.wgrad(x, dy, offsets, dtype="bfloat16", out=bits_out)
    assert rel_err(gwc.from_bfloat16_bits(bits_out), want) < 1e-2


def test_one_operator_for_new_storage(rng):
    x, dy, offsets = inputs(rng)
    gwgrad.clear_cache()
    before = gwgrad.cache_info()["constructed"]
    for _ in range(3):
        gwc.wgrad(x.copy(), dy.copy(), offsets.copy(), dtype="bfloat16", out_dtype="float32")
    assert gwgrad.cache_info()["constructed"] - before <= 1


def test_errors_name_the_adapter_arguments(rng):
    x, dy, offsets = inputs(rng)
    with pytest.raises(ValueError, match=r"^x \(a_tensor = x.T\): .*dtype='bfloat16'"):
        gwc.wgrad(x, dy, offsets)  # bits without the flag
    with pytest.raises(ValueError, match=r"^dtype: expected None or 'bfloat16'"):
        gwc.wgrad(x, dy, offsets, dtype="float16")
    with pytest.raises(ValueError, match=r"^x \(a_tensor = x.T\): .*bfloat16"):
        gwc.wgrad(x.astype(np.float32), dy, offsets, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"^offsets: .*int32"):
        gwc.wgrad(x, dy, offsets.astype(np.int64), dtype="bfloat16")
    with pytest.raises(ValueError, match=r"^out: .*accumulate"):
        gwc.wgrad(x, dy, offsets, dtype="bfloat16", accumulate=True)
    with pytest.raises(ValueError, match=r"^accumulate: expected a bool, got \[1\]"):
        gwc.wgrad(x, dy, offsets, dtype="bfloat16", accumulate=[1])  # was a TypeError
    with pytest.raises(ValueError, match=r"^out \(wgrad_tensor\): .*shape"):
        gwc.wgrad(x, dy, offsets, dtype="bfloat16", out=np.zeros((4, HIDDEN, INTER + 8), np.float32))
    with pytest.raises(ValueError, match=r"^out_dtype: "):
        gwc.wgrad(x, dy, offsets, dtype="bfloat16", out=np.zeros((4, HIDDEN, INTER), np.float32),
                  out_dtype="float16")
    with pytest.raises(ValueError, match=r"^out: expected 4 per-expert outputs"):
        gwc.wgrad(x, dy, offsets, dtype="bfloat16", out=[np.zeros((HIDDEN, INTER), np.float32)])
    with pytest.raises(ValueError, match=r"^out: expected every output to be a contiguous"):
        gwc.wgrad(x, dy, offsets, dtype="bfloat16",
                  out=[np.zeros((INTER, HIDDEN), np.float32).T] * 4)
    with pytest.raises(ValueError, match=r"^x: expected 2 dims|^x \(a_tensor = x.T\): expected 2"):
        gwc.wgrad(x[None], dy, offsets, dtype="bfloat16")
    for bad in ("float64", "int32", np.float64):  # a ValueError naming out_dtype, no KeyError
        with pytest.raises(gwgrad.ArgumentError, match=r"^out_dtype: expected None, 'bfloat16'"):
            gwc.wgrad(x, dy, offsets, dtype="bfloat16", out_dtype=bad)


def test_cupy_arrays_are_recognized():
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - CuPy imports but no CUDA driver / GPU
        pytest.skip("CuPy has no usable GPU")
    assert gwc._is_cupy(cupy.zeros(1)) and gwc._xp(cupy.zeros(1)) is cupy


class TestCupyGpu:
    pytestmark = GPU

    def test_non_default_stream(self, rng):
        (hidden, inter, _), x, dy, offsets, want = array_inputs(rng, "cupy")
        cupy.cuda.get_current_stream().synchronize()
        with cupy.cuda.Stream(non_blocking=True) as stream:
            w = gwc.wgrad(x, dy, offsets, dtype="bfloat16", out_dtype="float32")
            stream.synchronize()
            assert rel_err(w, want) < 1e-5
        other = cupy.cuda.Stream(non_blocking=True)
        out = cupy.full((5, hidden, inter), np.nan, np.float32)
        cupy.cuda.get_current_stream().synchronize()
        gwc.wgrad(x, dy, offsets, dtype="bfloat16", out=out, stream=other)  # an explicit stream
        other.synchronize()
        assert rel_err(out, want) < 1e-5

    def test_dlpack_bfloat16_arrays(self, rng):
        torch = pytest.importorskip("torch")
        _, x, dy, offsets, want = array_inputs(rng, "cupy")
        tx = torch.from_dlpack(x).view(torch.bfloat16)  # the same bits, a bfloat16 dtype
        tdy = torch.from_dlpack(dy).view(torch.bfloat16)
        w = gwc.wgrad(tx, tdy, offsets, out_dtype="float32")  # no flag: the arrays say bfloat16
        assert isinstance(w, cupy.ndarray) and rel_err(w, want) < 1e-5
