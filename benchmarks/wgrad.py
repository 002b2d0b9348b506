"""`python -m benchmarks.wgrad` (or `python -m gwgrad bench`): gwgrad against what an H100/H200
user has today, on the MoE shapes of benchmarks/shapes.json.

Every row times, in one process, on the same inputs (x.T as M-major A, dy as N-major B, BF16
output) and in one interleaved round-robin (``time_interleaved``: CUDA events, warm-up,
medians):

* ``gwgrad``: the kernel through its launch plan (``gwgrad.plan_for`` + ``plan.launch`` with a
  preallocated workspace on torch's current stream: the kernel's own time), at the default
  tiling and at every ``--tiles`` value;
* ``adapter``: ``gwgrad.adapters.torch.wgrad(x, dy, offsets, out=w)``;
* ``wrapper``: the contract's ``grouped_gemm_wgrad_wrapper_sm100(a_tensor=x.T, b_tensor=dy, ...,
  offsets_tensor=..., wgrad_tensor=w)`` with default arguments, given a different offsets
  tensor (same values) every call, as a training step does;
* ``torch_grouped_mm``, a per-expert ``torch.mm`` loop, and one dense cuBLAS GEMM of equal
  FLOPs (hidden x intermediate x tokens_sum): the compute ceiling;
* QuACK (``quack-kernels``, the ``bench`` extra), when importable: its varlen-K GEMM
  ``quack.gemm_interface.gemm(A=x.T, B=dy, out=w, cu_seqlens_k=...)`` with its default
  config (``quack_default``: ``tuned=False``) and with its autotuner (``quack_tuned``), which
  times its SM90 configs on the first call of a shape (untimed here) and keeps the winner in
  memory and on disk (``$QUACK_CACHE_DIR``) by the tensors' shapes: the zipf row of a shape
  reuses the winner of its uniform row, as a training process would;
* ``copy``: a large device-to-device copy (bytes read + written): the HBM bandwidth, for the
  rows with many small experts, whose ceiling is the HBM roofline (see shapes.json's "about").

A method that fails is recorded with its error and the row goes on. The table is printed last;
the JSON holds everything (and a PNG plot is written when matplotlib is there).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SHAPES = os.path.join(HERE, "shapes.json")

#: Rows averaging at most this many tokens per expert are the "many small experts" rows: the
#: output write, not the multiply, bounds their time (their ceiling is the HBM roofline).
SMALL_EXPERT_TOKENS = 512
#: wrapper TFLOP/s over adapter TFLOP/s, on every row.
WRAPPER_TARGET = 0.97
#: How many distinct offsets tensors (same values) the wrapper rotates through.
OFFSETS_POOL = 16
#: Relative error (Frobenius) allowed against the cuBLAS loop: BF16 output rounding.
CHECK_TOLERANCE = 1e-2


# ----------------------------------------------------------------------------------------
# token distributions and the arithmetic (no GPU)
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


def hbm_bytes(hidden: int, intermediate: int, num_experts: int, tokens_sum: int,
              out_bytes: int = 2, accumulate: bool = False) -> int:
    """Bytes a grouped weight gradient must move at least (shapes.json's formula): A and B read
    once (BF16), the output written once (read and written when accumulating)."""
    out = out_bytes * num_experts * hidden * intermediate
    return 2 * (hidden + intermediate) * tokens_sum + (2 if accumulate else 1) * out


def is_small_experts(shape: Dict) -> bool:
    """A row with many small experts (at most SMALL_EXPERT_TOKENS tokens per expert on
    average), unless the shape says otherwise with a "small_experts" entry."""
    if "small_experts" in shape:
        return bool(shape["small_experts"])
    return shape["tokens_sum"] <= SMALL_EXPERT_TOKENS * shape["num_experts"]


def copy_bandwidth(copy_bytes: int, ms: float) -> float:
    """Bytes per second of a device-to-device copy of ``copy_bytes``: read + written."""
    return 2.0 * copy_bytes / (ms * 1e-3)


def roofline_fraction(nbytes: int, bandwidth: float, ms: float) -> float:
    """The share of the HBM roofline a method reached: (bytes / bandwidth) / its time."""
    return nbytes / bandwidth / (ms * 1e-3)


def _cumsum(xs):
    out, s = [], 0
    for v in xs:
        s += v
        out.append(s)
    return out


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


# ----------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------


def williams_rows(n: int) -> List[List[int]]:
    """A Williams design for n methods: rows (one per round) in which every method takes
    every position equally often and follows every other method equally often (n rows for
    an even n, 2n for an odd one). Row i is the base sequence 0, 1, n-1, 2, n-2, ... plus i
    (mod n); an odd n also takes each row reversed."""
    if n <= 0:
        return [[]]
    base, lo, hi = [0], 1, n - 1
    while len(base) < n:
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    rows = [[(b + i) % n for b in base] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return rows


def round_order(names: List[str], r: int) -> List[str]:
    """The methods' order in round ``r``: row r of a Williams design (williams_rows), so that
    over the rounds every method takes every position, and follows every other method,
    equally often. A fixed order lets the position bias a method's time by a few percent on
    the H200 (the first sample of a round follows the round's synchronize); rotating it
    balances the positions but gives each method the same predecessor in every round, which
    biases it by up to 13-25% when that predecessor draws more power (an MXFP8 kernel after a
    tensor-bound FP8 one)."""
    rows = williams_rows(len(names))
    return [names[i] for i in rows[r % len(rows)]]


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
    for r in range(rounds):
        for name in round_order(list(fns), r):
            fn = fns[name]
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(inner[name]):
                fn()
            e.record()
            samples[name].append((s, e, inner[name]))
        torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) / n for s, e, n in v)
            for name, v in samples.items()}


def time_methods(fns: Dict[str, Callable[[], object]], methods: Dict[str, Dict],
                 rounds: int = 10, sample_ms: float = 12.0,
                 timer: Optional[Callable] = None,
                 sync: Optional[Callable[[], None]] = None) -> Dict[str, float]:
    """``time_interleaved`` that one failing method cannot stop: each method is first called
    once and synchronized (a method that raises gets ``{"error": ...}`` in ``methods`` and is
    left out); if timing them together still fails, each is timed alone."""
    if timer is None:
        timer = time_interleaved
    if sync is None:
        import torch

        sync = torch.cuda.synchronize
    live = {}
    for name, fn in fns.items():
        try:
            fn()
            sync()
            live[name] = fn
        except Exception as exc:  # noqa: BLE001 - recorded, the row goes on
            methods[name] = {"error": _error(exc)}
    if not live:
        return {}
    try:
        return dict(timer(live, rounds=rounds, sample_ms=sample_ms))
    except Exception:  # noqa: BLE001 - find which one, time the others
        times = {}
        for name, fn in live.items():
            try:
                times.update(timer({name: fn}, rounds=rounds, sample_ms=sample_ms))
            except Exception as exc:  # noqa: BLE001
                methods[name] = {"error": _error(exc)}
        return times


# ----------------------------------------------------------------------------------------
# the methods
# ----------------------------------------------------------------------------------------


class KernelRunner:
    """gwgrad's kernel through its launch plan: ``gwgrad.plan_for`` once, then each call is
    ``plan.launch`` of fixed addresses with a preallocated workspace on the stream that was
    current at construction (torch's). No API layer, no per-call argument handling: its time
    is the kernel's. CPU tensors run the reference backend (synchronously)."""

    def __init__(self, a, b, offsets, out, mma_tiler_mn=None, accumulate: bool = False,
                 tuning: Tuple[Tuple[str, int], ...] = ()):
        """``tuning``: (StaticSpec tuning field, value) pairs replacing the default's (a
        sweep's variants: ``--tiles 128x128:epi_buffer_sets=2``)."""
        import torch

        import gwgrad
        from gwgrad.plan import PlanCache, compile_spec, plan_for_spec

        desc = gwgrad.as_tensor_desc
        tuning = dict(tuning)
        tiling = {}
        if mma_tiler_mn is not None:
            tiling = {"mma_tiler_mn": tuple(mma_tiler_mn),
                      "cluster_shape_mn": tuple(tuning.pop("cluster_shape_mn", (1, 1)))}
        descs = (desc(a, "a_tensor"), desc(b, "b_tensor"), desc(offsets, "offsets_tensor"),
                 desc(out, "wgrad_tensor"))
        self.plan = gwgrad.plan_for(*descs[:3], wgrad=descs[3], accumulate_on_output=accumulate,
                                    **tiling)
        if tuning:
            operator = compile_spec(self.plan.spec.with_tuning(**tuning))
            self.plan = plan_for_spec(operator, *descs, None, PlanCache())
        self.spec = self.plan.spec
        self.tile = tuple(self.spec.mma_tiler_mn)
        self.workspace = None
        self.stream = 0
        workspace = 0
        if a.is_cuda:
            self.stream = torch.cuda.current_stream(a.device).cuda_stream
            if self.plan.workspace_bytes:
                self.workspace = torch.zeros(self.plan.workspace_bytes, dtype=torch.uint8,
                                             device=a.device)
                workspace = self.workspace.data_ptr()
        self._addresses = (a.data_ptr(), b.data_ptr(), offsets.data_ptr(), out.data_ptr())
        self._keep = (a, b, offsets, out)  # the addresses stay valid while the runner lives
        self._launch = self.plan.launch
        self._options = {"stream": self.stream, "workspace": workspace}

    def __call__(self):
        self._launch(*self._addresses, **self._options)


class RowInputs:
    """One row's tensors: x (tokens, hidden), dy (tokens, intermediate), int32 offsets and a
    pool of distinct copies of them, one output per gwgrad path and the reference's.

    ``accumulate``: the main-grad path, every method adds into an FP32 output (gwgrad's
    ``accumulate_on_output=True``; torch: ``torch._grouped_mm`` then ``add_``, the loop
    ``out[e] += mm``); ``init`` is the value the check starts each output from."""

    def __init__(self, shape: Dict, dist: str, multiple: int, device: str = "cuda",
                 seed: int = 0, accumulate: bool = False):
        import torch

        self.hidden, self.intermediate = shape["hidden"], shape["intermediate"]
        self.num_experts, self.tokens_sum = shape["num_experts"], shape["tokens_sum"]
        self.counts = token_counts(self.tokens_sum, self.num_experts, dist, multiple)
        self.multiple = multiple
        self.device = torch.device(device)
        self.offsets = torch.tensor(_cumsum(self.counts), dtype=torch.int32, device=device)
        self.offsets_pool = [self.offsets.clone() for _ in range(OFFSETS_POOL)]
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        self.x = torch.randn(self.tokens_sum, self.hidden, device=device, dtype=torch.bfloat16,
                             generator=gen)
        self.dy = torch.randn(self.tokens_sum, self.intermediate, device=device,
                              dtype=torch.bfloat16, generator=gen)
        self.a, self.b = self.x.t(), self.dy  # M-major A, N-major B: a training step's layout
        self.starts = [0] + _cumsum(self.counts)[:-1]
        out_shape = (self.num_experts, self.hidden, self.intermediate)
        self.accumulate = accumulate
        out_dtype = torch.float32 if accumulate else torch.bfloat16
        names = ("gwgrad", "adapter", "wrapper", "reference") + (
            ("grouped_mm",) if accumulate else ("quack_default", "quack_tuned"))
        self.outs = {name: torch.zeros(out_shape, device=device, dtype=out_dtype)
                     for name in names}
        self.init = None
        if accumulate:  # what each output holds before the checked call
            self.init = torch.randn(out_shape, device=device, dtype=torch.float32,
                                    generator=gen)
        self.dense_out = torch.empty(self.hidden, self.intermediate, device=device,
                                     dtype=torch.bfloat16)

    @property
    def flops(self) -> float:
        return 2.0 * self.hidden * self.intermediate * self.tokens_sum

    def reset(self, out) -> None:
        """Before a checked call: NaN (every element must be written), or ``init`` when
        accumulating (every element must be added to)."""
        if self.accumulate:
            out.copy_(self.init)
        else:
            out.fill_(float("nan"))

    def mm_loop(self):
        import torch

        a, b, out = self.a, self.b, self.outs["reference"]
        pairs = list(zip(self.starts, self.counts))

        if self.accumulate:  # a BF16 product per expert, added into the FP32 output
            def loop():
                for i, (s, c) in enumerate(pairs):
                    out[i].add_(torch.mm(a[:, s:s + c], b[s:s + c]))
        else:
            def loop():
                for i, (s, c) in enumerate(pairs):
                    torch.mm(a[:, s:s + c], b[s:s + c], out=out[i])

        return loop

    def variant(self, cfg: Tuple, out=None, accumulate: Optional[bool] = None) -> "KernelRunner":
        """gwgrad's kernel in a parse_tile variant (tile, then tuning pairs) on this row's
        operands, into ``out`` (default: the gwgrad output), accumulating as the row does
        unless ``accumulate`` says otherwise."""
        return KernelRunner(self.a, self.b, self.offsets,
                            self.outs["gwgrad"] if out is None else out, mma_tiler_mn=cfg[:2],
                            accumulate=self.accumulate if accumulate is None else accumulate,
                            tuning=tuple(cfg[2:]))

    def adapter(self):
        import gwgrad.adapters.torch as gwt

        x, dy, offsets, out, wgrad = self.x, self.dy, self.offsets, self.outs["adapter"], gwt.wgrad
        acc = self.accumulate
        return lambda: wgrad(x, dy, offsets, out=out, accumulate=acc)

    def wrapper(self):
        """The contract's wrapper as a training step calls it: default arguments, x.T taken in
        the call, a different offsets tensor (same values) every call."""
        import gwgrad

        x, dy, out = self.x, self.dy, self.outs["wrapper"]
        pool = itertools.cycle(self.offsets_pool)
        call = gwgrad.grouped_gemm_wgrad_wrapper_sm100
        acc = self.accumulate

        def wrapper():
            call(a_tensor=x.T, b_tensor=dy, sfa_tensor=None, sfb_tensor=None,
                 offsets_tensor=next(pool), wgrad_tensor=out, accumulate_on_output=acc)

        return wrapper

    def grouped_mm(self):
        import torch

        a, b, offsets = self.a, self.b, self.offsets
        if self.accumulate:  # what a torch user adds into FP32 main grads; returns them
            out = self.outs["grouped_mm"]
            return lambda: out.add_(torch._grouped_mm(a, b, offs=offsets))
        return lambda: torch._grouped_mm(a, b, offs=offsets)

    def quack(self, tuned: bool):
        """QuACK's varlen-K GEMM into a BF16 output of its own: ``tuned`` with its autotuner
        (its winner for these shapes), else its default config."""
        import torch
        from quack.gemm_interface import gemm

        if self.accumulate:
            raise NotImplementedError("QuACK is timed on the BF16-output rows only")
        cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int32, device=self.device),
                                self.offsets])
        a, b = self.a, self.b
        out = self.outs["quack_tuned" if tuned else "quack_default"]
        return lambda: gemm(a, b, out=out, cu_seqlens_k=cu_seqlens, tuned=tuned)

    def dense(self):
        import torch

        a, b, out = self.a, self.b, self.dense_out
        return lambda: torch.mm(a, b, out=out)  # one GEMM with the same FLOPs


