"""What the CPU tests of the cuDNN-compatible surface share: fake CUDA descriptors of every
format (no GPU: ``gwgrad.from_pointer`` with made-up aligned addresses) and a fixture that
lets the contract's wrapper and class run their CUDA path up to the kernel launch, with the
CuTe DSL backends' compile and launcher replaced by a recorder (the format x architecture
decisions are DSL-free; the kernels' own predicates are not run)."""

from __future__ import annotations

import contextlib
import ctypes
from typing import Dict

import pytest

import gwgrad
from gwgrad import DType, from_pointer, status
from gwgrad.backends import CuteDslBackend
from gwgrad.plan import workspace_bytes_bound

H, N, E, T = 128, 128, 2, 256  # hidden, intermediate, experts, tokens (two experts of 128)
E4M3, E5M2, FP4 = DType.FLOAT8_E4M3FN, DType.FLOAT8_E5M2, DType.FLOAT4_E2M1FN_X2
E8M0, F32, BF16 = DType.FLOAT8_E8M0FNU, DType.FLOAT32, DType.BFLOAT16

ARCHS = ("sm_90a", "sm_100a", "sm_103a")
SM90, SM100 = ("sm_90a",), ("sm_100a", "sm_103a")

_next = [1 << 32]


def cuda(shape, strides=None, dtype=BF16):
    """A CUDA descriptor on device 0 at a fresh 4 KiB-aligned made-up address."""
    _next[0] += 1 << 24
    return from_pointer(_next[0], shape, strides, dtype, 0)


