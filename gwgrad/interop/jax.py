"""JAX: gwgrad's XLA FFI custom calls, made with JAX and ctypes alone.

A compiled operator's XLA FFI module (``gwgrad.plan.ffi_gemm`` / ``ffi_quantizer``, a
``gwgrad.kernel_cache.XlaModule``) runs through the CuTe DSL runtime's JAX custom call target:
``call`` registers that target with XLA from the runtime library (``libcute_dsl_runtime.so``,
whose path the module's cache entry records) through ctypes, and makes the call with
``jax.ffi.ffi_call``, the module's bytes and fingerprint as its ``module`` / ``key``
attributes. No CuTe DSL import: that is what lets a JAX process whose kernels are on disk skip
it. The target names, the FFI versions and their symbols are the DSL's
(``cutlass/jax/ffi.py``): version 2 for JAX 0.9.1 and later (stateful calls: a type and an
instantiate stage), else 1. Where the DSL's JAX module is already imported, its own
registration is used, so the two never register a target twice.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from typing import Any, Dict, Sequence

import jax
import jax.numpy as jnp

__all__ = ["ffi_version", "register_targets", "call", "TARGETS", "TYPES"]

#: The first JAX whose FFI takes the version-2 targets.
_V2_MIN_JAX = (0, 9, 1)
#: target name -> {stage: symbol of the runtime library}, per FFI version.
TARGETS: Dict[int, Dict[str, Dict[str, str]]] = {
    1: {
        "CuteDSLRT_NvJaxCutlassCall_v1": {
            "prepare": "CuteDSLRT_NvJaxCutlassCallPrepare_v1",
            "execute": "CuteDSLRT_NvJaxCutlassCallExecute_v1"},
        "CuteDSLRT_NvJaxCutlassCallNoCudaGraph_v1": {
            "prepare": "CuteDSLRT_NvJaxCutlassCallPrepare_v1",
            "execute": "CuteDSLRT_NvJaxCutlassCallExecuteNoCudaGraph_v1"},
    },
    2: {
        "CuteDSLRT_NvJaxCutlassCall_v2": {
            "execute": "CuteDSLRT_NvJaxCutlassCallExecute_v2",
            "instantiate": "CuteDSLRT_NvJaxCutlassCallInstantiate_v2",
            "prepare": "CuteDSLRT_NvJaxCutlassCallPrepare_v2"},
        "CuteDSLRT_NvJaxCutlassCallNoCudaGraph_v2": {
            "execute": "CuteDSLRT_NvJaxCutlassCallExecuteNoCudaGraph_v2",
            "instantiate": "CuteDSLRT_NvJaxCutlassCallInstantiate_v2",
            "prepare": "CuteDSLRT_NvJaxCutlassCallPrepare_v2"},
    },
}
#: type name -> {field: symbol returning the pointer}, per FFI version.
TYPES: Dict[int, Dict[str, Dict[str, str]]] = {
    1: {},
    2: {"CuteDSLRT_NvJaxCutlassCallTypes_v2": {
        "type_id": "CuteDSLRT_NvJaxCutlassCallStateTypeId_v2",
        "type_info": "CuteDSLRT_NvJaxCutlassCallStateTypeInfo_v2"}},
}

_lock = threading.Lock()
_registered: set = set()  # FFI versions whose targets are registered in this process


def ffi_version() -> int:
    """The FFI target version the installed JAX takes (the DSL's rule)."""
    return 2 if tuple(jax.version.__version_info__) >= _V2_MIN_JAX else 1


def register_targets(runtime: str, version: int) -> None:
    """Register the CuTe DSL runtime's custom call targets of FFI ``version`` with XLA (CUDA),
    once per process: through the DSL where its JAX module is imported already, else from the
    library at ``runtime`` with ctypes. RuntimeError naming the library when it does not
    exist, does not load or lacks a target's symbol."""
    with _lock:
        if version in _registered:
            return
        if version not in TARGETS:
            raise RuntimeError(f"XLA FFI target version {version!r}: gwgrad knows versions "
                               f"{sorted(TARGETS)}")
        dsl_ffi = sys.modules.get("cutlass.jax.ffi")
        if dsl_ffi is not None:
            dsl_ffi.register_ffi(version)
            if not dsl_ffi.is_ffi_registered(version):
                raise RuntimeError("the CuTe DSL did not register its JAX custom call targets "
                                   "(its runtime library libcute_dsl_runtime.so was not found)")
        else:
            _register_from(runtime, version)
        _registered.add(version)


def _register_from(runtime: str, version: int) -> None:
    if not (isinstance(runtime, str) and os.path.isfile(runtime)):
        raise RuntimeError(f"the CuTe DSL runtime library {runtime!r} (libcute_dsl_runtime.so, "
                           "which implements gwgrad's JAX custom call) does not exist; "
                           "reinstall nvidia-cutlass-dsl, or clear gwgrad's kernel cache "
                           "(GWGRAD_CACHE_DIR) to record where it is now")
    try:
        lib = ctypes.CDLL(runtime)
    except OSError as exc:
        raise RuntimeError(f"loading the CuTe DSL runtime library {runtime!r} failed: "
                           f"{exc}") from exc

    def symbol(name: str):
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise RuntimeError(f"the CuTe DSL runtime library {runtime!r} has no {name} (XLA "
                               f"FFI version {version}): a runtime of another DSL version?"
                               ) from None
        fn.restype = ctypes.c_void_p
        return fn

    # Types first: a stateful target names its state's type.
    for type_name, fields in TYPES[version].items():
        registration = {field: jax.ffi.pycapsule(symbol(name)())
                        for field, name in fields.items()}
        jax.ffi.register_ffi_type(type_name, registration, platform="CUDA")
    for target, stages in TARGETS[version].items():
        handler = {stage: jax.ffi.pycapsule(symbol(name)) for stage, name in stages.items()}
        jax.ffi.register_ffi_target(target, handler, platform="CUDA")


def call(module: Any, *args: Any) -> Sequence[Any]:
    """The custom call of ``module`` (a ``gwgrad.kernel_cache.XlaModule``) on ``args`` (its
    buffers, in order), inside a traced computation; returns its results."""
    register_targets(module.runtime, module.ffi_version)
    fun = jax.ffi.ffi_call(
        module.target,
        [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for shape, dtype in module.results],
        input_output_aliases=dict(module.aliases),
        input_layouts=list(module.input_layouts),
        output_layouts=list(module.output_layouts))
    return fun(*args, module=module.module, key=module.fingerprint)
