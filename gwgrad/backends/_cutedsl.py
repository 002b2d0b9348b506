"""Plumbing shared by the CuTe DSL backends: spec -> kernel config, compile, launch.

Kernels are compiled for the spec's architecture with the DSL's `--gpu-arch` option, so
compilation needs no GPU. Compiled functions take raw device addresses, `tokens_sum` and the
grid size as run-time arguments: one compile serves every token count and every storage.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

from .. import cuda as _gcuda
from ..dtypes import DType
from ..spec import StaticSpec
from .base import Backend, LaunchArgs

_compile_lock = threading.Lock()
_GMEM = None  # cute.AddressSpace.gmem, bound on first use (importing the DSL is slow)
#: How many kernels this process compiled (tests assert that cached operators reuse theirs).
compile_count = 0


def problem_config(spec: StaticSpec, schedule: str, unit_tile_m: int = 0):
    """The kernel-side config. A unit is one cluster's tile: `unit_tile_m` is its M extent
    when that differs from the MMA tile's (SM100 clusters; default: mma_tiler_mn[0])."""
    from ..kernels.common import ProblemConfig

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
        tile_n=spec.mma_tiler_mn[1],
        cluster_m=spec.cluster_shape_mn[0],
        cluster_n=spec.cluster_shape_mn[1],
        schedule=schedule,
        # Tuning knob for benchmarks only: it is not part of the operator cache key.
        group_m=int(os.environ.get("GWGRAD_RASTER_GROUP", "16")),
    )


def _cutlass_dtype(dtype: DType):
    import cutlass

    return {
        DType.BFLOAT16: cutlass.BFloat16,
        DType.FLOAT16: cutlass.Float16,
        DType.FLOAT32: cutlass.Float32,
    }[dtype]


def check_bf16_spec(spec: StaticSpec) -> None:
    """What every BF16 CuTe DSL kernel needs from the static spec."""
    if spec.a_dtype != DType.BFLOAT16 or spec.b_dtype != DType.BFLOAT16:
        raise ValueError(
            f"a_tensor/b_tensor: the BF16 kernels take bfloat16 operands, got {spec.a_dtype} and {spec.b_dtype}"
        )
    if spec.acc_dtype != DType.FLOAT32:
        raise ValueError(f"acc_dtype: the BF16 kernels accumulate in float32, got {spec.acc_dtype}")
    if spec.wgrad_dtype not in (DType.BFLOAT16, DType.FLOAT16, DType.FLOAT32):
        raise ValueError(
            f"wgrad_dtype: expected bfloat16, float16 or float32, got {spec.wgrad_dtype}"
        )
    for name, value in (("hidden", spec.hidden), ("intermediate", spec.intermediate)):
        if value % 8 != 0:
            raise ValueError(
                f"a_tensor/b_tensor: {name} must be a multiple of 8 (16-byte TMA rows), got {value}"
            )
    if spec.num_experts < 1:
        raise ValueError(f"offsets_tensor: expected at least one expert, got {spec.num_experts}")


