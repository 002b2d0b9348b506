"""Runs anywhere (no GPU): the public API on CPU arrays, checked against a plain NumPy loop.

    python examples/cpu_reference.py
"""

import numpy as np

import gwgrad

rng = np.random.default_rng()
hidden, intermediate = 64, 96
counts = np.array([40, 0, 130, 7])  # tokens per expert: any count >= 0 for BF16
offsets = np.cumsum(counts).astype(np.int32)
tokens_sum = int(offsets[-1])

# The training layout: A = x.T (M-major), B = dy (N-major), in bfloat16 (ml_dtypes for NumPy).
try:
    import ml_dtypes
except ImportError:
    raise SystemExit("this example needs ml_dtypes for bfloat16 NumPy arrays (pip install ml_dtypes)") from None
x = rng.standard_normal((tokens_sum, hidden)).astype(ml_dtypes.bfloat16)
dy = rng.standard_normal((tokens_sum, intermediate)).astype(ml_dtypes.bfloat16)

result = gwgrad.grouped_gemm_wgrad(x.T, dy, offsets_tensor=offsets, wgrad_dtype="float32")
(wgrad,) = result  # or result["wgrad_tensor"]

begin = 0
for e, end in enumerate(offsets):
    want = x[begin:end].astype(np.float64).T @ dy[begin:end].astype(np.float64)
    assert np.allclose(wgrad[e], want, rtol=1e-5, atol=1e-5), e
    begin = end
print(f"{len(counts)} experts, tokens {counts.tolist()}: wgrad {wgrad.shape} matches the NumPy loop")
print(gwgrad.cache_info())
