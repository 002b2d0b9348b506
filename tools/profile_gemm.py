"""Profile target for ncu: per shape row, gwgrad's GEMM (adapter path, default
tiling; bf16 output, or FP32 accumulate with --accumulate) and the dense cuBLAS GEMM of equal
FLOPs, each call inside an NVTX range ``prof`` (printed in launch order). Warm-up (compiles, cuBLAS
heuristics) runs outside every range, so ncu sees exactly one call of each method per row.
With ``--fp8 channel,1x128,mx`` it profiles gwgrad's FP8 recipes (bench/fp8.py's inputs) and the
dense FP8 ``torch._scaled_mm`` of equal FLOPs instead.

    ncu --clock-control none --nvtx --nvtx-include "prof/" --section SpeedOfLight \\
        --csv --page details --log-file ncu.csv \\
        python tools/profile_gemm.py --rows dsv3-fc1,fine-256e --dists uniform
    python tools/profile_gemm.py --summarize ncu.csv

``bash tools/gpu_run.sh ncu`` runs it on the rows below the dense ceiling and the two
small-expert rows (GWGRAD_NCU_ROWS / GWGRAD_NCU_DISTS / GWGRAD_NCU_ACCUMULATE change that) and keeps the CSV
and a per-kernel summary (duration, SM / DRAM throughput, tensor-pipe share, SM clock,
duration in clock cycles; with GWGRAD_NCU_STALLS=1 also the largest warp stall reasons)
under $OUT.
``--tiles`` adds gwgrad variants (the bench's ``MxN[:field=value...]`` syntax, e.g.
``128x128:unit_schedule=3,128x128:cluster=1x2``; GWGRAD_NCU_TILES in gpu_run.sh), each through
its launch plan, so that ncu can say why one variant is slower than another.
Without ncu it prints each method's time from CUDA events (a check that the target runs).
"""
import argparse
import csv
import os
import sys
from collections import OrderedDict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from benchmarks.wgrad import (DEFAULT_SHAPES, RowInputs, config_name, parse_tile,  # noqa: E402
                              select_shapes)


# ncu --csv --page details metric names -> summary columns (unit-normalized below)
METRICS = {"Duration": "us", "Compute (SM) Throughput": "sm%", "DRAM Throughput": "dram%",
           "Memory Throughput": "mem%", "L2 Cache Throughput": "l2%",
           "L1/TEX Cache Throughput": "l1%",
           "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active": "tensor%",
           "SM Frequency": "ghz"}
_TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
          "s": 1e6, "second": 1e6}
_TO_GHZ = {"hz": 1e-9, "khz": 1e-6, "mhz": 1e-3, "ghz": 1.0, "cycle/second": 1e-9,
           "cycle/usecond": 1e-3, "cycle/nsecond": 1.0}


#: ncu's per-reason warp stall metrics (WarpStateStats): warps stalled for that reason per
#: issued instruction, ``smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio``.
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"
STALL_TOP = 5


def stall_reason(metric: str):
    """The reason of a warp stall metric name (e.g. "long_scoreboard"), or None."""
    if metric.startswith(STALL_PREFIX) and metric.endswith(STALL_SUFFIX):
        return metric[len(STALL_PREFIX):-len(STALL_SUFFIX)]
    return None


def summarize(path: str) -> str:
    """One line per profiled kernel of an ncu ``--csv --page details`` report, in launch
    order: its name, duration and the throughput figures (percent of peak)."""
    kernels: "OrderedDict[str, dict]" = OrderedDict()
    with open(path) as f:
        rows = csv.reader(line for line in f if line.startswith('"'))
        header = next(rows, None)
        if header is None:
            return f"{path}: no CSV rows"
        col = {name: i for i, name in enumerate(header)}
        for r in rows:
            k = kernels.setdefault(r[col["ID"]], {"name": r[col["Kernel Name"]]})
            metric, unit = r[col["Metric Name"]], r[col["Metric Unit"]]
            stall = stall_reason(metric)
            if stall is not None:
                k.setdefault("stalls", {})[stall] = float(
                    r[col["Metric Value"]].replace(",", ""))
            elif metric in METRICS:
                value = float(r[col["Metric Value"]].replace(",", ""))
                if METRICS[metric] == "us":
                    value *= _TO_US.get(unit, float("nan"))
                elif METRICS[metric] == "ghz":
                    value *= _TO_GHZ.get(unit.lower(), float("nan"))
                elif unit != "%":
                    continue  # "Memory Throughput" also comes in bytes/s
                k[METRICS[metric]] = value
    # The SM clock (ncu --clock-control none leaves it to the GPU's power management) and
    # the duration in clock cycles: a kernel that needs as many cycles as another but runs
    # at a lower clock loses to power, not to its schedule.
    for k in kernels.values():
        if "us" in k and "ghz" in k:
            k["Mcyc"] = k["us"] * k["ghz"] / 1e3
    cols = ["us", "sm%", "mem%", "l1%", "l2%", "dram%", "tensor%", "ghz", "Mcyc"]
    lines = [f"{'id':>3} {'kernel':<52} " + " ".join(f"{c:>7}" for c in cols)]
    for kid, k in kernels.items():
        lines.append(f"{kid:>3} {k['name'][:52]:<52} " + " ".join(
            (f"{k[c]:7.3f}" if c in ("ghz", "Mcyc") else f"{k[c]:7.1f}") if c in k
            else f"{'-':>7}" for c in cols))
    stalled = [(kid, k) for kid, k in kernels.items() if k.get("stalls")]
    if stalled:
        lines.append(f"warp stalls (warps stalled per issued instruction, the {STALL_TOP} largest "
                     "reasons; gpu_run.sh ncu with GWGRAD_NCU_STALLS=1):")
        for kid, k in stalled:
            top = sorted(k["stalls"].items(), key=lambda kv: -kv[1])[:STALL_TOP]
            lines.append(f"{kid:>3} {k['name'][:52]:<52} " + "  ".join(
                f"{reason} {value:.2f}" for reason, value in top))
    return "\n".join(lines)


