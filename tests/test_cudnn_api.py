"""cuDNN frontend 1.32's grouped wgrad API (``cudnn/gemm/cutedsl/grouped/wgrad/``), stated here
in gwgrad's words, against gwgrad's names: the signatures of the wrapper, the class, its
``execute``, the workspace size function and the JAX entry, and the behaviours a caller of
cuDNN relies on. A cuDNN release that changes them should change this file first: then the
difference is a decision, not a user's surprise.

The tables are written by hand from cuDNN frontend 1.32 (nothing of cuDNN is imported).
``REQUIRED`` marks a parameter without a default. gwgrad may add parameters (keyword-only,
so no positional call shifts) and give defaults where cuDNN has none; where a default differs,
``DEVIATIONS`` says why.
"""

from __future__ import annotations

import inspect

import pytest

import gwgrad
from gwgrad import DType
from gwgrad.dtypes import as_dtype
from cudnn_cases import (ARCHS, E, FORMATS, TABLE, class_kwargs, cuda, execute_kwargs,
                         fmt_kwargs, stand_in)  # noqa: F401 (a fixture)

REQUIRED = object()
POS, KW = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY

#: cuDNN 1.32 ``GroupedGemmWgradSm100.__init__`` (after self).
CLASS_INIT = [
    ("sample_a", POS, REQUIRED), ("sample_b", POS, REQUIRED), ("sample_sfa", POS, REQUIRED),
    ("sample_sfb", POS, REQUIRED), ("sample_offsets", POS, REQUIRED),
    ("sample_wgrad", POS, None), ("sample_wgrad_expert", POS, None), ("num_experts", POS, None),
    ("wgrad_shape", POS, None), ("wgrad_dtype", POS, None),
    ("sample_global_scale_a", POS, None), ("sample_global_scale_b", POS, None),
    ("acc_dtype", POS, None), ("mma_tiler_mn", POS, (256, 256)),
    ("cluster_shape_mn", POS, None), ("sf_vec_size", POS, 16),
    ("sf_fp8_dtype_override", POS, None), ("accumulate_on_output", POS, False),
    ("input_order", POS, "tensor2d"),
]
#: cuDNN 1.32 ``GroupedGemmWgradSm100.execute`` (after self).
EXECUTE = [
    ("a_tensor", POS, REQUIRED), ("b_tensor", POS, REQUIRED), ("sfa_tensor", POS, REQUIRED),
    ("sfb_tensor", POS, REQUIRED), ("offsets_tensor", POS, REQUIRED),
    ("wgrad_tensor", POS, None), ("wgrad_ptrs", POS, None), ("global_scale_a", POS, None),
    ("global_scale_b", POS, None), ("current_stream", POS, None),
    ("descriptor_workspace", KW, None),
]
#: cuDNN 1.32 ``grouped_gemm_wgrad_wrapper_sm100``.
WRAPPER = [
    ("a_tensor", POS, REQUIRED), ("b_tensor", POS, REQUIRED), ("sfa_tensor", POS, REQUIRED),
    ("sfb_tensor", POS, REQUIRED), ("offsets_tensor", POS, REQUIRED),
    ("output_mode", POS, "dense"), ("wgrad_tensor", POS, None), ("wgrad_ptrs", POS, None),
    ("global_scale_a", POS, None), ("global_scale_b", POS, None), ("acc_dtype", POS, None),
    ("wgrad_dtype", POS, None), ("mma_tiler_mn", POS, (256, 256)),
    ("cluster_shape_mn", POS, None), ("sf_vec_size", POS, 16),
    ("sf_fp8_dtype_override", POS, None), ("accumulate_on_output", POS, False),
    ("input_order", POS, "tensor2d"), ("current_stream", POS, None),
    ("descriptor_workspace", KW, None),
]
#: cuDNN 1.32 ``get_grouped_gemm_wgrad_workspace_size_sm100``.
WORKSPACE_SIZE = [
    ("num_experts", POS, REQUIRED), ("output_mode", KW, "dense"), ("input_order", KW, "tensor2d"),
]
#: cuDNN 1.32 ``grouped_gemm_wgrad_jax_sm100`` (an XLA custom call).
JAX_ENTRY = [
    ("a_tensor", POS, REQUIRED), ("b_tensor", POS, REQUIRED), ("offsets_tensor", POS, REQUIRED),
    ("wgrad_ptrs", POS, None), ("wgrad_dtype", POS, "bfloat16"), ("acc_dtype", POS, "float32"),
    ("mma_tiler_mn", POS, (256, 256)), ("cluster_shape_mn", POS, None),
    ("accumulate_on_output", POS, False), ("input_order", POS, "tensor2d"),
    ("sfa_tensor", KW, None), ("sfb_tensor", KW, None), ("global_scale_a", KW, None),
    ("global_scale_b", KW, None), ("sf_vec_size", KW, 32),
]

