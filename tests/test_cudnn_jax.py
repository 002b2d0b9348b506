"""``gwgrad.grouped_gemm_wgrad_jax_sm100``, cuDNN frontend 1.32's JAX entry on gwgrad's JAX
adapter, without a GPU: the CPU lowering (the jnp reference) against float64 loops for BF16
and for FP8 with FP32 scales, eager and under jit; the errors (cuDNN's argument names;
NotImplementedError for what gwgrad's JAX custom call does not do, ValueError for bad
arguments); the CUDA lowering's custom call, compiled for CUTE_DSL_ARCH in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

import gwgrad  # noqa: E402
from gwgrad.api import TupleDict  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
entry = gwgrad.grouped_gemm_wgrad_jax_sm100

HIDDEN, INTER = 64, 48
COUNTS = [48, 0, 96, 16, 64]  # multiples of 16: A is K-major (8), FP8 recipes (16)


@pytest.fixture(autouse=True)
def _on_the_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def bf16_inputs(rng, counts=COUNTS):
    offsets = np.cumsum(counts).astype(np.int32)
    tokens = int(offsets[-1])
    a = rng.standard_normal((HIDDEN, tokens)).astype(ml_dtypes.bfloat16)  # K-major, as cuDNN
    b = rng.standard_normal((tokens, INTER)).astype(ml_dtypes.bfloat16)   # N-major
    return a, b, offsets


def bf16_reference(a, b, offsets):
    a, b = a.astype(np.float64), b.astype(np.float64)
    bounds = [0] + [int(v) for v in offsets]
    return np.stack([a[:, s:t] @ b[s:t] for s, t in zip(bounds, bounds[1:])])


def rel_err(got, want):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("wgrad_dtype,tol", [(jnp.bfloat16, 1e-2), (jnp.float16, 2e-3),
                                             (jnp.float32, 1e-6), ("float32", 1e-6)])
def test_bf16_against_float64(rng, wgrad_dtype, tol):
    a, b, offsets = bf16_inputs(rng)
    want = bf16_reference(a, b, offsets)
    result = entry(jnp.asarray(a), jnp.asarray(b), jnp.asarray(offsets), wgrad_dtype=wgrad_dtype)
    assert isinstance(result, TupleDict) and list(result) == [result["wgrad_tensor"]]
    (w,) = result
    assert w.shape == (len(COUNTS), HIDDEN, INTER) and w.dtype == jnp.dtype(wgrad_dtype)
    assert rel_err(w, want) < tol
    assert not np.asarray(w[1].astype(jnp.float32)).any()  # the empty expert is zeros


def test_bf16_defaults_and_jit(rng):
    a, b, offsets = bf16_inputs(rng)
    want = bf16_reference(a, b, offsets)
    w = entry(jnp.asarray(a), jnp.asarray(b), jnp.asarray(offsets))["wgrad_tensor"]
    assert w.dtype == jnp.bfloat16 and rel_err(w, want) < 1e-2  # cuDNN's default: bfloat16
    f = jax.jit(lambda a, b, o: entry(a, b, o, None, jnp.float32, None, (128, 128), [1, 2])
                ["wgrad_tensor"])  # cuDNN's positional order; a tiling list is fine
    w = f(jnp.asarray(a), jnp.asarray(b), jnp.asarray(offsets))
    assert w.dtype == jnp.float32 and rel_err(w, want) < 1e-6
    # The TupleDict itself comes out of jit (a pytree, as cuDNN registers its own).
    g = jax.jit(lambda a, b, o: entry(a, b, o, wgrad_dtype=jnp.float32))
    result = g(jnp.asarray(a), jnp.asarray(b), jnp.asarray(offsets))
    assert isinstance(result, TupleDict) and rel_err(result["wgrad_tensor"], want) < 1e-6
    # new offsets values, same shapes: the same function, other experts' ranges
    other = np.cumsum([96, 48, 0, 64, 16]).astype(np.int32)
    assert rel_err(f(jnp.asarray(a), jnp.asarray(b), jnp.asarray(other)),
                   bf16_reference(a, b, other)) < 1e-6


def test_bf16_invalid_offsets_are_reported(rng):
    a, b, offsets = bf16_inputs(rng)
    for values, needle in ((offsets - np.int32(1), "last offset"),
                           (np.cumsum([52, 0, 92, 16, 64]).astype(np.int32), "multiple of 8")):
        w = entry(jnp.asarray(a), jnp.asarray(b), jnp.asarray(values))["wgrad_tensor"]
        jax.block_until_ready(w)
        with pytest.raises(ValueError, match=f"^offsets_tensor: .*{needle}"):
            gwgrad.check_errors()
    gwgrad.check_errors()  # nothing left


# --- FP8 with FP32 scale factors -------------------------------------------------------------

def fp8_inputs(rng, recipe, a_fmt=ml_dtypes.float8_e4m3fn, b_fmt=ml_dtypes.float8_e5m2):
    offsets = np.cumsum(COUNTS).astype(np.int32)
    tokens = int(offsets[-1])
    a = (rng.standard_normal((HIDDEN, tokens)) * 4).astype(a_fmt)
    b = (rng.standard_normal((tokens, INTER)) * 4).astype(b_fmt)
    experts = len(COUNTS)
    rows = experts if recipe == "per_expert_channel" else sum(-(-c // 128) for c in COUNTS)
    sfa = rng.uniform(0.25, 2.0, (rows, HIDDEN)).astype(np.float32)
    sfb = rng.uniform(0.25, 2.0, (rows, INTER)).astype(np.float32)
    return a, b, offsets, sfa, sfb


def fp8_reference(a, b, offsets, sfa, sfb, recipe, gsa=None, gsb=None):
    a, b = a.astype(np.float64), b.astype(np.float64)
    bounds = [0] + [int(v) for v in offsets]
    out, first_row = [], 0
    for e, (s, t) in enumerate(zip(bounds, bounds[1:])):
        if recipe == "per_expert_channel":
            sa, sb = sfa[e][:, None], sfb[e][None, :]
            w = (a[:, s:t] * sa) @ (b[s:t] * sb)
        else:  # expert e's j-th 128 tokens: scale row first_row + j
            rows = first_row + np.arange(t - s) // 128
            w = (a[:, s:t] * sfa[rows].T) @ (b[s:t] * sfb[rows])
            first_row += -(-(t - s) // 128)
        if gsa is not None:
            w = w * (float(gsa[e]) * float(gsb[e]))
        out.append(w)
    return np.stack(out)


@pytest.mark.parametrize("recipe", ["per_expert_channel", "block_1x128"])
@pytest.mark.parametrize("global_scales", [False, True])
def test_fp8_fp32_scales_against_float64(rng, recipe, global_scales):
    a, b, offsets, sfa, sfb = fp8_inputs(rng, recipe)
    gsa = gsb = None
    if global_scales:
        gsa = rng.uniform(0.5, 2.0, len(COUNTS)).astype(np.float32)
        gsb = rng.uniform(0.5, 2.0, len(COUNTS)).astype(np.float32)
    want = fp8_reference(a, b, offsets, sfa, sfb, recipe, gsa, gsb)
    kwargs = dict(sfa_tensor=jnp.asarray(sfa), sfb_tensor=jnp.asarray(sfb),
                  global_scale_a=None if gsa is None else jnp.asarray(gsa),
                  global_scale_b=None if gsb is None else jnp.asarray(gsb))
    f = jax.jit(lambda a, b, o, **kw: entry(a, b, o, wgrad_dtype=jnp.float32,
                                            scale_recipe=recipe, **kw))
    w = f(jnp.asarray(a), jnp.asarray(b), jnp.asarray(offsets), **kwargs)["wgrad_tensor"]
    kwargs["scale_recipe"] = recipe
    assert w.shape == (len(COUNTS), HIDDEN, INTER) and w.dtype == jnp.float32
    assert rel_err(w, want) < 1e-5
    assert not np.asarray(w[1]).any()
    eager = entry(jnp.asarray(a), jnp.asarray(b), jnp.asarray(offsets), **kwargs)
    assert eager["wgrad_tensor"].dtype == jnp.bfloat16 and rel_err(eager[0], want) < 1e-2
    if recipe == "block_1x128":  # sf_vec_size: the default or the recipe's
        entry(jnp.asarray(a), jnp.asarray(b), jnp.asarray(offsets), sf_vec_size=128, **kwargs)


# --- errors -----------------------------------------------------------------------------------

def test_what_the_jax_entry_does_not_implement(rng):
    a, b, offsets = (jnp.asarray(v) for v in bf16_inputs(rng))
    with pytest.raises(NotImplementedError, match=r"^wgrad_ptrs: .*wgrad_ptrs=None.*"
                                                  r"grouped_gemm_wgrad_wrapper_sm100"):
        entry(a, b, offsets, jnp.zeros((len(COUNTS) * 8,), jnp.uint8))
    with pytest.raises(NotImplementedError, match=r"^input_order: 'tensor_ragged'"):
        entry(a, b, offsets, input_order="tensor_ragged")
    fa, fb, foff, _, _ = fp8_inputs(rng, "per_expert_channel", b_fmt=ml_dtypes.float8_e4m3fn)
    sfa = jnp.ones((128, 12), jnp.float8_e8m0fnu)
    with pytest.raises(NotImplementedError, match=r"^sfa_tensor: float8_e8m0fnu scale factors "
                                                  r"\(the blocked recipe: MXFP8"):
        entry(jnp.asarray(fa), jnp.asarray(fb), jnp.asarray(foff), sfa_tensor=sfa,
              sfb_tensor=sfa, sf_vec_size=32)
    for error in (NotImplementedError, RuntimeError):  # NotImplementedError is a RuntimeError
        with pytest.raises(error):
            entry(a, b, offsets, input_order="tensor_ragged")


def test_bad_arguments_are_value_errors_named_as_cudnn_names_them(rng):
    a, b, offsets = (jnp.asarray(v) for v in bf16_inputs(rng))
    cases = {
        "accumulate_on_output": dict(accumulate_on_output=True),
        "acc_dtype": dict(acc_dtype=jnp.float16),
        "input_order": dict(input_order="ragged"),
        "mma_tiler_mn": dict(mma_tiler_mn=(96, 96)),
        "cluster_shape_mn": dict(cluster_shape_mn=(0, 1)),
        "wgrad_dtype": dict(wgrad_dtype=jnp.int32),
        "sfb_tensor": dict(sfb_tensor=jnp.ones((4, INTER), jnp.float32)),
        "scale_recipe": dict(scale_recipe="per_expert_channel"),
        "sf_vec_size": dict(sf_vec_size=64),
    }
    for name, kwargs in cases.items():
        with pytest.raises(ValueError, match=f"^{name}: ") as info:
            entry(a, b, offsets, **kwargs)
        assert not isinstance(info.value, NotImplementedError)
    entry(a, b, offsets, acc_dtype=None)  # cuDNN's None: FP32
    shapes = {
        "a_tensor": (a[0], b, offsets),
        "b_tensor": (a, b[:-16], offsets),
        "offsets_tensor": (a, b, offsets[None]),
    }
    for name, args in shapes.items():
        with pytest.raises(ValueError, match=f"^{name}: "):
            entry(*args)
    with pytest.raises(ValueError, match="^b_tensor: expected dtype bfloat16"):
        entry(a, b.astype(jnp.float16), offsets)
    fa, fb, foff, sfa, sfb = fp8_inputs(rng, "per_expert_channel")
    fp8 = (jnp.asarray(fa), jnp.asarray(fb), jnp.asarray(foff))
    with pytest.raises(ValueError, match="^sfa_tensor: expected a tensor"):
        entry(*fp8)  # FP8 without scale factors
    with pytest.raises(ValueError, match="^scale_recipe: expected one of"):
        entry(*fp8, sfa_tensor=jnp.asarray(sfa), sfb_tensor=jnp.asarray(sfb))
    with pytest.raises(ValueError, match="^sfb_tensor: expected a tensor"):
        entry(*fp8, sfa_tensor=jnp.asarray(sfa), scale_recipe="per_expert_channel")
    with pytest.raises(ValueError, match="^sfa_tensor: "):
        entry(*fp8, sfa_tensor=jnp.asarray(sfa[:, :8]), sfb_tensor=jnp.asarray(sfb),
              scale_recipe="per_expert_channel")
    with pytest.raises(ValueError, match="^global_scale_b: "):
        entry(*fp8, sfa_tensor=jnp.asarray(sfa), sfb_tensor=jnp.asarray(sfb),
              scale_recipe="per_expert_channel", global_scale_a=jnp.ones((5,), jnp.float32))


# --- the CUDA lowering without a GPU ---------------------------------------------------------

LOWER_FOR_CUDA = """
import json, os, sys
import numpy as np, jax, jax.numpy as jnp
import gwgrad
rng = np.random.default_rng(int(os.environ["GWGRAD_CHILD_SEED"]))
offsets = jnp.asarray(np.cumsum([256, 0, 512, 256]).astype(np.int32))
a = jnp.asarray(rng.standard_normal((256, 1024)), jnp.bfloat16)
b = jnp.asarray(rng.standard_normal((1024, 256)), jnp.bfloat16)
f = jax.jit(lambda a, b, o: gwgrad.grouped_gemm_wgrad_jax_sm100(
    a, b, o, wgrad_dtype=jnp.float32)["wgrad_tensor"])
