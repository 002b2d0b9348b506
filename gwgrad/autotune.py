"""The autotuner (opt-in): time the candidate tilings of a call's signature once, on the device,
and keep the winner beside the kernel cache, so that later calls and processes use it.

By default a tiling comes from the backends' rule tables (gwgrad/backends/tuning_rules.py),
measured on the benchmark's shapes. For other shapes, ``gwgrad.autotune(...)`` (the wrapper's
arguments) or ``GWGRAD_AUTOTUNE=1`` times the candidates on the call's own operands instead.

* **Signature**: the request (the ``StaticSpec`` of the call with the tiling as the caller gave
  it: the problem, its architecture and the caller's tile / cluster), ``tokens_sum`` and the
  device's name. One winner per signature; the token distribution timed is the first call's.
* **Candidates** (``candidates``): every (mma_tiler_mn, cluster_shape_mn) of the backend's
  tile table (``TABLES``: kernels/tiling.py's SM90_TILES, SM90_FP8_TILES, the SM100
  block-scaled tiles, crossed with the architecture's clusters) that ``finalize_spec``
  (``check_support``) accepts for the request, the other tuning fields filled by the rules as
  without the tuner. A tile or cluster the caller gave is kept (only the open one is tuned;
  both given: nothing to tune). The rules' default is always the first candidate. Kept
  besides: candidates whose cluster tile pads the output by at most ``PADDING_SLACK`` more
  than the least padded one (a tile that computes a quarter of padding does not win), at most
  ``MAX_CANDIDATES`` in all (each costs a compile, seconds, on the first tuning of a
  signature), in eighths of padding, least first, then larger cluster tiles first (fewer
  operand bytes per FLOP); only the SM90 BF16 table reaches the cap (21 tilings on a shape
  that pads little), where it drops the smallest cluster tiles (64x128 on one CTA first; the
  default stays whatever it is). SM100 BF16 runs more tile widths
  than its table's (multiples of 32): the tuner tries the table's four (N 128 or 256).
* **Timing** (``measure``): after a device synchronization (whatever produced the operands is
  done), the offsets are checked on the host (invalid ones raise the wrapper's
  ``ArgumentError``); each candidate is compiled (through the kernel cache) and launched on the
  call's A, B, offsets and scales (read only) into a scratch output of the call's layout and a
  zeroed scratch workspace of its own, never the caller's output (an accumulated output keeps
  every byte). ``WARMUP`` launches, then ``ROUNDS`` samples per candidate between CUDA events,
  each of back-to-back launches lasting about ``SAMPLE_MS``, the candidates taking turns
  (round-robin, the start rotated and the direction alternated every round) so that clock and
  temperature drift bias none; each candidate's time is its median. A candidate that fails to
  compile or launch is skipped and recorded with its error, never fatal. The winner is the
  fastest, unless the rules' default is within ``MARGIN`` of it (noise does not replace it).
  The tuning synchronizes (once, explicitly); later calls never do.
* **Persistence**: ``autotune-<key>.json`` in the kernel cache's directory
  (``kernel_cache.usable_cache_dir``; nothing on disk when it is off), ``<key>`` a sha256 of
  the signature, gwgrad's version, the kernels' source hash and the CuTe DSL version (as
  kernel keys), holding the winner's tuning and every candidate's time or error; written
  atomically. A file that cannot be read, is not this signature's, or names a tuning the
  backend does not run for it is ignored, and replaced once the signature is timed.
* **Switches**: ``gwgrad.autotune(a_tensor, b_tensor, ...)`` (every argument of
  ``grouped_gemm_wgrad_wrapper_sm100``, plus ``max_candidates`` and ``retune``) tunes, or
  loads the persisted winner, returns an ``AutotuneResult`` (the chosen ``Tuning``, the final
  spec, every candidate's time) and makes later calls with that signature in this process use
  it, whatever the environment. ``GWGRAD_AUTOTUNE=1``: the first call of each signature tunes
  it (or loads its persisted winner) before its plan is built. Unset or ``0``: the rules'
  tiling, persisted winners ignored (only explicit ``autotune`` calls change a tiling).
* **Where it hooks in**: ``plan.tuner`` (this module's ``_plan_hook``, installed on import,
  and importing gwgrad imports it) is called by ``plan.plan_for`` after the contract's check,
  on a plan miss only (the per-call path, one dict lookup, is unchanged), and by
  ``GroupedGemmWgrad.check_support`` on its samples; it returns the request with the winner's
  tuning (``plan.tuned``, this process's choices, cleared by ``gwgrad.clear_cache``) or the
  request itself. The wrapper, the class and the torch / CuPy adapters all pass there. JAX's
  custom calls keep the rules' tiling (their lowering has no operands to time).
* **Not tuned**: CPU arrays (the reference: ``autotune`` returns the rules' tuning untimed);
  a first call inside a CUDA-graph capture (a persisted winner is still used); a first call
  under ``GWGRAD_AUTOTUNE=1`` whose offsets fail the check, or while an earlier launch's
  offsets error is pending (the call goes on with the rules' tiling and reports the error as
  usual). In those cases nothing is kept: the signature's next plan (another process, or
  after ``gwgrad.clear_cache``) tunes it.

Within the package, ``gwgrad.autotune`` is the function; this module is
``sys.modules["gwgrad.autotune"]`` (``from gwgrad.autotune import AutotuneResult``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import statistics
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import api, backends, cuda, interop, kernel_cache, plan as plans, status
from ._version import __version__
from .dtypes import DType
from .errors import NAMED_ERRORS, ArgumentError
from .kernels.tiling import (SM90_CLUSTERS, SM90_FP8_CLUSTERS, SM90_FP8_TILES, SM90_TILES,
                             SM100_BLOCKSCALED_TILES, SM100_CLUSTERS, sm100_cta_tile_m)
from .offsets import check_values
from .spec import TUNING_FIELDS, StaticSpec, Tuning
from .tensors import TensorDesc
from .validation import scale_capacity

__all__ = ["autotune", "AutotuneResult", "Timing", "Operands", "candidates", "enabled",
           "measure", "signature_key", "stats", "TABLES", "MAX_CANDIDATES", "ENV"]

#: The environment switch: "1" (or "true", "yes", "on") tunes each signature's first call.
ENV = "GWGRAD_AUTOTUNE"
#: Candidates timed per signature at most (the rules' default among them).
MAX_CANDIDATES = 16
#: Padding a candidate's cluster tile may add over the least padded candidate's (a fraction
#: of the computed output area).
PADDING_SLACK = 1 / 8
#: The rules' default stays unless a candidate's median is faster by more than this fraction.
MARGIN = 0.01
WARMUP = 2
ROUNDS = 7
SAMPLE_MS = 5.0
#: Back-to-back launches per sample at most.
MAX_INNER = 100
#: The persisted file's format.
FORMAT = 1
KIND = "gwgrad-autotune"

_BF16, _SCALED = "bf16", "block_scaled"
#: (kind, arch) -> (tiles, clusters): the tilings each backend is tuned over.
TABLES: Dict[Tuple[str, str], Tuple[Tuple[Tuple[int, int], ...], Tuple[Tuple[int, int], ...]]] = {
    (_BF16, "sm_90a"): (tuple(SM90_TILES), SM90_CLUSTERS),
    (_SCALED, "sm_90a"): (tuple(SM90_FP8_TILES), SM90_FP8_CLUSTERS),
    **{(kind, arch): (SM100_BLOCKSCALED_TILES, SM100_CLUSTERS)
       for kind in (_BF16, _SCALED) for arch in ("sm_100a", "sm_103a")},
}

_lock = threading.RLock()
_stats = {"timed": 0, "loaded": 0, "stored": 0}


def enabled() -> bool:
    """Whether ``GWGRAD_AUTOTUNE`` asks for tuning (read when a plan is built)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def stats() -> Dict[str, int]:
    """Counters of this process: signatures ``timed``, winners ``loaded`` from disk, files
    ``stored``."""
    with _lock:
        return dict(_stats)


