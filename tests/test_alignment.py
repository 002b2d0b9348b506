"""Every call checks every address it hands a kernel, also on the cached path.

Plans are keyed by layout (shapes, strides, dtypes), not by address: a second call with the
same layout finds the first call's plan and skips the contract's full check. Its tensors can
still sit anywhere, e.g. a 1-byte scale tensor that is a view one byte into a buffer. Each
test here makes a first, aligned call (which builds the plan), then calls again with one
argument moved to a misaligned address of the same layout, and expects the ``ValueError``
naming that argument that a first call would raise, for every tensor argument of every
entry point: the contract's wrapper and class, the torch and CuPy adapters, and the plan
itself. CPU arrays take the same path (the reference backend runs behind the same checks).
JAX arrays have no user-visible addresses: XLA allocates every buffer a custom call gets.
"""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

import gwgrad
from gwgrad import DType, from_pointer
from gwgrad.adapters._common import NAMES
from test_reference_scaled import build, check
from wgrad_cases import bf16, poisoned

#: The alignment each argument needs (gwgrad/plan.py, gwgrad/validation.py).
NEED = {"a_tensor": 16, "b_tensor": 16, "sfa_tensor": 16, "sfb_tensor": 16,
        "wgrad_tensor": 16, "wgrad_ptrs": 16, "offsets_tensor": 4, "global_scale_a": 4,
        "global_scale_b": 4}


def _extent_bytes(shape, strides, itemsize) -> int:
    if any(s == 0 for s in shape):
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(shape, strides))) * itemsize


def _relocated(ptr: int, nbytes: int, shift: int) -> np.ndarray:
    """A fresh buffer whose bytes from ``shift`` past a 64-byte boundary hold ``nbytes``
    bytes copied from ``ptr``; returns that slice (misaligned as ``shift`` says)."""
    raw = np.zeros(nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + shift
    out = raw[start:start + nbytes]
    ctypes.memmove(out.ctypes.data, ptr, nbytes)
    return out


def shifted(value, name: str, shift: int):
    """The same values and layout as ``value`` (a TensorDesc or NumPy array on the CPU), at
    an address ``shift`` bytes past a 64-byte boundary, as a TensorDesc."""
    desc = gwgrad.as_tensor_desc(value, name)
    strides = desc.strides or tuple(int(np.prod(desc.shape[i + 1:])) for i in range(desc.ndim))
    nbytes = _extent_bytes(desc.shape, strides, desc.dtype.itemsize)
    buf = _relocated(desc.ptr, nbytes, shift)
    moved = from_pointer(buf.ctypes.data, desc.shape, strides, desc.dtype, device_type="cpu",
                         owner=buf)
    assert moved.ptr % 64 == shift
    return moved


def shifted_torch(t, shift: int):
    """The same values and layout as the CPU tensor ``t``, ``shift`` bytes past a 64-byte
    boundary (torch views need offsets divisible by the element size; from_numpy does not)."""
    import torch

    nbytes = _extent_bytes(t.shape, t.stride(), t.element_size())
    buf = _relocated(t.data_ptr(), nbytes, shift)
    flat = torch.from_numpy(buf).view(t.dtype)
    moved = flat.as_strided(t.shape, t.stride())
    assert moved.data_ptr() % 64 == shift
    return moved


def misaligned_shift(name: str, itemsize: int) -> int:
    """A shift that breaks ``name``'s alignment: one element (the view a user makes by
    slicing), or 2 bytes where one element is itself aligned enough."""
    return itemsize if itemsize % NEED[name] else 2


def aligned_message(name: str, adapter: bool = False) -> str:
    shown = NAMES[name] if adapter else name
    return rf"^{re.escape(shown)}: expected a {NEED[name]}-byte aligned base address, got 0x"


# --- the contract's wrapper, every format ----------------------------------------------------

def scaled_case(rng, recipe: str):
    if recipe == "mxfp8":
        return build(rng, "blocked", "e4m3", "e4m3", (64, 0, 32), hidden=32, inter=48,
                     sf_fmt="e8m0")
    if recipe == "nvfp4":
        return build(rng, "blocked", "e2m1", "e2m1", (64, 0, 128), hidden=32, inter=64,
                     sf_fmt="e4m3", sf_vec=16)
    if recipe == "per_expert_channel":
        return build(rng, "per_expert_channel", "e4m3", "e5m2", (48, 0, 16), hidden=32,
                     inter=48, global_scales=True)
    return build(rng, "block_1x128", "e5m2", "e4m3", (144, 16), hidden=32, inter=48)


def _tensor_arguments(kwargs: dict):
    return [k for k in NEED if kwargs.get(k) is not None]


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "per_expert_channel", "block_1x128"])
def test_wrapper_checks_every_address_of_a_cached_call(rng, recipe):
    case = scaled_case(rng, recipe)
    kwargs = dict(case.kwargs, wgrad_tensor=poisoned(case.expected.shape, "float32"))
    gwgrad.grouped_gemm_wgrad_wrapper_sm100(**kwargs)
    check(kwargs["wgrad_tensor"].astype(np.float64), case.expected)
    plans = gwgrad.cache_info()["plans"]
    names = _tensor_arguments(kwargs)
    assert {"sfa_tensor", "sfb_tensor"} <= set(names)
    for name in names:
        desc = gwgrad.as_tensor_desc(kwargs[name], name)
        moved = shifted(kwargs[name], name, misaligned_shift(name, desc.dtype.itemsize))
        with pytest.raises(ValueError, match=aligned_message(name)):
            gwgrad.grouped_gemm_wgrad_wrapper_sm100(**dict(kwargs, **{name: moved}))
        # Moved to another aligned address: the same plan runs it.
        again = shifted(kwargs[name], name, 0)
        gwgrad.grouped_gemm_wgrad_wrapper_sm100(**dict(kwargs, **{name: again}))
    assert gwgrad.cache_info()["plans"] == plans  # every call above found the first plan


