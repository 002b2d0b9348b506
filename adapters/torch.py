"""gwgrad for PyTorch: ``torch.ops.gwgrad.*`` custom ops and a one-line ``wgrad()``.

    import gwgrad.adapters.torch as gwt
    w = gwt.wgrad(x, dy, offsets)          # w[e] = x[tokens_e].T @ dy[tokens_e]

``x`` is (tokens, hidden) and ``dy`` (tokens, intermediate), as a training step holds them:
``x.T`` is then the contract's M-major ``a_tensor`` and ``dy`` its N-major ``b_tensor``, the
fastest layout; no copy is made. ``offsets`` is int32 (num_experts,), the cumulative token
counts. The ops:

    gwgrad::grouped_gemm_wgrad(Tensor x, Tensor dy, Tensor offsets, ScalarType out_dtype) -> Tensor
    gwgrad::grouped_gemm_wgrad_into(Tensor x, Tensor dy, Tensor offsets, Tensor(a!) out,
                                    bool accumulate) -> ()
    gwgrad::grouped_gemm_wgrad_discrete(Tensor x, Tensor dy, Tensor offsets, Tensor(a!)[] outs,
                                        bool accumulate) -> ()
    gwgrad::grouped_gemm_wgrad_fp8_into(...) -> ()                      (wgrad_fp8)
    gwgrad::quantize_into(Tensor x, Tensor offsets, str fmt, str? elem, Tensor(a!) data,
                          Tensor(b!) scales, Tensor(c!)? global_scale) -> ()   (quantize)

have fake (meta) kernels, so ``torch.compile`` and ``torch.library.opcheck`` work. CUDA
tensors run gwgrad's kernel on torch's current stream; the output and the kernel's workspace
come from torch's caching allocator on that stream, so calls can be captured in CUDA graphs
(run one call before capturing: the first call of a shape compiles). CPU tensors run the
reference implementation.

No host synchronization: offsets are read by the kernel on the device, every launch (a graph
replayed after ``offsets.copy_(new)`` uses the new values), and checked there: invalid
offsets make the kernel write nothing, and the ``ValueError`` naming ``offsets`` comes from
``gwgrad.check_errors()`` or the next gwgrad call (gwgrad/status.py). ``validate_offsets=True``
checks them on the host too, before launching (one sync).

``quantize(x, offsets, fmt)`` is gwgrad's grouped quantizer (gwgrad.quantize): BF16 ``x``
(tokens, channels) grouped by ``offsets`` to the block-scaled operands ``(data, scales,
global_scale)`` of the FP8 / FP4 GEMMs, in torch's FP8 / FP4 / E8M0 dtypes; ``data.t()`` is
``wgrad_fp8``'s x or dy:

    xt, sx, _ = gwt.quantize(x, offsets, "block_1x128")
    dyt, sdy, _ = gwt.quantize(dy, offsets, "block_1x128")
    w = gwt.wgrad_fp8(xt.t(), dyt.t(), offsets, sx, sdy, scale_recipe="block_1x128")

Host cost: ``wgrad()`` in eager mode calls the kernel launcher directly (the dispatcher adds
~5 us and nothing else: these ops have no autograd formula), and under ``torch.compile``,
dispatch modes or tensor subclasses goes through the op. See ``benchmarks/adapters.py``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

from gwgrad.dtypes import DType
from gwgrad.errors import ArgumentError
from gwgrad.interop import torch as tinterop
from gwgrad.plan import LaunchPlan, PlanCache, plan_for

from ._common import (FP8_DOC, FP8_RECIPES, NAMES, QUANTIZE_NAMES, adapter_names,
                      check_accumulate, experts_hidden_intermediate)

__all__ = ["wgrad", "wgrad_fp8", "quantize", "GroupedExpertLinear", "grouped_expert_linear",
           "grouped_mm_reference"]

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --- the launch shared by every op ----------------------------------------------------------

# (torch-level signature) -> gwgrad.plan.LaunchPlan. The key holds everything the contract's
# check reads except addresses (every tensor's device included), so a hit needs no validation
# beyond the alignment that LaunchPlan.launch checks.
_plans = PlanCache()


def _launch(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor,
            out: Optional[torch.Tensor], outs: Optional[Sequence[torch.Tensor]],
            accumulate: bool, validate_offsets: bool = False) -> None:
    """Compute into ``out`` (dense) or the per-expert ``outs`` (discrete)."""
    if out is not None:
        target = out
        key = _dense_key(x, dy, offsets, out, accumulate)
    else:
        _check_discrete(outs, offsets, x, dy)
        target = _pointer_array(outs, x)
        key = (x.shape, x.stride(), x.dtype, x.device, dy.shape, dy.stride(), dy.dtype,
               dy.device, offsets.shape, offsets.stride(), offsets.dtype, offsets.device,
               len(outs), outs[0].dtype, accumulate)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _plan(x, dy, offsets, out, outs, target, accumulate)
    _run(plan, x, dy, offsets, target, validate_offsets)


def _dense_key(x, dy, offsets, out, accumulate) -> tuple:
    """The plan key of a call into one stacked output."""
    return (x.shape, x.stride(), x.dtype, x.device, dy.shape, dy.stride(), dy.dtype, dy.device,
            offsets.shape, offsets.stride(), offsets.dtype, offsets.device, out.shape,
            out.stride(), out.dtype, out.device, accumulate)


def _run(plan: LaunchPlan, x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor,
         target: torch.Tensor, validate_offsets: bool = False) -> None:
    """Launch ``plan`` on torch's current stream with its per-stream workspace."""
    stream = workspace = 0
    if plan.is_cuda:  # plan.device_id: x's device (plans are keyed by it)
        stream = tinterop.current_stream(plan.device_id)
        if plan.workspace_bytes:
            workspace = tinterop.workspace(plan.device_id, stream, plan.workspace_bytes)
    try:
        plan.launch(x.data_ptr(), dy.data_ptr(), offsets.data_ptr(), target.data_ptr(),
                    stream=stream, workspace=workspace, validate_offsets=validate_offsets)
    except ArgumentError as exc:  # misaligned storage, or offsets rejected by a check
        raise exc.renamed(NAMES) from None


