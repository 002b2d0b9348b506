"""gwgrad.adapters.cupy on a GPU: bfloat16 bits in, every output kind out (accumulate and
discrete included), on a non-default stream, and DLPack bfloat16 arrays. Small shapes."""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import gwgrad.adapters.cupy as gwc  # noqa: E402

try:
    import pytest_timeout  # noqa: F401

    _timeout = [pytest.mark.timeout(120)]
except ImportError:
    _timeout = []


def _has_gpu():
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no driver
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="needs CuPy with a GPU"),
              *_timeout]

HIDDEN, INTER = 256, 384
COUNTS = [512, 0, 997, 3, 256]


def inputs(rng):
    offsets = np.cumsum(COUNTS).astype(np.int32)
    tokens = int(offsets[-1])
    x = gwc.to_bfloat16_bits(rng.standard_normal((tokens, HIDDEN)).astype(np.float32))
    dy = gwc.to_bfloat16_bits(rng.standard_normal((tokens, INTER)).astype(np.float32))
    want = reference(x, dy, offsets)
    return cupy.asarray(x), cupy.asarray(dy), cupy.asarray(offsets), want


def reference(x_bits, dy_bits, offsets):
    x = gwc.from_bfloat16_bits(x_bits).astype(np.float64)
    dy = gwc.from_bfloat16_bits(dy_bits).astype(np.float64)
    bounds = [0] + list(offsets)
    return np.stack([x[s:e].T @ dy[s:e] for s, e in zip(bounds, bounds[1:])])


def rel_err(got, want):
    got = cupy.asnumpy(got).astype(np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_bits_in_each_output(rng):
    x, dy, offsets, want = inputs(rng)
    w = gwc.wgrad(x, dy, offsets, dtype="bfloat16", out_dtype="float32")
    assert isinstance(w, cupy.ndarray) and w.dtype == np.float32
    assert rel_err(w, want) < 1e-5
    bits = gwc.wgrad(x, dy, offsets, dtype="bfloat16")
    assert bits.dtype == np.uint16 and rel_err(gwc.from_bfloat16_bits(bits), want) < 1e-2
    out = cupy.full((5, HIDDEN, INTER), np.nan, np.float32)
    base = cupy.asarray(rng.standard_normal(out.shape), np.float32)
    out[...] = base
    gwc.wgrad(x, dy, offsets, dtype="bfloat16", out=out, accumulate=True)
    assert rel_err(out, want + cupy.asnumpy(base).astype(np.float64)) < 1e-5


def test_discrete_outputs(rng):
    x, dy, offsets, want = inputs(rng)
    outs = [cupy.full((HIDDEN, INTER), np.nan, np.float32) for _ in range(5)]
    gwc.wgrad(x, dy, offsets, dtype="bfloat16", out=outs)
    assert rel_err(cupy.stack(outs), want) < 1e-5
    gwc.wgrad(x, dy, offsets, dtype="bfloat16", out=outs, accumulate=True)
    assert rel_err(cupy.stack(outs), 2 * want) < 1e-5


def test_non_default_stream(rng):
    x, dy, offsets, want = inputs(rng)
    cupy.cuda.get_current_stream().synchronize()
    with cupy.cuda.Stream(non_blocking=True) as stream:
        w = gwc.wgrad(x, dy, offsets, dtype="bfloat16", out_dtype="float32")
        stream.synchronize()
        assert rel_err(w, want) < 1e-5
    other = cupy.cuda.Stream(non_blocking=True)
    out = cupy.full((5, HIDDEN, INTER), np.nan, np.float32)
    cupy.cuda.get_current_stream().synchronize()
    gwc.wgrad(x, dy, offsets, dtype="bfloat16", out=out, stream=other)  # an explicit stream
    other.synchronize()
    assert rel_err(out, want) < 1e-5


def test_dlpack_bfloat16_arrays(rng):
    torch = pytest.importorskip("torch")
    x, dy, offsets, want = inputs(rng)
    tx = torch.from_dlpack(x).view(torch.bfloat16)  # the same bits, a bfloat16 dtype
    tdy = torch.from_dlpack(dy).view(torch.bfloat16)
    w = gwc.wgrad(tx, tdy, offsets, out_dtype="float32")  # no flag: the arrays say bfloat16
    assert isinstance(w, cupy.ndarray) and rel_err(w, want) < 1e-5
