"""gwgrad.adapters.jax without a GPU: the CPU lowering against a float64 loop, the CUDA
lowering's custom call (compiled for CUTE_DSL_ARCH, no GPU needed), jax.grad through the
custom_vjp example, and shard_map over two (CPU) devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import gwgrad  # noqa: E402
import gwgrad.adapters.jax as gwj  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _pythonpath() -> str:
    # The checkout first, then whatever the parent had (the GPU host puts the CuTe DSL there).
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
HIDDEN, INTER = 32, 48
COUNTS = [50, 0, 70, 80]


@pytest.fixture(autouse=True)
def _on_the_cpu():
    # On a GPU host JAX's default device is the GPU: these tests are about the CPU lowering.
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def inputs(rng, counts=COUNTS, hidden=HIDDEN, inter=INTER):
    offsets = np.cumsum(counts).astype(np.int32)
    tokens = int(offsets[-1])
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((tokens, inter)), jnp.bfloat16)
    return x, dy, jnp.asarray(offsets)


def reference(x, dy, offsets):
    x = np.asarray(x.astype(jnp.float32), np.float64)
    dy = np.asarray(dy.astype(jnp.float32), np.float64)
    bounds = [0] + [int(v) for v in np.asarray(offsets)]
    return np.stack([x[s:e].T @ dy[s:e] for s, e in zip(bounds, bounds[1:])])


def rel_err(got, want):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_cpu_lowering_against_reference(rng, out_dtype):
    x, dy, offsets = inputs(rng)
    want = reference(x, dy, offsets)
    f = jax.jit(lambda x, dy, o: gwj.wgrad(x, dy, o, out_dtype=out_dtype))
    w = f(x, dy, offsets)
    assert w.dtype == out_dtype and w.shape == (4, HIDDEN, INTER)
    assert rel_err(w, want) < (1e-6 if out_dtype == jnp.float32 else 1e-2)
    assert not np.asarray(w[1].astype(jnp.float32)).any()  # the empty expert is zeros
    # eagerly too (the primitive compiles alone)
    assert rel_err(gwj.wgrad(x, dy, offsets, out_dtype=out_dtype), want) < 1e-2


def test_accumulate_and_new_offsets_values(rng):
    x, dy, offsets = inputs(rng)
    base = jnp.asarray(rng.standard_normal((4, HIDDEN, INTER)), jnp.float32)
    f = jax.jit(lambda x, dy, o, out: gwj.wgrad(x, dy, o, out=out, accumulate=True),
                donate_argnums=3)
    w = f(x, dy, offsets, base.copy())
    assert rel_err(w, reference(x, dy, offsets) + np.asarray(base, np.float64)) < 1e-6
    # Same shapes, other values: the same executable, the new ranges.
    other = jnp.asarray(np.cumsum([0, 100, 0, 100]).astype(np.int32))
    w = f(x, dy, other, base.copy())
    assert rel_err(w, reference(x, dy, other) + np.asarray(base, np.float64)) < 1e-6


@pytest.mark.parametrize("values,message", [
    ([-5, 120, 60, 200], r"offsets_tensor\[0\] = -5"),
    ([10, 120, 60, 200], r"non-decreasing offsets, got offsets_tensor\[2\] = 60 after "
                         r"offsets_tensor\[1\] = 120"),
    ([10, 20, 30, 199], r"last offset to equal tokens_sum = 200"),
])
def test_invalid_offsets_are_reported_and_compute_nothing(rng, values, message):
    x, dy, _ = inputs(rng)
    bad = jnp.asarray(np.array(values, np.int32))
    gwgrad.check_errors()  # nothing pending
    w = np.asarray(jax.jit(lambda *a: gwj.wgrad(*a, out_dtype=jnp.float32))(x, dy, bad))
    assert np.isnan(w).all()
    with pytest.raises(ValueError, match="^offsets_tensor: expected .*" + message):
        gwgrad.check_errors()
    gwgrad.check_errors()  # reported once
    base = jnp.asarray(rng.standard_normal((4, HIDDEN, INTER)), jnp.float32)
    f = jax.jit(lambda x, dy, o, base: gwj.wgrad(x, dy, o, out=base, accumulate=True))
    np.testing.assert_array_equal(np.asarray(f(x, dy, bad, base)), np.asarray(base))
    with pytest.raises(ValueError, match="^offsets_tensor:"):
        gwgrad.check_errors()


def test_errors_name_the_adapter_arguments(rng):
    x, dy, offsets = inputs(rng)
    with pytest.raises(ValueError, match=r"^x \(a_tensor = x.T\): .*bfloat16"):
        gwj.wgrad(x.astype(jnp.float32), dy, offsets)
    with pytest.raises(ValueError, match=r"^offsets: .*int32"):
        gwj.wgrad(x, dy, offsets.astype(jnp.int16))
    with pytest.raises(ValueError, match=r"^dy \(b_tensor\): "):
        gwj.wgrad(x, dy[:-1], offsets)
    with pytest.raises(ValueError, match=r"^b_tensor|^dy \(b_tensor\): .*multiple of 8"):
        gwj.wgrad(x, dy[:, :-1], offsets)
    with pytest.raises(ValueError, match=r"^out: .*accumulate"):
        gwj.wgrad(x, dy, offsets, accumulate=True)
    with pytest.raises(ValueError, match=r"^accumulate: expected a bool, got 1"):
        gwj.wgrad(x, dy, offsets, out=jnp.zeros((4, HIDDEN, INTER)), accumulate=1)
    with pytest.raises(ValueError, match=r"^out: expected None unless accumulate"):
        gwj.wgrad(x, dy, offsets, out=jnp.zeros((4, HIDDEN, INTER)))
    with pytest.raises(ValueError, match=r"^out: expected shape"):
        gwj.wgrad(x, dy, offsets, out=jnp.zeros((4, HIDDEN, INTER + 8)), accumulate=True)
    with pytest.raises(ValueError, match=r"^out_dtype \(wgrad_dtype\): "):
        gwj.wgrad(x, dy, offsets, out_dtype=jnp.int32)


LOWER_FOR_CUDA = """
import json, sys
import numpy as np, jax, jax.numpy as jnp
import gwgrad.adapters.jax as gwj
rng = np.random.default_rng(int(__import__("os").environ["GWGRAD_CHILD_SEED"]))
offsets = jnp.asarray(np.cumsum([256, 0, 512, 256]).astype(np.int32))
x = jnp.asarray(rng.standard_normal((1024, 256)), jnp.bfloat16)
dy = jnp.asarray(rng.standard_normal((1024, 256)), jnp.bfloat16)
out = jnp.zeros((4, 256, 256), jnp.float32)
f = jax.jit(lambda x, dy, o: gwj.wgrad(x, dy, o, out_dtype=jnp.float32))
g = jax.jit(lambda x, dy, o, out: gwj.wgrad(x, dy, o, out=out, accumulate=True))
texts = {
    "dense": f.trace(x, dy, offsets).lower(lowering_platforms=("cuda",)).as_text(),
    "accumulate": g.trace(x, dy, offsets, out).lower(lowering_platforms=("cuda",)).as_text(),
    "both": f.trace(x, dy, offsets).lower(lowering_platforms=("cpu", "cuda")).as_text(),
    "cpu": f.trace(x, dy, offsets).lower(lowering_platforms=("cpu",)).as_text(),
}
from gwgrad import kernel_cache
json.dump({"texts": texts, "cutlass": "cutlass" in sys.modules,
           "compiles": kernel_cache.stats()["compiles"]}, sys.stdout)
