"""The public API: the contract's class and wrapper, under architecture-neutral names.

``GroupedGemmWgrad`` is the reusable operator (samples at construction, ``check_support()``,
``compile()``, ``execute()``). ``grouped_gemm_wgrad`` is the one-call wrapper. Both run the
three tiers of ``gwgrad.plan``: a call signature is checked once and bound to a compiled
operator (its ``LaunchPlan``); every later call with that signature only describes its
tensors, finds the plan, allocates a missing output and launches, without synchronizing.
``GroupedGemmWgradSm100`` and ``grouped_gemm_wgrad_wrapper_sm100`` are the contract's names;
they take every argument of cuDNN frontend 1.32's (``sf_fp8_dtype_override``,
``descriptor_workspace``), and ``get_grouped_gemm_wgrad_workspace_size_sm100`` sizes a
caller-owned workspace with cuDNN's signature.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Tuple

from . import cuda, interop, plan as plans
from .dtypes import DType
from .errors import NAMED_ERRORS, ArgumentError, UnsupportedError
from .plan import LaunchPlan, cache_info, clear_cache, workspace_bytes_bound
from .spec import StaticSpec
from .tensors import TensorDesc
from .validation import build_spec, check_output_stack, operand_dims

__all__ = ["TupleDict", "GroupedGemmWgrad", "grouped_gemm_wgrad", "GroupedGemmWgradSm100",
           "grouped_gemm_wgrad_wrapper_sm100", "get_grouped_gemm_wgrad_workspace_size_sm100",
           "cache_info", "clear_cache"]

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


#: cuDNN frontend's ``sf_fp8_dtype_override`` values: None (the scale tensors' dtype says what
#: they hold) or "e5m3" (NVFP4 scale bytes that are UE5M3, not E4M3; cuDNN reads them on Rubin).
SF_FP8_DTYPE_OVERRIDES = (None, "e5m3")


def _check_sf_override(value: Any, a_dtype: DType, sf_dtype: Optional[DType]) -> None:
    """The rules of ``sf_fp8_dtype_override`` a call can break whatever the architecture
    (ArgumentError): a value other than None / "e5m3", or "e5m3" with scale factors that are
    not NVFP4's E4M3 bytes (BF16 takes no scale controls at all)."""
    if value is None:
        return
    if not isinstance(value, str) or value not in SF_FP8_DTYPE_OVERRIDES:
        raise ArgumentError("sf_fp8_dtype_override", f"expected None or 'e5m3', got {value!r}")
    if a_dtype == DType.BFLOAT16:
        raise ArgumentError("sf_fp8_dtype_override", "expected None for bfloat16 inputs (BF16 "
                            f"takes no scale controls), got {value!r}")
    if a_dtype != DType.FLOAT4_E2M1FN_X2 or sf_dtype != DType.FLOAT8_E4M3FN:
        raise ArgumentError("sf_fp8_dtype_override", "expected None unless the inputs are NVFP4 "
                            "(float4_e2m1fn_x2 operands, float8_e4m3fn scale factors: 'e5m3' "
                            f"reinterprets those bytes), got {value!r} with {a_dtype} operands "
                            f"and {sf_dtype} scale factors")


def _sf_override_unsupported(value: Any, arch: str) -> None:
    """'e5m3' (after ``_check_sf_override``): no kernel of gwgrad reads UE5M3 scale bytes, on
    any architecture or on the CPU."""
    if value is not None:
        raise UnsupportedError(
            "sf_fp8_dtype_override", f"{value!r} (UE5M3 scale factors) needs a kernel that reads "
            "UE5M3 scale bytes: gwgrad's kernels and its CPU reference read E4M3 (NVFP4) and "
            "E8M0 (MXFP8, MXFP4) scale factors only (cuDNN frontend reads UE5M3 on Rubin, "
            f"SM107, GPUs); this is {arch or 'unknown'}", arch=arch, needs=())


