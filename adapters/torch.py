"""gwgrad for PyTorch: ``torch.ops.gwgrad.*`` custom ops and a one-line ``wgrad()``.

    import gwgrad.adapters.torch as gwt
    w = gwt.wgrad(x, dy, offsets)          # w[e] = x[tokens_e].T @ dy[tokens_e]

``x`` is (tokens, hidden) and ``dy`` (tokens, intermediate), as a training step holds them:
``x.T`` is then the contract's M-major ``a_tensor`` and ``dy`` its N-major ``b_tensor``, the
fastest layout; no copy is made. ``offsets`` is int32 (num_experts,), the cumulative token
counts. The ops:

    gwgrad::grouped_gemm_wgrad(Tensor x, Tensor dy, Tensor offsets, ScalarType out_dtype) -> Tensor
    gwgrad::grouped_gemm_wgrad_into(Tensor x, Tensor dy, Tensor offsets, Tensor(a!) out,
                                    bool accumulate) -> ()
    gwgrad::grouped_gemm_wgrad_discrete(Tensor x, Tensor dy, Tensor offsets, Tensor(a!)[] outs,
                                        bool accumulate) -> ()

have fake (meta) kernels, so ``torch.compile`` and ``torch.library.opcheck`` work. CUDA
tensors run gwgrad's kernel on torch's current stream; the output and the kernel's workspace
come from torch's caching allocator on that stream, so calls can be captured in CUDA graphs
(run one call before capturing: the first call of a shape compiles). CPU tensors run the
reference implementation.

No host synchronization: offsets are read by the kernel on the device, every launch (a graph
replayed after ``offsets.copy_(new)`` uses the new values), and never checked on the host
unless ``validate_offsets=True``. The kernel stays in bounds whatever offsets hold (each
expert's range is clamped to [0, tokens]); invalid offsets give wrong numbers, not faults.

Host cost: ``wgrad()`` in eager mode calls the kernel launcher directly (the dispatcher adds
~5 us and nothing else: these ops have no autograd formula), and under ``torch.compile``,
dispatch modes or tensor subclasses goes through the op. See ``gwgrad/bench_adapters.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import List, Optional, Sequence, Union

import torch

from gwgrad.dtypes import DType
from gwgrad.prepared import prepare_call
from gwgrad.tensors import TensorDesc, as_tensor_desc

from ._common import adapter_message, adapter_names, experts_hidden_intermediate

__all__ = ["wgrad", "GroupedExpertLinear", "grouped_expert_linear", "grouped_mm_reference"]

_DTYPES = {torch.bfloat16: DType.BFLOAT16, torch.float16: DType.FLOAT16,
           torch.float32: DType.FLOAT32, torch.int32: DType.INT32, torch.int64: DType.INT64}


def _desc(t: torch.Tensor, name: str, transpose: bool = False) -> TensorDesc:
    """A TensorDesc of ``t`` (of ``t.T`` when ``transpose``) without creating a view."""
    if transpose and t.dim() != 2:
        raise ValueError(f"{name}: expected 2 dims, got shape {tuple(t.shape)}")
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        return as_tensor_desc(t.t() if transpose else t, name)  # raises the core's error
    shape, strides = tuple(t.shape), t.stride()
    if transpose:
        shape, strides = shape[::-1], strides[::-1]
    device = t.device
    if device.type == "cuda":
        return TensorDesc(t.data_ptr(), shape, strides, dtype, "cuda", device.index, "torch", t)
    if device.type == "cpu":
        return TensorDesc(t.data_ptr(), shape, strides, dtype, "cpu", 0, "torch", t)
    return as_tensor_desc(t, name)  # meta, xpu, ...: the core's error


# --- discrete outputs: the int64 address array, built once per set of addresses -------------

_MAX_POINTER_ARRAYS = 256
# (device index, addresses) -> [device tensor, pinned host copy, kept, stream it was made on]
_pointer_arrays: "OrderedDict[tuple, list]" = OrderedDict()


def _pointer_array(outs: Sequence[torch.Tensor], device: torch.device, stream: int) -> torch.Tensor:
    """A CUDA int64 tensor of the outputs' addresses, cached by those addresses.

    Built from pinned host memory with a non-blocking copy, so it also works while a CUDA
    graph is captured. An array a capture used is kept for good (the graph reads it, and
    replays the copy from the pinned memory); others are evicted least-recently-used.
    """
    addresses = tuple(o.data_ptr() for o in outs)
    key = (device.index, addresses)
    capturing = torch.cuda.is_current_stream_capturing()
    entry = _pointer_arrays.get(key)
    if entry is None:
        host = torch.tensor(addresses, dtype=torch.int64).pin_memory()
        entry = [host.to(device, non_blocking=True), host, capturing, stream]
        _pointer_arrays[key] = entry
        if len(_pointer_arrays) > _MAX_POINTER_ARRAYS:
            for old, (_, _, kept, _) in _pointer_arrays.items():
                if not kept:
                    del _pointer_arrays[old]
                    break
    else:
        _pointer_arrays.move_to_end(key)
        entry[2] = entry[2] or capturing
        if entry[3] != stream and not capturing:  # freed on eviction: not before this use
            entry[0].record_stream(torch.cuda.ExternalStream(stream, device=device))
    return entry[0]


# --- the launch shared by every op ----------------------------------------------------------

# (torch-level signature) -> gwgrad.prepared.PreparedCall. The key holds everything the
# contract's check reads except addresses, so a hit needs no validation beyond alignment.
_prepared: dict = {}


def _current_stream(device: torch.device) -> int:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # ~10x cheaper than the
    if raw is not None:                                          # Stream object
        return raw(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def _launch(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor,
            out: Optional[torch.Tensor], outs: Optional[Sequence[torch.Tensor]],
            accumulate: bool, validate_offsets: bool = False) -> None:
    """Compute into ``out`` (dense) or the per-expert ``outs`` (discrete)."""
    if out is not None:
        target = out
        key = (x.shape, x.stride(), x.dtype, x.device, dy.shape, dy.stride(), dy.dtype,
               offsets.shape, offsets.stride(), offsets.dtype, out.shape, out.stride(),
               out.dtype, out.device, accumulate)
    else:
        _check_discrete(outs, offsets, x, dy)
        if x.is_cuda:
            target = _pointer_array(outs, x.device, _current_stream(x.device))
        else:
            target = torch.tensor([o.data_ptr() for o in outs], dtype=torch.int64)
        key = (x.shape, x.stride(), x.dtype, x.device, dy.shape, dy.stride(), dy.dtype,
               offsets.shape, offsets.stride(), offsets.dtype, len(outs), outs[0].dtype,
               accumulate)
    call = _prepared.get(key)
    if call is None:
        call = _prepared[key] = _prepare(x, dy, offsets, out, outs, target, accumulate)
    stream = workspace = 0
    if call.is_cuda:
        stream = _current_stream(x.device)
        if call.workspace_bytes:
            workspace = _workspace(x.device, stream, call.workspace_bytes)
    try:
        call.launch(x.data_ptr(), dy.data_ptr(), offsets.data_ptr(), target.data_ptr(), stream,
                    workspace, validate_offsets=validate_offsets)
    except ValueError as exc:  # misaligned storage, or offsets rejected by validate_offsets
        raise ValueError(adapter_message(str(exc))) from exc


# (device index, stream) -> the eager workspace of that stream: launches on one stream run in
# order, so one buffer serves them all (torch.empty per call cost ~3 us of the ~20 us budget).
_workspaces: dict = {}


def _workspace(device: torch.device, stream: int, nbytes: int) -> int:
    if torch.cuda.is_current_stream_capturing():
        # Freed right after the launch: during a capture it comes from (and stays in) the
        # graph's private pool, which the replays then use.
        return torch.empty(nbytes, dtype=torch.uint8, device=device).data_ptr()
    key = (device.index, stream)
    ws = _workspaces.get(key)
    if ws is None or ws.numel() < nbytes:
        ws = _workspaces[key] = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8,
                                            device=device)
    return ws.data_ptr()


def _prepare(x, dy, offsets, out, outs, target, accumulate):
    """The first call of a signature: the contract's full check, then the compiled operator."""
    with adapter_names():
        a = _desc(x, "a_tensor", transpose=True)
        b = _desc(dy, "b_tensor")
        off = _desc(offsets, "offsets_tensor")
        if out is not None:
            return prepare_call(a, b, off, wgrad=_desc(out, "wgrad_tensor"),
                                accumulate_on_output=accumulate)
        out_dtype = _DTYPES.get(outs[0].dtype)
        if out_dtype is None:
            raise ValueError(f"wgrad_dtype: expected bfloat16, float16 or float32 outputs, "
                             f"got {outs[0].dtype}")
        return prepare_call(a, b, off, wgrad_ptrs=_desc(target, "wgrad_ptrs"),
                            output_mode="discrete", wgrad_dtype=out_dtype,
                            accumulate_on_output=accumulate)