# (x, dy, offsets signature, out_dtype argument) -> (plan, output template) of the eager
# allocating call, so that a repeated call is one lookup, one allocation and the launch. The
# template is one element expanded to the output's shape: torch.empty_like of it is a new
# contiguous output on its device, ~0.6 us cheaper than x.new_empty(shape, dtype=) (fewer
# arguments to parse).
_allocating = PlanCache()
_empty_like = torch.empty_like


def _allocating_key(x, dy, offsets, out_dtype) -> tuple:
    return (x.shape, x.stride(), x.dtype, x.device, dy.shape, dy.stride(), dy.dtype, dy.device,
            offsets.shape, offsets.stride(), offsets.dtype, offsets.device, out_dtype)


def _allocate_and_launch(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor,
                         out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``wgrad(x, dy, offsets)`` in eager mode, a signature not seen before (or dropped): a
    new output, computed, and the signature's entry for ``wgrad``'s per-call path."""
    dtype = torch.bfloat16 if out_dtype is None else out_dtype
    result = _empty_output(x, dy, offsets, dtype)
    _launch(x, dy, offsets, result, None, False)
    # The plan that call found (its output is always a new contiguous tensor); None only if
    # already evicted by other signatures. No entry while a CUDA graph is captured: the
    # template's element would come from the graph's private pool and keep its block.
    plan = _plans.get(_dense_key(x, dy, offsets, result, False))
    if plan is not None and not (result.is_cuda and tinterop.capturing()):
        _allocating[_allocating_key(x, dy, offsets, out_dtype)] = (
            plan, result.new_empty(()).expand(result.shape))
    return result


def _pointer_array(outs: Sequence[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The discrete outputs' addresses as an int64 tensor on x's device (CUDA: cached, built
    without a host sync; CPU: a plain tensor for the reference)."""
    if x.is_cuda:
        return tinterop.pointer_array(outs, x.device, tinterop.current_stream(x.device.index))
    return torch.tensor([o.data_ptr() for o in outs], dtype=torch.int64)


def _plan(x, dy, offsets, out, outs, target, accumulate) -> LaunchPlan:
    """The first call of a signature: the contract's full check, then the compiled operator."""
    with adapter_names():
        a = tinterop.describe(x, "a_tensor", transpose=True)
        b = tinterop.describe(dy, "b_tensor")
        off = tinterop.describe(offsets, "offsets_tensor")
        if out is not None:
            return plan_for(a, b, off, wgrad=tinterop.describe(out, "wgrad_tensor"),
                            accumulate_on_output=accumulate)
        out_dtype = tinterop.DTYPES.get(outs[0].dtype)
        return plan_for(a, b, off, wgrad_ptrs=tinterop.describe(target, "wgrad_ptrs"),
                        output_mode="discrete", wgrad_dtype=out_dtype,
                        accumulate_on_output=accumulate)


def _check_discrete(outs, offsets, x, dy) -> None:
    experts, hidden, inter = experts_hidden_intermediate(x.shape, dy.shape, offsets.shape)
    if len(outs) != experts:
        raise ArgumentError("out", f"expected {experts} per-expert outputs (one per offsets "
                                   f"entry), got {len(outs)}")
    shape, dtype, device = (hidden, inter), outs[0].dtype, x.device
    if all(o.shape == shape and o.dtype == dtype and o.device == device and o.is_contiguous()
           for o in outs):
        return
    for e, o in enumerate(outs):
        if (o.shape != shape or not o.is_contiguous() or o.dtype != dtype
                or o.device != device):
            raise ArgumentError(
                "out", f"expected every output to be a contiguous ({hidden}, {inter}) tensor "
                f"of one dtype on {x.device}, got out[{e}] of shape {tuple(o.shape)}, dtype "
                f"{o.dtype}, device {o.device}")


# --- the ops --------------------------------------------------------------------------------

_lib = torch.library.Library("gwgrad", "DEF")
_lib.define("grouped_gemm_wgrad(Tensor x, Tensor dy, Tensor offsets, ScalarType out_dtype) "
            "-> Tensor")
_lib.define("grouped_gemm_wgrad_into(Tensor x, Tensor dy, Tensor offsets, Tensor(a!) out, "
            "bool accumulate) -> ()")
_lib.define("grouped_gemm_wgrad_discrete(Tensor x, Tensor dy, Tensor offsets, "
            "Tensor(a!)[] outs, bool accumulate) -> ()")


def _empty_output(x, dy, offsets, out_dtype):
    shape = experts_hidden_intermediate(x.shape, dy.shape, offsets.shape)
    return x.new_empty(shape, dtype=out_dtype)  # ~0.5 us cheaper than torch.empty(device=)


def _grouped_gemm_wgrad(x, dy, offsets, out_dtype):
    out = _empty_output(x, dy, offsets, out_dtype)
    _launch(x, dy, offsets, out, None, False)
    return out


def _grouped_gemm_wgrad_into(x, dy, offsets, out, accumulate):
    _launch(x, dy, offsets, out, None, accumulate)


def _grouped_gemm_wgrad_discrete(x, dy, offsets, outs, accumulate):
    _launch(x, dy, offsets, None, outs, accumulate)


for _key in ("CPU", "CUDA"):
    _lib.impl("grouped_gemm_wgrad", _grouped_gemm_wgrad, _key)
    _lib.impl("grouped_gemm_wgrad_into", _grouped_gemm_wgrad_into, _key)
    _lib.impl("grouped_gemm_wgrad_discrete", _grouped_gemm_wgrad_discrete, _key)


@torch.library.register_fake("gwgrad::grouped_gemm_wgrad")
def _fake_grouped_gemm_wgrad(x, dy, offsets, out_dtype):
    return _empty_output(x, dy, offsets, out_dtype)


@torch.library.register_fake("gwgrad::grouped_gemm_wgrad_into")
def _fake_grouped_gemm_wgrad_into(x, dy, offsets, out, accumulate):
    return None


@torch.library.register_fake("gwgrad::grouped_gemm_wgrad_discrete")
def _fake_grouped_gemm_wgrad_discrete(x, dy, offsets, outs, accumulate):
    return None


# --- the one-line entry ---------------------------------------------------------------------

_dispatch_depth = torch._C._len_torch_dispatch_stack
_functorch_interpreter = torch._C._functorch.peek_interpreter_stack


def _untraced() -> bool:
    """Not under torch.compile, no dispatch mode (fake tensors, FlopCounter, ...), no
    functorch transform: calling the implementation is what the op would do, for plain
    tensors."""
    return not (torch.compiler.is_compiling() or _dispatch_depth()
                or _functorch_interpreter() is not None)


def _eager(*tensors: torch.Tensor) -> bool:
    """True when calling the implementation directly is what the op would do: untraced, and
    plain tensors only, none on the meta device."""
    if not _untraced():
        return False
    for t in tensors:  # a loop, not all(<generator>): this runs on every call
        if type(t) is not torch.Tensor or t.is_meta:
            return False
    return True


def _check_arguments(x, dy, offsets, out) -> None:
    """Before a call leaves the eager path for the op (tracing, a dispatch mode, a tensor
    subclass, meta tensors): argument kinds and devices, so that nothing that is not a
    torch tensor reaches torch, and a meta tensor among real ones does not reach the op's
    fake kernel (which would return uninitialized memory, or not write ``out``). Plain
    tensors on the eager path get the same device checks from their plan."""
    for name, t in (("x", x), ("dy", dy), ("offsets", offsets)):
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(name, f"expected a torch.Tensor, got {type(t).__name__}")
    tensors = [("x", x), ("dy", dy), ("offsets", offsets)]
    if isinstance(out, torch.Tensor):
        tensors.append(("out", out))
    elif out is not None:
        tensors += [(f"out[{e}]", o) for e, o in enumerate(out)]
    # Meta tensors trace shapes (the op's fake kernel): all of them or none, never a mix, and
    # real tensors all on x's device.
    metas = [t.is_meta for _, t in tensors]
    if any(metas) and not all(metas):
        name, t = next((n, t) for n, t in tensors if t.is_meta != x.is_meta)
        raise ArgumentError(name, f"expected a tensor on {x.device} like x, got one on {t.device}")
    for name, t in tensors[1:]:
        if t.device != x.device:
            raise ArgumentError(name, f"expected a tensor on {x.device} like x (all tensors on "
                                      f"one device), got one on {t.device}")


def wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, *,
          out: Union[torch.Tensor, Sequence[torch.Tensor], None] = None,
          accumulate: bool = False, out_dtype: Optional[torch.dtype] = None,
          validate_offsets: bool = False) -> Union[torch.Tensor, List[torch.Tensor]]:
    """``W[e] = x[begin:end].T @ dy[begin:end]`` for every expert, FP32 accumulation.

    x: (tokens, hidden) bfloat16; dy: (tokens, intermediate) bfloat16; offsets: int32
    (num_experts,), ``end = offsets[e]``, ``begin = offsets[e-1]`` (0 for e = 0).
    out: None (a new (num_experts, hidden, intermediate) tensor of ``out_dtype``, default
    bfloat16), a tensor of that shape, or a list of num_experts contiguous
    (hidden, intermediate) tensors (discrete outputs). accumulate: add to ``out`` instead of
    overwriting it. Offsets are checked on the device (invalid ones write nothing; the error
    comes from ``gwgrad.check_errors()`` or the next call); validate_offsets: check them on
    the host first (one sync; eager only). Returns ``out`` (or the new tensor).
    """
    if (type(x) is torch.Tensor and type(dy) is torch.Tensor and type(offsets) is torch.Tensor
            and type(accumulate) is bool and not validate_offsets and _untraced()):
        # An eager call of a signature seen before, allocating or into one stacked output:
        # its cache entry, then the launch (the keys' devices are real ones: no meta tensor
        # gets a hit). A miss, or an argument the keys cannot hold, takes the checked path.
        plan = hit = None
        try:
            if out is None:
                if not accumulate:
                    hit = _allocating.get(_allocating_key(x, dy, offsets, out_dtype))
            elif type(out) is torch.Tensor and (out_dtype is None or out_dtype == out.dtype):
                plan = _plans.get(_dense_key(x, dy, offsets, out, accumulate))
        except TypeError:  # unhashable out_dtype or accumulate: the checks below name them
            pass
        if hit is not None:
            result = _empty_like(hit[1])
            _run(hit[0], x, dy, offsets, result)
            return result
        if plan is not None:
            _run(plan, x, dy, offsets, out)
            return out
    check_accumulate(accumulate, out)
    if out_dtype is not None and out_dtype not in _OUT_DTYPES:
        raise ArgumentError("out_dtype", f"expected None, torch.bfloat16, torch.float16 or "
                                         f"torch.float32, got {out_dtype}")
    if validate_offsets and torch.compiler.is_compiling():
        raise ArgumentError("validate_offsets", "expected False under torch.compile (the check "
                                                "synchronizes with the host), got True")
    if out is None:
        eager = _eager(x, dy, offsets)
        if eager and not validate_offsets:
            return _allocate_and_launch(x, dy, offsets, out_dtype)
        dtype = torch.bfloat16 if out_dtype is None else out_dtype
        if not eager:
            _check_arguments(x, dy, offsets, None)
        if eager or validate_offsets:
            result = _empty_output(x, dy, offsets, dtype)
            _launch(x, dy, offsets, result, None, False, validate_offsets)
            return result
        return torch.ops.gwgrad.grouped_gemm_wgrad.default(x, dy, offsets, dtype)
    if not isinstance(out, torch.Tensor) and (
            not isinstance(out, (list, tuple)) or not out
            or not all(isinstance(o, torch.Tensor) for o in out)):
        raise ArgumentError("out", "expected None, a tensor or a non-empty list of tensors, got "
                                   f"{type(out).__name__}")
    if isinstance(out, torch.Tensor):
        eager = _eager(x, dy, offsets, out)
        if not eager:
            _check_arguments(x, dy, offsets, out)
        if out_dtype is not None and out_dtype != out.dtype:
            raise ArgumentError("out_dtype", f"expected None or {out.dtype} (out's dtype), got "
                                             f"{out_dtype}")
        if eager or validate_offsets:
            _launch(x, dy, offsets, out, None, accumulate, validate_offsets)
        else:
            torch.ops.gwgrad.grouped_gemm_wgrad_into.default(x, dy, offsets, out, accumulate)
        return out
    outs = list(out)
    eager = _eager(x, dy, offsets, *outs)
    if not eager:
        _check_arguments(x, dy, offsets, outs)
    if out_dtype is not None and out_dtype != outs[0].dtype:
        raise ArgumentError("out_dtype", f"expected None or {outs[0].dtype} (out's dtype), got "
                                         f"{out_dtype}")
    if eager or validate_offsets:
        _launch(x, dy, offsets, None, outs, accumulate, validate_offsets)
    else:
        torch.ops.gwgrad.grouped_gemm_wgrad_discrete.default(x, dy, offsets, outs, accumulate)
    return outs