class CopyBuffers:
    """Two device buffers of ``nbytes``: ``dst.copy_(src)`` measures the HBM bandwidth."""

    def __init__(self, nbytes: int, device: str = "cuda"):
        import torch

        self.nbytes = int(nbytes) // 16 * 16
        self.src = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.dst = torch.empty_like(self.src)
        self.src.fill_(1)

    def __call__(self):
        self.dst.copy_(self.src)


def quack_available() -> bool:
    """Whether QuACK's GEMM imports (the ``bench`` extra on a GPU machine)."""
    try:
        import quack.gemm_interface  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or no GPU build: the column stays empty
        return False
    return True


def build_methods(inp: RowInputs, configs: List, row: Dict,
                  copy: Optional[CopyBuffers] = None, gwgrad_only: bool = False):
    """The row's callables by method name, and gwgrad's default KernelRunner (None if it
    failed). A method that cannot be built gets ``{"error": ...}`` in ``row["methods"]``.
    ``gwgrad_only``: the kernel variants alone (a tuning sweep: nothing else shares the GPU's
    power budget between their samples)."""
    import torch

    fns: Dict[str, Callable[[], object]] = {}
    meth = row["methods"]

    def add(name, make):
        try:
            fns[name] = make()
        except Exception as exc:  # noqa: BLE001 - recorded, the row goes on
            meth[name] = {"error": _error(exc)}

    default = None
    try:
        default = KernelRunner(inp.a, inp.b, inp.offsets, inp.outs["gwgrad"],
                               accumulate=inp.accumulate)
        row["gwgrad_config"] = list(default.tile)
        spec = default.spec
        row["gwgrad_tuning"] = {"cluster_shape_mn": list(spec.cluster_shape_mn),
                                "raster_group": spec.raster_group, "epi_tile_n": spec.epi_tile_n,
                                "epi_buffer_sets": spec.epi_buffer_sets,
                                "launches": spec.launches, "unit_schedule": spec.unit_schedule}
        fns["gwgrad_{}x{}".format(*default.tile)] = default
    except Exception as exc:  # noqa: BLE001
        meth["gwgrad"] = {"error": _error(exc)}
    for cfg in configs:
        name = config_name(cfg)
        cluster = dict(cfg[2:]).get("cluster_shape_mn", (1, 1))
        if (name in fns and default is not None and len(cfg) == 2
                and tuple(default.spec.cluster_shape_mn) != cluster):
            # "MxN" is the default's name too, but the default runs a CTA pair there.
            name += ":cluster=1x1"
        if name not in fns:  # a tile this shape cannot use is recorded as an error
            add(name, lambda cfg=cfg: inp.variant(cfg))
    if gwgrad_only:
        return fns, default
    add("adapter", inp.adapter)
    add("wrapper", inp.wrapper)
    if inp.device.type == "cuda" and hasattr(torch, "_grouped_mm") and inp.multiple % 16 == 0:
        add("torch_grouped_mm", inp.grouped_mm)
    add("torch_mm_loop", inp.mm_loop)
    add("dense_cublas", inp.dense)
    if inp.device.type == "cuda" and not inp.accumulate and quack_available():
        add("quack_default", lambda: inp.quack(tuned=False))
        add("quack_tuned", lambda: inp.quack(tuned=True))
    if copy is not None:
        fns["copy"] = copy
    return fns, default


