"""`python -m benchmarks.adapters --json out.json`: the framework adapters on a GPU.

Three tables, each step guarded (an error or a missing framework is recorded, never fatal):

1. Kernel time per adapter vs the core, on one benchmark row (default dsv3-fc1, both token
   distributions; x.T as M-major A, dy as N-major B, BF16 output): the core's launch plan
   (``plan.launch``: the kernel alone), the torch and CuPy adapters (CUDA events, interleaved
   rounds, on torch's current stream, which CuPy shares), and the JAX adapter (wall clock
   over many jitted calls and ``block_until_ready``, against the core timed the same way).
   Each adapter should be within 5% of the core.
2. gwgrad through JAX vs ``jax.lax.ragged_dot_general`` in its weight-gradient form (the
   token axis ragged and contracted: (tokens, hidden) x (tokens, intermediate) ->
   (experts, hidden, intermediate)), same inputs, both jitted, wall clock; results compared.
3. Host overhead per cached call (``--skip-kernel`` runs only this; well under 2 minutes):
   8 experts, hidden = intermediate = 256, 2048 tokens; wall clock over batches of ~2000
   calls with no synchronization inside a batch, the entries taking turns batch by batch,
   median over the batches. The contract's
   wrapper (default arguments, ``wgrad_tensor`` given, a different offsets tensor every
   call, as a training step makes one per step; also with the same one), the class's
   ``execute``, the torch adapter (``out=`` and allocating), the ``torch.ops.gwgrad`` op,
   the CuPy adapter, the jitted JAX call (``block_until_ready`` only after a batch) and the
   raw ``plan.launch`` for reference; targets: wrapper <= 20 us, adapters <= 15 us. The
   kernel's own GPU time (launches replayed from a CUDA graph) says when a figure is
   bounded by the GPU instead.

Run it under ``timeout`` on the GPU host; every step also has its own SIGALRM deadline.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
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

from .wgrad import (DEFAULT_SHAPES, OFFSETS_POOL, KernelRunner, time_interleaved,  # noqa: E402
                token_counts)


class StepTimeout(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: int):
    """Raise StepTimeout after ``seconds`` (when Python regains control). Nested deadlines
    keep the outer one: the inner gets at most what is left of it, and the outer is re-armed
    with what remains when the inner ends."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        raise StepTimeout(f"step exceeded {seconds} s")

    start = time.monotonic()
    outer = signal.alarm(0)  # seconds left on an enclosing deadline (0: none)
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(max(1, min(seconds, outer) if outer else seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        if outer:  # the enclosing step's deadline goes on (fires at once if it has passed)
            signal.alarm(max(1, int(round(outer - (time.monotonic() - start)))))


def record_error(results: Dict, name: str, exc: BaseException) -> None:
    """A failed step's error (with the trace being handled), recorded and printed."""
    results["errors"].append({"step": name, "error": f"{type(exc).__name__}: {exc}",
                              "trace": traceback.format_exc()[-2000:]})
    print(f"[{name}] failed: {type(exc).__name__}: {exc}", flush=True)


def guarded(results: Dict, name: str, seconds: int, fn: Callable[[], object]):
    """Run one step; record its error instead of failing the whole benchmark."""
    try:
        with deadline(seconds):
            return fn()
    except Exception as exc:  # noqa: BLE001 - one failing step must not stop the others
        record_error(results, name, exc)
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
    """x (tokens, hidden), dy (tokens, intermediate), offsets (and a pool of distinct copies),
    one output; on the GPU (``device="cpu"``: the reference backend, for checks of this file)."""

    def __init__(self, hidden: int, intermediate: int, counts: List[int], device: str = "cuda"):
        import torch

        self.hidden, self.intermediate, self.counts = hidden, intermediate, counts
        self.experts, self.tokens = len(counts), sum(counts)
        self.flops = 2.0 * hidden * intermediate * self.tokens
        self.device = device
        torch.manual_seed(0)
        self.x = torch.randn(self.tokens, hidden, dtype=torch.bfloat16).to(device)
        self.dy = torch.randn(self.tokens, intermediate, dtype=torch.bfloat16).to(device)
        offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
        self.offsets = offsets.to(device)
        # Distinct tensors holding the same offsets: a training step makes a new one each step.
        self.offsets_pool = [self.offsets.clone() for _ in range(OFFSETS_POOL)]
        self.out = torch.empty(self.experts, hidden, intermediate, device=device,
                               dtype=torch.bfloat16)

    def fresh_offsets(self) -> Callable[[], object]:
        """``next()`` over the offsets pool, round-robin: a different tensor every call."""
        return itertools.cycle(self.offsets_pool).__next__

    def core_launch(self, launches: int = 0):
        """The compiled operator the adapters use, through its launch plan (``plan_for`` once,
        then ``plan.launch`` of fixed addresses with a preallocated workspace on torch's
        current stream): no API layer, no per-call checks (the kernel's own time).
        ``launches``: the spec's kernel launches per call (0: the default)."""
        runner = KernelRunner(self.x.t(), self.dy, self.offsets, self.out,
                              tuning=(("launches", launches),) if launches else ())
        self.spec = runner.spec
        return runner

    def torch_call(self, fresh: bool = False):
        import gwgrad.adapters.torch as gwt

        x, dy, offsets, out, wgrad = self.x, self.dy, self.offsets, self.out, gwt.wgrad
        if fresh:
            nxt = self.fresh_offsets()
            return lambda: wgrad(x, dy, nxt(), out=out)
        return lambda: wgrad(x, dy, offsets, out=out)

    def cupy_call(self, fresh: bool = False):
        import cupy
        import torch

        import gwgrad.adapters.cupy as gwc

        # bfloat16 bits as int16 CuPy arrays over the same memory.
        x = cupy.from_dlpack(self.x.view(torch.int16))
        dy = cupy.from_dlpack(self.dy.view(torch.int16))
        out = cupy.from_dlpack(self.out.view(torch.int16))
        wgrad = gwc.wgrad
        if fresh:
            nxt = itertools.cycle([cupy.from_dlpack(o) for o in self.offsets_pool]).__next__
            return lambda: wgrad(x, dy, nxt(), out=out, dtype="bfloat16")
        offsets = cupy.from_dlpack(self.offsets)
        return lambda: wgrad(x, dy, offsets, out=out, dtype="bfloat16")

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


#: The small problem of the host-overhead table: its kernel is a few microseconds, so a batch
#: of calls measures the host's cost per call, not the GPU's.
OVERHEAD_PROBLEM = {"hidden": 256, "intermediate": 256, "num_experts": 8, "tokens_sum": 2048}
#: Seconds the whole host-overhead section may take (each entry: at most 60 s of it), so that
#: ``--skip-kernel`` ends within 2 minutes, imports included.
OVERHEAD_DEADLINE_S = 100
#: Targets per cached call (us): the contract's wrapper, and the adapters.
OVERHEAD_TARGETS_US = {"wrapper": 20.0, "adapters": 15.0}
#: Which target each entry of the overhead table answers to (the others are references; the
#: jitted JAX call is measured and reported, without a target).
OVERHEAD_TARGET_OF = {"wrapper": "wrapper", "class_execute": "wrapper",
                      "torch_wgrad_out": "adapters", "torch_wgrad_alloc": "adapters",
                      "torch_op_into": "adapters", "cupy_wgrad_out": "adapters"}


def per_call_us(fn: Callable[[], object], sync: Callable[[], None], batch: int = 2000,
                batches: int = 5, warmup: int = 20) -> List[float]:
    """Wall-clock microseconds per call of ``batch`` back-to-back calls, once per batch: no
    synchronization inside a batch (only after it, outside the timing)."""
    return interleaved_per_call_us({"fn": (fn, sync)}, batch, batches, warmup)["fn"]


def interleaved_per_call_us(calls: Dict[str, tuple], batch: int = 2000, batches: int = 5,
                            warmup: int = 20,
                            errors: Optional[Callable[[str, BaseException], None]] = None
                            ) -> Dict[str, List[float]]:
    """``per_call_us`` for several calls at once, taking turns: round r times batch r of every
    call, one after another, so that a drift of the host's state (clocks, another tenant)
    lands on all of them alike instead of on whichever ran last. ``calls``: name -> (fn,
    sync). A call that raises is dropped from the later rounds and reported to ``errors``
    (re-raised when None)."""
    live = dict(calls)

    def failed(name, exc):
        live.pop(name, None)
        if errors is None:
            raise exc
        errors(name, exc)

    for name, (fn, sync) in list(live.items()):
        try:
            for _ in range(warmup):
                fn()
            sync()
        except Exception as exc:  # noqa: BLE001 - reported, the others go on
            failed(name, exc)
    samples: Dict[str, List[float]] = {name: [] for name in live}
    for _ in range(batches):
        for name, (fn, sync) in list(live.items()):
            try:
                start = time.perf_counter()
                for _ in range(batch):
                    fn()
                samples[name].append((time.perf_counter() - start) / batch * 1e6)
                sync()
            except Exception as exc:  # noqa: BLE001
                samples.pop(name)
                failed(name, exc)
    return samples


def overhead_calls(p: Problem, frameworks: List[str]) -> Dict[str, Callable[[], Callable]]:
    """name -> a maker of the call to time (each made inside its own guarded step). Every
    call but ``wrapper_same_offsets`` gets a different offsets tensor each time."""
    import torch

    import gwgrad

    x, dy, out = p.x, p.dy, p.out
    makers: Dict[str, Callable[[], Callable]] = {}

    def wrapper(fresh=True):
        call, nxt, offsets = gwgrad.grouped_gemm_wgrad_wrapper_sm100, p.fresh_offsets(), p.offsets
        if not fresh:
            return lambda: call(a_tensor=x.T, b_tensor=dy, sfa_tensor=None, sfb_tensor=None,
                                offsets_tensor=offsets, wgrad_tensor=out)
        return lambda: call(a_tensor=x.T, b_tensor=dy, sfa_tensor=None, sfb_tensor=None,
                            offsets_tensor=nxt(), wgrad_tensor=out)

    def class_execute():
        op = gwgrad.GroupedGemmWgradSm100(sample_a=x.T, sample_b=dy, sample_sfa=None,
                                          sample_sfb=None, sample_offsets=p.offsets,
                                          sample_wgrad=out)
        op.check_support()
        op.compile()
        nxt = p.fresh_offsets()
        return lambda: op.execute(a_tensor=x.T, b_tensor=dy, sfa_tensor=None, sfb_tensor=None,
                                  offsets_tensor=nxt(), wgrad_tensor=out)

    makers["wrapper"] = wrapper
    makers["wrapper_same_offsets"] = lambda: wrapper(fresh=False)
    makers["class_execute"] = class_execute
    makers["plan_launch"] = p.core_launch
    # The same plan compiled as a prep kernel + GEMM (spec.launches=2, JAX's form): what the
    # default single launch saves per call.
    makers["plan_launch_two_launches"] = lambda: p.core_launch(launches=2)
    if "torch" in frameworks:
        def torch_alloc():
            import gwgrad.adapters.torch as gwt

            wgrad, nxt = gwt.wgrad, p.fresh_offsets()
            return lambda: wgrad(x, dy, nxt())

        def torch_op():
            import gwgrad.adapters.torch  # noqa: F401 - registers torch.ops.gwgrad

            op, nxt = torch.ops.gwgrad.grouped_gemm_wgrad_into.default, p.fresh_offsets()
            return lambda: op(x, dy, nxt(), out, False)

        makers["torch_wgrad_out"] = lambda: p.torch_call(fresh=True)
        makers["torch_wgrad_alloc"] = torch_alloc
        makers["torch_op_into"] = torch_op
    if "cupy" in frameworks:
        makers["cupy_wgrad_out"] = lambda: p.cupy_call(fresh=True)
    return makers


def host_overhead(results: Dict, frameworks: List[str], batch: int, batches: int,
                  step_s: int, device: str = "cuda", problem: Optional[Dict] = None):
    """Median host time to enqueue one cached call (small problem; batches without a sync;
    the entries take turns batch by batch, ``interleaved_per_call_us``). ``device="cpu"``
    runs the same calls on the reference backend (a check of this code: its figures are not
    host overheads), without CuPy, JAX and the GPU floor."""
    import torch

    shape = problem or OVERHEAD_PROBLEM
    counts = [shape["tokens_sum"] // shape["num_experts"]] * shape["num_experts"]
    p = Problem(shape["hidden"], shape["intermediate"], counts, device=device)
    on_gpu = device != "cpu"
    if not on_gpu:
        frameworks = [f for f in frameworks if f == "torch"]
    over, detail = results["overhead_us"], results["overhead"]
    results["overhead_settings"] = {**shape, "batch": batch, "batches": batches,
                                    "offsets_pool": OFFSETS_POOL, "interleaved": True,
                                    "targets_us": OVERHEAD_TARGETS_US}
    device_sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    # Each call is made (its first use compiles or plans) in its own guarded step, then all
    # are timed together, taking turns.
    calls: Dict[str, tuple] = {}
    for name, make in overhead_calls(p, frameworks).items():
        if name == "cupy_wgrad_out" and _import("cupy") is None:
            results["skipped"].append("cupy_wgrad_out: CuPy is not installed")
            continue
        fn = guarded(results, f"overhead: {name}", step_s, make)
        if fn is not None:
            calls[name] = (fn, device_sync)
    if "jax" in frameworks:
        if _import("jax") is None:
            results["skipped"].append("jax_jit_call: JAX is not installed")
        else:
            made = guarded(results, "overhead: jax_jit_call", step_s, lambda: _jax_call(p))
            if made is not None:
                calls["jax_jit_call"] = made

    def measure():
        samples = interleaved_per_call_us(
            calls, batch, batches,
            errors=lambda name, exc: record_error(results, f"overhead: {name}", exc))
        for name in calls:  # the makers' order, not the order of completion
            if name not in samples:
                continue
            over[name] = statistics.median(samples[name])
            entry = detail[name] = {"us": over[name], "samples_us": samples[name]}
            target = OVERHEAD_TARGET_OF.get(name)
            if target:
                entry["target_us"] = OVERHEAD_TARGETS_US[target]
                entry["target_met"] = over[name] <= OVERHEAD_TARGETS_US[target]
            print(f"host overhead {name:<22} {over[name]:8.2f} us", flush=True)

    guarded(results, "overhead: interleaved timing", step_s * max(1, len(calls) // 2), measure)
    if on_gpu:
        guarded(results, "overhead: gpu floor", step_s, lambda: _gpu_floor(p, results))
        guarded(results, "overhead: gpu floor, two launches", step_s,
                lambda: _gpu_floor(p, results, launches=2))


def _jax_call(p: Problem) -> tuple:
    """(call, sync) of the jitted JAX adapter, a different offsets array each call."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import gwgrad.adapters.jax as gwj

    jx, jdy, _ = p.jax_arrays()
    offsets = np.cumsum(np.asarray(p.counts, np.int32)).astype(np.int32)
    device = list(jx.devices())[0]
    pool = [jax.device_put(jnp.asarray(offsets), device) for _ in range(OFFSETS_POOL)]
    nxt = itertools.cycle(pool).__next__
    f = jax.jit(gwj.wgrad)
    last = [f(jx, jdy, pool[0])]
    last[0].block_until_ready()

    def call():  # keep the newest result: XLA runs in order, so it finishes last
        last[0] = f(jx, jdy, nxt())

    return call, lambda: last[0].block_until_ready()


def _gpu_floor(p: Problem, results: Dict, calls: int = 100, launches: int = 0):
    """The small kernel's GPU time per call, without any host cost: ``calls`` raw launches
    captured in one CUDA graph, replayed. A host figure near it is bounded by the GPU.
    ``launches=2``: the same plan as a prep kernel + GEMM (``overhead_gpu_floor_two_launches_us``)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        runner = p.core_launch(launches)  # launches on the side stream, which the capture uses
        runner()
    side.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for _ in range(calls):
            runner()
    graph.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = []
    for _ in range(5):
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        reps.append(s.elapsed_time(e) * 1e3 / calls)
    key = "overhead_gpu_floor_two_launches_us" if launches == 2 else "overhead_gpu_floor_us"
    results[key] = statistics.median(reps)
    print(f"gpu time per small kernel (graph replay{', two launches' if launches == 2 else ''}) "
          f"{results[key]:.2f} us", flush=True)


def format_tables(results: Dict) -> str:
    lines = []
    head = (f"{'row':<10} {'dist':<8} {'core':>8} {'torch':>8} {'cupy':>8} {'jax':>8} "
            f"{'core(w)':>8} {'ragged':>8}   (ms)   torch/core cupy/core jax/core(w) ragged/jax")
    if results["kernel"]:
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
    if results["kernel"]:
        lines.append("(adapter/core: 1.00 = the core's kernel time; within 1.05 is the target. "
                     "ragged/jax > 1: gwgrad is faster than ragged_dot_general)")
    if results["overhead_us"]:
        lines.append("")
        st = results.get("overhead_settings", {})
        lines.append(f"host overhead per cached call (median us over {st.get('batches', '?')} "
                     f"batches of {st.get('batch', '?')} calls, no sync inside a batch; "
                     f"{st.get('num_experts', '?')} experts, {st.get('hidden', '?')}x"
                     f"{st.get('intermediate', '?')}, {st.get('tokens_sum', '?')} tokens):")
        for name, us in results["overhead_us"].items():
            entry = results.get("overhead", {}).get(name, {})
            verdict = ""
            if "target_us" in entry:
                verdict = (f"target <= {entry['target_us']:.0f}: "
                           f"{'ok' if entry['target_met'] else 'MISSED'}")
            lines.append(f"  {name:<22} {us:8.2f}   {verdict}")
        if "overhead_gpu_floor_us" in results:
            lines.append(f"  {'(gpu time per kernel)':<22} {results['overhead_gpu_floor_us']:8.2f}"
                         "   a figure near this is bounded by the GPU, not the host")
        if "overhead_gpu_floor_two_launches_us" in results:
            lines.append(f"  {'(... as two launches)':<22} "
                         f"{results['overhead_gpu_floor_two_launches_us']:8.2f}"
                         "   prep kernel + GEMM (spec.launches=2)")
    for note in results.get("skipped", []):
        lines.append(f"skipped: {note}")
    if results["errors"]:
        lines.append("")
        lines.append("errors: " + "; ".join(f"{e['step']}: {e['error'][:160]}"
                                            for e in results["errors"]))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.adapters",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="bench_adapters.json", help="where to write results")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--row", default="dsv3-fc1", help="shape name for the kernel table")
    parser.add_argument("--dist", default="uniform,zipf")
    parser.add_argument("--frameworks", default="torch,cupy,jax")
    parser.add_argument("--overhead-batch", type=int, default=2000,
                        help="calls per timed batch (host overhead)")
    parser.add_argument("--overhead-batches", type=int, default=9,
                        help="timed batches per entry; the median is reported")
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
               "overhead_us": {}, "overhead": {}, "skipped": [], "errors": []}
    print(f"device: {results['device']}  versions: {versions}", flush=True)
    if not args.skip_kernel:
        with open(args.shapes) as f:
            shapes = {s["name"]: s for s in json.load(f)["shapes"]}
        shape = shapes[args.row]
        for dist in args.dist.split(","):
            guarded(results, f"kernel {dist}", args.step_timeout * 3,
                    lambda: kernel_rows(results, shape, dist, frameworks, args.step_timeout))
            save(args.json, results)
    if not args.skip_overhead:  # the whole section within OVERHEAD_DEADLINE_S
        guarded(results, "overhead", min(args.step_timeout * 3, OVERHEAD_DEADLINE_S),
                lambda: host_overhead(results, frameworks, args.overhead_batch,
                                      args.overhead_batches, min(args.step_timeout, 60)))
    save(args.json, results)
    print(format_tables(results))
    print(f"wrote {args.json}")
    return 0


def save(path: str, results: Dict) -> None:
    """Write the results (atomically: an interrupted run leaves the last complete file)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1, default=str)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
