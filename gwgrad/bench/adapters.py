"""`python -m gwgrad.bench_adapters --json out.json`: the framework adapters on a GPU.

Three tables, each step guarded (an error or a missing framework is recorded, never fatal):

1. Kernel time per adapter vs the core, on one benchmark row (default dsv3-fc1, both token
   distributions; x.T as M-major A, dy as N-major B, BF16 output): the core's launch through
   the backend (the kernel alone), the torch and CuPy adapters (CUDA events, interleaved
   rounds, on torch's current stream, which CuPy shares), and the JAX adapter (wall clock
   over many jitted calls and ``block_until_ready``, against the core timed the same way).
   Each adapter should be within 5% of the core.
2. gwgrad through JAX vs ``jax.lax.ragged_dot_general`` in its weight-gradient form (the
   token axis ragged and contracted: (tokens, hidden) x (tokens, intermediate) ->
   (experts, hidden, intermediate)), same inputs, both jitted, wall clock; results compared.
3. Host overhead: the median time to enqueue one call on a small problem (batches of calls
   without a sync, so the GPU never stalls the host), per adapter and for the core.

Run it under ``timeout`` on the GPU host; every step also has its own SIGALRM deadline.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional

# JAX shares the GPU with torch and CuPy here: no 75% preallocation.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from .bench import DEFAULT_SHAPES, time_interleaved, token_counts  # noqa: E402


class StepTimeout(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: int):
    """Raise StepTimeout after ``seconds`` (when Python regains control)."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        raise StepTimeout(f"step exceeded {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def guarded(results: Dict, name: str, seconds: int, fn: Callable[[], object]):
    """Run one step; record its error instead of failing the whole benchmark."""
    try:
        with deadline(seconds):
            return fn()
    except Exception as exc:  # noqa: BLE001 - one failing step must not stop the others
        results["errors"].append({"step": name, "error": f"{type(exc).__name__}: {exc}",
                                  "trace": traceback.format_exc()[-2000:]})
        print(f"[{name}] failed: {type(exc).__name__}: {exc}", flush=True)
        return None


def _import(name: str):
    try:
        return __import__(name)
    except Exception:  # noqa: BLE001 - ImportError or a broken install
        return None


def wall_ms(fns: Dict[str, Callable[[], object]], sync: Dict[str, Callable[[object], None]],
            rounds: int = 7, sample_ms: float = 150.0) -> Dict[str, float]:
    """Median wall-clock milliseconds per call: n back-to-back calls, then one sync; the
    functions take turns every round (as bench.time_interleaved does with CUDA events)."""
    inner, slow = {}, set()
    for name, fn in fns.items():
        sync[name](fn())
        start = time.perf_counter()
        sync[name](fn())
        once = (time.perf_counter() - start) * 1e3
        inner[name] = max(1, min(500, int(sample_ms / max(once, 1e-3))))
        if once > 1000.0:  # seconds per call (ragged_dot_general's dense lowering): 3 samples
            slow.add(name)
    samples = {name: [] for name in fns}
    for round_ in range(rounds):
        for name, fn in fns.items():
            if name in slow and round_ >= 3:
                continue
            start = time.perf_counter()
            last = None
            for _ in range(inner[name]):
                last = fn()
            sync[name](last)
            samples[name].append((time.perf_counter() - start) * 1e3 / inner[name])
    return {name: statistics.median(v) for name, v in samples.items()}


# ----------------------------------------------------------------------------------------
# inputs shared by the frameworks (torch owns them; CuPy and JAX see them through DLPack)
# ----------------------------------------------------------------------------------------

class Problem:
    def __init__(self, hidden: int, intermediate: int, counts: List[int]):
        import torch

        self.hidden, self.intermediate, self.counts = hidden, intermediate, counts
        self.experts, self.tokens = len(counts), sum(counts)
        self.flops = 2.0 * hidden * intermediate * self.tokens
        torch.manual_seed(0)
        self.x = torch.randn(self.tokens, hidden, device="cuda", dtype=torch.bfloat16)
        self.dy = torch.randn(self.tokens, intermediate, device="cuda", dtype=torch.bfloat16)
        offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
        self.offsets = offsets.cuda()
        self.out = torch.empty(self.experts, hidden, intermediate, device="cuda",
                               dtype=torch.bfloat16)

    def core_launch(self):
        """The compiled operator the adapters use, launched through the backend directly:
        no API layer, no per-call checks (the kernel's own time)."""
        import torch

        import gwgrad
        from gwgrad.backends.base import LaunchArgs

        desc = gwgrad.as_tensor_desc
        a, b, off, w = (desc(self.x.t(), "a"), desc(self.dy, "b"), desc(self.offsets, "o"),
                        desc(self.out, "w"))
        op = gwgrad.api.operator_for(a, b, off, wgrad=w)
        self.workspace = torch.empty(max(op.workspace_bytes, 1), dtype=torch.uint8,
                                     device="cuda")
        args = LaunchArgs(a=a, b=b, offsets=off, tokens_sum=self.tokens, wgrad=w,
                          stream=torch.cuda.current_stream().cuda_stream,
                          workspace=self.workspace.data_ptr())
        backend, compiled, spec = op.backend, op._compiled, op.spec
        self.spec = spec
        return lambda: backend.launch(compiled, spec, args)

    def torch_call(self):
        import gwgrad.adapters.torch as gwt

        x, dy, offsets, out = self.x, self.dy, self.offsets, self.out
        return lambda: gwt.wgrad(x, dy, offsets, out=out)

    def cupy_call(self):
        import cupy
        import torch

        import gwgrad.adapters.cupy as gwc

        # bfloat16 bits as int16 CuPy arrays over the same memory.
        x = cupy.from_dlpack(self.x.view(torch.int16))
        dy = cupy.from_dlpack(self.dy.view(torch.int16))
        offsets = cupy.from_dlpack(self.offsets)
        out = cupy.from_dlpack(self.out.view(torch.int16))
        return lambda: gwc.wgrad(x, dy, offsets, out=out, dtype="bfloat16")

    def jax_arrays(self):
        import jax.numpy as jnp
        import jax.dlpack

        try:
            return tuple(jax.dlpack.from_dlpack(t) for t in (self.x, self.dy, self.offsets))
        except Exception:  # noqa: BLE001 - copy through the host if DLPack is refused
            return tuple(jnp.asarray(t.cpu().float().numpy()).astype(
                jnp.bfloat16 if t.dtype != self.offsets.dtype else jnp.int32)
                for t in (self.x, self.dy, self.offsets))


# ----------------------------------------------------------------------------------------
# the tables
# ----------------------------------------------------------------------------------------

def kernel_rows(results: Dict, shape: Dict, dist: str, frameworks: List[str], step_s: int):
    import torch

    counts = token_counts(shape["tokens_sum"], shape["num_experts"], dist, 256)
    p = Problem(shape["hidden"], shape["intermediate"], counts)
    row = {"name": shape["name"], "dist": dist, "hidden": p.hidden,
           "intermediate": p.intermediate, "num_experts": p.experts, "tokens_sum": p.tokens,
           "ms": {}, "tflops": {}, "ratio_vs_core": {}}
    results["kernel"].append(row)
    fns = {"core": guarded(results, f"{dist}: core", step_s, p.core_launch)}
    if fns["core"] is None:
        return
    row["tile"] = list(p.spec.mma_tiler_mn)
    if "torch" in frameworks:
        fns["torch"] = guarded(results, f"{dist}: torch adapter", step_s, p.torch_call)
    if "cupy" in frameworks and _import("cupy") is not None:
        fns["cupy"] = guarded(results, f"{dist}: cupy adapter", step_s, p.cupy_call)
    fns = {k: v for k, v in fns.items() if v is not None}
    for name, fn in list(fns.items()):  # compile / first call outside the timing
        if guarded(results, f"{dist}: {name} first call", step_s, lambda: (fn(), True)) is None:
            del fns[name]
    torch.cuda.synchronize()
    times = guarded(results, f"{dist}: events", step_s, lambda: time_interleaved(fns))
    if times:
        row["ms"].update(times)
    if "jax" in frameworks and _import("jax") is not None:
        guarded(results, f"{dist}: jax", step_s, lambda: _jax_kernel(p, fns["core"], row,
                                                                       results))
    for name, ms in row["ms"].items():
        row["tflops"][name] = p.flops / ms / 1e9
    core = row["ms"].get("core")
    for name, ms in row["ms"].items():
        base = row["ms"].get("core_wall") if name.startswith("jax") else core
        if base and name not in ("core", "core_wall", "jax_ragged_dot_general"):
            row["ratio_vs_core"][name] = ms / base
    if "jax" in row["ms"] and "jax_ragged_dot_general" in row["ms"]:
        row["ragged_dot_over_gwgrad"] = row["ms"]["jax_ragged_dot_general"] / row["ms"]["jax"]
    print(json.dumps(row), flush=True)
    p = None  # the row's inputs and outputs go before the next row's
    torch.cuda.empty_cache()


def _ragged_wgrad(x, dy, group_sizes):
    """``jax.lax.ragged_dot_general`` as a weight gradient: the token axis of both operands is
    contracted and ragged, so the result has one (hidden, intermediate) block per group."""
    import jax

    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])),
        lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    return jax.lax.ragged_dot_general(x, dy, group_sizes, dims)