def record_times(row: Dict, times: Dict[str, float], flops: float, copy_bytes: int = 0) -> None:
    """``row["methods"][name]``: the median milliseconds and TFLOP/s of each method (GB/s of
    moved bytes for the copy)."""
    meth = row["methods"]
    for name, ms in times.items():
        entry = {"ms": ms}
        if name == "copy":
            entry.update(bytes=2 * copy_bytes, gbps=copy_bandwidth(copy_bytes, ms) / 1e9)
        else:
            entry["tflops"] = flops / ms / 1e9
        meth[name] = entry


def summarize(row: Dict, times: Dict[str, float], copy_bytes: int = 0) -> Dict:
    """Fill ``row`` from the methods' median milliseconds: TFLOP/s, the ratios and the HBM
    roofline. Ratios are TFLOP/s over TFLOP/s (= time over time, inverted): ratio_vs_X =
    gwgrad / X (> 1: gwgrad faster); wrapper_over_adapter = wrapper / adapter."""
    m, n, t = row["hidden"], row["intermediate"], row["tokens_sum"]
    record_times(row, times, 2.0 * m * n * t, copy_bytes)
    meth = row["methods"]
    tiles = {k: v for k, v in times.items() if k.startswith("gwgrad_")}
    default = "gwgrad_{}x{}".format(*row["gwgrad_config"]) if row.get("gwgrad_config") else None
    if default in times:
        meth["gwgrad"] = dict(meth[default])
        best = min(tiles, key=tiles.get)
        config = parse_tile(best[len("gwgrad_"):])
        row["gwgrad_best_config"] = list(config[:2])
        if config[2:]:
            row["gwgrad_best_tuning"] = dict(config[2:])
        row["gwgrad_best_vs_default"] = times[default] / times[best]

    def ms(k):
        return meth.get(k, {}).get("ms")

    for comp in ("torch_grouped_mm", "torch_mm_loop", "dense_cublas", "quack_default",
                 "quack_tuned"):
        if ms("gwgrad") and ms(comp):
            row[f"ratio_vs_{comp}"] = ms(comp) / ms("gwgrad")
    if ms("wrapper") and ms("adapter"):
        row["wrapper_over_adapter"] = ms("adapter") / ms("wrapper")
    if ms("adapter") and ms("gwgrad"):
        row["adapter_over_gwgrad"] = ms("gwgrad") / ms("adapter")
    # Accumulating: the FP32 outputs of the experts with tokens, read and written (an empty
    # expert's need not be touched); otherwise every expert's output is written (zeros).
    acc = bool(row.get("accumulate"))
    experts = row.get("nonempty_experts", row["num_experts"]) if acc else row["num_experts"]
    hbm = {"bytes": hbm_bytes(m, n, experts, t, out_bytes=4 if acc else 2, accumulate=acc)}
    if ms("copy") and copy_bytes:
        bandwidth = copy_bandwidth(copy_bytes, ms("copy"))
        hbm["copy_gbps"] = bandwidth / 1e9
        hbm["roofline_ms"] = hbm["bytes"] / bandwidth * 1e3
        hbm["fraction"] = {k: roofline_fraction(hbm["bytes"], bandwidth, ms(k))
                           for k in ("gwgrad", "adapter", "wrapper", "torch_grouped_mm",
                                     "torch_mm_loop", "dense_cublas") if ms(k)}
    row["hbm"] = hbm
    return row