"""


def _call_types(call: str):
    """(operand types, result types) of a custom call line."""
    inputs, results = call.rstrip().rsplit(": (", 1)[1].split(") -> (")
    return inputs.split(", "), results.rstrip(")").split(", ")


def _custom_calls(text: str):
    """The CuTe DSL custom calls of a lowered module (not the reference's host callback)."""
    return [line for line in text.splitlines()
            if "stablehlo.custom_call" in line and "python_cpu_callback" not in line]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_cuda_lowering_without_a_gpu_holds_the_custom_call(arch, tmp_path):
    """The lowered custom call, then the same lowering in a fresh process whose kernels are in
    the disk cache: no compile, no CuTe DSL import, the same call (module bytes and all)."""
    # A process of its own: CUTE_DSL_ARCH must be set before the CuTe DSL is first imported
    # on a machine without a GPU (the DSL reads it once, at import).
    env = dict(os.environ, PYTHONPATH=_pythonpath(), CUTE_DSL_ARCH=arch, JAX_PLATFORMS="cpu",
               GWGRAD_CACHE_DIR=str(tmp_path))
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", LOWER_FOR_CUDA], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout))
    cold, warm = runs
    assert cold["compiles"] == 4 and cold["cutlass"]  # two operators, two FFI modules
    assert warm["compiles"] == 0 and not warm["cutlass"], warm
    texts = cold["texts"]
    assert {k: _custom_calls(t) for k, t in warm["texts"].items()} == \
        {k: _custom_calls(t) for k, t in texts.items()}
    calls = _custom_calls(texts["dense"])
    assert len(calls) == 1 and "CuteDSLRT_NvJaxCutlassCall" in calls[0]
    assert "NoCudaGraph" not in calls[0]  # allowed in CUDA graphs
    # x, dy, offsets and the status block (kernels/ffi_entry.py); the output, the uint8
    # workspace XLA allocates and the status block, aliased to its input.
    inputs, results = _call_types(calls[0])
    assert inputs == ["tensor<1024x256xbf16>", "tensor<1024x256xbf16>", "tensor<4xi32>",
                      "tensor<16xi32>"], inputs
    assert results[0] == "tensor<4x256x256xf32>" and results[1].endswith("xui8>")
    assert results[2] == "tensor<16xi32>" and "output_operand_aliases" in calls[0]
    # Accumulating: the output buffer is an input aliased to the result.
    calls = _custom_calls(texts["accumulate"])
    assert len(calls) == 1 and _call_types(calls[0])[0][-1] == "tensor<4x256x256xf32>"
    assert calls[0].count("output_operand_alias<") == 2  # the status block and the output
    # One function for both platforms: the custom call in the CUDA branch only.
    assert len(_custom_calls(texts["both"])) == 1 and not _custom_calls(texts["cpu"])


def test_the_custom_call_tiles_for_its_static_tokens(monkeypatch):
    """Under jit the token count is static: the custom call's module comes from the operator
    compiled for it (gwgrad.plan.compile_spec with tokens_sum), so JAX gets the same
    tokens-aware tiling as the core and the other adapters (the short-expert rules, backends/tuning_rules.py), in
    two launches (XLA's workspace is not zeroed)."""
    from gwgrad import plan

    seen = []

    class Seen(Exception):
        pass

    def compile_spec(request, tokens_sum=None):
        seen.append((request.hidden, request.launches, tokens_sum))
        raise Seen

    monkeypatch.setattr(plan, "compile_spec", compile_spec)
    request = gwj._spec((768, 256), jnp.bfloat16, (768, 128), jnp.bfloat16, (3,), jnp.int32,
                        jnp.bfloat16, False, "sm_90a")
    operands = (((768, 256), jnp.bfloat16), ((768, 128), jnp.bfloat16), ((3,), jnp.int32))
    with pytest.raises(Seen):
        gwj._kernel_call(request, operands, 768)
    assert seen == [(256, 2, 768)]


def test_grouped_linear_grad_matches_autodiff(rng):
    x, _, offsets = inputs(rng)
    w = jnp.asarray(rng.standard_normal((4, HIDDEN, INTER)), jnp.bfloat16)
    up = jnp.asarray(rng.standard_normal((x.shape[0], INTER)), jnp.float32)

    def loss(x, w):
        return jnp.sum(gwj.grouped_linear(x, w, offsets).astype(jnp.float32) * up)

    def loss_ref(x, w):
        return jnp.sum(gwj.grouped_mm(x.astype(jnp.float32), w.astype(jnp.float32), offsets) * up)

    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    dx_ref, dw_ref = jax.grad(loss_ref, argnums=(0, 1))(x, w)
    assert dw.dtype == jnp.bfloat16 and dw.shape == w.shape
    assert rel_err(dx, np.asarray(dx_ref, np.float64)) < 1e-2
    assert rel_err(dw, np.asarray(dw_ref, np.float64)) < 1e-2


def test_shard_map_over_two_cpu_devices():
    code = textwrap.dedent("""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        import numpy as np, jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        import gwgrad.adapters.jax as gwj
        mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices("cpu")[:2])
        rng = np.random.default_rng(int(__import__("os").environ["GWGRAD_CHILD_SEED"]))
        tokens, hidden, inter, experts = 64, 16, 24, 3  # per device
        x = rng.standard_normal((2 * tokens, hidden)).astype(np.float32)
        dy = rng.standard_normal((2 * tokens, inter)).astype(np.float32)
        offsets = np.array([10, 30, 64, 0, 40, 64], np.int32)  # each device's local experts
        xb, dyb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16)
        want = []
        for d in range(2):
            b = [0] + list(offsets[d * experts:(d + 1) * experts])
            xd = np.asarray(xb[d * tokens:(d + 1) * tokens].astype(jnp.float32), np.float64)
            dyd = np.asarray(dyb[d * tokens:(d + 1) * tokens].astype(jnp.float32), np.float64)
            want += [xd[s:e].T @ dyd[s:e] for s, e in zip(b, b[1:])]
        put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))
        for check_vma in (True, False):
            f = jax.jit(jax.shard_map(
                lambda x, dy, o: gwj.wgrad(x, dy, o, out_dtype=jnp.float32), mesh=mesh,
                in_specs=(P("ep"), P("ep"), P("ep")), out_specs=P("ep"), check_vma=check_vma))
            w = f(put(xb), put(dyb), put(jnp.asarray(offsets)))
            np.testing.assert_allclose(np.asarray(w), np.stack(want), rtol=1e-5, atol=1e-4)
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=_pythonpath(), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr



def test_grad_through_shard_map_types_dw_as_varying():
    """jax.grad of grouped_linear inside shard_map: the custom VJP's dW must vary over the
    mesh axis like w (a result typed as replicated fails JAX's cotangent type check)."""
    code = textwrap.dedent("""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        import numpy as np, jax, jax.numpy as jnp
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        import gwgrad.adapters.jax as gwj
        mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("ep",))
        rng = np.random.default_rng(int(os.environ["GWGRAD_CHILD_SEED"]))
        tokens, hidden, inter, experts = 64, 16, 24, 3  # per device: its local experts
        x = jnp.asarray(rng.standard_normal((2 * tokens, hidden)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((2 * experts, hidden, inter)), jnp.bfloat16)
        offsets = np.array([10, 30, 64, 0, 40, 64], np.int32)
        put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))

        def loss(x, w, o):
            return jnp.sum(gwj.grouped_linear(x, w, o).astype(jnp.float32) ** 2)

        grad = jax.jit(jax.shard_map(jax.grad(loss, argnums=1), mesh=mesh,
                                     in_specs=(P("ep"), P("ep"), P("ep")), out_specs=P("ep"),
                                     check_vma=True))
        dw = np.asarray(grad(put(x), put(w), put(jnp.asarray(offsets))).astype(jnp.float32))
        for d in range(2):
            b = [0] + list(offsets[d * experts:(d + 1) * experts])
            xd = np.asarray(x[d * tokens:(d + 1) * tokens].astype(jnp.float32), np.float64)
            for i, (s, e) in enumerate(zip(b, b[1:])):
                we = np.asarray(w[d * experts + i].astype(jnp.float32), np.float64)
                y = np.asarray(jnp.asarray(xd[s:e] @ we, jnp.bfloat16).astype(jnp.float32))
                want = xd[s:e].T @ (2 * y)
                got = dw[d * experts + i]
                assert np.abs(got - want).max() <= 2e-2 * (np.abs(want).max() + 1), (d, i)
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=_pythonpath(), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr

# --- wgrad_fp8 -------------------------------------------------------------------------------

FP8_HIDDEN, FP8_INTER = 32, 48
# Multiples of 16 (the FP8 rule), not all of 128 (block_1x128's last blocks are short), one empty.
FP8_COUNTS = [48, 0, 160, 272]
FP8 = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def fp8_inputs(rng, recipe, counts=FP8_COUNTS, x_fmt="e4m3", dy_fmt="e5m2", extra_rows=1):
    """xt (hidden, tokens), dyt (intermediate, tokens) FP8, offsets, and the recipe's float32
    scales (block_1x128: ``extra_rows`` unused rows past the experts' ones)."""
    offsets = np.cumsum(counts).astype(np.int32)
    tokens = int(offsets[-1])
    xt = jnp.asarray(2 * rng.standard_normal((FP8_HIDDEN, tokens)), FP8[x_fmt])
    dyt = jnp.asarray(2 * rng.standard_normal((FP8_INTER, tokens)), FP8[dy_fmt])
    rows = len(counts)
    if recipe == "block_1x128":
        rows = sum(-(-c // 128) for c in counts) + extra_rows
    xs = jnp.asarray(rng.random((rows, FP8_HIDDEN)) + 0.25, jnp.float32)
    dys = jnp.asarray(rng.random((rows, FP8_INTER)) + 0.25, jnp.float32)
    return xt, dyt, jnp.asarray(offsets), xs, dys


def fp8_reference(xt, dyt, offsets, xs, dys, recipe, gx=None, gdy=None):
    """float64 loop over the experts of the dequantized inputs (gwgrad/scales.py's recipes)."""
    xt = np.asarray(xt.astype(jnp.float32), np.float64)
    dyt = np.asarray(dyt.astype(jnp.float32), np.float64)
    xs, dys = np.asarray(xs, np.float64), np.asarray(dys, np.float64)
    bounds = [0] + [int(v) for v in np.asarray(offsets)]
    out, first_row = [], 0
    for e, (s, t) in enumerate(zip(bounds, bounds[1:])):
        if recipe == "per_expert_channel":
            sx, sdy = xs[e][:, None], dys[e][:, None]
        else:  # expert e's j-th 128-token block is row first_row + j
            rows = first_row + np.arange(t - s) // 128
            sx, sdy = xs[rows].T, dys[rows].T
            first_row += -(-(t - s) // 128)
        w = (xt[:, s:t] * sx) @ (dyt[:, s:t] * sdy).T
        if gx is not None:
            w = w * (float(gx[e]) * float(gdy[e]))
        out.append(w)
    return np.stack(out)


RECIPES = ["per_expert_channel", "block_1x128"]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_cpu_lowering_against_reference(rng, recipe, out_dtype):
    xt, dyt, offsets, xs, dys = fp8_inputs(rng, recipe)
    want = fp8_reference(xt, dyt, offsets, xs, dys, recipe)
    f = jax.jit(lambda *a: gwj.wgrad_fp8(*a, scale_recipe=recipe, out_dtype=out_dtype))
    w = f(xt, dyt, offsets, xs, dys)
    assert w.dtype == out_dtype and w.shape == (4, FP8_HIDDEN, FP8_INTER)
    assert rel_err(w, want) < (1e-6 if out_dtype == jnp.float32 else 1e-2)
    assert not np.asarray(w[1].astype(jnp.float32)).any()  # the empty expert is zeros
    # eagerly too (the primitive compiles alone)
    eager = gwj.wgrad_fp8(xt, dyt, offsets, xs, dys, scale_recipe=recipe, out_dtype=out_dtype)
    assert rel_err(eager, want) < 1e-2


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_global_scales_formats_and_accumulate(rng, recipe):
    xt, dyt, offsets, xs, dys = fp8_inputs(rng, recipe, x_fmt="e5m2", dy_fmt="e4m3")
    gx = jnp.asarray(rng.random(4) + 0.5, jnp.float32)
    gdy = jnp.asarray(rng.random(4) + 0.5, jnp.float32)
    want = fp8_reference(xt, dyt, offsets, xs, dys, recipe, np.asarray(gx), np.asarray(gdy))
    base = jnp.asarray(rng.standard_normal((4, FP8_HIDDEN, FP8_INTER)), jnp.float32)
    f = jax.jit(lambda xt, dyt, o, xs, dys, gx, gdy, out: gwj.wgrad_fp8(
        xt, dyt, o, xs, dys, scale_recipe=recipe, out=out, accumulate=True,
        x_global_scale=gx, dy_global_scale=gdy), donate_argnums=7)
    w = f(xt, dyt, offsets, xs, dys, gx, gdy, base.copy())
    assert w.dtype == jnp.float32
    assert rel_err(w, want + np.asarray(base, np.float64)) < 1e-6
    g = jax.jit(lambda *a: gwj.wgrad_fp8(*a[:5], scale_recipe=recipe, out_dtype=jnp.float32,
                                         x_global_scale=a[5], dy_global_scale=a[6]))
    assert rel_err(g(xt, dyt, offsets, xs, dys, gx, gdy), want) < 1e-6
    # Same shapes, other counts: the same executable, the new ranges (and scale rows).
    other = jnp.asarray(np.cumsum([0, 208, 256, 16]).astype(np.int32))
    assert rel_err(g(xt, dyt, other, xs, dys, gx, gdy),
                   fp8_reference(xt, dyt, other, xs, dys, recipe, np.asarray(gx),
                                 np.asarray(gdy))) < 1e-6


@pytest.mark.parametrize("recipe,values,argument,message", [
    ("per_expert_channel", [-16, 120, 60, 480], "offsets_tensor", r"offsets_tensor\[0\] = -16"),
    ("block_1x128", [16, 128, 64, 480], "offsets_tensor",
     r"non-decreasing offsets, got offsets_tensor\[2\] = 64 after offsets_tensor\[1\] = 128"),
    ("per_expert_channel", [16, 32, 48, 464], "offsets_tensor",
     r"last offset to equal tokens_sum = 480"),
    ("block_1x128", [48, 56, 208, 480], "offsets_tensor",
     r"multiple of 16 .*got 8 tokens for expert 1"),
    # Valid offsets needing more scale rows than x_scale has: 1 + 1 + 1 + 4 > 5.
    ("block_1x128", [16, 32, 48, 480], "sfa_tensor",
     r"at least 7 scale rows for experts 0..3 .*got 5"),
])
def test_fp8_invalid_offsets_are_reported_and_compute_nothing(rng, recipe, values, argument,
                                                                message):
    xt, dyt, _, xs, dys = fp8_inputs(rng, recipe)  # 480 tokens
    if recipe == "block_1x128":  # R = 5 >= ceil(480 / 128): the shape check passes
        xs, dys = xs[:5], dys[:5]
    bad = jnp.asarray(np.array(values, np.int32))
    gwgrad.check_errors()  # nothing pending
    f = jax.jit(lambda *a: gwj.wgrad_fp8(*a, scale_recipe=recipe, out_dtype=jnp.float32))
    assert np.isnan(np.asarray(f(xt, dyt, bad, xs, dys))).all()
    with pytest.raises(ValueError, match=f"^{argument}: expected .*" + message):
        gwgrad.check_errors()
    gwgrad.check_errors()  # reported once
    base = jnp.asarray(rng.standard_normal((4, FP8_HIDDEN, FP8_INTER)), jnp.float32)
    g = jax.jit(lambda xt, dyt, o, xs, dys, base: gwj.wgrad_fp8(
        xt, dyt, o, xs, dys, scale_recipe=recipe, out=base, accumulate=True))
    np.testing.assert_array_equal(np.asarray(g(xt, dyt, bad, xs, dys, base)), np.asarray(base))
    with pytest.raises(ValueError, match=f"^{argument}:"):
        gwgrad.check_errors()


def test_fp8_errors_name_the_adapter_arguments(rng):
    xt, dyt, offsets, xs, dys = fp8_inputs(rng, "per_expert_channel")

    def call(xt=xt, dyt=dyt, offsets=offsets, xs=xs, dys=dys, **kw):
        kw.setdefault("scale_recipe", "per_expert_channel")
        return gwj.wgrad_fp8(xt, dyt, offsets, xs, dys, **kw)

    with pytest.raises(ValueError, match=r"^scale_recipe: .*'blocked'"):
        call(scale_recipe="blocked")
    with pytest.raises(ValueError, match=r"^xt: .*float8_e4m3fn or float8_e5m2, got bfloat16"):
        call(xt=xt.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"^dyt: .*float8_e4m3fn or float8_e5m2, got float32"):
        call(dyt=dyt.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"^xt: expected 2 dims \(hidden, tokens\)"):
        call(xt=xt[None])
    with pytest.raises(ValueError, match=r"^dyt \(b_tensor = dyt.T\): .*tokens_sum = 480"):
        call(dyt=dyt[:, :-16])
    with pytest.raises(ValueError, match=r"^xt \(a_tensor\): .*multiple of 16"):
        call(xt=xt[:-8])
    with pytest.raises(ValueError, match=r"^xt \(a_tensor\): .*tokens_sum .*multiple of 16"):
        call(xt=xt[:, :-8], dyt=dyt[:, :-8],
             offsets=jnp.asarray(np.array([48, 48, 208, 472], np.int32)))
    with pytest.raises(ValueError, match=r"^offsets: .*int32"):
        call(offsets=offsets.astype(jnp.int16))
    with pytest.raises(ValueError, match=r"^x_scale: expected float32"):
        call(xs=xs.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"^x_scale \(sfa_tensor\): .*\(num_experts, hidden\)"):
        call(xs=xs[:, :-1])
    with pytest.raises(ValueError, match=r"^dy_scale \(sfb_tensor\): .*\(num_experts, "
                                         r"intermediate\)"):
        call(dys=dys[:-1])
    rows = jnp.ones((5, FP8_HIDDEN), jnp.float32)
    with pytest.raises(ValueError, match=r"^x_scale \(sfa_tensor\): .*R >= ceil\(tokens_sum / "
                                         r"128\) = 4"):
        call(xs=rows[:2], dys=jnp.ones((2, FP8_INTER)), scale_recipe="block_1x128")
    with pytest.raises(ValueError, match=r"^dy_scale \(sfb_tensor\): .*\(5, 48\)"):
        call(xs=rows, dys=jnp.ones((4, FP8_INTER)), scale_recipe="block_1x128")
    with pytest.raises(ValueError, match=r"^dy_global_scale \(global_scale_b\): .*pairs"):
        call(x_global_scale=jnp.ones(4))
    with pytest.raises(ValueError, match=r"^x_global_scale \(global_scale_a\): .*\(4,\)"):
        call(x_global_scale=jnp.ones(5), dy_global_scale=jnp.ones(4))
    with pytest.raises(ValueError, match=r"^out: .*accumulate"):
        call(accumulate=True)
    with pytest.raises(ValueError, match=r"^accumulate: expected a bool"):
        call(accumulate="yes")
    with pytest.raises(ValueError, match=r"^out: expected None unless accumulate"):
        call(out=jnp.zeros((4, FP8_HIDDEN, FP8_INTER)))
    with pytest.raises(ValueError, match=r"^out: expected shape"):
        call(out=jnp.zeros((4, FP8_HIDDEN, FP8_INTER + 16)), accumulate=True)
    with pytest.raises(ValueError, match=r"^out_dtype \(wgrad_dtype\): "):
        call(out_dtype=jnp.int32)
    assert "xt: (hidden, tokens), dyt: (intermediate, tokens)" in gwj.wgrad_fp8.__doc__
    assert "x: (tokens, hidden)" not in gwj.wgrad_fp8.__doc__


LOWER_FP8_FOR_CUDA = """
import json, os, sys
import numpy as np, jax, jax.numpy as jnp
import gwgrad.adapters.jax as gwj
rng = np.random.default_rng(int(os.environ["GWGRAD_CHILD_SEED"]))
recipe = os.environ["GWGRAD_RECIPE"]
counts = [256, 0, 496, 272]
offsets = jnp.asarray(np.cumsum(counts).astype(np.int32))
xt = jnp.asarray(rng.standard_normal((256, 1024)), jnp.float8_e4m3fn)
dyt = jnp.asarray(rng.standard_normal((384, 1024)), jnp.float8_e5m2)
rows = 4 if recipe == "per_expert_channel" else sum(-(-c // 128) for c in counts)
xs, dys = jnp.ones((rows, 256), jnp.float32), jnp.ones((rows, 384), jnp.float32)
g = jnp.ones((4,), jnp.float32)
out = jnp.zeros((4, 256, 384), jnp.float32)
f = jax.jit(lambda *a: gwj.wgrad_fp8(*a, scale_recipe=recipe, out_dtype=jnp.float32))
h = jax.jit(lambda xt, dyt, o, xs, dys, g, out: gwj.wgrad_fp8(
    xt, dyt, o, xs, dys, scale_recipe=recipe, out=out, accumulate=True, x_global_scale=g,
    dy_global_scale=g))
args = (xt, dyt, offsets, xs, dys)
texts = {
    "dense": f.trace(*args).lower(lowering_platforms=("cuda",)).as_text(),
    "accumulate": h.trace(*args, g, out).lower(lowering_platforms=("cuda",)).as_text(),
    "both": f.trace(*args).lower(lowering_platforms=("cpu", "cuda")).as_text(),
    "cpu": f.trace(*args).lower(lowering_platforms=("cpu",)).as_text(),
}
json.dump(texts, sys.stdout)
"""


@pytest.mark.compile
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_cuda_lowering_without_a_gpu_holds_the_custom_call(recipe):
    env = dict(os.environ, PYTHONPATH=_pythonpath(), CUTE_DSL_ARCH="sm_90a", JAX_PLATFORMS="cpu",
               GWGRAD_RECIPE=recipe)
    proc = subprocess.run([sys.executable, "-c", LOWER_FP8_FOR_CUDA], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    texts = json.loads(proc.stdout)
    calls = _custom_calls(texts["dense"])
    assert len(calls) == 1 and "CuteDSLRT_NvJaxCutlassCall" in calls[0]
    assert "NoCudaGraph" not in calls[0]
    # xt, dyt, offsets, x_scale, dy_scale, the two global scales (ones when absent) and the
    # status block; results the output, the workspace and the status block (aliased).
    inputs, results = _call_types(calls[0])
    assert len(inputs) == 8 and inputs[-1] == "tensor<16xi32>", inputs
    assert results == ["tensor<4x256x384xf32>", results[1], "tensor<16xi32>"], results
    assert "tensor<4x256x384xf32>" in texts["dense"] and "xui8>" in texts["dense"]
    assert "f8E4M3FN" in texts["dense"] and "f8E5M2" in texts["dense"]
    assert len(_custom_calls(texts["accumulate"])) == 1
    assert "output_operand_aliases" in texts["accumulate"]
    assert len(_custom_calls(texts["both"])) == 1 and not _custom_calls(texts["cpu"])
