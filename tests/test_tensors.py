"""Descriptors from NumPy, raw pointers, torch and JAX CPU arrays, DLPack capsules; streams."""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest

import gwgrad
from gwgrad import DType, TensorDesc, as_tensor_desc, from_dlpack, from_pointer
from gwgrad.interop.dlpack import _exports, export_dlpack
from gwgrad.interop import resolve_stream, stream_handle


def test_numpy_contiguous_and_strided():
    x = np.random.default_rng(np.random.randint(1 << 31)).standard_normal((6, 8)).astype(np.float32)
    d = as_tensor_desc(x, "x")
    assert (d.ptr, d.shape, d.strides, d.dtype) == (x.ctypes.data, (6, 8), (8, 1), DType.FLOAT32)
    assert (d.device_type, d.framework, d.owner is x, d.read_only) == ("cpu", "numpy", True, False)
    t = as_tensor_desc(x.T, "x")
    assert (t.shape, t.strides, t.ptr) == ((8, 6), (1, 8), x.ctypes.data)
    s = as_tensor_desc(x[1:, ::2], "x")
    assert (s.shape, s.strides, s.ptr) == ((5, 4), (8, 2), x.ctypes.data + 8 * 4)
    assert not s.is_contiguous() and d.is_contiguous()


@pytest.mark.parametrize("ml,dtype", [(ml_dtypes.bfloat16, DType.BFLOAT16),
                                      (ml_dtypes.float8_e4m3fn, DType.FLOAT8_E4M3FN),
                                      (ml_dtypes.float8_e5m2, DType.FLOAT8_E5M2),
                                      (ml_dtypes.float8_e8m0fnu, DType.FLOAT8_E8M0FNU)])
def test_numpy_ml_dtypes(ml, dtype):
    x = np.ones((4, 4), dtype=ml)
    assert as_tensor_desc(x, "x").dtype == dtype


def test_numpy_unpacked_fp4_is_rejected_with_a_hint():
    with pytest.raises(ValueError, match="^x: .*packed two values per byte"):
        as_tensor_desc(np.ones(4, dtype=ml_dtypes.float4_e2m1fn), "x")


def test_numpy_read_only():
    x = np.zeros(4, np.float32)
    x.flags.writeable = False
    assert as_tensor_desc(x, "x").read_only


def test_numpy_through_dlpack_capsule():
    x = np.arange(24, dtype=np.int64).reshape(4, 6)[:, 1::2]
    d = from_dlpack(x, "x")
    assert (d.ptr, d.shape, d.strides, d.dtype, d.device_type) == \
        (x.ctypes.data, (4, 3), (6, 2), DType.INT64, "cpu")
    assert d.owner is x


def test_raw_pointer():
    mem = np.zeros(64, np.uint16)
    d = from_pointer(mem.ctypes.data, (4, 8), (1, 4), "bfloat16", device_type="cpu", owner=mem)
    assert (d.shape, d.strides, d.dtype, d.framework) == ((4, 8), (1, 4), DType.BFLOAT16, None)
    c = from_pointer(0x7F0000000000, (3, 5), None, DType.FLOAT32, 2)
    assert (c.strides, c.device, c.is_cuda) == ((5, 1), "cuda:2", True)
    assert as_tensor_desc(c, "x") is c


@pytest.mark.parametrize("kwargs,needle", [
    (dict(ptr=-1), "non-negative integer address"),
    (dict(ptr=1.5), "non-negative integer address"),
    (dict(shape=(2, -1)), "non-negative sizes"),
    (dict(strides=(1,)), "2 strides"),
    (dict(dtype="float128"), "dtype"),
    (dict(device_id=-1), "device ordinal"),
])
def test_raw_pointer_errors(kwargs, needle):
    args = dict(ptr=4096, shape=(2, 3), strides=None, dtype="float32", device_id=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=needle):
        from_pointer(args.pop("ptr"), args.pop("shape"), args.pop("strides"), args.pop("dtype"),
                     args.pop("device_id"), name="a_tensor")


def _torch():
    return pytest.importorskip("torch")


def test_torch_fast_path_bf16_and_views():
    torch = _torch()
    x = torch.randn(10, 16, dtype=torch.bfloat16)
    d = as_tensor_desc(x.T, "a_tensor")
    assert (d.shape, d.strides, d.dtype, d.ptr) == ((16, 10), (1, 16), DType.BFLOAT16, x.data_ptr())
    assert (d.framework, d.device_type, d.owner is not None) == ("torch", "cpu", True)
    s = as_tensor_desc(x[2:], "a_tensor")
    assert s.ptr == x.data_ptr() + 2 * 16 * 2
    for tdt, dt in [(torch.float8_e4m3fn, DType.FLOAT8_E4M3FN), (torch.float8_e5m2, DType.FLOAT8_E5M2),
                    (torch.float8_e8m0fnu, DType.FLOAT8_E8M0FNU),
                    (torch.float4_e2m1fn_x2, DType.FLOAT4_E2M1FN_X2), (torch.int32, DType.INT32)]:
        assert as_tensor_desc(torch.empty(4, 4, dtype=torch.uint8).view(tdt), "x").dtype == dt
    with pytest.raises(ValueError, match="^x: unsupported dtype"):
        as_tensor_desc(torch.zeros(3, dtype=torch.complex64), "x")