def _rel_err(got, want, rows=None) -> float:
    if rows is not None:
        got, want = got[rows], want[rows]
    want = want.float()
    return ((got.float() - want).norm() / want.norm().clamp_min(1e-30)).item()


def check_row(row: Dict, inp: RowInputs, fns: Dict[str, Callable[[], object]],
              default: Optional[KernelRunner]) -> None:
    """Each gwgrad path (kernel, adapter, wrapper) into a NaN-filled output (accumulating:
    into ``inp.init``), against the per-expert cuBLAS loop (FP32 accumulation); and
    torch._grouped_mm (+ add) against it too."""
    import torch

    import gwgrad

    sync = torch.cuda.synchronize if inp.device.type == "cuda" else (lambda: None)
    errs = row["rel_err"] = {}
    ref = inp.outs["reference"]
    try:
        inp.reset(ref)
        inp.mm_loop()()
        sync()
    except Exception as exc:  # noqa: BLE001
        row["check_error"] = "reference loop: " + _error(exc)
        return
    paths = (("gwgrad", default), ("adapter", fns.get("adapter")), ("wrapper", fns.get("wrapper")))
    for name, fn in paths:
        if fn is None or "error" in row["methods"].get(name, {}):
            continue
        out = inp.outs[name]
        try:
            inp.reset(out)
            fn()
            sync()
            gwgrad.check_errors()  # a device-side offsets check that failed
            errs[name] = _rel_err(out, ref)
        except Exception as exc:  # noqa: BLE001
            errs[name] = float("nan")
            row.setdefault("check_errors", {})[name] = _error(exc)
    if "torch_grouped_mm" in fns and "error" not in row["methods"].get("torch_grouped_mm", {}):
        try:  # experts without tokens: whatever _grouped_mm leaves there is not compared
            nonempty = torch.tensor([c > 0 for c in inp.counts], device=ref.device)
            if inp.accumulate:
                inp.reset(inp.outs["grouped_mm"])
            grouped = fns["torch_grouped_mm"]()
            errs["torch_grouped_mm"] = _rel_err(grouped, ref, nonempty)
            if "gwgrad" in errs:
                errs["gwgrad_vs_grouped_mm"] = _rel_err(inp.outs["gwgrad"], grouped, nonempty)
            del grouped
        except Exception as exc:  # noqa: BLE001
            row.setdefault("check_errors", {})["torch_grouped_mm"] = _error(exc)
    for name in ("quack_default", "quack_tuned"):  # a wrong competitor's speed is flagged
        if name in fns and "error" not in row["methods"].get(name, {}):
            try:
                nonempty = torch.tensor([c > 0 for c in inp.counts], device=ref.device)
                inp.reset(inp.outs[name])
                fns[name]()
                sync()
                errs[name] = _rel_err(inp.outs[name], ref, nonempty)
                if not errs[name] < CHECK_TOLERANCE:
                    row.setdefault("peer_check_failed", []).append(name)
            except Exception as exc:  # noqa: BLE001
                row.setdefault("check_errors", {})[name] = _error(exc)
    if "gwgrad" in errs:
        row["rel_err_vs_loop"] = errs["gwgrad"]
    bad = [k for k in ("gwgrad", "adapter", "wrapper") if k in errs
           and not errs[k] < CHECK_TOLERANCE]
    if bad:
        row["check_failed"] = bad


