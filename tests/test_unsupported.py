"""Which exception a call gets, by format x architecture (gwgrad/errors.py), on the CPU with
``CUTE_DSL_ARCH`` and fake CUDA descriptors: a call another architecture runs raises
``NotImplementedError`` (``gwgrad.UnsupportedError``) naming the argument and that
architecture, from the wrapper and from the class's ``check_support()`` (the constructor
accepts it, as cuDNN's callers expect: they wrap only ``check_support()`` in ``except
(ValueError, NotImplementedError)``); a call no kernel runs raises ``ValueError``; an unusable
environment ``RuntimeError``. ``NotImplementedError`` is a ``RuntimeError``, so code written
for gwgrad's earlier errors keeps working."""

from __future__ import annotations

import pytest

import gwgrad
from gwgrad import backends as backends_mod
from gwgrad.errors import ArgumentError, UnsupportedError
from cudnn_cases import (ARCHS, E, FORMATS, H, T, TABLE, class_kwargs, execute_kwargs,
                         fmt_kwargs, stand_in)  # noqa: F401 (a fixture)

CELLS = [(fmt, arch) for fmt in FORMATS for arch in ARCHS]


def test_not_implemented_is_a_runtime_error():
    # Python's own hierarchy: `except RuntimeError` (gwgrad's earlier error for these cases)
    # still catches the new one; `except ValueError` does not.
    assert issubclass(NotImplementedError, RuntimeError)
    assert issubclass(UnsupportedError, NotImplementedError)
    assert not issubclass(UnsupportedError, ValueError)
    assert issubclass(ArgumentError, ValueError) and not issubclass(ArgumentError, RuntimeError)


def _check_unsupported(info, argument, needs, arch, name=None):
    err = info.value
    assert isinstance(err, NotImplementedError) and isinstance(err, RuntimeError)
    assert err.argument == (name or argument) and err.arch == arch and err.needs == needs
    text = str(err)
    assert text.startswith(f"{name or argument}: ") and text.endswith(f"; this is {arch}")
    for wanted in needs:
        assert wanted in text


@pytest.mark.parametrize("fmt,arch", CELLS)
def test_wrapper_by_format_and_arch(fmt, arch, stand_in, monkeypatch):  # noqa: F811
    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    expected = TABLE[fmt][arch]
    if expected is None:
        result = gwgrad.grouped_gemm_wgrad_wrapper_sm100(**fmt_kwargs(fmt))
        assert result["wgrad_tensor"] is not None and len(stand_in.calls) == 1
        return
    with pytest.raises(NotImplementedError) as info:
        gwgrad.grouped_gemm_wgrad_wrapper_sm100(**fmt_kwargs(fmt))
    _check_unsupported(info, *expected, arch)
    assert not stand_in.calls


@pytest.mark.parametrize("fmt,arch", CELLS)
def test_class_by_format_and_arch(fmt, arch, stand_in, monkeypatch):  # noqa: F811
    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    expected = TABLE[fmt][arch]
    op = gwgrad.GroupedGemmWgradSm100(**class_kwargs(fmt))  # never raises for these
    if expected is None:
        assert op.check_support() is True
        op.compile()
        op.execute(**execute_kwargs(fmt))
        assert len(stand_in.calls) == 1
        return
    for _ in range(2):  # every call says so, not only the first
        with pytest.raises(NotImplementedError) as info:
            op.check_support()
        argument, needs = expected
        _check_unsupported(info, argument, needs, arch,
                           name={"a_tensor": "sample_a", "sfa_tensor": "sample_sfa"}[argument])
    with pytest.raises(NotImplementedError):
        op.compile()


def test_fp4_on_sm90_message(stand_in, monkeypatch):  # noqa: F811
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    with pytest.raises(NotImplementedError, match=r"^a_tensor: float4_e2m1fn_x2 \(NVFP4/MXFP4\) "
                                                  r"needs an SM100 GPU \(sm_100a/sm_103a\); "
                                                  r"this is sm_90a$"):
        gwgrad.grouped_gemm_wgrad_wrapper_sm100(**fmt_kwargs("nvfp4"))


