"""On the GPU: a misaligned view on the cached call path raises before anything is enqueued,
and a misaligned per-expert output address fails the device-side check (nothing written,
reported naming ``wgrad_ptrs``). The CPU half of these checks is tests/test_alignment.py."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import gwgrad
from gwgrad import DType
from test_reference_scaled import build

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

TORCH = {DType.FLOAT8_E4M3FN: torch.float8_e4m3fn, DType.FLOAT8_E5M2: torch.float8_e5m2,
         DType.FLOAT8_E8M0FNU: torch.float8_e8m0fnu, DType.FLOAT32: torch.float32,
         DType.INT32: torch.int32}


def to_cuda(value, name: str):
    """A CUDA tensor with ``value``'s bytes and layout (a CPU TensorDesc or NumPy array)."""
    desc = gwgrad.as_tensor_desc(value, name)
    strides = desc.strides or tuple(int(np.prod(desc.shape[i + 1:])) for i in range(desc.ndim))
    extent = 1 + sum((n - 1) * s for n, s in zip(desc.shape, strides))
    raw = ctypes.string_at(desc.ptr, extent * desc.dtype.itemsize)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8).cuda()
    return flat.view(TORCH[desc.dtype]).as_strided(desc.shape, strides)


def rel_error(got, want) -> float:
    want = torch.as_tensor(want, device=got.device)
    return float((got.double() - want).norm() / want.norm())


def test_misaligned_scale_view_on_the_cached_path_raises(rng):
    """The reproduction: MXFP8 through the contract's wrapper, once aligned (correct), then the
    same call with ``sfa_tensor`` a view one byte into a fresh buffer."""
    case = build(rng, "blocked", "e4m3", "e4m3", (64, 0, 96), hidden=256, inter=256,
                 sf_fmt="e8m0")
    tensors = ("a_tensor", "b_tensor", "sfa_tensor", "sfb_tensor", "offsets_tensor")
    kw = {k: to_cuda(case.kwargs[k], k) for k in tensors}
    out = torch.full(case.expected.shape, float("nan"), device="cuda")
    call = dict(kw, wgrad_tensor=out, sf_vec_size=32)
    gwgrad.grouped_gemm_wgrad_wrapper_sm100(**call)
    torch.cuda.synchronize()
    assert rel_error(out, case.expected) < 1e-3
    plans = gwgrad.cache_info()["plans"]

    sfa = kw["sfa_tensor"]
    n = sfa.numel()
    raw = torch.zeros(n + 32, dtype=torch.uint8, device="cuda")
    sfa2 = raw[1:1 + n].view(sfa.shape).view(torch.float8_e8m0fnu)
    sfa2.copy_(sfa)
    out.fill_(float("nan"))
    with pytest.raises(ValueError, match=r"^sfa_tensor: expected a 16-byte aligned base "
                                         r"address, got 0x[0-9a-f]*1$"):
        gwgrad.grouped_gemm_wgrad_wrapper_sm100(**dict(call, sfa_tensor=sfa2))
    torch.cuda.synchronize()
    gwgrad.check_errors()  # nothing was enqueued, nothing recorded
    assert torch.isnan(out).all()
    assert gwgrad.cache_info()["plans"] == plans  # it was the cached path

    # The same bytes at an aligned address: the cached plan runs them, correctly.
    sfa3 = raw[16:16 + n].view(sfa.shape).view(torch.float8_e8m0fnu)
    sfa3.copy_(sfa)
    gwgrad.grouped_gemm_wgrad_wrapper_sm100(**dict(call, sfa_tensor=sfa3))
    torch.cuda.synchronize()
    assert rel_error(out, case.expected) < 1e-3


@pytest.mark.parametrize("bad", ["null", "misaligned"])
def test_misaligned_output_pointer_writes_nothing_and_is_reported(rng, bad):
    """Discrete output through the wrapper with a device array of addresses: one invalid
    address and the launch writes no expert's output; the error names wgrad_ptrs."""
    counts = [96, 0, 160]
    hidden, inter = 128, 256
    x = torch.randn(sum(counts), hidden, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(sum(counts), inter, device="cuda", dtype=torch.bfloat16)
    offsets = torch.tensor(np.cumsum(counts), dtype=torch.int32, device="cuda")
    outs = [torch.full((hidden, inter), float("nan"), device="cuda") for _ in counts]
    spare = torch.full((hidden * inter + 4,), float("nan"), device="cuda")
    ptrs = torch.tensor([o.data_ptr() for o in outs], dtype=torch.int64, device="cuda")
    call = dict(a_tensor=x.t(), b_tensor=dy, offsets_tensor=offsets, output_mode="discrete",
                wgrad_ptrs=ptrs, wgrad_dtype="float32")
    gwgrad.grouped_gemm_wgrad(**call)
    torch.cuda.synchronize()
    gwgrad.check_errors()
    for o in outs:
        o.fill_(float("nan"))
    address = 0 if bad == "null" else spare.data_ptr() + 4
    ptrs[2] = address
    gwgrad.grouped_gemm_wgrad(**call)  # the same plan: the host cannot see inside ptrs
    with pytest.raises(ValueError, match=rf"^wgrad_ptrs: expected a non-null, 16-byte aligned "
                                         rf"address per expert, got wgrad_ptrs\[2\] = "
                                         rf"{address:#x} \(found by the device-side check"):
        gwgrad.check_errors()
    assert all(torch.isnan(o).all() for o in outs) and torch.isnan(spare).all()

    ptrs[2] = outs[2].data_ptr()
    gwgrad.grouped_gemm_wgrad(**call)
    torch.cuda.synchronize()
    gwgrad.check_errors()
    begin = 0
    for o, c in zip(outs, counts):
        want = x[begin:begin + c].double().T @ dy[begin:begin + c].double()
        begin += c
        if c:
            assert rel_error(o, want) < 1e-5
        else:
            assert (o == 0).all()
