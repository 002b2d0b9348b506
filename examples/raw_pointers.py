"""Raw pointers: describe memory by address, shape, strides (elements), dtype and device.

On a GPU the addresses come from any allocator (cudaMalloc, another framework, ...) and the
stream is an int cudaStream_t. This example uses host memory (device_type="cpu"), which runs
on the reference backend, so it works without a GPU.

    python examples/raw_pointers.py
"""

import numpy as np

import gwgrad
from gwgrad.backends.reference import decode, round_to_bfloat16_bits

rng = np.random.default_rng()
hidden, intermediate = 32, 48
offsets = np.array([16, 16, 64], dtype=np.int32)
tokens_sum = int(offsets[-1])

x_bits = round_to_bfloat16_bits(rng.standard_normal((tokens_sum, hidden)))  # bfloat16 bits
dy_bits = round_to_bfloat16_bits(rng.standard_normal((tokens_sum, intermediate)))
outputs = [np.full((hidden, intermediate), np.nan, np.float32) for _ in offsets]
ptrs = np.array([o.ctypes.data for o in outputs], dtype=np.int64)  # one address per expert

a = gwgrad.from_pointer(x_bits.ctypes.data, (hidden, tokens_sum), (1, hidden), "bfloat16",
                        device_type="cpu")
b = gwgrad.from_pointer(dy_bits.ctypes.data, (tokens_sum, intermediate), (intermediate, 1),
                        "bfloat16", device_type="cpu")
result = gwgrad.grouped_gemm_wgrad(a, b, offsets_tensor=offsets, output_mode="discrete",
                                   wgrad_ptrs=ptrs, wgrad_dtype="float32", current_stream=0)
assert result["wgrad_tensor"] is None  # pointer-only output: the caller owns the buffers

x, dy = decode(x_bits, gwgrad.DType.BFLOAT16), decode(dy_bits, gwgrad.DType.BFLOAT16)
assert np.allclose(outputs[0], x[:16].T @ dy[:16], rtol=1e-5, atol=1e-5)
assert not outputs[1].any()  # the empty expert
print("discrete outputs written through raw pointers:", [o.shape for o in outputs])
