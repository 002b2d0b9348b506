"""Plumbing shared by the CuTe DSL backends: spec -> kernel config, compile, launch.

Kernels are compiled for the spec's architecture with the DSL's `--gpu-arch` option, so
compilation needs no GPU. Compiled functions take raw device addresses, `tokens_sum` and the
grid size as run-time arguments: one compile serves every token count and every storage.
Compiled kernels live in ``gwgrad.kernel_cache`` (in memory and on disk: a later process loads
them with ctypes, without importing the DSL) and are launched through its ``KernelFunction``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from .. import grid as _grid, kernel_cache, status as _status
from ..dtypes import DType
from ..errors import ArgumentError, fail
from ..kernels import compiler
from ..offsets import token_count_multiple
from ..spec import StaticSpec
from .base import Backend, LaunchArgs


def entry_kinds(spec: StaticSpec) -> Tuple[str, ...]:
    """The kinds of the GEMM entry's arguments for ``spec``, as gwgrad.kernel_cache takes them."""
    return compiler.entry_kinds(compiler.entry_signature(spec))


def problem_config(spec: StaticSpec, schedule: str, unit_tile_m: int = 0, unit_tile_n: int = 0):
    """The kernel-side config. A unit is one cluster's tile: `unit_tile_m` / `unit_tile_n`
    are its extents when they differ from the MMA tile's (SM100 and SM90 clusters; default:
    mma_tiler_mn)."""
    from ..kernels.config import ProblemConfig

    mixed = spec.b_dtype != spec.a_dtype
    return ProblemConfig(
        hidden=spec.hidden,
        intermediate=spec.intermediate,
        num_experts=spec.num_experts,
        a_major=spec.a_major,
        b_major=spec.b_major,
        input_order=spec.input_order,
        output_mode=spec.output_mode,
        accumulate=spec.accumulate,
        ab_dtype=spec.a_dtype.value,
        c_dtype=spec.wgrad_dtype.value,
        tile_m=unit_tile_m or spec.mma_tiler_mn[0],
        tile_n=unit_tile_n or spec.mma_tiler_mn[1],
        cluster_m=spec.cluster_shape_mn[0],
        cluster_n=spec.cluster_shape_mn[1],
        schedule=schedule,
        # Tuning is part of the spec (filled in by backends.finalize_spec), so of every cache
        # key; 0 here only for a spec that skipped it: the kernels' defaults.
        group_m=spec.raster_group or 16,
        epi_tile_n=spec.epi_tile_n,
        epi_buffer_sets=spec.epi_buffer_sets or 1,  # 0: a spec that skipped finalize_spec
        count_multiple=token_count_multiple(spec),
        b_dtype=spec.b_dtype.value if mixed else "",
        scale_recipe=spec.scale_recipe or "",
        sf_vec=spec.sf_vec_size if spec.is_block_scaled else 0,
        has_global_scale=spec.has_global_scale,
        launches=spec.launches or 2,  # 0: a spec that skipped finalize_spec
        unit_schedule=spec.unit_schedule or 1,
    )


def cluster_problem_config(spec: StaticSpec, schedule: str):
    """problem_config with a unit of one cluster's tile (the SM90 kernels: a 1x2 or 2x1 CTA
    pair shares one operand)."""
    (m, n), (cm, cn) = spec.mma_tiler_mn, spec.cluster_shape_mn
    return problem_config(spec, schedule, m * cm, n * cn)


def launches_problem(backend: Backend, spec: StaticSpec) -> Optional[Tuple[str, str]]:
    """("launches", detail) when ``spec.launches`` is neither 2 nor a single launch the
    backend can run (0: a spec that skipped finalize_spec, which compiles as 2)."""
    if spec.launches in (0, 2):
        return None
    if spec.launches != 1:
        return "launches", f"expected 1 or 2 kernel launches per call, got {spec.launches!r}"
    why = backend.single_launch_problem(spec)
    return None if why is None else ("launches", f"expected 2 here ({why}), got 1")


def check_bf16_spec(spec: StaticSpec) -> None:
    """What every BF16 CuTe DSL kernel needs from the static spec."""
    if spec.a_dtype != DType.BFLOAT16 or spec.b_dtype != DType.BFLOAT16:
        fail("a_tensor", "bfloat16 operands (the BF16 kernels)",
             f"{spec.a_dtype} and {spec.b_dtype}")
    _check_accumulator_output_dims(spec, "float32 (the BF16 kernels accumulate in FP32)", 8,
                                   "hidden / intermediate a multiple of 8 (16-byte TMA rows)")
    if spec.num_experts < 1:
        fail("offsets_tensor", "at least one expert", spec.num_experts)