def _check_discrete(outs, offsets, x, dy) -> None:
    experts, hidden, inter = experts_hidden_intermediate(x.shape, dy.shape, offsets.shape)
    if len(outs) != experts:
        raise ValueError(f"out: expected {experts} per-expert outputs (one per offsets entry), "
                         f"got {len(outs)}")
    shape, dtype, device = (hidden, inter), outs[0].dtype, x.device
    if all(o.shape == shape and o.dtype == dtype and o.device == device and o.is_contiguous()
           for o in outs):
        return
    for e, o in enumerate(outs):
        if (o.shape != shape or not o.is_contiguous() or o.dtype != dtype
                or o.device != device):
            raise ValueError(
                f"out: expected every output to be a contiguous ({hidden}, {inter}) tensor of "
                f"one dtype on {x.device}, got out[{e}] of shape {tuple(o.shape)}, dtype "
                f"{o.dtype}, device {o.device}")


# --- the ops --------------------------------------------------------------------------------

_lib = torch.library.Library("gwgrad", "DEF")
_lib.define("grouped_gemm_wgrad(Tensor x, Tensor dy, Tensor offsets, ScalarType out_dtype) "
            "-> Tensor")
_lib.define("grouped_gemm_wgrad_into(Tensor x, Tensor dy, Tensor offsets, Tensor(a!) out, "
            "bool accumulate) -> ()")
