"""The public API: the contract's class and wrapper, under architecture-neutral names.

``GroupedGemmWgrad`` is the reusable operator (samples at construction, ``check_support()``,
``compile()``, ``execute()``; ``launch()`` for adapters that build ``TensorDesc``s
themselves). ``grouped_gemm_wgrad`` validates a call, finds or builds the compiled operator for
its static spec, allocates missing outputs and launches. ``GroupedGemmWgradSm100`` and
``grouped_gemm_wgrad_wrapper_sm100`` are the contract's names for the same objects.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Dict, Optional, Sequence, Tuple

from . import backends, memory, offsets as offsets_rules, outputs
from .backends.base import Backend, LaunchArgs
from .dtypes import DType
from .spec import StaticSpec
from .streams import resolve_stream
from .tensors import TensorDesc, as_tensor_desc
from .validation import build_spec, check_call, check_output_stack, operand_dims

__all__ = ["TupleDict", "GroupedGemmWgrad", "grouped_gemm_wgrad", "GroupedGemmWgradSm100",
           "grouped_gemm_wgrad_wrapper_sm100", "cache_info", "clear_cache", "operator_for"]


class TupleDict(dict):
    """The wrapper's result: keyed access (``result["wgrad_tensor"]``) and tuple unpacking
    (``(wgrad,) = result`` or ``result[0]``): iterating yields the values, in order."""

    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, key):
        if isinstance(key, int) and not isinstance(key, bool):
            return list(self.values())[key]
        return super().__getitem__(key)


_lock = threading.RLock()
_operators: Dict[StaticSpec, "GroupedGemmWgrad"] = {}
# The adapters' fast path: a call's static signature (see operator_for) -> its operator.
_by_signature: Dict[tuple, "GroupedGemmWgrad"] = {}
_counters = {"constructed": 0, "compiled": 0}


def cache_info() -> Dict[str, int]:
    """Operators in the wrapper's cache, and how many were ever constructed / compiled."""
    with _lock:
        return {"operators": len({id(op) for op in _operators.values()}), **_counters}


def clear_cache() -> None:
    """Forget every cached operator (the CuTe DSL's own file cache is unaffected)."""
    with _lock:
        _operators.clear()
        _by_signature.clear()


def _tokens_sum(spec: StaticSpec, a: TensorDesc) -> int:
    return operand_dims(a, "a_tensor", "a", spec.a_major)[1]


