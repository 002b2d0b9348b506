"""A JAX MoE layer under jax.jit + jax.grad, with gwgrad computing the expert weight gradients.

    python examples/jax_moe_layer.py

Tokens grouped by expert (top-1 routing), then per expert ``y = gelu(x @ w1[e]) @ w2[e]``
through ``gwgrad.adapters.jax.grouped_linear`` (a custom_vjp: dx with jax.lax.ragged_dot,
dw with gwgrad's custom call on CUDA / its jnp reference on the CPU). The gradients are
checked against plain autodiff of the same layer in float32. Runs on JAX's default device.
"""

import jax
import jax.numpy as jnp
import numpy as np

import gwgrad.adapters.jax as gwj

on_gpu = jax.default_backend() == "gpu"
tokens, hidden, ffn, experts = (4096, 512, 1024, 8) if on_gpu else (256, 64, 128, 4)
k = jax.random.split(jax.random.PRNGKey(0), 5)
x = jax.random.normal(k[0], (tokens, hidden))
router = jax.random.normal(k[1], (hidden, experts)) / hidden ** 0.5
params = {
    "w1": (jax.random.normal(k[2], (experts, hidden, ffn)) / hidden ** 0.5).astype(jnp.bfloat16),
    "w2": (jax.random.normal(k[3], (experts, ffn, hidden)) / ffn ** 0.5).astype(jnp.bfloat16),
}
target = jax.random.normal(k[4], (tokens, hidden))


def moe_loss(params, x, linear, dtype):
    expert = jnp.argmax(x @ router, axis=1)
    order = jnp.argsort(expert, stable=True)
    offsets = jnp.cumsum(jnp.bincount(expert, length=experts)).astype(jnp.int32)
    xs = x[order].astype(jnp.bfloat16).astype(dtype)
    h = jax.nn.gelu(linear(xs, params["w1"].astype(dtype), offsets).astype(jnp.float32))
    ys = linear(h.astype(jnp.bfloat16).astype(dtype), params["w2"].astype(dtype), offsets)
    y = jnp.zeros_like(ys).at[order].set(ys)
    return jnp.mean((y.astype(jnp.float32) - target) ** 2)


step = jax.jit(jax.value_and_grad(lambda p, x: moe_loss(p, x, gwj.grouped_linear, jnp.bfloat16)))
loss, grads = step(params, x)
ref_loss, ref_grads = jax.jit(jax.value_and_grad(
    lambda p, x: moe_loss(p, x, gwj.grouped_mm, jnp.float32)))(params, x)

for name in ("w1", "w2"):
    got = np.asarray(grads[name].astype(jnp.float32), np.float64)
    want = np.asarray(ref_grads[name], np.float64)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    print(f"{jax.default_backend()}: d{name} {got.shape} relative error {err:.2e}")
    assert grads[name].dtype == jnp.bfloat16 and err < 3e-2, (name, err)
print(f"loss {float(loss):.4f} (float32 reference {float(ref_loss):.4f})")
