"""The two-pass MXFP8 path on SM90 (Tuning.mainloop=2: kernels/sm90_mxfp8_bf16.py): its
selection and refusals, its workspace rule, and the exactness of its conversion (the NumPy
model gwgrad.formats.mx_to_bf16, which the GPU tests use as their reference)."""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest

from gwgrad import formats
from gwgrad.errors import ArgumentError, UnsupportedError

from kernel_compile import fp8_spec, spec as bf16_spec


def test_mx_to_bf16_exact_inside_the_documented_codes():
    """x * 2^(s-127) is a BF16 number for every E4M3 code with scale codes 3..246 and every
    E5M2 code with 10..239 (the module doc's ranges); just outside them some product is not."""
    codes = np.arange(256, dtype=np.uint8)
    for fmt, lo, hi in (("e4m3", 3, 246), ("e5m2", 10, 239)):
        x = formats.decode_codes(codes, fmt)
        finite = np.isfinite(x)
        for s in range(256):
            got = formats.mx_to_bf16(codes, fmt, np.full(256, s))
            exact = x * np.ldexp(1.0, s - 127)
            same = got[finite] == exact[finite]
            if lo <= s <= hi:
                assert same.all(), (fmt, s)
            elif s in (lo - 1, hi + 1):
                assert not same.all(), (fmt, s)


def test_mx_to_bf16_special_codes():
    e4m3 = formats.decode_codes(np.arange(256, dtype=np.uint8), "e4m3")
    one = 0x38  # E4M3 1.0
    assert formats.mx_to_bf16(np.array([one]), "e4m3", np.array([0x00]))[0] == 2.0 ** -127
    assert np.isnan(formats.mx_to_bf16(np.array([one]), "e4m3", np.array([0xFF]))[0])
    assert np.isnan(formats.mx_to_bf16(np.array([0]), "e4m3", np.array([0xFF]))[0])
    assert np.isnan(formats.mx_to_bf16(np.array([0x7F]), "e4m3", np.array([127]))[0])
    # 448 * 2^127 is past BF16's largest finite value: +Inf; -448 * 2^127: -Inf.
    assert formats.mx_to_bf16(np.array([0x7E]), "e4m3", np.array([254]))[0] == np.inf
    assert formats.mx_to_bf16(np.array([0xFE]), "e4m3", np.array([254]))[0] == -np.inf
    # The smallest E4M3 denormal (2^-9) times 2^-127 = 2^-136 rounds to 0 (BF16's smallest
    # denormal is 2^-133); times 2^-124 it is 2^-133 exactly.
    assert formats.mx_to_bf16(np.array([1]), "e4m3", np.array([0]))[0] == 0.0
    assert formats.mx_to_bf16(np.array([1]), "e4m3", np.array([3]))[0] == 2.0 ** -133
    # E5M2 Inf stays Inf under a finite scale.
    assert formats.mx_to_bf16(np.array([0x7C]), "e5m2", np.array([1]))[0] == np.inf
    assert e4m3[one] == 1.0


#: The tests below run the kernels' predicates (which import the CuTe DSL).
needs_dsl = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None,
                               reason="needs the CuTe DSL")


def two_pass(**kw):
    return fp8_spec("sm_90a", "blocked", **kw).with_tuning(mainloop=2)


@needs_dsl
def test_mainloop_2_selects_the_two_pass_backend_with_bf16_tilings():
    from gwgrad.backends import finalize_spec
    from gwgrad.backends.fp8_sm90 import Fp8Sm90Backend, Mxfp8Bf16Sm90Backend

    s, backend = finalize_spec(two_pass(hidden=7168, intermediate=4096, experts=32))
    assert isinstance(backend, Mxfp8Bf16Sm90Backend)
    # The BF16 kernel's defaults for the same problem with BF16 K-major operands.
    twin, _ = finalize_spec(bf16_spec("sm_90a", hidden=7168, intermediate=4096, experts=32,
                                      a_major="k", b_major="k"))
    assert s.tuning == dataclasses.replace(twin.tuning, mainloop=2, launches=2)
    assert (s.mma_tiler_mn, s.cluster_shape_mn) == ((128, 128), (1, 2))
    # The default stays the promoting kernel.
    s, backend = finalize_spec(fp8_spec("sm_90a", "blocked", hidden=7168, intermediate=4096,
                                        experts=32))
    assert type(backend) is Fp8Sm90Backend and s.mainloop == 1
    assert s.mma_tiler_mn == (64, 128)


@needs_dsl
@pytest.mark.parametrize("kw,argument", [
    (dict(global_scales=True), "global_scale_a"),
    (dict(order="tensor_ragged"), "input_order"),
])
def test_mainloop_2_refusals(kw, argument):
    from gwgrad.backends import finalize_spec

    with pytest.raises(ArgumentError, match=argument):
        finalize_spec(two_pass(**kw))


@needs_dsl
def test_mainloop_2_refused_elsewhere():
    from gwgrad.backends import finalize_spec

    with pytest.raises(ArgumentError, match="mainloop"):  # FP32 scale recipes
        finalize_spec(fp8_spec("sm_90a", "block_1x128").with_tuning(mainloop=2))
    with pytest.raises(ArgumentError, match="mainloop"):  # BF16 operands
        finalize_spec(bf16_spec("sm_90a").with_tuning(mainloop=2))
    with pytest.raises(ArgumentError, match="mainloop"):  # SM100
        finalize_spec(fp8_spec("sm_100a", "blocked").with_tuning(mainloop=2))
    with pytest.raises(ArgumentError, match="mainloop"):  # no such mainloop
        finalize_spec(fp8_spec("sm_90a", "blocked").with_tuning(mainloop=3))
    with pytest.raises(ArgumentError, match="launches"):  # the capacity check needs 2
        finalize_spec(two_pass().with_tuning(launches=1))
    with pytest.raises(ArgumentError, match="launches"):
        finalize_spec(two_pass().with_tuning(launches=3))


