"""The host path's three tiers: compile (per static spec), plan (per call signature), launch.

* **compile** — ``compile_spec(request)``: the backend and final tiling for a static spec and
  its compiled kernel, once per process (``CompiledOperator``, cached by spec); the CuTe DSL
  backends also keep the kernel on disk across processes (``gwgrad.kernel_cache``). The
  quantizers likewise: ``compile_quantizer(request)`` (``CompiledQuantizer``, cached by its
  config and arch), planned per token count (``QuantizePlan``).
* **plan** — ``plan_for(a, b, offsets, ...)``: a ``LaunchPlan`` per call *signature* (shapes,
  strides, dtypes and devices of every tensor, output kind, modes, tiling, target arch). The
  first call with a signature runs the contract's full check (``ArgumentError`` naming the
  argument) and binds the compiled operator; later calls find the plan by a dict lookup.
* **launch** — ``LaunchPlan.launch(a, b, offsets, out, stream=..., workspace=...)``: addresses
  and a stream, nothing else: alignment bits, the device status check, the kernel call.

Every entry point uses these: the contract's wrapper and class (``gwgrad.api``), the torch /
CuPy adapters (which key plans by their own cheap signatures), ``gwgrad.quantize`` and the
benchmarks. The autotuner (``gwgrad.autotune``, opt-in) enters at one point: ``tuner``, called
when a CUDA call's plan is built (a plan miss, never on the per-call path), may replace the
request's open tiling with a timed winner. The JAX adapter's custom calls take their kernel from a compiled operator too:
``ffi_gemm`` / ``ffi_quantizer`` give the operator's XLA FFI module (its workspace, grid and
options the operator's), kept on disk by gwgrad.kernel_cache, so a JAX process that finds it
there neither compiles nor imports the CuTe DSL.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from typing import Any, Callable, Dict, Optional, Tuple

from . import backends, cuda, grid, interop, kernel_cache, offsets as offsets_rules, status
from .backends.base import Backend, LaunchArgs
from .dsl import shielded_argv
from .dtypes import DType
from .errors import ArgumentError, UnsupportedError
from .kernels import compiler
from .spec import StaticSpec
from .tensors import TensorDesc
from .validation import build_spec, check_call, operand_dims, scale_capacity

__all__ = ["CompiledOperator", "LaunchPlan", "PlanCache", "compile_spec", "plan_for",
           "plan_for_spec", "call_request", "cache_info", "clear_cache", "forget_plans", "workspace_bytes_bound",
           "WORKSPACE_ZEROED_BYTES", "target_arch", "finalize", "QuantizeRequest",
           "CompiledQuantizer", "QuantizePlan", "compile_quantizer", "quantize_plan",
           "ffi_gemm", "ffi_quantizer", "ffi_status_words"]


class PlanCache:
    """Plans by call signature, the oldest first out past ``maxsize``.

    Signatures hold shapes, so a workload whose token total changes every step (dropless
    MoE) makes a new plan per total: unbounded, that would grow for as long as training runs.
    A hit is one dict lookup: no recency bookkeeping (an ``OrderedDict.move_to_end`` hashed the
    key a second time on every call), so a signature in use is dropped once every ``maxsize``
    new signatures and then costs one rebuilt plan. Concurrent threads may race on an entry
    being evicted, which also only costs a rebuilt plan."""

    def __init__(self, maxsize: int = 512):
        self.maxsize = maxsize
        self._entries: Dict[tuple, Any] = {}
        #: ``get`` bound once: the per-call paths call it directly.
        self.get = self._entries.get
        with _lock:
            _every_cache.add(self)  # forget_plans() empties every one

    def __setitem__(self, key, value) -> None:
        entries = self._entries
        entries[key] = value
        while len(entries) > self.maxsize:
            try:
                del entries[next(iter(entries))]
            except (KeyError, StopIteration, RuntimeError):  # changed by another thread
                break

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def clear(self) -> None:
        self._entries.clear()


_every_cache: "weakref.WeakSet[PlanCache]" = weakref.WeakSet()
_lock = threading.RLock()
_compiled: Dict[StaticSpec, "CompiledOperator"] = {}
_plans = PlanCache()
#: Plans of the public API's calls, keyed by the arguments' quick signatures
#: (gwgrad.interop.quick) and the call's static arguments.
call_plans = PlanCache()
_counters = {"constructed": 0, "compiled": 0, "plans": 0}
#: The autotuner's hook, installed by gwgrad.autotune when it is imported (importing gwgrad
#: does): ``tuner(request, tokens_sum, device_id, tensors) -> request`` for a CUDA call whose
#: plan is being built (``tensors``: the call's a, b, offsets, sfa, sfb, global_scale_a,
#: global_scale_b descriptors, or None where only their layout is known). It returns the
#: request itself, or the request with the tiling its autotuner chose.
tuner: Optional[Callable[..., StaticSpec]] = None
#: The autotuner's choices in this process, by (request, tokens_sum, device id): kept here so
#: that ``clear_cache`` forgets them with the plans they shaped (gwgrad.autotune fills it).
tuned: Dict[tuple, Any] = {}


def cache_info() -> Dict[str, int]:
    """Compiled operators held, and how many operators were ever constructed / compiled and
    plans built in this process."""
    with _lock:
        return {"operators": len({id(op) for op in _compiled.values()}), **_counters}


def clear_cache() -> None:
    """Forget every compiled operator and plan, and the autotuner's choices (the disk cache,
    its persisted winners included, is unaffected)."""
    with _lock:
        _compiled.clear()
        _plans.clear()
        call_plans.clear()
        _quantize_plans.clear()
        tuned.clear()


def forget_plans() -> None:
    """Empty every plan cache (``PlanCache``: the core's, the adapters', each operator's), so
    that the next call of every signature builds its plan again: after the autotuner chose a
    new tiling for a signature that already had a plan. Compiled operators are kept."""
    with _lock:
        for cache in list(_every_cache):
            cache.clear()


def count(event: str) -> None:
    with _lock:
        _counters[event] += 1


class CompiledOperator:
    """A static spec with its final tiling, its backend and its compiled kernel."""

    def __init__(self, spec: StaticSpec, backend: Backend):
        self.spec = spec
        self.backend = backend
        self.handle = backend.compile(spec)
        # A compiled kernel knows its workspace (a cached one without importing the DSL).
        workspace = getattr(self.handle, "workspace_bytes", None)
        self.workspace_bytes = backend.workspace_bytes(spec) if workspace is None else workspace
        #: Bytes per token of a call on top (the two-pass MXFP8 path's BF16 copies; else 0).
        self.workspace_per_token = getattr(self.handle, "workspace_per_token", 0)
        count("compiled")


def target_arch(device_id: int) -> str:
    """The architecture kernels for CUDA device ``device_id`` compile for: ``CUTE_DSL_ARCH``
    when set, else the device's (``UnsupportedError`` for one gwgrad has no kernels for,
    RuntimeError without CUDA)."""
    return backends.detect_arch(device_id)


def finalize(request: StaticSpec, tokens_sum: Optional[int] = None) -> Tuple[StaticSpec, Backend]:
    """The final spec of ``request`` (the tuning it leaves open filled with the backend's
    defaults, for ``tokens_sum`` tokens when given) and its backend, support checked: a spec
    this returns compiles."""
    return backends.finalize_spec(request, tokens_sum)


def compile_spec(request: StaticSpec, tokens_sum: Optional[int] = None) -> CompiledOperator:
    """The compiled operator for ``request`` (tiling None: the backend's default, for
    ``tokens_sum`` tokens when given), compiled once per final spec and process."""
    if tokens_sum is not None:
        request = backends.tiling_for_tokens(request, tokens_sum)
    op = _compiled.get(request)
    if op is not None:
        return op
    with _lock:
        op = _compiled.get(request)
        if op is None:
            spec, backend = finalize(request)
            op = _compiled.get(spec)  # another request may have reached the same final spec
            if op is None:
                count("constructed")
                op = _compiled[spec] = CompiledOperator(spec, backend)
            _compiled[request] = op
    return op


#: Leading workspace bytes that must be zero before a launch on a fresh workspace: the unit
#: counter and the offsets verdict (bytes 0-7, rewritten by every launch before use) and the
#: prep hand-off words of single-launch kernels (bytes 8-15, left zero by every launch).
WORKSPACE_ZEROED_BYTES = 16

#: The workspace layout of kernels/config.py (ProblemConfig), restated without the DSL: a
#: block of counters, then per expert int32 words (token range: 2, rank order: 1, the scale
#: recipes' first scale column / row: 1), padded to a descriptor, then per expert one 128-byte
#: TMA descriptor for A, B, the discrete output, SFA and SFB.
_COUNTER_BYTES = 128
_DESC_BYTES = 128
_WORDS_PER_EXPERT = 4
_MAX_DESC_SLOTS = {"dense": 4, "discrete": 5}


def workspace_bytes_bound(num_experts: int, output_mode: str) -> int:
    """The largest workspace a spec of ``num_experts`` experts and ``output_mode`` built by the
    public entry points needs, over every architecture and format (a compiled operator's own
    need, ``CompiledOperator.workspace_bytes``, is at most this). Host arithmetic only."""
    head = _COUNTER_BYTES + 4 * _WORDS_PER_EXPERT * num_experts
    head = -(-head // _DESC_BYTES) * _DESC_BYTES
    return head + num_experts * _MAX_DESC_SLOTS[output_mode] * _DESC_BYTES


#: Base-address alignment each operand needs (bytes), the same as the contract's first-call
#: check (gwgrad/validation.py): 16 for what the kernels read or write through TMA or 16-byte
#: vectors (A, B, the output, the pointer array, the scale tensors), 4 for int32 / float32
#: words (offsets, global scales). Checked on every launch with a few bit operations: plans
#: are keyed by layout, not by address, so a cached plan meets new addresses on every call.
_ALIGN = {"a_tensor": 16, "b_tensor": 16, "offsets_tensor": 4, "wgrad_tensor": 16,
          "wgrad_ptrs": 16, "sfa_tensor": 16, "sfb_tensor": 16, "global_scale_a": 4,
          "global_scale_b": 4}
_SCALE_NAMES = ("sfa_tensor", "sfb_tensor", "global_scale_a", "global_scale_b")


def _template(desc: Optional[TensorDesc]) -> Optional[TensorDesc]:
    # The layout, not the first call's array: a cached plan must not hold user memory.
    return None if desc is None else dataclasses.replace(desc, owner=None)


class LaunchPlan:
    """One accepted call signature bound to its compiled operator.

    ``launch(a, b, offsets, out, stream=, workspace=)`` takes the addresses of a call's tensors
    (``out``: the dense output, or in discrete mode the int64 array of per-expert output
    addresses) with the signature this plan was built for, and enqueues the work.
    """

    def __init__(self, operator: CompiledOperator, a: TensorDesc, b: TensorDesc,
                 offsets: TensorDesc, wgrad: Optional[TensorDesc],
                 wgrad_ptrs: Optional[TensorDesc], scales: Tuple[Optional[TensorDesc], ...] = ()):
        spec = operator.spec
        self.operator = operator
        self.spec = spec
        self.discrete = spec.output_mode == "discrete"
        self.out_name = "wgrad_ptrs" if self.discrete else "wgrad_tensor"
        self.is_cuda = a.is_cuda
        self.device_id = a.device_id
        self.framework = a.framework  # whose stream and allocator the public API uses
        # That framework's current stream on this device, as a function (None: stream 0 or
        # an explicit stream); bound once, here.
        self.framework_stream = None
        module = interop.framework(a.framework) if a.is_cuda and a.framework in (
            "torch", "cupy") else None
        if module is not None:
            self.framework_stream = functools.partial(module.current_stream, a.device_id)
        self.tokens_sum = operand_dims(a, "a_tensor", "a", spec.a_major)[1]
        self.workspace_bytes = (operator.workspace_bytes
                                + operator.workspace_per_token * self.tokens_sum
                                if a.is_cuda else 0)
        if self.discrete and wgrad_ptrs is None:  # the caller builds them per call
            wgrad_ptrs = TensorDesc(0, (spec.num_experts,), (1,), DType.INT64, a.device_type,
                                    a.device_id)
        if not self.discrete and wgrad is None:  # the caller allocates it per call
            shape = (spec.num_experts, spec.hidden, spec.intermediate)
            wgrad = TensorDesc(0, shape, (shape[1] * shape[2], shape[2], 1), spec.wgrad_dtype,
                               a.device_type, a.device_id)
        self._templates = tuple(_template(d) for d in (a, b, offsets, wgrad, wgrad_ptrs))
        self._scale_templates = tuple(_template(d) for d in scales) if any(scales) else ()
        # Block-scaled kernels take the scale tensors' capacity (gwgrad/scales.py) after the
        # four scale addresses: fixed by the scale tensors' shapes, so by this signature.
        self._scale_tail = ()
        if spec.is_block_scaled and self._scale_templates:
            self._scale_tail = (scale_capacity(spec, self._scale_templates[0]),)
        self._kernel = None  # the raw-address launcher of a GPU kernel
        self._status = 0
        if self.is_cuda:
            self._kernel = operator.backend.launcher(operator.handle, spec, self.device_id)
            if self._kernel is not None:
                self._status = status.status_address(self.device_id)
        self._pending = status.pending_view()  # field [0] of the status record
        count("plans")

    def launch(self, a: int, b: int, offsets: int, out: int, *, stream: int = 0,
               workspace: int = 0, validate_offsets: bool = False,
               scales: Tuple[int, ...] = ()) -> None:
        """Enqueue one call on ``stream``. ``workspace``: ``workspace_bytes`` of device memory
        untouched by other work until the launch completes on ``stream``, whose first
        ``WORKSPACE_ZEROED_BYTES`` were zero before its first gwgrad launch (a single-launch
        kernel's prep hand-off; each launch leaves them zero, so a workspace is zero-filled
        once, then reused by later launches on the same stream). 0: gwgrad's own per-stream
        workspace (or, while ``stream`` is captured, a zeroed stream-ordered one). ``scales``:
        block-scaled inputs' addresses of ``(sfa, sfb, global_scale_a, global_scale_b)`` (0
        for an absent global scale; empty for BF16). The offsets are
        always checked on the device (a failed check writes nothing and is raised later: see
        gwgrad.status); ``validate_offsets=True`` also checks them on the host first (one
        copy and a synchronization; skipped during CUDA-graph capture)."""
        if (a | b | out) & 15 or offsets & 3:
            self._misaligned((a, b, offsets, out))
        if scales or self._scale_tail:
            if len(scales) != 4:
                raise ArgumentError("sfa_tensor", "expected scales=(sfa, sfb, global_scale_a, "
                                    "global_scale_b) addresses (0: no global scale), got "
                                    f"{scales!r}")
            if (scales[0] | scales[1]) & 15 or (scales[2] | scales[3]) & 3:
                self._misaligned((a, b, offsets, out, *scales))
        if not self.is_cuda:  # the reference: synchronous, checks the offsets itself
            self._launch_args(a, b, offsets, out, scales, 0, 0)
            return
        if self._pending.value:  # an earlier launch found invalid offsets
            status.raise_pending()
        if validate_offsets:
            self._check_on_host(offsets, out, stream)
        kernel = self._kernel
        if kernel is None or (self.workspace_bytes and not workspace):
            self._launch_slow(a, b, offsets, out, scales, stream, workspace)
            return
        kernel(stream, a, b, offsets, out, workspace, self._status, self.tokens_sum, *scales,
               *self._scale_tail)

    def _launch_slow(self, a, b, offsets, out, scales, stream, workspace) -> None:
        """A backend without a raw-address launcher, or a caller that brought no workspace."""
        captured = False
        if self.workspace_bytes and not workspace:
            workspace, captured = self._own_workspace(stream)
        try:
            if self._kernel is None:
                self._launch_args(a, b, offsets, out, scales, stream, workspace)
            else:
                self._kernel(stream, a, b, offsets, out, workspace, self._status,
                             self.tokens_sum, *scales, *self._scale_tail)
        finally:
            if captured:
                with cuda.on_device(self.device_id):
                    cuda.free_async(workspace, stream)

    def _own_workspace(self, stream: int) -> Tuple[int, bool]:
        """(address, captured) of a workspace for a caller that brought none (raw pointers, a
        CuPy call on a given stream): gwgrad's per-stream one in eager mode; while ``stream``
        is being captured into a CUDA graph, a stream-ordered allocation (``captured``: free
        it after the launch; both become memory nodes of the graph), so that replays never
        share it with other work."""
        with cuda.on_device(self.device_id):
            if cuda.stream_is_capturing(stream):
                address = cuda.malloc_async(self.workspace_bytes, stream)
                cuda.memset_async(address, WORKSPACE_ZEROED_BYTES, stream)
                return address, True
        return interop.workspace(self.device_id, stream, self.workspace_bytes), False

    def layout(self, operand: str) -> TensorDesc:
        """The layout (descriptor without storage) the plan was built for: "a", "b",
        "offsets", "wgrad" or "wgrad_ptrs"."""
        return self._templates[("a", "b", "offsets", "wgrad", "wgrad_ptrs").index(operand)]

    def _descs(self, a: int, b: int, offsets: int, out: int,
               scales: Tuple[int, ...] = ()) -> LaunchArgs:
        ta, tb, toff, tw, tp = self._templates
        out_desc = dataclasses.replace(tp if self.discrete else tw, ptr=out)
        sfa, sfb, gsa, gsb = (
            None if t is None else dataclasses.replace(t, ptr=p)
            for t, p in zip(self._scale_templates or (None,) * 4, tuple(scales) + (0,) * 4))
        return LaunchArgs(
            a=dataclasses.replace(ta, ptr=a), b=dataclasses.replace(tb, ptr=b),
            offsets=dataclasses.replace(toff, ptr=offsets), tokens_sum=self.tokens_sum,
            wgrad=None if self.discrete else out_desc,
            wgrad_ptrs=out_desc if self.discrete else None, sfa=sfa, sfb=sfb,
            global_scale_a=gsa, global_scale_b=gsb)

    def _check_on_host(self, offsets: int, out: int, stream: int) -> None:
        args = self._descs(0, 0, offsets, out)
        offsets_rules.check_values(self.spec, args.offsets, self.tokens_sum, args.wgrad_ptrs,
                                   stream, capacity=self._scale_tail[0] if self._scale_tail
                                   else None)

    def _launch_args(self, a: int, b: int, offsets: int, out: int, scales: Tuple[int, ...],
                     stream: int, workspace: int) -> None:
        args = self._descs(a, b, offsets, out, scales)
        args.stream, args.workspace = stream, workspace
        self.operator.backend.launch(self.operator.handle, self.spec, args)

    def _misaligned(self, addresses: Tuple[int, ...]) -> None:
        """Raise naming the first misaligned argument among ``addresses`` (a, b, offsets, out
        and, for block-scaled inputs, the four scale addresses). An empty tensor's address is
        never read, so it may have any alignment, as on the first call; returns if only
        empty tensors had low bits set."""
        ta, tb, toff, tw, tp = self._templates
        layouts = (ta, tb, toff, tp if self.discrete else tw) + (
            self._scale_templates or (None,) * 4)
        names = ("a_tensor", "b_tensor", "offsets_tensor", self.out_name) + _SCALE_NAMES
        for name, ptr, layout in zip(names, addresses, layouts):
            if ptr % _ALIGN[name] and (layout is None or layout.numel):
                raise ArgumentError(name, f"expected a {_ALIGN[name]}-byte aligned base "
                                          f"address, got {ptr:#x}")


def hashable(value: Any) -> Any:
    """Lists (a tiling given as a list) as tuples, for cache keys."""
    if isinstance(value, list):
        return tuple(value)
    return value


def plan_for(a: TensorDesc, b: TensorDesc, offsets: TensorDesc, *,
             wgrad: Optional[TensorDesc] = None, wgrad_ptrs: Optional[TensorDesc] = None,
             output_mode: str = "dense", wgrad_dtype: Any = None,
             accumulate_on_output: bool = False, input_order: str = "tensor2d",
             mma_tiler_mn: Any = None, cluster_shape_mn: Any = None,
             acc_dtype: Any = DType.FLOAT32, sf_vec_size: int = 16,
             sfa: Optional[TensorDesc] = None, sfb: Optional[TensorDesc] = None,
             global_scale_a: Optional[TensorDesc] = None,
             global_scale_b: Optional[TensorDesc] = None,
             scale_recipe: Optional[str] = None, grow_workspace: bool = False) -> LaunchPlan:
    """The plan for a call described by ``TensorDesc``s (output storage may be absent only when
    the caller allocates it before launching: pass a descriptor of the layout it will have).
    ``grow_workspace``: the caller sizes the workspace from the plan (``workspace_bytes``), so it
    may grow with the tokens: MXFP8 on SM90 then runs in two passes (``backends.mxfp8_two_pass``);
    a caller-owned workspace sized by the contract's bound keeps the promoting kernel.

    The first call with a signature runs the contract's full check (``build_spec``) and finds
    or compiles the operator (with the autotuner's tiling when ``tuner`` has one for a CUDA
    call: gwgrad.autotune); later calls with the same signature cost a dict lookup. The
    target architecture (the device's, or ``CUTE_DSL_ARCH``) is read when a plan is built.
    """
    key = (interop.signature(a), interop.signature(b), interop.signature(offsets), interop.signature(wgrad),
           interop.signature(wgrad_ptrs), output_mode, hashable(wgrad_dtype), accumulate_on_output,
           input_order, hashable(mma_tiler_mn), hashable(cluster_shape_mn), acc_dtype,
           sf_vec_size, interop.signature(sfa), interop.signature(sfb), interop.signature(global_scale_a),
           interop.signature(global_scale_b), a.framework, scale_recipe, grow_workspace)
    try:
        plan = _plans.get(key)
    except TypeError:  # an unhashable argument: the full check names it
        plan, key = None, None
    if plan is not None:
        return plan
    request, tokens_sum = call_request(
        a, b, offsets, wgrad=wgrad, wgrad_ptrs=wgrad_ptrs, output_mode=output_mode,
        wgrad_dtype=wgrad_dtype, accumulate_on_output=accumulate_on_output,
        input_order=input_order, mma_tiler_mn=mma_tiler_mn, cluster_shape_mn=cluster_shape_mn,
        acc_dtype=acc_dtype, sf_vec_size=sf_vec_size, sfa=sfa, sfb=sfb,
        global_scale_a=global_scale_a, global_scale_b=global_scale_b, scale_recipe=scale_recipe)
    if grow_workspace:
        request = backends.mxfp8_two_pass(request)
    if tuner is not None and a.is_cuda:  # the autotuner's winner, if it has one (a plan miss)
        request = tuner(request, tokens_sum, a.device_id,
                        (a, b, offsets, sfa, sfb, global_scale_a, global_scale_b))
    plan = LaunchPlan(compile_spec(request, tokens_sum), a, b, offsets, wgrad, wgrad_ptrs,
                      (sfa, sfb, global_scale_a, global_scale_b))
    if key is not None:
        with _lock:
            _plans[key] = plan
    return plan


def call_request(a: TensorDesc, b: TensorDesc, offsets: TensorDesc, *,
                 wgrad: Optional[TensorDesc] = None, wgrad_ptrs: Optional[TensorDesc] = None,
                 output_mode: str = "dense", wgrad_dtype: Any = None,
                 accumulate_on_output: bool = False, input_order: str = "tensor2d",
                 mma_tiler_mn: Any = None, cluster_shape_mn: Any = None,
                 acc_dtype: Any = DType.FLOAT32, sf_vec_size: int = 16,
                 sfa: Optional[TensorDesc] = None, sfb: Optional[TensorDesc] = None,
                 global_scale_a: Optional[TensorDesc] = None,
                 global_scale_b: Optional[TensorDesc] = None,
                 scale_recipe: Optional[str] = None) -> Tuple[StaticSpec, int]:
    """``(request, tokens_sum)`` of a call (``plan_for``'s arguments): the contract's full check
    (``build_spec``, ``ArgumentError`` naming the argument), the target architecture read now,
    the tiling as given."""
    request = build_spec(
        a=a, b=b, offsets=offsets, sfa=sfa, sfb=sfb, global_scale_a=global_scale_a,
        global_scale_b=global_scale_b, output_mode=output_mode, wgrad=wgrad,
        wgrad_ptrs=wgrad_ptrs, wgrad_dtype=wgrad_dtype, acc_dtype=acc_dtype,
        mma_tiler_mn=mma_tiler_mn, cluster_shape_mn=cluster_shape_mn, sf_vec_size=sf_vec_size,
        accumulate=accumulate_on_output, input_order=input_order, arch=backends.detect_arch,
        scale_recipe=scale_recipe)
    return request, operand_dims(a, "a_tensor", "a", request.a_major)[1]


def plan_for_spec(operator: CompiledOperator, a: TensorDesc, b: TensorDesc,
                  offsets: TensorDesc, wgrad: Optional[TensorDesc],
                  wgrad_ptrs: Optional[TensorDesc], cache: PlanCache,
                  **scales: Optional[TensorDesc]) -> LaunchPlan:
    """The plan for a call on an operator compiled for a given spec (the contract's class):
    the call is checked against that spec once per signature (``check_call``)."""
    key = (interop.signature(a), interop.signature(b), interop.signature(offsets), interop.signature(wgrad),
           interop.signature(wgrad_ptrs), *(interop.signature(v) for v in scales.values()))
    plan = cache.get(key)
    if plan is None:
        check_call(operator.spec, a, b, offsets, wgrad=wgrad, wgrad_ptrs=wgrad_ptrs, **scales)
        plan = cache[key] = LaunchPlan(operator, a, b, offsets, wgrad, wgrad_ptrs,
                                       tuple(scales.values()))
    return plan


# --- the quantizers: compiled per config and arch, planned per token count --------------------

@dataclasses.dataclass(frozen=True)
class QuantizeRequest:
    """What a quantizer compiles in (the fields of kernels/quantize.py's ``QuantizeConfig``,
    named without importing the DSL) and the architecture: its operator's cache key."""

    channels: int
    num_experts: int
    recipe: str  # "blocked" | "per_expert_channel" | "block_1x128"
    elem: str  # "e4m3" | "e5m2" | "e2m1"
    sf_vec: int
    count_multiple: int
    arch: str

    def config(self) -> Any:
        """The kernel's ``QuantizeConfig`` (imports the DSL)."""
        from .kernels.quantize import QuantizeConfig

        fields = dataclasses.asdict(self)
        del fields["arch"]
        return QuantizeConfig(**fields)

    def key_parts(self) -> Tuple:
        return ("gwgrad.kernels.quantize.GroupedQuantizer",
                tuple(sorted(dataclasses.asdict(self).items())))


def _quantizer_info(cfg: Any) -> Dict[str, int]:
    """The workspace rule of ``cfg`` as numbers kept with its kernel: ``workspace_bytes(T) =
    base + per_tile * tile_bound(T)``, ``tile_bound(T) = ceil(T / tile_tokens) + experts``."""
    from .kernels.quantize import TILE_TOKENS

    per_tile = cfg.workspace_bytes(TILE_TOKENS) - cfg.workspace_bytes(0)
    info = {"tile_tokens": TILE_TOKENS, "per_tile": per_tile,
            "base": cfg.workspace_bytes(0) - per_tile * cfg.tile_bound(0)}
    for tokens in (0, 1, TILE_TOKENS + 1, 4096):  # the rule restated must be the kernel's
        assert cfg.tile_bound(tokens) == -(-tokens // TILE_TOKENS) + cfg.num_experts
        assert cfg.workspace_bytes(tokens) == info["base"] + per_tile * cfg.tile_bound(tokens)
    return info


class CompiledQuantizer:
    """A quantizer compiled for a ``QuantizeRequest``: its kernel (``KernelFunction``, from
    gwgrad.kernel_cache) and its workspace rule, both known without the DSL once cached."""

    def __init__(self, request: QuantizeRequest):
        self.request = request
        options = compiler.compile_options(request.arch)

        def build():
            cfg = request.config()
            return compiler.compile_quantizer(cfg, request.arch), _quantizer_info(cfg)

        self.kernel = kernel_cache.load_or_compile(
            request.key_parts(), request.arch, options,
            compiler.entry_kinds(compiler.QUANTIZE_SIGNATURE), build)
        info = self.kernel.info
        self.tile_tokens, self.per_tile, self.base = (int(info[k]) for k in (
            "tile_tokens", "per_tile", "base"))
        count("compiled")

    def tile_bound(self, tokens_sum: int) -> int:
        """Tile rows of a call's grid: enough for any counts."""
        return -(-tokens_sum // self.tile_tokens) + self.request.num_experts

    def workspace_bytes(self, tokens_sum: int) -> int:
        return self.base + self.per_tile * self.tile_bound(tokens_sum)


def compile_quantizer(request: QuantizeRequest) -> CompiledQuantizer:
    """The compiled quantizer for ``request``, once per process (and on disk)."""
    op = _compiled.get(request)
    if op is None:
        with _lock:
            op = _compiled.get(request)
            if op is None:
                count("constructed")
                op = _compiled[request] = CompiledQuantizer(request)
    return op


class QuantizePlan:
    """A compiled quantizer bound to a token count and a device: ``launch(stream, x, offsets,
    data, scales, global_scale, workspace, sf_capacity)`` takes addresses (``global_scale``
    0 but for NVFP4) and a workspace of ``workspace_bytes``."""

    def __init__(self, operator: CompiledQuantizer, tokens_sum: int, device_id: int):
        self.operator = operator
        self.tokens_sum = tokens_sum
        self.tile_bound = operator.tile_bound(tokens_sum)
        self.workspace_bytes = operator.workspace_bytes(tokens_sum)
        self._launch = operator.kernel.bound(device_id)
        count("plans")

    def launch(self, stream: int, x: int, offsets: int, data: int, scales: int,
               global_scale: int, workspace: int, sf_capacity: int) -> None:
        self._launch(stream, x, offsets, data, scales, global_scale, workspace, self.tokens_sum,
                     sf_capacity, self.tile_bound)


_quantize_plans = PlanCache()


def quantize_plan(request: QuantizeRequest, tokens_sum: int, device_id: int) -> QuantizePlan:
    """The plan of a quantizer call of ``tokens_sum`` tokens on CUDA device ``device_id``."""
    key = (request, tokens_sum, device_id)
    plan = _quantize_plans.get(key)
    if plan is None:
        plan = QuantizePlan(compile_quantizer(request), tokens_sum, device_id)
        with _lock:
            _quantize_plans[key] = plan
    return plan


# --- XLA FFI modules: an operator's custom call for JAX ---------------------------------------

#: The status block of a GEMM's custom call (kernels/ffi_entry.py): int32 words.
FFI_STATUS_WORDS = 16
_Shaped = Tuple[Tuple[int, ...], str]  # (shape, dtype name), a row-major buffer


def ffi_status_words(device_id: int = 0) -> Tuple[int, ...]:
    """The status block's contents before a call (kernels/ffi_entry.py): zeros, and in words
    8 and 9 (int32, low half first) the address of this process's status record (0 where
    there is no CUDA device: a lowering with ``CUTE_DSL_ARCH`` set, never run)."""
    address = status.status_address(device_id) if cuda.device_count() > device_id else 0
    low, high = address & 0xFFFFFFFF, address >> 32
    words = [0] * FFI_STATUS_WORDS
    words[8], words[9] = (w - (1 << 32) if w >= 1 << 31 else w for w in (low, high))
    return tuple(words)


def _shaped(buffers) -> Tuple[_Shaped, ...]:
    return tuple((tuple(int(d) for d in shape), str(dtype)) for shape, dtype in buffers)


def ffi_gemm(request: StaticSpec, operands, tokens_sum: int, ffi_version: int, *,
             sf_capacity: Optional[int] = None, device_id: int = 0) -> kernel_cache.XlaModule:
    """The XLA FFI module of the GEMM for ``request`` (tiled for ``tokens_sum`` tokens, two
    launches: XLA's workspace is not zeroed) from its compiled operator.

    ``operands``: (shape, dtype name) of the caller's arrays a, b, offsets and, block-scaled,
    sfa, sfb, gsa, gsb, as the custom call receives them (row-major). The call's buffers are
    those, the status block (int32 (``FFI_STATUS_WORDS``,), ``ffi_status_words``) and, when
    accumulating, the output; its results the output, the uint8 workspace and the status
    block (aliased). ``ffi_version``: the FFI target version the installed JAX takes
    (gwgrad.interop.jax). Compiles only when neither memory nor disk has it."""
    if request.mainloop == 2:
        raise UnsupportedError(
            "mainloop", "the two-pass MXFP8 path (mainloop=2) has no JAX custom call (its "
            "workspace grows with tokens_sum); JAX runs the promoting kernel (mainloop=1)",
            arch=request.arch, needs=())
    op = compile_spec(request.with_tuning(launches=2), tokens_sum)
    spec = op.spec
    out = ((spec.num_experts, spec.hidden, spec.intermediate), spec.wgrad_dtype.value)
    block = ((FFI_STATUS_WORDS,), "int32")
    inputs = _shaped(operands) + _shaped([block] + ([out] if spec.accumulate else []))
    outputs = _shaped([out, ((op.workspace_bytes,), "uint8"), block])
    aliases = {len(operands): 2, **({len(operands) + 1: 0} if spec.accumulate else {})}
    constants = {"tokens_sum": int(tokens_sum),
                 "grid_size": grid.grid_size_for_arch(op.handle, spec.arch, device_id)}
    if spec.is_block_scaled:
        constants["sf_capacity"] = int(sf_capacity)
    key = (op.backend.cache_key(spec), "gwgrad.kernels.ffi_entry.GemmFfiEntry", inputs,
           outputs, tuple(sorted(aliases.items())), tuple(sorted(constants.items())),
           ffi_version)
    options = op.backend.compile_options(spec)

    def build():  # imports the DSL, which reads sys.argv
        with shielded_argv():
            from .kernels.ffi_entry import GemmFfiEntry

            entry = GemmFfiEntry(op.backend.make_kernel(spec))
        fn = entry.scaled if spec.is_block_scaled else entry.bf16
        return _checked(compiler.compile_ffi(fn, inputs, outputs, aliases, options, constants,
                                             key), ffi_version)

    return kernel_cache.load_or_compile_module(key, spec.arch, options, build)


def ffi_quantizer(request: QuantizeRequest, tokens_sum: int, sf_capacity: int, outputs,
                  ffi_version: int) -> kernel_cache.XlaModule:
    """The XLA FFI module of the quantizer for ``request`` and ``tokens_sum`` tokens: buffers
    x (tokens, channels) bfloat16 and offsets int32 (experts,); results ``outputs`` (data,
    scales, global scales: (shape, dtype name) each) and the uint8 workspace."""
    op = compile_quantizer(request)
    inputs = _shaped([((tokens_sum, request.channels), "bfloat16"),
                      ((request.num_experts,), "int32")])
    outputs = _shaped(list(outputs) + [((max(op.workspace_bytes(tokens_sum), 4),), "uint8")])
    constants = {"tokens_sum": int(tokens_sum), "sf_capacity": int(sf_capacity),
                 "tile_bound": op.tile_bound(tokens_sum)}
    key = (request.key_parts(), "call_tensors", inputs, outputs,
           tuple(sorted(constants.items())), ffi_version)
    options = compiler.compile_options(request.arch)

    def build():  # imports the DSL, which reads sys.argv
        with shielded_argv():
            from .kernels.quantize import GroupedQuantizer

            kernel = GroupedQuantizer(request.config())
        return _checked(compiler.compile_ffi(kernel.call_tensors, inputs, outputs, {}, options,
                                             constants, key), ffi_version)

    return kernel_cache.load_or_compile_module(key, request.arch, options, build)


def _checked(built: Dict[str, Any], ffi_version: int) -> Dict[str, Any]:
    if built["ffi_version"] != ffi_version:
        raise RuntimeError(f"the CuTe DSL compiled for XLA FFI target version "
                           f"{built['ffi_version']}, the installed JAX takes {ffi_version}")
    return built