def check_scaled_spec(spec: StaticSpec) -> None:
    """What every block-scaled CuTe DSL kernel needs from the static spec (formats, majors and
    sf_vec_size are each kernel's own predicate, ``can_implement``)."""
    _check_accumulator_output_dims(
        spec, "float32", 16, "hidden / intermediate a multiple of 16 for block-scaled inputs")


def _check_accumulator_output_dims(spec: StaticSpec, acc_expected: str, multiple: int,
                                   dims_expected: str) -> None:
    """FP32 accumulation, a 16/32-bit float output and hidden / intermediate multiples of
    ``multiple``: the rules both kernel families share (their messages: the arguments)."""
    if spec.acc_dtype != DType.FLOAT32:
        fail("acc_dtype", acc_expected, spec.acc_dtype)
    if spec.wgrad_dtype not in (DType.BFLOAT16, DType.FLOAT16, DType.FLOAT32):
        fail("wgrad_dtype", "bfloat16, float16 or float32", spec.wgrad_dtype)
    for name, value in (("a_tensor", spec.hidden), ("b_tensor", spec.intermediate)):
        if value % multiple != 0:
            fail(name, dims_expected, value)


class CompiledGemm:
    """A compiled prep + GEMM kernel for one static spec: its ``KernelFunction``, the number
    of work units (for the grid size per device) and its workspace size, neither of which
    needs the DSL once the kernel is cached."""

    def __init__(self, kernel: kernel_cache.KernelFunction, spec: StaticSpec):
        self.kernel = kernel
        self.spec = spec
        self.num_units = int(kernel.info["num_units"])
        self.workspace_bytes = int(kernel.info["workspace_bytes"])
        #: Workspace bytes per token of a call on top of ``workspace_bytes`` (0 but for the
        #: two-pass MXFP8 path: LaunchPlan adds them for its tokens_sum).
        self.workspace_per_token = int(kernel.info.get("workspace_per_token", 0))
        self.cluster_m, self.cluster_n = spec.cluster_shape_mn  # the grid is whole clusters

    def launch(self, device: int, stream: int, a: int, b: int, offsets: int, out: int,
               workspace: int, status: int, tokens_sum: int, *scales: int) -> None:
        """Launch on ``stream`` of ``device`` from raw addresses (``out``: the dense output or
        the int64 pointer array; ``status``: gwgrad's status record, gwgrad/status.py;
        ``scales``: block-scaled kernels' sfa, sfb, global_scale_a/b (0: absent) and
        sf_capacity)."""
        self.kernel.launch(device, stream, a, b, offsets, out, workspace, status, tokens_sum,
                           *scales, _grid.grid_size(self, device))

    def launcher(self, device: int) -> Callable[..., None]:
        """``launch`` bound to ``device``, grid size computed once: a function ``(stream, a,
        b, offsets, out, workspace, status, tokens_sum)``; loads the kernel onto ``device``."""
        return self.kernel.bound(device, _grid.grid_size(self, device))


def compile_options(spec: StaticSpec, extra_options: str = "") -> str:
    """The DSL compile options of a spec's kernel."""
    return compiler.compile_options(spec.arch, extra_options)


def compile_gemm(spec: StaticSpec, make_kernel: Callable[[], Any], key_parts: Tuple,
                 extra_options: str = "") -> CompiledGemm:
    """The compiled kernel for ``spec`` from gwgrad.kernel_cache: ``make_kernel()`` (which
    imports the DSL) and the compile run only when neither memory nor disk has it.
    ``key_parts``: what names the kernel besides the arch and the options."""

    def build():
        kernel = make_kernel()
        info = {"num_units": kernel.cfg.num_units,
                "workspace_bytes": getattr(kernel, "workspace_base", kernel.cfg.workspace_bytes)}
        per_token = getattr(kernel, "workspace_per_token", 0)
        if per_token:  # the two-pass MXFP8 path's BF16 copies (kernels/sm90_mxfp8_bf16.py)
            info["workspace_per_token"] = per_token
        return compiler.compile_kernel(kernel, spec, extra_options), info

    kernel = kernel_cache.load_or_compile(key_parts, spec.arch,
                                          compile_options(spec, extra_options),
                                          entry_kinds(spec), build)
    return CompiledGemm(kernel, spec)


