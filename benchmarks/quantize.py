"""`python -m benchmarks.quantize`: the GPU quantizers (gwgrad.quantize) on the activations and
gradients of the MoE shapes of shapes.json (x: (tokens, hidden), dy: (tokens, intermediate),
uniform counts, multiples of 256), every format, in one process, methods interleaved (CUDA
events, warm-up, medians; benchmarks.wgrad.time_interleaved):

* ``gwgrad:<fmt>``: one gwgrad.quantize call into preallocated outputs (data, scales, global
  scale: everything the GEMM reads, in its layout);
* ``torch:<fmt>``: the same quantization written with torch ops, as users do today (the FP32
  recipes as in examples' earlier torch code: amax by scatter_reduce, divide, cast, transpose;
  MXFP8 with global 32-token blocks) — *without* the blocked scale layout, so a lower bound
  of what torch code costs;
* ``copy``: ``dst.copy_(src)`` of x: the HBM bandwidth of this run.

Reported per row and format: microseconds, the bytes the kernels move (BF16 x read -- twice
for the two-pass formats per_expert_channel and nvfp4, whose amax kernel reads x once more --
plus codes and scales written) over the time as a fraction of the copy bandwidth, and gwgrad's
speedup over the torch code. ``--step``: the whole FP8 weight-gradient step (quantize x and dy, then the
FP8 GEMM) against gwgrad's BF16 weight gradient, on the shapes with >= 2048 tokens per expert.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Dict, List, Optional

from .wgrad import DEFAULT_SHAPES, _cumsum, _error, time_methods, token_counts

FORMATS = ["mxfp8", "nvfp4", "mxfp4", "per_expert_channel", "block_1x128"]


def torch_methods(x, offsets, counts):
    """Torch-op quantizers of the FP32 recipes and MXFP8 (no blocked layout)."""
    import torch

    tokens, channels = x.shape
    dev = x.device
    experts = len(counts)
    counts_t = torch.tensor(counts, device=dev)
    expert_of = torch.repeat_interleave(torch.arange(experts, device=dev), counts_t,
                                        output_size=tokens)
    blocks = (counts_t + 127) // 128
    first_block = torch.cumsum(blocks, 0) - blocks
    begin = offsets.long() - counts_t
    block_of = first_block[expert_of] + (torch.arange(tokens, device=dev) - begin[expert_of]) // 128
    rows = int(blocks.sum())

    def grouped(group, groups):
        amax = torch.zeros(groups, channels, device=dev).scatter_reduce_(
            0, group[:, None].expand(tokens, channels), x.float().abs(), "amax")
        scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        data = (x.float() / scale[group]).to(torch.float8_e4m3fn)
        return data.t().contiguous(), scale

    def mxfp8():
        v = x.float().view(tokens // 32, 32, channels)
        amax = v.abs().amax(1, keepdim=True)
        exp = torch.floor(torch.log2(amax.clamp_min(2.0 ** -127))) - 8
        data = (v * torch.exp2(-exp)).to(torch.float8_e4m3fn).view(tokens, channels)
        return data.t().contiguous(), (exp + 127).to(torch.uint8)

    return {
        "per_expert_channel": lambda: grouped(expert_of, experts),
        "block_1x128": lambda: grouped(block_of, rows),
        "mxfp8": mxfp8,
    }


TWO_PASS = ("per_expert_channel", "nvfp4")  # an amax over each whole expert first


def row_bytes(fmt: str, tokens: int, channels: int, lay) -> int:
    """Bytes the kernels move: x read (twice for the two-pass formats, whose amax kernel
    reads it once more), the codes and the scales written."""
    code = tokens * channels // (2 if lay.elem == "e2m1" else 1)
    scale = 1
    for s in lay.scale_shape:
        scale *= s
    scale *= 4 if lay.scale_dtype.value == "float32" else 1
    reads = 2 if fmt in TWO_PASS else 1
    return 2 * tokens * channels * reads + code + scale


def run_row(shape: Dict, operand: str, rounds: int, sample_ms: float) -> Dict:
    import torch

    import gwgrad
    import gwgrad.adapters.torch as gwt
    from gwgrad import quantizers as Q

    tokens = shape["tokens_sum"]
    channels = shape["hidden"] if operand == "x" else shape["intermediate"]
    counts = token_counts(tokens, shape["num_experts"], "uniform", 256)
    offsets = torch.tensor(_cumsum(counts), dtype=torch.int32, device="cuda")
    x = torch.randn(tokens, channels, device="cuda", dtype=torch.bfloat16)
    row = {"shape": shape["name"], "operand": operand, "tokens": tokens, "channels": channels,
           "experts": shape["num_experts"], "methods": {}}
    fns, nbytes = {}, {}
    for fmt in FORMATS:
        lay = Q.layout(fmt, tokens, channels, shape["num_experts"])
        data, scales, gs = gwt.quantize(x, offsets, fmt)  # the outputs every call reuses
        fns[f"gwgrad:{fmt}"] = (lambda fmt=fmt, data=data, scales=scales, gs=gs: gwgrad.quantize(
            x, offsets, fmt, data=data, scales=scales, global_scale=gs))
        nbytes[fmt] = row_bytes(fmt, tokens, channels, lay)
    for fmt, fn in torch_methods(x, offsets, counts).items():
        fns[f"torch:{fmt}"] = fn
    src = x.view(torch.uint8).view(-1)
    dst = torch.empty_like(src)
    fns["copy"] = lambda: dst.copy_(src)
    times = time_methods(fns, row["methods"], rounds=rounds, sample_ms=sample_ms)
    copy_bw = 2 * src.numel() / (times["copy"] * 1e-3) if "copy" in times else None
    row["copy_GBps"] = copy_bw / 1e9 if copy_bw else None
    for name, ms in times.items():
        m = row["methods"].setdefault(name, {})
        m["us"] = ms * 1e3
        kind, _, fmt = name.partition(":")
        if kind == "gwgrad" and copy_bw:
            m["GBps"] = nbytes[fmt] / (ms * 1e-3) / 1e9
            m["of_copy_bw"] = m["GBps"] * 1e9 / copy_bw
            t = times.get(f"torch:{fmt}")
            if t:
                m["vs_torch"] = t / ms
    return row


STEP_FORMATS = ["per_expert_channel", "block_1x128", "mxfp8"]


def run_step(shape: Dict, rounds: int, sample_ms: float) -> Dict:
    """The whole FP8 weight-gradient step of one shape: quantize x and dy, then the FP8 GEMM
    (outputs preallocated, FP32 result), against gwgrad's BF16 weight gradient of the same BF16
    x and dy (``gwgrad.adapters.torch.wgrad``, the default path)."""
    import torch

    import gwgrad
    import gwgrad.adapters.torch as gwt
    from gwgrad import quantizers as Q

    tokens, experts = shape["tokens_sum"], shape["num_experts"]
    hidden, inter = shape["hidden"], shape["intermediate"]
    counts = token_counts(tokens, experts, "uniform", 256)
    offsets = torch.tensor(_cumsum(counts), dtype=torch.int32, device="cuda")
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, inter, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(experts, hidden, inter, device="cuda", dtype=torch.float32)
    row = {"shape": shape["name"], "tokens_per_expert": tokens // experts, "methods": {}}
    fns = {"bf16": lambda: gwt.wgrad(x, dy, offsets, out=out)}

    for fmt in STEP_FORMATS:
        (xq, sx, _), (dyq, sdy, _) = gwt.quantize(x, offsets, fmt), gwt.quantize(dy, offsets, fmt)
        f = Q.FORMATS[fmt]

        def gemm(f=f, xq=xq, sx=sx, dyq=dyq, sdy=sdy):
            gwgrad.grouped_gemm_wgrad(xq, dyq.t(), sx, sdy, offsets, wgrad_tensor=out,
                                      sf_vec_size=f.sf_vec or 16, scale_recipe=f.recipe)

        def step(fmt=fmt, xq=xq, sx=sx, dyq=dyq, sdy=sdy, gemm=gemm):
            gwgrad.quantize(x, offsets, fmt, data=xq, scales=sx)
            gwgrad.quantize(dy, offsets, fmt, data=dyq, scales=sdy)
            gemm()

        fns[f"step:{fmt}"] = step
        fns[f"gemm:{fmt}"] = gemm
    times = time_methods(fns, row["methods"], rounds=rounds, sample_ms=sample_ms)
    for name, ms in times.items():
        m = row["methods"].setdefault(name, {})
        m["us"] = ms * 1e3
        if name.startswith("step:") and "bf16" in times:
            m["vs_bf16"] = times["bf16"] / ms
    return row


def step_table(rows: List[Dict]) -> str:
    lines = ["FP8 step (quantize x + quantize dy + FP8 GEMM) vs gwgrad BF16 weight gradient, us:",
             f"{'row':16s} {'tok/exp':>7s} {'bf16':>9s} " + " ".join(
                 f"{f + ' step (gemm)':>34s}" for f in STEP_FORMATS)]
    for r in rows:
        m = r["methods"]
        cells = []
        for f in STEP_FORMATS:
            st, ge = m.get(f"step:{f}", {}), m.get(f"gemm:{f}", {})
            if "us" not in st:
                cells.append(f"{st.get('error', 'n/a')[:34]:>34s}")
                continue
            cells.append(f"{st['us']:9.0f} ({ge.get('us', 0):7.0f}) {st['vs_bf16']:5.2f}x bf16")
        lines.append(f"{r['shape']:16s} {r['tokens_per_expert']:7d} "
                     f"{m.get('bf16', {}).get('us', 0):9.0f} " + " ".join(f"{c:>34s}" for c in cells))
    return "\n".join(lines)


def table(rows: List[Dict]) -> str:
    lines = [f"{'row':24s} " + " ".join(f"{f:>22s}" for f in FORMATS),
             f"{'':24s} " + " ".join(f"{'us  %copy  xtorch':>22s}" for _ in FORMATS)]
    for r in rows:
        cells = []
        for fmt in FORMATS:
            m = r["methods"].get(f"gwgrad:{fmt}", {})
            if "us" not in m:
                cells.append(f"{m.get('error', 'n/a')[:22]:>22s}")
                continue
            vs = f"{m['vs_torch']:5.1f}x" if "vs_torch" in m else "   -  "
            cells.append(f"{m['us']:8.1f} {100 * m.get('of_copy_bw', 0):5.0f}% {vs:>6s}")
        lines.append(f"{r['shape'] + ' ' + r['operand']:24s} " + " ".join(cells))
    return "\n".join(lines)


def markdown(rows: List[Dict]) -> str:
    head = "| row | tokens x channels | copy GB/s | " + " | ".join(FORMATS) + " |"
    lines = [head, "|" + "---|" * (3 + len(FORMATS))]
    for r in rows:
        cells = []
        for fmt in FORMATS:
            m = r["methods"].get(f"gwgrad:{fmt}", {})
            if "us" not in m:
                cells.append("n/a")
                continue
            vs = f", {m['vs_torch']:.1f}x torch" if "vs_torch" in m else ""
            cells.append(f"{m['us']:.0f} us ({100 * m.get('of_copy_bw', 0):.0f}% of copy{vs})")
        lines.append(f"| {r['shape']} {r['operand']} | {r['tokens']} x {r['channels']} | "
                     f"{r['copy_GBps']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quantize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=str(DEFAULT_SHAPES))
    p.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--sample-ms", type=float, default=10.0)
    p.add_argument("--time-budget", type=float, default=0.0, help="seconds; 0: no limit")
    p.add_argument("--json", default="")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--step", action="store_true",
                   help="also time the whole FP8 step against BF16 on shapes with >= 2048 "
                        "tokens per expert")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("benchmarks.quantize needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = json.load(open(args.shapes))["shapes"]
    wanted = [s for s in args.rows.split(",") if s]
    shapes = [s for s in shapes if not wanted or s["name"] in wanted]
    start, rows = time.time(), []
    for shape in shapes:
        for operand in ("x", "dy"):
            if args.time_budget and time.time() - start > args.time_budget:
                rows.append({"shape": shape["name"], "operand": operand, "skipped": "budget"})
                continue
            try:
                rows.append(run_row(shape, operand, args.rounds, args.sample_ms))
            except Exception as exc:  # noqa: BLE001 - recorded, the next row goes on
                rows.append({"shape": shape["name"], "operand": operand, "error": _error(exc)})
            torch.cuda.empty_cache()
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump({"rows": rows, "device": torch.cuda.get_device_name()}, fh, indent=1)
    steps = []
    if args.step:
        for shape in shapes:
            if shape["tokens_sum"] // shape["num_experts"] < 2048:
                continue
            if args.time_budget and time.time() - start > args.time_budget:
                steps.append({"shape": shape["name"], "skipped": "budget"})
                continue
            try:
                steps.append(run_step(shape, args.rounds, args.sample_ms))
            except Exception as exc:  # noqa: BLE001
                steps.append({"shape": shape["name"], "error": _error(exc)})
            torch.cuda.empty_cache()
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump({"rows": rows, "steps": steps,
                               "device": torch.cuda.get_device_name()}, fh, indent=1)
    done = [r for r in rows if "methods" in r]
    print(table(done))
    if steps:
        print(step_table([r for r in steps if "methods" in r]))
        for r in steps:
            if "methods" not in r:
                print(f"step {r['shape']}: {r.get('error') or r.get('skipped')}")
    if args.markdown:
        print(markdown(done))
    for r in rows:
        if "methods" not in r:
            print(f"{r['shape']} {r['operand']}: {r.get('error') or r.get('skipped')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
