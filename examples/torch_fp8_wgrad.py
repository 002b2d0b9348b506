"""FP8 expert weight gradients (Hopper) against the BF16 weight gradient, in PyTorch.

    python examples/torch_fp8_wgrad.py

A training step's BF16 ``x`` (tokens, hidden) and ``dy`` (tokens, intermediate), grouped by
expert, are quantized on the device by ``gwgrad.adapters.torch.quantize`` (gwgrad's grouped
quantizer: one kernel call per tensor, offsets read on the device, no host synchronization) in
the two FP32-scale recipes gwgrad's SM90 FP8 kernel runs, then
``gwgrad.adapters.torch.wgrad_fp8`` computes ``dW[e] = x_e.T @ dy_e`` from them:

* ``per_expert_channel``: one scale per expert and channel, from the channel's amax over the
  expert's tokens (``torch._scaled_grouped_mm``'s 2D-2D convention);
* ``block_1x128``: one scale per channel per 128 tokens of an expert (DeepSeek-V3's recipe).

Hopper's FP8 tensor cores read token-contiguous operands, so ``quantize`` stores the data
transposed, ``(hidden, tokens)``, and it is passed as its ``.t()`` view. Every expert's token
count is a multiple of 16 here (``gwgrad.quantizers.count_multiple``: pad each expert's group
to 16 tokens in a real step; TMA needs 16-byte rows). Runs on an SM90 GPU, else on the CPU
(gwgrad's reference and the quantizer's NumPy model, smaller sizes); prints the relative error
against the BF16 weight gradient and, on the GPU, the times of the quantizer and the GEMMs.
"""

import torch

import gwgrad
import gwgrad.adapters.torch as gwt

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
experts, hidden, inter = (16, 2048, 1536) if device == "cuda" else (4, 64, 96)
units = 160 if device == "cuda" else 6  # tokens per expert: random multiples of 16
counts = torch.randint(0, 2 * units, (experts,), device=device) * 16
counts[0] = 0  # an expert without tokens
tokens = int(counts.sum())  # (a shape: needed to allocate; the kernels never read it)
offsets = torch.cumsum(counts, 0).to(torch.int32)
x = torch.randn(tokens, hidden, device=device).bfloat16()
dy = torch.randn(tokens, inter, device=device).bfloat16()

# per_expert_channel: E4M3 data (hidden, tokens) / (inter, tokens), FP32 scales (experts, C).
xt, sx, _ = gwt.quantize(x, offsets, "per_expert_channel")
dyt, sdy, _ = gwt.quantize(dy, offsets, "per_expert_channel")
w_channel = gwt.wgrad_fp8(xt.t(), dyt.t(), offsets, sx, sdy, scale_recipe="per_expert_channel",
                          out_dtype=torch.float32)

# block_1x128: FP32 scales (R, C), one row per 128 tokens of an expert, experts' rows in order
# (R: a bound that holds any counts; the GEMM reads only the rows the counts need).
xt_b, sx_b, _ = gwt.quantize(x, offsets, "block_1x128")
dyt_b, sdy_b, _ = gwt.quantize(dy, offsets, "block_1x128")
w_block = gwt.wgrad_fp8(xt_b.t(), dyt_b.t(), offsets, sx_b, sdy_b, scale_recipe="block_1x128",
                        out_dtype=torch.float32)

w_bf16 = gwt.wgrad(x, dy, offsets, out_dtype=torch.float32)
gwgrad.check_errors()
for name, w in (("per_expert_channel", w_channel), ("block_1x128", w_block)):
    err = ((w - w_bf16).norm() / w_bf16.norm()).item()
    print(f"FP8 {name:18s} relative error vs BF16 weight gradient: {err:.4f}")
    assert err < 0.06, err  # E4M3 keeps 3 mantissa bits: a few percent
assert torch.all(w_channel[0] == 0) and torch.all(w_block[0] == 0)  # the empty expert

if device == "cuda":
    def timed(fn, reps=20):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps

    # The quantizer: x and dy into the outputs of the calls above (no allocation), as a
    # training step reuses them; bytes moved: BF16 read, FP8 written (scales are small).
    moved = 3.0 * tokens * (hidden + inter)
    for name, fmt, outs in (("per_expert_channel", "per_expert_channel", ((xt, sx), (dyt, sdy))),
                            ("block_1x128", "block_1x128", ((xt_b, sx_b), (dyt_b, sdy_b)))):
        def quantize_both(fmt=fmt, outs=outs):
            gwt.quantize(x, offsets, fmt, out=(*outs[0], None))
            gwt.quantize(dy, offsets, fmt, out=(*outs[1], None))

        ms = timed(quantize_both)
        print(f"quantize x, dy {name:18s} {ms * 1e3:8.1f} us  {moved / ms / 1e6:6.0f} GB/s")

    flops = 2.0 * hidden * inter * tokens
    out = torch.empty_like(w_bf16)
    for name, fn in (
        ("BF16", lambda: gwt.wgrad(x, dy, offsets, out=out)),
        ("FP8 per_expert_channel", lambda: gwt.wgrad_fp8(
            xt.t(), dyt.t(), offsets, sx, sdy, scale_recipe="per_expert_channel", out=out)),
        ("FP8 block_1x128", lambda: gwt.wgrad_fp8(
            xt_b.t(), dyt_b.t(), offsets, sx_b, sdy_b, scale_recipe="block_1x128", out=out)),
    ):
        ms = timed(fn)
        print(f"{name:24s} {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s")
print("ok")
