"""Steady-state time, SM clock and energy per call: on the H200 these GEMMs run at the 700 W
power limit, so a kernel's time follows its energy per call, and a
single cold call (ncu) does not rank tilings the way back-to-back calls at the limit do.

Per row, each method (gwgrad's default, the --tiles variants, dense cuBLAS of equal FLOPs)
runs back to back for --window seconds, the methods taking turns (round_order) for --reps
rounds, while ``nvidia-smi`` samples the GPU every --sample-ms: the energy counter, the
instantaneous power and the SM clock, where the driver reports them (some drivers take only
``power.draw``, which recent drivers average over about a second: a window's W then
lags by up to that; ms, from CUDA events, does not). A window's figures come from the samples inside it
after its first --settle seconds (the clock and power settling at the limit):

    ms       median milliseconds per call over the window's CUDA-event samples
    W        mean power: the energy counter's increase over the samples' span (else the
             mean of the power samples)
    MHz      mean SM clock over the samples
    J/call   W x ms / 1000           Mcyc     ms x MHz / 1000 (clock cycles per call)
    pJ/FLOP  J/call / the row's FLOPs

    python tools/energy_bench.py --rows dsv3-fc1 --dist uniform \\
        --tiles 128x128:cluster=1x2,128x256:cluster=2x1 --json $OUT/energy.json
    bash tools/gpu_run.sh energy     (GWGRAD_ENERGY_ROWS / _DISTS / _TILES)

--mix times each method followed by the row's dense GEMM, the two as one step: a mix where
another GEMM shares the power budget, as in a training step (is a method's energy or its
cycles what costs time there?). --copy adds a device copy of the row's output bytes: its J per byte moved prices the grouped
GEMM's output writes (E outputs against dense cuBLAS's one). Printed per row and method: the medians over the reps of each column, and each as a ratio to
gwgrad's default. Needs a GPU and nvidia-smi.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

#: nvidia-smi fields, best first; the first set this driver accepts is sampled.
FIELD_SETS = (
    ("timestamp", "total_energy_consumption", "power.draw.instant", "clocks.sm"),
    ("timestamp", "total_energy_consumption", "power.draw", "clocks.sm"),
    ("timestamp", "power.draw", "clocks.sm"),
)


def parse_samples(text: str, fields: Sequence[str]) -> List[Dict[str, float]]:
    """nvidia-smi ``--format=csv,noheader,nounits`` lines -> [{"t": epoch s, "energy_j",
    "power_w", "mhz"}] (a field nvidia-smi reports as "[N/A]" or that is unparsable is left
    out of that sample; lines without a timestamp are dropped)."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(fields):
            continue
        sample = {}
        for field, value in zip(fields, parts):
            try:
                if field == "timestamp":
                    sample["t"] = datetime.strptime(value, "%Y/%m/%d %H:%M:%S.%f").timestamp()
                elif field == "total_energy_consumption":  # mJ
                    sample["energy_j"] = float(value) / 1000.0
                elif field.startswith("power.draw"):
                    sample["power_w"] = float(value)
                elif field == "clocks.sm":
                    sample["mhz"] = float(value)
            except ValueError:
                pass
        if "t" in sample:
            out.append(sample)
    return out


def window_stats(samples: List[Dict[str, float]], start: float, end: float) -> Dict:
    """Mean power (W: from the energy counter when two samples in [start, end] have it, else
    the power samples' mean), mean SM clock (MHz) and the sample count in [start, end]."""
    inside = [s for s in samples if start <= s["t"] <= end]
    stats = {"samples": len(inside), "W": None, "MHz": None, "power_from": None}
    energy = [s for s in inside if "energy_j" in s]
    if len(energy) >= 2 and energy[-1]["t"] > energy[0]["t"]:
        stats["W"] = (energy[-1]["energy_j"] - energy[0]["energy_j"]) / (
            energy[-1]["t"] - energy[0]["t"])
        stats["power_from"] = "energy counter"
    else:
        power = [s["power_w"] for s in inside if "power_w" in s]
        if power:
            stats["W"] = statistics.fmean(power)
            stats["power_from"] = "power samples"
    clocks = [s["mhz"] for s in inside if "mhz" in s]
    if clocks:
        stats["MHz"] = statistics.fmean(clocks)
    return stats