#: Defaults gwgrad gives differently, and why. (A parameter cuDNN requires and gwgrad makes
#: optional is not a deviation: every cuDNN call still binds.)
DEVIATIONS = {
    # cuDNN's default is its SM100 kernel's 2-CTA tile; gwgrad picks per architecture and
    # problem (the same tile on SM100 for wide outputs; SM90 has no 256-row tile).
    "mma_tiler_mn": None,
    # cuDNN's None means FP32; gwgrad spells it out (None is accepted and means FP32 too).
    "acc_dtype": DType.FLOAT32,
}

#: gwgrad's own additions (keyword-only): what they are for.
EXTRAS = {
    "output_mode": "the class: dense / discrete without guessing from the samples",
    "validate_offsets": "check the offsets on the host too (one synchronization)",
    "scale_recipe": "FP8 with FP32 scale factors (per_expert_channel, block_1x128)",
}


def _same_default(ours, theirs) -> bool:
    if ours is theirs or ours == theirs:
        return True
    if theirs in ("bfloat16", "float32") and ours is not None:
        return as_dtype(ours) == as_dtype(theirs)  # cuDNN's cutlass.BFloat16 / Float32
    return False


def _check_signature(function, table, skip_self=False):
    params = list(inspect.signature(function).parameters.values())
    if skip_self:
        params = params[1:]
    by_name = {p.name: p for p in params}
    positional = [p.name for p in params if p.kind == POS]
    theirs_positional = [name for name, kind, _ in table if kind == POS]
    # Every positional call of cuDNN's binds to the same parameters here.
    assert positional[:len(theirs_positional)] == theirs_positional
    for name, kind, default in table:
        assert name in by_name, f"{function.__qualname__} lacks cuDNN's {name}"
        ours = by_name[name]
        assert ours.kind == kind, f"{name}: {ours.kind} here, {kind} in cuDNN"
        if default is REQUIRED:
            continue
        assert ours.default is not inspect.Parameter.empty, f"{name} has no default here"
        if name in DEVIATIONS and not _same_default(ours.default, default):
            assert _same_default(ours.default, DEVIATIONS[name]), name
        else:
            assert _same_default(ours.default, default), \
                f"{name}: default {ours.default!r} here, {default!r} in cuDNN"
    theirs = {name for name, _, _ in table}
    for p in params:
        if p.name not in theirs:
            assert p.kind == KW and p.default is not inspect.Parameter.empty, \
                f"{p.name}: gwgrad's addition must be keyword-only and optional"
            assert p.name in EXTRAS, f"{p.name}: document gwgrad's addition in EXTRAS"


def test_class_signature():
    _check_signature(gwgrad.GroupedGemmWgradSm100.__init__, CLASS_INIT, skip_self=True)
    assert gwgrad.GroupedGemmWgradSm100 is gwgrad.GroupedGemmWgrad
    for method in ("check_support", "compile", "execute"):
        assert callable(getattr(gwgrad.GroupedGemmWgradSm100, method))


def test_execute_signature():
    _check_signature(gwgrad.GroupedGemmWgradSm100.execute, EXECUTE, skip_self=True)


def test_wrapper_signature():
    _check_signature(gwgrad.grouped_gemm_wgrad_wrapper_sm100, WRAPPER)
    assert gwgrad.grouped_gemm_wgrad_wrapper_sm100 is gwgrad.grouped_gemm_wgrad


def test_workspace_size_signature():
    _check_signature(gwgrad.get_grouped_gemm_wgrad_workspace_size_sm100, WORKSPACE_SIZE)


