"""The public API on CPU arrays: result shape, operator cache, class lifecycle, launch(), and
the CUDA path up to the backend (with a stand-in backend, so no GPU is needed)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import gwgrad
from gwgrad import DType, from_pointer
from gwgrad import backends as backends_mod
from gwgrad.backends.tuning_rules import REFERENCE, resolve, rules
from gwgrad.api import TupleDict
from wgrad_cases import bf16, bf16_problem, layout_a, layout_b, poisoned, random_output


def operands(problem, a_major="m", b_major="n", order="tensor2d"):
    a = layout_a(bf16(problem.a), problem.counts, a_major, order)
    b = layout_b(bf16(problem.b), problem.counts, b_major, order)
    return a.desc, b.desc


def test_tuple_dict():
    r = TupleDict(wgrad_tensor="w")
    (w,) = r
    assert w == "w" and r["wgrad_tensor"] == "w" and r[0] == "w" and len(r) == 1
    assert list(r.keys()) == ["wgrad_tensor"] and dict(r) == {"wgrad_tensor": "w"}
    assert "wgrad_tensor" in r


def test_contract_names_are_aliases():
    assert gwgrad.GroupedGemmWgradSm100 is gwgrad.GroupedGemmWgrad
    assert gwgrad.grouped_gemm_wgrad_wrapper_sm100 is gwgrad.grouped_gemm_wgrad


def test_wrapper_with_every_contract_argument(rng):
    problem = bf16_problem(rng)
    a, b = operands(problem)
    out = poisoned((problem.experts, 16, 24), "float32")
    result = gwgrad.grouped_gemm_wgrad_wrapper_sm100(
        a_tensor=a, b_tensor=b, sfa_tensor=None, sfb_tensor=None, offsets_tensor=problem.offsets,
        output_mode="dense", wgrad_tensor=out, wgrad_ptrs=None, global_scale_a=None,
        global_scale_b=None, acc_dtype="float32", wgrad_dtype="float32", mma_tiler_mn=(128, 256),
        cluster_shape_mn=(1, 1), sf_vec_size=16, accumulate_on_output=False,
        input_order="tensor2d", current_stream=None, validate_offsets=True)
    assert result["wgrad_tensor"] is out
    np.testing.assert_allclose(out, problem.expected(), rtol=1e-6, atol=1e-6)


def test_allocated_outputs(rng):
    problem = bf16_problem(rng)
    a, b = operands(problem)
    (dense,) = gwgrad.grouped_gemm_wgrad(a, b, offsets_tensor=problem.offsets)
    assert isinstance(dense, np.ndarray) and dense.shape == (problem.experts, 16, 24)
    assert dense.dtype.name == "bfloat16"  # the default wgrad_dtype
    (stacked,) = gwgrad.grouped_gemm_wgrad(a, b, offsets_tensor=problem.offsets,
                                           output_mode="discrete", wgrad_dtype=np.float16)
    assert stacked.dtype == np.float16
    np.testing.assert_allclose(stacked, problem.expected(), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(dense.astype(np.float64), problem.expected(), rtol=1e-2, atol=1e-2)


def test_discrete_with_a_caller_owned_stack(rng):
    problem = bf16_problem(rng)
    a, b = operands(problem)
    out = poisoned((problem.experts, 16, 24), "float32")
    result = gwgrad.grouped_gemm_wgrad(a, b, offsets_tensor=problem.offsets,
                                       output_mode="discrete", wgrad_tensor=out)
    assert result["wgrad_tensor"] is out
    np.testing.assert_allclose(out, problem.expected(), rtol=1e-6, atol=1e-6)


def test_cache_reuses_one_operator_across_tokens_offsets_and_storage(rng):
    p1 = bf16_problem(rng, counts=(8, 0, 24, 16))
    p2 = bf16_problem(rng, counts=(3, 77, 0, 1))  # other tokens_sum and offsets
    before = gwgrad.cache_info()
    for p in (p1, p2, p1):
        a, b = operands(p)
        out = poisoned((4, 16, 24), "float32")  # new storage every call
        gwgrad.grouped_gemm_wgrad(a, b, offsets_tensor=p.offsets, wgrad_tensor=out)
        np.testing.assert_allclose(out, p.expected(), rtol=1e-6, atol=1e-6)
    start = gwgrad.cache_info()
    assert start["operators"] == 1
    assert start["constructed"] == before["constructed"] + 1
    assert start["compiled"] == before["compiled"] + 1
    # An explicit tiling equal to the backend's default reaches the same operator.
    a, b = operands(p1)
    gwgrad.grouped_gemm_wgrad(a, b, offsets_tensor=p1.offsets, mma_tiler_mn=(128, 256),
                              cluster_shape_mn=(1, 1), wgrad_tensor=poisoned((4, 16, 24), "float32"))
    end = gwgrad.cache_info()
    assert {k: end[k] for k in ("operators", "constructed", "compiled")} == \
        {k: start[k] for k in ("operators", "constructed", "compiled")}
    assert end["plans"] == start["plans"] + 1  # a new call signature, the same operator


@pytest.mark.parametrize("change", ["wgrad_dtype", "accumulate", "a_major", "b_major", "order",
                                    "output_mode", "num_experts", "hidden", "tiling"])
def test_static_change_builds_a_new_operator(rng, change):
    p = bf16_problem(rng, counts=(8, 0, 24, 16))
    a, b = operands(p)
    gwgrad.grouped_gemm_wgrad(a, b, offsets_tensor=p.offsets, wgrad_dtype="float32")
    first = gwgrad.cache_info()
    kw = dict(offsets_tensor=p.offsets, wgrad_dtype="float32")
    if change == "wgrad_dtype":
        kw["wgrad_dtype"] = "float16"
    elif change == "accumulate":
        kw.update(accumulate_on_output=True, wgrad_tensor=random_output(rng, (4, 16, 24), "float32"))
    elif change == "a_major":
        a, b = operands(p, a_major="k")
    elif change == "b_major":
        a, b = operands(p, b_major="k")
    elif change == "order":
        kw["input_order"] = "tensor_ragged"
    elif change == "output_mode":
        kw["output_mode"] = "discrete"
    elif change == "num_experts":
        p = bf16_problem(rng, counts=(8, 40))
        a, b = operands(p)
        kw["offsets_tensor"] = p.offsets
    elif change == "hidden":
        p = bf16_problem(rng, hidden=24, counts=(8, 0, 24, 16))
        a, b = operands(p)
        kw["offsets_tensor"] = p.offsets
    elif change == "tiling":
        kw["mma_tiler_mn"] = (128, 128)
    gwgrad.grouped_gemm_wgrad(a, b, **kw)
    second = gwgrad.cache_info()
    assert second["operators"] == first["operators"] + 1
    assert second["constructed"] == first["constructed"] + 1
    assert second["compiled"] == first["compiled"] + 1


def test_class_lifecycle_dense_different_tokens_sum(rng):
    p = bf16_problem(rng, counts=(8, 0, 24, 16))
    a, b = operands(p)
    out = poisoned((4, 16, 24), "bfloat16")
    op = gwgrad.GroupedGemmWgradSm100(
        sample_a=a, sample_b=b, sample_sfa=None, sample_sfb=None, sample_offsets=p.offsets,
        sample_wgrad=out, acc_dtype="float32", input_order="tensor2d")
    assert op.check_support() is True
    op.compile()
    assert op.spec.mma_tiler_mn == (128, 256) and op.spec.arch == "cpu"
    for q in (p, bf16_problem(rng, counts=(100, 3, 0, 9))):
        qa, qb = operands(q)
        out = poisoned((4, 16, 24), "bfloat16")
        op.execute(a_tensor=qa, b_tensor=qb, sfa_tensor=None, sfb_tensor=None,
                   offsets_tensor=q.offsets, wgrad_tensor=out)
        np.testing.assert_allclose(out.astype(np.float64), q.expected(), rtol=1e-2, atol=1e-2)


def test_class_lifecycle_discrete(rng):
    p = bf16_problem(rng, counts=(8, 0, 24, 16))
    a, b = operands(p)
    outputs = [poisoned((16, 24), "float16") for _ in range(4)]
    op = gwgrad.GroupedGemmWgrad(
        sample_a=a, sample_b=b, sample_sfa=None, sample_sfb=None, sample_offsets=p.offsets,
        sample_wgrad_expert=outputs[0], num_experts=4, wgrad_shape=(16, 24), wgrad_dtype=np.float16)
    assert op.spec.output_mode == "discrete"
    op.compile()
    ptrs = np.array([o.ctypes.data for o in outputs], dtype=np.int64)
    op.execute(a, b, None, None, p.offsets, wgrad_ptrs=ptrs)
    np.testing.assert_allclose(np.stack(outputs), p.expected(), rtol=2e-3, atol=2e-3)
    stacked = poisoned((4, 16, 24), "float16")
    op.execute(a, b, None, None, p.offsets, wgrad_tensor=stacked)  # a stack stands for its pointers
    np.testing.assert_array_equal(stacked, np.stack(outputs))


def test_launch_plan_from_descriptors(rng):
    p = bf16_problem(rng, counts=(8, 0, 24, 16))
    a, b = operands(p)
    out = poisoned((4, 16, 24), "float32")
    offsets = gwgrad.as_tensor_desc(p.offsets, "offsets_tensor")
    plan = gwgrad.plan_for(a, b, offsets, wgrad=gwgrad.as_tensor_desc(out, "wgrad_tensor"))
    assert plan.tokens_sum == p.tokens_sum and plan.spec.arch == "cpu"
    assert gwgrad.plan_for(a, b, offsets, wgrad=gwgrad.as_tensor_desc(out, "w")) is plan
    plan.launch(a.ptr, b.ptr, offsets.ptr, out.ctypes.data)
    np.testing.assert_allclose(out, p.expected(), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="^wgrad_tensor: expected a 16-byte aligned"):
        plan.launch(a.ptr, b.ptr, offsets.ptr, out.ctypes.data + 4)


def test_torch_cpu_end_to_end(rng):
    torch = pytest.importorskip("torch")
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    dy = torch.randn(64, 16, dtype=torch.bfloat16)
    offsets = torch.tensor([16, 16, 40, 64], dtype=torch.int32)
    for mode in ("dense", "discrete"):
        (w,) = gwgrad.grouped_gemm_wgrad(x.T, dy, offsets_tensor=offsets, output_mode=mode)
        assert isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and w.shape == (4, 32, 16)
        bounds = [0, 16, 16, 40, 64]
        want = torch.stack([x[s:e].double().T @ dy[s:e].double()
                            for s, e in zip(bounds[:-1], bounds[1:])])
        err = (w.double() - want).norm() / want.norm()
        assert err < 1e-2
        assert (w[1] == 0).all()
    # K-major A (a contiguous (hidden, tokens_sum) tensor) and an int64 offsets tensor's error.
    (w,) = gwgrad.grouped_gemm_wgrad(x.T.contiguous(), dy, offsets_tensor=offsets,
                                     wgrad_dtype=torch.float32)
    assert w.dtype == torch.float32
    with pytest.raises(ValueError, match="^offsets_tensor: .*int32"):
        gwgrad.grouped_gemm_wgrad(x.T, dy, offsets_tensor=offsets.long())


# --- the CUDA path, with a stand-in backend -----------------------------------------------------

class Recorder(gwgrad.Backend):
    name = "recorder"
    tuning_rules = rules("recorder-tiling: -> 64x128 2x1") + REFERENCE

    def __init__(self):
        self.calls, self.compiled, self.checked = [], [], []

    def check_support(self, spec):
        self.checked.append(spec)

    def compile(self, spec):
        self.compiled.append(spec)
        return ("compiled", spec)

    def launch(self, compiled, spec, args):
        self.calls.append((compiled, spec, args))


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    monkeypatch.setitem(backends_mod._instances,
                        ("gwgrad.backends.bf16_sm100", "Bf16Sm100Backend"), rec)
    return rec


def cuda_desc(shape, strides, dtype, ptr):
    return from_pointer(ptr, shape, strides, dtype, 0)


def test_cuda_path_reaches_the_backend_with_a_final_spec(recorder):
    h, n, e, t = 64, 128, 4, 512
    a = cuda_desc((h, t), (1, h), DType.BFLOAT16, 1 << 32)
    b = cuda_desc((t, n), (n, 1), DType.BFLOAT16, 2 << 32)
    offsets = cuda_desc((e,), None, DType.INT32, 3 << 32)
    out = cuda_desc((e, h, n), None, DType.FLOAT32, 4 << 32)
    for tokens in (t, t // 2):  # tokens_sum is dynamic: one compile
        a = cuda_desc((h, tokens), (1, h), DType.BFLOAT16, 1 << 32)
        b = cuda_desc((tokens, n), (n, 1), DType.BFLOAT16, 2 << 32)
        result = gwgrad.grouped_gemm_wgrad(a, b, offsets_tensor=offsets, wgrad_tensor=out,
                                           current_stream=0x5000, validate_offsets=False)
        assert result["wgrad_tensor"] is out
    assert len(recorder.compiled) == 1
    spec = recorder.compiled[0]
    assert (spec.arch, spec.mma_tiler_mn, spec.cluster_shape_mn) == ("sm_100a", (64, 128), (2, 1))
    assert recorder.checked[-1] == spec
    (compiled, launched_spec, args), (_, _, args2) = recorder.calls
    assert compiled == ("compiled", spec) and launched_spec == spec
    assert (args.tokens_sum, args2.tokens_sum, args.stream, args.workspace) == (t, t // 2, 0x5000, 0)
    assert args.wgrad.ptr == out.ptr and args.wgrad_ptrs is None


def test_cuda_path_class_api_and_discrete_pointers(recorder):
    h, n, e, t = 64, 128, 4, 512
    a = cuda_desc((h, t), (t, 1), DType.BFLOAT16, 1 << 32)  # K-major
    b = cuda_desc((t, n), (n, 1), DType.BFLOAT16, 2 << 32)
    offsets = cuda_desc((e,), None, DType.INT32, 3 << 32)
    ptrs = cuda_desc((e,), None, DType.INT64, 5 << 32)
    expert = cuda_desc((h, n), None, DType.BFLOAT16, 6 << 32)
    op = gwgrad.GroupedGemmWgrad(a, b, None, None, offsets, sample_wgrad_expert=expert,
                                 num_experts=e, wgrad_shape=(h, n), wgrad_dtype="bfloat16",
                                 mma_tiler_mn=(128, 256), validate_offsets=False)
    op.compile()
    assert op.spec.mma_tiler_mn == (128, 256) and op.spec.cluster_shape_mn == (2, 1)
    assert op.spec.a_major == "k" and op.spec.output_mode == "discrete"
    op.execute(a, b, None, None, offsets, wgrad_ptrs=ptrs, current_stream=7)
    _, _, args = recorder.calls[-1]
    assert args.wgrad_ptrs.ptr == ptrs.ptr and args.stream == 7 and args.tokens_sum == t
    with pytest.raises(ValueError, match="^wgrad_ptrs:"):
        op.execute(a, b, None, None, offsets, wgrad_ptrs=cuda_desc((e,), None, DType.INT64, (5 << 32) + 8))
    with pytest.raises(ValueError, match="^a_tensor:"):
        op.execute(gwgrad.as_tensor_desc(np.zeros((h, t), np.float32), "a"), b, None, None, offsets,
                   wgrad_ptrs=ptrs)


def test_the_tokens_reach_the_tiling_choice(recorder, monkeypatch):
    """A tiling left to gwgrad may depend on the call's tokens (a rule on ``tokens``, tokens
    per expert): the functional API resolves it with each signature's tokens_sum, the class
    API with its sample's; a tiling the caller chose, even in part, is never replaced."""
    short = rules("short: open and tokens <= 64 -> 128x256 1x1")
    monkeypatch.setattr(recorder, "tuning_rules", short + Recorder.tuning_rules)
    h, n, e = 64, 128, 4
    offsets = cuda_desc((e,), None, DType.INT32, 3 << 32)
    out = cuda_desc((e, h, n), None, DType.FLOAT32, 4 << 32)

    def call(tokens, **kw):
        a = cuda_desc((h, tokens), (1, h), DType.BFLOAT16, 1 << 32)
        b = cuda_desc((tokens, n), (n, 1), DType.BFLOAT16, 2 << 32)
        gwgrad.grouped_gemm_wgrad(a, b, offsets_tensor=offsets, wgrad_tensor=out,
                                  current_stream=1, validate_offsets=False, **kw)
        return recorder.calls[-1][1]

    assert call(256).mma_tiler_mn == (128, 256)  # 64 tokens per expert
    assert call(1024).mma_tiler_mn == (64, 128)
    assert call(256).mma_tiler_mn == (128, 256)  # the cached plan
    assert len(recorder.compiled) == 2
    assert call(256, mma_tiler_mn=(64, 256)).mma_tiler_mn == (64, 256)
    chosen = call(256, cluster_shape_mn=(1, 1))  # the cluster chosen: the token rule is out
    assert (chosen.mma_tiler_mn, chosen.cluster_shape_mn) == ((64, 128), (1, 1))
    a = cuda_desc((h, 128), (1, h), DType.BFLOAT16, 1 << 32)
    b = cuda_desc((128, n), (n, 1), DType.BFLOAT16, 2 << 32)
    op = gwgrad.GroupedGemmWgrad(a, b, None, None, offsets, out, validate_offsets=False)
    op.compile()
    assert op.spec.mma_tiler_mn == (128, 256)  # its sample: 32 tokens per expert
    a2 = cuda_desc((h, 2048), (1, h), DType.BFLOAT16, 1 << 32)
    b2 = cuda_desc((2048, n), (n, 1), DType.BFLOAT16, 2 << 32)
    op.execute(a2, b2, None, None, offsets, out, current_stream=1)  # any tokens_sum runs
    assert recorder.calls[-1][2].tokens_sum == 2048 and recorder.calls[-1][1] == op.spec


def test_a_backend_without_rules_of_its_own():
    """A backend that names no rule table gets the reference's: a tiling some GPU kernel runs,
    every tuning field set."""
    class Minimal(gwgrad.Backend):
        def check_support(self, spec):
            pass

        def compile(self, spec):
            return None

        def launch(self, compiled, spec, args):
            pass

    from kernel_compile import spec

    assert Minimal().tuning_rules == REFERENCE
    tuning = resolve(Minimal().tuning_rules, spec("cpu"))
    assert (tuning.mma_tiler_mn, tuning.cluster_shape_mn) == ((128, 256), (1, 1))
    assert tuning.raster_group and tuning.epi_buffer_sets and tuning.unit_schedule
    assert Minimal().workspace_bytes(None) == 0


def test_spec_is_the_cache_key(rng):
    p = bf16_problem(rng)
    a, b = operands(p)
    gwgrad.grouped_gemm_wgrad(a, b, offsets_tensor=p.offsets)
    from gwgrad import plan

    keys = list(plan._compiled)
    assert all(isinstance(k, gwgrad.StaticSpec) for k in keys)
    assert dataclasses.replace(keys[0]) == keys[0] and hash(dataclasses.replace(keys[0])) == hash(keys[0])