def test_torch_through_dlpack_matches_fast_path():
    torch = _torch()
    for tdt in (torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.float8_e4m3fn,
                torch.float8_e5m2, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2, torch.uint8):
        base = torch.empty(12, 8, dtype=torch.uint8).view(tdt) if tdt.itemsize == 1 else \
            torch.empty(12, 8, dtype=tdt)
        view = base[1:, 2:].T
        fast = as_tensor_desc(view, "x")
        slow = from_dlpack(view, "x")
        assert (slow.ptr, slow.shape, slow.strides, slow.dtype, slow.device_type) == \
            (fast.ptr, fast.shape, fast.strides, fast.dtype, fast.device_type), tdt


def test_jax_cpu_arrays():
    jnp = pytest.importorskip("jax.numpy")
    x = jnp.arange(32, dtype=jnp.bfloat16).reshape(4, 8)
    d = as_tensor_desc(x, "a_tensor")
    assert (d.shape, d.strides, d.dtype, d.device_type, d.framework) == \
        ((4, 8), (8, 1), DType.BFLOAT16, "cpu", "jax")
    host = np.asarray(x)
    raw = np.frombuffer((np.ctypeslib.as_array(
        (np.ctypeslib.ctypes.c_uint16 * 32).from_address(d.ptr))).tobytes(), np.uint16)
    assert np.array_equal(raw, host.view(np.uint16).reshape(-1))
    assert as_tensor_desc(jnp.zeros(5, jnp.int32), "offsets_tensor").dtype == DType.INT32


def test_jax_end_to_end_on_cpu():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    key = jax.random.PRNGKey(np.random.default_rng(np.random.randint(1 << 31)).integers(1 << 30))
    kx, kd = jax.random.split(key)
    x = jax.random.normal(kx, (40, 16), jnp.bfloat16)
    dy = jax.random.normal(kd, (40, 24), jnp.bfloat16)
    offsets = jnp.array([8, 8, 40], jnp.int32)
    (w,) = gwgrad.grouped_gemm_wgrad(x.T, dy, offsets_tensor=offsets, wgrad_dtype="float32")
    assert isinstance(w, np.ndarray)  # JAX arrays are immutable: a CPU output is NumPy
    xf, df = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    want = np.stack([xf[:8].T @ df[:8], np.zeros((16, 24)), xf[8:].T @ df[8:]])
    np.testing.assert_allclose(w, want, rtol=1e-6, atol=1e-5)


class _HostArray:
    """A CPU array exported through gwgrad's own DLPack writer."""

    def __init__(self, array, versioned):
        self.array, self.versioned = array, versioned

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        a = self.array
        return export_dlpack(a, a.ctypes.data, a.shape, tuple(s // a.itemsize for s in a.strides),
                             as_tensor_desc(a, "x").dtype, "cpu", 0,
                             self.versioned and max_version is not None)


@pytest.mark.parametrize("versioned", [False, True])
def test_dlpack_export_consumed_by_numpy_torch_and_gwgrad(versioned):
    a = np.random.default_rng(np.random.randint(1 << 31)).standard_normal((3, 4)).astype(np.float32)
    before = len(_exports)
    np_view = np.from_dlpack(_HostArray(a, versioned))
    assert np.shares_memory(np_view, a) and np.array_equal(np_view, a)
    torch = _torch()
    t = torch.from_dlpack(_HostArray(a, versioned))
    assert t.data_ptr() == a.ctypes.data and torch.equal(t, torch.from_numpy(a))
    d = from_dlpack(_HostArray(a, versioned), "x")
    assert (d.ptr, d.shape, d.strides, d.dtype) == (a.ctypes.data, (3, 4), (4, 1), DType.FLOAT32)
    del np_view, t, d
    gc.collect()
    assert len(_exports) == before  # every export's deleter ran


def test_dlpack_export_bf16_to_torch():
    torch = _torch()
    bits = np.random.default_rng(np.random.randint(1 << 31)).standard_normal(8).astype(ml_dtypes.bfloat16)
    t = torch.from_dlpack(_HostArray(bits, True))
    assert t.dtype == torch.bfloat16
    assert np.array_equal(t.float().numpy(), bits.astype(np.float32))


def test_unexported_capsule_is_released():
    a = np.zeros(4, np.float32)
    before = len(_exports)
    capsule = export_dlpack(a, a.ctypes.data, (4,), (1,), DType.FLOAT32, "cpu", 0, False)
    assert len(_exports) == before + 1
    del capsule
    gc.collect()
    assert len(_exports) == before


# --- streams ------------------------------------------------------------------------------------

class _ProtocolStream:
    def __cuda_stream__(self):
        return (0, 0xABC0)


class _TorchLikeStream:
    cuda_stream = 0x1230


class _CupyLikeStream:
    ptr = 0x4560


def test_stream_handles():
    assert stream_handle(0) == 0 and stream_handle(0x10) == 0x10
    assert stream_handle(_ProtocolStream()) == 0xABC0
    assert stream_handle(_TorchLikeStream()) == 0x1230
    assert stream_handle(_CupyLikeStream()) == 0x4560
    assert resolve_stream(None, None, 0) == 0
    assert resolve_stream(7, "torch", 0) == 7
    from cuda.bindings import driver

    assert stream_handle(driver.CUstream(0x789)) == 0x789
    with pytest.raises(ValueError, match="^current_stream:"):
        stream_handle(-1)
    with pytest.raises(ValueError, match="^current_stream:"):
        stream_handle("default")


def test_tensor_desc_is_hashable_and_compares_without_owner():
    a = from_pointer(4096, (2, 2), None, DType.FLOAT32, owner=object())
    b = from_pointer(4096, (2, 2), None, DType.FLOAT32, owner=object())
    assert a == b and hash(a) == hash(b)
    assert isinstance(a, TensorDesc) and gwgrad.TensorDesc is TensorDesc
