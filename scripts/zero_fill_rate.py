"""How fast the SM90 kernel writes the empty experts' zeros when it has almost nothing else to
do (issue #12): one expert of --tokens tokens and every other expert empty, so the launch is
the zero fill (plus one short expert's units). Timed interleaved with a memset of the same
output (``out.zero_()``) and a device-to-device copy of it, in the same process:

    method       ms      GB/s written (zeros)     x memset
    gwgrad       ...
    memset       ...
    copy         ...     (read + write)

gwgrad's GB/s counts the empty experts' output bytes only. Run once per tree to compare zero
fill variants (``PYTHONPATH=ab_v1 python scripts/zero_fill_rate.py``): the kernel cache keys
on the source, so trees never share a kernel.

    python scripts/zero_fill_rate.py --shape fine-256e --json $OUT/zero_rate.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

# Appended, not inserted: a tree on PYTHONPATH (an A/B variant) comes first.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def counts_for(num_experts: int, tokens: int):
    """Expert 0 live with ``tokens`` tokens, every other expert empty."""
    return [tokens] + [0] * (num_experts - 1)


def zero_bytes(hidden: int, intermediate: int, num_experts: int, itemsize: int) -> int:
    """The empty experts' output bytes (every expert but the first)."""
    return (num_experts - 1) * hidden * intermediate * itemsize


def main(argv=None) -> int:
    import torch

    import gwgrad
    from gwgrad.bench import DEFAULT_SHAPES, KernelRunner, config_name, parse_tile, select_shapes
    from gwgrad.bench import time_interleaved

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="fine-256e", help="a row of the bench's shapes")
    p.add_argument("--tokens", type=int, default=256, help="tokens of the one live expert")
    p.add_argument("--tiles", default="", help="gwgrad variants (the bench's --tiles syntax)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    (shape,) = select_shapes(DEFAULT_SHAPES, args.shape)
    hidden, inter, experts = shape["hidden"], shape["intermediate"], shape["num_experts"]
    counts = counts_for(experts, args.tokens)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(args.tokens, inter, device="cuda", dtype=torch.bfloat16, generator=gen)
    offsets = torch.tensor([sum(counts[:i + 1]) for i in range(experts)], dtype=torch.int32,
                           device="cuda")
    out = torch.full((experts, hidden, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    fns = {"gwgrad": KernelRunner(x.t(), dy, offsets, out)}
    for cfg in (parse_tile(t) for t in args.tiles.split(",") if t):
        fns[config_name(cfg)] = KernelRunner(x.t(), dy, offsets, out, mma_tiler_mn=cfg[:2],
                                             tuning=tuple(cfg[2:]))
    fns["gwgrad"]()
    torch.cuda.synchronize()
    if torch.count_nonzero(out[1:]).item() != 0:
        raise SystemExit("the empty experts' outputs are not all zero")
    src = torch.empty_like(out)
    fns["memset"] = out.zero_
    fns["copy"] = lambda: out.copy_(src)
    ms = time_interleaved(fns, rounds=args.rounds)
    nbytes = zero_bytes(hidden, inter, experts, 2)
    rows = {}
    print(f"{gwgrad.__file__}\n{args.shape}: {experts - 1} empty experts, "
          f"{nbytes / 1e6:.0f} MB of zeros; expert 0: {args.tokens} tokens")
    print(f"{'method':40} {'ms':>8} {'GB/s':>8} {'x memset':>9}")
    for name, t in ms.items():
        moved = out.numel() * 2 * (2 if name == "copy" else 1) if name in ("memset", "copy") \
            else nbytes
        rows[name] = {"ms": t, "gbps": moved / t / 1e6}
        print(f"{name:40} {t:8.4f} {moved / t / 1e6:8.0f} {ms['memset'] / t:9.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gwgrad": gwgrad.__file__, "shape": shape, "tokens": args.tokens,
                       "zero_bytes": nbytes, "methods": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
