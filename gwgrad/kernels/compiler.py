"""Compiling gwgrad's kernels with the CuTe DSL: the options for an architecture, each compiled
entry's signature and placeholder arguments, and the compile itself.

Every kernel gwgrad compiles goes through ``compile_entry`` (one process-wide lock, shielded from
``sys.argv``, counted in ``compile_count``): the GEMMs' raw-address entries (``compile_kernel``),
the quantizers' (``compile_quantizer``) and the XLA FFI modules of the JAX adapter's custom
calls (``compile_ffi``). Kernels compile for the ``--gpu-arch`` option's architecture, so no GPU
is needed. Importing this module imports no DSL (its functions do): gwgrad.plan and the backends
import it on every path, cached kernels included. (Not ``compile.py``: that name would shadow
the builtin wherever the module is imported by name.)
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Sequence, Tuple

from ..dsl import shielded_argv

__all__ = ["ENTRY_SIGNATURE", "SCALED_ENTRY_SIGNATURE", "QUANTIZE_SIGNATURE", "compile_options",
           "entry_signature", "entry_kinds", "sample_arguments", "gemm_samples",
           "compile_entry", "compile_kernel", "compile_quantizer", "compile_ffi",
           "compile_count"]

_compile_lock = threading.Lock()
#: How many kernels this process compiled (tests assert that cached operators reuse theirs).
compile_count = 0

#: The GEMMs' compiled entry (``GemmEntryPoints.__call__``): its run-time arguments in order,
#: (name, "ptr", element dtype, alignment in bytes), (name, "i32") or (name, "stream"). Dtype
#: "a" / "b": the operands'; "out": the dense output's, or int64 (the pointer array) in
#: discrete mode; "sf": the scale tensors' (uint8 for E8M0 / E4M3 bytes).
ENTRY_SIGNATURE: Tuple[tuple, ...] = (
    ("a", "ptr", "a", 16),
    ("b", "ptr", "b", 16),
    ("offsets", "ptr", "int32", 4),
    ("out", "ptr", "out", 16),
    ("workspace", "ptr", "uint8", 128),
    ("status", "ptr", "int32", 16),
    ("tokens_sum", "i32"),
    ("grid_size", "i32"),
    ("stream", "stream"),
)
#: Block-scaled GEMMs (``ScaledEntryPoints.__call__``): the scale rows go after tokens_sum
#: (global scales 0 when absent; sf_capacity: gwgrad/scales.py).
SCALED_ENTRY_SIGNATURE: Tuple[tuple, ...] = ENTRY_SIGNATURE[:7] + (
    ("sfa", "ptr", "sf", 16),
    ("sfb", "ptr", "sf", 16),
    ("global_scale_a", "ptr", "float32", 4),
    ("global_scale_b", "ptr", "float32", 4),
    ("sf_capacity", "i32"),
) + ENTRY_SIGNATURE[7:]
#: The quantizers' entry (``GroupedQuantizer.__call__``); "sf": float32 or uint8 scales.
QUANTIZE_SIGNATURE: Tuple[tuple, ...] = (
    ("x", "ptr", "bfloat16", 16),
    ("offsets", "ptr", "int32", 4),
    ("q", "ptr", "uint8", 16),
    ("sf", "ptr", "sf", 16),
    ("global_scale", "ptr", "float32", 4),
    ("workspace", "ptr", "int32", 16),
    ("tokens_sum", "i32"),
    ("sf_capacity", "i32"),
    ("tile_bound", "i32"),
    ("stream", "stream"),
)


def compile_options(arch: str, extra_options: str = "") -> str:
    """The DSL compile options of a kernel for ``arch`` (no GPU needed: ``--gpu-arch``)."""
    return f"--gpu-arch {arch} {extra_options}".strip()


def entry_signature(spec: Any) -> Tuple[tuple, ...]:
    """The GEMM entry's signature for a static spec (``gwgrad.spec.StaticSpec``)."""
    return SCALED_ENTRY_SIGNATURE if spec.is_block_scaled else ENTRY_SIGNATURE


def entry_kinds(signature: Sequence[tuple]) -> Tuple[str, ...]:
    """The kinds of an entry's arguments, as gwgrad.kernel_cache takes them."""
    return tuple(row[1] for row in signature)


def sample_arguments(signature: Sequence[tuple], dtypes: Dict[str, str]) -> list:
    """Placeholder values of ``signature`` for ``cute.compile`` (types, alignments): a pointer
    of each "ptr" row's dtype (a name of ``gwgrad.dtypes.DType``, or a key of ``dtypes``
    naming one), an Int32 for "i32", a stream. Imports the DSL."""
    import cuda.bindings.driver as cuda_driver
    import cutlass
    import cutlass.cute as cute

    from .types import cutlass_type

    samples = []
    for _name, kind, *rest in signature:
        if kind == "ptr":
            dtype, align = rest
            samples.append(cute.runtime.make_ptr(cutlass_type(dtypes.get(dtype, dtype)), 0,
                                                 cute.AddressSpace.gmem, assumed_align=align))
        elif kind == "i32":
            samples.append(cutlass.Int32(1))
        else:
            samples.append(cuda_driver.CUstream(0))
    return samples


def gemm_samples(spec: Any) -> list:
    """``sample_arguments`` of a static spec's GEMM entry."""
    sf = spec.sf_dtype.value if spec.sf_dtype is not None else "uint8"
    named = {"a": spec.a_dtype.value, "b": spec.b_dtype.value,
             "out": spec.wgrad_dtype.value if spec.output_mode == "dense" else "int64",
             "sf": sf if sf == "float32" else "uint8"}
    return sample_arguments(entry_signature(spec), named)