# --- FP8 ------------------------------------------------------------------------------------

_lib.define("grouped_gemm_wgrad_fp8_into(Tensor x, Tensor dy, Tensor offsets, Tensor x_scale, "
            "Tensor dy_scale, Tensor? x_global_scale, Tensor? dy_global_scale, str scale_recipe, "
            "Tensor(a!) out, bool accumulate) -> ()")


def _fp8_launch(x, dy, offsets, x_scale, dy_scale, x_global_scale, dy_global_scale,
                scale_recipe, out, outs, accumulate, validate_offsets=False):
    """Through the core wrapper (its plan cache and torch's stream / allocator)."""
    import gwgrad

    if scale_recipe not in FP8_RECIPES:
        raise ArgumentError("scale_recipe", f"expected one of {sorted(FP8_RECIPES)}, got "
                                            f"{scale_recipe!r}")
    kwargs = dict(a_tensor=x.t(), b_tensor=dy, sfa_tensor=x_scale, sfb_tensor=dy_scale,
                  offsets_tensor=offsets, global_scale_a=x_global_scale,
                  global_scale_b=dy_global_scale, accumulate_on_output=accumulate,
                  sf_vec_size=FP8_RECIPES[scale_recipe], scale_recipe=scale_recipe,
                  validate_offsets=validate_offsets)
    with adapter_names():
        if out is not None:
            gwgrad.grouped_gemm_wgrad(wgrad_tensor=out, **kwargs)
        else:
            _check_discrete(outs, offsets, x, dy)
            ptrs = _pointer_array(outs, x)
            gwgrad.grouped_gemm_wgrad(output_mode="discrete", wgrad_ptrs=ptrs,
                                      wgrad_dtype=tinterop.DTYPES.get(outs[0].dtype), **kwargs)


