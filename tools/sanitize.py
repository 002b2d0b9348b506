#!/usr/bin/env python
"""Run NVIDIA compute-sanitizer (memcheck, racecheck, synccheck; initcheck on request) over a
representative set of small gwgrad calls, and check every result against float64.

The cases (``--list`` prints them; building them needs no GPU):

* the SM90 BF16 kernel in each tile the backend can pick: cooperative 128x256, 256x128 and
  pingpong 128x192, 192x128, 128x128, 64x256, 64x128 (``mma_tiler_mn``: kernels/tiling.py's
  SM90_TILES picks the schedule);
* each mode once: dense / discrete, accumulate, fp32 / bf16 / fp16 outputs, tensor_ragged, each
  (a_major, b_major), the class API and the torch adapter, tiny dims, all-empty experts;
* the SM90 FP8 kernel for each recipe (per_expert_channel, block_1x128, MXFP8 blocked) in its
  modes and in each FP8 tile (cooperative 128x128 / 128x192, pingpong 64x128 / 64x192), and
  quantize -> FP8 GEMM through the torch adapter;
* each quantizer format (mxfp8 e4m3 / e5m2, mxfp4, nvfp4, per_expert_channel, block_1x128),
  bit for bit against the NumPy model;
* invalid offsets with ``validate_offsets=False`` (decreasing, not a multiple, past the end,
  scale tensors too small): the kernel must write nothing and ``gwgrad.check_errors()`` must
  raise naming ``offsets_tensor`` / ``sfa_tensor``.

Sizes are tiny (hidden / intermediate 8..264, 1..64 experts, < 1100 tokens). The persistent
kernels launch min(units, SMs) CTAs, so with tiny problems every CTA would run one work unit;
the sanitized children shrink the grid to ``--small-grid`` CTAs (2 by default; the grid is a
run-time argument of the compiled kernels and any value is valid) so that every CTA runs
several units: the shared-memory rings wrap, the pingpong warp groups alternate, the unit
ring and the epilogue buffers are reused. The baseline runs the natural grid (as does
tests/test_fuzz_gpu.py, on problems of up to 512 experts).

Design: ``python tools/sanitize.py`` (the parent, which never touches CUDA itself) first runs
every case WITHOUT the sanitizer in ``--jobs`` child processes: that compiles each kernel once
into a shared disk cache (``GWGRAD_CACHE_DIR``: a temporary directory, or ``--cache-dir``) and
checks every result (the "baseline" row). Then, for each tool, it runs
``compute-sanitizer --tool T --error-exitcode 1 --report-api-errors no [--racecheck-report
all] python tools/sanitize.py --child --cases <batch>`` over batches of cases (children in
parallel, ``--jobs``), which load the cached kernels without compiling. (CUDA API errors are
not counted by default: torch and the CUDA libraries probe calls whose failure they expect,
and a failing call of gwgrad's raises in Python and fails its case; ``--api-errors`` counts
them.) memcheck and initcheck children
run with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` so that every tensor is its own allocation (exact
bounds); guard bytes around every output catch writes that stay inside an allocation. The
parent parses "ERROR SUMMARY: N errors" (and racecheck's "RACECHECK SUMMARY: N hazards
displayed (E errors, W warnings)"), attributes findings to cases through the child's
BEGIN / END markers (best effort), requires every child to reach its DONE marker, prints a
table and writes ``--json PATH``: per tool, its cases, errors, failed checks, seconds, children.

    python tools/sanitize.py --list
    python tools/sanitize.py --json sanitize.json              # default tools, ~3-4 min (H200)
    python tools/sanitize.py --tools memcheck,initcheck --cases 'fp8_*' --timeout 300
    python tools/sanitize.py --child --cases bf16_pp_128x128 [--device cpu]   # one child

``--device cpu`` (children only, or the whole flow with a stand-in sanitizer) runs the cases
on CPU tensors, i.e. gwgrad's reference backend: a dry run of the harness that needs no GPU
(tests/test_fuzz_cases.py uses it).

Exit status: 0 when every tool reported 0 errors and every case passed its checks in every
run, 1 otherwise, 2 when compute-sanitizer was not found (the baseline still runs).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
for _path in (ROOT, TESTS):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import fuzz_cases as F  # noqa: E402

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
DEFAULT_TOOLS = ("memcheck", "racecheck", "synccheck")
MARK = "GWGRAD-SANITIZE"
SEED = 20250113
ALL = ("memcheck", "synccheck", "initcheck")  # every case; racecheck: the cases that say so
RACE = ALL + ("racecheck",)


@dataclass
class SanCase:
    name: str
    what: str
    tools: Tuple[str, ...]
    gemm: Optional[F.Case] = None
    quant: Optional[F.QuantCase] = None

    @property
    def kind(self) -> str:
        return "quantize" if self.quant is not None else self.gemm.spec.kind


def _gemm(name: str, what: str, counts: Sequence[int], *, tools=ALL, entry="wrapper",
          offsets: Optional[Sequence[int]] = None, invalid: Optional[str] = None,
          expect: Optional[str] = None, capacity: Optional[int] = None, **kw) -> SanCase:
    spec_kw = dict(index=0, kind="bf16", hidden=264, intermediate=200, experts=len(counts),
                   a_major="m", b_major="n", order="tensor2d", mode="dense",
                   out_dtype="bfloat16", accumulate=False, tiling=None)
    spec_kw.update(kw)
    if spec_kw["kind"] == "fp8":
        spec_kw["a_major"] = spec_kw["b_major"] = "k"
        spec_kw.setdefault("recipe", "per_expert_channel")
        spec_kw.setdefault("a_fmt", "e4m3")
        spec_kw.setdefault("b_fmt", "e4m3")
    spec = F.Spec(**spec_kw)
    if offsets is None:
        offsets = [int(x) for x in np.cumsum(counts)]
    draw = F.Draw(index=0, seed=F.derive_seed(SEED, name), dist="fixed",
                  counts=tuple(int(c) for c in counts), offsets=tuple(int(o) for o in offsets),
                  entry=entry, invalid=invalid, expect_error=expect, capacity=capacity,
                  extra_capacity=1)
    assert entry in spec.entries, (name, entry, spec.entries)
    return SanCase(name, what, tuple(tools), gemm=F.Case(spec, draw, SEED))


def _quant(name: str, what: str, fmt: str, elem: Optional[str], tools=RACE,
           channels: int = 136, counts: Sequence[int] = (0, 64, 32, 160)) -> SanCase:
    return SanCase(name, what, tuple(tools),
                   quant=F.QuantCase(name, fmt, elem, channels, tuple(counts),
                                     F.derive_seed(SEED, name)))


def cases() -> List[SanCase]:
    """The representative set (names are stable: ``--cases`` and the JSON use them)."""
    mn = [0, 100, 37, 300]  # M/N-major: any count; not multiples of 8 / 128, an empty expert
    kk = [0, 96, 40, 304]  # a K-major operand: multiples of 8
    f16 = [0, 80, 48, 272]  # FP8 FP32 recipes: multiples of 16, not of 128
    f32 = [0, 96, 32, 288]  # blocked scales: multiples of 32, not of 128
    out = []
    for tile, sched in (((128, 256), "coop"), ((256, 128), "coop"), ((128, 192), "pp"),
                        ((192, 128), "pp"), ((128, 128), "pp"), ((64, 256), "pp"),
                        ((64, 128), "pp")):
        race = RACE if tile in ((128, 256), (128, 128), (64, 128)) else ALL
        out.append(_gemm(f"bf16_{sched}_{tile[0]}x{tile[1]}",
                         f"SM90 BF16 {'cooperative' if sched == 'coop' else 'pingpong'} "
                         f"{tile[0]}x{tile[1]}, M/N-major, dense bf16", [0, 200, 520, 64],
                         tools=race, tiling=tile))
    out += [
        _gemm("bf16_kn_ragged_discrete_acc_fp32", "A K-major, tensor_ragged, discrete, "
              "accumulate into fp32", kk, a_major="k", order="tensor_ragged", mode="discrete",
              out_dtype="float32", accumulate=True, tools=RACE),
        _gemm("bf16_mk_ragged_dense_fp16", "B K-major, tensor_ragged, dense fp16", kk,
              b_major="k", order="tensor_ragged", out_dtype="float16"),
        _gemm("bf16_kk_discrete_bf16", "both K-major, tensor2d, discrete bf16", kk, a_major="k",
              b_major="k", mode="discrete"),
        _gemm("bf16_mn_dense_acc_fp16", "M/N-major, dense, accumulate into fp16", mn,
              out_dtype="float16", accumulate=True),
        _gemm("bf16_class_kk_ragged_acc_bf16", "the GroupedGemmWgrad class, both K-major "
              "tensor_ragged, accumulate into bf16", kk, a_major="k", b_major="k",
              order="tensor_ragged", accumulate=True, entry="class"),
        _gemm("bf16_adapter_discrete_fp32", "torch adapter wgrad(out=[...]) fp32", mn,
              mode="discrete", out_dtype="float32", entry="adapter"),
        _gemm("bf16_tiny_dims", "hidden = intermediate = 8", [3, 0, 9], hidden=8,
              intermediate=8, out_dtype="float32"),
        _gemm("bf16_all_empty", "every expert empty (tokens_sum = 0), discrete", [0, 0, 0],
              mode="discrete"),
        _gemm("bf16_many_experts", "64 experts of 0..20 tokens, 64x64", [(7 * i) % 21 for i in
              range(64)], hidden=64, intermediate=64, tools=RACE),
    ]
    fp8 = dict(kind="fp8", hidden=256, intermediate=208)
    out += [
        _gemm("fp8_pec_dense_bf16", "FP8 per_expert_channel e4m3/e5m2, dense bf16 "
              "(default tile 128x192, cooperative)", f16, b_fmt="e5m2", tools=RACE, **fp8),
        _gemm("fp8_pec_ragged_discrete_acc_fp32_global", "per_expert_channel, tensor_ragged, "
              "discrete, accumulate fp32, global scales", f16, order="tensor_ragged",
              mode="discrete", out_dtype="float32", accumulate=True, global_scales=True, **fp8),
        _gemm("fp8_1x128_dense_acc_fp16_global", "block_1x128, dense, accumulate fp16, global "
              "scales", f16, recipe="block_1x128", out_dtype="float16", accumulate=True,
              global_scales=True, **fp8),
        _gemm("fp8_1x128_ragged_discrete_fp32", "block_1x128 e5m2/e4m3, tensor_ragged, "
              "discrete fp32", f16, recipe="block_1x128", a_fmt="e5m2", order="tensor_ragged",
              mode="discrete", out_dtype="float32", tools=RACE, **fp8),
        _gemm("fp8_blocked_dense_bf16", "MXFP8 blocked e4m3 through the wrapper, dense bf16: "
              "two passes (dequantize, then the BF16 pingpong 128x128)", f32,
              recipe="blocked", tiling=(128, 128), tools=RACE, **fp8),
        _gemm("fp8_blocked_promote_128x128", "MXFP8 blocked e4m3 through the class API, dense "
              "bf16: the promoting kernel, cooperative 128x128", f32, recipe="blocked",
              tiling=(128, 128), entry="class", tools=RACE, **fp8),
        _gemm("fp8_blocked_ragged_discrete_acc_fp32_e5m2", "MXFP8 e5m2, tensor_ragged, discrete, "
              "accumulate fp32, global scales", f32, recipe="blocked", a_fmt="e5m2",
              b_fmt="e5m2", order="tensor_ragged", mode="discrete", out_dtype="float32",
              accumulate=True, global_scales=True, **fp8),
        _gemm("fp8_pec_tile_128x128", "per_expert_channel, cooperative 128x128", f16,
              tiling=(128, 128), **fp8),
        _gemm("fp8_1x128_tile_64x128", "block_1x128, pingpong 64x128", f16, recipe="block_1x128",
              tiling=(64, 128), tools=RACE, **fp8),
        _gemm("fp8_pec_tile_64x192", "per_expert_channel, pingpong 64x192", f16,
              tiling=(64, 192), **fp8),
        _gemm("fp8_blocked_tile_64x128", "MXFP8 through the class API: the promoting kernel, "
              "pingpong 64x128", f32, recipe="blocked", tiling=(64, 128), entry="class", **fp8),
        _gemm("fp8_adapter_quantize_1x128", "torch adapter quantize(x), quantize(dy) -> "
              "wgrad_fp8 block_1x128, dense fp32", f16, recipe="block_1x128",
              out_dtype="float32", source="quantize", entry="adapter", **fp8),
        _gemm("fp8_class_quantize_mxfp8", "gwgrad.quantize mxfp8 -> GroupedGemmWgrad class, "
              "dense bf16", f32, recipe="blocked", source="quantize", entry="class", **fp8),
    ]
    out += [
        _quant("quant_mxfp8_e4m3", "quantize mxfp8 e4m3", "mxfp8", "e4m3"),
        _quant("quant_mxfp8_e5m2", "quantize mxfp8 e5m2", "mxfp8", "e5m2", tools=ALL),
        _quant("quant_mxfp4", "quantize mxfp4 (packed e2m1)", "mxfp4", None, tools=ALL),
        _quant("quant_nvfp4", "quantize nvfp4 (e4m3 scales + global)", "nvfp4", None),
        _quant("quant_per_expert_channel", "quantize per_expert_channel e4m3",
               "per_expert_channel", "e4m3", tools=ALL),
        _quant("quant_block_1x128", "quantize block_1x128 e5m2", "block_1x128", "e5m2"),
    ]
    out += [
        _gemm("invalid_bf16_decreasing", "decreasing offsets, accumulate fp32: nothing written",
              mn, offsets=[0, 100, 80, 437], invalid="decreasing", expect="offsets_tensor",
              out_dtype="float32", accumulate=True),
        _gemm("invalid_bf16_multiple", "K-major A, a count not a multiple of 8", kk,
              offsets=[0, 100, 136, 440], invalid="multiple", expect="offsets_tensor",
              a_major="k", mode="discrete"),
        _gemm("invalid_fp8_pec_last", "per_expert_channel, last offset past tokens_sum", f16,
              offsets=[0, 80, 128, 416], invalid="last", expect="offsets_tensor", **fp8),
        _gemm("invalid_fp8_1x128_scales", "block_1x128 scale rows too few for the offsets",
              [16, 16, 96], invalid="scales", expect="sfa_tensor", capacity=1,
              recipe="block_1x128", accumulate=True, out_dtype="float32", **fp8),
        _gemm("invalid_fp8_blocked_scales", "MXFP8 scale columns too few for the offsets "
              "(the wrapper: two passes)", [32, 32, 64], invalid="scales", expect="sfa_tensor",
              capacity=4, recipe="blocked", **fp8),
        _gemm("invalid_fp8_blocked_scales_promote", "MXFP8 scale columns too few for the "
              "offsets (the class API: the promoting kernel)", [32, 32, 64], invalid="scales",
              expect="sfa_tensor", capacity=4, recipe="blocked", entry="class", **fp8),
        _gemm("invalid_fp8_blocked_multiple", "MXFP8, a count not a multiple of 32", f32,
              offsets=[0, 112, 128, 416], invalid="multiple", expect="offsets_tensor",
              recipe="blocked", mode="discrete", **fp8),
    ]
    return out


def select(all_cases: Sequence[SanCase], patterns: str) -> List[SanCase]:
    """Cases whose name matches one of the comma-separated names / fnmatch patterns."""
    if not patterns or patterns == "all":
        return list(all_cases)
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    return [c for c in all_cases if any(fnmatch.fnmatchcase(c.name, p) for p in pats)]


# --- the child: run cases, print markers ---------------------------------------------------------

def run_child(names: Sequence[str], device: str, small_grid: int) -> int:
    chosen = select(cases(), ",".join(names))
    if device != "cpu" and small_grid > 0:
        from gwgrad import grid

        # Persistent grids of `small_grid` CTAs (the grid size is a run-time argument of the
        # compiled kernels; any value is valid): every CTA then runs several work units.
        grid._sm_count = lambda device_id, _n=small_grid: _n
    failed = 0
    for c in chosen:
        print(f"{MARK} BEGIN {c.name}", flush=True)
        if c.quant is not None:
            rec = F.run_quantize_case(c.quant, device)
        else:
            rec = F.run_case(c.gemm, device)
        status = "ok" if rec["ok"] else "FAIL"
        failed += not rec["ok"]
        detail = "" if rec["ok"] else f" {rec.get('error')} (guard bytes {rec.get('guard_bytes')})"
        print(f"{MARK} END {c.name} {status} {rec['seconds']:.2f}s{detail}", flush=True)
        if rec.get("fatal"):
            break
    print(f"{MARK} DONE {len(chosen) - failed}/{len(chosen)}", flush=True)
    return 3 if failed else 0


# --- the parent --------------------------------------------------------------------------------

#: The first line of a compute-sanitizer report ("Invalid __global__ write of size 16 bytes",
#: "Error: Race reported between ...", "Barrier error detected", "Uninitialized __global__
#: memory read", "Program hit cudaErrorLaunchFailure", ...); summaries are not findings.
FINDING = re.compile(r"^=========\s+(Invalid|Error|Warning|Barrier|Uninitialized|Program hit|"
                     r"Race|Malloc|Out-of-range|Misaligned|Address|Cuda API|Hazard|"
                     r"Potential|Detected|Unsupported)")


def find_sanitizer(given: Optional[str]) -> Optional[str]:
    candidates = [given, os.environ.get("COMPUTE_SANITIZER_BIN"), shutil.which("compute-sanitizer")]
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home:
        candidates.append(os.path.join(cuda_home, "bin", "compute-sanitizer"))
    candidates.append("/usr/local/cuda/bin/compute-sanitizer")
    try:
        candidates += sorted((os.path.join("/usr/local", d, "bin", "compute-sanitizer")
                              for d in os.listdir("/usr/local") if d.startswith("cuda-")),
                             reverse=True)
    except OSError:
        pass
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def parse_output(text: str) -> Dict[str, object]:
    """ERROR SUMMARY / RACECHECK SUMMARY totals, per-case findings and results from a child's
    merged stdout + stderr."""
    errors = [int(x) for x in re.findall(r"ERROR SUMMARY:\s*(\d+) errors?", text)]
    races = [tuple(int(v) for v in m) for m in re.findall(
        r"RACECHECK SUMMARY:\s*(\d+) hazards? displayed\s*\((\d+) errors?,\s*(\d+) warnings?\)",
        text)]
    findings: Dict[str, int] = {}
    results: Dict[str, str] = {}
    current = "(before the first case)"
    done = False
    for line in text.splitlines():
        if line.startswith(f"{MARK} BEGIN "):
            current = line.split()[2]
        elif line.startswith(f"{MARK} END "):
            parts = line.split(" ", 3)
            results[parts[2]] = line.split(" ", 3)[3] if len(parts) > 3 else ""
            current = f"(after {parts[2]})"
        elif line.startswith(f"{MARK} DONE"):
            done = True
            current = "(after the last case)"
        elif FINDING.match(line) and "SUMMARY" not in line:
            findings[current] = findings.get(current, 0) + 1
    return {"error_summary": errors, "racecheck": races, "findings": findings,
            "results": results, "done": done}


def run_batch(tool: Optional[str], names: List[str], args, env: Dict[str, str],
              sanitizer: Optional[str]) -> Dict[str, object]:
    child = [sys.executable, os.path.abspath(__file__), "--child", "--cases", ",".join(names),
             "--small-grid", str(args.small_grid if tool is not None else 0),
             "--device", args.device]
    cmd = list(child)
    env = dict(env)
    if tool is not None:
        cmd = [sanitizer, "--tool", tool, "--error-exitcode", "1",
               "--target-processes", "application-only"]
        if not args.api_errors:
            # torch and the CUDA libraries probe APIs whose failures they expect; a failing
            # call of gwgrad's raises in Python and fails its case anyway.
            cmd += ["--report-api-errors", "no"]
        if tool == "racecheck":
            cmd += ["--racecheck-report", "all"]
        if args.kernel_filter:
            cmd += ["--kernel-name", f"kns={args.kernel_filter}"]
        cmd += child
        if tool in ("memcheck", "initcheck"):
            env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            cwd=ROOT, start_new_session=True, text=True, errors="replace")
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)  # the child's own process group (started here)
        out, _ = proc.communicate()
    seconds = time.time() - start
    parsed = parse_output(out)
    log_name = f"{tool or 'baseline'}-{abs(hash(tuple(names))) % 10**8}.log"
    if args.log_dir:
        with open(os.path.join(args.log_dir, log_name), "w") as f:
            f.write(" ".join(cmd) + "\n" + out)
    return {"tool": tool or "baseline", "cases": names, "rc": proc.returncode,
            "timed_out": timed_out, "seconds": round(seconds, 1), **parsed,
            "log": log_name if args.log_dir else None, "tail": out[-3000:]}


def summarize(tool: str, batches: List[dict], expected: List[str]) -> dict:
    errors = sum(sum(b["error_summary"]) for b in batches)
    hazards = sum(r[0] for b in batches for r in b["racecheck"])
    race_errors = sum(r[1] for b in batches for r in b["racecheck"])
    race_warnings = sum(r[2] for b in batches for r in b["racecheck"])
    results: Dict[str, str] = {}
    findings: Dict[str, int] = {}
    problems: List[str] = []
    for b in batches:
        results.update(b["results"])
        for k, v in b["findings"].items():
            findings[k] = findings.get(k, 0) + v
        if b["timed_out"]:
            problems.append(f"timeout after {b['seconds']} s: {','.join(b['cases'])}")
        elif not b["done"]:
            problems.append(f"child did not finish (rc {b['rc']}): {','.join(b['cases'])}")
        elif tool != "baseline" and not (b["error_summary"] or b["racecheck"]):
            problems.append(f"no ERROR SUMMARY / RACECHECK SUMMARY in the output (rc {b['rc']}): "
                            f"{','.join(b['cases'])}")
    failed = sorted(n for n, r in results.items() if not (r.startswith("ok") or
                                                           r.startswith("skip")))
    missing = sorted(set(expected) - set(results))
    clean = (errors == 0 and race_errors == 0 and not failed and not missing and not problems)
    # racecheck may count its hazards in ERROR SUMMARY too: the larger of the two, not the sum
    return {"cases": expected, "errors": max(errors, race_errors), "error_summary_total": errors,
            "racecheck_hazards": hazards, "racecheck_errors": race_errors,
            "racecheck_warnings": race_warnings, "failed_checks": failed,
            "not_reported": missing, "problems": problems,
            "findings_by_case": findings, "results": results, "clean": clean,
            "seconds": round(max((b["seconds"] for b in batches), default=0.0), 1),
            "cpu_seconds": round(sum(b["seconds"] for b in batches), 1),
            "children": [{k: v for k, v in b.items() if k != "results"} for b in batches]}


def batches_of(names: List[str], size: int) -> List[List[str]]:
    size = max(1, size)
    return [names[i:i + size] for i in range(0, len(names), size)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--cases", default="all", help="comma-separated names / fnmatch patterns")
    ap.add_argument("--tools", default=",".join(DEFAULT_TOOLS),
                    help=f"comma-separated, of {', '.join(TOOLS)} (default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=420, help="seconds per child process")
    ap.add_argument("--jobs", type=int, default=6, help="child processes at a time")
    ap.add_argument("--batch", type=int, default=14, help="cases per child (racecheck: half)")
    ap.add_argument("--api-errors", action="store_true",
                    help="count CUDA API errors too (compute-sanitizer's --report-api-errors "
                         "explicit; default: no)")
    ap.add_argument("--small-grid", type=int, default=2,
                    help="CTAs of the persistent GEMM grids under the sanitizer (0: one per SM)")
    ap.add_argument("--kernel-filter", default="",
                    help="check only kernels whose name contains this (e.g. 'gwgrad'); "
                         "default: every kernel, torch's included")
    ap.add_argument("--cache-dir", default="", help="GWGRAD_CACHE_DIR for every child "
                    "(default: a new temporary directory)")
    ap.add_argument("--sanitizer", default="", help="path of compute-sanitizer")
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--log-dir", default="", help="keep every child's full output here")
    ap.add_argument("--skip-baseline", action="store_true",
                    help="no run without the sanitizer first (the cache must be warm)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        return run_child([args.cases], args.device, args.small_grid)

    chosen = select(cases(), args.cases)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    bad = [t for t in tools if t not in TOOLS]
    if bad:
        ap.error(f"unknown tools {bad}; choose from {', '.join(TOOLS)}")
    if args.list:
        print(f"{'case':42} {'kind':8} {'tools':40} what")
        for c in chosen:
            in_tools = ",".join(t for t in TOOLS if t in c.tools)
            print(f"{c.name:42} {c.kind:8} {in_tools:40} {c.what}")
        print(f"{len(chosen)} cases; default tools {', '.join(DEFAULT_TOOLS)} "
              f"(racecheck: {sum('racecheck' in c.tools for c in chosen)} of them)")
        return 0
    if not chosen:
        ap.error(f"--cases {args.cases!r} matches no case (see --list)")

    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="gwgrad-sanitize-cache-")
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    env = dict(os.environ)
    env["GWGRAD_CACHE_DIR"] = cache_dir
    env["PYTHONPATH"] = os.pathsep.join([ROOT, TESTS] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    sanitizer = find_sanitizer(args.sanitizer or None)
    report: Dict[str, object] = {"cache_dir": cache_dir, "sanitizer": sanitizer,
                                 "cases": [c.name for c in chosen], "tools": {}}
    names = [c.name for c in chosen]
    lock = threading.Lock()
    t0 = time.time()

    def run_jobs(jobs: List[Tuple[Optional[str], List[str]]]) -> List[dict]:
        out: List[dict] = []
        with cf.ThreadPoolExecutor(max(1, args.jobs)) as ex:
            futures = [ex.submit(run_batch, tool, batch, args, env, sanitizer)
                       for tool, batch in jobs]
            for fut in cf.as_completed(futures):
                res = fut.result()
                with lock:
                    out.append(res)
                    print(f"  {res['tool']:10} {len(res['cases']):3} cases {res['seconds']:7.1f} s "
                          f"rc={res['rc']} errors={sum(res['error_summary'])}"
                          f"{' TIMEOUT' if res['timed_out'] else ''}", flush=True)
        return out

    rows = []
    if not args.skip_baseline:
        print(f"baseline (no sanitizer; compiles into {cache_dir}) ...", flush=True)
        per_job = -(-len(names) // max(1, args.jobs))
        base = summarize("baseline", run_jobs([(None, b) for b in batches_of(names, per_job)]),
                         names)
        report["baseline"] = base
        rows.append(("baseline", base))
    if sanitizer is None:
        print("compute-sanitizer not found (PATH, $COMPUTE_SANITIZER_BIN, $CUDA_HOME/bin, "
              "/usr/local/cuda*/bin; or --sanitizer PATH): only the baseline ran", flush=True)
    else:
        jobs = []
        for tool in tools:
            tool_names = [c.name for c in chosen if tool in c.tools]
            size = max(1, args.batch // 2) if tool == "racecheck" else args.batch
            jobs += [(tool, b) for b in batches_of(tool_names, size)]
        print(f"{sanitizer}: {', '.join(tools)} ({len(jobs)} children, {args.jobs} at a time) ...",
              flush=True)
        results = run_jobs(jobs)
        for tool in tools:
            tool_names = [c.name for c in chosen if tool in c.tools]
            summ = summarize(tool, [r for r in results if r["tool"] == tool], tool_names)
            report["tools"][tool] = summ
            rows.append((tool, summ))

    print()
    print(f"{'tool':10} {'cases':>5} {'errors':>6} {'hazards':>8} {'failed':>6} {'seconds':>8}  "
          "status")
    for tool, s in rows:
        hazards = (f"{s['racecheck_hazards']}/{s['racecheck_warnings']}w"
                   if tool == "racecheck" else "-")
        errs = "-" if tool == "baseline" else str(s["errors"])
        status = "clean" if s["clean"] else "NOT CLEAN"
        print(f"{tool:10} {len(s['cases']):5} {errs:>6} {hazards:>8} "
              f"{len(s['failed_checks']) + len(s['not_reported']):6} {s['seconds']:8.1f}  {status}")
        for p in s["problems"]:
            print(f"{'':12}{p}")
        for n in s["failed_checks"]:
            print(f"{'':12}{n}: {s['results'][n]}")
        for n in s["not_reported"]:
            print(f"{'':12}{n}: no result (crash or timeout)")
        for n, k in sorted(s["findings_by_case"].items()):
            print(f"{'':12}{k} sanitizer report lines during {n}")
    ok = all(s["clean"] for _, s in rows) and sanitizer is not None
    report["ok"] = ok
    report["seconds"] = round(time.time() - t0, 1)
    print(f"sanitize: {'clean' if ok else 'NOT clean'} in {report['seconds']:.0f} s"
          f"{'' if sanitizer else ' (no compute-sanitizer)'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if sanitizer is None:
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