def new_row(shape: Dict, dist: str) -> Dict:
    return {"name": shape["name"], "dist": dist, "hidden": shape["hidden"],
            "intermediate": shape["intermediate"], "num_experts": shape["num_experts"],
            "tokens_sum": shape["tokens_sum"], "small_experts": is_small_experts(shape),
            "methods": {}}


def run_row(shape: Dict, dist: str, configs: List, multiple: int, check: bool,
            copy: Optional[CopyBuffers] = None, rounds: int = 10,
            sample_ms: float = 12.0, device: str = "cuda",
            timer: Optional[Callable] = None, accumulate: bool = False,
            gwgrad_only: bool = False) -> Dict:
    """One row: inputs, every method, timed together, summarized and cross-checked.
    (``device="cpu"`` with a ``timer`` stand-in checks the wiring without a GPU.)"""
    import torch

    on_gpu = device != "cpu"
    row = new_row(shape, dist)
    row["accumulate"] = accumulate
    inp = RowInputs(shape, dist, multiple, device=device, accumulate=accumulate)
    row.update(max_count=max(inp.counts), min_count=min(inp.counts),
               nonempty_experts=sum(1 for c in inp.counts if c > 0))
    fns, default = build_methods(inp, configs, row, None if gwgrad_only else copy, gwgrad_only)
    times = time_methods(fns, row["methods"], rounds=rounds, sample_ms=sample_ms, timer=timer,
                         sync=torch.cuda.synchronize if on_gpu else (lambda: None))
    summarize(row, times, copy.nbytes if copy is not None else 0)
    if check:
        check_row(row, inp, fns, default)
    del fns, default, inp
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return row


# ----------------------------------------------------------------------------------------
# reporting
# ----------------------------------------------------------------------------------------


