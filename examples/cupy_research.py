"""A CuPy research script: expert weight gradients of a skewed MoE batch with gwgrad.

    python examples/cupy_research.py

CuPy has no bfloat16 dtype, so the operands travel as uint16 bfloat16 bits
(``gwgrad.adapters.cupy.to_bfloat16_bits``) flagged with ``dtype="bfloat16"``. The script
computes W[e] = x[tokens_e].T @ dy[tokens_e] in float32 on a non-default stream, checks it
against a per-expert CuPy matmul, and times the call. Needs CuPy and a GPU; without them it
says so and exits (CuPy has no CPU arrays; see examples/cpu_reference.py for the CPU path).
"""

import sys

import numpy as np

try:
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 1:
        raise RuntimeError("no GPU")
except Exception as exc:  # noqa: BLE001 - ImportError, no driver, no device
    print(f"skipped: this example needs CuPy and a CUDA GPU ({type(exc).__name__}: {exc})")
    sys.exit(0)

import gwgrad.adapters.cupy as gwc

rng = np.random.default_rng(0)
hidden, intermediate, experts, tokens = 1024, 2048, 16, 16384
weights = 1.0 / (np.arange(experts) + 1) ** 1.2  # zipf-skewed routing
counts = np.floor(tokens * weights / weights.sum()).astype(np.int64)
counts[0] += tokens - counts.sum()
offsets = cupy.asarray(np.cumsum(counts).astype(np.int32))

x = gwc.to_bfloat16_bits(cupy.random.standard_normal((tokens, hidden), dtype=cupy.float32))
dy = gwc.to_bfloat16_bits(cupy.random.standard_normal((tokens, intermediate), dtype=cupy.float32))

stream = cupy.cuda.Stream(non_blocking=True)
cupy.cuda.get_current_stream().synchronize()
with stream:
    w = gwc.wgrad(x, dy, offsets, dtype="bfloat16", out_dtype="float32")  # compiles once
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(10):
        gwc.wgrad(x, dy, offsets, dtype="bfloat16", out=w)
    end.record()
    end.synchronize()
ms = cupy.cuda.get_elapsed_time(start, end) / 10
tflops = 2.0 * hidden * intermediate * tokens / ms / 1e9

xf, dyf = gwc.from_bfloat16_bits(x), gwc.from_bfloat16_bits(dy)
bounds = [0] + np.cumsum(counts).tolist()
want = cupy.stack([xf[s:e].T @ dyf[s:e] for s, e in zip(bounds, bounds[1:])])
err = float(cupy.linalg.norm(w - want) / cupy.linalg.norm(want))
print(f"{experts} experts, tokens per expert {counts.min()}..{counts.max()}: "
      f"{ms:.3f} ms ({tflops:.0f} TFLOP/s), relative error vs CuPy matmul {err:.1e}")
assert err < 1e-4, err