def _grouped_gemm_wgrad_fp8_into(x, dy, offsets, x_scale, dy_scale, x_global_scale,
                                 dy_global_scale, scale_recipe, out, accumulate):
    _fp8_launch(x, dy, offsets, x_scale, dy_scale, x_global_scale, dy_global_scale,
                scale_recipe, out, None, accumulate)


for _key in ("CPU", "CUDA"):
    _lib.impl("grouped_gemm_wgrad_fp8_into", _grouped_gemm_wgrad_fp8_into, _key)


@torch.library.register_fake("gwgrad::grouped_gemm_wgrad_fp8_into")
def _fake_grouped_gemm_wgrad_fp8_into(x, dy, offsets, x_scale, dy_scale, x_global_scale,
                                      dy_global_scale, scale_recipe, out, accumulate):
    return None


def wgrad_fp8(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, x_scale: torch.Tensor,
              dy_scale: torch.Tensor, *, scale_recipe: str,
              out: Union[torch.Tensor, Sequence[torch.Tensor], None] = None,
              accumulate: bool = False, out_dtype: Optional[torch.dtype] = None,
              x_global_scale: Optional[torch.Tensor] = None,
              dy_global_scale: Optional[torch.Tensor] = None,
              validate_offsets: bool = False) -> Union[torch.Tensor, List[torch.Tensor]]:
    check_accumulate(accumulate, out)
    if out_dtype is not None and out_dtype not in _OUT_DTYPES:
        raise ArgumentError("out_dtype", f"expected None, torch.bfloat16, torch.float16 or "
                                         f"torch.float32, got {out_dtype}")
    tensors = [x, dy, offsets, x_scale, dy_scale]
    for name, t in zip(("x", "dy", "offsets", "x_scale", "dy_scale"), tensors):
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(name, f"expected a torch.Tensor, got {type(t).__name__}")
    if out is None:
        shape = experts_hidden_intermediate(x.shape, dy.shape, offsets.shape)
        out = torch.empty(shape, dtype=out_dtype or torch.bfloat16, device=x.device)
    if isinstance(out, torch.Tensor):
        if out_dtype is not None and out_dtype != out.dtype:
            raise ArgumentError("out_dtype", f"expected None or {out.dtype} (out's dtype), got "
                                             f"{out_dtype}")
        if _eager(x, dy, offsets, x_scale, dy_scale, out) or validate_offsets:
            _fp8_launch(x, dy, offsets, x_scale, dy_scale, x_global_scale, dy_global_scale,
                        scale_recipe, out, None, accumulate, validate_offsets)
        else:
            _check_arguments(x, dy, offsets, out)
            torch.ops.gwgrad.grouped_gemm_wgrad_fp8_into.default(
                x, dy, offsets, x_scale, dy_scale, x_global_scale, dy_global_scale,
                scale_recipe, out, accumulate)
        return out
    outs = list(out)
    if not outs or not all(isinstance(o, torch.Tensor) for o in outs):
        raise ArgumentError("out", "expected None, a tensor or a non-empty list of tensors")
    if out_dtype is not None and out_dtype != outs[0].dtype:
        raise ArgumentError("out_dtype", f"expected None or {outs[0].dtype} (out's dtype), got "
                                         f"{out_dtype}")
    _fp8_launch(x, dy, offsets, x_scale, dy_scale, x_global_scale, dy_global_scale,
                scale_recipe, None, outs, accumulate, validate_offsets)
    return outs