def format_table(rows: List[Dict]) -> str:
    head = (f"{'shape':<14} {'dist':<7} {'gwgrad':>7} {'adapter':>7} {'wrapper':>7} "
            f"{'grp_mm':>7} {'mm_loop':>7} {'dense':>7}  {'w/a':>5} {'x grp':>5} "
            f"{'x loop':>6} {'x dense':>7} {'x qk':>5} {'x qkT':>5} {'HBM%':>5} {'tile':>7} "
            f"{'check':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        meth = r.get("methods", {})

        def tf(k):
            v = meth.get(k, {}).get("tflops")
            return f"{v:7.1f}" if v is not None else f"{'err' if 'error' in meth.get(k, {}) else '-':>7}"

        def ratio(v, width):
            return f"{v:{width}.2f}" if v is not None else f"{'-':>{width}}"

        frac = r.get("hbm", {}).get("fraction", {}).get("gwgrad")
        shown = r.get("small_experts") or r.get("accumulate")
        hbm = f"{100 * frac:4.0f}%" if frac is not None and shown else f"{'-':>5}"
        tile = "x".join(map(str, r.get("gwgrad_config", []))) or "-"
        if "error" in r:
            check = "ERR"
        elif r.get("check_failed"):
            check = "FAIL"
        elif r.get("rel_err"):
            check = "ok"
        else:
            check = "-"
        lines.append(
            f"{r['name']:<14} {r['dist']:<7} {tf('gwgrad')} {tf('adapter')} {tf('wrapper')} "
            f"{tf('torch_grouped_mm')} {tf('torch_mm_loop')} {tf('dense_cublas')}  "
            f"{ratio(r.get('wrapper_over_adapter'), 5)} "
            f"{ratio(r.get('ratio_vs_torch_grouped_mm'), 5)} "
            f"{ratio(r.get('ratio_vs_torch_mm_loop'), 6)} "
            f"{ratio(r.get('ratio_vs_dense_cublas'), 7)} "
            f"{ratio(r.get('ratio_vs_quack_default'), 5)} "
            f"{ratio(r.get('ratio_vs_quack_tuned'), 5)} {hbm} {tile:>7} {check:>5}")
    lines.append("(TFLOP/s. w/a: wrapper / adapter (target >= %.2f); x grp, x loop, x dense, "
                 "x qk (QuACK default), x qkT (QuACK autotuned): gwgrad / competitor (> 1: "
                 "gwgrad faster); HBM%%: share of the HBM roofline "
                 "(bytes / measured copy bandwidth), rows with many small experts)"
                 % WRAPPER_TARGET)
    if any(r.get("accumulate") for r in rows):
        lines.append("(accumulating into FP32 outputs, the main-grad path: gwgrad "
                     "accumulate_on_output=True; grp_mm: torch._grouped_mm + add_, mm_loop: "
                     "out[e] += mm per expert; dense: one BF16 GEMM of equal FLOPs, no "
                     "output read; HBM%: every row, the output read and written in FP32)")
    return "\n".join(lines)


def format_variants(rows: List[Dict]) -> str:
    """gwgrad's variants per row (the default and each --tiles entry): TFLOP/s, and each
    variant's rate over the default's (> 1: the variant is faster). Empty without variants."""
    names = []
    for r in rows:
        for k in r.get("methods", {}):
            if k.startswith("gwgrad_") and k not in names:
                names.append(k)
    if len(names) < 2:
        return ""
    head = f"{'shape':<14} {'dist':<7} {'default':>9}  " + "  ".join(
        f"{k[len('gwgrad_'):]}" for k in names)
    lines = ["gwgrad variants, TFLOP/s (x default):", head]
    for r in rows:
        meth = r.get("methods", {})
        default = "gwgrad_{}x{}".format(*r["gwgrad_config"]) if r.get("gwgrad_config") else None
        base = meth.get(default, {}).get("tflops")
        cells = []
        for k in names:
            v = meth.get(k, {}).get("tflops")
            if v is None:
                cells.append("err" if "error" in meth.get(k, {}) else "-")
            else:
                cells.append(f"{v:.1f}" + (f" ({v / base:.3f})" if base else ""))
        label = default[len("gwgrad_"):] if default else "-"
        lines.append(f"{r['name']:<14} {r['dist']:<7} {label:>9}  " + "  ".join(cells))
    return "\n".join(lines)


#: The competitors summarized over the rows (gwgrad's rate over theirs).
PEERS = ("torch_grouped_mm", "quack_default", "quack_tuned", "dense_cublas")


def peer_summary(rows: List[Dict], comp: str) -> Optional[Dict]:
    """gwgrad / ``comp`` over the rows that timed both: the worst row, the geometric mean and
    how many rows (None when no row did)."""
    got = [(f"{r['name']}/{r['dist']}", r[f"ratio_vs_{comp}"]) for r in rows
           if f"ratio_vs_{comp}" in r]
    if not got:
        return None
    worst = min(got, key=lambda kv: kv[1])
    return {"rows": len(got), "min": worst[1], "min_row": worst[0],
            "geomean": statistics.geometric_mean(v for _, v in got)}


def summary(rows: List[Dict]) -> Dict:
    """What the issue asks to see, over every row: the worst wrapper/adapter ratio, the HBM
    roofline shares of the small-expert rows, the copy bandwidth, failures."""
    wa = [r["wrapper_over_adapter"] for r in rows if "wrapper_over_adapter" in r]
    copies = [r["methods"]["copy"]["gbps"] for r in rows if "gbps" in r["methods"].get("copy", {})]
    out = {
        "rows": len(rows),
        "accumulate": any(r.get("accumulate") for r in rows),
        "wrapper_over_adapter_min": min(wa) if wa else None,
        "wrapper_target": WRAPPER_TARGET,
        "wrapper_target_met": bool(wa) and min(wa) >= WRAPPER_TARGET and len(wa) == len(rows),
        "copy_gbps_median": statistics.median(copies) if copies else None,
        "peers": {comp: peer_summary(rows, comp) for comp in PEERS},
        "hbm_fraction_small_experts": {
            f"{r['name']}/{r['dist']}": r["hbm"]["fraction"]["gwgrad"] for r in rows
            if r.get("small_experts") and "gwgrad" in r.get("hbm", {}).get("fraction", {})},
        "check_failed": [f"{r['name']}/{r['dist']}" for r in rows if r.get("check_failed")],
        "peer_check_failed": [f"{r['name']}/{r['dist']}: {', '.join(r['peer_check_failed'])}"
                              for r in rows if r.get("peer_check_failed")],
        "errors": [f"{r['name']}/{r['dist']}: {k}: {v['error'][:200]}" for r in rows
                   for k, v in r.get("methods", {}).items() if "error" in v]
                  + [f"{r['name']}/{r['dist']}: {r['error'][:200]}" for r in rows if "error" in r],
    }
    return out


def format_summary(s: Dict) -> str:
    lines = []
    wa = s.get("wrapper_over_adapter_min")
    if wa is not None:  # (a --gwgrad-only sweep times no wrapper)
        lines.append(f"wrapper/adapter, worst row: {wa:.3f} "
                     f"(target >= {s['wrapper_target']:.2f}: "
                     f"{'met' if s['wrapper_target_met'] else 'NOT met'})")
    if s.get("copy_gbps_median"):
        lines.append(f"copy bandwidth (read + write, median over rows): "
                     f"{s['copy_gbps_median']:.0f} GB/s")
    for comp, peer in (s.get("peers") or {}).items():
        if peer:
            lines.append(f"gwgrad / {comp}: geomean {peer['geomean']:.3f}, worst "
                         f"{peer['min']:.3f} ({peer['min_row']}), {peer['rows']} rows")
    mode = ", FP32 accumulate" if s.get("accumulate") else ""
    for key, frac in s.get("hbm_fraction_small_experts", {}).items():
        lines.append(f"HBM roofline reached, {key}{mode}: {100 * frac:.1f}%")
    if s.get("check_failed"):
        lines.append("CHECK FAILED: " + ", ".join(s["check_failed"]))
    if s.get("peer_check_failed"):
        lines.append("a competitor's result is wrong (its ratio means nothing): "
                     + "; ".join(s["peer_check_failed"]))
    for e in s.get("errors", [])[:20]:
        lines.append("error: " + e)
    return "\n".join(lines)


def progress_line(i: int, n: int, row: Dict) -> str:
    meth = row.get("methods", {})

    def tf(k):
        v = meth.get(k, {}).get("tflops")
        return "-" if v is None else f"{v:.0f}"

    wa = row.get("wrapper_over_adapter")
    err = f" ERROR {row['error'][:160]}" if "error" in row else ""
    return (f"[{i}/{n}] {row['name']} {row['dist']}: gwgrad {tf('gwgrad')} adapter "
            f"{tf('adapter')} wrapper {tf('wrapper')} grouped_mm {tf('torch_grouped_mm')} "
            f"dense {tf('dense_cublas')} TFLOP/s, w/a {'-' if wa is None else f'{wa:.3f}'}, "
            f"{row.get('seconds', 0):.1f} s{err}")


def plot(rows: List[Dict], path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - the plot is optional
        return None
    methods = ["gwgrad", "adapter", "wrapper", "torch_grouped_mm", "torch_mm_loop",
               "dense_cublas"]
    labels = [f"{r['name']}\n{r['dist']}" for r in rows]
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(rows)), 4.5))
    for i, meth in enumerate(methods):
        vals = [r.get("methods", {}).get(meth, {}).get("tflops", 0.0) for r in rows]
        offset = (i - (len(methods) - 1) / 2) * width
        ax.bar([j + offset for j in range(len(rows))], vals, width, label=meth)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=6)
    ax.set_ylabel("TFLOP/s")
    acc = any(r.get("accumulate") for r in rows)
    ax.set_title("grouped weight gradient (BF16, M-major A, N-major B"
                 + (", accumulated into FP32)" if acc else ")"))
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------
# the command
# ----------------------------------------------------------------------------------------