class CuteDslBackend(Backend):
    """What the CuTe DSL backends share: compile a kernel object (through gwgrad.kernel_cache)
    and launch it, from LaunchArgs or (``launcher``, gwgrad.plan's per-call path) from raw
    addresses. Subclasses provide ``make_kernel(spec)`` and the spec-dependent parts (tiling,
    support, workspace size)."""

    def make_kernel(self, spec: StaticSpec):  # pragma: no cover - abstract
        raise NotImplementedError

    def config(self, spec: StaticSpec):  # pragma: no cover - abstract
        """The kernel-side ProblemConfig of ``spec``."""
        raise NotImplementedError

    def tiling_problem(self, spec: StaticSpec) -> Optional[Tuple[str, str]]:
        """(argument, detail) when the arch's kernel cannot run this tiling (DSL-free)."""
        raise NotImplementedError  # pragma: no cover - abstract

    def kernel_problem(self, spec: StaticSpec) -> Optional[Tuple[str, str]]:
        """The kernel's own predicate (``can_implement``; imports the kernel module)."""
        raise NotImplementedError  # pragma: no cover - abstract

    def check_support(self, spec: StaticSpec) -> None:
        """What every CuTe DSL kernel needs, its tiling rules, then its own predicate, which
        a kernel found in gwgrad.kernel_cache has passed already (no DSL import then)."""
        if spec.mainloop and spec.mainloop not in self.mainloops():
            raise ArgumentError("mainloop", f"one of {self.mainloops()} for the {self.name} "
                                f"backend (2: MXFP8 on SM90 only), got {spec.mainloop}")
        self.check_spec(spec)
        problem = launches_problem(self, spec) or self.tiling_problem(spec)
        if problem is None and not self.compiled_before(spec):
            problem = self.kernel_problem(spec)
        if problem is not None:
            raise ArgumentError(*problem)

    def mainloops(self) -> Tuple[int, ...]:
        """The ``Tuning.mainloop`` values this backend runs (spec.py)."""
        return (1,)

    def check_spec(self, spec: StaticSpec) -> None:
        """The kernel family's rules on dtypes and dimensions (BF16's by default)."""
        check_bf16_spec(spec)

    def workspace_bytes(self, spec: StaticSpec) -> int:
        return self.config(spec).workspace_bytes

    def compile_options(self, spec: StaticSpec) -> str:
        """The DSL options the kernel of ``spec`` is compiled with (the JAX adapter's too)."""
        return compile_options(spec)

    def cache_key(self, spec: StaticSpec) -> Tuple[str, str]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", repr(spec))

    def compiled_before(self, spec: StaticSpec) -> bool:
        """True when gwgrad.kernel_cache holds this spec's kernel (so it compiles: the
        kernel-level predicate, which imports the DSL, need not run again)."""
        return kernel_cache.lookup(self.cache_key(spec), spec.arch, compile_options(spec),
                                   entry_kinds(spec)) is not None

    def compile(self, spec: StaticSpec) -> CompiledGemm:
        self.check_support(spec)  # check_support passing is what compile relies on
        return compile_gemm(spec, lambda: self.make_kernel(spec), self.cache_key(spec))

    def launch(self, compiled: CompiledGemm, spec: StaticSpec, args: LaunchArgs) -> None:
        device = args.a.device_id
        out = args.wgrad.ptr if spec.output_mode == "dense" else args.wgrad_ptrs.ptr
        scales = ()
        if spec.is_block_scaled:
            from ..validation import scale_capacity

            scales = (args.sfa.ptr, args.sfb.ptr,
                      args.global_scale_a.ptr if args.global_scale_a is not None else 0,
                      args.global_scale_b.ptr if args.global_scale_b is not None else 0,
                      scale_capacity(spec, args.sfa))
        compiled.launch(device, args.stream, args.a.ptr, args.b.ptr, args.offsets.ptr, out,
                        args.workspace, _status.status_address(device), args.tokens_sum,
                        *scales)

    def launcher(self, compiled: CompiledGemm, spec: StaticSpec, device_id: int):
        return compiled.launcher(device_id)
