"""Quantizer time against the number of experts at a fixed (tokens, channels): what the
per-tile expert lookup costs. Prints us and % of a same-size copy's bandwidth per format.

    python scripts/sweep_quantize.py [tokens] [channels]
"""
import sys

import torch

import gwgrad
from gwgrad import quantizers as Q
from gwgrad.bench import _cumsum, time_interleaved, token_counts
from gwgrad.bench.quantize import row_bytes
import gwgrad.adapters.torch as gwt

tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
channels = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
x = torch.randn(tokens, channels, device="cuda", dtype=torch.bfloat16)
src = x.view(torch.uint8).view(-1)
dst = torch.empty_like(src)
for fmt in ("mxfp8", "mxfp4", "block_1x128", "per_expert_channel", "nvfp4"):
    fns, nbytes = {"copy": lambda: dst.copy_(src)}, {}
    for experts in (8, 32, 128, 512):
        offsets = torch.tensor(_cumsum(token_counts(tokens, experts, "uniform", 128)),
                               dtype=torch.int32, device="cuda")
        lay = Q.layout(fmt, tokens, channels, experts)
        data, sc, gs = gwt.quantize(x, offsets, fmt)  # outputs the timed calls reuse
        fns[f"E={experts}"] = (lambda o=offsets, d=data, s=sc, g=gs: gwgrad.quantize(
            x, o, fmt, data=d, scales=s, global_scale=g))
        nbytes[f"E={experts}"] = row_bytes(fmt, tokens, channels, lay)
    t = time_interleaved(fns, rounds=8, sample_ms=8)
    bw = 2 * src.numel() / (t["copy"] * 1e-3)
    print(fmt, " ".join(f"{k}: {v * 1e3:.0f} us {100 * nbytes[k] / (v * 1e-3) / bw:.0f}%"
                        for k, v in t.items() if k != "copy"))
