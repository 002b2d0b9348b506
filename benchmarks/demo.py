"""A small end-to-end run of the public API, checked against a direct NumPy loop.

On CPU arrays it exercises the reference backend; ``python -m gwgrad`` runs it on machines
without a GPU.
"""

from __future__ import annotations

import time

import numpy as np

from gwgrad.api import grouped_gemm_wgrad
from gwgrad.backends.reference import decode, round_to_bfloat16_bits
from gwgrad.dtypes import DType
from gwgrad.tensors import from_pointer


def _loop_reference(a: np.ndarray, b: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    out = np.zeros((offsets.size, a.shape[0], b.shape[1]))
    begin = 0
    for e, end in enumerate(offsets):
        out[e] = a[:, begin:end] @ b[begin:end, :]
        begin = end
    return out


def cpu_demo(hidden: int = 256, intermediate: int = 384, num_experts: int = 8,
             tokens_per_expert: int = 96, seed: int = 0) -> bool:
    """Dense and discrete BF16 runs on CPU arrays; prints one line each; True if both match."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 2 * tokens_per_expert, num_experts)
    counts[rng.integers(num_experts)] = 0  # one empty expert, which must come out as zeros
    offsets = np.cumsum(counts).astype(np.int32)
    tokens_sum = int(offsets[-1])
    # Training layout: A = x.T (M-major), B = dy (N-major), BF16 as raw uint16 bits.
    x_bits = round_to_bfloat16_bits(rng.standard_normal((tokens_sum, hidden)))
    dy_bits = round_to_bfloat16_bits(rng.standard_normal((tokens_sum, intermediate)))
    x = from_pointer(x_bits.ctypes.data, x_bits.shape, None, DType.BFLOAT16,
                     device_type="cpu", owner=x_bits)
    dy = from_pointer(dy_bits.ctypes.data, dy_bits.shape, None, DType.BFLOAT16,
                      device_type="cpu", owner=dy_bits)
    a = from_pointer(x.ptr, (hidden, tokens_sum), (1, hidden), DType.BFLOAT16,
                     device_type="cpu", owner=x_bits)
    ref = _loop_reference(decode(x_bits, DType.BFLOAT16).T, decode(dy_bits, DType.BFLOAT16), offsets)

    ok = True
    for mode in ("dense", "discrete"):
        start = time.perf_counter()
        (w,) = grouped_gemm_wgrad(a, dy, offsets_tensor=offsets, output_mode=mode,
                                  wgrad_dtype="float32")
        seconds = time.perf_counter() - start
        err = float(np.linalg.norm(w - ref) / np.linalg.norm(ref))
        good = err < 1e-6 and not np.any(w[counts == 0])
        ok &= good
        print(f"cpu demo {mode:8s}: {num_experts} experts, counts {counts.tolist()}, "
              f"hidden={hidden} intermediate={intermediate}: rel. error {err:.1e} vs NumPy loop, "
              f"{seconds * 1e3:.0f} ms  {'OK' if good else 'MISMATCH'}")
    return ok


if __name__ == "__main__":
    raise SystemExit(0 if cpu_demo() else 1)