def derive(ms: float, stats: Dict, flops: float) -> Dict:
    """A window's per-call figures: J/call, Mcyc and pJ/FLOP (None where a figure is missing)."""
    row = {"ms": ms, "W": stats["W"], "MHz": stats["MHz"], "J": None, "Mcyc": None,
           "pJ_per_flop": None}
    if stats["W"] is not None:
        row["J"] = stats["W"] * ms / 1000.0
        row["pJ_per_flop"] = row["J"] / flops * 1e12
    if stats["MHz"] is not None:
        row["Mcyc"] = ms * stats["MHz"] / 1000.0
    return row


def medians(windows: List[Dict]) -> Dict:
    keys = ("ms", "W", "MHz", "J", "Mcyc", "pJ_per_flop")
    out = {}
    for k in keys:
        vals = [w[k] for w in windows if w.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    return out


class Sampler:
    """nvidia-smi sampling into a file from start() to stop()."""

    def __init__(self, sample_ms: int, gpu: int):
        self.sample_ms, self.gpu = sample_ms, gpu
        self.fields = None
        for fields in FIELD_SETS:
            probe = subprocess.run(["nvidia-smi", "-i", str(gpu), "--query-gpu=" + ",".join(fields),
                                    "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True, timeout=30)
            if probe.returncode == 0 and parse_samples(probe.stdout, fields):
                self.fields = fields
                break
        if self.fields is None:
            raise RuntimeError("nvidia-smi accepts none of the field sets " + repr(FIELD_SETS))
        self.log = None
        self.proc = None

    def start(self):
        """Start sampling into a new file (each start() has its own: stop() deletes it)."""
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
        self.proc = subprocess.Popen(
            ["nvidia-smi", "-i", str(self.gpu), "--query-gpu=" + ",".join(self.fields),
             "--format=csv,noheader,nounits", "-lms", str(self.sample_ms)],
            stdout=self.log, stderr=subprocess.DEVNULL)

    def stop(self) -> List[Dict[str, float]]:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.flush()
        with open(self.log.name) as f:
            text = f.read()
        os.unlink(self.log.name)
        return parse_samples(text, self.fields)


def run_window(fn, seconds: float, sample_ms: float = 12.0):
    """Back-to-back calls of ``fn`` for ~``seconds``: (wall start, wall end, median ms per
    call over CUDA-event samples of ~sample_ms each)."""
    import torch

    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    inner = max(1, min(200, int(sample_ms / max(s.elapsed_time(e), 1e-3))))
    per_sample = max(s.elapsed_time(e), 1e-3) * inner / 1000.0
    n = max(3, int(seconds / per_sample))
    events = []
    start = time.time()
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(inner):
            fn()
        e.record()
        events.append((s, e))
    torch.cuda.synchronize()
    end = time.time()
    return start, end, statistics.median(s.elapsed_time(e) / inner for s, e in events)


def mixed(fn, other):
    """``fn`` then ``other``: one step of --mix."""
    def step():
        fn()
        other()

    return step


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line (no GPU needed): --settle must be shorter than --window."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="dsv3-fc1,gptoss-fc1")
    p.add_argument("--dist", default="uniform")
    p.add_argument("--tiles", default="", help="gwgrad variants (the bench's --tiles syntax)")
    p.add_argument("--no-dense", action="store_true", help="leave dense cuBLAS out")
    p.add_argument("--copy", action="store_true",
                   help="also a device copy of the row's BF16 output bytes (J per HBM byte moved,"
                        " read + write, in the summary)")
    p.add_argument("--mix", action="store_true",
                   help="each call followed by the row's dense cuBLAS GEMM: the figures are per "
                        "(method + dense) step, as in a training step where other GEMMs share "
                        "the power budget (dense_cublas: two dense GEMMs)")
    p.add_argument("--accumulate", action="store_true",
                   help="the main-grad path: gwgrad's methods add into FP32 outputs "
                        "(accumulate_on_output=True); dense cuBLAS stays the BF16 GEMM of equal "
                        "FLOPs")
    p.add_argument("--window", type=float, default=2.0, help="seconds per method and rep")
    p.add_argument("--settle", type=float, default=0.5,
                   help="seconds at a window's start left out of its samples")
    p.add_argument("--warmup", type=float, default=3.0,
                   help="seconds of the methods in turn before the first window (unmeasured: "
                        "a GPU just out of idle runs its first window below the power limit)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--sample-ms", type=int, default=50, help="nvidia-smi sampling period")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.settle >= args.window:
        p.error(f"--settle: expected less than --window ({args.window}), got {args.settle}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    import torch

    from benchmarks.wgrad import (DEFAULT_SHAPES, CopyBuffers, RowInputs, build_methods,
                                  new_row, parse_tile, round_order, select_shapes)

    args = parse_args(argv)
    configs = [parse_tile(t) for t in args.tiles.split(",") if t]
    sampler = Sampler(args.sample_ms, torch.cuda.current_device())
    print(f"nvidia-smi fields: {', '.join(sampler.fields)}", flush=True)
    results = []
    for shape in select_shapes(DEFAULT_SHAPES, args.rows):
        for dist in args.dist.split(","):
            row = new_row(shape, dist)
            inp = RowInputs(shape, dist, 256, accumulate=args.accumulate)
            fns, _ = build_methods(inp, configs, row, gwgrad_only=True)
            if args.mix:  # each call followed by the row's dense GEMM (a training step's mix)
                dense = inp.dense()
                fns = {name: mixed(fn, dense) for name, fn in fns.items()}
                if not args.no_dense:
                    fns["dense_cublas"] = mixed(dense, dense)
            elif not args.no_dense:
                fns["dense_cublas"] = inp.dense()
            copy = None
            if args.copy:  # the output's bytes read and written: J per HBM byte
                copy = CopyBuffers(inp.num_experts * inp.hidden * inp.intermediate * 2)
                fns["copy"] = copy
            for fn in fns.values():  # compiles, cuBLAS heuristics
                fn()
            torch.cuda.synchronize()
            names = list(fns)
            marks = {n: [] for n in names}
            sampler.start()
            for name in names:  # to the power limit before the first measured window
                run_window(fns[name], args.warmup / len(names))
            for r in range(args.reps):
                for name in round_order(names, r):
                    start, end, ms = run_window(fns[name], args.window)
                    marks[name].append((start + args.settle, end, ms))
            time.sleep(0.3)
            samples = sampler.stop()
            out = {"name": shape["name"], "dist": dist, "mix": args.mix,
                   "accumulate": args.accumulate,
                   "flops": inp.flops * (2 if args.mix else 1), "methods": {},
                   "copy_bytes": 2 * copy.nbytes if copy is not None else 0}
            for name in names:
                windows = [dict(derive(ms, window_stats(samples, a, b), out["flops"]),
                                samples=window_stats(samples, a, b)["samples"])
                           for a, b, ms in marks[name]]
                out["methods"][name] = {"windows": windows, "median": medians(windows)}
            for name, err in row["methods"].items():
                out["methods"].setdefault(name, err)
            results.append(out)
            print_row(out)
            del fns, inp, copy
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "fields": sampler.fields, "rows": results}, f,
                      indent=1)
    return 0


def print_row(out: Dict) -> None:
    base = next((m["median"] for n, m in out["methods"].items()
                 if n.startswith("gwgrad_") and "median" in m), None)
    mode = ", accumulating into FP32" if out.get("accumulate") else ""
    print(f"\n{out['name']} {out['dist']}{mode}: {out['flops'] / 1e12:.2f} TFLOP per call")
    cols = ("ms", "W", "MHz", "J", "Mcyc", "pJ_per_flop")
    print(f"{'method':46}" + "".join(f"{c:>10}" for c in cols)
          + "   x default: ms, J, Mcyc, MHz")
    copy = out["methods"].get("copy", {}).get("median")
    if copy and copy["J"] and out.get("copy_bytes"):
        print(f"copy: {copy['J'] / out['copy_bytes'] * 1e12:.1f} pJ per HBM byte moved "
              f"(read + write; idle power included)")
    for name, m in out["methods"].items():
        if "median" not in m:
            print(f"{name:46} {m}")
            continue
        med = m["median"]
        vals = "".join(f"{med[c]:10.3f}" if med[c] is not None else f"{'-':>10}" for c in cols)
        ratio = " ".join(f"{med[c] / base[c]:.3f}" if med[c] and base and base[c] else "-"
                         for c in ("ms", "J", "Mcyc", "MHz"))
        print(f"{name[:46]:46}{vals}   {ratio}")


if __name__ == "__main__":
    sys.exit(main())
