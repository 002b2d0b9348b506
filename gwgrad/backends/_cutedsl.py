"""Plumbing shared by the CuTe DSL backends: spec -> kernel config, compile, launch.

Kernels are compiled for the spec's architecture with the DSL's `--gpu-arch` option, so
compilation needs no GPU. Compiled functions take raw device addresses, `tokens_sum` and the
grid size as run-time arguments: one compile serves every token count and every storage.
Compiled kernels live in ``gwgrad.kernel_cache`` (in memory and on disk: a later process loads
them with ctypes, without importing the DSL) and are launched through its ``KernelFunction``.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Optional, Tuple

from .. import kernel_cache, status as _status
from ..dsl import shielded_argv
from ..dtypes import DType
from ..errors import ArgumentError, fail
from ..offsets import token_count_multiple
from ..spec import StaticSpec
from .base import Backend, LaunchArgs

_compile_lock = threading.Lock()
#: How many kernels this process compiled (tests assert that cached operators reuse theirs).
compile_count = 0

#: The compiled entry's run-time arguments (``GemmEntryPoints.__call__``) in order: (name,
#: "ptr", element dtype, alignment in bytes), (name, "i32") or (name, "stream"). Dtype "a" /
#: "b": the operands'; "out": the dense output's, or int64 (the pointer array) in discrete
#: mode; "sf": the scale tensors' (uint8 for E8M0 / E4M3 bytes).
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
#: Block-scaled kernels (``ScaledEntryPoints.__call__``): the scale rows go after tokens_sum
#: (global scales 0 when absent; sf_capacity: gwgrad/scales.py).
SCALED_ENTRY_SIGNATURE: Tuple[tuple, ...] = ENTRY_SIGNATURE[:7] + (
    ("sfa", "ptr", "sf", 16),
    ("sfb", "ptr", "sf", 16),
    ("global_scale_a", "ptr", "float32", 4),
    ("global_scale_b", "ptr", "float32", 4),
    ("sf_capacity", "i32"),
) + ENTRY_SIGNATURE[7:]


def entry_signature(spec: StaticSpec) -> Tuple[tuple, ...]:
    return SCALED_ENTRY_SIGNATURE if spec.is_block_scaled else ENTRY_SIGNATURE


def entry_kinds(spec: StaticSpec) -> Tuple[str, ...]:
    """The kinds of the entry's arguments, as gwgrad.kernel_cache takes them."""
    return tuple(row[1] for row in entry_signature(spec))


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
        self.cluster_m, self.cluster_n = spec.cluster_shape_mn  # the grid is whole clusters

    def launch(self, device: int, stream: int, a: int, b: int, offsets: int, out: int,
               workspace: int, status: int, tokens_sum: int, *scales: int) -> None:
        """Launch on ``stream`` of ``device`` from raw addresses (``out``: the dense output or
        the int64 pointer array; ``status``: gwgrad's status record, gwgrad/status.py;
        ``scales``: block-scaled kernels' sfa, sfb, global_scale_a/b (0: absent) and
        sf_capacity)."""
        self.kernel.launch(device, stream, a, b, offsets, out, workspace, status, tokens_sum,
                           *scales, grid_size(self, device))

    def launcher(self, device: int) -> Callable[..., None]:
        """``launch`` bound to ``device``, grid size computed once: a function ``(stream, a,
        b, offsets, out, workspace, status, tokens_sum)``; loads the kernel onto ``device``."""
        return self.kernel.bound(device, grid_size(self, device))


def cluster_size(cfg: Any) -> int:
    return getattr(cfg, "cluster_m", 1) * getattr(cfg, "cluster_n", 1)


def whole_clusters(cfg: Any, resident_clusters: int) -> int:
    """The persistent grid in CTAs: one cluster per unit of work, at most ``resident_clusters``
    (with 1x1 clusters, the SMs)."""
    return min(cfg.num_units, resident_clusters) * cluster_size(cfg)


def grid_size(cfg: Any, device_id: int) -> int:
    """Persistent grid: one CTA per SM, or fewer when there are fewer units of work; with
    clusters, whole clusters (``cfg``: a kernel config or a CompiledGemm, with ``num_units``
    and the cluster shape)."""
    size = cluster_size(cfg)
    # Clusters (the SM90 pairs): persistent too, no more clusters than can be
    # resident at once (their leaders take units from the counter).
    resident = _sm_count(device_id) if size == 1 else _max_active_clusters(device_id, size)
    return whole_clusters(cfg, resident)


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    from .. import cuda as gcuda

    return gcuda.sm_count(device_id)


@functools.lru_cache(maxsize=None)
def _max_active_clusters(device_id: int, size: int) -> int:
    """Clusters of ``size`` CTAs (one per SM, all of its shared memory) resident at once: the
    driver's occupancy answer through the DSL's HardwareInfo, learned once per device model,
    driver and size and then read from the kernel cache's directory (a process running cached
    kernels then never imports the DSL); SMs // size where the query fails."""
    from .. import cuda as gcuda

    major, minor = gcuda.compute_capability(device_id)
    fact = (f"max_active_clusters {size} CTAs | {gcuda.device_name(device_id)} | "
            f"sm_{major}{minor} | {_sm_count(device_id)} SMs | driver {gcuda.driver_version()}")
    fallback = _sm_count(device_id) // size
    found = kernel_cache.remembered(fact, lambda: _query_max_active_clusters(device_id, size))
    return max(1, min(found, fallback))