def operands(a_dtype, b_dtype=None, a_major="k", b_major="k"):
    b_dtype = b_dtype or a_dtype
    if a_dtype == FP4:
        a = cuda((H, T // 2), (T // 2, 1), a_dtype)
    else:
        a = cuda((H, T), (T, 1) if a_major == "k" else (1, H), a_dtype)
    if b_dtype == FP4:
        b = cuda((T // 2, N), (1, T // 2), b_dtype)
    else:
        b = cuda((T, N), (1, T) if b_major == "k" else (N, 1), b_dtype)
    return a, b


def blocked_scales(sf, vec):
    """(sfa, sfb) in the blocked layout: (round_up(rows, 128), C) with C the scale columns
    round_up(ceil(T / vec), 4)."""
    cols = (T // vec + 3) // 4 * 4
    return cuda((128, cols), None, sf), cuda((128, cols), None, sf)


def fmt_kwargs(fmt: str) -> Dict:
    """The wrapper's keyword arguments (tensors) of one call in format ``fmt``."""
    kw = dict(offsets_tensor=cuda((E,), None, DType.INT32), wgrad_tensor=cuda((E, H, N), None, F32))
    if fmt == "bf16":
        a, b = operands(BF16, a_major="m", b_major="n")
    elif fmt in ("mxfp8", "mxfp8_m_major"):
        a, b = operands(E4M3, a_major="m" if fmt == "mxfp8_m_major" else "k")
        kw.update(zip(("sfa_tensor", "sfb_tensor"), blocked_scales(E8M0, 32)), sf_vec_size=32)
    elif fmt == "nvfp4":
        a, b = operands(FP4)
        kw.update(zip(("sfa_tensor", "sfb_tensor"), blocked_scales(E4M3, 16)), sf_vec_size=16,
                  global_scale_a=cuda((E,), None, F32), global_scale_b=cuda((E,), None, F32))
    elif fmt == "mxfp4":
        a, b = operands(FP4)
        kw.update(zip(("sfa_tensor", "sfb_tensor"), blocked_scales(E8M0, 32)), sf_vec_size=32)
    elif fmt in ("fp8_channel", "fp8_mixed"):
        a, b = operands(E4M3, E5M2 if fmt == "fp8_mixed" else E4M3)
        kw.update(sfa_tensor=cuda((E, H), None, F32), sfb_tensor=cuda((E, N), None, F32),
                  scale_recipe="per_expert_channel")
    elif fmt == "fp8_1x128":
        a, b = operands(E4M3)
        rows = T // 128 + E
        kw.update(sfa_tensor=cuda((rows, H), None, F32), sfb_tensor=cuda((rows, N), None, F32),
                  scale_recipe="block_1x128", sf_vec_size=128)
    else:
        raise KeyError(fmt)
    kw.update(a_tensor=a, b_tensor=b)
    return kw


def class_kwargs(fmt: str) -> Dict:
    """The class constructor's keyword arguments (samples) of ``fmt_kwargs(fmt)``."""
    names = {"a_tensor": "sample_a", "b_tensor": "sample_b", "sfa_tensor": "sample_sfa",
             "sfb_tensor": "sample_sfb", "offsets_tensor": "sample_offsets",
             "wgrad_tensor": "sample_wgrad", "global_scale_a": "sample_global_scale_a",
             "global_scale_b": "sample_global_scale_b"}
    return {names.get(k, k): v for k, v in fmt_kwargs(fmt).items()}


def execute_kwargs(fmt: str) -> Dict:
    return {k: v for k, v in fmt_kwargs(fmt).items()
            if k not in ("sf_vec_size", "scale_recipe")}


#: Every format x architecture: None where the architecture runs it, else (argument, the
#: architectures that do) of the NotImplementedError.
FORMATS = ("bf16", "mxfp8", "mxfp8_m_major", "nvfp4", "mxfp4", "fp8_channel", "fp8_mixed",
           "fp8_1x128")
TABLE = {
    "bf16": {arch: None for arch in ARCHS},
    "mxfp8": {arch: None for arch in ARCHS},
    "mxfp8_m_major": {"sm_90a": ("a_tensor", SM100), "sm_100a": None, "sm_103a": None},
    "nvfp4": {"sm_90a": ("a_tensor", SM100), "sm_100a": None, "sm_103a": None},
    "mxfp4": {"sm_90a": ("a_tensor", SM100), "sm_100a": None, "sm_103a": None},
    **{fmt: {"sm_90a": None, "sm_100a": ("sfa_tensor", SM90), "sm_103a": ("sfa_tensor", SM90)}
       for fmt in ("fp8_channel", "fp8_mixed", "fp8_1x128")},
}


class Launches:
    """What reached the stand-in kernels: one tuple of launcher arguments per launch."""

    def __init__(self):
        self.calls = []


_record = (ctypes.c_int32 * 32)()


class _Compiled:
    def __init__(self, spec):
        self.spec = spec
        self.workspace_bytes = workspace_bytes_bound(spec.num_experts, spec.output_mode)


@pytest.fixture
def stand_in(monkeypatch):
    """The CuTe DSL backends without the DSL: compile returns a stub of the bound workspace
    size; the launcher records its arguments; a kernel counts as compiled before (so the
    kernel modules' predicates, which import the DSL, are not asked). No CUDA is touched."""
    launches = Launches()
    monkeypatch.setattr(CuteDslBackend, "compile", lambda self, spec: (
        self.check_support(spec), _Compiled(spec))[1])
    monkeypatch.setattr(CuteDslBackend, "compiled_before", lambda self, spec: True)
    monkeypatch.setattr(CuteDslBackend, "workspace_bytes",
                        lambda self, spec: workspace_bytes_bound(spec.num_experts,
                                                                 spec.output_mode))
    monkeypatch.setattr(CuteDslBackend, "launcher",
                        lambda self, compiled, spec, device: (
                            lambda *values: launches.calls.append(values)))
    ctypes.memset(_record, 0, ctypes.sizeof(_record))
    monkeypatch.setattr(status, "_address", ctypes.addressof(_record))
    monkeypatch.setattr(status, "_code", ctypes.c_int32.from_address(ctypes.addressof(_record)))
    monkeypatch.setattr(gwgrad.interop, "workspace", lambda device, stream, nbytes: 0xABC000)
    monkeypatch.setattr(gwgrad.cuda, "stream_is_capturing", lambda stream: False)
    monkeypatch.setattr(gwgrad.cuda, "on_device", lambda device: contextlib.nullcontext())
    launches.memsets = []
    monkeypatch.setattr(gwgrad.cuda, "memset_async",
                        lambda ptr, nbytes, stream: launches.memsets.append((ptr, nbytes)))
    gwgrad.clear_cache()  # plans are keyed by signature, not by CUTE_DSL_ARCH
    yield launches
    gwgrad.clear_cache()