def test_jax_entry_signature():
    pytest.importorskip("jax")
    _check_signature(gwgrad.grouped_gemm_wgrad_jax_sm100, JAX_ENTRY)


def test_names_are_exported():
    for name in ("GroupedGemmWgradSm100", "grouped_gemm_wgrad_wrapper_sm100",
                 "get_grouped_gemm_wgrad_workspace_size_sm100", "UnsupportedError"):
        assert name in gwgrad.__all__ and getattr(gwgrad, name) is not None
    # The JAX entry is an attribute (imported on first use), not in __all__: `import gwgrad`
    # and `from gwgrad import *` never import JAX.
    assert "grouped_gemm_wgrad_jax_sm100" not in gwgrad.__all__


# --- the workspace size function ------------------------------------------------------------

def _cudnn_size(num_experts, output_mode):
    """cuDNN 1.32's own size: one 128-byte TMA descriptor per expert for A, B, SFA, SFB (and
    the output, discrete)."""
    return (4 if output_mode == "dense" else 5) * 128 * num_experts


@pytest.mark.parametrize("output_mode", ["dense", "discrete"])
@pytest.mark.parametrize("experts", [1, 2, 7, 64, 128, 1000])
def test_workspace_size(experts, output_mode):
    size = gwgrad.get_grouped_gemm_wgrad_workspace_size_sm100(experts, output_mode=output_mode)
    assert isinstance(size, int) and size % 128 == 0
    # At least cuDNN's for the same arguments: a buffer sized for gwgrad also serves cuDNN.
    assert size >= _cudnn_size(experts, output_mode)
    for order in ("tensor2d", "tensor_ragged"):
        assert gwgrad.get_grouped_gemm_wgrad_workspace_size_sm100(
            experts, output_mode=output_mode, input_order=order) == size
    bigger = gwgrad.get_grouped_gemm_wgrad_workspace_size_sm100(experts + 1,
                                                                 output_mode=output_mode)
    assert bigger > size


def test_workspace_size_errors():
    size = gwgrad.get_grouped_gemm_wgrad_workspace_size_sm100
    for bad in (0, -1, 1.5, True, None, "4"):
        with pytest.raises(ValueError, match="^num_experts: expected a positive int"):
            size(bad)
    with pytest.raises(ValueError, match="^output_mode: "):
        size(4, output_mode="stacked")
    with pytest.raises(ValueError, match="^input_order: "):
        size(4, input_order="ragged")
    with pytest.raises(TypeError):  # keyword-only, as in cuDNN
        size(4, "dense")


def test_workspace_size_bounds_every_kernel():
    """The host arithmetic (gwgrad.plan.workspace_bytes_bound) against the kernels' own layout
    (kernels/config.py ProblemConfig.workspace_bytes) for every format family, output mode
    and scale recipe the public entry points build: never less, equal for the largest."""
    pytest.importorskip("cutlass")
    from gwgrad.kernels.config import ProblemConfig

    size = gwgrad.get_grouped_gemm_wgrad_workspace_size_sm100
    for experts in (1, 3, 8, 129):
        for mode in ("dense", "discrete"):
            needs = []
            for recipe, sf_vec, descriptors in (("", 0, False), ("blocked", 32, False),
                                                ("blocked", 32, True), ("blocked", 16, True),
                                                ("per_expert_channel", 0, False),
                                                ("block_1x128", 128, False)):
                for schedule in (1, 3):  # dynamic; balanced (the SM90 pairs' default)
                    cfg = ProblemConfig(
                        hidden=256, intermediate=256, num_experts=experts, a_major="k",
                        b_major="k", input_order="tensor2d", output_mode=mode, accumulate=False,
                        ab_dtype="bfloat16", c_dtype="bfloat16", tile_m=128, tile_n=128,
                        scale_recipe=recipe, sf_vec=sf_vec, sf_descriptors=descriptors,
                        unit_schedule=schedule)
                    needs.append(cfg.workspace_bytes)
            assert max(needs) == size(experts, output_mode=mode)


# --- descriptor_workspace -------------------------------------------------------------------

@pytest.mark.parametrize("fmt,arch", [(f, a) for f in FORMATS for a in ARCHS
                                      if TABLE[f][a] is None])