def get_grouped_gemm_wgrad_workspace_size_sm100(
    num_experts: int,
    *,
    output_mode: str = "dense",
    input_order: str = "tensor2d",
) -> int:
    """Bytes of device workspace that serve any call with ``num_experts`` experts and this
    output mode, on every architecture and format (cuDNN frontend's signature and meaning:
    the size of a caller-owned ``descriptor_workspace``). Computed on the host: no GPU, no
    CuTe DSL. ``input_order`` is checked and does not change the size. A compiled operator's
    own need (``GroupedGemmWgrad.workspace_bytes``) is at most this.

    The workspace holds the experts' token ranges and order and their TMA descriptors, which
    every launch's prep work writes before its tiles read them. A ``descriptor_workspace`` may
    hold anything (``torch.empty`` will do): before a single-launch kernel, whose prep
    hand-off counters are its first ``gwgrad.plan.WORKSPACE_ZEROED_BYTES`` (16) bytes, the
    wrapper and ``execute`` zero those on the call's stream. (``LaunchPlan.launch`` itself,
    the raw-address tier, does not: there they must be zero before the first launch; every
    launch leaves the hand-off words, bytes 8-15, zero and rewrites bytes 0-7, the unit
    counter and the offsets verdict, before reading them.)
    """
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
        raise ArgumentError("num_experts", f"expected a positive int, got {num_experts!r}")
    from .spec import INPUT_ORDERS, OUTPUT_MODES

    if getattr(output_mode, "value", output_mode) not in OUTPUT_MODES:
        raise ArgumentError("output_mode", f"expected 'dense' or 'discrete', got {output_mode!r}")
    if getattr(input_order, "value", input_order) not in INPUT_ORDERS:
        raise ArgumentError("input_order", f"expected 'tensor2d' or 'tensor_ragged', got "
                            f"{input_order!r}")
    return workspace_bytes_bound(num_experts, getattr(output_mode, "value", output_mode))