#: StaticSpec fields a --tiles entry may set (``MxN:field=value``; ``cluster=MxN`` sets
#: cluster_shape_mn; ``launches=2``: the prep kernel then the GEMM, against the default single
#: launch; ``unit_schedule=3``: units handed out statically (no counter, no cluster hand-off)
#: when the counts are balanced, else dynamically; 1: the dynamic counter; ``mainloop=2``:
#: MXFP8 on SM90 dequantized to BF16, then the BF16 kernel, benchmarks/fp8.py).
TUNING_FIELDS = ("raster_group", "epi_tile_n", "epi_buffer_sets", "cluster", "launches",
                 "unit_schedule", "mainloop")


def parse_tile(s: str) -> Tuple:
    """``"MxN"`` -> (M, N); ``"MxN:field=value[:...]"`` -> (M, N, (field, value), ...): a tile
    and tuning that replaces the backend's default (fields: TUNING_FIELDS)."""
    head, *options = s.lower().split(":")
    m, n = head.split("x")
    tuning = []
    for option in options:
        field, _, value = option.partition("=")
        if field not in TUNING_FIELDS:
            raise ValueError(f"unknown tuning field {field!r} in {s!r} (known: "
                             f"{', '.join(TUNING_FIELDS)})")
        if field == "cluster":
            cm, cn = value.split("x")
            tuning.append(("cluster_shape_mn", (int(cm), int(cn))))
        else:
            tuning.append((field, int(value)))
    return (int(m), int(n), *tuning)


