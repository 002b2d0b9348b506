"""The interface every backend implements: check support, compile, launch."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from ..spec import StaticSpec
from ..tensors import TensorDesc
from .tuning_rules import REFERENCE, Rule

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
    ``tuning_rules``: the rule table filling the tuning a caller leaves unset
    (gwgrad/backends/tuning_rules.py; ``backends.finalize_spec`` evaluates it).
    """

    name: str = "backend"
    tuning_rules: Tuple[Rule, ...] = REFERENCE

    @abc.abstractmethod
    def check_support(self, spec: StaticSpec) -> None: ...

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
