"""gwgrad for JAX: ``wgrad()`` under ``jax.jit``, as an XLA FFI custom call on CUDA.

    import gwgrad.adapters.jax as gwj
    w = jax.jit(gwj.wgrad)(x, dy, offsets)     # w[e] = x[tokens_e].T @ dy[tokens_e]

``x`` (tokens, hidden) and ``dy`` (tokens, intermediate) are bfloat16 and row-major, as JAX
holds them: ``x``'s buffer *is* the contract's M-major ``a_tensor = x.T`` and ``dy`` its
N-major ``b_tensor``, so the kernel reads them in place. ``offsets`` is int32
(num_experts,), the cumulative token counts.

``wgrad`` binds one primitive with a lowering per platform, so one jitted function runs
anywhere:

* CUDA: CuTe DSL's ``cutlass.jax.cutlass_call`` with the kernel's ``call_tensors`` entry
  (inputs x, dy, offsets and, when accumulating, the output aliased in place; outputs the
  result and a uint8 workspace that XLA allocates). It runs on XLA's stream, may be captured
  in CUDA graphs (XLA command buffers), works inside ``shard_map`` (each device its local
  experts) and never synchronizes with the host. The kernel is compiled when the function is
  lowered, for ``CUTE_DSL_ARCH`` or else the architecture of CUDA device 0 (a host's GPUs
  are assumed alike); so lowering for CUDA works without a GPU when ``CUTE_DSL_ARCH`` is set.
  ``tokens`` is static in JAX: each distinct token count compiles its own kernel.
* CPU: a jnp reference with the same semantics (FP32 accumulation, one rounding), so jitted
  code also runs in CPU-only tests.

Invalid offsets (decreasing, negative, last != tokens) are never silent, and never raise inside
a traced computation: the kernel (or, on the CPU, a host callback of the reference) records
them in gwgrad's status record and computes nothing (with ``accumulate=True`` the result is
``out`` unchanged; otherwise its contents are unspecified: NaN on the CPU). The
``ValueError`` naming ``offsets_tensor`` is raised by ``gwgrad.check_errors()`` after the
computation (it waits for the devices), or by the next gwgrad call in the process.

``wgrad_fp8`` is the FP8 counterpart (a second primitive, the same two lowerings): ``xt``
(hidden, tokens) and ``dyt`` (intermediate, tokens), FP8 and row-major, i.e. quantized
column-wise, since Hopper's FP8 kernel reads token-contiguous operands (``xt`` is the
contract's K-major ``a_tensor``, ``dyt.T`` its K-major ``b_tensor``), with FP32 scales
("per_expert_channel" or "block_1x128"). SM90 GPUs; the CPU runs its jnp reference.

``quantize`` is gwgrad's grouped quantizer (gwgrad/quantizers.py) as a third primitive: BF16
``x`` (tokens, channels) grouped by ``offsets`` to the block-scaled operands (``(data, scales,
global_scale)``: FP8 data as ``float8_e4m3fn`` / ``float8_e5m2``, ready for ``wgrad_fp8``).
On CUDA the CuTe DSL quantizer through ``cutlass_call``; on the CPU the NumPy model
(``gwgrad.quantizers.reference_quantize``, the bit-exact spec) through a host callback.

``grouped_linear`` is a ``jax.custom_vjp`` example: a grouped expert linear layer whose
weight gradient is gwgrad's.

``grouped_gemm_wgrad_jax_sm100`` is cuDNN frontend 1.32's JAX entry (its signature and
semantics: ``a_tensor`` (hidden, tokens), ``b_tensor`` (tokens, intermediate), the result in
a ``TupleDict``) on these primitives: BF16 through ``wgrad``'s (A K-major, read in place),
FP8 with FP32 scales through ``wgrad_fp8``'s; also exported as
``gwgrad.grouped_gemm_wgrad_jax_sm100``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from gwgrad import backends, cuda, offsets as offsets_rules, status
from gwgrad.dsl import shielded_argv
from gwgrad.dtypes import DType, as_dtype
from gwgrad.errors import NAMED_ERRORS, ArgumentError
from gwgrad.scales import BLOCK_1X128, BLOCK_TOKENS
from gwgrad.spec import StaticSpec
from gwgrad.tensors import TensorDesc
from gwgrad.validation import build_spec, scale_capacity

from ._common import (FP8_DOC, FP8_RECIPES, NAMES, adapter_names, check_accumulate,
                      experts_hidden_intermediate)

__all__ = ["wgrad", "wgrad_fp8", "reference_wgrad", "reference_wgrad_fp8", "quantize",
           "reference_quantize", "grouped_linear", "grouped_mm", "grouped_gemm_wgrad_jax_sm100"]

_wgrad_p = Primitive("gwgrad_grouped_gemm_wgrad")


# --- the contract's check, on shapes and dtypes ---------------------------------------------

def _spec(x_shape, x_dtype, dy_shape, dy_dtype, off_shape, off_dtype, out_dtype,
          accumulate: bool, arch: str, a_kmajor: bool = False,
          tiling: Tuple = (None, None)) -> StaticSpec:
    """The static spec of a call, checked by the core (ValueError naming the argument).

    The descriptors have address 0: only shapes, strides and dtypes matter here, and a JAX
    array is row-major, so x's (tokens, hidden) buffer is A = x.T in M-major layout; with
    ``a_kmajor`` the first operand is A itself, (hidden, tokens), K-major (the contract's
    a_tensor as cuDNN's JAX entry takes it). ``tiling``: (mma_tiler_mn, cluster_shape_mn),
    None each for the backend's choice.
    """
    if a_kmajor:
        x_shape = tuple(x_shape)[::-1]
    experts, hidden, inter = experts_hidden_intermediate(x_shape, dy_shape, off_shape)
    tokens = int(x_shape[0])
    with adapter_names():
        a_strides = (tokens, 1) if a_kmajor else (1, hidden)
        a = TensorDesc(0, (hidden, tokens), a_strides, as_dtype(x_dtype, "a_tensor"), "cuda",
                       0, "jax")
        b = TensorDesc(0, tuple(dy_shape), (inter, 1), as_dtype(dy_dtype, "b_tensor"), "cuda",
                       0, "jax")
        offsets = TensorDesc(0, tuple(off_shape), (1,), as_dtype(off_dtype, "offsets_tensor"),
                             "cuda", 0, "jax")
        out = as_dtype(out_dtype, "wgrad_dtype")
        wgrad = None
        if accumulate:  # the output is an operand then: its layout is checked too
            wgrad = TensorDesc(0, (experts, hidden, inter), (hidden * inter, inter, 1), out,
                               "cuda", 0, "jax")
        return build_spec(a=a, b=b, offsets=offsets, wgrad=wgrad, wgrad_dtype=out,
                          accumulate=accumulate, arch=arch, mma_tiler_mn=tiling[0],
                          cluster_shape_mn=tiling[1])


# --- the primitive --------------------------------------------------------------------------

def _result_aval(shape, dtype, operands):
    """A primitive's result type. Inside shard_map it varies over every manual axis an operand
    varies over (else a custom VJP's cotangent type, jax.grad through shard_map, fails). JAX
    spells that ``manual_axis_type`` (0.10 and later), ``vma`` (0.6 to 0.9), or not at all."""
    typed = [v for v in operands if hasattr(v, "manual_axis_type")]
    if typed:
        varying = frozenset().union(*(v.manual_axis_type.varying for v in typed))
        if not varying:
            return jax.core.ShapedArray(shape, dtype)
        # A varying type needs the (manual) mesh it refers to: the operands', unpartitioned.
        mesh = next(v.sharding.mesh for v in typed if v.manual_axis_type.varying)
        sharding = jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(*([None] * len(shape))))
        return jax.core.ShapedArray(shape, dtype, sharding=sharding,
                                    manual_axis_type=type(typed[0].manual_axis_type)(
                                        varying=varying))
    vma = frozenset().union(*(getattr(v, "vma", frozenset()) for v in operands))
    try:
        return jax.core.ShapedArray(shape, dtype, vma=vma)
    except TypeError:  # a JAX without varying-manual-axes types
        return jax.core.ShapedArray(shape, dtype)


def _abstract_eval(x, dy, offsets, *out, out_dtype, accumulate, a_kmajor=False,
                   tiling=(None, None)):
    x_shape = tuple(x.shape)[::-1] if a_kmajor else x.shape
    shape = experts_hidden_intermediate(x_shape, dy.shape, offsets.shape)
    return _result_aval(shape, out_dtype, (x, dy, offsets, *out))


_wgrad_p.def_abstract_eval(_abstract_eval)
try:  # eager calls (outside jit) compile the primitive alone, as JAX's own primitives do
    from jax._src.dispatch import apply_primitive as _apply_primitive

    _wgrad_p.def_impl(functools.partial(_apply_primitive, _wgrad_p))
except ImportError:  # pragma: no cover - then only jitted calls work
    pass


def _offsets_problem(offsets, tokens: int):
    """(code, expert, value, previous) of the first invalid offset, as the kernels' prep
    kernel and gwgrad.offsets.find_problem report it; code 0 when the offsets are valid."""
    num = offsets.shape[0]
    prev = jnp.concatenate([jnp.zeros((1,), offsets.dtype), offsets[:-1]])
    index = jnp.arange(num, dtype=jnp.int32)
    negative = offsets < prev
    first_negative = jnp.min(jnp.where(negative, index, num))
    last_bad = offsets[-1] != tokens
    code = jnp.where(first_negative < num, offsets_rules.NEGATIVE_COUNT,
                     jnp.where(last_bad, offsets_rules.LAST_NOT_TOKENS_SUM, 0)).astype(jnp.int32)
    expert = jnp.where(first_negative < num, first_negative, num - 1).astype(jnp.int32)
    return code, expert, offsets[expert], prev[expert]


def _record_problem(code, expert, value, prev, tokens):
    if int(code):
        status.record(int(code), int(expert), int(value), int(prev), int(tokens), 1)


def reference_wgrad(x, dy, offsets, out=None, *, out_dtype=jnp.bfloat16, accumulate=False,
                    a_kmajor=False):
    """The jnp reference (the CPU lowering): FP32 accumulation, rounded once to ``out_dtype``.

    Valid offsets give expert e the tokens [offsets[e-1], offsets[e]). Invalid ones are
    recorded for ``gwgrad.check_errors()`` (a host callback) and compute nothing: ``out``
    when accumulating, else NaN. One matmul per expert (``lax.map``), so memory stays at one
    expert's masked copy of x. ``a_kmajor``: ``x`` is (hidden, tokens), A itself, K-major:
    every count must then be a multiple of 8, as for the kernels (16-byte TMA rows).
    """
    if a_kmajor:
        x = x.T
    tokens = x.shape[0]
    if a_kmajor:
        multiple = 16 // np.dtype(x.dtype).itemsize  # gwgrad.offsets.token_count_multiple
        code, expert, value, prev = _fp8_offsets_problem(offsets, tokens, multiple, None)
        jax.debug.callback(_record_fp8_problem, code, expert, value, prev, tokens, multiple)
    else:
        code, expert, value, prev = _offsets_problem(offsets, tokens)
        jax.debug.callback(_record_problem, code, expert, value, prev, tokens)
    end = jnp.clip(offsets, 0, tokens)
    begin = jnp.concatenate([jnp.zeros((1,), end.dtype), end[:-1]])
    end = jnp.maximum(end, begin)
    t = jnp.arange(tokens, dtype=end.dtype)
    xf, dyf = x.astype(jnp.float32), dy.astype(jnp.float32)

    def one_expert(bounds):
        lo, hi = bounds
        rows = ((t >= lo) & (t < hi))[:, None]
        return jnp.matmul(jnp.where(rows, xf, 0.0).T, dyf, precision=jax.lax.Precision.HIGHEST)

    w = jax.lax.map(one_expert, (begin, end))
    if accumulate:
        w = out.astype(jnp.float32) + w
    invalid_result = out.astype(jnp.float32) if accumulate else jnp.full_like(w, jnp.nan)
    return jnp.where(code == 0, w, invalid_result).astype(out_dtype)


def _cpu_lowering(ctx, x, dy, offsets, *out, out_dtype, accumulate, a_kmajor=False,
                  tiling=(None, None)):
    # The tiling is the GPU kernels' (the entry points checked that some GPU runs it).
    fun = functools.partial(reference_wgrad, out_dtype=out_dtype, accumulate=accumulate,
                            a_kmajor=a_kmajor)
    return mlir.lower_fun(lambda *args: fun(*args), multiple_results=False)(
        ctx, x, dy, offsets, *out)


def _kernel_call(request, out_dtype, accumulate: bool, out_input: int, tokens_sum: int,
                 constants: Callable[[Any], Dict[str, int]] = lambda spec: {}):
    """The CuTe DSL ``cutlass_call`` of the kernel for ``request`` (a StaticSpec before
    finalize_spec): outputs (the weight gradients, the workspace); when accumulating, the
    output comes in as input ``out_input`` and leaves as output 0, in place.
    ``constants(spec)``: the entry's further constants (the scaled kernels' ``sf_capacity``)."""
    import cutlass.jax as cutlass_jax

    if not cutlass_jax.is_available():
        raise RuntimeError("the CuTe DSL's JAX support (cutlass.jax) is unavailable with this "
                           f"JAX {jax.__version__}; gwgrad's JAX custom call needs it")
    # Two launches (prep kernel, GEMM): a single launch's grid barrier needs a workspace that
    # starts zeroed, and XLA's is not.
    spec, backend = backends.finalize_spec(request.with_tuning(launches=2), tokens_sum)
    make_kernel = getattr(backend, "make_kernel", None)
    if make_kernel is None:
        raise RuntimeError(f"the {backend.name} backend has no JAX entry point yet "
                           "(make_kernel)")
    kernel = make_kernel(spec)
    # The same compiler options as the core's compile of this spec (the kernel time must match).
    options = getattr(backend, "compile_options", None)
    options = options(spec) if options is not None else f"--gpu-arch {spec.arch}"
    outputs = (jax.ShapeDtypeStruct((spec.num_experts, spec.hidden, spec.intermediate),
                                    out_dtype),
               jax.ShapeDtypeStruct((backend.workspace_bytes(spec),), jnp.uint8))
    return cutlass_jax.cutlass_call(
        kernel.call_tensors,  # GemmEntryPoints / ScaledEntryPoints.call_tensors
        output_shape_dtype=outputs,
        input_output_aliases={out_input: 0} if accumulate else None,
        allow_cuda_graph=True,
        compile_options=options,
        # Skips re-tracing the kernel to find it in cutlass_call's cache: the spec (and the
        # kernel class) determine the kernel; shapes and the constants below are added to
        # the key by cutlass_call itself.
        compile_key=("gwgrad", type(kernel).__module__, type(kernel).__qualname__, spec),
        tokens_sum=tokens_sum,
        grid_size=backend.grid_size(kernel, spec),
        status_address=_status_address(),
        **constants(spec),
    )


@functools.lru_cache(maxsize=None)
def _cutlass_call(shapes: Tuple, dtypes: Tuple, out_dtype, accumulate: bool, arch: str,
                  a_kmajor: bool = False, tiling: Tuple = (None, None)):
    """The cutlass_call for one static signature (built once per process)."""
    (x_shape, dy_shape, off_shape), (x_dtype, dy_dtype, off_dtype) = shapes, dtypes
    request = _spec(x_shape, x_dtype, dy_shape, dy_dtype, off_shape, off_dtype, out_dtype,
                    accumulate, arch, a_kmajor, tiling)
    # Inputs x, dy, offsets [, out].
    tokens = int(x_shape[1] if a_kmajor else x_shape[0])
    return _kernel_call(request, out_dtype, accumulate, 3, tokens)


def _status_address() -> int:
    """gwgrad's status record, where the kernel reports invalid offsets (gwgrad/status.py);
    0 when lowering without a GPU (CUTE_DSL_ARCH set: compile-only, never run)."""
    if cuda.device_count() == 0:
        return 0
    return status.status_address(0)


def _cuda_lowering(ctx, x, dy, offsets, *out, out_dtype, accumulate, a_kmajor=False,
                   tiling=(None, None)):
    avals = ctx.avals_in
    shapes = tuple(tuple(v.shape) for v in avals[:3])
    dtypes = tuple(np.dtype(v.dtype) for v in avals[:3])
    with shielded_argv():  # the CuTe DSL compiles here and reads sys.argv
        call = _cutlass_call(shapes, dtypes, np.dtype(out_dtype), accumulate,
                             backends.detect_arch(0), a_kmajor, tiling)
        return mlir.lower_fun(lambda *args: call(*args)[0], multiple_results=False)(
            ctx, x, dy, offsets, *out)


def _register_lowerings(prim, cpu_lowering, cuda_lowering) -> None:
    """The CPU (NumPy / jnp) and CUDA (cutlass_call) lowerings of one of gwgrad's
    primitives; like cutlass_call's own primitive, lowering may look at the devices."""
    mlir.register_lowering(prim, cpu_lowering, platform="cpu")
    mlir.register_lowering(prim, cuda_lowering, platform="cuda")
    try:
        from jax._src.dispatch import prim_requires_devices_during_lowering

        prim_requires_devices_during_lowering.add(prim)
    except ImportError:  # pragma: no cover
        pass


_register_lowerings(_wgrad_p, _cpu_lowering, _cuda_lowering)


def _check_some_gpu_runs(spec: StaticSpec) -> None:
    """A tiling the caller chose must be one some GPU kernel runs (the CPU reference's rule,
    so that jitted code tested on the CPU does not fail on a GPU): ArgumentError naming it."""
    if spec.mma_tiler_mn is not None or spec.cluster_shape_mn is not None:
        backends.finalize_spec(dataclasses.replace(spec, arch="cpu"))


# --- the entry point ------------------------------------------------------------------------

def wgrad(x, dy, offsets, *, out=None, accumulate: bool = False, out_dtype=None):
    """``W[e] = x[begin:end].T @ dy[begin:end]`` for every expert, FP32 accumulation.

    x: (tokens, hidden) bfloat16; dy: (tokens, intermediate) bfloat16; offsets: int32
    (num_experts,). Returns a (num_experts, hidden, intermediate) array of ``out_dtype``
    (default bfloat16). With ``accumulate=True``, returns ``out + W`` computed in place of
    ``out`` (XLA aliases the buffer; donate ``out`` to the enclosing jit to avoid a copy).
    Works under ``jax.jit`` (and eagerly), on CUDA and CPU; no host synchronization.
    """
    check_accumulate(accumulate, out)
    if out is not None and not accumulate:
        raise ValueError("out: expected None unless accumulate=True (JAX arrays are "
                         "immutable: the result is returned), got an array")
    if out is not None:
        if out_dtype is not None and np.dtype(out_dtype) != np.dtype(out.dtype):
            raise ValueError(f"out_dtype: expected None or {out.dtype} (out's dtype), got "
                             f"{np.dtype(out_dtype)}")
        out_dtype = out.dtype
    out_dtype = np.dtype(jnp.bfloat16 if out_dtype is None else out_dtype)
    x, dy, offsets = jnp.asarray(x), jnp.asarray(dy), jnp.asarray(offsets)
    # The contract's checks at trace time, so a bad call fails where it is written.
    _spec(x.shape, x.dtype, dy.shape, dy.dtype, offsets.shape, offsets.dtype, out_dtype,
          accumulate, "")
    if out is not None:
        out = jnp.asarray(out)
        experts, hidden, inter = experts_hidden_intermediate(x.shape, dy.shape, offsets.shape)
        if tuple(out.shape) != (experts, hidden, inter):
            raise ValueError(f"out: expected shape (num_experts, hidden, intermediate) = "
                             f"{(experts, hidden, inter)}, got {tuple(out.shape)}")
        return _wgrad_p.bind(x, dy, offsets, out, out_dtype=out_dtype, accumulate=True)
    return _wgrad_p.bind(x, dy, offsets, out_dtype=out_dtype, accumulate=False)


# --- FP8: wgrad_fp8 -------------------------------------------------------------------------

_wgrad_fp8_p = Primitive("gwgrad_grouped_gemm_wgrad_fp8")

#: The core's argument names as ``wgrad_fp8`` calls them: ``xt`` is the contract's a_tensor
#: itself, ``dyt.T`` its b_tensor.
_FP8_NAMES = dict(NAMES, a_tensor="xt (a_tensor)", b_tensor="dyt (b_tensor = dyt.T)")
_FP8_OPERANDS = ("float8_e4m3fn", "float8_e5m2")


@contextlib.contextmanager
def _fp8_names() -> Iterator[None]:
    """Re-raise the core's ArgumentErrors (and UnsupportedErrors) under wgrad_fp8's argument
    names."""
    try:
        yield
    except NAMED_ERRORS as exc:
        renamed = exc.renamed(_FP8_NAMES)
        if renamed is exc:
            raise
        raise renamed from None


def _fp8_dims(xt_shape, dyt_shape, off_shape) -> Tuple[int, int, int]:
    """(num_experts, hidden, intermediate), or ArgumentError naming xt / dyt / offsets."""
    if len(xt_shape) != 2:
        raise ArgumentError("xt", f"expected 2 dims (hidden, tokens), got shape "
                                  f"{tuple(xt_shape)}")
    if len(dyt_shape) != 2:
        raise ArgumentError("dyt", f"expected 2 dims (intermediate, tokens), got shape "
                                   f"{tuple(dyt_shape)}")
    if len(off_shape) != 1:
        raise ArgumentError("offsets", f"expected shape (num_experts,), got shape "
                                       f"{tuple(off_shape)}")
    return int(off_shape[0]), int(xt_shape[0]), int(dyt_shape[0])


def _signature(v) -> Optional[Tuple[Tuple[int, ...], np.dtype]]:
    """(shape, dtype) of an array or aval (hashable: the CUDA lowering's cache key)."""
    return None if v is None else (tuple(int(d) for d in v.shape), np.dtype(v.dtype))


def _row_major(shape) -> Tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def _fp8_spec(xt, dyt, offsets, x_scale, dy_scale, x_global_scale, dy_global_scale, *,
              scale_recipe: str, out_dtype, accumulate: bool,
              arch: str, tiling: Tuple = (None, None)) -> Tuple[StaticSpec, TensorDesc]:
    """The static spec of a wgrad_fp8 call and the x_scale descriptor (its scale capacity),
    checked by the core (ArgumentError naming the argument). Every argument is a (shape,
    dtype) pair (``_signature``); the global scales may be None.

    JAX arrays are row-major: xt's (hidden, tokens) buffer is A itself, K-major (strides
    (tokens, 1)), and dyt's (intermediate, tokens) buffer is B = dyt.T, K-major (strides
    (1, tokens)). Addresses are 0: only shapes, strides and dtypes matter here.
    """
    if scale_recipe not in FP8_RECIPES:
        raise ArgumentError("scale_recipe", f"expected one of {sorted(FP8_RECIPES)}, got "
                                            f"{scale_recipe!r}")
    experts, hidden, inter = _fp8_dims(xt[0], dyt[0], offsets[0])
    for name, (_, dtype) in (("xt", xt), ("dyt", dyt)):
        if np.dtype(dtype).name not in _FP8_OPERANDS:
            raise ArgumentError(name, f"expected dtype float8_e4m3fn or float8_e5m2, got "
                                      f"{np.dtype(dtype)}")
    for name, (_, dtype) in (("x_scale", x_scale), ("dy_scale", dy_scale)):
        if np.dtype(dtype) != np.float32:
            raise ArgumentError(name, f"expected float32 scales ({scale_recipe}), got "
                                      f"{np.dtype(dtype)}")

    def desc(sig, name, shape=None, strides=None):
        if sig is None:
            return None
        shape = sig[0] if shape is None else shape
        return TensorDesc(0, tuple(shape), strides or _row_major(shape),
                          as_dtype(sig[1], name), "cuda", 0, "jax")

    tokens_b = int(dyt[0][1])
    with _fp8_names():
        a = desc(xt, "a_tensor")
        b = desc(dyt, "b_tensor", (tokens_b, inter), (1, tokens_b))
        off = desc(offsets, "offsets_tensor")
        sfa, sfb = desc(x_scale, "sfa_tensor"), desc(dy_scale, "sfb_tensor")
        gsa = desc(x_global_scale, "global_scale_a")
        gsb = desc(dy_global_scale, "global_scale_b")
        out = as_dtype(out_dtype, "wgrad_dtype")
        wgrad = None
        if accumulate:  # the output is an operand then: its layout is checked too
            wgrad = TensorDesc(0, (experts, hidden, inter), (hidden * inter, inter, 1), out,
                               "cuda", 0, "jax")
        spec = build_spec(a=a, b=b, offsets=off, sfa=sfa, sfb=sfb, global_scale_a=gsa,
                          global_scale_b=gsb, wgrad=wgrad, wgrad_dtype=out,
                          accumulate=accumulate, arch=arch, scale_recipe=scale_recipe,
                          sf_vec_size=FP8_RECIPES[scale_recipe], mma_tiler_mn=tiling[0],
                          cluster_shape_mn=tiling[1])
    return spec, sfa


def _fp8_abstract_eval(xt, dyt, offsets, x_scale, dy_scale, gx, gdy, *out, scale_recipe,
                       out_dtype, accumulate, tiling=(None, None)):
    shape = _fp8_dims(xt.shape, dyt.shape, offsets.shape)
    return _result_aval(shape, out_dtype, (xt, dyt, offsets, x_scale, dy_scale, gx, gdy, *out))


_wgrad_fp8_p.def_abstract_eval(_fp8_abstract_eval)
try:
    _wgrad_fp8_p.def_impl(functools.partial(_apply_primitive, _wgrad_fp8_p))
except NameError:  # pragma: no cover - then only jitted calls work
    pass


def _fp8_offsets_problem(offsets, tokens: int, multiple: int, capacity: Optional[int]):
    """(code, expert, value, previous) of the first problem, as gwgrad.offsets.find_problem
    (and the prep kernel) report it: a negative count, the last offset, a count not a
    multiple of ``multiple``, then (``capacity``: block_1x128's scale rows R) the first expert
    whose scale rows end past R; code 0 when there is none. (Also BF16's with a K-major A.)"""
    num = offsets.shape[0]
    prev = jnp.concatenate([jnp.zeros((1,), offsets.dtype), offsets[:-1]])
    index = jnp.arange(num, dtype=jnp.int32)
    counts = offsets - prev
    first_negative = jnp.min(jnp.where(offsets < prev, index, num))
    last_bad = offsets[-1] != tokens
    first_not_multiple = jnp.min(jnp.where(counts % multiple != 0, index, num))
    negative, not_multiple = first_negative < num, first_not_multiple < num
    code = jnp.where(negative, offsets_rules.NEGATIVE_COUNT,
                     jnp.where(last_bad, offsets_rules.LAST_NOT_TOKENS_SUM,
                               jnp.where(not_multiple, offsets_rules.COUNT_NOT_MULTIPLE, 0)))
    expert = jnp.where(negative, first_negative,
                       jnp.where(last_bad, num - 1,
                                 jnp.where(not_multiple, first_not_multiple, 0)))
    code, expert = code.astype(jnp.int32), expert.astype(jnp.int32)
    value, previous = offsets[expert], prev[expert]
    if capacity is not None:
        cumulative = jnp.cumsum((jnp.maximum(counts, 0) + (BLOCK_TOKENS - 1)) // BLOCK_TOKENS)
        first_over = jnp.min(jnp.where(cumulative > capacity, index, num))
        too_small = (code == 0) & (first_over < num)
        over = jnp.minimum(first_over, num - 1).astype(jnp.int32)
        code = jnp.where(too_small, offsets_rules.SCALES_TOO_SMALL, code).astype(jnp.int32)
        expert = jnp.where(too_small, over, expert)
        value = jnp.where(too_small, cumulative[over], value)
        previous = jnp.where(too_small, capacity, previous)
    return code, expert, value, previous


def _record_fp8_problem(code, expert, value, prev, tokens, multiple):
    if int(code):
        status.record(int(code), int(expert), int(value), int(prev), int(tokens), int(multiple))


def reference_wgrad_fp8(xt, dyt, offsets, x_scale, dy_scale, x_global_scale=None,
                        dy_global_scale=None, out=None, *, scale_recipe: str,
                        out_dtype=jnp.bfloat16, accumulate: bool = False):
    """The jnp reference of ``wgrad_fp8`` (its CPU lowering): each operand dequantized with its
    expert's scales (FP32), one FP32 matmul per expert at HIGHEST precision (``lax.map``),
    times ``alpha_e``, accumulated and rounded once to ``out_dtype``.

    Invalid offsets (and, for block_1x128, a scale tensor with fewer rows than the offsets
    need) are recorded for ``gwgrad.check_errors()`` (a host callback) and compute nothing:
    ``out`` when accumulating, else NaN.
    """
    hidden, tokens = xt.shape
    inter = dyt.shape[0]
    num = offsets.shape[0]
    multiple = 16  # offsets.token_count_multiple of the FP32 recipes
    capacity = int(x_scale.shape[0]) if scale_recipe == BLOCK_1X128 else None
    code, expert, value, prev = _fp8_offsets_problem(offsets, tokens, multiple, capacity)
    jax.debug.callback(_record_fp8_problem, code, expert, value, prev, tokens, multiple)
    end = jnp.clip(offsets, 0, tokens)
    begin = jnp.concatenate([jnp.zeros((1,), end.dtype), end[:-1]])
    end = jnp.maximum(end, begin)
    t = jnp.arange(tokens, dtype=end.dtype)
    # Every token's expert (valid offsets: the e with begin_e <= t < end_e) and its scales.
    owner = jnp.clip(jnp.searchsorted(end, t, side="right"), 0, num - 1)
    if scale_recipe == BLOCK_1X128:
        blocks = (end - begin + (BLOCK_TOKENS - 1)) // BLOCK_TOKENS
        starts = jnp.concatenate([jnp.zeros((1,), blocks.dtype), jnp.cumsum(blocks)[:-1]])
        row = starts[owner] + (t - begin[owner]) // BLOCK_TOKENS
        row = jnp.clip(row, 0, max(capacity - 1, 0))
        xs, dys = x_scale[row], dy_scale[row]  # (tokens, hidden), (tokens, intermediate)
    else:
        xs = x_scale.reshape(num, hidden)[owner]
        dys = dy_scale.reshape(num, inter)[owner]
    xd = xt.astype(jnp.float32) * xs.T    # (hidden, tokens)
    dyd = dyt.astype(jnp.float32) * dys.T  # (intermediate, tokens)
    alpha = jnp.ones((num,), jnp.float32)
    if x_global_scale is not None:
        alpha = x_global_scale.astype(jnp.float32) * dy_global_scale.astype(jnp.float32)

    def one_expert(args):
        lo, hi, a = args
        cols = ((t >= lo) & (t < hi))[None, :]
        w = jnp.matmul(jnp.where(cols, xd, 0.0), jnp.where(cols, dyd, 0.0).T,
                       precision=jax.lax.Precision.HIGHEST)
        return w * a

    w = jax.lax.map(one_expert, (begin, end, alpha))
    if accumulate:
        w = out.astype(jnp.float32) + w
    invalid_result = out.astype(jnp.float32) if accumulate else jnp.full_like(w, jnp.nan)
    return jnp.where(code == 0, w, invalid_result).astype(out_dtype)


def _fp8_cpu_lowering(ctx, *args, scale_recipe, out_dtype, accumulate, tiling=(None, None)):
    fun = functools.partial(reference_wgrad_fp8, scale_recipe=scale_recipe, out_dtype=out_dtype,
                            accumulate=accumulate)
    return mlir.lower_fun(lambda *a: fun(*a), multiple_results=False)(ctx, *args)


@functools.lru_cache(maxsize=None)
def _fp8_cutlass_call(signatures: Tuple, scale_recipe: str, out_dtype, accumulate: bool,
                      arch: str, tiling: Tuple = (None, None)):
    """The cutlass_call of one static wgrad_fp8 signature (built once per process)."""
    request, sfa = _fp8_spec(*signatures, scale_recipe=scale_recipe, out_dtype=out_dtype,
                             accumulate=accumulate, arch=arch, tiling=tiling)
    # Inputs xt, dyt, offsets, x_scale, dy_scale, gx, gdy [, out].
    return _kernel_call(request, out_dtype, accumulate, 7, int(signatures[0][0][1]),
                        lambda spec: {"sf_capacity": scale_capacity(spec, sfa)})


def _fp8_cuda_lowering(ctx, *args, scale_recipe, out_dtype, accumulate, tiling=(None, None)):
    signatures = tuple(_signature(v) for v in ctx.avals_in[:7])
    with shielded_argv():  # the CuTe DSL compiles here and reads sys.argv
        call = _fp8_cutlass_call(signatures, scale_recipe, np.dtype(out_dtype), accumulate,
                                 backends.detect_arch(0), tiling)
        return mlir.lower_fun(lambda *a: call(*a)[0], multiple_results=False)(ctx, *args)


_register_lowerings(_wgrad_fp8_p, _fp8_cpu_lowering, _fp8_cuda_lowering)


def wgrad_fp8(xt, dyt, offsets, x_scale, dy_scale, *, scale_recipe: str, out=None,
              accumulate: bool = False, out_dtype=None, x_global_scale=None,
              dy_global_scale=None):
    return _wgrad_fp8(xt, dyt, offsets, x_scale, dy_scale, scale_recipe=scale_recipe, out=out,
                      accumulate=accumulate, out_dtype=out_dtype, x_global_scale=x_global_scale,
                      dy_global_scale=dy_global_scale)


def _wgrad_fp8(xt, dyt, offsets, x_scale, dy_scale, *, scale_recipe: str, out=None,
               accumulate: bool = False, out_dtype=None, x_global_scale=None,
               dy_global_scale=None, tiling: Tuple = (None, None)):
    """``wgrad_fp8`` with a ``tiling`` (mma_tiler_mn, cluster_shape_mn), None each for the
    backend's choice."""
    check_accumulate(accumulate, out)
    if out is not None and not accumulate:
        raise ArgumentError("out", "expected None unless accumulate=True (JAX arrays are "
                                   "immutable: the result is returned), got an array")
    if out is not None:
        if out_dtype is not None and np.dtype(out_dtype) != np.dtype(out.dtype):
            raise ArgumentError("out_dtype", f"expected None or {out.dtype} (out's dtype), "
                                             f"got {np.dtype(out_dtype)}")
        out_dtype = out.dtype
    out_dtype = np.dtype(jnp.bfloat16 if out_dtype is None else out_dtype)
    xt, dyt, offsets = jnp.asarray(xt), jnp.asarray(dyt), jnp.asarray(offsets)
    x_scale, dy_scale = jnp.asarray(x_scale), jnp.asarray(dy_scale)
    gx = None if x_global_scale is None else jnp.asarray(x_global_scale)
    gdy = None if dy_global_scale is None else jnp.asarray(dy_global_scale)
    # The contract's checks at trace time, so a bad call fails where it is written.
    spec, _ = _fp8_spec(*(_signature(v) for v in (xt, dyt, offsets, x_scale, dy_scale, gx, gdy)),
                        scale_recipe=scale_recipe, out_dtype=out_dtype, accumulate=accumulate,
                        arch="", tiling=tiling)
    _check_some_gpu_runs(spec)
    experts, hidden, inter = _fp8_dims(xt.shape, dyt.shape, offsets.shape)
    if gx is None:  # one kernel signature: no global scales are ones (the same results)
        gx = gdy = jnp.ones((experts,), jnp.float32)
    params = dict(scale_recipe=scale_recipe, out_dtype=out_dtype)
    if tiling != (None, None):  # checked: tuples now
        params["tiling"] = (spec.mma_tiler_mn, spec.cluster_shape_mn)
    if out is not None:
        out = jnp.asarray(out)
        if tuple(out.shape) != (experts, hidden, inter):
            raise ArgumentError("out", f"expected shape (num_experts, hidden, intermediate) = "
                                       f"{(experts, hidden, inter)}, got {tuple(out.shape)}")
        return _wgrad_fp8_p.bind(xt, dyt, offsets, x_scale, dy_scale, gx, gdy, out,
                                 accumulate=True, **params)
    return _wgrad_fp8_p.bind(xt, dyt, offsets, x_scale, dy_scale, gx, gdy, accumulate=False,
                             **params)


wgrad_fp8.__doc__ = FP8_DOC.replace(
    "x: (tokens, hidden), dy: (tokens, intermediate), float8_e4m3fn or float8_e5m2 (they may\n"
    "    differ), stored token-contiguous: x is the transpose view of a (hidden, tokens) "
    "row-major\n    array (``xt.T``; strides (1, tokens)), dy likewise, as Hopper's FP8 tensor "
    "cores read them\n    (quantize x and dy column-wise).",
    "xt: (hidden, tokens), dyt: (intermediate, tokens), float8_e4m3fn or float8_e5m2 (they\n"
    "    may differ), row-major JAX arrays: the transposes of x (tokens, hidden) and dy (tokens,\n"
    "    intermediate), quantized column-wise, because Hopper's FP8 tensor cores read\n"
    "    token-contiguous operands (``xt`` is the contract's K-major a_tensor, ``dyt.T`` its\n"
    "    K-major b_tensor). Every expert's token count must be a multiple of 16.\n   ",
).replace("(x[t, :] * sx)^T (dy[t, :] * sdy)", "(xt[:, t] * sx) (dyt[:, t] * sdy)^T") + """

    out: None (a new (num_experts, hidden, intermediate) array of ``out_dtype``, default
    bfloat16) or, with ``accumulate=True``, the array to add to (``out + W`` is returned,
    computed in place of ``out``: donate it to the enclosing jit to avoid a copy).
    Works under ``jax.jit`` (and eagerly): on CUDA (SM90) the kernel as an XLA custom call,
    on the CPU a jnp reference with the same semantics. Invalid offsets, and a block_1x128
    scale tensor with fewer rows than the offsets need, are checked on the device: nothing is
    computed (NaN on the CPU, ``out`` unchanged when accumulating) and the ValueError comes
    from ``gwgrad.check_errors()`` or the next gwgrad call. ``tokens`` is static: each distinct
    token count (and scale row count R) compiles its own kernel."""


# --- quantize: BF16 x grouped by expert to block-scaled operands -----------------------------

_quantize_p = Primitive("gwgrad_grouped_quantize")
_quantize_p.multiple_results = True

#: The dtypes ``quantize`` returns its byte outputs as (the primitive's are uint8 codes; a
#: bitcast, free in XLA, gives them their types): FP8 data by element format, E8M0 / E4M3
#: scales by gwgrad's scale dtype. Packed FP4 data stays uint8.
_DATA_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
_SCALE_DTYPES = {DType.FLOAT8_E8M0FNU: jnp.float8_e8m0fnu, DType.FLOAT8_E4M3FN: jnp.float8_e4m3fn}


def _quantize_elem(elem) -> Optional[str]:
    """``elem`` as gwgrad.quantizers names it: None, "e4m3", "e5m2", "e2m1", or a dtype
    (``jnp.float8_e4m3fn``, ``"float8_e5m2"``)."""
    if elem is None or isinstance(elem, str):
        return elem
    try:
        return np.dtype(elem).name
    except TypeError:
        return elem  # gwgrad.quantizers names it in its ArgumentError


def _quantize_layout(x, offsets, fmt, elem):
    """gwgrad.quantizers' layout of a call on ``x`` and ``offsets`` (``_signature`` pairs),
    after the core's checks (ArgumentError naming x, offsets, fmt or elem)."""
    from gwgrad import quantizers

    (x_shape, x_dtype), (off_shape, off_dtype) = x, offsets
    if len(x_shape) != 2 or np.dtype(x_dtype) != np.dtype(jnp.bfloat16):
        raise ArgumentError("x", f"expected a 2-D bfloat16 (tokens, channels) array, got "
                                 f"{len(x_shape)}-D {np.dtype(x_dtype)}")
    if len(off_shape) != 1 or np.dtype(off_dtype) != np.int32 or off_shape[0] < 1:
        raise ArgumentError("offsets", f"expected a 1-D int32 array of at least one expert, "
                                       f"got {len(off_shape)}-D {np.dtype(off_dtype)} of shape "
                                       f"{tuple(off_shape)}")
    tokens, channels = x_shape
    if channels % 8 or channels == 0:
        raise ArgumentError("x", f"expected a channel count (x.shape[1]) that is a positive "
                                 f"multiple of 8, got {channels}")
    return quantizers.layout(fmt, int(tokens), int(channels), int(off_shape[0]), elem)


def _quantize_outputs(lay):
    """The primitive's outputs: uint8 codes (data; blocked scales) or float32 (FP32 scales),
    and NVFP4's float32 global scales."""
    scale_dtype = np.float32 if lay.scale_dtype == DType.FLOAT32 else np.uint8
    outs = [(lay.data_shape, np.dtype(np.uint8)), (lay.scale_shape, np.dtype(scale_dtype))]
    if lay.global_shape is not None:
        outs.append((lay.global_shape, np.dtype(np.float32)))
    return outs


def _quantize_abstract_eval(x, offsets, *, fmt, elem):
    lay = _quantize_layout(_signature(x), _signature(offsets), fmt, elem)
    return [_result_aval(shape, dtype, (x, offsets)) for shape, dtype in _quantize_outputs(lay)]


_quantize_p.def_abstract_eval(_quantize_abstract_eval)
try:
    _quantize_p.def_impl(functools.partial(_apply_primitive, _quantize_p))
except NameError:  # pragma: no cover - then only jitted calls work
    pass


@functools.lru_cache(maxsize=None)
def _libm_default_env():
    """(libm, pointer to FE_DFL_ENV) where the C library has them, else None."""
    import ctypes
    import ctypes.util
    import sys

    try:
        libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        if sys.platform.startswith("linux"):  # glibc and musl: ((const fenv_t *) -1)
            return libm, ctypes.c_void_p(-1)
        if sys.platform == "darwin":
            return libm, ctypes.c_void_p(ctypes.addressof(
                ctypes.c_char.in_dll(ctypes.CDLL(None), "_FE_DFL_ENV")))
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    return None


def _flushes_denormals() -> bool:
    tiny = np.array([np.finfo(np.float32).smallest_subnormal], np.float32)
    return not (tiny * np.float32(2)).any()


@contextlib.contextmanager
def _ieee_denormals() -> Iterator[None]:
    """The C default floating-point environment (denormals kept) on this thread, restored
    after. XLA's CPU threads, where host callbacks run, flush denormals to zero (FTZ / DAZ):
    the NumPy model's FP32 arithmetic would then differ from the spec (and the GPU kernels)
    on denormal inputs, e.g. a block of BF16 denormals."""
    import ctypes

    if not _flushes_denormals():
        yield
        return
    found = _libm_default_env()
    saved = ctypes.create_string_buffer(1024)  # > sizeof(fenv_t) everywhere
    if found is None or found[0].fegetenv(saved) != 0:
        raise RuntimeError("gwgrad.adapters.jax.quantize on the CPU: this thread flushes "
                           "denormals to zero and the C library's fenv functions are out of "
                           "reach; the NumPy model would not be bit-exact")
    libm, default = found
    libm.fesetenv(default)
    try:
        if _flushes_denormals():
            raise RuntimeError("gwgrad.adapters.jax.quantize on the CPU: fesetenv(FE_DFL_ENV) "
                               "did not stop the flushing of denormals; the NumPy model would "
                               "not be bit-exact")
        yield
    finally:
        libm.fesetenv(saved)


def reference_quantize(x, offsets, *, fmt: str, elem: Optional[str] = None):
    """The CPU lowering of ``quantize``: gwgrad.quantizers.reference_quantize (the NumPy model,
    the bit-exact spec of the GPU kernels) in a host callback (``jax.pure_callback``, run in
    the C default floating-point environment: XLA's threads flush denormals), with the
    primitive's outputs: uint8 codes or float32 scales, and NVFP4's global scales."""
    from gwgrad import quantizers

    lay = _quantize_layout(_signature(x), _signature(offsets), fmt, elem)
    outs = _quantize_outputs(lay)

    def host(x_host, offsets_host):
        x_host = np.asarray(x_host).astype(np.float32)  # BF16 values: exact in FP32
        with _ieee_denormals():  # an XLA thread: FTZ / DAZ otherwise
            data, scales, gs = quantizers.reference_quantize(x_host, np.asarray(offsets_host),
                                                             fmt, lay.elem)
        results = [np.ascontiguousarray(data, np.uint8),
                   np.ascontiguousarray(scales, outs[1][1])]
        if gs is not None:
            results.append(np.ascontiguousarray(gs, np.float32))
        return tuple(results)

    return jax.pure_callback(host, tuple(jax.ShapeDtypeStruct(s, d) for s, d in outs),
                             x, offsets)


def _quantize_cpu_lowering(ctx, x, offsets, *, fmt, elem):
    fun = functools.partial(reference_quantize, fmt=fmt, elem=elem)
    return mlir.lower_fun(lambda *a: list(fun(*a)), multiple_results=True)(ctx, x, offsets)


@functools.lru_cache(maxsize=None)
def _quantize_cutlass_call(x: Tuple, offsets: Tuple, fmt: str, elem: Optional[str], arch: str):
    """The cutlass_call of one static quantize signature (built once per process): the
    quantizer's ``call_tensors`` entry, inputs x and offsets, outputs the codes, the scales,
    the global scales (a one-element dummy but for NVFP4) and the uint8 workspace that XLA
    allocates (the call's tile table and amax records, written by its prep kernel)."""
    import cutlass.jax as cutlass_jax

    from gwgrad import quantizers
    from gwgrad.kernels.quantize import GroupedQuantizer, problem

    if not cutlass_jax.is_available():
        raise RuntimeError("the CuTe DSL's JAX support (cutlass.jax) is unavailable with this "
                           f"JAX {jax.__version__}; gwgrad's JAX custom call needs it")
    lay = _quantize_layout(x, offsets, fmt, elem)
    tokens, channels = x[0]
    experts = offsets[0][0]
    cfg = quantizers.kernel_config(fmt, lay.elem, channels, experts)
    bad = problem(cfg)
    if bad is not None:
        raise ArgumentError(*bad)
    kernel = GroupedQuantizer(cfg)
    outs = _quantize_outputs(lay)
    if lay.global_shape is None:
        outs.append(((1,), np.dtype(np.float32)))  # the kernel's unused global scale output
    outs.append(((max(cfg.workspace_bytes(tokens), 4),), np.dtype(np.uint8)))
    return cutlass_jax.cutlass_call(
        kernel.call_tensors,
        output_shape_dtype=tuple(jax.ShapeDtypeStruct(s, d) for s, d in outs),
        allow_cuda_graph=True,
        # The core's compile options for the quantizer (gwgrad.quantizers.compile_quantizer).
        compile_options=f"--gpu-arch {arch}",
        # The config determines the kernel; shapes and the constants below are added to the
        # key by cutlass_call itself.
        compile_key=("gwgrad", type(kernel).__module__, type(kernel).__qualname__, cfg),
        tokens_sum=tokens,
        sf_capacity=lay.scale_capacity,
        tile_bound=cfg.tile_bound(tokens),
    )


def _zero_unwritten_scales(scales, offsets, fmt: str, tokens: int, capacity: int):
    """``scales`` with the bytes past the experts' scales zeroed, as the NumPy model leaves
    them: the kernel writes the first ``min(sum_e C_e, capacity)`` columns (blocked: flat
    bytes ``Mpad * column``, gwgrad/scales.py) or rows (block_1x128) and nothing past them,
    and XLA's output buffer is not initialized. ``C_e`` of the offsets sanitized as the
    kernels and ``gwgrad.quantizers._counts`` do. One small elementwise pass (scales are
    1/16 to 1/32 of the data; flat indices in uint32: scale tensors under 4 GiB)."""
    from gwgrad import quantizers
    from gwgrad.scales import BLOCKED, column_rule

    f = quantizers.FORMATS[fmt]
    per_column_tokens, pad = column_rule(f.recipe, f.sf_vec)
    end = jnp.clip(offsets, 0, tokens)
    begin = jnp.concatenate([jnp.zeros((1,), end.dtype), end[:-1]])
    counts = jnp.maximum(end, begin) - begin
    counts = jnp.where(counts % quantizers.count_multiple(fmt) == 0, counts, 0)
    columns = (counts + (per_column_tokens - 1)) // per_column_tokens
    columns = (columns + (pad - 1)) // pad * pad
    used_columns = jnp.minimum(jnp.sum(columns), capacity).astype(jnp.uint32)
    rows, cols = scales.shape
    per_column = rows if f.recipe == BLOCKED else cols  # elements of one column (row)
    flat = (jax.lax.broadcasted_iota(jnp.uint32, scales.shape, 0) * np.uint32(cols)
            + jax.lax.broadcasted_iota(jnp.uint32, scales.shape, 1))
    return jnp.where(flat < used_columns * np.uint32(per_column), scales,
                     jnp.zeros((), scales.dtype))


def _quantize_cuda_lowering(ctx, x, offsets, *, fmt, elem):
    xs, offs = (_signature(v) for v in ctx.avals_in)
    lay = _quantize_layout(xs, offs, fmt, elem)
    with shielded_argv():  # the CuTe DSL compiles here and reads sys.argv
        call = _quantize_cutlass_call(xs, offs, fmt, elem, backends.detect_arch(0))

        def run(x, offsets):
            data, scales, gs, _workspace = call(x, offsets)
            if lay.scale_capacity:  # blocked, block_1x128: a capacity past the counts' needs
                scales = _zero_unwritten_scales(scales, offsets, fmt, xs[0][0],
                                                lay.scale_capacity)
            return [data, scales] if lay.global_shape is None else [data, scales, gs]

        return mlir.lower_fun(run, multiple_results=True)(ctx, x, offsets)


_register_lowerings(_quantize_p, _quantize_cpu_lowering, _quantize_cuda_lowering)


def quantize(x, offsets, fmt: str, *, elem=None):
    """Quantize ``x`` (tokens, channels), bfloat16, grouped by expert through ``offsets``
    (int32 (num_experts,), the cumulative token counts) into ``fmt``: "mxfp8", "mxfp4",
    "nvfp4", "per_expert_channel" or "block_1x128" (gwgrad/quantizers.py; ``elem``: "e4m3"
    (default) or "e5m2" for the FP8 formats, or their jnp dtypes).

    Returns ``(data, scales, global_scale)`` with the shapes of
    ``gwgrad.quantizers.layout(fmt, tokens, channels, num_experts, elem)``:

    * ``data`` (channels, tokens), tokens contiguous: ``float8_e4m3fn`` / ``float8_e5m2``
      codes for the FP8 formats (``wgrad_fp8``'s ``xt`` / ``dyt`` as they are), packed E2M1
      as uint8 (channels, tokens // 2) (the even token in the low nibble) for mxfp4 / nvfp4;
    * ``scales``: E8M0 codes as ``float8_e8m0fnu`` (mxfp8, mxfp4) or E4M3 as
      ``float8_e4m3fn`` (nvfp4), (round_up(channels, 128), capacity) in the blocked layout;
      float32 (num_experts, channels) (per_expert_channel) or (capacity, channels)
      (block_1x128; ``wgrad_fp8``'s scales as they are);
    * ``global_scale``: float32 (num_experts,) for nvfp4, else None.

    The scale capacity is the bound that holds any valid counts. Every expert's count must be
    a multiple of ``gwgrad.quantizers.count_multiple(fmt)`` (and so must ``tokens``); a count
    that is not, or invalid offsets, are quantized as an empty expert (the GEMM's own offsets
    check reports them). Scales past those the experts use are zeros, as in the NumPy model;
    so are, on the CPU, the codes of tokens that no (sanitized) expert range covers, which
    only invalid offsets leave: on CUDA those codes are unspecified (never written).

    Works under ``jax.jit`` (and eagerly): on CUDA the CuTe DSL quantizer as an XLA custom
    call on XLA's stream (no host synchronization; allowed in CUDA graphs; ``tokens`` is
    static: each distinct shape compiles its own kernel), on the CPU the NumPy model in a
    host callback; the two agree bit for bit.
    """
    elem = _quantize_elem(elem)
    x, offsets = jnp.asarray(x), jnp.asarray(offsets)
    # The checks at trace time, so a bad call fails where it is written.
    lay = _quantize_layout(_signature(x), _signature(offsets), fmt, elem)
    outs = _quantize_p.bind(x, offsets, fmt=fmt, elem=lay.elem)
    data, scales = outs[0], outs[1]
    if lay.elem in _DATA_DTYPES:
        data = jax.lax.bitcast_convert_type(data, _DATA_DTYPES[lay.elem])
    if lay.scale_dtype in _SCALE_DTYPES:
        scales = jax.lax.bitcast_convert_type(scales, _SCALE_DTYPES[lay.scale_dtype])
    return data, scales, (outs[2] if lay.global_shape is not None else None)


# --- cuDNN frontend's JAX entry point ---------------------------------------------------------

#: What the calls below name an argument -> cuDNN's name for it (``wgrad``'s and
#: ``wgrad_fp8``'s own names, and the core's as they rename them).
_CUDNN_NAMES = {
    **{adapter: core for core, adapter in NAMES.items()},
    **{adapter: core for core, adapter in _FP8_NAMES.items()},
    "x": "a_tensor", "dy": "b_tensor", "xt": "a_tensor", "dyt": "b_tensor",
    "offsets": "offsets_tensor", "x_scale": "sfa_tensor", "dy_scale": "sfb_tensor",
    "x_global_scale": "global_scale_a", "dy_global_scale": "global_scale_b",
    "out_dtype": "wgrad_dtype",
}

#: cuDNN's JAX entry's ``sf_vec_size`` default; FP32 scale recipes and BF16 do not use it.
_CUDNN_JAX_SF_VEC = 32


def _register_tuple_dict() -> None:
    """gwgrad's ``TupleDict`` as a JAX pytree (keys static, values leaves), as cuDNN registers
    its own: a jitted function may return the entry's result as it is."""
    from gwgrad.api import TupleDict

    try:
        jax.tree_util.register_pytree_node(
            TupleDict, lambda value: (tuple(dict.values(value)), tuple(dict.keys(value))),
            lambda keys, values: TupleDict(zip(keys, values)))
    except ValueError:  # registered already (this module imported twice)
        pass


_register_tuple_dict()


def grouped_gemm_wgrad_jax_sm100(
    a_tensor: Any,
    b_tensor: Any,
    offsets_tensor: Any,
    wgrad_ptrs: Any = None,
    wgrad_dtype: Any = DType.BFLOAT16,
    acc_dtype: Any = DType.FLOAT32,
    mma_tiler_mn: Optional[Tuple[int, int]] = None,
    cluster_shape_mn: Optional[Tuple[int, int]] = None,
    accumulate_on_output: bool = False,
    input_order: str = "tensor2d",
    *,
    sfa_tensor: Any = None,
    sfb_tensor: Any = None,
    global_scale_a: Any = None,
    global_scale_b: Any = None,
    sf_vec_size: int = _CUDNN_JAX_SF_VEC,
    scale_recipe: Optional[str] = None,
):
    """cuDNN frontend 1.32's ``grouped_gemm_wgrad_jax_sm100`` on gwgrad's JAX adapter: an XLA
    custom call on CUDA (SM90 and SM100), the jnp reference on the CPU; eager or under
    ``jax.jit``, no host synchronization.

    ``a_tensor`` (hidden, tokens) and ``b_tensor`` (tokens, intermediate) are row-major JAX
    arrays, as cuDNN takes them (A K-major, B N-major); ``offsets_tensor`` int32
    (num_experts,), the cumulative token counts (checked on the device: see
    ``gwgrad.check_errors()``). Returns ``TupleDict(wgrad_tensor=W)``, W (num_experts,
    hidden, intermediate) of ``wgrad_dtype`` (bfloat16, float16 or float32; default
    bfloat16); experts without tokens come back zero.

    * BF16 operands, no scale tensors: the dense output, read in place (no transposes).
    * FP8 operands (e4m3 / e5m2, may differ) with float32 ``sfa_tensor`` / ``sfb_tensor``:
      gwgrad's FP32 scale recipes, named by ``scale_recipe`` ("per_expert_channel":
      (num_experts, hidden) / (num_experts, intermediate); "block_1x128": (R, hidden) / (R,
      intermediate)), with optional ``global_scale_a`` / ``global_scale_b`` (num_experts,);
      SM90 GPUs (the CPU runs the reference). Hopper's FP8 kernel reads token-contiguous B,
      so ``b_tensor`` is transposed by XLA first (one copy of B); ``sf_vec_size`` is 32 (the
      default, unused) or the recipe's tokens per scale.

    Not implemented (``NotImplementedError``, gwgrad.errors.UnsupportedError, naming the
    argument): ``wgrad_ptrs`` (cuDNN's discrete output, written through raw per-expert
    addresses outside XLA's buffers: gwgrad's custom call returns its output as an XLA array;
    pass None for the dense ``wgrad_tensor``, or run discrete output with
    ``gwgrad.grouped_gemm_wgrad_wrapper_sm100`` on torch / CuPy arrays); E8M0 / E4M3
    ``sfa_tensor`` (MXFP8, NVFP4, MXFP4: the adapter has no block-scaled custom call; the
    wrapper runs them on torch / CuPy arrays); ``input_order="tensor_ragged"`` (likewise).
    ``accumulate_on_output=True`` is a ValueError, as in cuDNN: there is no output argument to
    add into (``gwgrad.adapters.jax.wgrad(..., out=, accumulate=True)`` adds in place).
    ``mma_tiler_mn`` / ``cluster_shape_mn``: None each for gwgrad's choice per architecture
    (cuDNN's default, (256, 256), is the SM100 kernel's; SM90 has no 256-row tile), else a
    tiling some GPU kernel runs. ``scale_recipe`` is gwgrad's addition (cuDNN's JAX entry takes
    no FP32 scale factors).
    """
    try:
        return _cudnn_jax_call(a_tensor, b_tensor, offsets_tensor, wgrad_ptrs, wgrad_dtype,
                               acc_dtype, mma_tiler_mn, cluster_shape_mn, accumulate_on_output,
                               input_order, sfa_tensor, sfb_tensor, global_scale_a,
                               global_scale_b, sf_vec_size, scale_recipe)
    except NAMED_ERRORS as exc:
        renamed = exc.renamed(_CUDNN_NAMES)
        if renamed is exc:
            raise
        raise renamed from None


def _cudnn_jax_call(a_tensor, b_tensor, offsets_tensor, wgrad_ptrs, wgrad_dtype, acc_dtype,
                    mma_tiler_mn, cluster_shape_mn, accumulate_on_output, input_order,
                    sfa_tensor, sfb_tensor, global_scale_a, global_scale_b, sf_vec_size,
                    scale_recipe):
    from gwgrad.api import TupleDict
    from gwgrad.errors import UnsupportedError
    from gwgrad.spec import INPUT_ORDERS

    acc = DType.FLOAT32 if acc_dtype is None else as_dtype(acc_dtype, "acc_dtype")
    if acc != DType.FLOAT32:
        raise ArgumentError("acc_dtype", f"expected float32 (the kernels accumulate in FP32), "
                                         f"got {acc}")
    out = as_dtype(DType.BFLOAT16 if wgrad_dtype is None else wgrad_dtype, "wgrad_dtype")
    out_dtype = np.dtype(jnp.dtype(out.value))
    if not isinstance(accumulate_on_output, bool):
        raise ArgumentError("accumulate_on_output", f"expected a bool, got "
                                                    f"{accumulate_on_output!r}")
    if accumulate_on_output:
        raise ArgumentError("accumulate_on_output", "expected False: the JAX entry returns a new "
                            "wgrad_tensor and takes no output to add into "
                            "(gwgrad.adapters.jax.wgrad(x, dy, offsets, out=..., "
                            "accumulate=True) adds in place), got True")
    order = getattr(input_order, "value", input_order)
    if order not in INPUT_ORDERS:
        raise ArgumentError("input_order", f"expected 'tensor2d' or 'tensor_ragged', got "
                                           f"{input_order!r}")
    if order == "tensor_ragged":
        raise UnsupportedError(
            "input_order", "'tensor_ragged' (per-expert K-contiguous blocks) is not implemented "
            "in gwgrad's JAX custom call, which reads tensor2d operands; "
            "gwgrad.grouped_gemm_wgrad_wrapper_sm100 runs it on torch / CuPy arrays")
    if wgrad_ptrs is not None:
        raise UnsupportedError(
            "wgrad_ptrs", "discrete output through raw per-expert addresses is not implemented "
            "in gwgrad's JAX custom call, which returns its output as an XLA array: pass "
            "wgrad_ptrs=None for the dense (num_experts, hidden, intermediate) wgrad_tensor, or "
            "run discrete output with gwgrad.grouped_gemm_wgrad_wrapper_sm100 "
            "(output_mode='discrete') on torch / CuPy arrays")
    x, dy, offsets = jnp.asarray(a_tensor), jnp.asarray(b_tensor), jnp.asarray(offsets_tensor)
    for name, arr, ndim, dims in (("a_tensor", x, 2, "(hidden, tokens_sum)"),
                                  ("b_tensor", dy, 2, "(tokens_sum, intermediate)"),
                                  ("offsets_tensor", offsets, 1, "(num_experts,)")):
        if arr.ndim != ndim:
            raise ArgumentError(name, f"expected {ndim} dims {dims}, got shape {arr.shape}")
    tiling = (mma_tiler_mn, cluster_shape_mn)

    if sfa_tensor is None:  # BF16
        for name, value in (("sfb_tensor", sfb_tensor), ("global_scale_a", global_scale_a),
                            ("global_scale_b", global_scale_b), ("scale_recipe", scale_recipe)):
            if value is not None:
                raise ArgumentError(name, "expected None without sfa_tensor (bfloat16 inputs "
                                          "take no scale controls), got "
                                          f"{getattr(value, 'shape', value)!r}")
        if sf_vec_size not in (16, _CUDNN_JAX_SF_VEC):
            raise ArgumentError("sf_vec_size", f"expected 32 (the default) or 16 for bfloat16 "
                                               f"inputs (BF16 takes no scale controls), got "
                                               f"{sf_vec_size!r}")
        spec = _spec(x.shape, x.dtype, dy.shape, dy.dtype, offsets.shape, offsets.dtype,
                     out_dtype, False, "", a_kmajor=True, tiling=tiling)
        _check_some_gpu_runs(spec)
        params = dict(out_dtype=out_dtype, accumulate=False, a_kmajor=True)
        if tiling != (None, None):  # checked: tuples now
            params["tiling"] = (spec.mma_tiler_mn, spec.cluster_shape_mn)
        return TupleDict(wgrad_tensor=_wgrad_p.bind(x, dy, offsets, **params))

    sfa = jnp.asarray(sfa_tensor)
    if np.dtype(sfa.dtype) != np.float32:
        raise UnsupportedError(
            "sfa_tensor", f"{np.dtype(sfa.dtype)} scale factors (the blocked recipe: MXFP8, "
            "NVFP4, MXFP4) are not implemented in gwgrad's JAX custom call; "
            "gwgrad.grouped_gemm_wgrad_wrapper_sm100 runs them on torch / CuPy arrays (MXFP8 on "
            "SM90 and SM100 GPUs, NVFP4 / MXFP4 on SM100 GPUs). From JAX: FP8 with float32 "
            "scale factors (scale_recipe 'per_expert_channel' or 'block_1x128')")
    if scale_recipe not in FP8_RECIPES:
        raise ArgumentError("scale_recipe", f"expected one of {sorted(FP8_RECIPES)} for float32 "
                                            f"scale factors, got {scale_recipe!r}")
    if sf_vec_size not in (_CUDNN_JAX_SF_VEC, FP8_RECIPES[scale_recipe]):
        raise ArgumentError("sf_vec_size", f"expected 32 (the default) or "
                                           f"{FP8_RECIPES[scale_recipe]} for {scale_recipe}, got "
                                           f"{sf_vec_size!r}")
    # Hopper's FP8 WGMMA reads K-major operands: B (tokens, intermediate) row-major is
    # N-major, so it goes in as its transpose, (intermediate, tokens) (one XLA copy).
    if sfb_tensor is None:
        raise ArgumentError("sfb_tensor", "expected a tensor like sfa_tensor (scale factors come "
                                          "in pairs), got None")
    w = _wgrad_fp8(x, dy.T, offsets, sfa, sfb_tensor, scale_recipe=scale_recipe,
                   out_dtype=out_dtype, x_global_scale=global_scale_a,
                   dy_global_scale=global_scale_b, tiling=tiling)
    return TupleDict(wgrad_tensor=w)


# --- example: a grouped expert linear layer whose weight gradient is gwgrad's ---------------

def _group_sizes(offsets):
    return jnp.diff(offsets, prepend=jnp.zeros((1,), offsets.dtype)).astype(jnp.int32)


def grouped_mm(x, w, offsets):
    """``y[tokens_e] = x[tokens_e] @ w[e]`` (``jax.lax.ragged_dot``)."""
    return jax.lax.ragged_dot(x, w, _group_sizes(offsets))


@jax.custom_vjp
def grouped_linear(x, w, offsets):
    """``y_e = x_e @ w_e`` per expert: x (tokens, hidden), w (num_experts, hidden,
    intermediate), offsets int32. Gradients: dx with ``ragged_dot``, dw with gwgrad."""
    return grouped_mm(x, w, offsets)


def _grouped_linear_fwd(x, w, offsets):
    return grouped_mm(x, w, offsets), (x, w, offsets)


def _grouped_linear_bwd(residuals, dy):
    x, w, offsets = residuals
    dy = dy.astype(x.dtype)
    dx = grouped_mm(dy, jnp.swapaxes(w, 1, 2), offsets)
    dw = wgrad(x, dy, offsets, out_dtype=w.dtype)
    return dx, dw, None


grouped_linear.defvjp(_grouped_linear_fwd, _grouped_linear_bwd)
