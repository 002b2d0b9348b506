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

``grouped_linear`` is a ``jax.custom_vjp`` example: a grouped expert linear layer whose
weight gradient is gwgrad's.
"""

from __future__ import annotations

import functools
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from gwgrad import backends, cuda, offsets as offsets_rules, status
from gwgrad.dsl import shielded_argv
from gwgrad.dtypes import as_dtype
from gwgrad.spec import StaticSpec
from gwgrad.tensors import TensorDesc
from gwgrad.validation import build_spec

from ._common import adapter_names, experts_hidden_intermediate

__all__ = ["wgrad", "reference_wgrad", "grouped_linear", "grouped_mm"]

_wgrad_p = Primitive("gwgrad_grouped_gemm_wgrad")


# --- the contract's check, on shapes and dtypes ---------------------------------------------

def _spec(x_shape, x_dtype, dy_shape, dy_dtype, off_shape, off_dtype, out_dtype,
          accumulate: bool, arch: str) -> StaticSpec:
    """The static spec of a call, checked by the core (ValueError naming the argument).

    The descriptors have address 0: only shapes, strides and dtypes matter here, and a JAX
    array is row-major, so x's (tokens, hidden) buffer is A = x.T in M-major layout.
    """
    experts, hidden, inter = experts_hidden_intermediate(x_shape, dy_shape, off_shape)
    tokens = int(x_shape[0])
    with adapter_names():
        a = TensorDesc(0, (hidden, tokens), (1, hidden), as_dtype(x_dtype, "a_tensor"), "cuda",
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
                          accumulate=accumulate, arch=arch)


# --- the primitive --------------------------------------------------------------------------

def _abstract_eval(x, dy, offsets, *out, out_dtype, accumulate):
    shape = experts_hidden_intermediate(x.shape, dy.shape, offsets.shape)
    # Inside shard_map, the result varies over the manual axes any operand varies over.
    vma = frozenset().union(*(getattr(v, "vma", frozenset()) for v in (x, dy, offsets, *out)))
    try:
        return jax.core.ShapedArray(shape, out_dtype, vma=vma)
    except TypeError:  # a JAX without varying-manual-axes types
        return jax.core.ShapedArray(shape, out_dtype)


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


def reference_wgrad(x, dy, offsets, out=None, *, out_dtype=jnp.bfloat16, accumulate=False):
    """The jnp reference (the CPU lowering): FP32 accumulation, rounded once to ``out_dtype``.

    Valid offsets give expert e the tokens [offsets[e-1], offsets[e]). Invalid ones are
    recorded for ``gwgrad.check_errors()`` (a host callback) and compute nothing: ``out``
    when accumulating, else NaN. One matmul per expert (``lax.map``), so memory stays at one
    expert's masked copy of x.
    """
    tokens = x.shape[0]
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


def _cpu_lowering(ctx, x, dy, offsets, *out, out_dtype, accumulate):
    fun = functools.partial(reference_wgrad, out_dtype=out_dtype, accumulate=accumulate)
    return mlir.lower_fun(lambda *args: fun(*args), multiple_results=False)(
        ctx, x, dy, offsets, *out)


@functools.lru_cache(maxsize=None)
def _cutlass_call(shapes: Tuple, dtypes: Tuple, out_dtype, accumulate: bool, arch: str):
    """The cutlass_call for one static signature (built once per process)."""
    import cutlass.jax as cutlass_jax

    if not cutlass_jax.is_available():
        raise RuntimeError("the CuTe DSL's JAX support (cutlass.jax) is unavailable with this "
                           f"JAX {jax.__version__}; gwgrad's JAX custom call needs it")
    (x_shape, dy_shape, off_shape), (x_dtype, dy_dtype, off_dtype) = shapes, dtypes
    request = _spec(x_shape, x_dtype, dy_shape, dy_dtype, off_shape, off_dtype, out_dtype,
                    accumulate, arch)
    spec, backend = backends.finalize_spec(request)
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
        kernel.call_tensors,
        output_shape_dtype=outputs,
        # Accumulating: the output comes in as input 3 and leaves as output 0, in place.
        input_output_aliases={3: 0} if accumulate else None,
        allow_cuda_graph=True,
        compile_options=options,
        # Skips re-tracing the kernel to find it in cutlass_call's cache: the spec (and the
        # kernel class) determine the kernel; shapes and the constants below are added to
        # the key by cutlass_call itself.
        compile_key=("gwgrad", type(kernel).__module__, type(kernel).__qualname__, spec),
        tokens_sum=int(x_shape[0]),
        grid_size=backend.grid_size(kernel, spec),
        status_address=_status_address(),
    )


def _status_address() -> int:
    """gwgrad's status record, where the kernel reports invalid offsets (gwgrad/status.py);
    0 when lowering without a GPU (CUTE_DSL_ARCH set: compile-only, never run)."""
    if cuda.device_count() == 0:
        return 0
    return status.status_address(0)


def _cuda_lowering(ctx, x, dy, offsets, *out, out_dtype, accumulate):
    avals = ctx.avals_in
    shapes = tuple(tuple(v.shape) for v in avals[:3])
    dtypes = tuple(np.dtype(v.dtype) for v in avals[:3])
    with shielded_argv():  # the CuTe DSL compiles here and reads sys.argv
        call = _cutlass_call(shapes, dtypes, np.dtype(out_dtype), accumulate,
                             backends.detect_arch(0))
        return mlir.lower_fun(lambda *args: call(*args)[0], multiple_results=False)(
            ctx, x, dy, offsets, *out)


mlir.register_lowering(_wgrad_p, _cpu_lowering, platform="cpu")
mlir.register_lowering(_wgrad_p, _cuda_lowering, platform="cuda")
try:  # as cutlass_call's own primitive: lowering may look at the devices
    from jax._src.dispatch import prim_requires_devices_during_lowering

    prim_requires_devices_during_lowering.add(_wgrad_p)
except ImportError:  # pragma: no cover
    pass


# --- the entry point ------------------------------------------------------------------------

def wgrad(x, dy, offsets, *, out=None, accumulate: bool = False, out_dtype=None):
    """``W[e] = x[begin:end].T @ dy[begin:end]`` for every expert, FP32 accumulation.

    x: (tokens, hidden) bfloat16; dy: (tokens, intermediate) bfloat16; offsets: int32
    (num_experts,). Returns a (num_experts, hidden, intermediate) array of ``out_dtype``
    (default bfloat16). With ``accumulate=True``, returns ``out + W`` computed in place of
    ``out`` (XLA aliases the buffer; donate ``out`` to the enclosing jit to avoid a copy).
    Works under ``jax.jit`` (and eagerly), on CUDA and CPU; no host synchronization.
    """
    if accumulate and out is None:
        raise ValueError("out: expected an initialized output to accumulate into "
                         "(accumulate=True adds to it), got None")
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