def test_wrapper_discrete_pointer_array(rng):
    counts = (8, 0, 24)
    x = bf16(rng.standard_normal((32, 16)))
    dy = bf16(rng.standard_normal((32, 24)))
    offsets = np.cumsum(counts).astype(np.int32)
    outs = [poisoned((16, 24), "float32") for _ in counts]
    ptrs = np.array([o.ctypes.data for o in outs], np.int64)
    kwargs = dict(a_tensor=x.T, b_tensor=dy, offsets_tensor=offsets, output_mode="discrete",
                  wgrad_ptrs=ptrs, wgrad_dtype="float32")
    gwgrad.grouped_gemm_wgrad(**kwargs)
    plans = gwgrad.cache_info()["plans"]
    for name, shift in (("wgrad_ptrs", 8), ("offsets_tensor", 2)):
        with pytest.raises(ValueError, match=aligned_message(name)):
            gwgrad.grouped_gemm_wgrad(**dict(kwargs, **{name: shifted(kwargs[name], name,
                                                                      shift)}))
    assert gwgrad.cache_info()["plans"] == plans
    # The addresses inside the array are checked too (the reference on the host; CUDA
    # launches in the prep kernel, gwgrad/kernels/prep.py check_offsets).
    bad = ptrs.copy()
    bad[2] += 4
    with pytest.raises(ValueError, match=r"^wgrad_ptrs: expected a non-null, 16-byte aligned "
                                         r"address per expert, got wgrad_ptrs\[2\] = 0x"):
        gwgrad.grouped_gemm_wgrad(**dict(kwargs, wgrad_ptrs=bad))


# --- the contract's class -------------------------------------------------------------------

@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "per_expert_channel"])
def test_class_execute_checks_every_address(rng, recipe):
    case = scaled_case(rng, recipe)
    kw = dict(case.kwargs)
    out = poisoned(case.expected.shape, "float32")
    op = gwgrad.GroupedGemmWgradSm100(
        kw["a_tensor"], kw["b_tensor"], kw["sfa_tensor"], kw["sfb_tensor"], kw["offsets_tensor"],
        out, sample_global_scale_a=kw.get("global_scale_a"),
        sample_global_scale_b=kw.get("global_scale_b"), sf_vec_size=kw.get("sf_vec_size", 16),
        scale_recipe=kw.get("scale_recipe"))
    op.compile()
    args = dict(a_tensor=kw["a_tensor"], b_tensor=kw["b_tensor"], sfa_tensor=kw["sfa_tensor"],
                sfb_tensor=kw["sfb_tensor"], offsets_tensor=kw["offsets_tensor"],
                wgrad_tensor=out, global_scale_a=kw.get("global_scale_a"),
                global_scale_b=kw.get("global_scale_b"))
    op.execute(**args)
    check(out.astype(np.float64), case.expected)
    for name in _tensor_arguments(args):
        desc = gwgrad.as_tensor_desc(args[name], name)
        moved = shifted(args[name], name, misaligned_shift(name, desc.dtype.itemsize))
        with pytest.raises(ValueError, match=aligned_message(name)):
            op.execute(**dict(args, **{name: moved}))
    assert len(op._plans) == 1


