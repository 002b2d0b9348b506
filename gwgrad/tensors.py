"""Tensor descriptors: what gwgrad needs to know about an array (address, shape, strides,
dtype, device), framework-free. ``gwgrad.interop.as_tensor_desc`` makes them from framework
arrays; ``from_pointer`` from a raw address.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Tuple

from .dtypes import DType, as_dtype
from .errors import ArgumentError


@dataclass(frozen=True)
class TensorDesc:
    """A strided array in device or host memory.

    ``strides`` count elements (bytes for packed FP4, whose shape also counts bytes).
    ``framework`` names where it came from ("torch", "cupy", "jax", "numpy") or is None for a
    raw pointer; ``owner`` keeps the source object alive and lets adapters allocate alike.
    ``read_only`` is set when the producer says the memory must not be written.
    """

    ptr: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    dtype: DType
    device_type: str  # "cuda" or "cpu"
    device_id: int = 0
    framework: Optional[str] = None
    owner: Any = field(default=None, compare=False, repr=False)
    read_only: bool = field(default=False, compare=False)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    @property
    def device(self) -> str:
        return f"{self.device_type}:{self.device_id}" if self.is_cuda else "cpu"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def is_contiguous(self) -> bool:
        """Row-major dense, ignoring the strides of size-1 axes (as torch and NumPy do)."""
        if 0 in self.shape:  # no elements: any strides describe it
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


def contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def from_pointer(
    ptr: int,
    shape: Sequence[int],
    strides: Optional[Sequence[int]],
    dtype: Any,
    device_id: int = 0,
    *,
    device_type: str = "cuda",
    owner: Any = None,
    name: str = "tensor",
) -> TensorDesc:
    """Describe memory at address ``ptr``: ``strides`` in elements (None: row-major dense).

    ``device_type="cpu"`` describes host memory (what the reference backend reads).
    """
    if isinstance(ptr, bool) or not isinstance(ptr, int) or ptr < 0:
        raise ArgumentError(name, f"expected a non-negative integer address, got {ptr!r}")
    try:
        shape_t = tuple(int(s) for s in shape)
    except TypeError:
        raise ArgumentError(name, f"expected shape to be a sequence of ints, got {shape!r}") from None
    if any(s < 0 for s in shape_t):
        raise ArgumentError(name, f"expected non-negative sizes, got shape {shape_t}")
    if strides is None:
        strides_t = contiguous_strides(shape_t)
    else:
        strides_t = tuple(int(s) for s in strides)
        if len(strides_t) != len(shape_t):
            raise ArgumentError(
                name, f"expected {len(shape_t)} strides for shape {shape_t}, got {strides_t}")
    if device_type not in ("cuda", "cpu"):
        raise ArgumentError(name, f"expected device_type 'cuda' or 'cpu', got {device_type!r}")
    if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
        raise ArgumentError(name, f"expected a non-negative device ordinal, got {device_id!r}")
    return TensorDesc(ptr, shape_t, strides_t, as_dtype(dtype, f"{name} dtype"), device_type,
                      device_id if device_type == "cuda" else 0, None, owner)