def _query_max_active_clusters(device_id: int, size: int) -> Tuple[int, bool]:
    """(clusters, True) from the DSL's HardwareInfo, or (SMs // size, False) when the DSL or
    the query is not available (not kept: a later process asks again)."""
    try:
        from .. import cuda as gcuda
        import cutlass.utils as cutlass_utils

        with gcuda.on_device(device_id), shielded_argv():
            return int(cutlass_utils.HardwareInfo(device_id).get_max_active_clusters(size)), True
    except Exception:  # no DSL here, or the query failed: every SM can hold one CTA
        return _sm_count(device_id) // size, False


def _sample_arguments(spec: StaticSpec) -> list:
    """Placeholder values of ``ENTRY_SIGNATURE`` for ``cute.compile`` (types, alignments)."""
    import cuda.bindings.driver as cuda_driver
    import cutlass
    import cutlass.cute as cute

    from ..kernels.types import cutlass_type

    sf = spec.sf_dtype.value if spec.sf_dtype is not None else "uint8"
    named = {"a": spec.a_dtype.value, "b": spec.b_dtype.value,
             "out": spec.wgrad_dtype.value if spec.output_mode == "dense" else "int64",
             "sf": sf if sf == "float32" else "uint8"}
    samples = []
    for name, kind, *rest in entry_signature(spec):
        if kind == "ptr":
            dtype, align = rest
            samples.append(cute.runtime.make_ptr(cutlass_type(named.get(dtype, dtype)), 0,
                                                 cute.AddressSpace.gmem, assumed_align=align))
        elif kind == "i32":
            samples.append(cutlass.Int32(1))
        else:
            samples.append(cuda_driver.CUstream(0))
    return samples


def compile_options(spec: StaticSpec, extra_options: str = "") -> str:
    """The DSL compile options of a spec's kernel."""
    return compile_options_for(spec.arch, extra_options)


def compile_options_for(arch: str, extra_options: str = "") -> str:
    """The DSL compile options of a kernel for ``arch`` (no GPU needed: ``--gpu-arch``)."""
    return f"--gpu-arch {arch} {extra_options}".strip()


def compile_kernel(kernel: Any, spec: StaticSpec, extra_options: str = "") -> Any:
    """``cute.compile`` of ``kernel`` (an object with a ``@cute.jit __call__`` taking
    ``ENTRY_SIGNATURE``) for ``spec.arch``; no cache. The compile tests read the PTX of
    ``compile_kernel(kernel, spec, "--keep-ptx").artifacts.PTX``."""
    return compile_entry(kernel, lambda: _sample_arguments(spec),
                         compile_options(spec, extra_options))


def compile_entry(entry: Any, samples: Callable[[], list], options: str) -> Any:
    """``cute.compile(entry, *samples(), options=options)`` under the process's compile lock,
    shielded from ``sys.argv`` (which the DSL reads when it compiles), counted in
    ``compile_count``. Every kernel gwgrad compiles (GEMMs, quantizers) goes through here."""
    global compile_count

    with _compile_lock, shielded_argv():
        import cutlass.cute as cute

        fn = cute.compile(entry, *samples(), options=options)
        compile_count += 1
    return fn


def compile_gemm(spec: StaticSpec, make_kernel: Callable[[], Any], key_parts: Tuple,
                 extra_options: str = "") -> CompiledGemm:
    """The compiled kernel for ``spec`` from gwgrad.kernel_cache: ``make_kernel()`` (which
    imports the DSL) and the compile run only when neither memory nor disk has it.
    ``key_parts``: what names the kernel besides the arch and the options."""

    def build():
        kernel = make_kernel()
        info = {"num_units": kernel.cfg.num_units,
                "workspace_bytes": kernel.cfg.workspace_bytes}
        return compile_kernel(kernel, spec, extra_options), info

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
        self.check_spec(spec)
        problem = launches_problem(self, spec) or self.tiling_problem(spec)
        if problem is None and not self.compiled_before(spec):
            problem = self.kernel_problem(spec)
        if problem is not None:
            raise ArgumentError(*problem)

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

    #: SM counts assumed for a grid compiled in without the GPU present (the JAX custom call
    #: bakes the grid size in; any value is correct, the device's own count the fastest).
    SM_COUNT_WITHOUT_GPU = {"sm_90a": 132, "sm_100a": 148, "sm_103a": 148}

    def grid_size(self, kernel: Any, spec: StaticSpec, device_id: int = 0) -> int:
        """The persistent grid of ``kernel`` (a ``make_kernel`` result) on ``device_id``, or
        for ``spec.arch``'s usual SM count when no GPU is present."""
        try:
            return grid_size(kernel.cfg, device_id)
        except RuntimeError:  # lowering without a GPU (CUTE_DSL_ARCH set)
            sms = self.SM_COUNT_WITHOUT_GPU.get(spec.arch, 132)
            return whole_clusters(kernel.cfg, sms // cluster_size(kernel.cfg))
