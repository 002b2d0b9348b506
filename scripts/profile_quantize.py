"""Profile target for ncu: a few gwgrad.quantize calls of one format on one shape.

    ncu --kernel-name regex:tile_kernel --launch-skip 2 --launch-count 1 \
        python scripts/profile_quantize.py mxfp8 65536 7168 32
"""
import sys

import torch

import gwgrad
from gwgrad.bench import _cumsum, token_counts
import gwgrad.adapters.torch as gwt

fmt, tokens, channels, experts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
offsets = torch.tensor(_cumsum(token_counts(tokens, experts, "uniform", 256)), dtype=torch.int32,
                       device="cuda")
x = torch.randn(tokens, channels, device="cuda", dtype=torch.bfloat16)
data, scales, gs = gwt.quantize(x, offsets, fmt)  # outputs the calls below reuse
for _ in range(4):
    gwgrad.quantize(x, offsets, fmt, data=data, scales=scales, global_scale=gs)
torch.cuda.synchronize()
print("done")
