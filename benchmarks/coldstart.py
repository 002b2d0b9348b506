"""`python -m benchmarks.coldstart --json out.json`: how long a new process waits for its
first gwgrad result.

Each measurement is a child process (``sys.executable -c <script>``) that first imports torch
and puts a small problem on the GPU (not counted: a training process has both already), then
times ``import gwgrad`` + ``import gwgrad.adapters.torch`` and the first
``wgrad(x, dy, offsets)`` up to ``torch.cuda.synchronize()``. The first child gets an empty
cache directory (``GWGRAD_CACHE_DIR``, and an empty one for the CuTe DSL's own cache,
``CUTE_DSL_CACHE_DIR``):
the cold figure, compilation included. The next children reuse that directory: the warm figure
(gwgrad's disk cache of compiled kernels; target <= 0.5 s). Each child also reports whether
``cutlass`` (the CuTe DSL, slow to import) was imported, the time of a second call, the
in-process compile count and its result's error against a torch reference.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

#: The marker before the child's one JSON line on stdout.
MARKER = "GWGRAD_COLDSTART_RESULT "
WARM_TARGET_S = 0.5
DEFAULT_PROBLEM = {"hidden": 256, "intermediate": 256, "num_experts": 8, "tokens_sum": 2048}

_CHILD = r'''
import json, os, sys, time
t_start = time.perf_counter()
import torch
device = DEVICE
hidden, intermediate, experts, tokens = HIDDEN, INTERMEDIATE, EXPERTS, TOKENS

def sync():
    if device == "cuda":
        torch.cuda.synchronize()

gen = torch.Generator(device=device)
gen.manual_seed(0)
x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device, generator=gen)
dy = torch.randn(tokens, intermediate, dtype=torch.bfloat16, device=device, generator=gen)
counts = [tokens // experts] * experts
counts[-1] += tokens - sum(counts)
offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(device)
sync()
t0 = time.perf_counter()  # the user's process: torch imported, data on the device
import gwgrad
import gwgrad.adapters.torch as gwt
t1 = time.perf_counter()
cutlass_after_import = "cutlass" in sys.modules
w = gwt.wgrad(x, dy, offsets)
sync()
t2 = time.perf_counter()
gwt.wgrad(x, dy, offsets, out=w)
sync()
t3 = time.perf_counter()
info = {
    "torch_setup_s": t0 - t_start,
    "import_s": t1 - t0,
    "first_call_s": t2 - t1,
    "total_s": t2 - t0,
    "second_call_s": t3 - t2,
    "cutlass_after_import": cutlass_after_import,
    "cutlass_imported": "cutlass" in sys.modules,
    "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
    "cache_dir_env": os.environ.get("GWGRAD_CACHE_DIR"),
}
try:
    info["cache_info"] = gwgrad.cache_info()
except Exception as exc:
    info["cache_info"] = repr(exc)
dsl = sys.modules.get("gwgrad.kernels.compiler")
info["compiled_in_process"] = getattr(dsl, "compile_count", None)
try:
    from gwgrad import kernel_cache
    info["kernel_cache_dir"] = str(kernel_cache.cache_dir())
    stats = getattr(kernel_cache, "stats", None)
    if callable(stats):
        info["kernel_cache_stats"] = stats()
except Exception as exc:
    info["kernel_cache_error"] = repr(exc)
ref, start = torch.empty_like(w, dtype=torch.float32), 0
for e, c in enumerate(counts):
    ref[e] = x[start:start + c].float().T @ dy[start:start + c].float()
    start += c
info["rel_err"] = ((w.float() - ref).norm() / ref.norm()).item()
print(MARKER + json.dumps(info), flush=True)
'''


def child_script(problem: Optional[Dict] = None, device: str = "cuda") -> str:
    """The child's Python source for ``sys.executable -c``."""
    p = {**DEFAULT_PROBLEM, **(problem or {})}
    for key in ("hidden", "intermediate", "num_experts", "tokens_sum"):
        if not isinstance(p[key], int) or p[key] <= 0:
            raise ValueError(f"{key}: expected a positive int, got {p[key]!r}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device: expected 'cuda' or 'cpu', got {device!r}")
    header = (f"DEVICE = {device!r}\nHIDDEN, INTERMEDIATE, EXPERTS, TOKENS = {p['hidden']}, "
              f"{p['intermediate']}, {p['num_experts']}, {p['tokens_sum']}\n"
              f"MARKER = {MARKER!r}\n")
    return header + _CHILD