def test_descriptor_workspace_reaches_the_kernel(fmt, arch, stand_in, monkeypatch):  # noqa: F811
    """cuDNN's ``descriptor_workspace``: a caller-owned device buffer of at least
    get_grouped_gemm_wgrad_workspace_size_sm100(...) bytes; every backend here takes one (in
    cuDNN 1.32 only its block-scaled backend does) and launches with its address."""
    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    nbytes = gwgrad.get_grouped_gemm_wgrad_workspace_size_sm100(E)
    ws = cuda((nbytes,), None, DType.UINT8)
    gwgrad.grouped_gemm_wgrad_wrapper_sm100(**fmt_kwargs(fmt), descriptor_workspace=ws)
    op = gwgrad.GroupedGemmWgradSm100(**class_kwargs(fmt))
    assert op.workspace_bytes <= nbytes  # known before compile()
    op.compile()
    assert op.workspace_bytes <= nbytes
    op.execute(**execute_kwargs(fmt), descriptor_workspace=ws)
    op.execute(**execute_kwargs(fmt))  # without one: gwgrad's own
    (*_, w1), (*_, w2), (*_, w3) = [call[:6] for call in stand_in.calls]
    assert w1 == w2 == ws.ptr and w3 == 0xABC000
    # A caller's workspace may hold anything (cuDNN's examples use torch.empty): before a
    # single-launch kernel its prep hand-off words are zeroed on the call's stream, each call.
    single = op.spec.launches == 1
    assert stand_in.memsets == ([(ws.ptr, gwgrad.plan.WORKSPACE_ZEROED_BYTES)] * 2 if single
                                else [])


