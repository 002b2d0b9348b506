"""The interface every backend implements: check support, compile, launch."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ..spec import StaticSpec
from ..tensors import TensorDesc


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

    ``check_support`` raises ``ValueError`` naming the argument that this backend cannot serve
    (or ``RuntimeError`` for an unusable environment); ``compile`` returns an opaque handle
    (the CuTe DSL backends cache compiled code on disk via ``CUTE_DSL_CACHE_DIR``);
    ``launch`` enqueues the work on ``args.stream`` and returns without synchronizing.
    """

    name: str = "backend"

    @abc.abstractmethod
    def check_support(self, spec: StaticSpec) -> None: ...

    def default_tiling(self, spec: StaticSpec) -> Tuple[Tuple[int, int], Tuple[int, int]]:
        """(mma_tiler_mn, cluster_shape_mn) for a spec whose caller left them None.

        ``spec`` may have either field None; the result fills only those that are.
        """
        return (128, 256), (1, 1)

    def workspace_bytes(self, spec: StaticSpec) -> int:
        return 0

    @abc.abstractmethod
    def compile(self, spec: StaticSpec) -> Any: ...

    @abc.abstractmethod
    def launch(self, compiled: Any, spec: StaticSpec, args: LaunchArgs) -> None: ...

    #: Optional fast launch for the adapters' per-call path (``gwgrad.prepared``): a backend
    #: may define ``launch_pointers(compiled, spec, device_id, a, b, offsets, out, workspace,
    #: tokens_sum, stream)`` taking raw addresses (``out``: the dense output, or the int64
    #: pointer array in discrete mode) and doing what ``launch`` does with them. Without it
    #: (None), prepared calls build ``LaunchArgs`` and call ``launch``.
    launch_pointers = None
