"""DeviceBuffer, workspaces, output allocation for raw CUDA pointers and the host-side offsets
check of device memory, against a stand-in for the CUDA runtime that serves host memory (no
GPU needed)."""

from __future__ import annotations

import contextlib
import ctypes
import gc

import numpy as np
import pytest

import gwgrad
from gwgrad import DType, as_tensor_desc, from_pointer
from gwgrad.interop import buffer as memory
from gwgrad import backends as backends_mod
from gwgrad.offsets import check_values
from gwgrad.validation import build_spec


class FakeRuntime:
    """Host memory in place of device memory; records what gwgrad asked of CUDA."""

    def __init__(self):
        self.blocks, self.freed, self.copies, self.syncs = {}, [], [], []
        self.capturing = False

    def malloc(self, nbytes, device_id=0):
        block = ctypes.create_string_buffer(b"\xa5" * (nbytes + 256))  # not zeroed, as cudaMalloc
        ptr = (ctypes.addressof(block) + 255) // 256 * 256  # cudaMalloc's alignment
        self.blocks[ptr] = block
        return ptr

    def memset(self, ptr, nbytes, device_id=0):
        ctypes.memset(ptr, 0, nbytes)

    def free(self, ptr, device_id=0):
        self.freed.append(ptr)
        self.blocks.pop(ptr, None)

    def memcpy_d2h(self, dst, src, nbytes, stream):
        self.copies.append(("d2h", nbytes, stream))
        ctypes.memmove(dst, src, nbytes)

    def memcpy_h2d(self, dst, src, nbytes, stream):
        self.copies.append(("h2d", nbytes, stream))
        ctypes.memmove(dst, src, nbytes)

    def synchronize(self, stream):
        self.syncs.append(stream)

    def stream_is_capturing(self, stream):
        return self.capturing


@pytest.fixture
def fake_cuda(monkeypatch):
    rt = FakeRuntime()
    for name in ("malloc", "free", "memset", "memcpy_d2h", "memcpy_h2d", "synchronize",
                 "stream_is_capturing"):
        monkeypatch.setattr(gwgrad.cuda, name, getattr(rt, name))
    monkeypatch.setattr(gwgrad.cuda, "on_device", lambda device_id: contextlib.nullcontext())
    monkeypatch.setattr(memory, "_workspaces", {})
    return rt


def test_device_buffer_exports_and_frees_itself(fake_cuda):
    buf = memory.DeviceBuffer((3, 8), "bfloat16", device_id=0)
    assert buf.ptr in fake_cuda.blocks and buf.nbytes == 48
    cai = buf.__cuda_array_interface__
    assert cai["shape"] == (3, 8) and cai["data"] == (buf.ptr, False) and cai["typestr"] == "|V2"
    assert memory.DeviceBuffer((4,), "float32").__cuda_array_interface__["typestr"] == "<f4"
    d = as_tensor_desc(buf, "wgrad_tensor")  # through its DLPack capsule
    assert (d.ptr, d.shape, d.strides, d.dtype, d.device) == \
        (buf.ptr, (3, 8), (8, 1), DType.BFLOAT16, "cuda:0")
    assert buf.__dlpack_device__() == (2, 0)
    with pytest.raises(BufferError):
        buf.__dlpack__(copy=True)
    ptr = buf.ptr
    del buf, d
    gc.collect()
    assert ptr in fake_cuda.freed


def test_workspace_is_cached_per_stream_and_grows(fake_cuda):
    assert memory.workspace(0, 7, 0) == 0
    first = memory.workspace(0, 7, 1000)
    # Zero-filled when allocated: single-launch kernels need their grid-barrier words zero.
    assert ctypes.string_at(first, 1000) == bytes(1000)
    assert memory.workspace(0, 7, 500) == first  # reused
    other = memory.workspace(0, 8, 1000)
    assert other != first  # another stream, another buffer
    grown = memory.workspace(0, 7, 5 << 20)
    assert ctypes.string_at(grown, 5 << 20) == bytes(5 << 20)
    gc.collect()
    assert grown != first and first in fake_cuda.freed
    memory.release_workspaces()


def _cuda_problem(fake_cuda, values, tokens):
    offsets = np.array(values, dtype=np.int32)
    dev = fake_cuda.malloc(offsets.nbytes)
    ctypes.memmove(dev, offsets.ctypes.data, offsets.nbytes)
    return from_pointer(dev, offsets.shape, None, DType.INT32, 0)