class GroupedGemmWgrad:
    """A grouped weight-gradient operator compiled for one static spec.

    Dense output: pass ``sample_wgrad`` (num_experts, hidden, intermediate). Discrete output:
    pass ``sample_wgrad_expert`` (one (hidden, intermediate) output) and/or ``wgrad_dtype``,
    with ``num_experts`` and ``wgrad_shape`` optional cross-checks; ``execute`` then takes
    ``wgrad_ptrs`` (or a stacked ``wgrad_tensor`` to build them from). ``tokens_sum`` and
    the offsets values may change from call to call (a tiling left to gwgrad is chosen for
    ``sample_a``'s tokens_sum, and runs any other). ``scale_recipe``: as for
    ``grouped_gemm_wgrad`` (block-scaled inputs; gwgrad/scales.py). ``sf_fp8_dtype_override``:
    cuDNN's; None, or "e5m3" (NVFP4 only), which ``check_support()`` refuses with
    ``UnsupportedError`` (no kernel of gwgrad reads UE5M3 scale factors).

    Errors: arguments no kernel runs raise ``ArgumentError`` (a ValueError) here; a call this
    architecture cannot run but another can raises ``UnsupportedError`` (a
    NotImplementedError) from ``check_support()`` (gwgrad/errors.py), as cuDNN's callers
    expect (``except (ValueError, NotImplementedError)`` around ``check_support()``).
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
        sf_fp8_dtype_override: Optional[str] = None,
        accumulate_on_output: bool = False,
        input_order: str = "tensor2d",
        *,
        output_mode: Optional[str] = None,
        validate_offsets: bool = False,
        scale_recipe: Optional[str] = None,
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
                sf_vec_size=sf_vec_size, accumulate=accumulate_on_output, input_order=input_order,
                scale_recipe=scale_recipe)
            _check_sf_override(sf_fp8_dtype_override, request.a_dtype, request.sf_dtype)
        except NAMED_ERRORS as exc:
            raise exc.renamed(_SAMPLE_NAMES) from None
        self._request = request
        self.sf_fp8_dtype_override = sf_fp8_dtype_override
        self._device_id = t["a_tensor"].device_id
        # The samples, held until check_support() picks the tiling: the autotuner (gwgrad.autotune,
        # when switched on) times the candidates on them there.
        self._samples = tuple(t[name] for name in ("a_tensor", "b_tensor", "offsets_tensor",
                                                   "sfa_tensor", "sfb_tensor", "global_scale_a",
                                                   "global_scale_b"))
        # The default tiling is chosen for the sample's tokens (it runs any tokens_sum).
        self._sample_tokens = operand_dims(t["a_tensor"], "a_tensor", "a", request.a_major)[1]
        self.validate_offsets = validate_offsets
        self._spec: Optional[StaticSpec] = None
        self._backend = None
        self._operator: Optional[plans.CompiledOperator] = None
        self._plans = plans.PlanCache()

    @property
    def spec(self) -> StaticSpec:
        """The static spec; its tiling is final once ``check_support()`` ran."""
        return self._spec if self._spec is not None else self._request

    @property
    def backend(self):
        return self._backend

    def check_support(self) -> bool:
        """Pick the backend and tiling. Raises ``UnsupportedError`` (a NotImplementedError)
        when this architecture cannot run the operator but another can (naming the argument
        and that architecture), ``ArgumentError`` (a ValueError) for a tiling the kernel does
        not run, ``RuntimeError`` without CUDA. Returning True means ``compile()`` succeeds."""
        if self._spec is None:
            request = self._request
            try:
                if not request.arch:
                    request = dataclasses.replace(request,
                                                  arch=plans.target_arch(self._device_id))
                _sf_override_unsupported(self.sf_fp8_dtype_override, request.arch)
                if plans.tuner is not None and not request.is_cpu:
                    request = plans.tuner(request, self._sample_tokens, self._device_id,
                                          self._samples)
                self._spec, self._backend = plans.finalize(request, self._sample_tokens)
            except NAMED_ERRORS as exc:
                raise exc.renamed(_SAMPLE_NAMES) from None
            self._samples = None
        return True

    def compile(self) -> None:
        self.check_support()
        if self._operator is None:
            self._operator = plans.compile_spec(self._spec)

    @property
    def workspace_bytes(self) -> int:
        """Bytes of device workspace one launch needs, the least a ``descriptor_workspace``
        may hold (0 for CPU arrays): the compiled kernel's, else (before ``compile()``) the
        backend's for the spec (``check_support()`` runs first when it has not)."""
        if self._operator is not None:
            return self._operator.workspace_bytes
        self.check_support()
        return 0 if self._spec.is_cpu else self._backend.workspace_bytes(self._spec)

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
        descriptor_workspace: Any = None,
        validate_offsets: Optional[bool] = None,
    ) -> None:
        """Enqueue one call on ``current_stream`` (None: the framework's current stream).

        ``descriptor_workspace``: cuDNN's; a caller-owned device array of at least
        ``workspace_bytes`` bytes (``get_grouped_gemm_wgrad_workspace_size_sm100`` bytes
        always suffice), contiguous, on the operands' device, 128-byte aligned, of any
        contents (gwgrad zeroes what its kernels need zeroed on ``current_stream``, a 16-byte
        memset, before each launch that needs it). The caller keeps it alive, and away from other work, until the
        launch completes on ``current_stream``. None: gwgrad provides one (the framework's
        allocator, else gwgrad's per-stream workspace). CPU arrays need none."""
        if self._operator is None:
            raise RuntimeError(f"{type(self).__name__}: call compile() before execute()")
        tensors = (a_tensor, b_tensor, offsets_tensor, wgrad_tensor, wgrad_ptrs, sfa_tensor,
                   sfb_tensor, global_scale_a, global_scale_b)
        quick = _quick(tensors)
        key = _signature(quick)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(tensors)
            self._plans[key] = plan
        stream = _stream(current_stream, plan)
        out = _output(plan, quick, wgrad_tensor, stream)
        validate = self.validate_offsets if validate_offsets is None else validate_offsets
        workspace = (_workspace(plan, stream) if descriptor_workspace is None
                     else _caller_workspace(plan, descriptor_workspace, stream))
        plan.launch(quick[0][0], quick[1][0], quick[2][0], _out_address(plan, quick, out),
                    stream=stream, workspace=workspace, validate_offsets=validate,
                    scales=_scales(plan, quick))

    def _plan(self, tensors) -> LaunchPlan:
        """The first call with a signature: checked against this operator's spec."""
        a, b, offsets, wgrad, ptrs, sfa, sfb, gsa, gsb = (
            _describe(t, name) for t, name in zip(tensors, _NAMES))
        if a is None:
            raise ArgumentError("a_tensor", "expected a tensor, got None")
        spec = self._operator.spec
        if spec.output_mode == "discrete" and wgrad is not None:
            if ptrs is not None:
                raise ArgumentError("wgrad_tensor", "expected None when wgrad_ptrs is given "
                                    "(discrete output goes through wgrad_ptrs), got a tensor")
            check_output_stack(wgrad, "wgrad_tensor", spec.num_experts, spec.hidden,
                               spec.intermediate)
        if spec.output_mode == "dense" and wgrad is None:
            raise ArgumentError("wgrad_tensor", "expected the dense output tensor, got None")
        if spec.output_mode == "discrete" and ptrs is None:
            if wgrad is None:
                raise ArgumentError("wgrad_ptrs", "expected the per-expert output addresses (or "
                                    "a stacked wgrad_tensor), got None")
            # The addresses into the stack, built per call (interop.pointer_array): their layout.
            ptrs = TensorDesc(0, (spec.num_experts,), (1,), DType.INT64, a.device_type,
                              a.device_id)
        return plans.plan_for_spec(
            self._operator, a, b, offsets, None if spec.output_mode == "discrete" else wgrad,
            ptrs, {}, sfa=sfa, sfb=sfb, global_scale_a=gsa, global_scale_b=gsb)