@functools.lru_cache(maxsize=None)
def device_name(device_id: int) -> str:
    """The CUDA device's name, part of a persisted winner's key."""
    return cuda.device_name(device_id)


@dataclasses.dataclass(frozen=True)
class Timing:
    """One candidate: its tuning, its median milliseconds per call (None: it failed) and the
    error that made it fail."""

    tuning: Tuning
    ms: Optional[float]
    error: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class AutotuneResult:
    """What ``autotune`` chose. ``source``: "timed" (measured now), "disk" (a persisted winner),
    "memory" (this process chose it before) or "rules" (the rules' tuning, untimed: CPU
    arrays, nothing to choose, or every candidate failed; see ``timings``). ``default``: the
    rules' tuning; ``key`` / ``path``: the persisted winner's key and file (None: not kept on
    disk)."""

    tuning: Tuning
    spec: StaticSpec
    source: str
    timings: Tuple[Timing, ...] = ()
    default: Optional[Tuning] = None
    key: Optional[str] = None
    path: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Operands:
    """What timing needs of a call: its operands (read only), the tokens, device and stream."""

    a: TensorDesc
    b: TensorDesc
    offsets: TensorDesc
    scales: Tuple[Optional[TensorDesc], ...]  # sfa, sfb, global_scale_a, global_scale_b
    tokens_sum: int
    device_id: int
    stream: int


