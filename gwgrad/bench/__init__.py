"""`python -m gwgrad bench`: gwgrad against what an H100/H200 user has today, on the MoE shapes
of shared/bench/shapes.json (a copy ships as gwgrad/bench_shapes.json).

Every row times, in one process and on the same inputs (x.T as M-major A, dy as N-major B,
BF16 output): gwgrad, `torch._grouped_mm`, a per-expert `torch.mm` loop, and one dense
cuBLAS GEMM of equal FLOPs (hidden x intermediate x tokens_sum) as the ceiling. CUDA events,
warm-up, median of many runs; randn data. The table is printed and saved as JSON (and a PNG
plot when matplotlib is there).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SHAPES = os.path.join(HERE, "bench_shapes.json")


# ----------------------------------------------------------------------------------------
# token distributions
# ----------------------------------------------------------------------------------------


def token_counts(tokens_sum: int, num_experts: int, dist: str, multiple: int = 256) -> List[int]:
    """Per-expert counts summing to tokens_sum. `uniform`: equal; `zipf`: weights
    1/rank^1.2 in a fixed random order (seed 0). Counts are multiples of `multiple`."""
    import random

    if dist == "uniform":
        weights = [1.0] * num_experts
    elif dist == "zipf":
        weights = [1.0 / (r + 1) ** 1.2 for r in range(num_experts)]
        random.Random(0).shuffle(weights)
    else:
        raise ValueError(f"dist: expected 'uniform' or 'zipf', got {dist!r}")
    total_w = sum(weights)
    units = tokens_sum // multiple
    counts = [int(units * w / total_w) for w in weights]
    # Hand the remainder to the largest experts so the sum is exact.
    rest = units - sum(counts)
    for i in sorted(range(num_experts), key=lambda i: -weights[i])[:rest]:
        counts[i] += 1
    counts = [c * multiple for c in counts]
    counts[max(range(num_experts), key=lambda i: weights[i])] += tokens_sum - sum(counts)
    return counts


# ----------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------


def time_interleaved(fns: Dict[str, object], rounds: int = 12, sample_ms: float = 15.0,
                     warmup: int = 3) -> Dict[str, float]:
    """Median milliseconds per call of each function, sampled round-robin.

    Each sample times enough back-to-back calls to last ~sample_ms between two CUDA events;
    the methods take turns within every round, so clock and temperature drift (large on an
    H200 running near its power limit) bias none of them.
    """
    import torch

    inner = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        inner[name] = max(1, min(200, int(sample_ms / max(s.elapsed_time(e), 1e-3))))
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(inner[name]):
                fn()
            e.record()
            samples[name].append((s, e, inner[name]))
        torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) / n for s, e, n in v)
            for name, v in samples.items()}


# ----------------------------------------------------------------------------------------
# the methods
# ----------------------------------------------------------------------------------------


class KernelRunner:
    """gwgrad's kernel through the backend interface: the launch an operator makes, without the
    API layer's per-call argument handling (so its time is the kernel's)."""

    def __init__(self, a, b, offsets, out, mma_tiler_mn, accumulate=False):
        import torch

        from .backends import detect_arch, finalize_spec
        from .backends.base import LaunchArgs
        from .dtypes import DType
        from .spec import StaticSpec
        from .tensors import TensorDesc

        dt = {torch.bfloat16: DType.BFLOAT16, torch.float16: DType.FLOAT16,
              torch.float32: DType.FLOAT32, torch.int32: DType.INT32}

        def desc(x):
            return TensorDesc(x.data_ptr(), tuple(x.shape), tuple(x.stride()), dt[x.dtype],
                              "cuda", x.device.index or 0, "torch", x)

        spec = StaticSpec(
            hidden=a.shape[0], intermediate=b.shape[1], num_experts=offsets.shape[0],
            a_dtype=DType.BFLOAT16, b_dtype=DType.BFLOAT16, wgrad_dtype=dt[out.dtype],
            acc_dtype=DType.FLOAT32, a_major="k" if a.stride(1) == 1 else "m",
            b_major="k" if b.stride(0) == 1 else "n", input_order="tensor2d",
            output_mode="dense", accumulate=accumulate,
            mma_tiler_mn=None if mma_tiler_mn is None else tuple(mma_tiler_mn),
            cluster_shape_mn=None if mma_tiler_mn is None else (1, 1), sf_vec_size=16,
            arch=detect_arch(a.device.index or 0),
        )
        self.spec, self.backend = finalize_spec(spec)
        self.compiled = self.backend.compile(self.spec)
        self.workspace = torch.empty(self.backend.workspace_bytes(self.spec), dtype=torch.uint8,
                                     device=a.device)
        self.args = LaunchArgs(a=desc(a), b=desc(b), offsets=desc(offsets),
                               tokens_sum=a.shape[1], wgrad=desc(out),
                               stream=torch.cuda.current_stream().cuda_stream,
                               workspace=self.workspace.data_ptr())

    def __call__(self):
        self.backend.launch(self.compiled, self.spec, self.args)


def run_row(shape: Dict, dist: str, configs: List, multiple: int, check: bool) -> Dict:
    import torch

    m, n, e, t = shape["hidden"], shape["intermediate"], shape["num_experts"], shape["tokens_sum"]
    counts = token_counts(t, e, dist, multiple)
    offs = torch.tensor(_cumsum(counts), dtype=torch.int32, device="cuda")
    torch.manual_seed(0)
    x = torch.randn(t, m, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    a, b = x.t(), dy  # M-major A, N-major B: how a training step holds them
    flops = 2.0 * m * n * t
    row = {"name": shape["name"], "dist": dist, "hidden": m, "intermediate": n,
           "num_experts": e, "tokens_sum": t, "max_count": max(counts),
           "min_count": min(counts), "methods": {}}

    def record(name, ms):
        row["methods"][name] = {"ms": ms, "tflops": flops / ms / 1e9}

    out = torch.empty(e, m, n, device="cuda", dtype=torch.bfloat16)
    fns = {}
    default = KernelRunner(a, b, offs, out, mma_tiler_mn=None)  # what users get by default
    default_name = "gwgrad_{}x{}".format(*default.spec.mma_tiler_mn)
    fns[default_name] = default
    for cfg in configs:
        name = f"gwgrad_{cfg[0]}x{cfg[1]}"
        if name in fns:
            continue
        try:
            fns[name] = KernelRunner(a, b, offs, out, mma_tiler_mn=cfg)
        except (ValueError, RuntimeError) as exc:  # a tile this shape cannot use
            row["methods"][name] = {"error": str(exc)}
    starts = [0] + _cumsum(counts)[:-1]
    ref_out = torch.empty_like(out)

    def loop():
        for i, (s, c) in enumerate(zip(starts, counts)):
            torch.mm(a[:, s:s + c], b[s:s + c], out=ref_out[i])

    fns["torch_mm_loop"] = loop
    if hasattr(torch, "_grouped_mm") and multiple % 16 == 0:
        try:
            gm = lambda: torch._grouped_mm(a, b, offs=offs)  # noqa: E731
            gm()
            fns["torch_grouped_mm"] = gm
        except Exception as exc:  # noqa: BLE001 - record why the competitor did not run
            row["methods"]["torch_grouped_mm"] = {"error": f"{type(exc).__name__}: {exc}"}
    fns["dense_cublas"] = lambda: torch.mm(a, b)  # one GEMM with the same FLOPs
    times = time_interleaved(fns)
    for name, ms in times.items():
        record(name, ms)
    best = min((k for k in times if k.startswith("gwgrad_")), key=times.get)
    record("gwgrad", times[default_name])
    row["gwgrad_config"] = list(default.spec.mma_tiler_mn)
    row["gwgrad_best_config"] = [int(x) for x in best.split("_")[1].split("x")]
    row["gwgrad_best_vs_default"] = times[default_name] / times[best]
    if check:
        out.fill_(float("nan"))
        fns[default_name]()
        loop()
        torch.cuda.synchronize()
        err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
        row["rel_err_vs_loop"] = err
        if not err < 1e-2:
            row["check_failed"] = True

    meth = row["methods"]
    for comp in ("torch_grouped_mm", "torch_mm_loop", "dense_cublas"):
        if "ms" in meth.get("gwgrad", {}) and "ms" in meth.get(comp, {}):
            row[f"ratio_vs_{comp}"] = meth[comp]["ms"] / meth["gwgrad"]["ms"]
    del x, dy, out, ref_out
    torch.cuda.empty_cache()
    return row


def _cumsum(xs):
    out, s = [], 0
    for v in xs:
        s += v
        out.append(s)
    return out


def format_table(rows: List[Dict]) -> str:
    head = (f"{'shape':<15} {'dist':<8} {'gwgrad':>8} {'grouped_mm':>10} {'mm_loop':>8} "
            f"{'dense':>8} {'x grouped':>9} {'x loop':>7} {'x dense':>8} {'tile':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        meth = r["methods"]

        def tf(k):
            v = meth.get(k, {}).get("tflops")
            return f"{v:8.1f}" if v is not None else f"{'-':>8}"

        def ratio(k):
            v = r.get(f"ratio_vs_{k}")
            return f"{v:.2f}" if v is not None else "-"

        tile = "x".join(map(str, r.get("gwgrad_config", []))) or "-"
        lines.append(
            f"{r['name']:<15} {r['dist']:<8} {tf('gwgrad')} {tf('torch_grouped_mm'):>10} "
            f"{tf('torch_mm_loop')} {tf('dense_cublas')} {ratio('torch_grouped_mm'):>9} "
            f"{ratio('torch_mm_loop'):>7} {ratio('dense_cublas'):>8} {tile:>8}"
        )
    lines.append("(TFLOP/s; ratios are competitor time / gwgrad time: > 1 means gwgrad is faster)")
    return "\n".join(lines)


def plot(rows: List[Dict], path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - the plot is optional
        return None
    methods = ["gwgrad", "torch_grouped_mm", "torch_mm_loop", "dense_cublas"]
    labels = [f"{r['name']}\n{r['dist']}" for r in rows]
    width = 0.2
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(rows)), 4.5))
    for i, meth in enumerate(methods):
        vals = [r["methods"].get(meth, {}).get("tflops", 0.0) for r in rows]
        ax.bar([j + (i - 1.5) * width for j in range(len(rows))], vals, width, label=meth)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.set_title("grouped weight gradient (BF16, M-major A, N-major B)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def parse_tile(s: str):
    m, n = s.lower().split("x")
    return (int(m), int(n))


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gwgrad bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="shapes JSON (default: bundled copy)")
    p.add_argument("--rows", default="", help="comma-separated shape names (default: all)")
    p.add_argument("--dist", default="uniform,zipf")
    p.add_argument("--tiles", default="128x256,128x128",
                   help="gwgrad mma_tiler_mn values timed besides the default tiling (the "
                        "table reports the default; the JSON has every tile and the best)")
    p.add_argument("--unrounded", action="store_true",
                   help="counts not rounded to 256 (torch._grouped_mm is skipped)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness cross-check")
    p.add_argument("--json", default="bench_results.json")
    p.add_argument("--plot", default="bench_results.png")
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: the benchmark needs one", file=sys.stderr)
        return 2
    with open(args.shapes) as f:
        shapes = json.load(f)["shapes"]
    if args.rows:
        wanted = set(args.rows.split(","))
        shapes = [s for s in shapes if s["name"] in wanted]
    tiles = [parse_tile(s) for s in args.tiles.split(",") if s]
    multiple = 8 if args.unrounded else 256
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    rows = []
    t0 = time.time()
    for shape in shapes:
        for dist in args.dist.split(","):
            row = run_row(shape, dist, tiles, multiple, not args.no_check)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "methods"}), flush=True)
    table = format_table(rows)
    print(table)
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "unrounded": args.unrounded, "rows": rows, "seconds": time.time() - t0},
                  f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