def _spec(experts=3, **changes):
    def d(shape, strides=None, dtype=DType.BFLOAT16):
        return from_pointer(1 << 20, shape, strides, dtype)

    kw = dict(a=d((64, 256), (1, 64)), b=d((256, 128), (128, 1)),
              offsets=d((experts,), None, DType.INT32), wgrad=d((experts, 64, 128)), arch="sm_90a")
    kw.update(changes)
    return build_spec(**kw)


def test_offsets_checked_by_one_device_copy_in_eager_mode(fake_cuda):
    spec = _spec()
    good = _cuda_problem(fake_cuda, [100, 100, 256], 256)
    assert check_values(spec, good, 256, stream=11) is True
    assert fake_cuda.copies == [("d2h", 12, 11)] and fake_cuda.syncs == [11]
    bad = _cuda_problem(fake_cuda, [100, 90, 256], 256)
    with pytest.raises(ValueError, match="^offsets_tensor: expected non-decreasing"):
        check_values(spec, bad, 256, stream=11)


def test_pointer_values_checked_with_the_offsets(fake_cuda):
    spec = _spec(output_mode="discrete", wgrad=None)
    offsets = _cuda_problem(fake_cuda, [0, 0, 256], 256)
    ptrs = np.array([4096, 8192, 8200], dtype=np.int64)
    dev = fake_cuda.malloc(ptrs.nbytes)
    ctypes.memmove(dev, ptrs.ctypes.data, ptrs.nbytes)
    with pytest.raises(ValueError, match=r"^wgrad_ptrs: .*wgrad_ptrs\[2\] = 0x2008"):
        check_values(spec, offsets, 256, from_pointer(dev, (3,), None, DType.INT64), stream=3)
    assert len(fake_cuda.syncs) == 1  # two copies, one synchronization


def test_stream_capture_skips_the_copy(fake_cuda):
    fake_cuda.capturing = True
    bad = _cuda_problem(fake_cuda, [100, 90, 256], 256)
    assert check_values(_spec(), bad, 256, stream=11) is False
    assert fake_cuda.copies == [] and fake_cuda.syncs == []


class Recorder(gwgrad.Backend):
    def __init__(self):
        self.calls = []

    def check_support(self, spec):
        pass

    def workspace_bytes(self, spec):
        return 4096

    def compile(self, spec):
        return spec

    def launch(self, compiled, spec, args):
        self.calls.append(args)


def test_raw_pointer_inputs_get_device_buffers_and_a_pointer_array(fake_cuda, monkeypatch):
    rec = Recorder()
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setitem(backends_mod._instances, ("gwgrad.backends.bf16_sm90", "Bf16Sm90Backend"), rec)
    h, n, tokens = 64, 128, 256
    a = from_pointer(fake_cuda.malloc(h * tokens * 2), (h, tokens), (1, h), "bfloat16")
    b = from_pointer(fake_cuda.malloc(n * tokens * 2), (tokens, n), (n, 1), "bfloat16")
    offsets = _cuda_problem(fake_cuda, [56, 56, 256], tokens)

    (dense,) = gwgrad.grouped_gemm_wgrad(a, b, offsets_tensor=offsets, wgrad_dtype="float32",
                                         current_stream=5, validate_offsets=True)
    assert isinstance(dense, memory.DeviceBuffer) and dense.shape == (3, h, n)
    args = rec.calls[-1]
    assert args.wgrad.ptr == dense.ptr and args.wgrad.dtype == DType.FLOAT32
    assert args.workspace != 0 and args.stream == 5 and args.tokens_sum == tokens
    assert ("d2h", 12, 5) in fake_cuda.copies  # the host check asked for
    copies = len(fake_cuda.copies)
    gwgrad.grouped_gemm_wgrad(a, b, offsets_tensor=offsets, wgrad_dtype="float32",
                              current_stream=5)
    assert len(fake_cuda.copies) == copies  # by default: no copy, no synchronization

    (stacked,) = gwgrad.grouped_gemm_wgrad(a, b, offsets_tensor=offsets, output_mode="discrete",
                                           current_stream=5, validate_offsets=False)
    args = rec.calls[-1]
    ptrs = np.ctypeslib.as_array((ctypes.c_int64 * 3).from_address(args.wgrad_ptrs.ptr))
    step = h * n * 2
    assert ptrs.tolist() == [stacked.ptr, stacked.ptr + step, stacked.ptr + 2 * step]
    assert args.wgrad_ptrs.is_cuda and args.wgrad is None