def test_cpu_runs_every_format():
    """The reference runs every format, so none of them is unsupported on CPU arrays (the
    descriptors' layouts only: the check, not the arithmetic, matters here)."""
    for fmt in FORMATS:
        kw = fmt_kwargs(fmt)
        cpu = {k: (gwgrad.TensorDesc(v.ptr, v.shape, v.strides, v.dtype, "cpu", 0)
                   if isinstance(v, gwgrad.TensorDesc) else v) for k, v in kw.items()}
        spec = gwgrad.validation.build_spec(
            a=cpu["a_tensor"], b=cpu["b_tensor"], offsets=cpu["offsets_tensor"],
            wgrad=cpu["wgrad_tensor"], sfa=cpu.get("sfa_tensor"), sfb=cpu.get("sfb_tensor"),
            global_scale_a=cpu.get("global_scale_a"), global_scale_b=cpu.get("global_scale_b"),
            sf_vec_size=cpu.get("sf_vec_size", 16), scale_recipe=cpu.get("scale_recipe"))
        assert backends_mod.finalize_spec(spec)[0].arch == "cpu"


def test_layouts_no_gpu_runs_stay_value_errors(stand_in, monkeypatch):  # noqa: F811
    """M/N-major FP8 with FP32 scale factors: no GPU kernel of gwgrad reads it (SM90's FP8
    kernel reads K-major operands; SM100's takes no FP32 scales): a ValueError everywhere."""
    for arch in ARCHS:
        monkeypatch.setenv("CUTE_DSL_ARCH", arch)
        gwgrad.clear_cache()
        kw = fmt_kwargs("fp8_channel")
        kw["a_tensor"] = gwgrad.from_pointer(kw["a_tensor"].ptr, kw["a_tensor"].shape,
                                             (1, kw["a_tensor"].shape[0]), kw["a_tensor"].dtype, 0)
        with pytest.raises(ValueError) as info:
            gwgrad.grouped_gemm_wgrad_wrapper_sm100(**kw)
        assert not isinstance(info.value, NotImplementedError)
        assert str(info.value).startswith("a_tensor: ") and "K-major" in str(info.value)


@pytest.mark.parametrize("arch", ARCHS)
def test_sf_fp8_dtype_override(arch, stand_in, monkeypatch):  # noqa: F811
    """cuDNN's ``sf_fp8_dtype_override``: "e5m3" on NVFP4 is valid and no kernel of gwgrad
    reads UE5M3 scale bytes (NotImplementedError naming it, on every architecture; from the
    class, at check_support); other values, or "e5m3" on other formats, are ValueErrors."""
    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    with pytest.raises(NotImplementedError, match=r"^sf_fp8_dtype_override: 'e5m3' .*UE5M3.*"
                                                  rf"this is {arch}$") as info:
        gwgrad.grouped_gemm_wgrad_wrapper_sm100(**fmt_kwargs("nvfp4"), sf_fp8_dtype_override="e5m3")
    assert info.value.needs == ()
    op = gwgrad.GroupedGemmWgradSm100(**class_kwargs("nvfp4"), sf_fp8_dtype_override="e5m3")
    with pytest.raises(NotImplementedError, match="^sf_fp8_dtype_override: 'e5m3'"):
        op.check_support()
    for fmt, value in (("nvfp4", "e4m3"), ("nvfp4", "E5M3"), ("mxfp8", "e5m3"), ("mxfp4", "e5m3"),
                       ("bf16", "e5m3"), ("nvfp4", 3)):
        with pytest.raises(ValueError, match="^sf_fp8_dtype_override: expected None") as info:
            gwgrad.grouped_gemm_wgrad_wrapper_sm100(**fmt_kwargs(fmt), sf_fp8_dtype_override=value)
        assert not isinstance(info.value, NotImplementedError)
        with pytest.raises(ValueError, match="^sf_fp8_dtype_override: expected None"):
            gwgrad.GroupedGemmWgradSm100(**class_kwargs(fmt), sf_fp8_dtype_override=value)
    # None is the default and changes nothing.
    gwgrad.grouped_gemm_wgrad_wrapper_sm100(**fmt_kwargs("bf16"), sf_fp8_dtype_override=None)
    assert len(stand_in.calls) == 1


