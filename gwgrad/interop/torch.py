"""PyTorch interop: tensors, torch's current stream, its caching allocator, record_stream.

Imported only once torch is (``gwgrad.interop`` looks it up lazily); the torch adapter and the
core both use it, so the torch-specific code lives here once.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from typing import Dict, Sequence

import torch

from ..dtypes import DType
from ..errors import ArgumentError
from ..tensors import TensorDesc

__all__ = ["DTYPES", "native_dtype", "describe", "current_stream", "capturing", "on_stream",
           "empty", "record_stream", "workspace", "stacked_pointer_array", "pointer_array"]

#: torch dtype -> DType, for every element type both know.
DTYPES: Dict[torch.dtype, DType] = {
    getattr(torch, d.value): d for d in DType if isinstance(getattr(torch, d.value, None), torch.dtype)}
_NATIVE = {d: t for t, d in DTYPES.items()}


def native_dtype(dtype: DType) -> torch.dtype:
    return _NATIVE[dtype]


def describe(t: torch.Tensor, name: str, transpose: bool = False) -> TensorDesc:
    """A TensorDesc of ``t`` (of ``t.T`` when ``transpose``) without creating a view."""
    dtype = DTYPES.get(t.dtype)
    if dtype is None:
        raise ArgumentError(name, f"unsupported dtype {t.dtype}")
    shape, strides = tuple(t.shape), t.stride()
    if transpose:
        if len(shape) != 2:
            raise ArgumentError(name, f"expected 2 dims, got shape {shape}")
        shape, strides = shape[::-1], strides[::-1]
    device = t.device
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return TensorDesc(t.data_ptr(), shape, strides, dtype, "cuda", index, "torch", t)
    if device.type == "cpu":
        return TensorDesc(t.data_ptr(), shape, strides, dtype, "cpu", 0, "torch", t)
    raise ArgumentError(name, f"expected a CUDA or CPU tensor, got a tensor on {device}")


def _stream_object(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


#: ``current_stream(device_index)``: torch's current stream on a CUDA device, as an address
#: (the raw query, ~10x cheaper than a Stream object, where this torch has it).
current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _stream_object


def on_stream(device_index: int, stream: int):
    """Context that makes ``stream`` torch's current stream (allocations then belong to it)."""
    if stream == current_stream(device_index):
        return contextlib.nullcontext()
    device = torch.device("cuda", device_index)
    return torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device))


def empty(shape: Sequence[int], dtype: DType, like: TensorDesc, stream: int) -> torch.Tensor:
    """An uninitialized tensor on ``like``'s device, allocated on ``stream``."""
    if not like.is_cuda:
        return torch.empty(tuple(shape), dtype=native_dtype(dtype))
    with on_stream(like.device_id, stream):
        return torch.empty(tuple(shape), dtype=native_dtype(dtype),
                           device=torch.device("cuda", like.device_id))


def record_stream(t: torch.Tensor, stream: int) -> None:
    """Tell the caching allocator that work on ``stream`` uses ``t`` (freeing ``t`` early then
    cannot hand its memory to other work before that work is done)."""
    if t.is_cuda and stream != current_stream(t.device.index):
        t.record_stream(torch.cuda.ExternalStream(stream, device=t.device))


# (device index, stream, purpose) -> (address, bytes, tensor): the eager workspace of that
# stream: launches on one stream run in order, so one buffer serves them all (torch.empty per
# call cost ~3 us). The GEMMs' ("kernel") and the quantizers' ("quantize") are separate: a
# single-launch GEMM keeps its grid-barrier words (bytes 8..15) zero between launches, which a
# quantizer's data would break.
_workspaces: Dict[tuple, tuple] = {}
#: ``capturing()``: whether torch's current stream is being captured into a CUDA graph.
capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing",
                    torch.cuda.is_current_stream_capturing)


def workspace(device_index: int, stream: int, nbytes: int, purpose: str = "kernel") -> int:
    """Address of ``nbytes`` of workspace for a launch on ``stream``, from torch's allocator,
    zero-filled when allocated.

    During CUDA-graph capture: a fresh block, zeroed on ``stream`` (a node of the graph) and
    freed right after the launch is enqueued: it comes from (and stays in) the graph's private
    pool, which the replays use.
    """
    if capturing():
        with on_stream(device_index, stream):
            return torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{device_index}").data_ptr()
    key = (device_index, stream, purpose)
    held = _workspaces.get(key)
    if held is not None and held[1] >= nbytes:
        return held[0]
    with on_stream(device_index, stream):
        ws = torch.zeros(max(nbytes, 1 << 16), dtype=torch.uint8, device=f"cuda:{device_index}")
    _workspaces[key] = (ws.data_ptr(), ws.numel(), ws)
    return ws.data_ptr()


def stacked_pointer_array(stacked: TensorDesc, stream: int) -> TensorDesc:
    """The int64 per-expert addresses into a stacked CUDA output, built by a device kernel on
    ``stream`` (so also under CUDA-graph capture)."""
    step = stacked.strides[0] * stacked.dtype.itemsize
    with on_stream(stacked.device_id, stream):
        ptrs = torch.arange(stacked.shape[0], dtype=torch.int64,
                            device=torch.device("cuda", stacked.device_id)) * step + stacked.ptr
    return describe(ptrs, "wgrad_ptrs")


_MAX_POINTER_ARRAYS = 256
# (device index, addresses) -> [device tensor, pinned host copy, kept, stream it was made on]
_pointer_arrays: "OrderedDict[tuple, list]" = OrderedDict()
_pointer_arrays_lock = threading.Lock()


def pointer_array(outs: Sequence[torch.Tensor], device: torch.device, stream: int) -> torch.Tensor:
    """A CUDA int64 tensor of the outputs' addresses, cached by those addresses.

    Built from pinned host memory with a non-blocking copy, so it also works while a CUDA
    graph is captured. An array a capture used is kept for good (the graph reads it, and
    replays the copy from the pinned memory); others are evicted least-recently-used.
    """
    addresses = tuple(o.data_ptr() for o in outs)
    key = (device.index, addresses)
    in_capture = capturing()
    with _pointer_arrays_lock:  # threads share the cache (eviction iterates over it)
        entry = _pointer_arrays.get(key)
        if entry is None:
            host = torch.tensor(addresses, dtype=torch.int64).pin_memory()
            entry = [host.to(device, non_blocking=True), host, in_capture, stream]
            _pointer_arrays[key] = entry
            if len(_pointer_arrays) > _MAX_POINTER_ARRAYS:
                for old, (_, _, kept, _) in _pointer_arrays.items():
                    if not kept:
                        del _pointer_arrays[old]
                        break
        else:
            _pointer_arrays.move_to_end(key)
            entry[2] = entry[2] or in_capture
            if entry[3] != stream and not in_capture:  # freed on eviction: not before this use
                entry[0].record_stream(torch.cuda.ExternalStream(stream, device=device))
    return entry[0]
