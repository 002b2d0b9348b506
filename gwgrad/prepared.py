"""Prepared calls: the adapters' per-call path, from raw addresses.

A framework adapter sees the same static call signature (shapes, strides, dtypes, device,
modes) over and over with new storage. ``prepare_call`` runs the contract's full check once
for a signature and returns a ``PreparedCall`` bound to the compiled operator;
``PreparedCall.launch`` then takes only addresses, a stream and a workspace, and checks only
what can change between calls with that signature: the addresses' alignment. The adapter
keeps the ``PreparedCall`` under its own cheap key (its framework's shape/stride/dtype
attributes), which must determine everything ``prepare_call`` was given except addresses.

Launching goes through the backend's optional ``launch_pointers`` (no per-call objects at
all) or, without it, through ``LaunchArgs`` and ``Backend.launch``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from . import memory
from .api import GroupedGemmWgrad, operator_for
from .backends.base import LaunchArgs
from .dtypes import DType
from .tensors import TensorDesc
from .validation import operand_dims

__all__ = ["PreparedCall", "prepare_call"]


def _template(desc: Optional[TensorDesc]) -> Optional[TensorDesc]:
    # Keep the layout, not the first call's array: the cache must not hold user memory.
    return None if desc is None else dataclasses.replace(desc, owner=None)


class PreparedCall:
    """One accepted call signature bound to its compiled operator (see the module doc)."""

    def __init__(self, op: GroupedGemmWgrad, a: TensorDesc, b: TensorDesc, offsets: TensorDesc,
                 wgrad: Optional[TensorDesc], wgrad_ptrs: Optional[TensorDesc]):
        spec = op.spec
        self.operator = op
        self.discrete = spec.output_mode == "discrete"
        self.is_cuda = a.is_cuda
        self.device_id = a.device_id
        self.workspace_bytes = op.workspace_bytes if a.is_cuda else 0
        self.tokens_sum = operand_dims(a, "a_tensor", "a", spec.a_major)[1]
        self._spec = spec
        self._templates = tuple(_template(d) for d in (a, b, offsets, wgrad, wgrad_ptrs))
        self._launch_pointers = op.backend.launch_pointers if a.is_cuda else None

    def launch(self, a: int, b: int, offsets: int, out: int, stream: int = 0,
               workspace: int = 0, *, validate_offsets: bool = False) -> None:
        """Enqueue one call on ``stream``: ``a``, ``b``, ``offsets`` and ``out`` are the
        addresses of this call's tensors (``out``: the dense output, or in discrete mode the
        int64 array of per-expert output addresses). ``workspace``: ``workspace_bytes`` of
        device memory untouched by other work until the launch completes on ``stream``
        (0: gwgrad's per-stream workspace, which CUDA-graph capture cannot allocate).
        ``validate_offsets`` reads the offsets on the host first (one sync)."""
        if (a | b | out) & 15 or offsets & 3:
            self._misaligned(a, b, offsets, out)
        if self.workspace_bytes and not workspace:
            workspace = memory.workspace(self.device_id, stream, self.workspace_bytes)
        fast = self._launch_pointers
        if fast is not None and not validate_offsets:
            op = self.operator
            fast(op._compiled, self._spec, self.device_id, a, b, offsets, out, workspace,
                 self.tokens_sum, stream)
            return
        ta, tb, toff, tw, tp = self._templates
        out_desc = dataclasses.replace(tp if self.discrete else tw, ptr=out)
        args = LaunchArgs(
            a=dataclasses.replace(ta, ptr=a), b=dataclasses.replace(tb, ptr=b),
            offsets=dataclasses.replace(toff, ptr=offsets), tokens_sum=self.tokens_sum,
            wgrad=None if self.discrete else out_desc,
            wgrad_ptrs=out_desc if self.discrete else None, stream=stream, workspace=workspace)
        self.operator._run(args, validate_offsets)

    def _misaligned(self, a: int, b: int, offsets: int, out: int) -> None:
        out_name = "wgrad_ptrs" if self.discrete else "wgrad_tensor"
        for name, ptr, align in (("a_tensor", a, 16), ("b_tensor", b, 16),
                                 ("offsets_tensor", offsets, 4), (out_name, out, 16)):
            if ptr % align:
                raise ValueError(f"{name}: expected a {align}-byte aligned base address, got "
                                 f"{ptr:#x}")


def prepare_call(a: TensorDesc, b: TensorDesc, offsets: TensorDesc, *,
                 wgrad: Optional[TensorDesc] = None, wgrad_ptrs: Optional[TensorDesc] = None,
                 output_mode: str = "dense", wgrad_dtype: Optional[DType] = None,
                 accumulate_on_output: bool = False,
                 input_order: str = "tensor2d") -> PreparedCall:
    """Check a call completely (ValueError naming the argument), find or compile its operator
    (``gwgrad.api.operator_for``) and bind it to the call's signature."""
    op = operator_for(a, b, offsets, wgrad=wgrad, wgrad_ptrs=wgrad_ptrs,
                      output_mode=output_mode, wgrad_dtype=wgrad_dtype,
                      accumulate_on_output=accumulate_on_output, input_order=input_order)
    return PreparedCall(op, a, b, offsets, wgrad, wgrad_ptrs)