_lib.define("grouped_gemm_wgrad_discrete(Tensor x, Tensor dy, Tensor offsets, "
            "Tensor(a!)[] outs, bool accumulate) -> ()")


def _empty_output(x, dy, offsets, out_dtype):
    shape = experts_hidden_intermediate(x.shape, dy.shape, offsets.shape)
    return torch.empty(shape, dtype=out_dtype, device=x.device)


def _grouped_gemm_wgrad(x, dy, offsets, out_dtype):
    out = _empty_output(x, dy, offsets, out_dtype)
    _launch(x, dy, offsets, out, None, False)
    return out


def _grouped_gemm_wgrad_into(x, dy, offsets, out, accumulate):
    _launch(x, dy, offsets, out, None, accumulate)


def _grouped_gemm_wgrad_discrete(x, dy, offsets, outs, accumulate):
    _launch(x, dy, offsets, None, outs, accumulate)


for _key in ("CPU", "CUDA"):
    _lib.impl("grouped_gemm_wgrad", _grouped_gemm_wgrad, _key)
    _lib.impl("grouped_gemm_wgrad_into", _grouped_gemm_wgrad_into, _key)
    _lib.impl("grouped_gemm_wgrad_discrete", _grouped_gemm_wgrad_discrete, _key)


@torch.library.register_fake("gwgrad::grouped_gemm_wgrad")
def _fake_grouped_gemm_wgrad(x, dy, offsets, out_dtype):
    return _empty_output(x, dy, offsets, out_dtype)


@torch.library.register_fake("gwgrad::grouped_gemm_wgrad_into")
def _fake_grouped_gemm_wgrad_into(x, dy, offsets, out, accumulate):
    return None


@torch.library.register_fake("gwgrad::grouped_gemm_wgrad_discrete")
def _fake_grouped_gemm_wgrad_discrete(x, dy, offsets, outs, accumulate):
    return None


# --- the one-line entry ---------------------------------------------------------------------