# --- the plan: raw addresses ------------------------------------------------------------------

def test_plan_launch_checks_the_scale_addresses(rng):
    case = scaled_case(rng, "per_expert_channel")
    kw = case.kwargs
    out = poisoned(case.expected.shape, "float32")
    descs = {k: gwgrad.as_tensor_desc(v, k) for k, v in kw.items() if k in NEED}
    plan = gwgrad.plan.plan_for(
        descs["a_tensor"], descs["b_tensor"], descs["offsets_tensor"],
        wgrad=gwgrad.as_tensor_desc(out, "wgrad_tensor"), sfa=descs["sfa_tensor"],
        sfb=descs["sfb_tensor"], global_scale_a=descs["global_scale_a"],
        global_scale_b=descs["global_scale_b"], scale_recipe="per_expert_channel")
    ptrs = [descs[k].ptr for k in ("a_tensor", "b_tensor", "offsets_tensor")] + [out.ctypes.data]
    scales = [descs[k].ptr for k in ("sfa_tensor", "sfb_tensor", "global_scale_a",
                                     "global_scale_b")]
    plan.launch(*ptrs, scales=tuple(scales))
    check(out.astype(np.float64), case.expected)
    for i, (name, low) in enumerate((("sfa_tensor", 4), ("sfb_tensor", 8),
                                     ("global_scale_a", 2), ("global_scale_b", 1))):
        moved = list(scales)
        moved[i] += low
        with pytest.raises(ValueError, match=aligned_message(name)):
            plan.launch(*ptrs, scales=tuple(moved))
    with pytest.raises(ValueError, match=r"^sfa_tensor: expected scales=\(sfa, sfb"):
        plan.launch(*ptrs, scales=tuple(scales[:2]))


def test_an_empty_tensor_may_sit_anywhere_on_the_cached_path_too():
    """A zero-size tensor's address is never read: the first call accepts any, and so does a
    cached plan (the per-call check looks closer only when low bits are set)."""
    offsets = np.zeros(2, np.int32)
    out = poisoned((2, 16, 24), "float32")
    a = np.zeros((16, 0), bf16(np.zeros(1)).dtype)
    b = np.zeros((0, 24), a.dtype)
    gwgrad.grouped_gemm_wgrad(a, b, offsets_tensor=offsets, wgrad_tensor=out)
    assert (out == 0).all()
    empty = from_pointer(0x1003, (16, 0), (1, 16), DType.BFLOAT16, device_type="cpu")
    out[:] = np.nan
    gwgrad.grouped_gemm_wgrad(empty, b, offsets_tensor=offsets, wgrad_tensor=out)
    assert (out == 0).all()


# --- the torch adapter ----------------------------------------------------------------------

def test_torch_adapter_checks_every_address(rng):
    torch = pytest.importorskip("torch")
    import gwgrad.adapters.torch as gwt

    counts = (16, 0, 32)
    x = torch.randn(48, 32, dtype=torch.bfloat16)
    dy = torch.randn(48, 24, dtype=torch.bfloat16)
    offsets = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    out = torch.full((3, 32, 24), float("nan"))
    gwt.wgrad(x, dy, offsets, out=out)
    args = dict(x=("a_tensor", x), dy=("b_tensor", dy), offsets=("offsets_tensor", offsets),
                out=("wgrad_tensor", out))
    for arg, (name, t) in args.items():
        moved = shifted_torch(t, misaligned_shift(name, t.element_size()))
        call = dict(x=x, dy=dy, offsets=offsets, out=out)
        call[arg] = moved
        with pytest.raises(ValueError, match=aligned_message(name, adapter=True)):
            gwt.wgrad(call.pop("x"), call.pop("dy"), call.pop("offsets"), **call)


