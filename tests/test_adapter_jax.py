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
json.dump(texts, sys.stdout)
"""


def _custom_calls(text: str):
    """The CuTe DSL custom calls of a lowered module (not the reference's host callback)."""
    return [line for line in text.splitlines()
            if "stablehlo.custom_call" in line and "python_cpu_callback" not in line]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_cuda_lowering_without_a_gpu_holds_the_custom_call(arch):
    # A process of its own: CUTE_DSL_ARCH must be set before the CuTe DSL is first imported
    # on a machine without a GPU (the DSL reads it once, at import).
    env = dict(os.environ, PYTHONPATH=_pythonpath(), CUTE_DSL_ARCH=arch, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", LOWER_FOR_CUDA], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    texts = json.loads(proc.stdout)
    calls = _custom_calls(texts["dense"])
    assert len(calls) == 1 and "CuteDSLRT_NvJaxCutlassCall" in calls[0]
    assert "NoCudaGraph" not in calls[0]  # allowed in CUDA graphs
    assert "tensor<4x256x256xf32>" in texts["dense"]  # the output...
    assert "xui8>" in texts["dense"]                  # ...and the uint8 workspace XLA allocates
    # Accumulating: the output buffer is an input aliased to the result.
    assert len(_custom_calls(texts["accumulate"])) == 1
    assert "output_operand_aliases" in texts["accumulate"]
    # One function for both platforms: the custom call in the CUDA branch only.
    assert len(_custom_calls(texts["both"])) == 1 and not _custom_calls(texts["cpu"])


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