def config_name(cfg: Tuple) -> str:
    """The method name of a parse_tile result: gwgrad_MxN[:field=value...]."""
    def option(field, value):
        if field == "cluster_shape_mn":
            return f":cluster={value[0]}x{value[1]}"
        return f":{field}={value}"

    return f"gwgrad_{cfg[0]}x{cfg[1]}" + "".join(option(f, v) for f, v in cfg[2:])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.wgrad", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="shapes JSON (default: benchmarks/shapes.json)")
    p.add_argument("--rows", default="", help="comma-separated shape names (default: all)")
    p.add_argument("--dist", default="uniform,zipf")
    p.add_argument("--tiles", default="128x256,128x128",
                   help="gwgrad mma_tiler_mn values timed besides the default tiling (the "
                        "table reports the default; the JSON has every tile and the best); "
                        "MxN:field=value sets a tuning field too (%s), e.g. "
                        "128x128:epi_buffer_sets=2" % ", ".join(TUNING_FIELDS))
    p.add_argument("--unrounded", action="store_true",
                   help="counts not rounded to 256 (torch._grouped_mm is skipped)")
    p.add_argument("--accumulate", action="store_true",
                   help="the main-grad path: every method adds into an FP32 output (gwgrad "
                        "accumulate_on_output=True against torch._grouped_mm + add_)")
    p.add_argument("--gwgrad-only", action="store_true",
                   help="time gwgrad's default and --tiles variants alone (a tuning sweep: no "
                        "competitors, adapters or copy between their samples)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness cross-check")
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds per row")
    p.add_argument("--sample-ms", type=float, default=12.0, help="milliseconds per sample")
    p.add_argument("--copy-gib", type=float, default=2.0,
                   help="size of the device-to-device copy timed for the HBM roofline (0: none)")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds: rows not started by then are skipped (0: no limit)")
    p.add_argument("--json", default="bench_results.json")
    p.add_argument("--plot", default="bench_results.png", help="PNG path ('' for none)")
    return p


def select_shapes(path: str, rows: str) -> List[Dict]:
    with open(path) as f:
        shapes = json.load(f)["shapes"]
    if rows:
        wanted = [r for r in rows.split(",") if r]
        unknown = sorted(set(wanted) - {s["name"] for s in shapes})
        if unknown:
            raise SystemExit(f"--rows: unknown shape(s) {unknown}; known: "
                             f"{[s['name'] for s in shapes]}")
        shapes = [s for s in shapes if s["name"] in set(wanted)]
    return shapes


def _write(path: str, payload: Dict) -> None:
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(tmp, path)


def main(argv: Optional[List[str]] = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    shapes = select_shapes(args.shapes, args.rows)
    dists = [d for d in args.dist.split(",") if d]
    try:
        for d in dists:
            token_counts(256, 1, d)  # an unknown distribution fails here, before the GPU work
        tiles = [parse_tile(s) for s in args.tiles.split(",") if s]
    except ValueError as exc:
        p.error(f"--dist / --tiles: {exc}")

    import torch

    import gwgrad

    if not torch.cuda.is_available():
        print("no CUDA GPU: the benchmark needs one", file=sys.stderr)
        return 2
    multiple = 8 if args.unrounded else 256
    device = torch.cuda.get_device_name()
    print(f"device: {device}  torch {torch.__version__}  gwgrad {gwgrad.__version__}", flush=True)
    payload = {"device": device, "torch": torch.__version__, "gwgrad": gwgrad.__version__,
               "unrounded": args.unrounded, "accumulate": args.accumulate,
               "gwgrad_only": args.gwgrad_only,
               "settings": {"rounds": args.rounds, "sample_ms": args.sample_ms,
                            "tiles": args.tiles, "copy_gib": args.copy_gib,
                            "offsets_pool": OFFSETS_POOL},
               "targets": {"wrapper_over_adapter": WRAPPER_TARGET},
               "rows": []}
    copy = None
    if args.copy_gib > 0:
        try:
            copy = CopyBuffers(int(args.copy_gib * 2 ** 30))
        except Exception as exc:  # noqa: BLE001 - the rest runs without the roofline
            payload["copy_error"] = _error(exc)
            print(f"copy buffers: {payload['copy_error']}", flush=True)
    rows = payload["rows"]
    t0 = time.time()
    todo = [(shape, dist) for shape in shapes for dist in dists]
    for i, (shape, dist) in enumerate(todo, 1):
        if args.time_budget and time.time() - t0 > args.time_budget:
            row = new_row(shape, dist)
            row["error"] = f"skipped: --time-budget {args.time_budget:.0f} s spent"
            rows.append(row)
            print(progress_line(i, len(todo), row), flush=True)
            continue
        start = time.time()
        try:
            row = run_row(shape, dist, tiles, multiple, not args.no_check, copy,
                          rounds=args.rounds, sample_ms=args.sample_ms,
                          accumulate=args.accumulate, gwgrad_only=args.gwgrad_only)
        except Exception as exc:  # noqa: BLE001 - one row must not stop the others
            row = new_row(shape, dist)
            row["error"] = _error(exc)
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001 - a broken context: the next rows say so
                pass
        row["seconds"] = time.time() - start
        rows.append(row)
        print(progress_line(i, len(todo), row), flush=True)
        payload["seconds"] = time.time() - t0
        _write(args.json, payload)  # what was measured survives a timeout
    payload["summary"] = summary(rows)
    payload["seconds"] = time.time() - t0
    _write(args.json, payload)
    if args.plot:
        try:
            plot(rows, args.plot)
        except Exception as exc:  # noqa: BLE001 - the plot is optional
            print(f"plot: {_error(exc)}")
    print()
    print(format_summary(payload["summary"]))
    print(format_table(rows))
    variants = format_variants(rows)
    if variants:
        print(variants)
    if args.json:
        print(f"wrote {args.json} ({payload['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