#: The tensor arguments of a call, in the order of ``interop.quick`` tuples below.
_NAMES = ("a_tensor", "b_tensor", "offsets_tensor", "wgrad_tensor", "wgrad_ptrs", "sfa_tensor",
          "sfb_tensor", "global_scale_a", "global_scale_b")


_ABSENT = (0, None)
_NO_SCALES = (_ABSENT,) * 4


def _quick(tensors: tuple) -> tuple:
    """``interop.quick`` of each tensor argument (the four scale arguments are usually None).
    Written out: this runs on every call, where a generator costs microseconds."""
    q = interop.quick
    a, b, offsets, wgrad, ptrs, sfa, sfb, gsa, gsb = tensors
    head = (q(a, "a_tensor"), q(b, "b_tensor"), q(offsets, "offsets_tensor"),
            q(wgrad, "wgrad_tensor"), _ABSENT if ptrs is None else q(ptrs, "wgrad_ptrs"))
    if sfa is None and sfb is None and gsa is None and gsb is None:
        return head + _NO_SCALES
    return head + (q(sfa, "sfa_tensor"), q(sfb, "sfb_tensor"), q(gsa, "global_scale_a"),
                   q(gsb, "global_scale_b"))


def _signature(quick: tuple) -> tuple:
    """The arguments' part of a plan key."""
    return (quick[0][1], quick[1][1], quick[2][1], quick[3][1], quick[4][1], quick[5][1],
            quick[6][1], quick[7][1], quick[8][1])


def _stream(current_stream: Any, plan: LaunchPlan) -> int:
    if not plan.is_cuda:
        return 0
    if current_stream is None and plan.framework_stream is not None:
        return plan.framework_stream()
    return interop.resolve_stream(current_stream, plan.framework, plan.device_id)


def _output(plan: LaunchPlan, quick: tuple, wgrad_tensor: Any, stream: int):
    """The pointer array of a discrete call given a stacked output (None otherwise: the
    ``out`` address is the call's own); hold it until the launch is enqueued."""
    if not plan.discrete or quick[4][1] is not None:
        return None
    ptrs = interop.pointer_array(_describe(wgrad_tensor, "wgrad_tensor"), stream)
    interop.keep_alive(ptrs, stream)  # the kernel reads it on the launch stream
    return ptrs


def _out_address(plan: LaunchPlan, quick: tuple, out) -> int:
    """The launch's ``out``: a pointer array or output made for the call, else the given
    pointer array (discrete) or dense output."""
    if out is not None:
        return out.ptr
    return quick[4][0] if plan.discrete else quick[3][0]


def _scales(plan: LaunchPlan, quick: tuple) -> Tuple[int, ...]:
    """Block-scaled inputs' addresses for ``LaunchPlan.launch`` (empty for BF16)."""
    return tuple(q[0] for q in quick[5:]) if plan.spec.is_block_scaled else ()


