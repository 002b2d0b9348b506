"""gwgrad.adapters.cupy's argument handling without CuPy: NumPy arrays take the same path
(bfloat16 bits flagged with dtype="bfloat16", outputs, discrete lists, errors) on the
reference backend. Tests needing CuPy itself skip where it cannot be imported."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import gwgrad
import gwgrad.adapters.cupy as gwc

HIDDEN, INTER = 32, 48
COUNTS = [50, 0, 70, 80]


def inputs(rng, counts=COUNTS):
    offsets = np.cumsum(counts).astype(np.int32)
    tokens = int(offsets[-1])
    x = gwc.to_bfloat16_bits(rng.standard_normal((tokens, HIDDEN)).astype(np.float32))
    dy = gwc.to_bfloat16_bits(rng.standard_normal((tokens, INTER)).astype(np.float32))
    return x, dy, offsets


def reference(x_bits, dy_bits, offsets):
    x = gwc.from_bfloat16_bits(x_bits).astype(np.float64)
    dy = gwc.from_bfloat16_bits(dy_bits).astype(np.float64)
    bounds = [0] + list(offsets)
    return np.stack([x[s:e].T @ dy[s:e] for s, e in zip(bounds, bounds[1:])])


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


@pytest.mark.parametrize("out_dtype,tol", [("float32", 1e-6), ("float16", 2e-3), (None, 1e-2)])
def test_bits_in_each_output_dtype(rng, out_dtype, tol):
    x, dy, offsets = inputs(rng)
    want = reference(x, dy, offsets)
    w = gwc.wgrad(x, dy, offsets, dtype="bfloat16", out_dtype=out_dtype)
    assert w.shape == (4, HIDDEN, INTER)
    if out_dtype is None:  # bfloat16 comes back as bits, in x's dtype
        assert w.dtype == np.uint16
        w = gwc.from_bfloat16_bits(w)
    got = w.astype(np.float64)
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


def test_into_accumulate_and_discrete(rng):
    x, dy, offsets = inputs(rng)
    want = reference(x, dy, offsets)
    out = np.full((4, HIDDEN, INTER), np.nan, np.float32)
    assert gwc.wgrad(x, dy, offsets, dtype="bfloat16", out=out) is out
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
    gwc.wgrad(x, dy, offsets, dtype="bfloat16", out=out, accumulate=True)
    np.testing.assert_allclose(out, 2 * want, rtol=1e-5, atol=1e-4)
    outs = [np.full((HIDDEN, INTER), np.nan, np.float32) for _ in range(4)]
    assert gwc.wgrad(x, dy, offsets, dtype="bfloat16", out=outs) == outs
    np.testing.assert_allclose(np.stack(outs), want, rtol=1e-5, atol=1e-4)
    gwc.wgrad(x, dy, offsets, dtype="bfloat16", out=outs, accumulate=True)
    np.testing.assert_allclose(np.stack(outs), 2 * want, rtol=1e-5, atol=1e-4)
    bits_out = np.zeros((4, HIDDEN, INTER), np.uint16)  # a bfloat16 output given as bits
    gwc.wgrad(x, dy, offsets, dtype="bfloat16", out=bits_out)
    np.testing.assert_allclose(gwc.from_bfloat16_bits(bits_out), want, rtol=1e-2, atol=1e-1)


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