def _tensor_args(**named: Any) -> Dict[str, Optional[TensorDesc]]:
    return {name: as_tensor_desc(value, name) for name, value in named.items()}


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
        validate_offsets: bool = True,
    ) -> None:
        if output_mode is None:
            discrete = sample_wgrad is None and (
                sample_wgrad_expert is not None or num_experts is not None or wgrad_shape is not None)
            output_mode = "discrete" if discrete else "dense"
        t = _tensor_args(sample_a=sample_a, sample_b=sample_b, sample_sfa=sample_sfa,
                         sample_sfb=sample_sfb, sample_offsets=sample_offsets,
                         sample_wgrad=sample_wgrad, sample_wgrad_expert=sample_wgrad_expert,
                         sample_global_scale_a=sample_global_scale_a,
                         sample_global_scale_b=sample_global_scale_b)
        if output_mode == "dense" and t["sample_wgrad"] is None:
            raise ValueError("sample_wgrad: expected the dense output tensor (num_experts, hidden, "
                             "intermediate) the operator is built for, got None")
        if output_mode == "discrete" and t["sample_wgrad_expert"] is None and wgrad_dtype is None:
            raise ValueError("sample_wgrad_expert: expected one (hidden, intermediate) output "
                             "(or wgrad_dtype) for discrete output, got None")
        if output_mode == "discrete" and t["sample_wgrad"] is not None:
            raise ValueError("sample_wgrad: expected None for discrete output (pass "
                             "sample_wgrad_expert), got a tensor")
        spec = _rename_errors(lambda: build_spec(
            a=t["sample_a"], b=t["sample_b"], offsets=t["sample_offsets"], sfa=t["sample_sfa"],
            sfb=t["sample_sfb"], global_scale_a=t["sample_global_scale_a"],
            global_scale_b=t["sample_global_scale_b"], output_mode=output_mode,
            wgrad=t["sample_wgrad"], wgrad_expert=t["sample_wgrad_expert"],
            num_experts=num_experts, wgrad_shape=wgrad_shape, wgrad_dtype=wgrad_dtype,
            acc_dtype=acc_dtype, mma_tiler_mn=mma_tiler_mn, cluster_shape_mn=cluster_shape_mn,
            sf_vec_size=sf_vec_size, accumulate=accumulate_on_output, input_order=input_order))
        self._setup(spec, t["sample_a"].device_id, validate_offsets)

    def _setup(self, request: StaticSpec, device_id: int, validate_offsets: bool,
               backend: Optional[Backend] = None) -> None:
        self._request = request
        self._device_id = device_id
        self.validate_offsets = validate_offsets
        self._spec: Optional[StaticSpec] = request if backend is not None else None
        self._backend = backend
        self._compiled: Any = None
        self._workspace_bytes = 0
        with _lock:
            _counters["constructed"] += 1

    @classmethod
    def _from_spec(cls, spec: StaticSpec, backend: Backend, validate_offsets: bool = True):
        op = cls.__new__(cls)
        op._setup(spec, 0, validate_offsets, backend)
        return op

    @property
    def spec(self) -> StaticSpec:
        """The static spec; its tiling is final once ``check_support()`` ran."""
        return self._spec if self._spec is not None else self._request

    @property
    def backend(self) -> Optional[Backend]:
        return self._backend

    def check_support(self) -> bool:
        """Pick the backend and tiling; raise ValueError / RuntimeError if unsupported."""
        if self._spec is None:
            request = self._request
            if not request.arch:
                import dataclasses

                request = dataclasses.replace(request, arch=backends.detect_arch(self._device_id))
            self._spec, self._backend = backends.finalize_spec(request)
        return True

    def compile(self) -> None:
        self.check_support()
        if self._compiled is None:
            self._workspace_bytes = self._backend.workspace_bytes(self._spec)
            self._compiled = self._backend.compile(self._spec)
            with _lock:
                _counters["compiled"] += 1

    @property
    def workspace_bytes(self) -> int:
        """Device workspace one launch needs (known once compiled; 0 for the reference)."""
        return self._workspace_bytes

    def _require_compiled(self) -> None:
        if self._compiled is None:
            raise RuntimeError(f"{type(self).__name__}: call compile() before execute() / launch()")

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
        self._require_compiled()
        t = _tensor_args(a_tensor=a_tensor, b_tensor=b_tensor, sfa_tensor=sfa_tensor,
                         sfb_tensor=sfb_tensor, offsets_tensor=offsets_tensor,
                         wgrad_tensor=wgrad_tensor, wgrad_ptrs=wgrad_ptrs,
                         global_scale_a=global_scale_a, global_scale_b=global_scale_b)
        a = t["a_tensor"]
        if a is None:
            raise ValueError("a_tensor: expected a tensor, got None")
        stream = resolve_stream(current_stream, a.framework, a.device_id) if a.is_cuda else 0
        wgrad, ptrs = t["wgrad_tensor"], t["wgrad_ptrs"]
        spec = self.spec
        if spec.output_mode == "discrete" and wgrad is not None:
            if ptrs is not None:
                raise ValueError("wgrad_tensor: expected None when wgrad_ptrs is given (discrete "
                                 "output goes through wgrad_ptrs), got a tensor")
            # A stacked output stands for the pointer array into it.
            check_output_stack(wgrad, "wgrad_tensor", spec.num_experts, spec.hidden,
                               spec.intermediate)
            ptrs = outputs.pointer_array(wgrad, stream)
        args = LaunchArgs(a=a, b=t["b_tensor"], offsets=t["offsets_tensor"], tokens_sum=0,
                          wgrad=wgrad, wgrad_ptrs=ptrs, sfa=t["sfa_tensor"], sfb=t["sfb_tensor"],
                          global_scale_a=t["global_scale_a"], global_scale_b=t["global_scale_b"],
                          stream=stream)
        self.launch(args, validate_offsets=validate_offsets)

    def launch(self, args: LaunchArgs, *, validate_offsets: Optional[bool] = None) -> None:
        """Enqueue one call described by ``args`` (TensorDescs, stream); sets ``tokens_sum``.

        The per-call check only compares the tensors with this operator's spec.
        """
        self._require_compiled()
        args.tokens_sum = check_call(
            self._spec, args.a, args.b, args.offsets, sfa=args.sfa, sfb=args.sfb,
            global_scale_a=args.global_scale_a, global_scale_b=args.global_scale_b,
            wgrad=args.wgrad, wgrad_ptrs=args.wgrad_ptrs)
        self._run(args, validate_offsets)

    def _run(self, args: LaunchArgs, validate_offsets: Optional[bool]) -> None:
        spec = self._spec
        validate = self.validate_offsets if validate_offsets is None else validate_offsets
        # The reference backend checks host-resident values itself, always.
        if validate and not spec.is_cpu:
            offsets_rules.check_values(spec, args.offsets, args.tokens_sum, args.wgrad_ptrs,
                                       args.stream)
        # A workspace the caller allocated (an adapter, from its framework's allocator on the
        # launch stream) is kept; otherwise one that survives CUDA-graph capture.
        release = None
        if self._workspace_bytes and not args.workspace:
            args.workspace, release = memory.launch_workspace(args.a, args.stream,
                                                              self._workspace_bytes)
        if args.wgrad_ptrs is not None and args.wgrad_ptrs.framework == "torch":
            _record_stream(args.wgrad_ptrs, args.stream)
        try:
            self._backend.launch(self._compiled, spec, args)
        finally:
            if release is not None:
                release()