# --- candidates -----------------------------------------------------------------------------


def _kind(spec: StaticSpec) -> str:
    return _SCALED if spec.is_block_scaled else _BF16


def _unit(spec: StaticSpec) -> Tuple[int, int]:
    """Output rows and columns of one unit (a cluster's tile)."""
    (m, n), (cm, cn) = spec.mma_tiler_mn, spec.cluster_shape_mn
    if not spec.arch.startswith("sm_9"):
        m = sm100_cta_tile_m((m, n))
    return m * cm, n * cn


def _padding(spec: StaticSpec) -> float:
    """The fraction of the units' area that lies past the output."""
    um, un = _unit(spec)
    padded = -(-spec.hidden // um) * um * -(-spec.intermediate // un) * un
    return 1 - spec.hidden * spec.intermediate / padded


def candidates(request: StaticSpec, tokens_sum: Optional[int] = None,
               limit: int = MAX_CANDIDATES) -> List[StaticSpec]:
    """The final specs the autotuner times for ``request`` (the module's docstring says which):
    the rules' default first, every one accepted by ``check_support``."""
    default, _ = plans.finalize(request, tokens_sum)
    table = TABLES.get((_kind(request), request.arch))
    if table is None:
        return [default]
    tiles, clusters = table
    found, seen = [], {default.tuning}
    for tile in tiles:
        if request.mma_tiler_mn is not None and tuple(request.mma_tiler_mn) != tile:
            continue
        for cluster in clusters:
            if request.cluster_shape_mn is not None and tuple(request.cluster_shape_mn) != cluster:
                continue
            try:
                spec, _ = plans.finalize(
                    request.with_tuning(mma_tiler_mn=tile, cluster_shape_mn=cluster), tokens_sum)
            except (ValueError, NotImplementedError):  # a tiling this kernel does not run here
                continue
            if spec.tuning not in seen:
                seen.add(spec.tuning)
                found.append(spec)
    least = min([_padding(default)] + [_padding(s) for s in found])
    found = [s for s in found if _padding(s) <= least + PADDING_SLACK]
    found.sort(key=lambda s: (int(_padding(s) * 8), -_unit(s)[0] * _unit(s)[1]))
    return [default] + found[:max(limit, 1) - 1]


# --- timing on the device ---------------------------------------------------------------------


def _scratch(ref: TensorDesc, nbytes: int, stream: int) -> Tuple[Any, TensorDesc]:
    """Zeroed device memory of ``nbytes`` in ``ref``'s framework (its allocator), on ``stream``."""
    array, desc = interop.allocate(ref, (max(nbytes, 16),), DType.UINT8, stream)
    cuda.memset_async(desc.ptr, max(nbytes, 16), stream)
    return array, desc


def _launcher(spec: StaticSpec, ops: Operands, out: TensorDesc, ptrs: Optional[TensorDesc],
              keep: list) -> Callable[[], None]:
    """Compile ``spec`` and return a function launching it on the scratch output, with a
    zeroed workspace of its own."""
    backend = backends.get_backend(spec)
    operator = plans.CompiledOperator(spec, backend)
    discrete = spec.output_mode == "discrete"
    launch_plan = plans.LaunchPlan(operator, ops.a, ops.b, ops.offsets,
                                   None if discrete else out, ptrs if discrete else None,
                                   ops.scales)
    workspace = 0
    if launch_plan.workspace_bytes:
        array, desc = _scratch(ops.a, launch_plan.workspace_bytes, ops.stream)
        keep.append(array)
        workspace = desc.ptr
    target = ptrs.ptr if discrete else out.ptr
    scales = tuple(0 if d is None else d.ptr for d in ops.scales) if spec.is_block_scaled else ()
    a, b, offsets, stream = ops.a.ptr, ops.b.ptr, ops.offsets.ptr, ops.stream

    def run() -> None:
        launch_plan.launch(a, b, offsets, target, stream=stream, workspace=workspace,
                           scales=scales)

    return run


def _failure(stage: str, exc: BaseException) -> str:
    return f"{stage}: {type(exc).__name__}: {exc}"


def measure(specs: Sequence[StaticSpec], ops: Operands) -> List[Timing]:
    """Time each final spec of ``specs`` on the call's operands (the module's docstring says
    how): a ``Timing`` each, in order. Raises the wrapper's ``ArgumentError`` for offsets that
    fail the check. (The CPU tests replace this function.)"""
    first = specs[0]
    with cuda.on_device(ops.device_id):
        cuda.device_synchronize(ops.device_id)
        sfa = ops.scales[0]
        capacity = scale_capacity(first, sfa) if first.is_block_scaled and sfa else None
        check_values(first, ops.offsets, ops.tokens_sum, None, ops.stream, capacity=capacity)
        keep: list = []
        item = first.wgrad_dtype.itemsize
        array, flat = _scratch(ops.a, first.num_experts * first.hidden * first.intermediate * item,
                               ops.stream)
        keep.append(array)  # the scratch memory goes back to its allocator on return
        shape = (first.num_experts, first.hidden, first.intermediate)
        out = TensorDesc(flat.ptr, shape, (shape[1] * shape[2], shape[2], 1), first.wgrad_dtype,
                         "cuda", ops.device_id)
        ptrs = None
        if first.output_mode == "discrete":
            ptrs = interop.pointer_array(dataclasses.replace(out, framework=flat.framework,
                                                             owner=array), ops.stream)
            keep.append(ptrs)
        runs: Dict[int, Callable[[], None]] = {}
        errors: Dict[int, str] = {}
        for i, spec in enumerate(specs):
            try:
                runs[i] = _launcher(spec, ops, out, ptrs, keep)
            except Exception as exc:  # a tiling that does not compile here: skipped
                errors[i] = _failure("compile", exc)
        times = time_interleaved(runs, ops.stream)
        cuda.synchronize(ops.stream)
    return [Timing(spec.tuning, times.get(i) if isinstance(times.get(i), float) else None,
                   errors.get(i) or (times.get(i) if isinstance(times.get(i), str) else None))
            for i, spec in enumerate(specs)]


def time_interleaved(runs: Dict[int, Callable[[], None]], stream: int, warmup: int = WARMUP,
                     rounds: int = ROUNDS, sample_ms: float = SAMPLE_MS) -> Dict[int, Any]:
    """Median milliseconds per call of each function (or its error, a str), sampled
    round-robin between CUDA events on ``stream``."""
    results: Dict[int, Any] = {}
    live = dict(runs)
    inner: Dict[int, int] = {}
    events = {i: (cuda.event_create(), cuda.event_create()) for i in live}
    try:
        for i, run in list(live.items()):
            start, end = events[i]
            try:
                for _ in range(warmup):
                    run()
                cuda.event_record(start, stream)
                run()
                cuda.event_record(end, stream)
                once = cuda.event_elapsed_ms(start, end)
                inner[i] = max(1, min(MAX_INNER, int(sample_ms / max(once, 1e-3))))
            except Exception as exc:
                results[i] = _failure("launch", exc)
                del live[i]
        samples: Dict[int, List[float]] = {i: [] for i in live}
        order = list(live)
        for r in range(rounds):
            turn = order[r % len(order):] + order[:r % len(order)] if order else []
            if r % 2:
                turn.reverse()
            recorded = []
            for i in turn:
                if i not in live:
                    continue
                start, end = events[i]
                try:
                    cuda.event_record(start, stream)
                    for _ in range(inner[i]):
                        live[i]()
                    cuda.event_record(end, stream)
                    recorded.append(i)
                except Exception as exc:
                    results[i] = _failure("launch", exc)
                    del live[i]
            cuda.synchronize(stream)
            for i in recorded:
                samples[i].append(cuda.event_elapsed_ms(*events[i]) / inner[i])
        for i in live:
            results[i] = float(statistics.median(samples[i]))
    finally:
        for pair in events.values():
            for event in pair:
                try:
                    cuda.event_destroy(event)
                except RuntimeError:  # a context already broken by a failed launch
                    pass
    return results


# --- persistence ------------------------------------------------------------------------------


def signature_key(request: StaticSpec, tokens_sum: int, device: str) -> str:
    """The hex sha256 naming a signature's persisted winner."""
    text = json.dumps([FORMAT, KIND, __version__, kernel_cache.source_hash(),
                       kernel_cache.dsl_version(), device, repr(request), int(tokens_sum)])
    return hashlib.sha256(text.encode()).hexdigest()


def _path(key: str) -> Optional[Path]:
    directory = kernel_cache.usable_cache_dir()
    return None if directory is None else directory / f"autotune-{key}.json"


def _tuning_json(tuning: Tuning) -> Dict[str, Any]:
    return {f: (list(v) if isinstance(v, tuple) else v)
            for f, v in dataclasses.asdict(tuning).items()}


def _tuning_from_json(value: Any) -> Optional[Tuning]:
    """The tuning a file names, or None when it is not one (every field, of its type)."""
    if not isinstance(value, dict) or set(value) != set(TUNING_FIELDS):
        return None
    fields = {}
    for name in TUNING_FIELDS:
        v = value[name]
        if name in ("mma_tiler_mn", "cluster_shape_mn"):
            if not (isinstance(v, list) and len(v) == 2 and all(
                    isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v)):
                return None
            v = tuple(v)
        elif not isinstance(v, int) or isinstance(v, bool) or v < 0:
            return None
        fields[name] = v
    return Tuning(**fields)


def _load(path: Optional[Path], key: str, request: StaticSpec, tokens_sum: int,
          device: str) -> Optional[Tuple[StaticSpec, Tuple[Timing, ...]]]:
    """The persisted winner's final spec and the timings it was chosen from, or None (no
    file; or one that is unreadable, another signature's, or a tuning not run here)."""
    if path is None:
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    expected = {"format": FORMAT, "kind": KIND, "key": key, "gwgrad_version": __version__,
                "device": device, "request": repr(request), "tokens_sum": int(tokens_sum)}
    if not isinstance(data, dict) or any(data.get(k) != v for k, v in expected.items()):
        return None
    winner = _tuning_from_json(data.get("winner"))
    if winner is None:
        return None
    try:
        spec, _ = plans.finalize(dataclasses.replace(request, tuning=winner), tokens_sum)
    except (ValueError, NotImplementedError):
        return None
    if spec.tuning != winner:
        return None
    timings = []
    for row in data.get("candidates") if isinstance(data.get("candidates"), list) else ():
        tuning = _tuning_from_json(row.get("tuning")) if isinstance(row, dict) else None
        if tuning is not None:
            ms = row.get("ms")
            timings.append(Timing(tuning, float(ms) if isinstance(ms, (int, float)) else None,
                                  row.get("error") if isinstance(row.get("error"), str) else None))
    return spec, tuple(timings)


def _store(path: Optional[Path], key: str, request: StaticSpec, tokens_sum: int, device: str,
           winner: Tuning, timings: Sequence[Timing]) -> Optional[Path]:
    """Write the winner atomically (None: no disk cache, or the write failed, with a warning)."""
    if path is None:
        return None
    data = {"format": FORMAT, "kind": KIND, "key": key, "gwgrad_version": __version__,
            "device": device, "request": repr(request), "tokens_sum": int(tokens_sum),
            "winner": _tuning_json(winner),
            "settings": {"warmup": WARMUP, "rounds": ROUNDS, "sample_ms": SAMPLE_MS,
                         "margin": MARGIN},
            "candidates": [{"tuning": _tuning_json(t.tuning), "ms": t.ms, "error": t.error}
                           for t in timings]}
    try:
        kernel_cache.write_atomic(path, json.dumps(data, indent=1).encode())
    except OSError as exc:
        warnings.warn(f"gwgrad autotune: cannot write {path} ({exc}); the winner is kept in "
                      "this process only", RuntimeWarning, stacklevel=3)
        return None
    _stats["stored"] += 1
    return path


# --- the decision -------------------------------------------------------------------------------


def _winner(specs: Sequence[StaticSpec], timings: Sequence[Timing]) -> Optional[StaticSpec]:
    """The fastest candidate, or the default (the first) within MARGIN of it; None when every
    candidate failed."""
    timed = [(t.ms, i) for i, t in enumerate(timings) if t.ms is not None]
    if not timed:
        return None
    best_ms, best = min(timed)
    default_ms = timings[0].ms
    if default_ms is not None and default_ms <= best_ms * (1 + MARGIN):
        best = 0
    return specs[best]


def _decide(request: StaticSpec, tokens_sum: int, device_id: int, ops: Optional[Operands], *,
            retune: bool = False, limit: int = MAX_CANDIDATES) -> AutotuneResult:
    """The tuning of a CUDA request: this process's choice, the persisted winner or (with
    ``ops``) a timed one; kept in ``plan.tuned`` unless nothing could be timed."""
    default, _ = plans.finalize(request, tokens_sum)  # the wrapper's own errors, as it raises them
    memo_key = (request, tokens_sum, device_id)
    with _lock:
        memo = plans.tuned.get(memo_key)
        if memo is not None and not retune:
            return dataclasses.replace(memo, source="memory")
        result = AutotuneResult(default.tuning, default, "rules", (), default.tuning)
        if request.mma_tiler_mn is not None and request.cluster_shape_mn is not None:
            plans.tuned[memo_key] = result  # the caller chose: nothing to tune
            return result
        device = device_name(device_id)
        key = signature_key(request, tokens_sum, device)
        path = _path(key)
        # A persisted winner is found before the candidates are walked: loading it costs no
        # check of kernels never compiled (no CuTe DSL import).
        stored = None if retune else _load(path, key, request, tokens_sum, device)
        specs = [] if stored is not None or ops is None else candidates(request, tokens_sum, limit)
        if stored is not None:
            _stats["loaded"] += 1
            result = AutotuneResult(stored[0].tuning, stored[0], "disk", stored[1],
                                    default.tuning, key, str(path))
        elif ops is None:
            return result
        elif len(specs) == 1:  # nothing to choose
            result = dataclasses.replace(result, key=key)
        else:
            timings = tuple(measure(specs, ops))
            winner = _winner(specs, timings)
            if winner is None:  # every candidate failed: the rules' tiling, nothing kept
                return dataclasses.replace(result, timings=timings)
            _stats["timed"] += 1
            stored_at = _store(path, key, request, tokens_sum, device, winner.tuning, timings)
            result = AutotuneResult(winner.tuning, winner, "timed", timings, default.tuning, key,
                                    None if stored_at is None else str(stored_at))
        plans.tuned[memo_key] = result
        return result


def _operands(tensors: Sequence[Optional[TensorDesc]], tokens_sum: int, device_id: int,
              stream: int) -> Operands:
    a, b, offsets, *scales = tensors
    return Operands(a, b, offsets, tuple(scales), tokens_sum, device_id, stream)


def _capturing(device_id: int, stream: int) -> bool:
    """Whether ``stream`` (or, in global capture mode, any stream) is being captured."""
    with cuda.on_device(device_id):
        return cuda.stream_is_capturing(stream) or cuda.stream_is_capturing(0)


def _plan_hook(request: StaticSpec, tokens_sum: int, device_id: int,
               tensors: Optional[Sequence[Optional[TensorDesc]]]) -> StaticSpec:
    """``plan.tuner``: the request with this process's choice for its signature; else, under
    ``GWGRAD_AUTOTUNE=1``, with the persisted or timed winner; else the request itself."""
    memo = plans.tuned.get((request, tokens_sum, device_id))
    if memo is not None:
        return memo.spec
    if not enabled() or (request.mma_tiler_mn is not None and request.cluster_shape_mn is not None):
        return request
    try:
        ops = None
        if tensors is not None and tensors[0] is not None and not status.pending_view().value:
            stream = interop.resolve_stream(None, tensors[0].framework, device_id)
            if not _capturing(device_id, stream):
                ops = _operands(tensors, tokens_sum, device_id, stream)
        return _decide(request, tokens_sum, device_id, ops).spec
    except NAMED_ERRORS:  # the request's own error (compile_spec raises it), or bad offsets
        return request
    except Exception as exc:
        warnings.warn(f"gwgrad autotune: tuning failed ({type(exc).__name__}: {exc}); this "
                      "signature runs the rules' tiling", RuntimeWarning, stacklevel=2)
        return request


plans.tuner = _plan_hook


# --- the explicit call --------------------------------------------------------------------------


def autotune(
    a_tensor: Any,
    b_tensor: Any,
    sfa_tensor: Any = None,
    sfb_tensor: Any = None,
    offsets_tensor: Any = None,
    output_mode: str = "dense",
    wgrad_tensor: Any = None,
    wgrad_ptrs: Any = None,
    global_scale_a: Any = None,
    global_scale_b: Any = None,
    acc_dtype: Any = DType.FLOAT32,
    wgrad_dtype: Any = None,
    mma_tiler_mn: Optional[Sequence[int]] = None,
    cluster_shape_mn: Optional[Sequence[int]] = None,
    sf_vec_size: int = 16,
    sf_fp8_dtype_override: Optional[str] = None,
    accumulate_on_output: bool = False,
    input_order: str = "tensor2d",
    current_stream: Any = None,
    *,
    descriptor_workspace: Any = None,
    validate_offsets: bool = False,
    scale_recipe: Optional[str] = None,
    max_candidates: int = MAX_CANDIDATES,
    retune: bool = False,
) -> AutotuneResult:
    """Choose the tiling of the call these arguments describe (``grouped_gemm_wgrad``'s, with
    the same errors) by timing the candidates on its operands, or take this process's earlier
    choice or the persisted winner (``retune=True``: time again); later calls with this
    signature in this process use it, with or without ``GWGRAD_AUTOTUNE``.

    Nothing is computed into ``wgrad_tensor`` / ``wgrad_ptrs`` (they only describe the output;
    the timing writes a scratch output) and ``descriptor_workspace`` is not used (scratch
    workspaces); the offsets are always checked on the host (``validate_offsets`` is accepted
    for the wrapper's signature). Runs on ``current_stream`` (None: the framework's current
    one) after synchronizing the device, and synchronizes it. ``max_candidates``: at most this
    many candidates timed, the rules' default first. CPU arrays (the reference backend): the
    rules' tuning, untimed (``source`` "rules"). Raises RuntimeError inside a CUDA-graph capture.
    """
    if isinstance(max_candidates, bool) or not isinstance(max_candidates, int) or max_candidates < 1:
        raise ArgumentError("max_candidates", f"expected a positive int, got {max_candidates!r}")
    if not isinstance(retune, bool):
        raise ArgumentError("retune", f"expected a bool, got {retune!r}")
    if sf_fp8_dtype_override is not None:
        a, sfa = api._describe(a_tensor, "a_tensor"), api._describe(sfa_tensor, "sfa_tensor")
        if a is None:
            raise ArgumentError("a_tensor", "expected a tensor, got None")
        api._check_sf_override(sf_fp8_dtype_override, a.dtype, None if sfa is None else sfa.dtype)
        api._sf_override_unsupported(sf_fp8_dtype_override,
                                     plans.target_arch(a.device_id) if a.is_cuda else "cpu")
    if accumulate_on_output and wgrad_tensor is None and wgrad_ptrs is None:
        raise ArgumentError("wgrad_tensor", "expected an initialized output to accumulate into "
                            "(accumulate_on_output=True adds to it), got None")
    tensors = (a_tensor, b_tensor, offsets_tensor, wgrad_tensor, wgrad_ptrs, sfa_tensor,
               sfb_tensor, global_scale_a, global_scale_b)
    a, b, offsets, wgrad, ptrs, sfa, sfb, gsa, gsb = (
        api._describe(t, name) for t, name in zip(tensors, api._NAMES))
    if a is None:
        raise ArgumentError("a_tensor", "expected a tensor, got None")
    api._describe(descriptor_workspace, "descriptor_workspace")  # an array, if given
    request, tokens_sum = plans.call_request(
        a, b, offsets, wgrad=wgrad, wgrad_ptrs=ptrs, output_mode=output_mode,
        wgrad_dtype=wgrad_dtype, accumulate_on_output=accumulate_on_output,
        input_order=input_order, mma_tiler_mn=mma_tiler_mn, cluster_shape_mn=cluster_shape_mn,
        acc_dtype=acc_dtype, sf_vec_size=sf_vec_size, sfa=sfa, sfb=sfb, global_scale_a=gsa,
        global_scale_b=gsb, scale_recipe=scale_recipe)
    if not a.is_cuda:
        default, _ = plans.finalize(request, tokens_sum)
        return AutotuneResult(default.tuning, default, "rules", (), default.tuning)
    stream = interop.resolve_stream(current_stream, a.framework, a.device_id)
    if _capturing(a.device_id, stream):
        raise RuntimeError("gwgrad.autotune cannot time candidates while a CUDA graph is being "
                           "captured: tune before capturing")
    status.raise_pending()  # an earlier launch's offsets error first, as a launch would
    before = plans.tuned.get((request, tokens_sum, a.device_id))
    result = _decide(request, tokens_sum, a.device_id,
                     _operands((a, b, offsets, sfa, sfb, gsa, gsb), tokens_sum, a.device_id,
                               stream), retune=retune, limit=max_candidates)
    if before is None or before.spec != result.spec:
        plans.forget_plans()  # plans built with another tiling for this signature
    return result
