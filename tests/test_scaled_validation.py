"""Block-scaled inputs' static rules (gwgrad/validation.py): every accepted and rejected
combination of operand dtypes, scale dtypes, ``sf_vec_size`` and ``scale_recipe``, the scale
tensors' shapes per recipe, global scales, and the offsets' capacity check (SCALES_TOO_SMALL,
naming ``sfa_tensor``) on the host and as a device status record."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import gwgrad
from gwgrad import DType, from_pointer, status
from gwgrad.errors import ArgumentError
from gwgrad.offsets import (SCALES_TOO_SMALL, check_offsets_values, check_values, find_problem,
                            problem_argument, problem_detail, token_count_multiple)
from gwgrad.scales import column_rule
from gwgrad.validation import build_spec, check_call, scale_capacity

H, N, E, T = 64, 160, 4, 256  # hidden, intermediate (not a multiple of 128), experts, tokens
BASE_PTR = 1 << 20
E4M3, E5M2, FP4 = DType.FLOAT8_E4M3FN, DType.FLOAT8_E5M2, DType.FLOAT4_E2M1FN_X2
E8M0, F32 = DType.FLOAT8_E8M0FNU, DType.FLOAT32


def d(shape, strides=None, dtype=DType.BFLOAT16, ptr=BASE_PTR, device="cpu"):
    return from_pointer(ptr, shape, strides, dtype, 0, device_type=device)


def gs(n=E, dtype=F32, strides=None):
    return d((n,), strides, dtype)


def operands(a_dtype, b_dtype):
    if a_dtype == FP4:
        a = d((H, T // 2), (T // 2, 1), a_dtype)
    else:
        a = d((H, T), (T, 1), a_dtype)
    if b_dtype == FP4:
        b = d((T // 2, N), (1, T // 2), b_dtype)
    else:
        b = d((T, N), (1, T), b_dtype)
    return a, b


def blocked(a_dtype=E4M3, b_dtype=None, sf=E8M0, vec=32, **changes):
    a, b = operands(a_dtype, b_dtype or a_dtype)
    cols = -(-T // vec // 4) * 4
    kw = dict(a=a, b=b, offsets=d((E,), None, DType.INT32), wgrad=d((E, H, N)),
              sfa=d((128, cols), None, sf), sfb=d((256, cols), None, sf), sf_vec_size=vec,
              arch="sm_100a")
    kw.update(changes)
    return kw


def fp32(recipe, a_dtype=E4M3, b_dtype=None, **changes):
    a, b = operands(a_dtype, b_dtype or a_dtype)
    if recipe == "per_expert_channel":
        sfa, sfb = d((E, H), None, F32), d((E, N), None, F32)
    else:
        sfa, sfb = d((T // 128 + E, H), None, F32), d((T // 128 + E, N), None, F32)
    kw = dict(a=a, b=b, offsets=d((E,), None, DType.INT32), wgrad=d((E, H, N)), sfa=sfa, sfb=sfb,
              scale_recipe=recipe, arch="sm_90a")
    kw.update(changes)
    return kw


def raises(name, **kw):
    with pytest.raises(ArgumentError) as info:
        build_spec(**kw)
    assert info.value.argument == name, str(info.value)
    assert "expected" in str(info.value) and "got" in str(info.value)
    return str(info.value)


# --- accepted ---------------------------------------------------------------------------------

ACCEPTED = {
    "MXFP8 e4m3": (blocked(), ("blocked", 32, E8M0, False)),
    "MXFP8 e5m2": (blocked(E5M2), ("blocked", 32, E8M0, False)),
    "MXFP8 recipe named": (blocked(scale_recipe="blocked"), ("blocked", 32, E8M0, False)),
    "MXFP8 with global scales": (blocked(global_scale_a=gs(), global_scale_b=gs()),
                                 ("blocked", 32, E8M0, True)),
    "MXFP8 M/N-major": (blocked(a=d((H, T), (1, H), E4M3), b=d((T, N), (N, 1), E4M3)),
                        ("blocked", 32, E8M0, False)),
    "NVFP4": (blocked(FP4, sf=E4M3, vec=16, global_scale_a=gs(), global_scale_b=gs()),
              ("blocked", 16, E4M3, True)),
    "MXFP4": (blocked(FP4), ("blocked", 32, E8M0, False)),
    "MXFP4 with global scales": (blocked(FP4, global_scale_a=gs(), global_scale_b=gs()),
                                 ("blocked", 32, E8M0, True)),
    "per_expert_channel e4m3": (fp32("per_expert_channel"), ("per_expert_channel", 0, F32, False)),
    "per_expert_channel e4m3 x e5m2": (fp32("per_expert_channel", E4M3, E5M2),
                                       ("per_expert_channel", 0, F32, False)),
    "per_expert_channel e5m2 x e4m3": (fp32("per_expert_channel", E5M2, E4M3),
                                       ("per_expert_channel", 0, F32, False)),
    "per_expert_channel flat": (fp32("per_expert_channel", sfa=d((E * H,), None, F32),
                                     sfb=d((E * N,), None, F32)),
                                ("per_expert_channel", 0, F32, False)),
    "per_expert_channel global scales": (fp32("per_expert_channel", global_scale_a=gs(),
                                              global_scale_b=gs()),
                                         ("per_expert_channel", 0, F32, True)),
    "block_1x128 default vec": (fp32("block_1x128"), ("block_1x128", 128, F32, False)),
    "block_1x128 vec 128": (fp32("block_1x128", E5M2, E5M2, sf_vec_size=128),
                            ("block_1x128", 128, F32, False)),
    "block_1x128 mixed, global scales": (fp32("block_1x128", E5M2, E4M3, global_scale_a=gs(),
                                              global_scale_b=gs()),
                                         ("block_1x128", 128, F32, True)),
    "block_1x128 exact rows": (fp32("block_1x128", sfa=d((2, H), None, F32),
                                    sfb=d((2, N), None, F32)), ("block_1x128", 128, F32, False)),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_accepted(case):
    kw, (recipe, vec, sf, has_gs) = ACCEPTED[case]
    spec = build_spec(**kw)
    assert spec.is_block_scaled
    assert (spec.scale_recipe, spec.sf_vec_size, spec.sf_dtype, spec.has_global_scale) == \
        (recipe, vec, sf, has_gs)
    fp4 = spec.a_dtype == DType.FLOAT4_E2M1FN_X2
    assert token_count_multiple(spec) == ((64 if fp4 else 32) if recipe == "blocked" else 16)
    assert spec.a_dtype == kw["a"].dtype and spec.b_dtype == kw["b"].dtype
    hash(spec)
    # the per-call check accepts the tensors the spec was built from
    check_call(spec, kw["a"], kw["b"], kw["offsets"], sfa=kw["sfa"], sfb=kw["sfb"],
               global_scale_a=kw.get("global_scale_a"), global_scale_b=kw.get("global_scale_b"),
               wgrad=kw["wgrad"])


def test_nvfp4_and_mxfp4_pass_validation_on_cuda_descriptors():
    # The SM90 backend refuses FP4 later (RuntimeError); validation itself accepts it.
    cuda = {k: (dataclasses.replace(v, device_type="cuda") if hasattr(v, "device_type") else v)
            for k, v in blocked(FP4, sf=E4M3, vec=16, global_scale_a=gs(), global_scale_b=gs()).items()}
    assert build_spec(**dict(cuda, arch="sm_90a")).arch == "sm_90a"


def test_bf16_spec_has_no_recipe():
    kw = dict(a=d((H, T), (1, H)), b=d((T, N), (N, 1)), offsets=d((E,), None, DType.INT32),
              wgrad=d((E, H, N)), arch="sm_90a")
    assert build_spec(**kw).scale_recipe is None
    assert "bfloat16" in raises("scale_recipe", **dict(kw, scale_recipe="blocked"))
    raises("scale_recipe", **dict(kw, scale_recipe="per_expert_channel"))


# --- rejected: formats ------------------------------------------------------------------------

REJECTED = {
    # blocked formats: exactly MXFP8, NVFP4, MXFP4
    "MXFP8 mixed e4m3 x e5m2": ("b_tensor", blocked(E4M3, E5M2)),
    "MXFP8 mixed e5m2 x e4m3": ("b_tensor", blocked(E5M2, E4M3)),
    "FP8 with e4m3 scales": ("sfa_tensor", blocked(sf=E4M3, vec=16)),
    "FP8 with e4m3 scales vec 32": ("sfa_tensor", blocked(sf=E4M3)),
    "MXFP8 vec 16": ("sf_vec_size", blocked(vec=16)),
    "MXFP8 vec 64": ("sf_vec_size", blocked(vec=64)),
    "NVFP4 vec 32": ("sf_vec_size", blocked(FP4, sf=E4M3, vec=32, global_scale_a=gs(),
                                            global_scale_b=gs())),
    "NVFP4 without global scales": ("global_scale_a", blocked(FP4, sf=E4M3, vec=16)),
    "NVFP4 one-element global scales": ("global_scale_a", blocked(
        FP4, sf=E4M3, vec=16, global_scale_a=gs(1), global_scale_b=gs(1))),
    "FP4 with e8m0 at 16": ("sf_vec_size", blocked(FP4, vec=16)),
    "FP4 x FP8": ("b_tensor", blocked(FP4, E4M3)),
    "FP8 x FP4": ("b_tensor", blocked(E4M3, FP4)),
    "FP8 x BF16": ("b_tensor", blocked(E4M3, DType.BFLOAT16)),
    "scale dtype uint8": ("sfa_tensor", blocked(sf=DType.UINT8)),
    "scale dtype float16": ("sfa_tensor", blocked(sf=DType.FLOAT16)),
    "sfb dtype differs": ("sfb_tensor", blocked(sfb=d((256, 8), None, E4M3))),
    "sfb float32 with e8m0 sfa": ("sfb_tensor", blocked(sfb=d((256, 8), None, F32))),
    "e8m0 with an FP32 recipe": ("scale_recipe", blocked(scale_recipe="per_expert_channel")),
    "unknown recipe": ("scale_recipe", blocked(scale_recipe="tensorwise")),
    "sfa missing": ("sfa_tensor", blocked(sfa=None)),
    "sfb missing": ("sfb_tensor", blocked(sfb=None)),
    # FP32 recipes
    "FP32 scales without a recipe": ("scale_recipe", fp32(None)),
    "FP32 scales with blocked": ("scale_recipe", fp32("blocked")),
    "FP32 scales with FP4": ("a_tensor", fp32("per_expert_channel", FP4)),
    "per_expert_channel vec 32": ("sf_vec_size", fp32("per_expert_channel", sf_vec_size=32)),
    "per_expert_channel vec 128": ("sf_vec_size", fp32("per_expert_channel", sf_vec_size=128)),
    "block_1x128 vec 32": ("sf_vec_size", fp32("block_1x128", sf_vec_size=32)),
    "block_1x128 vec 64": ("sf_vec_size", fp32("block_1x128", sf_vec_size=64)),
    # global scales: FP32 (E,) contiguous, both or neither
    "one global scale": ("global_scale_b", blocked(global_scale_a=gs())),
    "other global scale": ("global_scale_a", fp32("block_1x128", global_scale_b=gs())),
    "global scale float16": ("global_scale_a", blocked(global_scale_a=gs(dtype=DType.FLOAT16),
                                                       global_scale_b=gs())),
    "global scale one element": ("global_scale_b", fp32("per_expert_channel", global_scale_a=gs(),
                                                        global_scale_b=gs(1))),
    "global scale strided": ("global_scale_a", blocked(global_scale_a=gs(strides=(2,)),
                                                       global_scale_b=gs())),
    "global scale 2-D": ("global_scale_a", blocked(global_scale_a=d((E, 1), None, F32),
                                                   global_scale_b=gs())),
}


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_rejected(case):
    name, kw = REJECTED[case]
    raises(name, **kw)


def test_messages_list_what_is_accepted():
    assert "'per_expert_channel' or 'block_1x128'" in raises("scale_recipe", **fp32(None))
    assert "MXFP8" in raises("sf_vec_size", **blocked(vec=16))
    assert "NVFP4" in raises("global_scale_a", **blocked(FP4, sf=E4M3, vec=16))
    assert "float8_e8m0fnu" in raises("sfa_tensor", **blocked(sf=E4M3, vec=16))


# --- rejected: shapes per recipe --------------------------------------------------------------

SHAPES = {
    # blocked: (round_up(rows, 128), C), C % 4 == 0, C >= round_up(ceil(T / vec), 4), compact
    "blocked rows unpadded": ("sfa_tensor", blocked(sfa=d((H, 8), None, E8M0))),
    "blocked C not multiple of 4": ("sfa_tensor", blocked(sfa=d((128, 10), None, E8M0),
                                                          sfb=d((256, 10), None, E8M0))),
    "blocked C too small": ("sfa_tensor", blocked(sfa=d((128, 4), None, E8M0),
                                                  sfb=d((256, 4), None, E8M0))),
    "blocked 1-D": ("sfa_tensor", blocked(sfa=d((128 * 8,), None, E8M0))),
    "blocked strided": ("sfa_tensor", blocked(sfa=d((128, 8), (1, 128), E8M0))),
    "blocked padded rows": ("sfa_tensor", blocked(sfa=d((128, 8), (16, 1), E8M0))),
    "blocked sfb rows": ("sfb_tensor", blocked(sfb=d((160, 8), None, E8M0))),
    "blocked sfb other C": ("sfb_tensor", blocked(sfb=d((256, 12), None, E8M0))),
    "blocked sfb strided": ("sfb_tensor", blocked(sfb=d((256, 8), (1, 256), E8M0))),
    "NVFP4 C too small": ("sfa_tensor", blocked(FP4, sf=E4M3, vec=16, global_scale_a=gs(),
                                                global_scale_b=gs(),
                                                sfa=d((128, 8), None, E4M3),
                                                sfb=d((256, 8), None, E4M3))),
    # per_expert_channel: (E, rows) or (E * rows,), contiguous
    "channel sfa width": ("sfa_tensor", fp32("per_expert_channel", sfa=d((E, H + 16), None, F32))),
    "channel sfa experts": ("sfa_tensor", fp32("per_expert_channel", sfa=d((E + 1, H), None, F32))),
    "channel sfa transposed": ("sfa_tensor", fp32("per_expert_channel", sfa=d((E, H), (1, E), F32))),
    "channel sfa flat wrong": ("sfa_tensor", fp32("per_expert_channel", sfa=d((H,), None, F32))),
    "channel sfb width": ("sfb_tensor", fp32("per_expert_channel", sfb=d((E, H), None, F32))),
    "channel sfb strided": ("sfb_tensor", fp32("per_expert_channel", sfb=d((E * N,), (2,), F32))),
    # block_1x128: (R, rows) contiguous, R >= ceil(T / 128), sfb with the same R
    "1x128 R too small": ("sfa_tensor", fp32("block_1x128", sfa=d((1, H), None, F32),
                                             sfb=d((1, N), None, F32))),
    "1x128 sfa width": ("sfa_tensor", fp32("block_1x128", sfa=d((6, N), None, F32))),
    "1x128 sfa transposed": ("sfa_tensor", fp32("block_1x128", sfa=d((H, 6), None, F32))),
    "1x128 sfa strided": ("sfa_tensor", fp32("block_1x128", sfa=d((6, H), (1, 6), F32))),
    "1x128 sfb other R": ("sfb_tensor", fp32("block_1x128", sfb=d((7, N), None, F32))),
    "1x128 sfb width": ("sfb_tensor", fp32("block_1x128", sfb=d((6, H), None, F32))),
    # alignment of scale tensors
    "sfa misaligned": ("sfa_tensor", blocked(sfa=d((128, 8), None, E8M0, ptr=BASE_PTR + 4))),
    "sfb misaligned": ("sfb_tensor", fp32("per_expert_channel",
                                          sfb=d((E, N), None, F32, ptr=BASE_PTR + 4))),
}


@pytest.mark.parametrize("case", sorted(SHAPES))
def test_scale_shapes(case):
    name, kw = SHAPES[case]
    raises(name, **kw)


def test_blocked_shape_message():
    msg = raises("sfa_tensor", **blocked(sfa=d((128, 4), None, E8M0), sfb=d((256, 4), None, E8M0)))
    assert msg == ("sfa_tensor: expected shape (round_up(hidden, 128), C) = (128, C) with C a "
                   "multiple of 4 and C >= round_up(ceil(tokens_sum / 32), 4) = 8 (blocked "
                   "scales), got shape (128, 4)")


@pytest.mark.parametrize("make,ok_tokens,bad_tokens", [
    (lambda t: blocked(a=d((H, t), (t, 1), E4M3), b=d((t, N), (1, t), E4M3),
                       sfa=d((128, 16), None, E8M0), sfb=d((256, 16), None, E8M0)), 96, 112),
    (lambda t: fp32("per_expert_channel", a=d((H, t), (t, 1), E4M3), b=d((t, N), (1, t), E5M2)),
     48, 40),
    (lambda t: fp32("block_1x128", a=d((H, t), (t, 1), E4M3), b=d((t, N), (1, t), E4M3)), 48, 56),
])
def test_tokens_sum_multiple_per_recipe(make, ok_tokens, bad_tokens):
    build_spec(**make(ok_tokens))
    assert "multiple of" in raises("a_tensor", **make(bad_tokens))


def test_check_call_applies_the_same_rules():
    kw = blocked(global_scale_a=gs(), global_scale_b=gs())
    spec = build_spec(**kw)
    args = dict(sfa=kw["sfa"], sfb=kw["sfb"], global_scale_a=kw["global_scale_a"],
                global_scale_b=kw["global_scale_b"], wgrad=kw["wgrad"])

    def call_raises(name, **changes):
        a = changes.pop("a", kw["a"])
        b = changes.pop("b", kw["b"])
        with pytest.raises(ArgumentError) as info:
            check_call(spec, a, b, kw["offsets"], **dict(args, **changes))
        assert info.value.argument == name, str(info.value)

    assert check_call(spec, kw["a"], kw["b"], kw["offsets"], **args) == T
    call_raises("sfa_tensor", sfa=d((128, 6), None, E8M0))
    call_raises("sfb_tensor", sfb=d((256, 12), None, E8M0))
    call_raises("sfb_tensor", sfb=d((256, 8), None, E4M3))
    call_raises("global_scale_a", global_scale_a=gs(1))
    call_raises("global_scale_b", global_scale_b=None)
    # more tokens need more columns than this sfa holds (round_up(512 / 32, 4) = 16 > 8)
    call_raises("sfa_tensor", a=d((H, 512), (512, 1), E4M3), b=d((512, N), (1, 512), E4M3))
    # block_1x128: R >= ceil(T / 128) per call; per_expert_channel: (E, rows)
    kw2 = fp32("block_1x128")
    spec2 = build_spec(**kw2)
    with pytest.raises(ArgumentError, match="^sfa_tensor:"):
        check_call(spec2, d((H, 1024), (1024, 1), E4M3), d((1024, N), (1, 1024), E4M3),
                   kw2["offsets"], sfa=kw2["sfa"], sfb=kw2["sfb"], wgrad=kw2["wgrad"])
    kw3 = fp32("per_expert_channel")
    spec3 = build_spec(**kw3)
    with pytest.raises(ArgumentError, match="^sfb_tensor:"):
        check_call(spec3, kw3["a"], kw3["b"], kw3["offsets"], sfa=kw3["sfa"],
                   sfb=d((E, H), None, F32), wgrad=kw3["wgrad"])


def test_scale_capacity():
    kw = blocked(sfa=d((128, 20), None, E8M0), sfb=d((256, 20), None, E8M0))
    assert scale_capacity(build_spec(**kw), kw["sfa"]) == 20
    kw = fp32("block_1x128")
    assert scale_capacity(build_spec(**kw), kw["sfa"]) == T // 128 + E
    kw = fp32("per_expert_channel")
    assert scale_capacity(build_spec(**kw), kw["sfa"]) == 0
    bf16 = build_spec(a=d((H, T), (1, H)), b=d((T, N), (N, 1)), offsets=d((E,), None, DType.INT32),
                      wgrad=d((E, H, N)), arch="sm_90a")
    assert scale_capacity(bf16, None) == 0


# --- the offsets' capacity check ----------------------------------------------------------------

def test_find_problem_scales_too_small():
    rule = column_rule("blocked", 32)
    offsets = np.cumsum([32, 0, 96, 32])  # columns 4, 0, 4, 4: 12 in all
    assert find_problem(offsets, 160, 32, rule, 12) is None
    assert find_problem(offsets, 160, 32, rule, 8) == (SCALES_TOO_SMALL, 3, 12, 8)
    assert find_problem(offsets, 160, 32, rule, 0) == (SCALES_TOO_SMALL, 0, 4, 0)
    assert find_problem(offsets, 160, 32) is None  # no rule: not checked
    # the other problems come first
    assert find_problem(np.array([32, 16]), 16, 32, rule, 0)[0] == 1
    assert find_problem(np.array([32, 64]), 96, 32, rule, 0)[0] == 2
    assert find_problem(np.array([16, 64]), 64, 32, rule, 0)[0] == 3
    rows = column_rule("block_1x128", 128)
    assert find_problem(np.cumsum([16, 16, 256]), 288, 16, rows, 3) == (SCALES_TOO_SMALL, 2, 4, 3)


def test_capacity_message_names_sfa_tensor():
    spec = build_spec(**blocked(a=d((H, 160), (160, 1), E4M3), b=d((160, N), (1, 160), E4M3),
                                sfa=d((128, 8), None, E8M0), sfb=d((256, 8), None, E8M0)))
    offsets = np.cumsum([32, 0, 96, 32])
    check_offsets_values(offsets, 160, spec)  # without a capacity: not checked
    check_offsets_values(offsets, 160, spec, capacity=12)
    with pytest.raises(ArgumentError) as info:
        check_offsets_values(offsets, 160, spec, capacity=8)
    assert str(info.value) == ("sfa_tensor: expected at least 12 scale columns for experts 0..3 "
                               "with these offsets (sum of round_up(ceil(count/32), 4)), got 8")
    nvfp4 = dataclasses.replace(spec, a_dtype=FP4, b_dtype=FP4, sf_dtype=E4M3, sf_vec_size=16)
    with pytest.raises(ArgumentError, match=r"^sfa_tensor: expected at least 4 scale columns for "
                                            r"expert 0 .*ceil\(count/16\), 4\)\), got 2"):
        check_offsets_values(np.array([64, 64, 192, 192]), 192, nvfp4, capacity=2)
    # FP4 GEMMs take counts that are multiples of 64 (one block-scaled MMA step)
    with pytest.raises(ArgumentError, match=r"^offsets_tensor: expected every expert's token "
                                            r"count to be a multiple of 64 \(packed FP4"):
        check_offsets_values(np.array([32, 64, 192, 192]), 192, nvfp4, capacity=16)
    # block_1x128 counts rows
    spec = build_spec(**fp32("block_1x128"))
    with pytest.raises(ArgumentError, match=r"^sfa_tensor: expected at least 3 scale rows for "
                                            r"experts 0..2 with these offsets \(sum of "
                                            r"ceil\(count/128\)\), got 2"):
        check_offsets_values(np.cumsum([16, 0, 144, 96]), 256, spec, capacity=2)
    # per_expert_channel has no capacity to check
    check_offsets_values(np.cumsum([16, 0, 144, 96]), 256, build_spec(**fp32("per_expert_channel")),
                         capacity=0)


def test_host_check_values_with_capacity():
    spec = build_spec(**blocked(a=d((H, 160), (160, 1), E4M3), b=d((160, N), (1, 160), E4M3),
                                sfa=d((128, 8), None, E8M0), sfb=d((256, 8), None, E8M0)))
    memory = np.cumsum([32, 0, 96, 32]).astype(np.int32)
    offsets = from_pointer(memory.ctypes.data, (E,), None, DType.INT32, device_type="cpu",
                           owner=memory)
    assert check_values(spec, offsets, 160) is True
    assert check_values(spec, offsets, 160, capacity=12) is True
    with pytest.raises(ArgumentError, match="^sfa_tensor: expected at least 12 scale columns"):
        check_values(spec, offsets, 160, capacity=8)


def test_device_record_of_scales_too_small_names_sfa_tensor():
    assert problem_argument(SCALES_TOO_SMALL) == "sfa_tensor"
    assert problem_argument(1) == "offsets_tensor" and problem_argument(3, "x") == "x"
    # a device record has only the count multiple: 32 is blocked, 16 block_1x128
    assert problem_detail(SCALES_TOO_SMALL, 3, 12, 8, 160, 32) == (
        "expected at least 12 scale columns for experts 0..3 with these offsets (sum of "
        "round_up(ceil(count/sf_vec_size), 4)), got 8")
    assert problem_detail(SCALES_TOO_SMALL, 0, 2, 1, 160, 16) == (
        "expected at least 2 scale rows for expert 0 with these offsets (sum of "
        "ceil(count/128)), got 1")
    status.check_errors(synchronize=False)  # nothing pending
    status.record(SCALES_TOO_SMALL, 3, 12, 8, 160, 32)
    try:
        with pytest.raises(ArgumentError) as info:
            status.check_errors(synchronize=False)
        assert info.value.argument == "sfa_tensor"
        assert "expected at least 12 scale columns for experts 0..3" in str(info.value)
        status.check_errors(synchronize=False)  # cleared once reported
    finally:
        status._take()  # never leave a record for later tests


def test_wrapper_with_cpu_arrays_and_block_scaled_count_multiple(rng):
    # MXFP8 counts must be multiples of 32 (not 256 any more): 32 passes, 16 does not
    from gwgrad.scales import assemble_blocked

    hidden, inter = 32, 32
    a = np.zeros((hidden, 64), np.uint8)
    b = np.zeros((inter, 64), np.uint8)
    sfa = assemble_blocked([np.full((hidden, 1), 127, np.uint8)] * 2, hidden)
    sfb = assemble_blocked([np.full((inter, 1), 127, np.uint8)] * 2, inter)

    def desc(m, shape, strides, dtype):
        return from_pointer(m.ctypes.data, shape, strides, dtype, device_type="cpu", owner=m)

    kw = dict(a_tensor=desc(a, (hidden, 64), (64, 1), E4M3), b_tensor=desc(b, (64, inter), (1, 64), E4M3),
              sfa_tensor=desc(sfa, sfa.shape, None, E8M0), sfb_tensor=desc(sfb, sfb.shape, None, E8M0),
              sf_vec_size=32, wgrad_dtype="float32")
    (w,) = gwgrad.grouped_gemm_wgrad(offsets_tensor=np.array([32, 64], np.int32), **kw)
    assert w.shape == (2, hidden, inter) and (w == 0).all()
    with pytest.raises(ArgumentError, match=r"^offsets_tensor: .*multiple of 32"):
        gwgrad.grouped_gemm_wgrad(offsets_tensor=np.array([16, 64], np.int32), **kw)