def _record_stream(desc: TensorDesc, stream: int) -> None:
    # The kernel reads the pointer tensor on the launch stream; tell torch's caching allocator,
    # so that freeing the tensor early cannot hand its memory to other work meanwhile.
    torch = sys.modules.get("torch")
    owner = desc.owner
    if torch is None or not desc.is_cuda or not isinstance(owner, torch.Tensor):
        return
    if stream != torch.cuda.current_stream(desc.device_id).cuda_stream:
        owner.record_stream(torch.cuda.ExternalStream(stream, device=owner.device))


def _rename_errors(build):
    """Report the class API's sample_* arguments under their own names."""
    try:
        return build()
    except ValueError as exc:
        message = str(exc)
        for name in ("a_tensor", "b_tensor", "sfa_tensor", "sfb_tensor", "offsets_tensor",
                     "wgrad_tensor"):
            if message.startswith(name + ":"):
                sample = "sample_" + name.removesuffix("_tensor")
                raise ValueError(sample + message[len(name):]) from None
        for name in ("global_scale_a", "global_scale_b"):
            if message.startswith(name + ":"):
                raise ValueError("sample_" + message) from None
        raise


def _operator_for(request: StaticSpec) -> GroupedGemmWgrad:
    op = _operators.get(request)
    if op is not None:
        return op
    with _lock:
        op = _operators.get(request)
        if op is None:
            spec, backend = backends.finalize_spec(request)
            op = _operators.get(spec)  # another request may have reached the same final spec
            if op is None:
                op = GroupedGemmWgrad._from_spec(spec, backend)
                op.compile()
                _operators[spec] = op
            _operators[request] = op
    return op


def _signature(desc: Optional[TensorDesc]) -> Optional[tuple]:
    # Everything build_spec reads from a tensor except its address (checked per call).
    if desc is None:
        return None
    return (desc.shape, desc.strides, desc.dtype, desc.device_type, desc.device_id)