def test_torch_adapter_fp8_checks_every_scale_address(rng):
    torch = pytest.importorskip("torch")
    import gwgrad.adapters.torch as gwt

    hidden, inter, counts = 32, 48, (48, 0, 16)
    tokens = sum(counts)
    offsets = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    # Token-contiguous FP8 operands (x = xt.T) and per-expert-channel FP32 scales.
    x = torch.randn(hidden, tokens).to(torch.float8_e4m3fn).t()
    dy = torch.randn(inter, tokens).to(torch.float8_e5m2).t()
    sx = torch.rand(3, hidden) + 0.5
    sdy = torch.rand(3, inter) + 0.5
    gx = torch.rand(3) + 0.5
    gdy = torch.rand(3) + 0.5
    out = torch.full((3, hidden, inter), float("nan"))
    call = dict(x=x, dy=dy, offsets=offsets, x_scale=sx, dy_scale=sdy, x_global_scale=gx,
                dy_global_scale=gdy, out=out, scale_recipe="per_expert_channel")
    gwt.wgrad_fp8(**call)
    want = torch.stack([
        (x[b:e].double() * sx[i].double()).T @ (dy[b:e].double() * sdy[i].double())
        * float(gx[i]) * float(gdy[i])
        for i, (b, e) in enumerate(zip([0, 48, 48], [48, 48, 64]))])
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    for arg, name in (("x_scale", "sfa_tensor"), ("dy_scale", "sfb_tensor"),
                      ("x_global_scale", "global_scale_a"), ("dy_global_scale", "global_scale_b"),
                      ("x", "a_tensor")):
        moved = shifted_torch(call[arg], misaligned_shift(name, call[arg].element_size()))
        with pytest.raises(ValueError, match=aligned_message(name, adapter=True)):
            gwt.wgrad_fp8(**dict(call, **{arg: moved}))


# --- the CuPy adapter (NumPy arrays take its path on the CPU) ---------------------------------

def _np_shifted(arr: np.ndarray, shift: int) -> np.ndarray:
    nbytes = _extent_bytes(arr.shape, [s // arr.itemsize for s in arr.strides], arr.itemsize)
    buf = _relocated(arr.ctypes.data, nbytes, shift)
    moved = np.lib.stride_tricks.as_strided(buf.view(arr.dtype), arr.shape, arr.strides)
    assert moved.ctypes.data % 64 == shift
    return moved


def test_cupy_adapter_checks_every_address(rng):
    import ml_dtypes

    import gwgrad.adapters.cupy as gwc

    counts = (48, 0, 16)
    tokens = sum(counts)
    offsets = np.cumsum(counts).astype(np.int32)
    x = gwc.to_bfloat16_bits(rng.standard_normal((tokens, 32)).astype(np.float32))
    dy = gwc.to_bfloat16_bits(rng.standard_normal((tokens, 24)).astype(np.float32))
    out = np.full((3, 32, 24), np.nan, np.float32)
    gwc.wgrad(x, dy, offsets, out=out, dtype="bfloat16")
    for arg, name, arr in (("x", "a_tensor", x), ("dy", "b_tensor", dy),
                           ("offsets", "offsets_tensor", offsets), ("out", "wgrad_tensor", out)):
        call = dict(x=x, dy=dy, offsets=offsets, out=out)
        call[arg] = _np_shifted(arr, misaligned_shift(name, arr.itemsize))
        with pytest.raises(ValueError, match=aligned_message(name, adapter=True)):
            gwc.wgrad(call.pop("x"), call.pop("dy"), call.pop("offsets"), dtype="bfloat16",
                      **call)

    xt = rng.standard_normal((32, tokens)).astype(ml_dtypes.float8_e4m3fn)
    dyt = rng.standard_normal((48, tokens)).astype(ml_dtypes.float8_e4m3fn)
    sx = (rng.random((3, 32)) + 0.5).astype(np.float32)
    sdy = (rng.random((3, 48)) + 0.5).astype(np.float32)
    out = np.full((3, 32, 48), np.nan, np.float32)
    call = dict(x=xt.T, dy=dyt.T, offsets=offsets, x_scale=sx, dy_scale=sdy, out=out,
                scale_recipe="per_expert_channel")
    gwc.wgrad_fp8(**call)
    for arg, name in (("x_scale", "sfa_tensor"), ("dy_scale", "sfb_tensor")):
        moved = _np_shifted(call[arg], misaligned_shift(name, 4))
        with pytest.raises(ValueError, match=aligned_message(name, adapter=True)):
            gwc.wgrad_fp8(**dict(call, **{arg: moved}))