@needs_dsl
def test_two_pass_workspace_rule():
    """The BF16 kernel's workspace first (its leading words zeroed like every GEMM's), the
    expert table, then 2 bytes per value of A and B per token; a plan adds the per-token part
    for its tokens_sum."""
    from gwgrad.backends import finalize_spec
    from gwgrad.kernels import sm90_mxfp8_bf16 as K

    s, backend = finalize_spec(two_pass(hidden=512, intermediate=768, experts=8))
    cfg = backend.config(s)
    gemm = K.gemm_config(cfg)
    assert gemm.ab_dtype == "bfloat16" and gemm.scale_recipe == "" and gemm.count_multiple == 32
    assert gemm.sf_rule == (32, 4)  # the prep kernel checks the scale tensors' capacity
    assert K.table_offset(cfg) >= gemm.workspace_bytes
    assert K.copies_offset(cfg) >= K.table_offset(cfg) + 16 * 8 + 32
    assert K.copies_offset(cfg) % 128 == 0
    assert backend.workspace_bytes(s) == K.workspace_base(cfg)
    assert K.workspace_per_token(cfg) == 2 * (512 + 768)
    kernel = backend.make_kernel(s)
    assert (kernel.workspace_base, kernel.workspace_per_token) == (K.workspace_base(cfg),
                                                                    2 * (512 + 768))


@needs_dsl
def test_launch_plan_adds_the_per_token_workspace():
    from gwgrad import plan as P
    from gwgrad.dtypes import DType
    from gwgrad.tensors import TensorDesc

    s = dataclasses.replace(two_pass(hidden=512, intermediate=768, experts=8), arch="sm_90a")

    class Backend:
        def launcher(self, *args):
            return None

    op = P.CompiledOperator.__new__(P.CompiledOperator)
    op.spec, op.backend, op.handle = s, Backend(), None
    op.workspace_bytes, op.workspace_per_token = 4096, 2 * (512 + 768)
    T = 1024
    a = TensorDesc(0, (512, T), (T, 1), DType.FLOAT8_E4M3FN, "cuda", 0)
    b = TensorDesc(0, (T, 768), (1, T), DType.FLOAT8_E4M3FN, "cuda", 0)
    offs = TensorDesc(0, (8,), (1,), DType.INT32, "cuda", 0)
    plan = P.LaunchPlan(op, a, b, offs, None, None)
    assert plan.workspace_bytes == 4096 + 2 * (512 + 768) * T


@needs_dsl
def test_jax_custom_call_refuses_the_two_pass_path():
    from gwgrad import plan as P

    with pytest.raises(UnsupportedError, match="mainloop"):
        P.ffi_gemm(two_pass(), [], 1024, 1)


def test_two_pass_is_the_default_where_gwgrad_sizes_the_workspace():
    """backends.mxfp8_two_pass: MXFP8 on SM90 with the mainloop open, tensor2d operands, no
    global scales and no tile or a BF16 one takes mainloop=2; anything else is unchanged
    (plan.plan_for asks only with grow_workspace=True: the wrapper without a caller's
    workspace)."""
    from gwgrad.backends import mxfp8_two_pass

    base = fp8_spec("sm_90a", "blocked", hidden=512, intermediate=768)
    assert mxfp8_two_pass(base).mainloop == 2
    assert mxfp8_two_pass(base.with_tuning(mma_tiler_mn=(128, 192))).mainloop == 2
    assert mxfp8_two_pass(fp8_spec("sm_90a", "blocked", a="e5m2", b="e5m2")).mainloop == 2
    unchanged = [
        fp8_spec("sm_90a", "blocked", global_scales=True),
        fp8_spec("sm_90a", "blocked", order="tensor_ragged"),
        base.with_tuning(mma_tiler_mn=(64, 192)),  # an FP8-only tile
        base.with_tuning(mainloop=1),
        fp8_spec("sm_90a", "per_expert_channel"),
        fp8_spec("sm_90a", "block_1x128"),
        fp8_spec("sm_100a", "blocked"),
        bf16_spec("sm_90a"),
    ]
    for request in unchanged:
        assert mxfp8_two_pass(request) is request, request


def test_the_wrappers_plan_follows_who_owns_the_workspace(monkeypatch):
    """The wrapper's plan key tells a call with a caller-owned workspace from one without, and
    only the latter asks plan_for for a growing workspace."""
    from gwgrad import api, plan as gwplan

    asked = []

    def plan_for(*args, grow_workspace=False, **kw):
        asked.append(grow_workspace)
        raise RuntimeError("stop here")

    monkeypatch.setattr(gwplan, "plan_for", plan_for)
    torch = pytest.importorskip("torch")
    a, b = torch.zeros(64, 32, dtype=torch.bfloat16), torch.zeros(32, 48, dtype=torch.bfloat16)
    offs = torch.tensor([32], dtype=torch.int32)
    for workspace in (None, torch.zeros(1 << 16, dtype=torch.uint8)):
        with pytest.raises(RuntimeError, match="stop here"):
            api.grouped_gemm_wgrad(a, b, offsets_tensor=offs, descriptor_workspace=workspace)
    assert asked == [True, False]