def test_e5m3_on_the_cpu_is_not_implemented_either():
    kw = fmt_kwargs("nvfp4")
    cpu = {k: (gwgrad.TensorDesc(v.ptr, v.shape, v.strides, v.dtype, "cpu", 0)
               if isinstance(v, gwgrad.TensorDesc) else v) for k, v in kw.items()}
    with pytest.raises(NotImplementedError, match="this is cpu$"):
        gwgrad.grouped_gemm_wgrad_wrapper_sm100(**cpu, sf_fp8_dtype_override="e5m3")


@pytest.mark.parametrize("capability,arch", [((8, 0), "sm_80"), ((7, 5), "sm_75"),
                                             ((12, 0), "sm_120")])
def test_a_gpu_without_kernels(monkeypatch, capability, arch):
    """A GPU gwgrad has no kernels for is unsupported hardware: NotImplementedError naming
    a_tensor (whose device it is), still a RuntimeError; from the class, at check_support."""
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    monkeypatch.setattr(gwgrad.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gwgrad.cuda, "compute_capability", lambda device: capability)
    backends_mod._arch_of_device.cache_clear()
    gwgrad.clear_cache()
    try:
        with pytest.raises(NotImplementedError) as info:
            backends_mod.detect_arch(0)
        assert info.value.argument == "a_tensor" and info.value.arch == arch
        assert info.value.needs == backends_mod.KNOWN_ARCHS
        with pytest.raises(RuntimeError, match=f"^a_tensor: .*compute capability "
                                               f"{capability[0]}.{capability[1]}"):
            gwgrad.grouped_gemm_wgrad_wrapper_sm100(**fmt_kwargs("bf16"))
        op = gwgrad.GroupedGemmWgradSm100(**class_kwargs("bf16"))
        with pytest.raises(NotImplementedError, match="^sample_a: "):
            op.check_support()
    finally:
        backends_mod._arch_of_device.cache_clear()
        gwgrad.clear_cache()


def test_no_cuda_stays_a_runtime_error(monkeypatch):
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    monkeypatch.setattr(gwgrad.cuda, "device_count", lambda: 0)
    backends_mod._arch_of_device.cache_clear()
    gwgrad.clear_cache()
    try:
        with pytest.raises(RuntimeError) as info:
            gwgrad.grouped_gemm_wgrad_wrapper_sm100(**fmt_kwargs("bf16"))
        assert not isinstance(info.value, NotImplementedError)
    finally:
        backends_mod._arch_of_device.cache_clear()


def test_an_unknown_cute_dsl_arch(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_120a")
    with pytest.raises(NotImplementedError, match=r"^CUTE_DSL_ARCH: 'sm_120a' is not an "
                                                  r"architecture gwgrad has kernels for"):
        backends_mod.detect_arch(0)


def test_execute_before_compile_stays_a_runtime_error(stand_in, monkeypatch):  # noqa: F811
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    op = gwgrad.GroupedGemmWgradSm100(**class_kwargs("bf16"))
    with pytest.raises(RuntimeError, match="compile") as info:
        op.execute(**execute_kwargs("bf16"))
    assert not isinstance(info.value, NotImplementedError)


def test_quantize_names_x_on_a_gpu_without_kernels(monkeypatch):
    """The quantizer reports the same hardware problem under its own argument name."""
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    monkeypatch.setattr(gwgrad.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gwgrad.cuda, "compute_capability", lambda device: (8, 6))
    backends_mod._arch_of_device.cache_clear()
    try:
        x = gwgrad.from_pointer(1 << 32, (T, H), None, gwgrad.DType.BFLOAT16, 0)
        offsets = gwgrad.from_pointer(2 << 32, (E,), None, gwgrad.DType.INT32, 0)
        data = gwgrad.from_pointer(3 << 32, (H, T), None, gwgrad.DType.FLOAT8_E4M3FN, 0)
        scales = gwgrad.from_pointer(4 << 32, (E, H), None, gwgrad.DType.FLOAT32, 0)
        with pytest.raises(NotImplementedError, match="^x: "):
            gwgrad.quantize(x, offsets, "per_expert_channel", data=data, scales=scales)
    finally:
        backends_mod._arch_of_device.cache_clear()
