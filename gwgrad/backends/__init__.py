"""Backend selection: which implementation serves a spec, and for which architecture.

CPU arrays run on the NumPy reference backend (arch "cpu"). CUDA arrays target the device's
architecture (``CUTE_DSL_ARCH`` overrides the query, so kernels compile on machines without
that GPU) and a CuTe DSL kernel module, imported only when first needed.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import time
from typing import Dict, Optional, Tuple

from .. import cuda
from ..dtypes import DType
from ..errors import ArgumentError, UnsupportedError, arch_names
from ..spec import TUNING_FIELDS, StaticSpec
from ._cutedsl import CuteDslBackend
from .base import Backend, LaunchArgs
from .tuning_rules import resolve

__all__ = ["Backend", "CuteDslBackend", "LaunchArgs", "ARCH_BY_CAPABILITY", "detect_arch", "get_backend",
           "finalize_spec", "tiling_for_tokens", "compile_check"]

ARCH_BY_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}
KNOWN_ARCHS = tuple(ARCH_BY_CAPABILITY.values())

# (kind, arch) -> (module, class). The kernel modules are imported lazily: importing them pulls
# in the CuTe DSL, which a CPU-only user never needs.
_KERNELS: Dict[Tuple[str, str], Tuple[str, str]] = {
    ("bf16", "sm_90a"): ("gwgrad.backends.bf16_sm90", "Bf16Sm90Backend"),
    ("bf16", "sm_100a"): ("gwgrad.backends.bf16_sm100", "Bf16Sm100Backend"),
    ("bf16", "sm_103a"): ("gwgrad.backends.bf16_sm100", "Bf16Sm100Backend"),
    ("block_scaled", "sm_90a"): ("gwgrad.backends.fp8_sm90", "Fp8Sm90Backend"),
    # MXFP8 with Tuning.mainloop = 2: dequantize to BF16, then the BF16 kernel.
    ("mxfp8_bf16", "sm_90a"): ("gwgrad.backends.fp8_sm90", "Mxfp8Bf16Sm90Backend"),
    ("block_scaled", "sm_100a"): ("gwgrad.backends.blockscaled_sm100", "BlockScaledSm100Backend"),
    ("block_scaled", "sm_103a"): ("gwgrad.backends.blockscaled_sm100", "BlockScaledSm100Backend"),
}
_instances: Dict[Tuple[str, str], Backend] = {}


def _arch_override() -> str:
    value = os.environ.get("CUTE_DSL_ARCH", "").strip().lower()
    if value and value not in KNOWN_ARCHS:
        raise UnsupportedError(
            "CUTE_DSL_ARCH", f"{value!r} is not an architecture gwgrad has kernels for "
            f"({', '.join(KNOWN_ARCHS)})", arch=value, needs=KNOWN_ARCHS)
    return value


@functools.lru_cache(maxsize=None)
def _arch_of_device(device_id: int) -> str:
    cuda.require(device_id)  # RuntimeError without CUDA or without this device
    major, minor = cuda.compute_capability(device_id)
    if major < 9:
        raise UnsupportedError(
            "a_tensor", f"gwgrad needs a GPU of compute capability 9.0 (SM90, Hopper) or "
            f"newer; CUDA device {device_id} has compute capability {major}.{minor}. CPU "
            f"arrays run the reference", arch=f"sm_{major}{minor}", needs=KNOWN_ARCHS)
    arch = ARCH_BY_CAPABILITY.get((major, minor))
    if arch is None:
        supported = ", ".join(f"{a}.{b}" for a, b in ARCH_BY_CAPABILITY)
        raise UnsupportedError(
            "a_tensor", f"gwgrad has no kernels for compute capability {major}.{minor} (CUDA "
            f"device {device_id}); supported: {supported}. Set CUTE_DSL_ARCH to force one",
            arch=f"sm_{major}{minor}", needs=KNOWN_ARCHS)
    return arch


def detect_arch(device_id: int) -> str:
    """The architecture to compile for on CUDA device ``device_id``: ``CUTE_DSL_ARCH`` when
    set, else the device's. ``UnsupportedError`` (a NotImplementedError) for an architecture
    gwgrad has no kernels for, naming ``a_tensor`` (the tensor whose device it is; callers
    rename it); ``RuntimeError`` without CUDA."""
    return _arch_override() or _arch_of_device(device_id)


def _kind(spec: StaticSpec) -> str:
    if spec.is_block_scaled and spec.mainloop == 2:
        return "mxfp8_bf16"
    return "block_scaled" if spec.is_block_scaled else "bf16"


def get_backend(spec: StaticSpec) -> Backend:
    """The backend for ``spec`` (one shared instance per implementation)."""
    if spec.is_cpu:
        key = ("gwgrad.backends.reference", "ReferenceBackend")
    else:
        key = _KERNELS.get((_kind(spec), spec.arch))
        if key is None and _kind(spec) == "mxfp8_bf16":
            raise ArgumentError("mainloop", f"expected 1 on {spec.arch} (mainloop=2, MXFP8 "
                                "dequantized to BF16, runs on SM90), got 2")
        if key is None:
            needs = tuple(arch for kind, arch in _KERNELS if kind == _kind(spec))
            raise UnsupportedError(
                "a_tensor", f"{spec.a_dtype} operands need {arch_names(needs)}; gwgrad has no "
                f"{_kind(spec).replace('_', '-')} kernel for {spec.arch} (CPU arrays run the "
                "reference)", arch=spec.arch, needs=needs)
    backend = _instances.get(key)
    if backend is None:
        module_name, class_name = key
        backend = _instances[key] = getattr(importlib.import_module(module_name), class_name)()
    return backend


#: FP8 operand types MXFP8 takes.
_FP8 = (DType.FLOAT8_E4M3FN, DType.FLOAT8_E5M2)


def mxfp8_two_pass(request: StaticSpec) -> StaticSpec:
    """``request`` with ``mainloop=2`` where SM90 runs MXFP8 in two passes by default
    (kernels/sm90_mxfp8_bf16.py; its measurement against the promoting kernel: docs/
    PERFORMANCE.md, "Defaults and why"): the blocked recipe with FP8 operands, the mainloop
    left open, tensor2d operands, no global scales, no tile or one the BF16 kernel runs.
    Otherwise ``request`` itself. Its workspace grows with the tokens, so only entry points
    that size the workspace themselves ask for it (``plan.plan_for(grow_workspace=True)``)."""
    from ..kernels.tiling import SM90_TILES
    from ..scales import BLOCKED

    if (request.arch.startswith("sm_90") and request.a_dtype in _FP8
            and request.scale_recipe == BLOCKED and not request.mainloop
            and request.input_order == "tensor2d" and not request.has_global_scale
            and (request.mma_tiler_mn is None or tuple(request.mma_tiler_mn) in SM90_TILES)):
        return request.with_tuning(mainloop=2)
    return request


def tiling_for_tokens(spec: StaticSpec, tokens_sum: int) -> StaticSpec:
    """``spec`` with the tuning fields its backend's rules pick for ``tokens_sum`` tokens where
    that differs from their pick for unknown tokens (the short-expert rules) and the caller left
    the tiling open; otherwise ``spec`` itself (``finalize_spec`` then fills the default).
    Its result is a cache key: requests of one tuning share it."""
    if spec.mma_tiler_mn is not None or spec.cluster_shape_mn is not None:
        return spec
    rules = get_backend(spec).tuning_rules
    known, blind = resolve(rules, spec, tokens_sum), resolve(rules, spec)
    pinned = {f: getattr(known, f) for f in TUNING_FIELDS
              if getattr(known, f) != getattr(blind, f) and not getattr(spec.tuning, f)}
    if {"mma_tiler_mn", "cluster_shape_mn"} & set(pinned):
        # The tiling is pinned whole: a pinned tile alone closes the tiling (the rules' `open`)
        # and the cluster would fall to another rule's.
        pinned.update(mma_tiler_mn=known.mma_tiler_mn, cluster_shape_mn=known.cluster_shape_mn)
    return spec.with_tuning(**pinned) if pinned else spec


def finalize_spec(spec: StaticSpec,
                  tokens_sum: Optional[int] = None) -> Tuple[StaticSpec, Backend]:
    """Fill the tuning the caller left unset (None / 0) from the backend's rule table
    (``Backend.tuning_rules``, gwgrad/backends/tuning_rules.py) and check support: a spec this
    returns compiles. ``tokens_sum``: the call's tokens when known (the rules may tile short
    experts differently); the result runs any tokens_sum."""
    backend = get_backend(spec)
    spec = dataclasses.replace(spec, tuning=resolve(backend.tuning_rules, spec, tokens_sum))
    backend.check_support(spec)
    return spec, backend


def compile_check(arch: str) -> str:
    """Compile a representative BF16 spec for ``arch`` without running it; returns a report.

    Needs no GPU: ``CUTE_DSL_ARCH`` is set to ``arch`` while compiling. When the kernel module
    for ``arch`` is not there yet, says so instead of failing.
    """
    spec = StaticSpec(
        hidden=256, intermediate=512, num_experts=4, a_dtype=DType.BFLOAT16,
        b_dtype=DType.BFLOAT16, wgrad_dtype=DType.BFLOAT16, acc_dtype=DType.FLOAT32,
        a_major="m", b_major="n", input_order="tensor2d", output_mode="dense", accumulate=False,
        sf_vec_size=16, arch=arch)
    previous = os.environ.get("CUTE_DSL_ARCH")
    os.environ["CUTE_DSL_ARCH"] = arch
    try:
        try:
            spec, backend = finalize_spec(spec)
        except RuntimeError as exc:
            return f"compile check {arch}: skipped, {exc}"
        start = time.perf_counter()
        backend.compile(spec)
        seconds = time.perf_counter() - start
        return (f"compile check {arch}: {type(backend).__name__} compiled {spec.a_major}/"
                f"{spec.b_major}-major BF16 hidden={spec.hidden} intermediate={spec.intermediate} "
                f"tile={spec.mma_tiler_mn} cluster={spec.cluster_shape_mn} in {seconds:.1f} s")
    finally:
        if previous is None:
            os.environ.pop("CUTE_DSL_ARCH", None)
        else:
            os.environ["CUTE_DSL_ARCH"] = previous