def _workspace(plan: LaunchPlan, stream: int) -> int:
    """Workspace from the operands' framework (torch's allocator; graph-capture safe); 0:
    gwgrad's own per-stream workspace (LaunchPlan.launch)."""
    if not plan.workspace_bytes or plan.framework != "torch":
        return 0
    return interop.framework("torch").workspace(plan.device_id, stream, plan.workspace_bytes)


def _caller_workspace(plan: LaunchPlan, workspace: Any, stream: int) -> int:
    """The address of a caller's ``descriptor_workspace`` for ``plan`` (0 for the reference,
    which needs none), after the checks its use needs (ArgumentError naming it). A
    single-launch kernel's prep hand-off starts from zeroed leading bytes
    (``WORKSPACE_ZEROED_BYTES``); cuDNN's callers may bring uninitialized memory
    (``torch.empty``), so those bytes are zeroed on ``stream`` before each such launch."""
    desc = _describe(workspace, "descriptor_workspace")
    if not plan.is_cuda:
        return 0
    need = plan.workspace_bytes
    if not desc.is_cuda or desc.device_id != plan.device_id:
        raise ArgumentError("descriptor_workspace", f"expected a tensor on cuda:{plan.device_id} "
                            f"like a_tensor, got a tensor on {desc.device}")
    if not desc.is_contiguous():
        raise ArgumentError("descriptor_workspace", f"expected a contiguous tensor, got shape "
                            f"{desc.shape} strides {desc.strides}")
    if desc.read_only:
        raise ArgumentError("descriptor_workspace", "expected a writable tensor, got a "
                            "read-only one")
    nbytes = desc.numel * desc.dtype.itemsize
    if nbytes < need:
        raise ArgumentError("descriptor_workspace", f"expected at least {need} bytes (this "
                            "operator's workspace_bytes; get_grouped_gemm_wgrad_workspace_size_"
                            f"sm100({plan.spec.num_experts}, output_mode="
                            f"{plan.spec.output_mode!r}) bytes always suffice), got {nbytes}")
    if need and desc.ptr % 128:
        raise ArgumentError("descriptor_workspace", f"expected a 128-byte aligned base address, "
                            f"got {desc.ptr:#x}")
    if need and plan.spec.launches == 1:
        with cuda.on_device(plan.device_id):
            cuda.memset_async(desc.ptr, plans.WORKSPACE_ZEROED_BYTES, stream)
    return desc.ptr


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
    sf_fp8_dtype_override: Optional[str] = None,
    accumulate_on_output: bool = False,
    input_order: str = "tensor2d",
    current_stream: Any = None,
    *,
    descriptor_workspace: Any = None,
    validate_offsets: bool = False,
    scale_recipe: Optional[str] = None,
) -> TupleDict:
    """``W[e] = A[:, begin:end] @ B[begin:end, :]`` for every expert; see the README.

    Returns ``TupleDict(wgrad_tensor=...)``: the output given or allocated (in ``a_tensor``'s
    framework), or None for pointer-only discrete output. ``wgrad_dtype`` defaults to the
    given output's dtype, else bfloat16. With ``accumulate_on_output=True`` an output must be
    given (there is nothing to add into otherwise).

    Errors: ``ArgumentError`` (a ValueError) for arguments no kernel runs, ``UnsupportedError``
    (a NotImplementedError) for a call this architecture cannot run but another can,
    ``RuntimeError`` for an unusable environment (gwgrad/errors.py).

    Offsets: every CUDA launch checks them on the device, without synchronizing; invalid
    offsets make the kernel write nothing, and the ``ValueError`` naming ``offsets_tensor``
    comes from ``gwgrad.check_errors()`` or the next gwgrad call (see gwgrad.status).
    ``validate_offsets=True`` also checks them on the host before launching (one copy and a
    synchronization: the error is then raised by this call). CPU arrays are always checked.

    Block-scaled inputs: ``scale_recipe`` says what ``sfa_tensor`` / ``sfb_tensor`` hold
    (gwgrad/scales.py): None or "blocked" for FP8 (E8M0 / E4M3) scale factors, and
    "per_expert_channel" or "block_1x128" for FP32 ones.

    cuDNN frontend 1.32's arguments: ``sf_fp8_dtype_override`` None, or "e5m3" (NVFP4 only),
    which raises ``UnsupportedError`` (no kernel of gwgrad reads UE5M3 scale factors);
    ``descriptor_workspace`` a caller-owned workspace, as for ``GroupedGemmWgrad.execute``
    (sized by ``get_grouped_gemm_wgrad_workspace_size_sm100``; every backend takes one).
    """
    if sf_fp8_dtype_override is not None:
        a, sfa = _describe(a_tensor, "a_tensor"), _describe(sfa_tensor, "sfa_tensor")
        if a is None:
            raise ArgumentError("a_tensor", "expected a tensor, got None")
        _check_sf_override(sf_fp8_dtype_override, a.dtype, None if sfa is None else sfa.dtype)
        _sf_override_unsupported(sf_fp8_dtype_override,
                                 plans.target_arch(a.device_id) if a.is_cuda else "cpu")
    if accumulate_on_output and wgrad_tensor is None and wgrad_ptrs is None:
        raise ArgumentError("wgrad_tensor", "expected an initialized output to accumulate into "
                            "(accumulate_on_output=True adds to it), got None")
    tensors = (a_tensor, b_tensor, offsets_tensor, wgrad_tensor, wgrad_ptrs, sfa_tensor,
               sfb_tensor, global_scale_a, global_scale_b)
    quick = _quick(tensors)
    key = (_signature(quick), output_mode, wgrad_dtype, acc_dtype,
           plans.hashable(mma_tiler_mn), plans.hashable(cluster_shape_mn), sf_vec_size,
           accumulate_on_output, input_order, scale_recipe, descriptor_workspace is None)
    try:
        plan = plans.call_plans.get(key)
    except TypeError:  # an unhashable argument: the full check names it
        plan, key = None, None
    if plan is None:
        a, b, offsets, wgrad, ptrs, sfa, sfb, gsa, gsb = (
            _describe(t, name) for t, name in zip(tensors, _NAMES))
        if a is None:
            raise ArgumentError("a_tensor", "expected a tensor, got None")
        plan = plans.plan_for(
            a, b, offsets, wgrad=wgrad, wgrad_ptrs=ptrs, output_mode=output_mode,
            wgrad_dtype=wgrad_dtype, accumulate_on_output=accumulate_on_output,
            input_order=input_order, mma_tiler_mn=mma_tiler_mn, cluster_shape_mn=cluster_shape_mn,
            acc_dtype=acc_dtype, sf_vec_size=sf_vec_size, sfa=sfa, sfb=sfb, global_scale_a=gsa,
            global_scale_b=gsb, scale_recipe=scale_recipe,
            grow_workspace=descriptor_workspace is None)
        if key is not None:
            plans.call_plans[key] = plan
    stream = _stream(current_stream, plan)
    result, out = wgrad_tensor, None
    if quick[3][1] is None and quick[4][1] is None:  # no output given: allocate one
        spec = plan.spec
        result, desc = interop.allocate(plan.layout("a"), (spec.num_experts, spec.hidden,
                                                           spec.intermediate),
                                        spec.wgrad_dtype, stream)
        if plan.discrete:
            out = interop.pointer_array(desc, stream)
            interop.keep_alive(out, stream)
        else:
            out = desc
    else:
        out = _output(plan, quick, wgrad_tensor, stream)
    workspace = (_workspace(plan, stream) if descriptor_workspace is None
                 else _caller_workspace(plan, descriptor_workspace, stream))
    plan.launch(quick[0][0], quick[1][0], quick[2][0], _out_address(plan, quick, out),
                stream=stream, workspace=workspace, validate_offsets=validate_offsets,
                scales=_scales(plan, quick))
    return TupleDict(wgrad_tensor=result)


#: The contract's names (cuDNN frontend); gwgrad also runs them on SM90 and on the CPU.
GroupedGemmWgradSm100 = GroupedGemmWgrad
grouped_gemm_wgrad_wrapper_sm100 = grouped_gemm_wgrad