wgrad_fp8.__doc__ = FP8_DOC + """

    out: None (a new (num_experts, hidden, intermediate) tensor of ``out_dtype``, default
    bfloat16), a tensor of that shape, or a list of per-expert (hidden, intermediate)
    tensors (eager only). accumulate: add to ``out``. Offsets and the scales' capacity are
    checked on the device (the error comes from ``gwgrad.check_errors()`` or the next call);
    ``validate_offsets=True`` checks them on the host first. Runs on torch's current stream;
    under ``torch.compile`` through ``torch.ops.gwgrad.grouped_gemm_wgrad_fp8_into``. Needs
    an SM90 GPU (CPU tensors run the reference)."""


# --- quantize: BF16 x grouped by expert to block-scaled operands ----------------------------

_lib.define("quantize_into(Tensor x, Tensor offsets, str fmt, str? elem, Tensor(a!) data, "
            "Tensor(b!) scales, Tensor(c!)? global_scale) -> ()")


def _quantize_launch(x, offsets, fmt, elem, data, scales, global_scale):
    """gwgrad.quantize into the given outputs, on torch's current stream (CPU: the model)."""
    import gwgrad

    stream = tinterop.current_stream(x.device.index) if x.is_cuda else 0
    with adapter_names(QUANTIZE_NAMES):
        gwgrad.quantize(x, offsets, fmt, elem=elem, data=data, scales=scales,
                        global_scale=global_scale, stream=stream)


def _quantize_into(x, offsets, fmt, elem, data, scales, global_scale):
    _quantize_launch(x, offsets, fmt, elem, data, scales, global_scale)


for _key in ("CPU", "CUDA"):
    _lib.impl("quantize_into", _quantize_into, _key)


@torch.library.register_fake("gwgrad::quantize_into")
def _fake_quantize_into(x, offsets, fmt, elem, data, scales, global_scale):
    return None


def _torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of a gwgrad DType; uint8 (the same bytes) for an FP8 / FP4 / E8M0 type
    this torch lacks."""
    try:
        return tinterop.native_dtype(dtype)
    except KeyError:
        return torch.uint8


def _quantize_layout(x, offsets, fmt, elem):
    """gwgrad.quantizers.layout of a call (ArgumentError naming x, offsets, fmt or elem when
    there is none)."""
    from gwgrad import quantizers

    if x.dim() != 2:
        raise ArgumentError("x", f"expected a 2-D bfloat16 (tokens, channels) array, got "
                                 f"{x.dim()}-D {x.dtype}")
    if offsets.dim() != 1:
        raise ArgumentError("offsets", f"expected a 1-D int32 array of at least one expert, "
                                       f"got {offsets.dim()}-D {offsets.dtype}")
    return quantizers.layout(fmt, int(x.shape[0]), int(x.shape[1]), int(offsets.shape[0]), elem)


def _quantize_outputs(lay, device):
    """New (data, scales, global_scale) on ``device`` with the layout's shapes and dtypes."""
    shapes = [(lay.data_shape, lay.data_dtype), (lay.scale_shape, lay.scale_dtype),
              (lay.global_shape, DType.FLOAT32)]
    return tuple(None if shape is None else
                 torch.empty(shape, dtype=_torch_dtype(dtype), device=device)
                 for shape, dtype in shapes)


_E8M0 = getattr(torch, "float8_e8m0fnu", None)


