"""gwgrad.interop.jax without a GPU: the CuTe DSL runtime's JAX custom call targets registered
with ctypes (found, or refused with the library named), the same names and symbols as the
DSL's own registration, and a call of a cached XLA FFI module lowered for CUDA: the target,
the module's bytes and fingerprint as attributes, the aliases and the result types."""

from __future__ import annotations

import ctypes.util
import glob
import hashlib
import os
import sys

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gwgrad import kernel_cache  # noqa: E402
from gwgrad.interop import jax as xla_ffi  # noqa: E402


def _runtime_library():
    """The DSL runtime library of the installed wheel, found without importing the DSL."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    roots = list(spec.submodule_search_locations) if spec else []
    for root in roots:
        found = sorted(glob.glob(os.path.join(root, "*", "lib", "libcute_dsl_runtime.so")))
        if found:
            return found[0]
    return None


@pytest.fixture
def fresh(monkeypatch):
    """No version registered yet in gwgrad.interop.jax, and the DSL's JAX module unseen."""
    monkeypatch.setattr(xla_ffi, "_registered", set())
    monkeypatch.delitem(sys.modules, "cutlass.jax.ffi", raising=False)


def test_the_ffi_version_follows_jax():
    version = xla_ffi.ffi_version()
    assert version == (2 if jax.version.__version_info__ >= (0, 9, 1) else 1)
    assert set(xla_ffi.TARGETS) == {1, 2} and set(xla_ffi.TYPES) == {1, 2}


def test_targets_and_symbols_are_the_dsls():
    """Registered under the DSL's names, from the DSL's symbols: a DSL release that changes
    them fails here, not in a user's XLA."""
    pytest.importorskip("cutlass")
    from cutlass.jax import ffi as dsl_ffi

    assert xla_ffi.TARGETS == dsl_ffi._CUTLASS_CALL_TARGETS
    assert xla_ffi.TYPES == dsl_ffi._CUTLASS_CALL_TYPES
    assert xla_ffi.ffi_version() == dsl_ffi.get_cutlass_call_ffi_version()
    path = _runtime_library()
    assert path is not None and os.path.samefile(path, dsl_ffi.find_cute_dsl_runtime_library())


def test_a_missing_runtime_library_is_named(fresh, tmp_path):
    gone = str(tmp_path / "libcute_dsl_runtime.so")
    with pytest.raises(RuntimeError, match="runtime library .*libcute_dsl_runtime.so.* does "
                                           "not exist"):
        xla_ffi.register_targets(gone, 2)
    assert xla_ffi._registered == set()


def test_a_file_that_is_not_the_runtime_is_refused(fresh, tmp_path):
    fake = tmp_path / "libcute_dsl_runtime.so"
    fake.write_bytes(b"not a shared library")
    with pytest.raises(RuntimeError, match="loading the CuTe DSL runtime library"):
        xla_ffi.register_targets(str(fake), 2)
    libm = ctypes.util.find_library("m")
    path = next((p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib64/libm.so.6")
                 if os.path.exists(p)), None) if libm else None
    if path is None:
        pytest.skip("no libm path to stand in for a library without the symbols")
    with pytest.raises(RuntimeError, match="has no CuteDSLRT_NvJaxCutlassCall"):
        xla_ffi.register_targets(path, 2)
    with pytest.raises(RuntimeError, match="version 3"):
        xla_ffi.register_targets(path, 3)


def test_the_runtime_library_registers_once(fresh, monkeypatch):
    """From the installed runtime with ctypes (no DSL import); a second call is free."""
    path = _runtime_library()
    if path is None:
        pytest.skip("nvidia-cutlass-dsl's runtime library is not installed")
    seen = []
    monkeypatch.setattr(jax.ffi, "register_ffi_target",
                        lambda name, fn, platform: seen.append((name, sorted(fn), platform)))
    monkeypatch.setattr(jax.ffi, "register_ffi_type",
                        lambda name, fn, platform: seen.append((name, sorted(fn), platform)))
    xla_ffi.register_targets(path, 2)
    xla_ffi.register_targets(path, 2)
    assert seen == [
        ("CuteDSLRT_NvJaxCutlassCallTypes_v2", ["type_id", "type_info"], "CUDA"),
        ("CuteDSLRT_NvJaxCutlassCall_v2", ["execute", "instantiate", "prepare"], "CUDA"),
        ("CuteDSLRT_NvJaxCutlassCallNoCudaGraph_v2", ["execute", "instantiate", "prepare"],
         "CUDA"),
    ]
    assert xla_ffi._registered == {2}


def test_real_registration_with_xla(monkeypatch):
    """The handlers and the type really register (pending for CUDA on a CPU-only JAX); the
    process keeps the registration, as after any call (a no-op if one registered already)."""
    path = _runtime_library()
    if path is None:
        pytest.skip("nvidia-cutlass-dsl's runtime library is not installed")
    monkeypatch.delitem(sys.modules, "cutlass.jax.ffi", raising=False)
    xla_ffi.register_targets(path, xla_ffi.ffi_version())
    assert xla_ffi.ffi_version() in xla_ffi._registered


def test_a_cached_module_is_called_with_its_bytes_and_fingerprint(tmp_path, monkeypatch):
    """The custom call a cached module lowers to, on a CPU-only JAX (lowered for CUDA)."""
    runtime = tmp_path / "libcute_dsl_runtime.so"
    runtime.write_bytes(b"stand-in")
    data = b"\x7fELF\x00module"
    meta = {"target": "CuteDSLRT_NvJaxCutlassCall_v2", "ffi_version": 2,
            "results": [[[2, 8], "float32"], [[64], "uint8"], [[16], "int32"]],
            "aliases": [[1, 2]], "input_layouts": [[1, 0], [0]],
            "output_layouts": [[1, 0], [0], [0]], "runtime": str(runtime)}
    module = kernel_cache.XlaModule("k" * 64, data, meta)
    registered = []
    monkeypatch.setattr(xla_ffi, "register_targets",
                        lambda path, version: registered.append((path, version)))

    def f(x):
        block = jnp.asarray(np.arange(16, dtype=np.int32))
        return xla_ffi.call(module, x, block)[0]

    x = jnp.zeros((2, 8), jnp.bfloat16)
    text = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and "@CuteDSLRT_NvJaxCutlassCall_v2" in calls[0]
    assert registered == [(str(runtime), 2)]
    assert "output_operand_aliases" in calls[0] and "operand_index = 1" in calls[0]
    assert calls[0].rstrip().endswith(
        "(tensor<2x8xbf16>, tensor<16xi32>) -> (tensor<2x8xf32>, tensor<64xui8>, "
        "tensor<16xi32>)"), calls[0][-200:]
    assert "module = \"\\7FELF\\00module\"" in calls[0]
    assert module.fingerprint == hashlib.sha256(data).digest()