def child_env(cache_dir: str, dsl_cache_dir: Optional[str] = None,
              base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The child's environment: ``GWGRAD_CACHE_DIR=cache_dir``, ``CUTE_DSL_CACHE_DIR`` when
    given, and this checkout's gwgrad first on the import path."""
    env = dict(os.environ if base is None else base)
    env["GWGRAD_CACHE_DIR"] = cache_dir
    if dsl_cache_dir:
        env["CUTE_DSL_CACHE_DIR"] = dsl_cache_dir
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([root] + paths)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def parse_child_output(stdout: str) -> Optional[Dict]:
    """The child's result (the last marked line), or None."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    return None


def _files_under(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def run_child(script: str, env: Dict[str, str], timeout: float) -> Dict:
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {"error": f"timed out after {timeout:.0f} s", "stdout_tail": out[-1500:],
                "process_s": time.perf_counter() - start}
    info = parse_child_output(proc.stdout)
    if info is None:
        info = {"error": f"child exited with {proc.returncode} and no result",
                "stderr_tail": (proc.stderr or "")[-3000:], "stdout_tail": proc.stdout[-1000:]}
    info["returncode"] = proc.returncode
    info["process_s"] = time.perf_counter() - start
    return info


def summarize(cold: Dict, warm: List[Dict]) -> Dict:
    ok_warm = [w["total_s"] for w in warm if "total_s" in w]
    warm_s = statistics.median(ok_warm) if ok_warm else None
    out = {"cold_s": cold.get("total_s"), "warm_s": warm_s, "warm_all_s": ok_warm,
           "warm_min_s": min(ok_warm) if ok_warm else None,
           "warm_target_s": WARM_TARGET_S,
           "warm_target_met": warm_s is not None and warm_s <= WARM_TARGET_S,
           "cutlass_imported_warm": warm[-1].get("cutlass_imported") if warm else None,
           "errors": [r["error"] for r in [cold, *warm] if "error" in r]}
    errs = [r.get("rel_err") for r in [cold, *warm] if r.get("rel_err") is not None]
    out["max_rel_err"] = max(errs) if errs else None
    out["results_ok"] = bool(errs) and max(errs) < 1e-2
    return out


def format_report(report: Dict) -> str:
    lines = [f"{'run':<6} {'total s':>8} {'import s':>8} {'1st call':>8} {'2nd call':>8} "
             f"{'cutlass':>8} {'compiles':>8} {'disk hits':>9} {'cache files':>11}"]

    def f(v, spec="8.3f"):
        return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else f"{'-':>8}"

    runs = [("cold", report["cold"])] + [(f"warm{i + 1}", w) for i, w in enumerate(report["warm"])]
    for name, r in runs:
        lines.append(f"{name:<6} {f(r.get('total_s'))} {f(r.get('import_s'))} "
                     f"{f(r.get('first_call_s'))} {f(r.get('second_call_s'), '8.4f')} "
                     f"{str(r.get('cutlass_imported', '-')):>8} "
                     f"{str(r.get('compiled_in_process', '-')):>8} "
                     f"{str((r.get('kernel_cache_stats') or {}).get('disk_hits', '-')):>9} "
                     f"{str(r.get('cache_files_after', '-')):>11}"
                     + (f"  ERROR {r['error']}" if "error" in r else ""))
    s = report["summary"]
    warm = s.get("warm_s")
    lines.append(f"cold start {f(s.get('cold_s'), '.2f')} s; warm {f(warm, '.3f')} s "
                 f"(target <= {WARM_TARGET_S} s: {'met' if s['warm_target_met'] else 'NOT met'}); "
                 f"cutlass imported in the warm child: {s.get('cutlass_imported_warm')}; "
                 f"results {'ok' if s['results_ok'] else 'NOT ok'}")
    for r in [report["cold"], *report["warm"]]:
        if "stderr_tail" in r:
            lines.append("child stderr (tail):\n" + r["stderr_tail"][-1500:])
            break
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.coldstart",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="coldstart.json")
    ap.add_argument("--warm-runs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per child")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: the reference backend (a check of this script, no GPU needed)")
    ap.add_argument("--cache-dir", default="",
                    help="cache directory to use (default: a fresh temporary one, removed after)")
    ap.add_argument("--no-isolate-dsl-cache", action="store_true",
                    help="leave CUTE_DSL_CACHE_DIR as it is")
    ap.add_argument("--hidden", type=int, default=DEFAULT_PROBLEM["hidden"])
    ap.add_argument("--intermediate", type=int, default=DEFAULT_PROBLEM["intermediate"])
    ap.add_argument("--experts", type=int, default=DEFAULT_PROBLEM["num_experts"])
    ap.add_argument("--tokens", type=int, default=DEFAULT_PROBLEM["tokens_sum"])
    args = ap.parse_args(argv)

    if args.device == "cuda":
        from gwgrad import cuda

        if not cuda.available():
            print("no CUDA GPU: the cold-start measurement needs one (--device cpu checks this "
                  "script on the reference backend)", file=sys.stderr)
            return 2
    problem = {"hidden": args.hidden, "intermediate": args.intermediate,
               "num_experts": args.experts, "tokens_sum": args.tokens}
    script = child_script(problem, args.device)
    scratch = "" if args.cache_dir else tempfile.mkdtemp(prefix="gwgrad-coldstart-")
    cache_dir = args.cache_dir or os.path.join(scratch, "gwgrad")
    os.makedirs(cache_dir, exist_ok=True)
    if _files_under(cache_dir):
        print(f"note: {cache_dir} is not empty: the first run is not cold", flush=True)
    dsl_dir = None  # a given cache dir: the DSL's own cache stays where the environment says
    if scratch and not args.no_isolate_dsl_cache:
        dsl_dir = os.path.join(scratch, "cute_dsl")
    env = child_env(cache_dir, dsl_dir)
    report = {"problem": problem, "device": args.device, "cache_dir": cache_dir,
              "python": sys.executable, "warm_target_s": WARM_TARGET_S,
              "cute_dsl_cache_dir": env.get("CUTE_DSL_CACHE_DIR"), "warm": []}
    try:
        for i in range(1 + max(0, args.warm_runs)):
            name = "cold" if i == 0 else f"warm{i}"
            result = run_child(script, env, args.timeout)
            result["cache_files_after"] = _files_under(cache_dir)
            if i == 0:
                report["cold"] = result
            else:
                report["warm"].append(result)
            total = result.get("total_s")
            print(f"{name}: " + (f"{total:.3f} s (import {result['import_s']:.3f} s, first call "
                                 f"{result['first_call_s']:.3f} s), cutlass imported: "
                                 f"{result['cutlass_imported']}" if total is not None
                                 else f"ERROR {result.get('error')}"), flush=True)
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    report["summary"] = summarize(report["cold"], report["warm"])
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0 if "total_s" in report["cold"] else 1


if __name__ == "__main__":
    sys.exit(main())
