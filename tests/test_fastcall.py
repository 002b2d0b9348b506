"""gwgrad.backends._fastcall.PackedLauncher without a GPU: a host-only CuTe DSL function with
the kernels' entry signature (five pointers, two Int32, a stream) writes the values it
received into host memory; PackedLauncher's call must deliver exactly what the DSL's does."""

from __future__ import annotations

import numpy as np
import pytest

cutlass = pytest.importorskip("cutlass")

import cuda.bindings.driver as cuda_driver  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32  # noqa: E402
from cutlass.cute.runtime import make_ptr  # noqa: E402

from gwgrad.backends._fastcall import PackedLauncher, PackingMismatch  # noqa: E402


@cute.jit
def _entry(a: cute.Pointer, b: cute.Pointer, offsets: cute.Pointer, c: cute.Pointer,
           workspace: cute.Pointer, tokens_sum: Int32, grid_size: Int32,
           stream: cuda_driver.CUstream):
    # `offsets` points at host memory here: record what arrived.
    seen = cute.make_tensor(offsets, cute.make_layout(6))
    seen[0] = tokens_sum
    seen[1] = grid_size
    seen[2] = Int32(a.toint() & 0xFFFFFF)
    seen[3] = Int32(b.toint() & 0xFFFFFF)
    seen[4] = Int32(c.toint() & 0xFFFFFF)
    seen[5] = Int32(workspace.toint() & 0xFFFFFF)


def _ptr(dtype, address, align):
    return make_ptr(dtype, address, cute.AddressSpace.generic, assumed_align=align)


def _samples(seen_address):
    return [_ptr(cutlass.BFloat16, 0x10, 16), _ptr(cutlass.BFloat16, 0x20, 16),
            _ptr(cutlass.Int32, seen_address, 4), _ptr(cutlass.Float32, 0x30, 16),
            _ptr(cutlass.Uint8, 0x80, 128)]


@pytest.fixture(scope="module")
def compiled():
    return cute.compile(_entry, *_samples(16), Int32(0), Int32(1), cuda_driver.CUstream(0),
                        options="--gpu-arch sm_90a")


def test_packed_launch_delivers_what_the_dsl_call_does(compiled):
    by_dsl = np.zeros(6, np.int32)
    compiled(*_samples(by_dsl.ctypes.data)[:2], _ptr(cutlass.Int32, by_dsl.ctypes.data, 4),
             _ptr(cutlass.Float32, 0x1230, 16), _ptr(cutlass.Uint8, 0x4500, 128), 4096, 132,
             cuda_driver.CUstream(0))
    launcher = PackedLauncher(compiled, 5, 2, None, _samples(by_dsl.ctypes.data))
    packed = np.zeros(6, np.int32)
    launcher(0x10, 0x20, packed.ctypes.data, 0x1230, 0x4500, 4096, 132, 0)
    np.testing.assert_array_equal(packed, by_dsl)
    np.testing.assert_array_equal(packed[:2], [4096, 132])
    again = np.zeros(6, np.int32)  # new values each call
    launcher(0x40, 0x50, again.ctypes.data, 0x60, 0x80, 7, 3, 0)
    np.testing.assert_array_equal(again, [7, 3, 0x40, 0x50, 0x60, 0x80])


def test_a_different_signature_is_refused(compiled):
    with pytest.raises(PackingMismatch):
        PackedLauncher(compiled, 5, 1, None, _samples(16))  # the function takes two Int32
    with pytest.raises(ValueError, match="sample_pointers"):
        PackedLauncher(compiled, 5, 2, None, _samples(16)[:3])