def _jax_kernel(p: Problem, core: Callable, row: Dict, results: Dict):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    import gwgrad.adapters.jax as gwj

    x, dy, offsets = p.jax_arrays()
    sizes = jnp.asarray(np.asarray(p.counts, np.int32))
    gw = jax.jit(lambda x, dy, o: gwj.wgrad(x, dy, o))
    ragged = jax.jit(_ragged_wgrad)
    fns = {"jax": lambda: gw(x, dy, offsets),
           "jax_ragged_dot_general": lambda: ragged(x, dy, sizes),
           "core_wall": lambda: core()}
    block = lambda out: out.block_until_ready()  # noqa: E731
    sync = {"jax": block, "jax_ragged_dot_general": block,
            "core_wall": lambda _: torch.cuda.synchronize()}
    try:  # ragged_dot_general may be unsupported for this layout on this JAX
        ragged(x, dy, sizes).block_until_ready()
    except Exception as exc:  # noqa: BLE001
        results["errors"].append({"step": "ragged_dot_general",
                                  "error": f"{type(exc).__name__}: {exc}"})
        del fns["jax_ragged_dot_general"], sync["jax_ragged_dot_general"]
    row["ms"].update(wall_ms(fns, sync))
    if "jax_ragged_dot_general" in fns:  # same inputs: the results must agree
        a = np.asarray(gw(x, dy, offsets).astype(jnp.float32))
        b = np.asarray(ragged(x, dy, sizes).astype(jnp.float32))
        row["jax_vs_ragged_rel_err"] = float(np.linalg.norm(a - b) / np.linalg.norm(b))