def _bytes_if_e8m0(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == _E8M0 and _E8M0 is not None else t


def _quantize_given(out, fmt) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``out`` as (data, scales, global_scale), every entry a tensor (global_scale: None for
    the formats without global scales)."""
    from gwgrad import quantizers

    if not isinstance(out, (tuple, list)) or len(out) not in (2, 3):
        raise ArgumentError("out", f"expected None or a (data, scales, global_scale) tuple, got "
                                   f"{type(out).__name__}"
                                   + (f" of length {len(out)}" if isinstance(out, (tuple, list))
                                      else ""))
    data, scales, gs = (*out, None) if len(out) == 2 else out
    for i, (name, t) in enumerate((("data", data), ("scales", scales))):
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(QUANTIZE_NAMES[name], f"expected a torch.Tensor, got "
                                                      f"{type(t).__name__}")
    f = quantizers.FORMATS.get(fmt) if isinstance(fmt, str) else None
    if gs is None and f is not None and f.global_scale:
        raise ArgumentError(QUANTIZE_NAMES["global_scale"], f"expected a float32 "
                            f"(num_experts,) tensor ({fmt}'s per-expert global scales), got None")
    if gs is not None and not isinstance(gs, torch.Tensor):
        raise ArgumentError(QUANTIZE_NAMES["global_scale"], f"expected None or a torch.Tensor, "
                                                            f"got {type(gs).__name__}")
    return data, scales, gs


def quantize(x: torch.Tensor, offsets: torch.Tensor, fmt: str, *,
             elem: Union[str, torch.dtype, None] = None,
             out: Optional[Sequence[Optional[torch.Tensor]]] = None
             ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Quantize ``x`` (tokens, channels), bfloat16, row-major, grouped by expert through
    ``offsets`` (int32 (num_experts,), the cumulative token counts; read on the device, never
    on the host) into ``fmt``: "mxfp8", "mxfp4", "nvfp4", "per_expert_channel" or
    "block_1x128" (gwgrad/quantizers.py). ``elem``: "e4m3" (default) or "e5m2" (or
    torch.float8_e4m3fn / torch.float8_e5m2) for the FP8 formats.

    Returns ``(data, scales, global_scale)``, shapes from ``gwgrad.quantizers.layout(fmt,
    tokens, channels, num_experts, elem)``:

    * ``data`` (channels, tokens), tokens contiguous: torch.float8_e4m3fn / float8_e5m2 for
      the FP8 formats, packed E2M1 torch.float4_e2m1fn_x2 (channels, tokens // 2) for mxfp4 /
      nvfp4 (uint8 in a torch without it). Pass ``data.t()`` as ``wgrad_fp8``'s x / dy;
    * ``scales``: E8M0 torch.float8_e8m0fnu (mxfp8, mxfp4) or E4M3 torch.float8_e4m3fn
      (nvfp4) in the blocked layout (round_up(channels, 128), capacity); float32
      (num_experts, channels) (per_expert_channel) or (capacity, channels) (block_1x128),
      ``wgrad_fp8``'s x_scale / dy_scale as they are;
    * ``global_scale``: float32 (num_experts,) for nvfp4, else None.

    out: None (new tensors from torch's caching allocator) or a ``(data, scales,
    global_scale)`` tuple to write into (a previous call's result: reuse across steps; no
    allocation then, so the call can be captured in a CUDA graph once a call of its shape has
    compiled the kernel). FP8 / FP4 / E8M0 outputs may be uint8 tensors of the same shape; a
    blocked or block_1x128 ``scales`` may hold more columns / rows than the default bound.
    Returns ``out`` (its tensors) when given.

    Every expert's count must be a multiple of ``gwgrad.quantizers.count_multiple(fmt)`` (32
    for the blocked formats, 16 for the FP32 ones), and so must ``tokens``: a count that is not,
    or invalid offsets, are quantized as an empty expert (the GEMM's own offsets check reports
    them). CUDA tensors run the CuTe DSL quantizer on torch's current stream (no host
    synchronization); CPU tensors run the NumPy model, bit-equal to it. Under
    ``torch.compile`` (and dispatch modes, meta tensors) through
    ``torch.ops.gwgrad.quantize_into``; E8M0 outputs pass through the op as their uint8
    bytes, since inductor cannot yet functionalize an op that writes a float8_e8m0fnu tensor
    (pytorch/pytorch#189522), and for the same reason E8M0 ``out`` scales given to a function
    compiled with inductor should be uint8 tensors.
    """
    for name, t in (("x", x), ("offsets", offsets)):
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(name, f"expected a torch.Tensor, got {type(t).__name__}")
    if isinstance(elem, torch.dtype):
        elem = str(elem).removeprefix("torch.")  # gwgrad.quantizers reads float8_e4m3fn
    if out is None:
        data, scales, gs = _quantize_outputs(_quantize_layout(x, offsets, fmt, elem), x.device)
    else:
        data, scales, gs = _quantize_given(out, fmt)
    tensors = [("x", x), ("offsets", offsets), (QUANTIZE_NAMES["data"], data),
               (QUANTIZE_NAMES["scales"], scales)]
    if gs is not None:
        tensors.append((QUANTIZE_NAMES["global_scale"], gs))
    if _eager(*(t for _, t in tensors)):
        _quantize_launch(x, offsets, fmt, elem, data, scales, gs)
        return data, scales, gs
    # Tracing, a dispatch mode or meta tensors: fmt, elem and the tensors' devices checked here
    # (meta ones all or none), the rest by the op's real kernel (its fake one writes nothing).
    lay = _quantize_layout(x, offsets, fmt, elem)
    for name, t in tensors[1:]:
        if t.device != x.device:
            raise ArgumentError(name, f"expected a tensor on {x.device} like x (all tensors "
                                      f"on one device), got one on {t.device}")
    # E8M0 outputs go to the op as their bytes: inductor cannot yet functionalize an op that
    # writes a float8_e8m0fnu tensor (pytorch/pytorch#189522).
    torch.ops.gwgrad.quantize_into.default(x, offsets, fmt, lay.elem, _bytes_if_e8m0(data),
                                           _bytes_if_e8m0(scales), gs)
    return data, scales, gs


# --- example: a grouped expert linear layer with gwgrad in its backward ---------------------

def _bounds(offsets: torch.Tensor) -> List[int]:
    return [0] + offsets.tolist()  # one host sync: only the loop fallbacks use it


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``y[tokens_e] = x[tokens_e] @ w[e]`` with a per-expert loop (syncs for offsets)."""
    bounds = _bounds(offsets)
    y = x.new_zeros((x.shape[0], w.shape[2]))
    for e in range(w.shape[0]):
        s, t = bounds[e], bounds[e + 1]
        if t > s:
            y[s:t] = x[s:t] @ w[e]
    return y


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # torch._grouped_mm (PyTorch >= 2.8, SM90+) reads offsets on the device: no sync.
    if x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16:
        try:
            return torch._grouped_mm(x, w, offs=offsets)
        except RuntimeError:  # an older GPU or an unsupported layout: loop below
            pass
    return grouped_mm_reference(x, w, offsets)


class GroupedExpertLinear(torch.autograd.Function):
    """``y_e = x_e @ w_e`` for the tokens of each expert e (x (tokens, hidden), w
    (num_experts, hidden, intermediate)); backward: ``dx_e = dy_e @ w_e.T`` with torch,
    ``dw = gwgrad`` (``dw[e] = x_e.T @ dy_e``)."""

    @staticmethod
    def forward(ctx, x, w, offsets):
        ctx.save_for_backward(x, w, offsets)
        return _grouped_mm(x, w, offsets)

    @staticmethod
    def backward(ctx, dy):
        x, w, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _grouped_mm(dy, w.transpose(1, 2), offsets)
        if ctx.needs_input_grad[1]:
            dw = wgrad(x, dy, offsets, out_dtype=w.dtype)
        return dx, dw, None


def grouped_expert_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``GroupedExpertLinear.apply(x, w, offsets)``."""
    return GroupedExpertLinear.apply(x, w, offsets)


# --- a grouped linear layer: per-expert parameters, FP32 main grads (issue #13) --------------
#
# Megatron-LM / Transformer Engine keep one parameter per expert and, with
# ``gradient_accumulation_fusion``, let the weight-gradient GEMM add straight into each
# parameter's FP32 ``main_grad`` buffer: autograd then returns no weight gradient at all
# (``param.grad`` stays None) and marks ``param.grad_added_to_main_grad = True``. gwgrad's
# discrete outputs with ``accumulate=True`` are exactly that GEMM: one launch writes every
# expert's ``main_grad += x_e.T @ dy_e`` in place, through a device array of the buffers'
# addresses that the torch adapter builds once per set of addresses (pinned memory and a
# non-blocking copy, cached: no host synchronization, CUDA-graph capturable).

_MAIN_GRAD_DTYPES = (torch.float32, torch.bfloat16)


def _positive_int(name: str, value, multiple: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value % multiple:
        rule = "a positive int" + (f", a multiple of {multiple}" if multiple > 1 else "")
        raise ArgumentError(name, f"expected {rule}, got {value!r}")
    return value


def _check_layer_input(x, offsets, weights: Sequence[torch.Tensor], in_features: int) -> None:
    """GroupedLinear.forward's arguments and parameters, host-side metadata only (no sync)."""
    w0 = weights[0]
    for e, w in enumerate(weights):
        if w.dtype != torch.bfloat16 or w.shape != w0.shape or w.device != w0.device:
            raise ArgumentError(f"weight{e}", f"expected a bfloat16 {tuple(w0.shape)} parameter "
                                              f"on {w0.device} like weight0, got {w.dtype} "
                                              f"{tuple(w.shape)} on {w.device}")
    if not isinstance(x, torch.Tensor):
        raise ArgumentError("x", f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2 or x.shape[1] != in_features or x.dtype != torch.bfloat16:
        raise ArgumentError("x", f"expected a bfloat16 (tokens, {in_features}) tensor, got "
                                 f"{x.dtype} of shape {tuple(x.shape)}")
    if x.device != w0.device:
        raise ArgumentError("x", f"expected a tensor on {w0.device} (the weights' device), got "
                                 f"one on {x.device}")
    if not isinstance(offsets, torch.Tensor):
        raise ArgumentError("offsets", f"expected a torch.Tensor, got {type(offsets).__name__}")
    if offsets.dtype != torch.int32 or tuple(offsets.shape) != (len(weights),):
        raise ArgumentError("offsets", f"expected an int32 ({len(weights)},) tensor (one "
                                       f"cumulative token count per expert), got "
                                       f"{offsets.dtype} of shape {tuple(offsets.shape)}")
    if offsets.device != x.device:
        raise ArgumentError("offsets", f"expected a tensor on {x.device} like x, got one on "
                                       f"{offsets.device}")


def _main_grads(weights: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Every weight's ``main_grad`` buffer, checked: a contiguous, 16-byte aligned tensor of
    the weight's shape and device, all float32 (or all bfloat16)."""
    mains = [getattr(w, "main_grad", None) for w in weights]
    dtype = getattr(mains[0], "dtype", None)
    for e, (w, m) in enumerate(zip(weights, mains)):
        if (not isinstance(m, torch.Tensor) or m.dtype not in _MAIN_GRAD_DTYPES
                or m.dtype != dtype or m.shape != w.shape or m.device != w.device
                or not m.is_contiguous() or m.data_ptr() % 16):
            got = "None" if m is None else (
                f"{type(m).__name__}" if not isinstance(m, torch.Tensor) else
                f"{m.dtype} {tuple(m.shape)} on {m.device}"
                + ("" if m.is_contiguous() else ", not contiguous")
                + (f", address {m.data_ptr():#x} not 16-byte aligned" if m.data_ptr() % 16
                   else ""))
            raise ArgumentError(f"weight{e}.main_grad",
                                f"expected a contiguous, 16-byte aligned float32 "
                                f"{tuple(w.shape)} tensor on {w.device} (one dtype for all "
                                f"experts: float32, or bfloat16), got {got} (allocate it with "
                                f"GroupedLinear.allocate_main_grad() or assign "
                                f"torch.zeros_like(weight, dtype=torch.float32))")
    return mains


class GroupedLinearFunction(torch.autograd.Function):
    """``y[tokens_e] = x[tokens_e] @ weights[e]``; the autograd function of ``GroupedLinear``.

    ``apply(x, offsets, use_main_grad, *weights)``. Forward: the weights stacked once and
    ``torch._grouped_mm`` (CUDA bfloat16), else a per-expert loop. Backward: the weight
    gradients by one gwgrad call -- with ``use_main_grad``, accumulated in place into every
    weight's ``main_grad`` (discrete outputs, ``accumulate=True``), ``None`` returned for the
    weights and ``grad_added_to_main_grad = True`` set on them; otherwise a new bfloat16
    (num_experts, in, out) tensor returned as per-expert views -- then ``dx`` by torch
    (``_grouped_mm(dy, stacked weights transposed)``), when x needs it.
    """

    @staticmethod
    def forward(ctx, x, offsets, use_main_grad, *weights):
        x = x.contiguous()
        ctx.use_main_grad = bool(use_main_grad)
        ctx.weights = weights  # the Parameter objects: their main_grad attributes (leaves: no cycle)
        ctx.save_for_backward(x, offsets, *weights)
        return _grouped_mm(x, torch.stack(weights), offsets)

    @staticmethod
    def backward(ctx, dy):
        x, offsets, *weights = ctx.saved_tensors
        dy = dy.contiguous()  # autograd may hand over an expanded or strided gradient
        need_w = ctx.needs_input_grad[3:]
        grads: List[Optional[torch.Tensor]] = [None] * len(weights)
        if any(need_w):
            if ctx.use_main_grad:
                params = ctx.weights
                mains = _main_grads(params)
                if all(need_w):
                    # One launch: main_grad[e] += x_e.T @ dy_e for every expert, in place.
                    wgrad(x, dy, offsets, out=mains, accumulate=True)
                else:  # some experts frozen: only the others' main grads change
                    dw = wgrad(x, dy, offsets, out_dtype=torch.float32)
                    for e, need in enumerate(need_w):
                        if need:
                            mains[e].add_(dw[e])
                for p, need in zip(params, need_w):
                    if need:
                        p.grad_added_to_main_grad = True
            else:
                dw = wgrad(x, dy, offsets, out_dtype=weights[0].dtype)
                grads = [g if need else None for g, need in zip(dw.unbind(0), need_w)]
        dx = None
        if ctx.needs_input_grad[0]:
            dx = _grouped_mm(dy, torch.stack(weights).transpose(1, 2), offsets)
        return (dx, None, None, *grads)


class GroupedLinear(torch.nn.Module):
    """Grouped expert linear layer: ``y[tokens_e] = x[tokens_e] @ weight{e}`` for every expert
    e, with one ``nn.Parameter`` per expert and, by default, FP32 main gradients.

        layer = GroupedLinear(num_experts, in_features, out_features, device="cuda")
        y = layer(x, offsets)          # x (tokens, in_features) bfloat16, grouped by expert
        y.backward(dy)                 # weight{e}.main_grad += x_e.T @ dy_e (one gwgrad call)

    ``offsets``: int32 (num_experts,), the cumulative token counts (``end_e = offsets[e]``,
    ``begin_e = offsets[e-1]``, 0 for e = 0; the last entry equals ``x.shape[0]``); read on
    the device only. Parameters ``weight0 .. weight{E-1}``, each bfloat16
    ``(in_features, out_features)`` so that ``dW_e = x_e.T @ dy_e`` is gwgrad's output
    layout; in_features and out_features are multiples of 8.

    **Main gradients** (``main_grad=True``, the Megatron-LM / Transformer Engine convention of
    ``gradient_accumulation_fusion``): every weight carries a ``main_grad`` attribute, a
    contiguous float32 tensor of the weight's shape on its device (16-byte aligned; all
    experts one dtype: float32, or bfloat16). The layer allocates zeroed ones at construction
    (``allocate_main_grad()``); a caller may assign its own instead -- e.g. views into one
    flat gradient buffer, as Megatron's DDP does: ``param.main_grad =
    flat[start:start + n].view(in_features, out_features)``. The backward adds every expert's
    gradient straight into those buffers (one gwgrad launch, discrete outputs with
    ``accumulate=True``: no temporary of the weight-gradient size, no copy), returns None
    for the weights -- so **``param.grad`` stays None** and autograd's gradient hooks on the
    weights do not fire -- and sets ``param.grad_added_to_main_grad = True``. Zero the
    buffers between optimizer steps with ``zero_main_grad()`` (in place: the addresses, and
    so the cached pointer array and captured CUDA graphs, stay valid). Experts without
    tokens leave their main grad unchanged. With ``main_grad=False`` the weights get
    ordinary bfloat16 ``.grad``s: one gwgrad call into a new (num_experts, in, out) tensor,
    handed to autograd as per-expert views.

    **No host synchronization** in forward or backward (metadata checks only; the offsets
    stay on the device), so a training step can be captured in a CUDA graph: run one eager
    step first (it compiles the kernel and caches the main grads' pointer array), capture
    with ``torch.cuda.graph``, and before each replay copy new values into the captured
    offsets tensor. Replays accumulate into the same main grads; ``grad_added_to_main_grad``
    is set when the backward is captured, not per replay. With
    ``torch.cuda.make_graphed_callables`` pass ``allow_unused_input=True`` (the weights get
    no gradient) and zero the main grads after it: its warm-up steps run the backward.
    Needs ``torch._grouped_mm`` (PyTorch >= 2.8, SM90+) for the forward and ``dx`` on CUDA;
    without it a per-expert loop runs, which reads the offsets on the host (syncs, not
    capturable). CPU tensors run gwgrad's reference (and the loop).
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, *,
                 dtype: torch.dtype = torch.bfloat16, device=None, main_grad: bool = True):
        super().__init__()
        _positive_int("num_experts", num_experts)
        _positive_int("in_features", in_features, 8)
        _positive_int("out_features", out_features, 8)
        if dtype != torch.bfloat16:
            raise ArgumentError("dtype", f"expected torch.bfloat16 (gwgrad's BF16 kernels), got "
                                         f"{dtype}")
        if not isinstance(main_grad, bool):
            raise ArgumentError("main_grad", f"expected True or False, got {main_grad!r}")
        self.num_experts = num_experts
        self.in_features = in_features
        self.out_features = out_features
        self.use_main_grad = main_grad
        for e in range(num_experts):
            self.register_parameter(f"weight{e}", torch.nn.Parameter(
                torch.empty(in_features, out_features, dtype=dtype, device=device)))
        self.reset_parameters()
        if main_grad:
            self.allocate_main_grad()

    @property
    def weights(self) -> List[torch.nn.Parameter]:
        """``[weight0, ..., weight{E-1}]``."""
        return [getattr(self, f"weight{e}") for e in range(self.num_experts)]

    def reset_parameters(self) -> None:
        """Uniform in ``+-1/sqrt(in_features)`` (``nn.Linear``'s default bound)."""
        bound = self.in_features ** -0.5
        with torch.no_grad():
            for w in self.weights:
                w.uniform_(-bound, bound)

    def allocate_main_grad(self, dtype: torch.dtype = torch.float32) -> None:
        """Give every weight a new zeroed ``main_grad`` of ``dtype`` on its device (after
        moving the module to another device, call this again)."""
        if dtype not in _MAIN_GRAD_DTYPES:
            raise ArgumentError("dtype", f"expected torch.float32 or torch.bfloat16, got {dtype}")
        for w in self.weights:
            w.main_grad = torch.zeros(w.shape, dtype=dtype, device=w.device)
            w.grad_added_to_main_grad = False

    def zero_main_grad(self) -> None:
        """Zero every ``main_grad`` in place and reset ``grad_added_to_main_grad``."""
        for w in self.weights:
            main = getattr(w, "main_grad", None)
            if main is not None:
                main.zero_()
            w.grad_added_to_main_grad = False

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        weights = self.weights
        _check_layer_input(x, offsets, weights, self.in_features)
        if self.use_main_grad and torch.is_grad_enabled() and any(w.requires_grad
                                                                   for w in weights):
            _main_grads(weights)  # a missing or wrong buffer fails here, not in backward
        return GroupedLinearFunction.apply(x, offsets, self.use_main_grad, *weights)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, main_grad={self.use_main_grad}")


__all__ += ["GroupedLinear", "GroupedLinearFunction"]