class CompiledGemm:
    """A compiled prep + GEMM launcher for one static spec."""

    def __init__(self, fn: Any, cfg: Any, spec: StaticSpec):
        import cutlass

        self.fn = fn
        self.cfg = cfg
        self.spec = spec
        self.ab_dtype = cutlass.BFloat16
        self.out_dtype = _cutlass_dtype(spec.wgrad_dtype)
        self.i32, self.i64, self.u8 = cutlass.Int32, cutlass.Int64, cutlass.Uint8
        # device ordinal -> (PackedLauncher or None for the DSL's own call, grid size). One per
        # device: an executor holds the kernel handles of one device's context.
        self._launchers: dict = {}

    def _sample_pointers(self):
        from cutlass.cute.runtime import make_ptr

        gmem = _gmem()
        out = self.out_dtype if self.spec.output_mode == "dense" else self.i64
        return [make_ptr(self.ab_dtype, 0, gmem, assumed_align=16),
                make_ptr(self.ab_dtype, 0, gmem, assumed_align=16),
                make_ptr(self.i32, 0, gmem, assumed_align=4),
                make_ptr(out, 0, gmem, assumed_align=16),
                make_ptr(self.u8, 0, gmem, assumed_align=128)]

    def _for_device(self, device: int):
        """(PackedLauncher or None, grid size) for ``device``, made on first use."""
        from ._fastcall import PackedLauncher, PackingMismatch

        try:
            launcher = PackedLauncher(self.fn, 5, 2, device, self._sample_pointers())
        except PackingMismatch:  # a DSL that marshals differently: keep its own call
            launcher = None
        entry = self._launchers[device] = (launcher, grid_size(self.cfg, device))
        return entry

    def launch_pointers(self, device: int, a: int, b: int, offsets: int, out: int,
                        workspace: int, tokens_sum: int, stream: int) -> None:
        """Launch from raw addresses (``out``: the dense output or the pointer array)."""
        if _gcuda.current_device() == device:  # the common case: no context manager
            self._launch_here(device, a, b, offsets, out, workspace, tokens_sum, stream)
        else:
            with _gcuda.on_device(device):
                self._launch_here(device, a, b, offsets, out, workspace, tokens_sum, stream)

    def _launch_here(self, device, a, b, offsets, out, workspace, tokens_sum, stream):
        entry = self._launchers.get(device)
        launcher, grid = entry if entry is not None else self._for_device(device)
        if launcher is not None:
            launcher.launch_entry(a, b, offsets, out, workspace, tokens_sum, grid, stream)
            return
        import cuda.bindings.driver as cuda_driver
        from cutlass.cute.runtime import make_ptr

        gmem = _gmem()
        out_dtype = self.out_dtype if self.spec.output_mode == "dense" else self.i64
        self.fn(
            make_ptr(self.ab_dtype, a, gmem, assumed_align=16),
            make_ptr(self.ab_dtype, b, gmem, assumed_align=16),
            make_ptr(self.i32, offsets, gmem, assumed_align=4),
            make_ptr(out_dtype, out, gmem, assumed_align=16),
            make_ptr(self.u8, workspace, gmem, assumed_align=128),
            tokens_sum,
            grid,
            cuda_driver.CUstream(stream),
        )

    def launch(self, args: LaunchArgs) -> None:
        out = args.wgrad.ptr if self.spec.output_mode == "dense" else args.wgrad_ptrs.ptr
        self.launch_pointers(args.a.device_id, args.a.ptr, args.b.ptr, args.offsets.ptr, out,
                             args.workspace, args.tokens_sum, args.stream)


def _gmem():
    global _GMEM
    if _GMEM is None:
        import cutlass.cute as cute

        _GMEM = cute.AddressSpace.gmem
    return _GMEM


def grid_size(cfg: Any, device_id: int) -> int:
    """Persistent grid: one CTA per SM, or fewer when there are fewer units of work."""
    return min(cfg.num_units, _sm_count(device_id))


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    from .. import cuda as gcuda

    return gcuda.sm_count(device_id)


def compile_gemm(kernel: Any, spec: StaticSpec, extra_options: str = "") -> CompiledGemm:
    """Compile `kernel` (a kernel object with a `@cute.jit __call__`) for `spec.arch`."""
    global compile_count
    import cuda.bindings.driver as cuda_driver
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    def ptr(dtype, align):
        return cute.runtime.make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)

    out_ptr = (
        ptr(_cutlass_dtype(spec.wgrad_dtype), 16)
        if spec.output_mode == "dense"
        else ptr(cutlass.Int64, 16)
    )
    with _compile_lock:
        fn = cute.compile(
            kernel,
            ptr(cutlass.BFloat16, 16),
            ptr(cutlass.BFloat16, 16),
            ptr(cutlass.Int32, 4),
            out_ptr,
            ptr(cutlass.Uint8, 128),
            Int32(0),
            Int32(1),
            cuda_driver.CUstream(0),
            options=f"--gpu-arch {spec.arch} {extra_options}".strip(),
        )
        compile_count += 1
    return CompiledGemm(fn, kernel.cfg, spec)


class CuteDslBackend(Backend):
    """What the CuTe DSL backends share: compile a kernel object, launch it (from LaunchArgs
    or, on the adapters' per-call path, from raw addresses). Subclasses provide
    ``make_kernel(spec)`` and the spec-dependent parts (tiling, support, workspace size)."""

    def make_kernel(self, spec: StaticSpec):  # pragma: no cover - abstract
        raise NotImplementedError

    def compile(self, spec: StaticSpec):
        return compile_gemm(self.make_kernel(spec), spec)

    def launch(self, compiled, spec: StaticSpec, args: LaunchArgs) -> None:
        compiled.launch(args)

    def launch_pointers(self, compiled, spec: StaticSpec, device_id: int, *addresses) -> None:
        # gwgrad.prepared's path: addresses, workspace, tokens_sum, stream.
        compiled.launch_pointers(device_id, *addresses)
