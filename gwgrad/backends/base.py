"""The interface every backend implements: check support, compile, launch."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from ..kernels.tiling import SCHEDULE_DYNAMIC
from ..spec import StaticSpec
from ..tensors import TensorDesc

#: The architectures of each GPU family gwgrad has kernels for (what an UnsupportedError's
#: ``needs`` names).
SM90_ARCHS = ("sm_90a",)
SM100_ARCHS = ("sm_100a", "sm_103a")


@dataclass
class LaunchArgs:
    """The dynamic part of one call: storage, tokens_sum and the stream.

    ``wgrad`` is the dense output (or, in discrete mode when the wrapper allocated a stacked
    tensor, that tensor); ``wgrad_ptrs`` the int64 array of per-expert output addresses
    (discrete mode). ``workspace`` is a device address of ``backend.workspace_bytes(spec)``
    bytes that stays untouched by anything else until the launch completes on ``stream``.
    """

    a: TensorDesc
    b: TensorDesc
    offsets: TensorDesc
    tokens_sum: int
    wgrad: Optional[TensorDesc] = None
    wgrad_ptrs: Optional[TensorDesc] = None
    sfa: Optional[TensorDesc] = None
    sfb: Optional[TensorDesc] = None
    global_scale_a: Optional[TensorDesc] = None
    global_scale_b: Optional[TensorDesc] = None
    stream: int = 0
    workspace: int = 0


class Backend(abc.ABC):
    """A way to compute the operation for some static specs.

    ``check_support`` raises ``ArgumentError`` (a ``ValueError``) naming the argument no kernel
    runs, ``UnsupportedError`` (a ``NotImplementedError``) naming the argument another
    architecture's kernel runs (gwgrad/errors.py), or ``RuntimeError`` for an unusable
    environment; when it passes, ``compile`` succeeds.
    ``compile`` returns an opaque handle (the CuTe DSL backends keep compiled kernels on disk
    too: gwgrad.kernel_cache); ``launch`` enqueues the work described by ``args`` on
    ``args.stream``; ``launcher`` gives the per-call path of ``gwgrad.plan`` for CUDA.
    """

    name: str = "backend"

    @abc.abstractmethod
    def check_support(self, spec: StaticSpec) -> None: ...

    def default_tiling(self, spec: StaticSpec) -> Tuple[Tuple[int, int], Tuple[int, int]]:
        """(mma_tiler_mn, cluster_shape_mn) for a spec whose caller left them None.

        ``spec`` may have either field None; the result fills only those that are.
        """
        return (128, 256), (1, 1)

    def tiling_for_tokens(self, spec: StaticSpec,
                          tokens_sum: int) -> Optional[Tuple[Tuple[int, int], Tuple[int, int]]]:
        """(mma_tiler_mn, cluster_shape_mn) better than ``default_tiling``'s for a call with
        ``tokens_sum`` tokens, or None. Asked only when the caller left both None and the
        tokens are known when the plan is built (the functional API and the adapters: the
        operand's shape; the class API: its sample's). A kernel so tiled runs any tokens_sum."""
        return None

    def default_tuning(self, spec: StaticSpec) -> Tuple[int, int]:
        """(raster_group, epi_tile_n) for a spec whose caller left them 0."""
        return 16, 64

    def default_epi_buffer_sets(self, spec: StaticSpec) -> int:
        """Sets of epilogue staging buffers for a (tiled) spec whose caller left it 0: one,
        the consumer groups take it in turn (kernels without consumer groups have one)."""
        return 1

    def default_unit_schedule(self, spec: StaticSpec) -> int:
        """How CTAs take units for a (tiled) spec whose caller left ``unit_schedule`` 0: the
        dynamic counter (kernels/tiling.py UNIT_SCHEDULES)."""
        return SCHEDULE_DYNAMIC

    def default_launches(self, spec: StaticSpec) -> int:
        """Kernel launches per call for a spec whose caller left ``launches`` 0: 1 where the
        backend's GEMM can do the prep work itself (``single_launch_problem`` is None), else 2
        (a prep kernel, then the GEMM)."""
        return 1 if self.single_launch_problem(spec) is None else 2

    def single_launch_problem(self, spec: StaticSpec) -> Optional[str]:
        """Why this backend cannot run ``spec`` in one launch (``launches=1``), or None."""
        return f"the {self.name} backend's kernels run as a prep kernel and a GEMM"

    def workspace_bytes(self, spec: StaticSpec) -> int:
        return 0

    @abc.abstractmethod
    def compile(self, spec: StaticSpec) -> Any: ...

    @abc.abstractmethod
    def launch(self, compiled: Any, spec: StaticSpec, args: LaunchArgs) -> None: ...

    def launcher(self, compiled: Any, spec: StaticSpec, device_id: int) -> Optional[Callable]:
        """A function ``(stream, a, b, offsets, out, workspace, status, tokens_sum)`` of raw
        addresses that launches ``compiled`` on CUDA device ``device_id`` (``out``: the dense
        output, or the int64 pointer array in discrete mode; ``status``: gwgrad's device status
        record, gwgrad/status.py). None for backends that run on the host (the reference),
        which ``gwgrad.plan`` calls through ``launch``."""
        return None