def compile_entry(entry: Any, samples: Callable[[], list], options: str) -> Any:
    """``cute.compile(entry, *samples(), options=options)`` under the process's compile lock,
    shielded from ``sys.argv`` (which the DSL reads when it compiles), counted in
    ``compile_count``."""
    global compile_count

    with _compile_lock, shielded_argv():
        import cutlass.cute as cute

        fn = cute.compile(entry, *samples(), options=options)
        compile_count += 1
    return fn


def compile_kernel(kernel: Any, spec: Any, extra_options: str = "") -> Any:
    """``cute.compile`` of a GEMM ``kernel`` (an object with a ``@cute.jit __call__`` taking
    ``entry_signature(spec)``) for ``spec.arch``; no cache. The compile tests read the PTX of
    ``compile_kernel(kernel, spec, "--keep-ptx").artifacts.PTX``."""
    return compile_entry(kernel, lambda: gemm_samples(spec),
                         compile_options(spec.arch, extra_options))


def compile_quantizer(cfg: Any, arch: str, extra_options: str = "") -> Any:
    """``cute.compile`` of the quantizer of ``cfg`` (a ``kernels.quantize.QuantizeConfig``)
    for ``arch``; no cache. ArgumentError when no quantizer implements ``cfg``."""
    from ..errors import ArgumentError
    from .quantize import GroupedQuantizer, problem

    bad = problem(cfg)
    if bad is not None:
        raise ArgumentError(*bad)
    sf = "float32" if cfg.recipe != "blocked" else "uint8"
    return compile_entry(GroupedQuantizer(cfg),
                         lambda: sample_arguments(QUANTIZE_SIGNATURE, {"sf": sf}),
                         compile_options(arch, extra_options))


def compile_ffi(fn: Callable[..., None], inputs: Sequence[Tuple[tuple, str]],
                outputs: Sequence[Tuple[tuple, str]], aliases: Dict[int, int], options: str,
                constants: Dict[str, int], key: Any) -> Dict[str, Any]:
    """An XLA FFI module of ``fn`` for the CuTe DSL runtime's JAX custom call target.

    ``fn`` is a ``@cute.jit`` function of ``(stream, *inputs, *outputs)`` (outputs aliased to an
    input left out: they arrive as that input), with ``constants`` as keyword compile-time
    constants; ``inputs`` / ``outputs`` are (shape, dtype name) pairs, row-major;
    ``aliases``: input index -> output index. The DSL's JAX bridge (``cutlass.jax``) builds its
    function spec and compiles its ``jit_wrapper`` around ``fn`` into an object file
    (``dump_to_object``); that object is what ``jax.ffi.ffi_call`` passes the target as the
    ``module`` attribute. Returns ``module`` (bytes) and what the call needs besides:
    ``target`` and ``ffi_version`` (the target the installed JAX takes), ``results``,
    ``aliases``, ``input_layouts`` / ``output_layouts`` (JAX's major-to-minor order) and
    ``runtime`` (the path of the DSL runtime library that implements the target). Imports the
    DSL and JAX."""
    global compile_count

    with _compile_lock, shielded_argv():
        import jax
        import jax.numpy as jnp
        import cutlass.jax as cutlass_jax
        from cutlass.jax import ffi as dsl_ffi
        from cutlass.jax.compile import build_function_spec, get_or_compile_kernel
        from cutlass.jax.types import cutlass_to_jax_layout_order, default_tensor_spec

        if not cutlass_jax.is_available():
            raise RuntimeError("the CuTe DSL's JAX support (cutlass.jax) is unavailable with "
                               f"this JAX {jax.__version__}; gwgrad's JAX custom calls need it "
                               "to compile")
        runtime = dsl_ffi.find_cute_dsl_runtime_library()
        if not runtime:
            raise RuntimeError("the CuTe DSL runtime library (libcute_dsl_runtime.so), which "
                               "implements the JAX custom call, was not found")
        outs = [jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype)) for shape, dtype in outputs]
        found = {}

        def trace(*args):  # build_function_spec takes JAX arrays: tracers here
            found["spec"] = build_function_spec(
                list(args), jax.tree.structure(tuple(args)), outs,
                jax.tree.structure(tuple(outs)), tuple(default_tensor_spec(a) for a in args),
                tuple(default_tensor_spec(o) for o in outs), dict(aliases), options, False,
                dict(constants))
            return args[0]

        jax.eval_shape(trace, *(jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))
                                for shape, dtype in inputs))
        spec = found["spec"]
        result = get_or_compile_kernel(fn, spec, compile_key=key)
        compile_count += 1
        version = dsl_ffi.get_cutlass_call_ffi_version()
        return {
            "module": bytes(result.module),
            "target": dsl_ffi.get_cutlass_call_ffi_name(True, version),
            "ffi_version": version,
            "results": [[list(shape), str(jnp.dtype(dtype))] for shape, dtype in outputs],
            "aliases": [[int(i), int(o)] for i, o in spec.input_output_aliases],
            "input_layouts": [_layout(cutlass_to_jax_layout_order(s.layout))
                              for s in spec.input_spec],
            "output_layouts": [_layout(cutlass_to_jax_layout_order(s.layout))
                               for s in spec.output_spec],
            "runtime": str(runtime),
        }


def _layout(order: Any) -> Any:
    return None if order is None else [int(i) for i in order]