def test_descriptor_workspace_errors(stand_in, monkeypatch):  # noqa: F811
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    op = gwgrad.GroupedGemmWgradSm100(**class_kwargs("bf16"))
    op.compile()
    need = op.workspace_bytes
    exact = cuda((need,), None, DType.UINT8)
    op.execute(**execute_kwargs("bf16"), descriptor_workspace=exact)  # exactly enough
    words = cuda((need // 4,), None, DType.INT32)  # any dtype: its bytes count
    op.execute(**execute_kwargs("bf16"), descriptor_workspace=words)
    assert [c[5] for c in stand_in.calls] == [exact.ptr, words.ptr]
    bad = {
        "at least": cuda((need - 1,), None, DType.UINT8),
        "cuda:0": gwgrad.TensorDesc(exact.ptr, (need,), (1,), DType.UINT8, "cpu", 0),
        "contiguous": gwgrad.from_pointer(exact.ptr, (need,), (2,), DType.UINT8, 0),
        "128-byte aligned": gwgrad.from_pointer(exact.ptr + 16, (need,), None, DType.UINT8, 0),
    }
    for needle, ws in bad.items():
        for call in (lambda: op.execute(**execute_kwargs("bf16"), descriptor_workspace=ws),
                     lambda: gwgrad.grouped_gemm_wgrad_wrapper_sm100(
                         **fmt_kwargs("bf16"), descriptor_workspace=ws)):
            with pytest.raises(ValueError, match=f"^descriptor_workspace: expected .*{needle}"):
                call()
    with pytest.raises(ValueError, match="^descriptor_workspace: expected an array"):
        op.execute(**execute_kwargs("bf16"), descriptor_workspace=object())
    assert len(stand_in.calls) == 2


def test_descriptor_workspace_on_the_cpu_is_not_needed(rng):
    import ml_dtypes
    import numpy as np

    a16 = rng.standard_normal((16, 32)).astype(ml_dtypes.bfloat16)
    b16 = rng.standard_normal((32, 8)).astype(ml_dtypes.bfloat16)
    offsets = np.array([16, 32], np.int32)
    out = np.full((2, 16, 8), np.nan, np.float32)
    ws = np.zeros(16, np.uint8)  # smaller than any GPU workspace: the reference needs none
    gwgrad.grouped_gemm_wgrad_wrapper_sm100(np.asfortranarray(a16), b16, None, None, offsets,
                                            wgrad_tensor=out, descriptor_workspace=ws)
    want = np.stack([a16[:, :16].astype(np.float64) @ b16[:16].astype(np.float64),
                     a16[:, 16:].astype(np.float64) @ b16[16:].astype(np.float64)])
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


# --- other behaviours cuDNN callers rely on -------------------------------------------------

def test_acc_dtype_none_means_fp32(stand_in, monkeypatch):  # noqa: F811
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    gwgrad.grouped_gemm_wgrad_wrapper_sm100(**fmt_kwargs("bf16"), acc_dtype=None)
    op = gwgrad.GroupedGemmWgradSm100(**class_kwargs("bf16"), acc_dtype=None)
    assert op.spec.acc_dtype == DType.FLOAT32
    with pytest.raises(ValueError, match="^acc_dtype: "):
        gwgrad.GroupedGemmWgradSm100(**class_kwargs("bf16"), acc_dtype="float16")


def test_cutlass_dtypes_are_accepted():
    """cuDNN's APIs default to the CuTe DSL's types (cutlass.BFloat16, cutlass.Float32)."""
    cutlass = pytest.importorskip("cutlass")
    assert as_dtype(cutlass.BFloat16) == DType.BFLOAT16
    assert as_dtype(cutlass.Float32) == DType.FLOAT32
    assert as_dtype(cutlass.Float16) == DType.FLOAT16
    assert as_dtype(cutlass.Float8E4M3FN) == DType.FLOAT8_E4M3FN
    assert as_dtype(cutlass.Float8E8M0FNU) == DType.FLOAT8_E8M0FNU


#: cuDNN's exception contract, in gwgrad's words: what a caller that catches cuDNN's errors
#: gets for each kind of problem (the other tests check the cases in detail).
EXCEPTIONS = {
    "a format this GPU cannot run (FP4 on SM90), from the wrapper": NotImplementedError,
    "the same, from the class's check_support()": NotImplementedError,
    "sf_fp8_dtype_override='e5m3' (NVFP4)": NotImplementedError,
    "sf_fp8_dtype_override of another value": ValueError,
    "a tiling the kernel does not run": ValueError,
    "descriptor_workspace too small": ValueError,
    "execute() before compile()": RuntimeError,
    "num_experts <= 0 for the workspace size": ValueError,
}


def test_exception_contract(stand_in, monkeypatch):  # noqa: F811
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    wrapper = gwgrad.grouped_gemm_wgrad_wrapper_sm100
    op = gwgrad.GroupedGemmWgradSm100(**class_kwargs("nvfp4"))
    calls = {
        "a format this GPU cannot run (FP4 on SM90), from the wrapper":
            lambda: wrapper(**fmt_kwargs("mxfp4")),
        "the same, from the class's check_support()": op.check_support,
        "sf_fp8_dtype_override='e5m3' (NVFP4)":
            lambda: wrapper(**fmt_kwargs("nvfp4"), sf_fp8_dtype_override="e5m3"),
        "sf_fp8_dtype_override of another value":
            lambda: wrapper(**fmt_kwargs("nvfp4"), sf_fp8_dtype_override="ue8m0"),
        "a tiling the kernel does not run":
            lambda: wrapper(**fmt_kwargs("bf16"), mma_tiler_mn=(256, 256)),
        "descriptor_workspace too small":
            lambda: wrapper(**fmt_kwargs("bf16"), descriptor_workspace=cuda((16,), None,
                                                                            DType.UINT8)),
        "execute() before compile()":
            lambda: gwgrad.GroupedGemmWgradSm100(**class_kwargs("bf16")).execute(
                **execute_kwargs("bf16")),
        "num_experts <= 0 for the workspace size":
            lambda: gwgrad.get_grouped_gemm_wgrad_workspace_size_sm100(0),
    }
    assert calls.keys() == EXCEPTIONS.keys()
    for what, call in calls.items():
        with pytest.raises(EXCEPTIONS[what]) as info:
            call()
        if EXCEPTIONS[what] is not NotImplementedError:  # the three are disjoint here
            assert not isinstance(info.value, NotImplementedError), what
        # cuDNN's own tests skip on exactly these two:
        assert isinstance(info.value, (ValueError, NotImplementedError)) or \
            EXCEPTIONS[what] is RuntimeError, what
