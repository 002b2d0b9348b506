"""One failing input per contract rule: the error type, and a message naming the argument.

Most rules are pure functions over descriptors (``build_spec``), so they are checked here
with descriptors of CPU or (fake, never dereferenced) CUDA memory, without a GPU.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import gwgrad
from gwgrad import DType, from_pointer
from gwgrad import backends as backends_mod
from gwgrad.backends.tuning_rules import REFERENCE, rules
from gwgrad.offsets import check_offsets_values, check_ptr_values, token_count_multiple
from gwgrad.validation import build_spec, check_call
from wgrad_cases import bf16, bf16_problem, host_ptrs, layout_a, layout_b

H, N, E, T = 64, 128, 4, 256
BASE_PTR = 1 << 20


def d(shape, strides=None, dtype=DType.BFLOAT16, ptr=BASE_PTR, device="cpu", device_id=0):
    """A descriptor of memory nobody reads (pure validation never dereferences)."""
    return from_pointer(ptr, shape, strides, dtype, device_id, device_type=device)


def base(device="cpu", **changes):
    kw = dict(a=d((H, T), (1, H), device=device), b=d((T, N), (N, 1), device=device),
              offsets=d((E,), None, DType.INT32, device=device),
              wgrad=d((E, H, N), None, device=device), arch="sm_90a")
    kw.update(changes)
    return kw


def scaled(dtype=DType.FLOAT8_E4M3FN, sf=DType.FLOAT8_E8M0FNU, vec=32, **changes):
    # Blocked scales (gwgrad/scales.py): (round_up(rows, 128), C), C = round_up(T / vec, 4).
    cols = -(-T // vec // 4) * 4
    kw = base(a=d((H, T), (T, 1), dtype), b=d((T, N), (1, T), dtype),
              sfa=d((128, cols), None, sf), sfb=d((128, cols), None, sf), sf_vec_size=vec)
    kw.update(changes)
    return kw


def raises(exc, name, **kw):
    with pytest.raises(exc) as info:
        build_spec(**kw)
    assert str(info.value).startswith(name + ":"), str(info.value)
    return str(info.value)


def test_valid_inputs_build_a_spec():
    spec = build_spec(**base())
    assert (spec.hidden, spec.intermediate, spec.num_experts) == (H, N, E)
    assert (spec.a_major, spec.b_major, spec.arch) == ("m", "n", "cpu")
    assert spec.wgrad_dtype == DType.BFLOAT16 and spec.mma_tiler_mn is None
    cuda_spec = build_spec(**base(device="cuda"))
    assert cuda_spec.arch == "sm_90a"
    hash(spec)


CASES = {
    # presence and shapes
    "a missing": ("a_tensor", dict(a=None)),
    "b missing": ("b_tensor", dict(b=None)),
    "offsets missing": ("offsets_tensor", dict(offsets=None)),
    "a 3-D": ("a_tensor", dict(a=d((1, H, T)))),
    "b 1-D": ("b_tensor", dict(b=d((T,)))),
    "tokens mismatch": ("b_tensor", dict(b=d((T + 8, N), (N, 1)))),
    "hidden not multiple of 8": ("a_tensor", dict(a=d((H + 4, T), (1, H + 4)),
                                                  wgrad=d((E, H + 4, N)))),
    "intermediate not multiple of 8": ("b_tensor", dict(b=d((T, N + 2), (N + 2, 1)),
                                                        wgrad=d((E, H, N + 2)))),
    "hidden zero": ("a_tensor", dict(a=d((0, T), (1, 1)), wgrad=d((E, 0, N)))),
    # dtypes
    "a float16": ("a_tensor", dict(a=d((H, T), (1, H), DType.FLOAT16),
                                   b=d((T, N), (N, 1), DType.FLOAT16))),
    "b dtype differs": ("b_tensor", dict(b=d((T, N), (N, 1), DType.FLOAT8_E4M3FN))),
    "acc float16": ("acc_dtype", dict(acc_dtype="float16")),
    # strides / majors
    "a padded leading stride": ("a_tensor", dict(a=d((H, T), (1, H + 8)))),
    "a strided columns": ("a_tensor", dict(a=d((H, T), (2 * T, 2)))),
    "b wrong strides": ("b_tensor", dict(b=d((T, N), (N + 8, 1)))),
    "ragged without unit stride": ("a_tensor", dict(a=d((H, T), (2, 2 * H)),
                                                    input_order="tensor_ragged")),
    # offsets
    "offsets 2-D": ("offsets_tensor", dict(offsets=d((E, 1), None, DType.INT32))),
    "offsets int64": ("offsets_tensor", dict(offsets=d((E,), None, DType.INT64))),
    "offsets strided": ("offsets_tensor", dict(offsets=d((E,), (2,), DType.INT32))),
    "no experts": ("offsets_tensor", dict(offsets=d((0,), None, DType.INT32))),
    "offsets misaligned": ("offsets_tensor", dict(offsets=d((E,), None, DType.INT32,
                                                            ptr=BASE_PTR + 2))),
    # dense output
    "dense with wgrad_ptrs": ("wgrad_ptrs", dict(wgrad_ptrs=d((E,), None, DType.INT64))),
    "wgrad wrong shape": ("wgrad_tensor", dict(wgrad=d((E, N, H)))),
    "wgrad not contiguous": ("wgrad_tensor", dict(wgrad=d((E, H, N), (H * N, 1, H)))),
    "wgrad int32": ("wgrad_tensor", dict(wgrad=d((E, H, N), None, DType.INT32))),
    "wgrad_dtype differs from wgrad": ("wgrad_dtype", dict(wgrad_dtype="float32")),
    "wgrad_dtype float64": ("wgrad_dtype", dict(wgrad=None, wgrad_dtype="float64")),
    "wgrad_dtype unknown": ("wgrad_dtype", dict(wgrad=None, wgrad_dtype="complex64")),
    # discrete output
    "ptrs int32": ("wgrad_ptrs", dict(output_mode="discrete", wgrad=None,
                                      wgrad_ptrs=d((E,), None, DType.INT32))),
    "ptrs wrong length": ("wgrad_ptrs", dict(output_mode="discrete", wgrad=None,
                                             wgrad_ptrs=d((E + 1,), None, DType.INT64))),
    "ptrs strided": ("wgrad_ptrs", dict(output_mode="discrete", wgrad=None,
                                        wgrad_ptrs=d((E,), (2,), DType.INT64))),
    "ptrs and wgrad": ("wgrad_tensor", dict(output_mode="discrete",
                                            wgrad_ptrs=d((E,), None, DType.INT64))),
    "discrete expert sample wrong shape": ("sample_wgrad_expert", dict(
        output_mode="discrete", wgrad=None, wgrad_expert=d((N, H)))),
    "num_experts mismatch": ("num_experts", dict(output_mode="discrete", wgrad=None,
                                                 num_experts=E + 1)),
    "wgrad_shape mismatch": ("wgrad_shape", dict(output_mode="discrete", wgrad=None,
                                                 wgrad_shape=(N, H))),
    # BF16 rejects every scale control
    "bf16 sfa": ("sfa_tensor", dict(sfa=d((H, 8), None, DType.FLOAT8_E8M0FNU))),
    "bf16 sfb": ("sfb_tensor", dict(sfb=d((8, N), None, DType.FLOAT8_E8M0FNU))),
    "bf16 global_scale_a": ("global_scale_a", dict(global_scale_a=d((1,), None, DType.FLOAT32))),
    "bf16 global_scale_b": ("global_scale_b", dict(global_scale_b=d((1,), None, DType.FLOAT32))),
    "bf16 sf_vec_size": ("sf_vec_size", dict(sf_vec_size=32)),
    # modes and configuration
    "output_mode": ("output_mode", dict(output_mode="sparse")),
    "input_order": ("input_order", dict(input_order="ragged")),
    "mma_tiler_mn zero": ("mma_tiler_mn", dict(mma_tiler_mn=(0, 128))),
    "mma_tiler_mn length": ("mma_tiler_mn", dict(mma_tiler_mn=(128,))),
    "cluster_shape_mn": ("cluster_shape_mn", dict(cluster_shape_mn="1x1")),
    "accumulate not bool": ("accumulate_on_output", dict(accumulate=1)),
    "sf_vec_size not int": ("sf_vec_size", dict(sf_vec_size=16.0)),
    # alignment
    "a misaligned": ("a_tensor", dict(a=d((H, T), (1, H), ptr=BASE_PTR + 2))),
    "b misaligned": ("b_tensor", dict(b=d((T, N), (N, 1), ptr=BASE_PTR + 8))),
    "wgrad misaligned": ("wgrad_tensor", dict(wgrad=d((E, H, N), ptr=BASE_PTR + 4))),
    "tokens_sum vs K-major row stride": ("a_tensor", dict(a=d((H, T - 4), (T - 4, 1)),
                                                          b=d((T - 4, N), (N, 1)))),
    # devices
    "b on another device type": ("b_tensor", dict(b=d((T, N), (N, 1), device="cuda"))),
    "offsets on cuda": ("offsets_tensor", dict(offsets=d((E,), None, DType.INT32, device="cuda"))),
    "wgrad on cuda": ("wgrad_tensor", dict(wgrad=d((E, H, N), device="cuda"))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rule(case):
    name, changes = CASES[case]
    raises(ValueError, name, **base(**changes))


CUDA_CASES = {
    "another CUDA device": ("b_tensor", dict(b=d((T, N), (N, 1), device="cuda", device_id=1))),
    "host wgrad_ptrs with CUDA inputs": ("wgrad_ptrs", dict(
        output_mode="discrete", wgrad=None, wgrad_ptrs=d((E,), None, DType.INT64))),
    "ptrs misaligned": ("wgrad_ptrs", dict(output_mode="discrete", wgrad=None, wgrad_ptrs=d(
        (E,), None, DType.INT64, device="cuda", ptr=BASE_PTR + 8))),
}


@pytest.mark.parametrize("case", sorted(CUDA_CASES))
def test_rule_cuda_descriptors(case):
    name, changes = CUDA_CASES[case]
    raises(ValueError, name, **base(device="cuda", **changes))


BLOCK_SCALED_CASES = {
    "fp8 pair mismatch": ("b_tensor", dict(b=d((T, N), (1, T), DType.FLOAT8_E5M2))),
    "sfa missing": ("sfa_tensor", dict(sfa=None)),
    "sfb missing": ("sfb_tensor", dict(sfb=None)),
    "sf dtype": ("sfa_tensor", dict(sfa=d((H, 8), None, DType.UINT8))),
    "sfb dtype differs": ("sfb_tensor", dict(sfb=d((8, N), None, DType.FLOAT8_E4M3FN))),
    "sf_vec_size 64": ("sf_vec_size", dict(sf_vec_size=64)),
    "fp8 with vec 16": ("sf_vec_size", dict(sf_vec_size=16)),
    "one global scale": ("global_scale_b", dict(global_scale_a=d((E,), None, DType.FLOAT32))),
    "global scale dtype": ("global_scale_a", dict(global_scale_a=d((E,), None, DType.FLOAT16),
                                                  global_scale_b=d((E,), None, DType.FLOAT32))),
    "global scale size": ("global_scale_b", dict(global_scale_a=d((E,), None, DType.FLOAT32),
                                                 global_scale_b=d((E + 1,), None, DType.FLOAT32))),
    "one-element global scales": ("global_scale_a", dict(
        global_scale_a=d((1,), None, DType.FLOAT32), global_scale_b=d((1,), None, DType.FLOAT32))),
    "global scale strided": ("global_scale_a", dict(
        global_scale_a=d((E,), (2,), DType.FLOAT32), global_scale_b=d((E,), None, DType.FLOAT32))),
    "sfa misaligned": ("sfa_tensor", dict(sfa=d((128, 8), None, DType.FLOAT8_E8M0FNU,
                                                ptr=BASE_PTR + 1))),
    "fp8 hidden granule": ("a_tensor", dict(a=d((H + 8, T), (T, 1), DType.FLOAT8_E4M3FN),
                                            wgrad=d((E, H + 8, N)))),
}


@pytest.mark.parametrize("case", sorted(BLOCK_SCALED_CASES))
def test_block_scaled_rule(case):
    name, changes = BLOCK_SCALED_CASES[case]
    raises(ValueError, name, **scaled(**changes))


def test_block_scaled_valid_and_its_dtype_rules():
    spec = build_spec(**scaled())
    assert spec.is_block_scaled and spec.sf_dtype == DType.FLOAT8_E8M0FNU
    fp4 = DType.FLOAT4_E2M1FN_X2
    nvfp4 = scaled(a=d((H, T // 2), (T // 2, 1), fp4), b=d((T // 2, N), (1, T // 2), fp4),
                   sfa=d((128, T // 16), None, DType.FLOAT8_E4M3FN),
                   sfb=d((128, T // 16), None, DType.FLOAT8_E4M3FN), sf_vec_size=16,
                   global_scale_a=d((E,), None, DType.FLOAT32),
                   global_scale_b=d((E,), None, DType.FLOAT32))
    spec = build_spec(**nvfp4)
    assert (spec.hidden, spec.num_experts) == (H, E)
    assert spec.scale_recipe == "blocked" and spec.has_global_scale
    raises(ValueError, "sf_vec_size", **dict(nvfp4, sf_vec_size=32))  # E4M3 scales need 16
    raises(ValueError, "a_tensor", **dict(nvfp4, a=d((H // 2, T), (1, H // 2), fp4)))  # M-major FP4


def test_unsupported_combinations_name_the_argument():
    # A K-major A needs counts that are multiples of 8 in either input order; a bad operand
    # layout is named.
    spec = build_spec(**base(a=d((H, T), (T, 1)), input_order="tensor_ragged"))
    assert spec.a_major == "k"
    assert token_count_multiple(spec) == 8
    assert token_count_multiple(dataclasses.replace(spec, input_order="tensor2d")) == 8
    assert token_count_multiple(dataclasses.replace(spec, a_major="m")) == 1
    assert token_count_multiple(build_spec(**scaled())) == 32


# --- offsets and pointer values -----------------------------------------------------------------

def spec_for(**changes):
    return build_spec(**base(**changes))


@pytest.mark.parametrize("values,tokens,needle", [
    ([-1, 4, 8, 8], 8, "offsets >= 0"),
    ([4, 2, 8, 8], 8, "non-decreasing"),
    ([4, 8, 8, 9], 8, "tokens_sum = 8"),
])
def test_offsets_values(values, tokens, needle):
    with pytest.raises(ValueError, match=rf"^offsets_tensor: .*{needle}"):
        check_offsets_values(np.array(values), tokens, spec_for())


def test_offsets_count_multiple_ragged_k_major_and_block_scaled():
    ragged = spec_for(a=d((H, T), (T, 1)), input_order="tensor_ragged")
    check_offsets_values(np.array([8, 8, 16, 256]), 256, ragged)
    with pytest.raises(ValueError, match=r"^offsets_tensor: .*multiple of 8.*12 tokens for expert 1"):
        check_offsets_values(np.array([8, 20, 24, 256]), 256, ragged)
    bs = build_spec(**scaled())
    check_offsets_values(np.array([0, 256, 256, 256]), 256, bs)
    check_offsets_values(np.array([32, 96, 96, 256]), 256, bs)  # multiples of 32, not 128
    with pytest.raises(ValueError, match=r"^offsets_tensor: .*multiple of 32"):
        check_offsets_values(np.array([16, 256, 256, 256]), 256, bs)
    check_offsets_values(np.array([1, 3, 3, 256]), 256, spec_for())  # BF16: any count


@pytest.mark.parametrize("ptrs", [[64, 0, 128], [64, 72, 128]])
def test_pointer_values(ptrs):
    with pytest.raises(ValueError, match=r"^wgrad_ptrs: .*non-null, 16-byte aligned"):
        check_ptr_values(np.array(ptrs))


# --- through the public API (CPU arrays) --------------------------------------------------------

def problem_kwargs(rng, counts=(8, 0, 24, 16)):
    problem = bf16_problem(rng, counts=counts)
    a = layout_a(bf16(problem.a), problem.counts, "m", "tensor2d")
    b = layout_b(bf16(problem.b), problem.counts, "n", "tensor2d")
    return problem, dict(a_tensor=a.desc, b_tensor=b.desc, offsets_tensor=problem.offsets)


def api_raises(exc, name, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert str(info.value).startswith(name + ":"), str(info.value)


def test_bad_offsets_values_through_the_wrapper(rng):
    _, kw = problem_kwargs(rng)
    kw["offsets_tensor"] = np.array([8, 4, 24, 48], dtype=np.int32)
    api_raises(ValueError, "offsets_tensor", gwgrad.grouped_gemm_wgrad, **kw)
    # validate_offsets=False skips the GPU's host copy; on the CPU the reference still checks,
    # since a bad offset would read outside the arrays there.
    api_raises(ValueError, "offsets_tensor", gwgrad.grouped_gemm_wgrad, validate_offsets=False, **kw)


def test_bad_pointer_values_through_the_wrapper(rng):
    problem, kw = problem_kwargs(rng)
    outputs = [np.empty((16, 24), np.float32) for _ in range(problem.experts)]
    ptrs = host_ptrs(outputs)
    ptrs[2] = 0
    api_raises(ValueError, "wgrad_ptrs", gwgrad.grouped_gemm_wgrad, output_mode="discrete",
               wgrad_ptrs=ptrs, wgrad_dtype="float32", **kw)


def test_accumulate_without_output_names_wgrad_tensor(rng):
    _, kw = problem_kwargs(rng)
    api_raises(ValueError, "wgrad_tensor", gwgrad.grouped_gemm_wgrad, accumulate_on_output=True, **kw)
    api_raises(ValueError, "wgrad_tensor", gwgrad.grouped_gemm_wgrad, accumulate_on_output=True,
               output_mode="discrete", **kw)


def test_read_only_output(rng):
    problem, kw = problem_kwargs(rng)
    out = np.zeros((problem.experts, 16, 24), np.float32)
    out.flags.writeable = False
    api_raises(ValueError, "wgrad_tensor", gwgrad.grouped_gemm_wgrad, wgrad_tensor=out, **kw)


def test_not_an_array_and_bad_stream(rng):
    _, kw = problem_kwargs(rng)
    api_raises(ValueError, "a_tensor", gwgrad.grouped_gemm_wgrad, **dict(kw, a_tensor=[[1.0]]))
    api_raises(ValueError, "offsets_tensor", gwgrad.grouped_gemm_wgrad,
               **dict(kw, offsets_tensor=np.array([8, 8, 32, 48], dtype=np.complex64)))
    from gwgrad.interop import stream_handle

    with pytest.raises(ValueError, match="^current_stream:"):
        stream_handle(object())


def test_class_api_names_its_sample_arguments(rng):
    problem, kw = problem_kwargs(rng)
    out = np.empty((problem.experts, 16, 24), np.float32)
    api_raises(ValueError, "sample_wgrad", gwgrad.GroupedGemmWgrad, kw["a_tensor"], kw["b_tensor"],
               None, None, kw["offsets_tensor"])
    api_raises(ValueError, "sample_a", gwgrad.GroupedGemmWgrad, np.zeros((16, 48), np.float16),
               kw["b_tensor"], None, None, kw["offsets_tensor"], out)
    api_raises(ValueError, "sample_offsets", gwgrad.GroupedGemmWgrad, kw["a_tensor"],
               kw["b_tensor"], None, None, np.zeros(4, np.int64), out)
    api_raises(ValueError, "sample_sfa", gwgrad.GroupedGemmWgrad, kw["a_tensor"], kw["b_tensor"],
               np.zeros((16, 1), np.uint8), None, kw["offsets_tensor"], out)
    api_raises(ValueError, "sample_wgrad_expert", gwgrad.GroupedGemmWgrad, kw["a_tensor"],
               kw["b_tensor"], None, None, kw["offsets_tensor"], output_mode="discrete")


def test_use_before_compile(rng):
    problem, kw = problem_kwargs(rng)
    out = np.empty((problem.experts, 16, 24), np.float32)
    op = gwgrad.GroupedGemmWgrad(kw["a_tensor"], kw["b_tensor"], None, None, kw["offsets_tensor"], out)
    with pytest.raises(RuntimeError, match="compile()"):
        op.execute(kw["a_tensor"], kw["b_tensor"], None, None, kw["offsets_tensor"], out)
    assert op.check_support() is True
    with pytest.raises(RuntimeError, match="compile()"):
        op.execute(kw["a_tensor"], kw["b_tensor"], None, None, kw["offsets_tensor"], out)


def test_call_must_match_the_operators_spec(rng):
    problem, kw = problem_kwargs(rng)
    out = np.zeros((problem.experts, 16, 24), np.float32)
    op = gwgrad.GroupedGemmWgrad(kw["a_tensor"], kw["b_tensor"], None, None, kw["offsets_tensor"], out)
    op.compile()
    api_raises(ValueError, "wgrad_tensor", op.execute, kw["a_tensor"], kw["b_tensor"], None, None,
               kw["offsets_tensor"], out.astype(np.float16))
    other, kw2 = problem_kwargs(rng)
    k_major = layout_a(bf16(other.a), other.counts, "k", "tensor2d")
    api_raises(ValueError, "a_tensor", op.execute, k_major.desc, kw["b_tensor"], None, None,
               kw["offsets_tensor"], out)
    api_raises(ValueError, "wgrad_ptrs", op.execute, kw["a_tensor"], kw["b_tensor"], None, None,
               kw["offsets_tensor"], out, wgrad_ptrs=np.zeros(4, np.int64))
    api_raises(ValueError, "sfa_tensor", check_call, op.spec, kw["a_tensor"], kw["b_tensor"],
               as_desc(kw["offsets_tensor"]), sfa=d((16, 1), None, DType.FLOAT8_E8M0FNU),
               wgrad=as_desc(out))


def as_desc(x):
    return gwgrad.as_tensor_desc(x, "x")


# --- environment: RuntimeError ----------------------------------------------------------------

def test_no_cuda_is_a_runtime_error(monkeypatch):
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    monkeypatch.setattr(gwgrad.cuda, "device_count", lambda: 0)
    backends_mod._arch_of_device.cache_clear()
    with pytest.raises(RuntimeError, match="CUDA is unavailable"):
        build_spec(**base(device="cuda", arch=backends_mod.detect_arch))
    backends_mod._arch_of_device.cache_clear()


@pytest.mark.parametrize("capability,needle", [((8, 0), "compute capability 8.0"),
                                               ((7, 5), "compute capability 7.5"),
                                               ((12, 0), "no kernels for compute capability 12.0")])
def test_gpu_capability(monkeypatch, capability, needle):
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    monkeypatch.setattr(gwgrad.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gwgrad.cuda, "compute_capability", lambda device: capability)
    backends_mod._arch_of_device.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=needle):
            backends_mod.detect_arch(0)
    finally:
        backends_mod._arch_of_device.cache_clear()


@pytest.mark.parametrize("capability,arch", [((9, 0), "sm_90a"), ((10, 0), "sm_100a"),
                                             ((10, 3), "sm_103a")])
def test_arch_from_capability_and_override(monkeypatch, capability, arch):
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    monkeypatch.setattr(gwgrad.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gwgrad.cuda, "compute_capability", lambda device: capability)
    backends_mod._arch_of_device.cache_clear()
    try:
        assert backends_mod.detect_arch(0) == arch
        monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
        assert backends_mod.detect_arch(0) == "sm_100a"
        monkeypatch.setenv("CUTE_DSL_ARCH", "sm_80")
        with pytest.raises(RuntimeError, match="CUTE_DSL_ARCH"):
            backends_mod.detect_arch(0)
    finally:
        backends_mod._arch_of_device.cache_clear()


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_block_scaled_backend_per_arch(arch):
    scaled_spec = build_spec(**dict(scaled(), a=d((H, T), (T, 1), DType.FLOAT8_E4M3FN, device="cuda"),
                                    b=d((T, N), (1, T), DType.FLOAT8_E4M3FN, device="cuda"),
                                    sfa=d((128, 8), None, DType.FLOAT8_E8M0FNU, device="cuda"),
                                    sfb=d((128, 8), None, DType.FLOAT8_E8M0FNU, device="cuda"),
                                    offsets=d((E,), None, DType.INT32, device="cuda"),
                                    wgrad=d((E, H, N), device="cuda"), arch=arch))
    want = "fp8_sm90" if arch == "sm_90a" else "blockscaled_sm100"
    assert backends_mod.get_backend(scaled_spec).name == want


def test_unsupported_tiling_is_the_backends_call(monkeypatch):
    class Picky(gwgrad.Backend):
        def check_support(self, spec):
            if spec.mma_tiler_mn != (128, 128):
                raise ValueError(f"mma_tiler_mn: expected (128, 128), got {spec.mma_tiler_mn}")

        tuning_rules = rules("picky-tiling: -> 128x128 1x1") + REFERENCE

        def compile(self, spec):
            return spec

        def launch(self, compiled, spec, args):
            pass

    monkeypatch.setitem(backends_mod._instances, ("gwgrad.backends.bf16_sm90", "Bf16Sm90Backend"),
                        Picky())
    spec = build_spec(**base(device="cuda", arch="sm_90a"))
    final, _ = backends_mod.finalize_spec(spec)
    assert final.mma_tiler_mn == (128, 128) and final.cluster_shape_mn == (1, 1)
    with pytest.raises(ValueError, match="^mma_tiler_mn:"):
        backends_mod.finalize_spec(spec.with_tuning(mma_tiler_mn=(64, 64)))
