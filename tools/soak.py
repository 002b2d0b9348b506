#!/usr/bin/env python
"""Soak test of gwgrad on a GPU: many mixed calls from several threads, flat memory, one
kernel per spec, CUDA-graph replays with new offsets.

    python tools/soak.py                               # defaults below; ~1-2 min on an H200
    python tools/soak.py --calls 300 --replays 50 --json soak.json     # short (tests)
    python tools/soak.py --device cpu --calls 200      # the call mix on the CPU reference

What it does (CUDA):

1. **Warm-up**: ``--threads`` Python threads (default 4), each with its own
   ``torch.cuda.Stream``, run every spec at each of its token counts once, verified. This
   compiles (or loads from gwgrad's disk cache) every kernel, from all threads at once.
2. **Mixed calls**: ``--calls`` calls (default 10,000) spread over the threads, each a random
   spec (``default_specs``: BF16 through ``gwgrad.adapters.torch.wgrad`` -- allocating,
   dense ``out=``, per-expert outputs, FP32 accumulate -- and through the contract wrapper
   ``gwgrad.grouped_gemm_wgrad_wrapper_sm100`` -- allocating, FP32 accumulate, ``wgrad_ptrs``;
   on an SM90 GPU also FP8: ``gwgrad.adapters.torch.quantize`` of x and dy then
   ``wgrad_fp8``, per_expert_channel and block_1x128) with random offsets every call (random
   counts, empty experts, sometimes every token in one expert), built on the host and copied
   through pinned memory without a synchronization. Every ``--verify-every``-th call of a
   thread is checked against an FP64 reference on that thread's stream (BF16: the float64
   product of the same BF16 values; FP8: of the dequantized codes, and within 6% of the
   BF16 values' product; empty experts exactly zero, or unchanged when accumulating).
3. **Memory**: ``torch.cuda.memory_allocated`` and the driver's free memory
   (``torch.cuda.mem_get_info``, after ``empty_cache``) after the warm-up and after the mixed
   calls; growth must stay within ``--alloc-tol-mib`` (1 MiB) / ``--driver-tol-mib``
   (32 MiB; reserved-segment growth and memory outside torch's allocator are reported
   separately). Plan caches
   (the adapter's, the core's) must not grow after the warm-up.
4. **Kernels**: kernels loaded into the process (``gwgrad.kernel_cache.stats()``: compiles +
   disk loads; ``gwgrad.kernels.compiler.compile_count`` counts actual compiles) must equal
   the number of distinct kernels the specs need (``expected_kernels``: one per static GEMM
   spec, one per quantizer (channels, experts, format)), none after the warm-up.
5. **CUDA graphs**: one ``wgrad`` call (BF16 out) and one accumulating into FP32 are each
   captured in a ``torch.cuda.graph`` and replayed ``--replays`` times (default 1,000) with
   new offsets copied into the captured offsets tensor; every replay must be bit-equal to an
   eager call with the same offsets on the same stream (``torch.equal``), and every
   ``--fp64-every``-th replay within tolerance of the FP64 reference. Memory before and after
   the replays is compared too.
6. ``gwgrad.check_errors()`` must raise nothing.

Prints a summary; ``--json PATH`` writes every figure. Exit code 1 on any failure. The
default run's time is dominated by compiling ~13 kernels (~2-3 s each; a warm disk cache
skips that). The pure parts (specs, offsets, references, checks) import without a GPU:
tests/test_soak.py runs them on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import queue
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

import gwgrad
import gwgrad.adapters.torch as gwt

MIB = 1 << 20
#: Relative-error tolerances against the FP64 reference, by output dtype.
TOLERANCE = {"bfloat16": 1e-2, "float32": 1e-5}
#: FP8 GEMM against the FP64 product of its dequantized codes (FP32 scales; Hopper's FP8 MMA
#: accumulates with reduced precision between promotions: tests/test_fp8_sm90_gpu.py's bounds).
FP8_TOLERANCE = {"bfloat16": 1e-2, "float32": 2e-3}
#: Quantize -> FP8 GEMM against the FP64 product of the BF16 values (README: within 6%).
FP8_VS_BF16 = 0.06
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# --- specs ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Spec:
    """One kind of call. ``api``: "adapter" (gwgrad.adapters.torch.wgrad), "wrapper"
    (gwgrad.grouped_gemm_wgrad_wrapper_sm100) or "fp8" (quantize x and dy, then wgrad_fp8).
    ``out``: "alloc" (no output given), "dense" (a given (E, H, I) tensor), "discrete" (given
    per-expert tensors; the wrapper: their int64 ``wgrad_ptrs``), "fresh_discrete" (new
    per-expert tensors every call). ``tokens``: the token totals a call draws from (each a
    multiple of ``multiple``, as every expert's count is)."""

    name: str
    api: str
    experts: int
    hidden: int
    inter: int
    tokens: Tuple[int, ...]
    out: str
    out_dtype: str
    accumulate: bool = False
    recipe: Optional[str] = None  # fp8: "per_expert_channel" | "block_1x128"
    quantize_out: str = "alloc"  # fp8: "alloc" (new quantizer outputs) | "reuse" (out=)
    multiple: int = 1

    @property
    def output_mode(self) -> str:
        return "discrete" if self.out in ("discrete", "fresh_discrete") else "dense"


def default_specs(fp8: bool = False) -> List[Spec]:
    """The soak's call mix: BF16 through the torch adapter and the contract wrapper in every
    output mode, FP32 accumulation among them; with ``fp8`` two FP8 recipes (SM90)."""
    specs = [
        Spec("adapter-alloc-bf16", "adapter", 8, 128, 256, (1024, 1000), "alloc", "bfloat16"),
        Spec("adapter-dense-f32-acc", "adapter", 8, 128, 256, (1024, 1000), "dense", "float32",
             accumulate=True),
        Spec("adapter-discrete-f32-acc", "adapter", 8, 128, 256, (1024, 1000), "discrete",
             "float32", accumulate=True),
        Spec("adapter-fresh-discrete-bf16", "adapter", 4, 256, 128, (768, 517),
             "fresh_discrete", "bfloat16"),
        Spec("wrapper-alloc-bf16", "wrapper", 16, 192, 128, (2048, 1536), "alloc", "bfloat16"),
        Spec("wrapper-dense-f32-acc", "wrapper", 16, 192, 128, (2048, 1536), "dense", "float32",
             accumulate=True),
        Spec("wrapper-discrete-bf16", "wrapper", 6, 320, 192, (1024, 999), "discrete",
             "bfloat16"),
    ]
    if fp8:
        specs += [
            Spec("fp8-channel-alloc-bf16", "fp8", 8, 128, 256, (1024, 768), "alloc", "bfloat16",
                 recipe="per_expert_channel", multiple=16),
            Spec("fp8-1x128-dense-f32-acc", "fp8", 8, 256, 128, (1536, 1024), "dense",
                 "float32", accumulate=True, recipe="block_1x128", quantize_out="reuse",
                 multiple=16),
        ]
    return specs


def kernel_keys(spec: Spec) -> set:
    """The compiled kernels a spec's calls need, as comparable keys: the GEMM's static spec
    (dims, dtypes, output mode, accumulate; x.T M-major / dy N-major, or FP8 K-major) and, for
    FP8, the quantizer of x and of dy (one per channels, experts, format, element type)."""
    if spec.api == "fp8":
        return {("gemm", "float8_e4m3fn", spec.recipe, spec.experts, spec.hidden, spec.inter,
                 spec.out_dtype, spec.output_mode, spec.accumulate),
                ("quantize", spec.recipe, "e4m3", spec.experts, spec.hidden),
                ("quantize", spec.recipe, "e4m3", spec.experts, spec.inter)}
    return {("gemm", "bfloat16", None, spec.experts, spec.hidden, spec.inter, spec.out_dtype,
             spec.output_mode, spec.accumulate)}


def expected_kernels(specs: Sequence[Spec]) -> Dict[str, int]:
    """Distinct kernels (all, GEMMs, quantizers) the specs need."""
    keys = set().union(*(kernel_keys(s) for s in specs)) if specs else set()
    gemms = sum(1 for k in keys if k[0] == "gemm")
    return {"total": len(keys), "gemm": gemms, "quantize": len(keys) - gemms}


def graph_specs(specs: Sequence[Spec]) -> Tuple[Spec, Spec]:
    """The two captured calls: ``wgrad(out=bf16)`` and ``wgrad(out=f32, accumulate=True)`` on
    the first spec's dims (kernels the mixed calls already loaded)."""
    s = specs[0]
    plain = dataclasses.replace(s, name="graph-bf16", api="adapter", out="dense",
                                out_dtype="bfloat16", accumulate=False, recipe=None, multiple=1)
    acc = dataclasses.replace(plain, name="graph-f32-acc", out_dtype="float32", accumulate=True)
    return plain, acc


# --- offsets and schedules (host, NumPy) ------------------------------------------------------

def random_counts(rng: np.random.Generator, experts: int, tokens: int,
                  multiple: int = 1) -> np.ndarray:
    """Random token counts per expert summing to ``tokens``, each a multiple of ``multiple``:
    usually some experts empty (first, last, any), sometimes every token in one expert, skewed
    sizes otherwise."""
    if tokens % multiple:
        raise ValueError(f"tokens {tokens} is not a multiple of {multiple}")
    units = tokens // multiple
    counts = np.zeros(experts, dtype=np.int64)
    r = rng.random()
    if r < 0.05 or experts == 1:
        counts[rng.integers(experts)] = units
    else:
        empty = rng.choice(experts, size=int(rng.integers(0, max(1, experts // 2) + 1)),
                           replace=False) if r < 0.8 else np.array([], dtype=np.int64)
        live = np.setdiff1d(np.arange(experts), empty)
        if live.size == 0:
            live = np.array([rng.integers(experts)])
        weights = rng.dirichlet(np.full(live.size, 0.7))
        counts[live] = rng.multinomial(units, weights)
    return counts * multiple


def offsets_of(counts: Sequence[int]) -> np.ndarray:
    return np.cumsum(np.asarray(counts, dtype=np.int64)).astype(np.int32)


def device_offsets(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """The int32 offsets on ``device``: from pinned host memory with a non-blocking copy on
    the current stream (no synchronization; the caching host allocator keeps the pinned
    block until the copy is done)."""
    host = torch.from_numpy(offsets_of(counts))
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def make_schedule(calls: int, specs: Sequence[Spec], threads: int, seed: int,
                  verify_every: int) -> List[List[Tuple[int, int, int, bool]]]:
    """Per thread, its calls ``(call index, spec index, token total, verify)``: call i goes to
    thread ``i % threads``, a random spec and token total each; every ``verify_every``-th call
    of a thread is verified (its first included; 0: none)."""
    rng = np.random.default_rng(seed)
    plan: List[List[Tuple[int, int, int, bool]]] = [[] for _ in range(threads)]
    for i in range(calls):
        t = i % threads
        s = int(rng.integers(len(specs)))
        tokens = int(rng.choice(specs[s].tokens))
        verify = verify_every > 0 and len(plan[t]) % verify_every == 0
        plan[t].append((i, s, tokens, verify))
    return plan


# --- references and checks (torch; CPU or CUDA) -----------------------------------------------

def reference_wgrad(x: torch.Tensor, dy: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """float64 ``W[e] = x_e.T @ dy_e`` on x's device (x (T, H), dy (T, I), any float dtype)."""
    x64, dy64 = x.double(), dy.double()
    out = torch.zeros(len(counts), x.shape[1], dy.shape[1], dtype=torch.float64, device=x.device)
    begin = 0
    for e, c in enumerate(counts):
        c = int(c)
        if c:
            out[e] = x64[begin:begin + c].T @ dy64[begin:begin + c]
        begin += c
    return out


def dequantize(data: torch.Tensor, scales: torch.Tensor, counts: Sequence[int],
               recipe: str) -> torch.Tensor:
    """float64 (channels, tokens) values of a quantizer's FP8 ``data`` (channels, tokens) and
    FP32 ``scales``: per_expert_channel ``scales[e, c]`` for expert e's tokens; block_1x128 row
    ``S_e + j`` for the j-th 128 tokens of expert e, ``S_e = sum_{i<e} ceil(count_i / 128)``."""
    values = data.float().double()
    out = torch.zeros_like(values)
    begin = row = 0
    for e, c in enumerate(counts):
        c = int(c)
        if c == 0:
            continue
        block = values[:, begin:begin + c]
        if recipe == "per_expert_channel":
            out[:, begin:begin + c] = block * scales[e].double()[:, None]
        elif recipe == "block_1x128":
            n = -(-c // 128)
            s = scales[row:row + n].double().T.repeat_interleave(128, dim=1)[:, :c]
            out[:, begin:begin + c] = block * s
            row += n
        else:
            raise ValueError(f"recipe: expected per_expert_channel or block_1x128, got {recipe!r}")
        begin += c
    return out


def rel_error(got: torch.Tensor, want: torch.Tensor, scale: Optional[torch.Tensor] = None) -> float:
    """``||got - want|| / ||scale||`` (``scale`` defaults to ``want``; 1 when it is zero)."""
    denom = float((want if scale is None else scale).double().norm())
    diff = float((got.double() - want.double()).norm())
    return diff / denom if denom else diff


def check_result(got: torch.Tensor, ref: torch.Tensor, counts: Sequence[int], out_dtype: str,
                 before: Optional[torch.Tensor] = None,
                 tolerance: Optional[Dict[str, float]] = None) -> Tuple[float, List[str]]:
    """(relative error, problems) of a result ``got`` (E, H, I) against the float64 ``ref``:
    without ``before`` ``got ~ ref`` and empty experts exactly zero; with ``before`` (the
    output before an accumulating call) ``got ~ before + ref`` (error relative to ``ref``)
    and empty experts bit-for-bit unchanged. NaN anywhere is a problem."""
    tol = (tolerance or TOLERANCE)[out_dtype]
    problems: List[str] = []
    if tuple(got.shape) != tuple(ref.shape):
        return math.inf, [f"shape {tuple(got.shape)}, expected {tuple(ref.shape)}"]
    want = ref if before is None else before.double() + ref
    err = rel_error(got, want, ref)
    if not math.isfinite(err) or err > tol:
        problems.append(f"relative error {err:.3g} > {tol:g}")
    for e, c in enumerate(counts):
        if int(c):
            continue
        if before is None:
            if bool((got[e] != 0).any()):
                problems.append(f"empty expert {e} not zero")
        elif not torch.equal(got[e], before[e]):
            problems.append(f"empty expert {e} changed by accumulate")
    return err, problems


# --- one call ---------------------------------------------------------------------------------

class Buffers:
    """One thread's persistent tensors for one spec: x / dy at the largest token count (calls
    use prefixes), given outputs, the wrapper's pointer array, reused quantizer outputs."""

    def __init__(self, spec: Spec, device: torch.device, generator: Optional[torch.Generator]):
        t = max(spec.tokens)
        kw = dict(device=device, generator=generator)
        self.x = torch.randn(t, spec.hidden, **kw).to(torch.bfloat16)
        self.dy = torch.randn(t, spec.inter, **kw).to(torch.bfloat16)
        dtype = DTYPES[spec.out_dtype]
        shape = (spec.experts, spec.hidden, spec.inter)
        self.out = self.outs = self.ptrs = None
        if spec.out == "dense":
            self.out = torch.zeros(shape, dtype=dtype, device=device)
        elif spec.out == "discrete":
            self.outs = [torch.zeros(shape[1:], dtype=dtype, device=device)
                         for _ in range(spec.experts)]
            if spec.api == "wrapper":  # built once (a synchronizing copy, outside the loop)
                self.ptrs = torch.tensor([o.data_ptr() for o in self.outs], dtype=torch.int64,
                                         device=device)
        self.quantized: Dict[int, Tuple[tuple, tuple]] = {}  # tokens -> (x's, dy's) outputs


def reset_for_verify(spec: Spec, bufs: Buffers) -> Optional[torch.Tensor]:
    """Before a verified call: given outputs poisoned (NaN) or, when accumulating, set to a
    random base; returns that base (E, H, I) (None when not accumulating)."""
    targets = [bufs.out] if bufs.out is not None else (bufs.outs or [])
    if spec.accumulate:
        for t in targets:
            t.normal_()
        return (bufs.out.clone() if bufs.out is not None
                else torch.stack([o.clone() for o in bufs.outs]))
    for t in targets:
        t.fill_(float("nan"))
    return None


def run_call(spec: Spec, bufs: Buffers, tokens: int, counts: Sequence[int],
             device: torch.device, verify: bool) -> Optional[Dict[str, Any]]:
    """One call of ``spec`` on torch's current stream with these counts; when ``verify``,
    its check against the FP64 reference: ``{"err", "problems", ...}``."""
    offsets = device_offsets(counts, device)
    x, dy = bufs.x[:tokens], bufs.dy[:tokens]
    dtype = DTYPES[spec.out_dtype]
    before = reset_for_verify(spec, bufs) if verify else None
    quant = None
    if spec.api == "adapter":
        if spec.out == "alloc":
            got = gwt.wgrad(x, dy, offsets, out_dtype=dtype)
        elif spec.out == "dense":
            got = gwt.wgrad(x, dy, offsets, out=bufs.out, accumulate=spec.accumulate)
        else:
            outs = bufs.outs if spec.out == "discrete" else [
                torch.empty(spec.hidden, spec.inter, dtype=dtype, device=device)
                for _ in range(spec.experts)]
            got = gwt.wgrad(x, dy, offsets, out=outs, accumulate=spec.accumulate)
    elif spec.api == "wrapper":
        wrapper = gwgrad.grouped_gemm_wgrad_wrapper_sm100
        common = dict(a_tensor=x.T, b_tensor=dy, sfa_tensor=None, sfb_tensor=None,
                      offsets_tensor=offsets, accumulate_on_output=spec.accumulate)
        if spec.out == "alloc":
            got = wrapper(output_mode="dense", wgrad_dtype=dtype, **common)["wgrad_tensor"]
        elif spec.out == "dense":
            got = wrapper(output_mode="dense", wgrad_tensor=bufs.out, **common)["wgrad_tensor"]
        elif spec.out == "discrete":
            result = wrapper(output_mode="discrete", wgrad_ptrs=bufs.ptrs, wgrad_dtype=dtype,
                             **common)
            assert result["wgrad_tensor"] is None
            got = bufs.outs
        else:
            raise ValueError(f"out: {spec.out!r} is not a wrapper mode")
    elif spec.api == "fp8":
        qx = qdy = None
        if spec.quantize_out == "reuse":
            qx, qdy = bufs.quantized.get(tokens, (None, None))
        xq, sx, _ = gwt.quantize(x, offsets, spec.recipe, out=qx)
        dyq, sdy, _ = gwt.quantize(dy, offsets, spec.recipe, out=qdy)
        if spec.quantize_out == "reuse":
            bufs.quantized[tokens] = ((xq, sx, None), (dyq, sdy, None))
        quant = (xq, sx, dyq, sdy)
        kw = dict(scale_recipe=spec.recipe)
        if spec.out == "alloc":
            got = gwt.wgrad_fp8(xq.t(), dyq.t(), offsets, sx, sdy, out_dtype=dtype, **kw)
        else:
            got = gwt.wgrad_fp8(xq.t(), dyq.t(), offsets, sx, sdy, out=bufs.out,
                                accumulate=spec.accumulate, **kw)
    else:
        raise ValueError(f"api: {spec.api!r}")
    if not verify:
        return None
    got = torch.stack(list(got)) if isinstance(got, (list, tuple)) else got
    if quant is None:
        err, problems = check_result(got, reference_wgrad(x, dy, counts), counts,
                                     spec.out_dtype, before)
        return {"err": err, "problems": problems}
    xq, sx, dyq, sdy = quant
    ref_q = reference_wgrad(dequantize(xq, sx, counts, spec.recipe).T,
                            dequantize(dyq, sdy, counts, spec.recipe).T, counts)
    err, problems = check_result(got, ref_q, counts, spec.out_dtype, before, FP8_TOLERANCE)
    ref_bf16 = reference_wgrad(x, dy, counts)
    added = got.double() - (before.double() if before is not None else 0)
    err_bf16 = rel_error(added, ref_bf16)
    if not err_bf16 <= FP8_VS_BF16:
        problems.append(f"quantize -> FP8 GEMM off the BF16 product by {err_bf16:.3g} "
                        f"(> {FP8_VS_BF16})")
    return {"err": err, "err_vs_bf16": err_bf16, "problems": problems}


# --- threads ----------------------------------------------------------------------------------

class Soak:
    """Shared state of the worker threads: per-thread streams and buffers, figures, failures."""

    def __init__(self, specs: Sequence[Spec], device: torch.device, threads: int, seed: int,
                 max_failures: int = 20):
        self.specs = list(specs)
        self.device = device
        self.seed = seed
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.failures: List[str] = []
        self.max_failures = max_failures
        self.streams = [torch.cuda.Stream(device=device) if device.type == "cuda" else None
                        for _ in range(threads)]
        self.buffers: List[Dict[int, Buffers]] = [{} for _ in range(threads)]
        self.rngs = [np.random.default_rng([seed, 1, t]) for t in range(threads)]
        self.calls = {s.name: 0 for s in specs}
        self.verified = {s.name: 0 for s in specs}
        self.max_err = {s.name: 0.0 for s in specs}
        self.max_err_vs_bf16 = {s.name: 0.0 for s in specs if s.api == "fp8"}
        self.thread_calls = [0] * threads
        self.inbox: List["queue.Queue"] = [queue.Queue() for _ in range(threads)]
        self.done = [threading.Event() for _ in range(threads)]
        self.threads: Optional[List[threading.Thread]] = None

    def fail(self, message: str) -> None:
        with self.lock:
            if len(self.failures) < self.max_failures:
                self.failures.append(message)
            elif len(self.failures) == self.max_failures:
                self.failures.append("... more failures not recorded")
        self.stop.set()

    def _buffers(self, t: int, s: int) -> Buffers:
        bufs = self.buffers[t].get(s)
        if bufs is None:
            gen = None
            if self.device.type == "cuda":
                gen = torch.Generator(device=self.device)
                gen.manual_seed(self.seed * 1000 + t * 100 + s)
            bufs = self.buffers[t][s] = Buffers(self.specs[s], self.device, gen)
        return bufs

    def call(self, t: int, i: int, s: int, tokens: int, verify: bool) -> None:
        spec = self.specs[s]
        counts = random_counts(self.rngs[t], spec.experts, tokens, spec.multiple)
        try:
            result = run_call(spec, self._buffers(t, s), tokens, counts, self.device, verify)
        except Exception as exc:  # noqa: BLE001 - every error is a soak failure
            self.fail(f"thread {t} call {i} {spec.name} counts {counts.tolist()}: "
                      f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}")
            return
        with self.lock:
            self.calls[spec.name] += 1
            self.thread_calls[t] += 1
            if result is not None:
                self.verified[spec.name] += 1
                self.max_err[spec.name] = max(self.max_err[spec.name], result["err"])
                if "err_vs_bf16" in result:
                    self.max_err_vs_bf16[spec.name] = max(self.max_err_vs_bf16[spec.name],
                                                          result["err_vs_bf16"])
        if result is not None and result["problems"]:
            self.fail(f"thread {t} call {i} {spec.name} tokens {tokens} counts "
                      f"{counts.tolist()}: " + "; ".join(result["problems"]))

    def worker(self, t: int) -> None:
        """Thread t for the whole run: it takes one phase's work at a time from its inbox
        (None: stop), on its own stream, then reports it done. The same threads serve every
        phase, so per-thread state (torch's cuBLAS handle and its workspace for this stream,
        used by the FP64 checks) is made in the warm-up and reused, not made again."""
        stream = self.streams[t]
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        if stream is not None:
            torch.cuda.set_device(self.device)  # the current device is per thread
        with ctx:
            while True:
                work = self.inbox[t].get()
                if work is None:
                    return
                try:
                    for i, s, tokens, verify in work:
                        if self.stop.is_set():
                            break
                        self.call(t, i, s, tokens, verify)
                    if stream is not None:
                        stream.synchronize()
                except Exception as exc:  # noqa: BLE001
                    self.fail(f"thread {t}: {type(exc).__name__}: {exc}\n"
                              f"{traceback.format_exc(limit=6)}")
                finally:
                    self.done[t].set()

    def run(self, plan: Sequence[Sequence[Tuple[int, int, int, bool]]],
            deadline: float) -> bool:
        """Run each thread's share of a phase and wait for all of them; False when the
        deadline passed first (a failure is recorded)."""
        if self.threads is None:
            self.threads = [threading.Thread(target=self.worker, args=(t,), daemon=True,
                                             name=f"soak-{t}") for t in range(len(self.streams))]
            for th in self.threads:
                th.start()
        for t, work in enumerate(plan):
            self.done[t].clear()
            self.inbox[t].put(list(work))
        for t in range(len(plan)):
            if not self.done[t].wait(max(0.0, deadline - time.monotonic())):
                self.fail("threads still running at the deadline (--max-seconds)")
                return False
        return True

    def close(self) -> None:
        """Stop the threads (after the last phase)."""
        if self.threads:
            for q in self.inbox:
                q.put(None)
            for th in self.threads:
                th.join(10)

    def warmup_plan(self) -> List[List[Tuple[int, int, int, bool]]]:
        """Every thread: every spec at each of its token totals, verified."""
        return [[(-1, s, tokens, True) for s, spec in enumerate(self.specs)
                 for tokens in spec.tokens] for _ in self.streams]


# --- process-level figures --------------------------------------------------------------------

def memory_sample(device: torch.device) -> Dict[str, int]:
    """torch's allocated / reserved bytes and the driver's free bytes, after synchronizing,
    collecting garbage and releasing torch's cached blocks."""
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated": int(torch.cuda.memory_allocated(device)),
            "reserved": int(torch.cuda.memory_reserved(device)),
            "driver_free": int(free), "driver_total": int(total)}


def memory_growth(before: Dict[str, int], after: Dict[str, int], alloc_tol_mib: float,
                  driver_tol_mib: float) -> Tuple[Dict[str, int], List[str]]:
    """Growth of allocated / reserved bytes, of driver memory in use and of the part of it
    outside torch's allocator (in use minus reserved), and the problems (allocated or driver
    memory in use grown past the tolerances). Reserved growth is fragmentation (segments kept
    by live blocks, e.g. the torch adapter's bounded pointer-array cache): reported only."""
    growth = {"allocated": after["allocated"] - before["allocated"],
              "reserved": after["reserved"] - before["reserved"],
              "driver_used": before["driver_free"] - after["driver_free"]}
    growth["outside_torch"] = growth["driver_used"] - growth["reserved"]
    problems = []
    if growth["allocated"] > alloc_tol_mib * MIB:
        problems.append(f"torch.cuda.memory_allocated grew by {growth['allocated']} B "
                        f"(> {alloc_tol_mib} MiB)")
    if growth["driver_used"] > driver_tol_mib * MIB:
        problems.append(f"driver memory in use grew by {growth['driver_used']} B "
                        f"(> {driver_tol_mib} MiB)")
    return growth, problems


def kernel_counters() -> Dict[str, int]:
    """gwgrad.kernel_cache.stats() with the CuTe DSL compile count and the operator counters."""
    from gwgrad import kernel_cache
    from gwgrad.kernels import compiler

    stats = kernel_cache.stats()
    info = gwgrad.cache_info()
    return {"compiles": stats["compiles"], "disk_hits": stats["disk_hits"],
            "rebuilds": stats["rebuilds"], "loaded": stats["compiles"] + stats["disk_hits"],
            "dsl_compile_count": int(compiler.compile_count),
            "operators_constructed": info["constructed"]}


def counter_delta(a: Dict[str, int], b: Dict[str, int]) -> Dict[str, int]:
    return {k: b[k] - a[k] for k in a}


def plan_cache_sizes() -> Dict[str, int]:
    from gwgrad import plan as plans
    from gwgrad.interop import torch as tinterop

    return {"adapter_plans": len(gwt._plans), "core_plans": len(plans._plans),
            "wrapper_call_plans": len(plans.call_plans),
            "pointer_arrays": len(tinterop._pointer_arrays)}


def kernel_problems(total: Dict[str, int], after_warmup: Dict[str, int],
                    expected: Dict[str, int]) -> List[str]:
    """The kernel-count checks: loaded == expected, nothing after the warm-up, operators (GEMMs
    and quantizers: gwgrad.plan) constructed once each, every kernel_cache compile a DSL
    compile."""
    problems = []
    if total["loaded"] != expected["total"]:
        problems.append(f"{total['loaded']} kernels loaded ({total['compiles']} compiled, "
                        f"{total['disk_hits']} from disk), expected {expected['total']} (one per "
                        "distinct spec)")
    if after_warmup["loaded"] or after_warmup["dsl_compile_count"]:
        problems.append(f"kernels loaded after the warm-up: {after_warmup}")
    if total["operators_constructed"] != expected["total"]:
        problems.append(f"{total['operators_constructed']} operators constructed (GEMMs and "
                        f"quantizers), expected {expected['total']}")
    if total["dsl_compile_count"] != total["compiles"]:
        problems.append(f"CuTe DSL compiles {total['dsl_compile_count']} != kernel_cache compiles "
                        f"{total['compiles']}")
    return problems


# --- CUDA graphs ------------------------------------------------------------------------------

def graph_replays(specs: Sequence[Spec], replays: int, fp64_every: int, seed: int,
                  device: torch.device, alloc_tol_mib: float,
                  driver_tol_mib: float) -> Dict[str, Any]:
    """Capture ``wgrad(out=bf16)`` and ``wgrad(out=f32, accumulate=True)``; replay each
    ``replays`` times with new offsets in the captured tensor, each replay against an eager
    call (bit-equal) and every ``fp64_every``-th against FP64."""
    plain, _ = graph_specs(specs)  # the accumulating call: the same dims, FP32 out
    rng = np.random.default_rng([seed, 2])
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    e, h, n, t = plain.experts, plain.hidden, plain.inter, max(plain.tokens)
    stream = torch.cuda.Stream(device=device)
    problems: List[str] = []
    figures: Dict[str, Any] = {"replays": 0, "bit_equal": {"bf16": 0, "f32_acc": 0},
                               "fp64_checks": 0, "max_err": {"bf16": 0.0, "f32_acc": 0.0},
                               "shape": [e, h, n, t]}
    with torch.cuda.stream(stream):
        x = torch.randn(t, h, device=device, generator=gen).to(torch.bfloat16)
        dy = torch.randn(t, n, device=device, generator=gen).to(torch.bfloat16)
        offsets = device_offsets(random_counts(rng, e, t), device)
        out = torch.zeros(e, h, n, dtype=torch.bfloat16, device=device)
        acc = torch.zeros(e, h, n, dtype=torch.float32, device=device)
        base = torch.randn(e, h, n, device=device, generator=gen)
        gwt.wgrad(x, dy, offsets, out=out)  # eager first: plans cached, kernels loaded
        gwt.wgrad(x, dy, offsets, out=acc, accumulate=True)
    stream.synchronize()
    g_plain, g_acc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_plain, stream=stream):
        gwt.wgrad(x, dy, offsets, out=out)
    with torch.cuda.graph(g_acc, stream=stream):
        gwt.wgrad(x, dy, offsets, out=acc, accumulate=True)
    mem_start = None
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        for r in range(replays):
            counts = random_counts(rng, e, t)
            offsets.copy_(torch.from_numpy(offsets_of(counts)).pin_memory(), non_blocking=True)
            out.fill_(float("nan"))
            g_plain.replay()
            eager = gwt.wgrad(x, dy, offsets)
            acc.copy_(base)
            g_acc.replay()
            eager_acc = base.clone()
            gwt.wgrad(x, dy, offsets, out=eager_acc, accumulate=True)
            equal_plain = torch.equal(out, eager)
            equal_acc = torch.equal(acc, eager_acc)
            figures["replays"] += 1
            figures["bit_equal"]["bf16"] += int(equal_plain)
            figures["bit_equal"]["f32_acc"] += int(equal_acc)
            if not equal_plain or not equal_acc:
                problems.append(f"replay {r} counts {counts.tolist()}: not bit-equal to eager "
                                f"(bf16 {equal_plain}, f32 accumulate {equal_acc})")
            if fp64_every and r % fp64_every == 0:
                ref = reference_wgrad(x, dy, counts)
                err_p, pp = check_result(out, ref, counts, "bfloat16")
                err_a, pa = check_result(acc, ref, counts, "float32", base)
                figures["fp64_checks"] += 1
                figures["max_err"]["bf16"] = max(figures["max_err"]["bf16"], err_p)
                figures["max_err"]["f32_acc"] = max(figures["max_err"]["f32_acc"], err_a)
                problems += [f"replay {r} counts {counts.tolist()} {name}: {p}"
                             for name, ps in (("bf16", pp), ("f32 accumulate", pa)) for p in ps]
            if len(problems) > 10:
                problems.append("... stopped after 10 problems")
                break
            if r == min(9, replays - 1):
                stream.synchronize()
                mem_start = memory_sample(device)
    stream.synchronize()
    figures["seconds"] = round(time.perf_counter() - t0, 3)
    if mem_start is not None:
        mem_end = memory_sample(device)
        growth, mem_problems = memory_growth(mem_start, mem_end, alloc_tol_mib, driver_tol_mib)
        figures["memory"] = {"after_10_replays": mem_start, "end": mem_end, "growth": growth}
        problems += [f"graph replays: {p}" for p in mem_problems]
    figures["problems"] = problems
    return figures


# --- the run ----------------------------------------------------------------------------------

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="soak.py", description="Soak test of gwgrad: mixed calls from several threads "
        "and streams, flat memory, one kernel per spec, CUDA-graph replays with new offsets.")
    p.add_argument("--calls", type=int, default=10_000, help="mixed calls after the warm-up "
                   "(default 10000)")
    p.add_argument("--threads", type=int, default=4, help="Python threads, one CUDA stream "
                   "each (default 4)")
    p.add_argument("--verify-every", type=int, default=20, help="verify every N-th call of a "
                   "thread against FP64 (default 20; 0: never)")
    p.add_argument("--replays", type=int, default=1000, help="CUDA-graph replays of each "
                   "captured call (default 1000; 0: skip the graph phase)")
    p.add_argument("--fp64-every", type=int, default=50, help="check every N-th replay "
                   "against FP64 too (default 50)")
    p.add_argument("--fp8", choices=("auto", "on", "off"), default="auto", help="FP8 specs "
                   "(quantize + wgrad_fp8): auto = on an SM90 GPU only")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (the call mix on "
                   "gwgrad's reference; no memory, kernel or graph figures)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--alloc-tol-mib", type=float, default=1.0, help="allowed growth of "
                   "torch.cuda.memory_allocated (default 1 MiB)")
    p.add_argument("--driver-tol-mib", type=float, default=32.0, help="allowed growth of "
                   "driver memory in use (default 32 MiB: torch's allocator may keep a few more "
                   "2 MiB segments)")
    p.add_argument("--max-seconds", type=float, default=900.0, help="deadline for the whole "
                   "run (default 900)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every figure here")
    args = p.parse_args(argv)
    if args.calls < 0 or args.threads < 1 or args.replays < 0 or args.verify_every < 0:
        p.error("--calls, --replays and --verify-every must be >= 0, --threads >= 1")
    return args


def use_fp8(choice: str, device: torch.device) -> bool:
    if choice != "auto":
        return choice == "on"
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def summary_lines(report: Dict[str, Any]) -> List[str]:
    lines = [f"gwgrad soak on {report['device']}: {report['config']['threads']} threads, "
             f"{report['calls']['total']} calls (+{report['calls']['warmup']} warm-up) over "
             f"{len(report['specs'])} specs in {report['timings'].get('mixed_s', 0):.1f} s"]
    for name, n in report["calls"]["per_spec"].items():
        v = report["verification"]
        extra = (f", vs BF16 values {v['max_err_vs_bf16'][name]:.2e}"
                 if name in v["max_err_vs_bf16"] else "")
        lines.append(f"  {name:28s} {n:6d} calls, {v['per_spec'][name]:4d} verified, max "
                     f"error {v['max_err'][name]:.2e}{extra}")
    mem = report.get("memory")
    if isinstance(mem, dict) and "growth" in mem:
        w, e, g = mem["after_warmup"], mem["end"], mem["growth"]
        lines.append(f"memory_allocated {w['allocated']} -> {e['allocated']} B "
                     f"({g['allocated']:+d} B); driver free {w['driver_free'] / MIB:.1f} -> "
                     f"{e['driver_free'] / MIB:.1f} MiB (in use {g['driver_used']:+d} B, of "
                     f"which outside torch's allocator {g['outside_torch']:+d} B); reserved "
                     f"{g['reserved']:+d} B")
    k = report.get("kernels")
    if isinstance(k, dict) and "total" in k:
        t = k["total"]
        lines.append(f"kernels: {t['loaded']} loaded ({t['compiles']} compiled, "
                     f"{t['disk_hits']} from disk; DSL compile_count +{t['dsl_compile_count']}) "
                     f"for {k['expected']['total']} distinct specs ({k['expected']['gemm']} GEMM, "
                     f"{k['expected']['quantize']} quantizer); after warm-up: "
                     f"{k['after_warmup']['loaded']}")
    p = report.get("plans")
    if isinstance(p, dict) and "after_warmup" in p:
        lines.append(f"plan caches after warm-up {p['after_warmup']} -> end {p['end']}")
    g = report.get("graphs")
    if isinstance(g, dict) and "replays" in g:
        lines.append(f"CUDA graphs: {g['replays']} replays x 2; bit-equal to eager: bf16 "
                     f"{g['bit_equal']['bf16']}, f32 accumulate {g['bit_equal']['f32_acc']}; "
                     f"FP64 checks {g['fp64_checks']} (max error bf16 {g['max_err']['bf16']:.2e}, "
                     f"f32 {g['max_err']['f32_acc']:.2e}); {g['seconds']:.1f} s")
        if "memory" in g:
            gg = g["memory"]["growth"]
            lines.append(f"  memory over the replays: allocated {gg['allocated']:+d} B, driver in "
                         f"use {gg['driver_used']:+d} B")
    lines.append(f"check_errors: {report.get('check_errors', 'not run')}")
    for f in report["failures"]:
        lines.append(f"FAIL: {f}")
    lines.append("RESULT: " + ("PASS" if report["ok"] else "FAIL"))
    return lines


def write_json(path: Optional[str], report: Dict[str, Any]) -> None:
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1, default=str)
        os.replace(tmp, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    deadline = started + args.max_seconds
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("soak.py: no CUDA GPU (use --device cpu for the call mix on the CPU)",
                  file=sys.stderr)
            return 1
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    cuda = device.type == "cuda"
    specs = default_specs(use_fp8(args.fp8, device))
    expected = expected_kernels(list(specs) + list(graph_specs(specs)))
    report: Dict[str, Any] = {
        "ok": False, "failures": [],
        "device": (f"{torch.cuda.get_device_name(device)} (sm_"
                   f"{''.join(map(str, torch.cuda.get_device_capability(device)))})"
                   if cuda else "cpu"),
        "versions": {"gwgrad": gwgrad.__version__, "torch": torch.__version__,
                     "python": sys.version.split()[0]},
        "config": {k: v for k, v in vars(args).items()},
        "specs": [dataclasses.asdict(s) for s in specs],
        "timings": {},
    }
    soak = Soak(specs, device, args.threads, args.seed)
    counters0 = kernel_counters()
    failures: List[str] = []
    report_ok = True

    def finish() -> int:
        report["failures"] = failures + soak.failures
        report["ok"] = report_ok and not report["failures"]
        report["timings"]["total_s"] = round(time.monotonic() - started, 3)
        write_json(args.json, report)
        print("\n".join(summary_lines(report)), flush=True)
        return 0 if report["ok"] else 1

    # 1. warm-up: every spec and token total on every thread (compiles / loads the kernels)
    t0 = time.monotonic()
    warm = soak.warmup_plan()
    finished = soak.run(warm, deadline)
    report["timings"]["warmup_s"] = round(time.monotonic() - t0, 3)
    warmup_calls = sum(soak.thread_calls)
    counters1 = kernel_counters()
    plans1 = plan_cache_sizes()
    mem1 = memory_sample(device) if cuda and finished else None
    # 2. the mixed calls
    plan = make_schedule(args.calls, specs, args.threads, args.seed, args.verify_every)
    calls_before = dict(soak.calls)
    verified_before = dict(soak.verified)
    t0 = time.monotonic()
    if finished and not soak.failures:
        finished = soak.run(plan, deadline)
    report["timings"]["mixed_s"] = round(time.monotonic() - t0, 3)
    report["calls"] = {
        "total": sum(soak.calls.values()) - sum(calls_before.values()),
        "requested": args.calls, "warmup": warmup_calls,
        "per_spec": {k: soak.calls[k] - calls_before[k] for k in soak.calls},
        "per_thread": [n for n in soak.thread_calls]}
    report["verification"] = {
        "every": args.verify_every,
        "total_with_warmup": sum(soak.verified.values()),
        "per_spec": {k: soak.verified[k] - verified_before[k] for k in soak.verified},
        "max_err": soak.max_err, "max_err_vs_bf16": soak.max_err_vs_bf16,
        "tolerance": TOLERANCE, "fp8_tolerance": FP8_TOLERANCE, "fp8_vs_bf16": FP8_VS_BF16}
    if not finished:
        report_ok = False
        failures.append(f"deadline of {args.max_seconds} s passed")
        code = finish()
        os._exit(code)  # threads may be stuck in a launch
    soak.close()
    if report["calls"]["total"] != args.calls and not soak.failures:
        failures.append(f"{report['calls']['total']} calls ran, {args.calls} requested")
    plans2 = plan_cache_sizes()
    report["plans"] = {"after_warmup": plans1, "end": plans2}
    for key in ("adapter_plans", "core_plans", "wrapper_call_plans"):
        if plans2[key] != plans1[key]:
            failures.append(f"plan cache {key} grew after the warm-up: {plans1[key]} -> "
                            f"{plans2[key]}")
    if cuda:
        mem2 = memory_sample(device)
        growth, problems = memory_growth(mem1, mem2, args.alloc_tol_mib, args.driver_tol_mib)
        report["memory"] = {"after_warmup": mem1, "end": mem2, "growth": growth,
                            "tolerance_mib": {"allocated": args.alloc_tol_mib,
                                              "driver_used": args.driver_tol_mib}}
        failures.extend(problems)
        # 5. CUDA graphs
        if args.replays and not soak.failures:
            t0 = time.monotonic()
            try:
                report["graphs"] = graph_replays(specs, args.replays, args.fp64_every, args.seed,
                                                 device, args.alloc_tol_mib, args.driver_tol_mib)
                failures.extend(report["graphs"]["problems"])
            except Exception as exc:  # noqa: BLE001
                failures.append(f"CUDA graphs: {type(exc).__name__}: {exc}\n"
                                f"{traceback.format_exc(limit=6)}")
            report["timings"]["graphs_s"] = round(time.monotonic() - t0, 3)
        # 4. kernels (after the graphs: they must not load any either)
        counters3 = kernel_counters()
        report["kernels"] = {"expected": expected,
                             "total": counter_delta(counters0, counters3),
                             "after_warmup": counter_delta(counters1, counters3),
                             "warmup": counter_delta(counters0, counters1)}
        if not soak.failures:
            failures.extend(kernel_problems(report["kernels"]["total"],
                                            report["kernels"]["after_warmup"], expected))
    else:
        report["memory"] = report["kernels"] = report["graphs"] = "skipped (CPU)"
    # 6. device-side errors
    try:
        gwgrad.check_errors()
        report["check_errors"] = "clean"
    except Exception as exc:  # noqa: BLE001
        report["check_errors"] = f"{type(exc).__name__}: {exc}"
        failures.append(f"gwgrad.check_errors() raised {type(exc).__name__}: {exc}")
    return finish()


if __name__ == "__main__":
    sys.exit(main())