texts = {"dense": f.trace(a, b, offsets).lower(lowering_platforms=("cuda",)).as_text()}
fa = jnp.asarray(rng.standard_normal((256, 1024)), jnp.float8_e4m3fn)
fb = jnp.asarray(rng.standard_normal((1024, 256)), jnp.float8_e4m3fn)
s = jnp.ones((4, 256), jnp.float32)
g = jax.jit(lambda a, b, o, s: gwgrad.grouped_gemm_wgrad_jax_sm100(
    a, b, o, sfa_tensor=s, sfb_tensor=s, scale_recipe="per_expert_channel")["wgrad_tensor"])
try:
    g.trace(fa, fb, offsets, s).lower(lowering_platforms=("cuda",))
    texts["fp8"] = "lowered"
except NotImplementedError as exc:
    texts["fp8"] = f"NotImplementedError: {exc}"
json.dump(texts, sys.stdout)
"""


def test_cuda_lowering_without_a_gpu():
    """On an SM100 target the BF16 call lowers to one CuTe DSL custom call reading A
    K-major in place (no transpose op before it); FP8 with FP32 scales is SM90's, so lowering
    for SM100 raises NotImplementedError naming sfa_tensor and SM90."""
    pytest.importorskip("cutlass")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        str(ROOT), os.environ.get("PYTHONPATH")])), CUTE_DSL_ARCH="sm_100a",
        JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", LOWER_FOR_CUDA], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    texts = json.loads(proc.stdout)
    calls = [line for line in texts["dense"].splitlines()
             if "stablehlo.custom_call" in line and "python_cpu_callback" not in line]
    assert len(calls) == 1 and "CuteDSLRT_NvJaxCutlassCall" in calls[0]
    assert "tensor<4x256x256xf32>" in texts["dense"]
    assert "stablehlo.transpose" not in texts["dense"]
    assert texts["fp8"].startswith("NotImplementedError: sfa_tensor: float32 scale factors "
                                   "(per_expert_channel) needs an SM90 GPU")
    assert texts["fp8"].endswith("this is sm_100a")