def _eager(*tensors: torch.Tensor) -> bool:
    """True when calling the implementation directly is what the op would do: not under
    torch.compile, no dispatch mode (fake tensors, FlopCounter, ...), no functorch transform,
    plain tensors only."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    return all(type(t) is torch.Tensor and not t.is_meta for t in tensors)


def wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, *,
          out: Union[torch.Tensor, Sequence[torch.Tensor], None] = None,
          accumulate: bool = False, out_dtype: Optional[torch.dtype] = None,
          validate_offsets: bool = False) -> Union[torch.Tensor, List[torch.Tensor]]:
    """``W[e] = x[begin:end].T @ dy[begin:end]`` for every expert, FP32 accumulation.

    x: (tokens, hidden) bfloat16; dy: (tokens, intermediate) bfloat16; offsets: int32
    (num_experts,), ``end = offsets[e]``, ``begin = offsets[e-1]`` (0 for e = 0).
    out: None (a new (num_experts, hidden, intermediate) tensor of ``out_dtype``, default
    bfloat16), a tensor of that shape, or a list of num_experts contiguous
    (hidden, intermediate) tensors (discrete outputs). accumulate: add to ``out`` instead of
    overwriting it. validate_offsets: check offsets on the host first (one sync; eager only).
    Returns ``out`` (or the new tensor).
    """
    if accumulate and out is None:
        raise ValueError("out: expected an initialized output to accumulate into "
                         "(accumulate=True adds to it), got None")
    if validate_offsets and torch.compiler.is_compiling():
        raise ValueError("validate_offsets: expected False under torch.compile (the check "
                         "synchronizes with the host), got True")
    if out is None:
        dtype = torch.bfloat16 if out_dtype is None else out_dtype
        if _eager(x, dy, offsets) or validate_offsets:
            result = _empty_output(x, dy, offsets, dtype)
            _launch(x, dy, offsets, result, None, False, validate_offsets)
            return result
        return torch.ops.gwgrad.grouped_gemm_wgrad.default(x, dy, offsets, dtype)
    if isinstance(out, torch.Tensor):
        if out_dtype is not None and out_dtype != out.dtype:
            raise ValueError(f"out_dtype: expected None or {out.dtype} (out's dtype), got {out_dtype}")
        if _eager(x, dy, offsets, out) or validate_offsets:
            _launch(x, dy, offsets, out, None, accumulate, validate_offsets)
        else:
            torch.ops.gwgrad.grouped_gemm_wgrad_into.default(x, dy, offsets, out, accumulate)
        return out
    outs = list(out)
    if not outs or not all(isinstance(o, torch.Tensor) for o in outs):
        raise ValueError("out: expected None, a tensor or a non-empty list of tensors, got "
                         f"{type(out).__name__}")
    if out_dtype is not None and out_dtype != outs[0].dtype:
        raise ValueError(f"out_dtype: expected None or {outs[0].dtype} (out's dtype), got {out_dtype}")
    if _eager(x, dy, offsets, *outs) or validate_offsets:
        _launch(x, dy, offsets, None, outs, accumulate, validate_offsets)
    else:
        torch.ops.gwgrad.grouped_gemm_wgrad_discrete.default(x, dy, offsets, outs, accumulate)
    return outs


# --- example: a grouped expert linear layer with gwgrad in its backward ---------------------

def _bounds(offsets: torch.Tensor) -> List[int]:
    return [0] + offsets.tolist()  # one host sync: only the loop fallbacks use it


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``y[tokens_e] = x[tokens_e] @ w[e]`` with a per-expert loop (syncs for offsets)."""
    bounds = _bounds(offsets)
    y = x.new_zeros((x.shape[0], w.shape[2]))
    for e in range(w.shape[0]):
        s, t = bounds[e], bounds[e + 1]
        if t > s:
            y[s:t] = x[s:t] @ w[e]
    return y


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # torch._grouped_mm (PyTorch >= 2.8, SM90+) reads offsets on the device: no sync.
    if x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16:
        try:
            return torch._grouped_mm(x, w, offs=offsets)
        except RuntimeError:  # an older GPU or an unsupported layout: loop below
            pass
    return grouped_mm_reference(x, w, offsets)


class GroupedExpertLinear(torch.autograd.Function):
    """``y_e = x_e @ w_e`` for the tokens of each expert e (x (tokens, hidden), w
    (num_experts, hidden, intermediate)); backward: ``dx_e = dy_e @ w_e.T`` with torch,
    ``dw = gwgrad`` (``dw[e] = x_e.T @ dy_e``)."""

    @staticmethod
    def forward(ctx, x, w, offsets):
        ctx.save_for_backward(x, w, offsets)
        return _grouped_mm(x, w, offsets)

    @staticmethod
    def backward(ctx, dy):
        x, w, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _grouped_mm(dy, w.transpose(1, 2), offsets)
        if ctx.needs_input_grad[1]:
            dw = wgrad(x, dy, offsets, out_dtype=w.dtype)
        return dx, dw, None


def grouped_expert_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``GroupedExpertLinear.apply(x, w, offsets)``."""
    return GroupedExpertLinear.apply(x, w, offsets)