def operator_for(
    a: TensorDesc,
    b: TensorDesc,
    offsets: TensorDesc,
    *,
    wgrad: Optional[TensorDesc] = None,
    wgrad_ptrs: Optional[TensorDesc] = None,
    output_mode: str = "dense",
    wgrad_dtype: Optional[DType] = None,
    accumulate_on_output: bool = False,
    input_order: str = "tensor2d",
) -> GroupedGemmWgrad:
    """The compiled operator for a call described by ``TensorDesc``s: the adapters' fast path.

    The first call with a static signature (shapes, strides, dtypes and device of every
    tensor, the modes, ``CUTE_DSL_ARCH``) runs the contract's full check (``build_spec``,
    ValueError naming the argument) and finds or compiles the operator; later calls with the
    same signature only look it up (a dict lookup instead of ~30 us of validation).
    ``gwgrad.prepared.prepare_call`` binds the result to the call's signature for launching
    from raw addresses.
    """
    key = (_signature(a), _signature(b), _signature(offsets), _signature(wgrad),
           _signature(wgrad_ptrs), output_mode, wgrad_dtype, accumulate_on_output, input_order,
           os.environ.get("CUTE_DSL_ARCH"))
    op = _by_signature.get(key)
    if op is None:
        request = build_spec(a=a, b=b, offsets=offsets, output_mode=output_mode, wgrad=wgrad,
                             wgrad_ptrs=wgrad_ptrs, wgrad_dtype=wgrad_dtype,
                             accumulate=accumulate_on_output, input_order=input_order,
                             arch=backends.detect_arch)
        op = _operator_for(request)
        with _lock:
            _by_signature[key] = op
    return op


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
    validate_offsets: bool = True,
) -> TupleDict:
    """``W[e] = A[:, begin:end] @ B[begin:end, :]`` for every expert; see the README.

    Returns ``TupleDict(wgrad_tensor=...)``: the output given or allocated (in ``a_tensor``'s
    framework), or None for pointer-only discrete output. ``wgrad_dtype`` defaults to the
    given output's dtype, else bfloat16. With ``accumulate_on_output=True`` an output must be
    given (there is nothing to add into otherwise). ``validate_offsets=False`` skips the
    device-to-host copy that checks offsets values in eager mode.
    """
    t = _tensor_args(a_tensor=a_tensor, b_tensor=b_tensor, sfa_tensor=sfa_tensor,
                     sfb_tensor=sfb_tensor, offsets_tensor=offsets_tensor,
                     wgrad_tensor=wgrad_tensor, wgrad_ptrs=wgrad_ptrs,
                     global_scale_a=global_scale_a, global_scale_b=global_scale_b)
    a, wgrad, ptrs = t["a_tensor"], t["wgrad_tensor"], t["wgrad_ptrs"]
    request = build_spec(
        a=a, b=t["b_tensor"], offsets=t["offsets_tensor"], sfa=t["sfa_tensor"],
        sfb=t["sfb_tensor"], global_scale_a=t["global_scale_a"], global_scale_b=t["global_scale_b"],
        output_mode=output_mode, wgrad=wgrad, wgrad_ptrs=ptrs, wgrad_dtype=wgrad_dtype,
        acc_dtype=acc_dtype, mma_tiler_mn=mma_tiler_mn, cluster_shape_mn=cluster_shape_mn,
        sf_vec_size=sf_vec_size, accumulate=accumulate_on_output, input_order=input_order,
        arch=backends.detect_arch)
    allocate = wgrad is None and ptrs is None
    if allocate and accumulate_on_output:
        raise ValueError("wgrad_tensor: expected an initialized output to accumulate into "
                         "(accumulate_on_output=True adds to it), got None")
    op = _operator_for(request)
    spec = op.spec
    stream = resolve_stream(current_stream, a.framework, a.device_id) if a.is_cuda else 0

    result = wgrad_tensor
    if allocate:
        result, wgrad = outputs.allocate(
            a, (spec.num_experts, spec.hidden, spec.intermediate), spec.wgrad_dtype, stream)
    if spec.output_mode == "discrete" and ptrs is None:
        ptrs = outputs.pointer_array(wgrad, stream)
    args = LaunchArgs(a=a, b=t["b_tensor"], offsets=t["offsets_tensor"],
                      tokens_sum=_tokens_sum(spec, a), wgrad=wgrad, wgrad_ptrs=ptrs,
                      sfa=t["sfa_tensor"], sfb=t["sfb_tensor"], global_scale_a=t["global_scale_a"],
                      global_scale_b=t["global_scale_b"], stream=stream)
    op._run(args, validate_offsets)
    return TupleDict(wgrad_tensor=result)


#: The contract's names (cuDNN frontend); gwgrad also runs them on SM90 and on the CPU.
GroupedGemmWgradSm100 = GroupedGemmWgrad
grouped_gemm_wgrad_wrapper_sm100 = grouped_gemm_wgrad