def variant_methods(inp, tiles: str, out, accumulate: bool):
    """gwgrad's kernel in each ``--tiles`` variant (comma-separated ``MxN[:field=value...]``)
    on ``inp``'s operands, into ``out`` (accumulating into it with ``accumulate``), by the
    bench's method name (RowInputs.variant)."""
    return {config_name(cfg): inp.variant(cfg, out, accumulate)
            for cfg in map(parse_tile, filter(None, (t.strip() for t in tiles.split(","))))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--summarize", metavar="CSV",
                   help="print the per-kernel summary of an ncu CSV report and exit")
    p.add_argument("--shapes", default=DEFAULT_SHAPES)
    p.add_argument("--rows", default="", help="comma-separated shape names (default: all)")
    p.add_argument("--dists", default="uniform", help="comma-separated: uniform, zipf")
    p.add_argument("--accumulate", action="store_true",
                   help="gwgrad accumulates into an FP32 output (the main-grad path)")
    p.add_argument("--fp8", default="", metavar="RECIPES",
                   help="profile gwgrad's FP8 kernel instead (bench/fp8.py's inputs), for "
                        "these comma-separated recipes (channel, 1x128, mx), beside the dense "
                        "FP8 torch._scaled_mm of equal FLOPs")
    p.add_argument("--tiles", default="",
                   help="gwgrad variants profiled beside the default (BF16 only), as the "
                        "bench's --tiles: MxN[:field=value...], comma-separated")
    p.add_argument("--quack", action="store_true",
                   help="also profile QuACK's varlen-K GEMM in its default config (BF16 "
                        "output only; the bench extra)")
    args = p.parse_args()
    if args.summarize:
        print(summarize(args.summarize))
        return 0

    import gwgrad.adapters.torch as gwt

    for shape in select_shapes(args.shapes, args.rows):
        for dist in args.dists.split(","):
            if args.fp8:
                from benchmarks.fp8 import Fp8Row

                inp = Fp8Row(shape, dist)
                methods = {f"fp8_{r}": inp.runner(r) for r in args.fp8.split(",")}
                methods["dense_fp8"] = inp.dense_fp8()
                profile(shape, dist, inp.flops, methods)
                del inp
                torch.cuda.empty_cache()
                continue
            inp = RowInputs(shape, dist, 256)
            if args.accumulate:
                out = torch.zeros(inp.num_experts, inp.hidden, inp.intermediate,
                                  dtype=torch.float32, device="cuda")
                x, dy, offsets = inp.x, inp.dy, inp.offsets
                methods = {"gwgrad_fp32_acc":
                           lambda: gwt.wgrad(x, dy, offsets, out=out, accumulate=True)}
            else:
                out = inp.outs["gwgrad"]
                methods = {"gwgrad": inp.adapter()}
            methods.update(variant_methods(inp, args.tiles, out, args.accumulate))
            if args.quack and not args.accumulate:
                methods["quack_default"] = inp.quack(tuned=False)
            methods["dense_cublas"] = inp.dense()
            profile(shape, dist, inp.flops, methods)
            del inp
            torch.cuda.empty_cache()
    return 0


def profile(shape, dist, flops, methods) -> None:
    """Warm each method up outside the ranges, then call each once inside an NVTX range."""
    for fn in methods.values():
        fn()
        fn()
    torch.cuda.synchronize()
    for name, fn in methods.items():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.nvtx.range_push("prof")  # ncu --nvtx-include "prof/"
        start.record()
        fn()
        end.record()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end)
        print(f"{shape['name']:>14} {dist:>7} {name:>16}: {ms:8.3f} ms "
              f"{flops / ms / 1e9:7.1f} TFLOP/s (one call; ncu's figures are the profiled "
              "ones)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