def host_overhead(results: Dict, frameworks: List[str], calls: int, step_s: int):
    """Median host time to enqueue one call (small problem; batches without a sync)."""
    import torch

    import gwgrad

    p = Problem(128, 128, [128] * 8)
    over = results["overhead_us"]
    x, dy, offsets, out = p.x, p.dy, p.offsets, p.out

    def measure(name, fn, sync=torch.cuda.synchronize, batch=200):
        fn()
        sync()
        samples = []
        for _ in range(max(1, calls // batch)):
            start = time.perf_counter()
            for _ in range(batch):
                fn()
            samples.append((time.perf_counter() - start) / batch * 1e6)
            sync()
        over[name] = statistics.median(samples)
        print(f"host overhead {name:<24} {over[name]:8.2f} us", flush=True)

    guarded(results, "overhead: core backend launch", step_s,
            lambda: measure("core_backend_launch", p.core_launch()))
    guarded(results, "overhead: core wrapper", step_s, lambda: measure(
        "core_wrapper", lambda: gwgrad.grouped_gemm_wgrad(
            x.t(), dy, offsets_tensor=offsets, wgrad_tensor=out, validate_offsets=False)))
    if "torch" in frameworks:
        import gwgrad.adapters.torch as gwt

        guarded(results, "overhead: torch", step_s,
                lambda: measure("torch_wgrad_out", p.torch_call()))
        guarded(results, "overhead: torch alloc", step_s, lambda: measure(
            "torch_wgrad_alloc", lambda: gwt.wgrad(x, dy, offsets)))
        guarded(results, "overhead: torch op", step_s, lambda: measure(
            "torch_op_into", lambda: torch.ops.gwgrad.grouped_gemm_wgrad_into.default(
                x, dy, offsets, out, False)))
    if "cupy" in frameworks and _import("cupy") is not None:
        guarded(results, "overhead: cupy", step_s,
                lambda: measure("cupy_wgrad_out", p.cupy_call()))
    if "jax" in frameworks and _import("jax") is not None:
        def jax_overhead():
            import jax

            import gwgrad.adapters.jax as gwj

            jx, jdy, joff = p.jax_arrays()
            f = jax.jit(lambda x, dy, o: gwj.wgrad(x, dy, o))
            last = [f(jx, jdy, joff)]

            def call():  # keep the newest result: XLA runs in order, so it finishes last
                last[0] = f(jx, jdy, joff)

            measure("jax_jit_call", call, sync=lambda: last[0].block_until_ready())
        guarded(results, "overhead: jax", step_s, jax_overhead)


def format_tables(results: Dict) -> str:
    lines = []
    head = (f"{'row':<10} {'dist':<8} {'core':>8} {'torch':>8} {'cupy':>8} {'jax':>8} "
            f"{'core(w)':>8} {'ragged':>8}   (ms)   torch/core cupy/core jax/core(w) ragged/jax")
    lines += [head, "-" * len(head)]
    for r in results["kernel"]:
        ms, ratio = r["ms"], r["ratio_vs_core"]

        def f(k):
            return f"{ms[k]:8.3f}" if k in ms else f"{'-':>8}"

        def q(k):
            return f"{ratio[k]:.3f}" if k in ratio else "-"

        rag = r.get("ragged_dot_over_gwgrad")
        lines.append(f"{r['name']:<10} {r['dist']:<8} {f('core')} {f('torch')} {f('cupy')} "
                     f"{f('jax')} {f('core_wall')} {f('jax_ragged_dot_general')}        "
                     f"{q('torch'):>10} {q('cupy'):>9} {q('jax'):>11} "
                     f"{(f'{rag:.2f}' if rag else '-'):>10}")
    lines.append("(adapter/core: 1.00 = the core's kernel time; within 1.05 is the target. "
                 "ragged/jax > 1: gwgrad is faster than ragged_dot_general)")
    if results["overhead_us"]:
        lines.append("")
        lines.append("host overhead per call (median us, small problem, no sync):")
        for name, us in results["overhead_us"].items():
            lines.append(f"  {name:<24} {us:8.2f}")
    if results["errors"]:
        lines.append("")
        lines.append("errors: " + "; ".join(f"{e['step']}: {e['error'][:160]}"
                                            for e in results["errors"]))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gwgrad.bench_adapters",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="bench_adapters.json", help="where to write results")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--row", default="dsv3-fc1", help="shape name for the kernel table")
    parser.add_argument("--dist", default="uniform,zipf")
    parser.add_argument("--frameworks", default="torch,cupy,jax")
    parser.add_argument("--overhead-calls", type=int, default=4000)
    parser.add_argument("--step-timeout", type=int, default=240, help="seconds per step")
    parser.add_argument("--skip-kernel", action="store_true")
    parser.add_argument("--skip-overhead", action="store_true")
    args = parser.parse_args(argv)

    torch = _import("torch")
    if torch is None or not torch.cuda.is_available():
        print("no CUDA GPU (through torch): the adapter benchmark needs one", file=sys.stderr)
        return 2
    frameworks = [f for f in args.frameworks.split(",") if f]
    versions = {name: getattr(_import(name), "__version__", None)
                for name in ("torch", "cupy", "jax", "cutlass")}
    results = {"device": torch.cuda.get_device_name(), "versions": versions, "kernel": [],
               "overhead_us": {}, "errors": []}
    print(f"device: {results['device']}  versions: {versions}", flush=True)
    if not args.skip_kernel:
        with open(args.shapes) as f:
            shapes = {s["name"]: s for s in json.load(f)["shapes"]}
        shape = shapes[args.row]
        for dist in args.dist.split(","):
            guarded(results, f"kernel {dist}", args.step_timeout * 3,
                    lambda: kernel_rows(results, shape, dist, frameworks, args.step_timeout))
    if not args.skip_overhead:
        guarded(results, "overhead", args.step_timeout * 3,
                lambda: host_overhead(results, frameworks, args.overhead_calls,
                                      args.step_timeout))
    print(format_tables(results))
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
