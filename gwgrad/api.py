"""The public API: the contract's class and wrapper, under architecture-neutral names.

``GroupedGemmWgrad`` is the reusable operator (samples at construction, ``check_support()``,
``compile()``, ``execute()``). ``grouped_gemm_wgrad`` is the one-call wrapper. Both run the
three tiers of ``gwgrad.plan``: a call signature is checked once and bound to a compiled
operator (its ``LaunchPlan``); every later call with that signature only describes its
tensors, finds the plan, allocates a missing output and launches, without synchronizing.
``GroupedGemmWgradSm100`` and ``grouped_gemm_wgrad_wrapper_sm100`` are the contract's names.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Sequence, Tuple

from . import backends, interop, plan as plans
from .dtypes import DType
from .errors import ArgumentError
from .plan import LaunchPlan, cache_info, clear_cache
from .spec import StaticSpec
from .tensors import TensorDesc
from .validation import build_spec, check_output_stack

__all__ = ["TupleDict", "GroupedGemmWgrad", "grouped_gemm_wgrad", "GroupedGemmWgradSm100",
           "grouped_gemm_wgrad_wrapper_sm100", "cache_info", "clear_cache"]

_describe = interop.as_tensor_desc


class TupleDict(dict):
    """The wrapper's result: keyed access (``result["wgrad_tensor"]``) and tuple unpacking
    (``(wgrad,) = result`` or ``result[0]``): iterating yields the values, in order."""

    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, key):
        if isinstance(key, int) and not isinstance(key, bool):
            return list(self.values())[key]
        return super().__getitem__(key)


#: The class API's sample arguments, reported under their own names.
_SAMPLE_NAMES = {"a_tensor": "sample_a", "b_tensor": "sample_b", "sfa_tensor": "sample_sfa",
                 "sfb_tensor": "sample_sfb", "offsets_tensor": "sample_offsets",
                 "wgrad_tensor": "sample_wgrad", "global_scale_a": "sample_global_scale_a",
                 "global_scale_b": "sample_global_scale_b"}


def _stream(current_stream: Any, a: TensorDesc) -> int:
    return interop.resolve_stream(current_stream, a.framework, a.device_id) if a.is_cuda else 0


def _output(plan: LaunchPlan, wgrad: Optional[TensorDesc], ptrs: Optional[TensorDesc],
            stream: int) -> TensorDesc:
    """What the launch's ``out`` address points to: the dense output, or the pointer array
    (built from a stacked output when only that was given; hold it until the launch)."""
    if not plan.discrete:
        return wgrad
    if ptrs is None:
        ptrs = interop.pointer_array(wgrad, stream)
    interop.keep_alive(ptrs, stream)  # the kernel reads it on the launch stream
    return ptrs


class GroupedGemmWgrad:
    """A grouped weight-gradient operator compiled for one static spec.

    Dense output: pass ``sample_wgrad`` (num_experts, hidden, intermediate). Discrete output:
    pass ``sample_wgrad_expert`` (one (hidden, intermediate) output) and/or ``wgrad_dtype``,
    with ``num_experts`` and ``wgrad_shape`` optional cross-checks; ``execute`` then takes
    ``wgrad_ptrs`` (or a stacked ``wgrad_tensor`` to build them from). ``tokens_sum`` and
    the offsets values may change from call to call.
    """

    def __init__(
        self,
        sample_a: Any,
        sample_b: Any,
        sample_sfa: Any = None,
        sample_sfb: Any = None,
        sample_offsets: Any = None,
        sample_wgrad: Any = None,
        sample_wgrad_expert: Any = None,
        num_experts: Optional[int] = None,
        wgrad_shape: Optional[Tuple[int, int]] = None,
        wgrad_dtype: Any = None,
        sample_global_scale_a: Any = None,
        sample_global_scale_b: Any = None,
        acc_dtype: Any = DType.FLOAT32,
        mma_tiler_mn: Optional[Tuple[int, int]] = None,
        cluster_shape_mn: Optional[Tuple[int, int]] = None,
        sf_vec_size: int = 16,
        accumulate_on_output: bool = False,
        input_order: str = "tensor2d",
        *,
        output_mode: Optional[str] = None,
        validate_offsets: bool = False,
    ) -> None:
        if output_mode is None:
            discrete = sample_wgrad is None and (
                sample_wgrad_expert is not None or num_experts is not None or wgrad_shape is not None)
            output_mode = "discrete" if discrete else "dense"
        try:
            t = {name: _describe(value, name) for name, value in (
                ("a_tensor", sample_a), ("b_tensor", sample_b), ("sfa_tensor", sample_sfa),
                ("sfb_tensor", sample_sfb), ("offsets_tensor", sample_offsets),
                ("wgrad_tensor", sample_wgrad), ("sample_wgrad_expert", sample_wgrad_expert),
                ("global_scale_a", sample_global_scale_a),
                ("global_scale_b", sample_global_scale_b))}
            if output_mode == "dense" and t["wgrad_tensor"] is None:
                raise ArgumentError("wgrad_tensor", "expected the dense output tensor "
                                    "(num_experts, hidden, intermediate) the operator is built "
                                    "for, got None")
            if output_mode == "discrete" and t["sample_wgrad_expert"] is None and wgrad_dtype is None:
                raise ArgumentError("sample_wgrad_expert", "expected one (hidden, intermediate) "
                                    "output (or wgrad_dtype) for discrete output, got None")
            if output_mode == "discrete" and t["wgrad_tensor"] is not None:
                raise ArgumentError("wgrad_tensor", "expected None for discrete output (pass "
                                    "sample_wgrad_expert), got a tensor")
            request = build_spec(
                a=t["a_tensor"], b=t["b_tensor"], offsets=t["offsets_tensor"], sfa=t["sfa_tensor"],
                sfb=t["sfb_tensor"], global_scale_a=t["global_scale_a"],
                global_scale_b=t["global_scale_b"], output_mode=output_mode,
                wgrad=t["wgrad_tensor"], wgrad_expert=t["sample_wgrad_expert"],
                num_experts=num_experts, wgrad_shape=wgrad_shape, wgrad_dtype=wgrad_dtype,
                acc_dtype=acc_dtype, mma_tiler_mn=mma_tiler_mn, cluster_shape_mn=cluster_shape_mn,
                sf_vec_size=sf_vec_size, accumulate=accumulate_on_output, input_order=input_order)
        except ArgumentError as exc:
            raise exc.renamed(_SAMPLE_NAMES) from None
        self._request = request
        self._device_id = t["a_tensor"].device_id
        self.validate_offsets = validate_offsets
        self._spec: Optional[StaticSpec] = None
        self._backend = None
        self._operator: Optional[plans.CompiledOperator] = None
        self._plans: Dict[tuple, LaunchPlan] = {}

    @property
    def spec(self) -> StaticSpec:
        """The static spec; its tiling is final once ``check_support()`` ran."""
        return self._spec if self._spec is not None else self._request

    @property
    def backend(self):
        return self._backend

    def check_support(self) -> bool:
        """Pick the backend and tiling; raise ValueError / RuntimeError if unsupported.
        Returning True means ``compile()`` succeeds."""
        if self._spec is None:
            request = self._request
            if not request.arch:
                request = dataclasses.replace(request, arch=backends.detect_arch(self._device_id))
            self._spec, self._backend = backends.finalize_spec(request)
        return True

    def compile(self) -> None:
        self.check_support()
        if self._operator is None:
            self._operator = plans.compile_spec(self._spec)

    @property
    def workspace_bytes(self) -> int:
        """Device workspace one launch needs (known once compiled; 0 for the reference)."""
        return self._operator.workspace_bytes if self._operator is not None else 0

    def execute(
        self,
        a_tensor: Any,
        b_tensor: Any,
        sfa_tensor: Any = None,
        sfb_tensor: Any = None,
        offsets_tensor: Any = None,
        wgrad_tensor: Any = None,
        wgrad_ptrs: Any = None,
        global_scale_a: Any = None,
        global_scale_b: Any = None,
        current_stream: Any = None,
        *,
        validate_offsets: Optional[bool] = None,
    ) -> None:
        """Enqueue one call on ``current_stream`` (None: the framework's current stream)."""
        if self._operator is None:
            raise RuntimeError(f"{type(self).__name__}: call compile() before execute()")
        a = _describe(a_tensor, "a_tensor")
        if a is None:
            raise ArgumentError("a_tensor", "expected a tensor, got None")
        b, offsets = _describe(b_tensor, "b_tensor"), _describe(offsets_tensor, "offsets_tensor")
        wgrad, ptrs = _describe(wgrad_tensor, "wgrad_tensor"), _describe(wgrad_ptrs, "wgrad_ptrs")
        scales = {name: _describe(value, name) for name, value in (
            ("sfa", sfa_tensor), ("sfb", sfb_tensor), ("global_scale_a", global_scale_a),
            ("global_scale_b", global_scale_b))}
        spec = self._operator.spec
        stream = _stream(current_stream, a)
        if spec.output_mode == "discrete" and wgrad is not None:
            if ptrs is not None:
                raise ArgumentError("wgrad_tensor", "expected None when wgrad_ptrs is given "
                                    "(discrete output goes through wgrad_ptrs), got a tensor")
            check_output_stack(wgrad, "wgrad_tensor", spec.num_experts, spec.hidden,
                               spec.intermediate)
            ptrs = interop.pointer_array(wgrad, stream)  # a stack stands for its addresses
        if spec.output_mode == "dense" and wgrad is None:
            raise ArgumentError("wgrad_tensor", "expected the dense output tensor, got None")
        plan = plans.plan_for_spec(self._operator, a, b, offsets,
                                   None if spec.output_mode == "discrete" else wgrad, ptrs,
                                   self._plans, **scales)
        validate = self.validate_offsets if validate_offsets is None else validate_offsets
        out = _output(plan, wgrad, ptrs, stream)
        plan.launch(a.ptr, b.ptr, offsets.ptr, out.ptr, stream=stream,
                    workspace=_workspace(plan, a, stream), validate_offsets=validate,
                    scales=_addresses(scales.values()))


def _addresses(scales) -> Tuple[int, ...]:
    """Block-scaled inputs' addresses for ``LaunchPlan.launch`` (empty for BF16)."""
    scales = tuple(scales)
    return tuple(0 if d is None else d.ptr for d in scales) if any(scales) else ()


def _workspace(plan: LaunchPlan, like: TensorDesc, stream: int) -> int:
    """Workspace from the operands' framework (torch's allocator; graph-capture safe)."""
    if not plan.workspace_bytes or like.framework != "torch":
        return 0
    return interop.framework("torch").workspace(plan.device_id, stream, plan.workspace_bytes)


def grouped_gemm_wgrad(
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
    accumulate_on_output: bool = False,
    input_order: str = "tensor2d",
    current_stream: Any = None,
    *,
    validate_offsets: bool = False,
) -> TupleDict:
    """``W[e] = A[:, begin:end] @ B[begin:end, :]`` for every expert; see the README.

    Returns ``TupleDict(wgrad_tensor=...)``: the output given or allocated (in ``a_tensor``'s
    framework), or None for pointer-only discrete output. ``wgrad_dtype`` defaults to the
    given output's dtype, else bfloat16. With ``accumulate_on_output=True`` an output must be
    given (there is nothing to add into otherwise).

    Offsets: every CUDA launch checks them on the device, without synchronizing; invalid
    offsets make the kernel write nothing, and the ``ValueError`` naming ``offsets_tensor``
    comes from ``gwgrad.check_errors()`` or the next gwgrad call (see gwgrad.status).
    ``validate_offsets=True`` also checks them on the host before launching (one copy and a
    synchronization: the error is then raised by this call). CPU arrays are always checked.
    """
    a = _describe(a_tensor, "a_tensor")
    if a is None:
        raise ArgumentError("a_tensor", "expected a tensor, got None")
    b, offsets = _describe(b_tensor, "b_tensor"), _describe(offsets_tensor, "offsets_tensor")
    wgrad, ptrs = _describe(wgrad_tensor, "wgrad_tensor"), _describe(wgrad_ptrs, "wgrad_ptrs")
    sfa, sfb = _describe(sfa_tensor, "sfa_tensor"), _describe(sfb_tensor, "sfb_tensor")
    gsa, gsb = _describe(global_scale_a, "global_scale_a"), _describe(global_scale_b, "global_scale_b")
    allocate = wgrad is None and ptrs is None
    if allocate and accumulate_on_output:
        raise ArgumentError("wgrad_tensor", "expected an initialized output to accumulate into "
                            "(accumulate_on_output=True adds to it), got None")
    plan = plans.plan_for(
        a, b, offsets, wgrad=wgrad, wgrad_ptrs=ptrs, output_mode=output_mode, wgrad_dtype=wgrad_dtype,
        accumulate_on_output=accumulate_on_output, input_order=input_order,
        mma_tiler_mn=mma_tiler_mn, cluster_shape_mn=cluster_shape_mn, acc_dtype=acc_dtype,
        sf_vec_size=sf_vec_size, sfa=sfa, sfb=sfb, global_scale_a=gsa, global_scale_b=gsb)
    spec = plan.spec
    stream = _stream(current_stream, a)
    result = wgrad_tensor
    if allocate:
        result, wgrad = interop.allocate(
            a, (spec.num_experts, spec.hidden, spec.intermediate), spec.wgrad_dtype, stream)
    out = _output(plan, wgrad, ptrs, stream)
    plan.launch(a.ptr, b.ptr, offsets.ptr, out.ptr, stream=stream,
                workspace=_workspace(plan, a, stream), validate_offsets=validate_offsets,
                scales=_addresses((sfa, sfb, gsa, gsb)))
    return TupleDict(wgrad_tensor=result)


#: The contract's names (cuDNN frontend); gwgrad also runs them on SM90 and on the CPU.
GroupedGemmWgradSm100 = GroupedGemmWgrad
grouped_gemm_wgrad_wrapper_sm100 = grouped_gemm_wgrad
