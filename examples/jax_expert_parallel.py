"""An expert-parallel MoE training step in JAX (``shard_map`` over a 2-device ``('ep',)``
mesh), with gwgrad computing the expert weight gradients, checked against a single-device
FP32 pure-JAX run of the same model and batch.

    python examples/jax_expert_parallel.py                 # two GPUs when JAX sees them
    python examples/jax_expert_parallel.py --device cpu    # two CPU devices (forced host
                                                           # device count; gwgrad's jnp reference)

The layer (the same as examples/torch_expert_parallel.py): top-k softmax router, then per
expert ``y = swiglu(x @ w1[e]) @ w2[e]`` with ``w1`` (experts, hidden, 2 * ffn) and ``w2``
(experts, ffn, hidden) in bfloat16, the outputs summed with the renormalized top-k gates. The
tokens are sharded over the mesh axis ``ep`` (``--tokens`` per device), and so are the experts
(device d owns experts ``d * L ... (d + 1) * L - 1``, L = experts / devices); the router is
replicated. One step, inside ``shard_map``, every shape static:

1. route this device's tokens; each (token, k) pair is an *assignment* (A = tokens * top_k);
2. ``plan_dispatch``: sort the assignments by expert (hence by owning device) and lay them out
   in a fixed-capacity send buffer (devices, C, hidden), block d for device d; C = A, the
   drop-free bound (all of a device's assignments may go to one device); unused slots are
   zero rows. The per-(device, expert) counts go through a ``jax.lax.all_to_all`` too;
3. ``dispatch``: ``jax.lax.all_to_all`` of the buffer; the received rows are sorted to be
   grouped by local expert (stable sort on (local expert, source)), unused slots last, and
   the offsets (int32 cumulative counts) are computed on the device. gwgrad's contract wants
   ``offsets[-1] == tokens`` (the rows given; other offsets are invalid and compute nothing),
   so the unused slots are *not* cut off: they join the last local expert's range. They are
   zero rows in the forward pass and get zero gradients (``combine`` never reads them), so
   they add exactly nothing to that expert's weight gradient. (The price of the drop-free
   bound: about (W - 1) / W of the W * C slots are unused, and the last expert's GEMMs run
   over them. Production code sizes C with a capacity factor and drops the overflow, or
   uses a ragged all-to-all.);
4. the local experts: ``gwgrad.adapters.jax.grouped_linear``, a ``jax.custom_vjp`` whose
   forward and dx are ``jax.lax.ragged_dot`` and whose **dW is gwgrad's** ``wgrad`` (the CuTe
   DSL kernel as an XLA custom call on CUDA, its jnp reference on the CPU); fc1, SwiGLU, fc2;
5. ``combine``: the inverse sort, the reverse all-to-all, the gate-weighted sum per token; the
   loss is ``psum``-med over ``ep``.

``jax.grad`` of the jitted ``shard_map`` gives each device its experts' gradients over the
global batch (the transposed all-to-alls bring every device's tokens' gradients to them), its
tokens' input gradients, and the router's gradient summed over devices.

The check: the whole model on the whole batch on one device in FP32 (``Precision.HIGHEST``),
dense per-expert einsums weighted by the routing, plain ``jax.grad``; no gwgrad, no
``ragged_dot``. Compared (relative Frobenius error ``||got - ref|| / ||ref||``; the expert
weights per expert, the maximum over a device's experts printed): the loss, each device's
experts' ``w1`` / ``w2`` gradients, its tokens' ``x`` gradient, the router's gradient. The step
computes in BF16 (FP32 accumulation): expect errors of a few 1e-3; default tolerance
``--rtol 3e-2``. The chosen experts are compared too: a near-tie in the router's FP32 logits
that rounding flipped between the two runs (different matmul shapes) would be an error that
is not gwgrad's (then try another ``--seed``). Prints the errors, then PASS or FAIL; exits
non-zero on failure.

``--ndev`` sets the mesh size (any number of devices that divides ``--experts``). Needs
``pip install -e ".[jax]"`` (a CUDA jaxlib and two GPUs for the GPU run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import List, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import gwgrad
import gwgrad.adapters.jax as gwj

AXIS = "ep"
HIGHEST = jax.lax.Precision.HIGHEST
shard_map = getattr(jax, "shard_map", None)
if shard_map is None:  # pragma: no cover - JAX before jax.shard_map
    from jax.experimental.shard_map import shard_map


# --- the router and the activation, shared by the expert-parallel step and the reference ----

def route(x, router, top_k: int):
    """Top-k softmax routing in float32: (gates (T, k), renormalized to sum to 1; experts
    (T, k) int32)."""
    probs = jax.nn.softmax(jnp.dot(x, router, precision=HIGHEST), axis=-1)
    top_p, top_i = jax.lax.top_k(probs, top_k)
    return top_p / top_p.sum(-1, keepdims=True), top_i


def swiglu(h1):
    """SwiGLU on fc1's output (T, 2 * ffn): silu(first half) * second half, in float32."""
    gate, up = jnp.split(h1.astype(jnp.float32), 2, axis=-1)
    return jax.nn.silu(gate) * up


# --- the local experts' grouped matmul, dW by gwgrad ----------------------------------------

# --- dispatch and combine (inside shard_map) ------------------------------------------------

class Dispatch(NamedTuple):
    """Where every row goes in one dispatch and back; all device arrays, static shapes.
    A assignments on this device, W devices, C = A slots per destination, L local experts."""

    send_src: jax.Array     # (W * C,) the assignment filling each send slot (0 where unused)
    send_used: jax.Array    # (W * C,) bool: the slot holds an assignment
    assign_slot: jax.Array  # (A,) the send slot of each assignment
    regroup: jax.Array      # (W * C,) received slots -> grouped by local expert
    regroup_inv: jax.Array  # (W * C,) its inverse
    counts: jax.Array       # (W, L) int32: rows received [source device, local expert]
    offsets: jax.Array      # (L,) int32 cumulative rows per local expert; last = W * C


def inverse_permutation(perm):
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))


def plan_dispatch(expert, num_experts: int, world: int, axis: str = AXIS) -> Dispatch:
    """Plan the dispatch of assignments to ``expert`` (A,) (global expert ids; device d owns
    experts d * L ... (d + 1) * L - 1). Collective over ``axis`` (one all-to-all of counts);
    no host synchronization."""
    assignments = expert.shape[0]
    local = num_experts // world
    capacity = assignments  # per destination: drop-free
    order = jnp.argsort(expert, stable=True)  # by expert, so by destination, then local expert
    send_counts = jnp.zeros((num_experts,), jnp.int32).at[expert].add(1).reshape(world, local)
    per_dest = send_counts.sum(1)
    dest_start = jnp.cumsum(per_dest) - per_dest  # each destination's first sorted assignment
    j = jnp.arange(capacity, dtype=jnp.int32)
    used = j[None, :] < per_dest[:, None]  # (W, C)
    send_src = order[jnp.where(used, dest_start[:, None] + j[None, :], 0).reshape(-1)]
    dest = expert[order] // local
    slot_sorted = dest * capacity + jnp.arange(assignments, dtype=jnp.int32) - dest_start[dest]
    assign_slot = jnp.zeros_like(slot_sorted).at[order].set(slot_sorted)

    # counts[s, l]: rows device s sends here for local expert l, in its block s in that order.
    counts = jax.lax.all_to_all(send_counts, axis, 0, 0, tiled=True)
    ends = jnp.cumsum(counts, axis=1)  # (W, L)
    local_expert = (j[None, :, None] >= ends[:, None, :]).sum(-1)  # (W, C); L: unused slot
    key = local_expert * world + jnp.arange(world, dtype=jnp.int32)[:, None]
    regroup = jnp.argsort(key.reshape(-1), stable=True)  # unused slots (key >= L * W) last
    # The unused slots (zero rows) join the last local expert: offsets[-1] == W * C, as
    # gwgrad's contract requires of the rows it is given.
    offsets = jnp.cumsum(counts.sum(0)).astype(jnp.int32).at[-1].set(world * capacity)
    return Dispatch(send_src, used.reshape(-1), assign_slot, regroup,
                    inverse_permutation(regroup), counts, offsets)


def dispatch(rows, plan: Dispatch, axis: str = AXIS):
    """``rows`` (A, ...) in assignment order -> the rows received here (W * C, ...), grouped
    by local expert as ``plan.offsets`` says (unused slots: zero rows, last)."""
    mask = plan.send_used.reshape((-1,) + (1,) * (rows.ndim - 1))
    send = jnp.where(mask, rows[plan.send_src], jnp.zeros((), rows.dtype))
    return jax.lax.all_to_all(send, axis, 0, 0, tiled=True)[plan.regroup]


def combine(rows, plan: Dispatch, axis: str = AXIS):
    """The inverse of ``dispatch``: grouped rows (W * C, ...) -> (A, ...) in assignment order."""
    back = jax.lax.all_to_all(rows[plan.regroup_inv], axis, 0, 0, tiled=True)
    return back[plan.assign_slot]


# --- the expert-parallel layer --------------------------------------------------------------

def ep_local_loss(x, router, w1, w2, target, *, top_k: int, world: int, total: int):
    """One device's part (inside shard_map): x (T, hidden) float32 its tokens, w1 / w2 its
    experts (bfloat16), router replicated. Returns (the loss, psum-med over the axis; (the
    experts chosen (T, k), the received counts (W, L)))."""
    tokens, hidden = x.shape
    gates, top_i = route(x, router, top_k)
    plan = plan_dispatch(top_i.reshape(-1), w1.shape[0] * world, world)
    # Assignment a = t * top_k + k: token t's k-th expert.
    xs = dispatch(jnp.repeat(x.astype(jnp.bfloat16), top_k, axis=0), plan)
    h = swiglu(gwj.grouped_linear(xs, w1, plan.offsets)).astype(jnp.bfloat16)
    ys = gwj.grouped_linear(h, w2, plan.offsets)  # custom_vjp: dW by gwgrad
    y = combine(ys, plan).reshape(tokens, top_k, hidden).astype(jnp.float32)
    y = (y * gates[..., None]).sum(1)
    loss = jnp.sum((y - target) ** 2) / total  # this device's part of the mean
    return jax.lax.psum(loss, AXIS), (top_i, plan.counts)


def make_ep_step(mesh: Mesh, top_k: int, total: int):
    """The jitted step: (params, x, target) -> ((loss, (experts chosen, counts)), (param
    grads, x grad)); x, target and w1 / w2 sharded over ``ep``, the router replicated."""
    world = mesh.shape[AXIS]
    local = shard_map(
        lambda x, router, w1, w2, target: ep_local_loss(x, router, w1, w2, target,
                                                        top_k=top_k, world=world, total=total),
        mesh=mesh, in_specs=(P(AXIS), P(), P(AXIS), P(AXIS), P(AXIS)),
        out_specs=(P(), (P(AXIS), P(AXIS))))

    def loss(params, x, target):
        return local(x, params["router"], params["w1"], params["w2"], target)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


# --- the FP32 single-device reference -------------------------------------------------------

def reference_loss(params, x, target, top_k: int):
    """The whole model on the whole batch in float32: every expert on every token (dense
    einsums), weighted by the routing (zero for the experts not chosen); no gwgrad."""
    router, w1, w2 = (params[k].astype(jnp.float32) for k in ("router", "w1", "w2"))
    gates, top_i = route(x, router, top_k)
    tokens = x.shape[0]
    weight = jnp.zeros((tokens, w1.shape[0])).at[jnp.arange(tokens)[:, None], top_i].add(gates)
    h = swiglu(jnp.einsum("th,ehf->etf", x, w1, precision=HIGHEST))
    out = jnp.einsum("etf,efh->eth", h, w2, precision=HIGHEST)
    y = jnp.einsum("te,eth->th", weight, out, precision=HIGHEST)
    return jnp.sum((y - target) ** 2) / target.size, top_i


# --- the run --------------------------------------------------------------------------------

SIZES = {"gpu": dict(tokens=4096, hidden=1024, ffn=1024, experts=8, top_k=2),
         "cpu": dict(tokens=64, hidden=32, ffn=48, experts=4, top_k=2)}


def make_model(args, world: int):
    """The global batch, target and parameters as NumPy arrays (one seed); expert weights
    rounded to bfloat16 once: both runs use the same values."""
    rng = np.random.default_rng(args.seed)
    tokens, h, f, e = args.tokens * world, args.hidden, args.ffn, args.experts
    x = rng.standard_normal((tokens, h), np.float32)
    target = rng.standard_normal((tokens, h), np.float32)
    params = {
        "router": rng.standard_normal((h, e), np.float32) / np.float32(h ** 0.5),
        "w1": (rng.standard_normal((e, h, 2 * f), np.float32) / np.float32(h ** 0.5)
               ).astype(jnp.bfloat16),
        "w2": (rng.standard_normal((e, f, h), np.float32) / np.float32(f ** 0.5)
               ).astype(jnp.bfloat16),
    }
    return x, target, params


def rel_err(got, want) -> float:
    """||got - want|| / ||want|| (||got|| where want is zero)."""
    got = np.asarray(np.asarray(got).astype(np.float32), np.float64)
    want = np.asarray(np.asarray(want).astype(np.float32), np.float64)
    diff, scale = float(np.linalg.norm(got - want)), float(np.linalg.norm(want))
    return diff / scale if scale > 0 else diff


def devices_for(kind: str, count: int) -> list:
    try:
        found = jax.devices(kind)
    except RuntimeError:
        found = []
    if len(found) < count:
        raise SystemExit(f"--device {kind} needs {count} JAX {kind} devices, found "
                         f"{len(found)}")
    return found[:count]


def run(args) -> int:
    devices = devices_for(args.device, args.ndev)
    mesh = Mesh(np.array(devices), (AXIS,))
    world = len(devices)
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} is not a multiple of the {world} devices")
    local = args.experts // world
    x_np, target_np, params_np = make_model(args, world)

    sharded, replicated = NamedSharding(mesh, P(AXIS)), NamedSharding(mesh, P())
    x = jax.device_put(x_np, sharded)
    target = jax.device_put(target_np, sharded)
    params = {"router": jax.device_put(params_np["router"], replicated),
              "w1": jax.device_put(params_np["w1"], sharded),
              "w2": jax.device_put(params_np["w2"], sharded)}
    step = make_ep_step(mesh, args.top_k, target_np.size)
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        (loss, (top_i, counts)), (grads, x_grad) = jax.block_until_ready(
            step(params, x, target))
        times.append(time.perf_counter() - start)
    gwgrad.check_errors()  # no launch reported invalid offsets

    one = devices[0]
    ref_step = jax.jit(jax.value_and_grad(
        lambda p, x, t: reference_loss(p, x, t, args.top_k), argnums=(0, 1), has_aux=True))
    (ref_loss, ref_top_i), (ref_grads, ref_x_grad) = jax.block_until_ready(ref_step(
        jax.device_put(params_np, one), jax.device_put(x_np, one),
        jax.device_put(target_np, one)))

    top_i, ref_top_i = np.asarray(top_i), np.asarray(ref_top_i)
    counts = np.asarray(counts).reshape(world, world, local)
    g = {k: np.asarray(v.astype(jnp.float32)) for k, v in grads.items()}
    r = {k: np.asarray(v) for k, v in ref_grads.items()}
    x_grad, ref_x_grad = np.asarray(x_grad), np.asarray(ref_x_grad)
    assert grads["w1"].dtype == jnp.bfloat16 and grads["w1"].shape == params["w1"].shape
    assert len(grads["w1"].sharding.device_set) == world  # each device its experts' gradients
    print(f"expert parallel MoE step (jax {jax.__version__}, shard_map): {world} "
          f"{args.device} devices, tokens {args.tokens} per device, hidden {args.hidden}, "
          f"ffn {args.ffn}, experts {args.experts} ({local} per device), top-{args.top_k}; "
          f"loss {float(loss):.6f} (FP32 reference {float(ref_loss):.6f})")
    passed = True
    for d in range(world):
        mine = slice(d * args.tokens, (d + 1) * args.tokens)
        experts = range(d * local, (d + 1) * local)
        same_picks = np.array_equal(top_i[mine], ref_top_i[mine])
        errors = {
            "loss": rel_err(loss, ref_loss),
            "w1.grad": max(rel_err(g["w1"][e], r["w1"][e]) for e in experts),
            "w2.grad": max(rel_err(g["w2"][e], r["w2"][e]) for e in experts),
            "x.grad": rel_err(x_grad[mine], ref_x_grad[mine]),
            "router.grad": rel_err(g["router"], r["router"]),
        }
        ok = same_picks and all(err <= args.rtol for err in errors.values())
        passed &= ok
        print(f"device {d} ({devices[d]}): experts {experts.start}-{experts.stop - 1}, "
              f"received rows per local expert {counts[d].sum(0).tolist()} (by source: "
              f"{counts[d].tolist()}; {world * args.tokens * args.top_k} slots)")
        print(f"device {d}: max relative error "
              + "  ".join(f"{name} {err:.2e}" for name, err in errors.items())
              + ("" if same_picks else "  ROUTING DIFFERS from the reference (a near-tie: "
                                       "try another --seed)")
              + f"  -> {'ok' if ok else 'FAIL'}")
    if args.repeat > 1:
        print(f"step (forward + backward): {times[0] * 1e3:.1f} ms first (traces, compiles), "
              f"then median {statistics.median(times[1:]) * 1e3:.2f} ms")
    else:
        print(f"step (forward + backward, first call: traces, compiles) {times[0] * 1e3:.1f} ms")
    print(f"{'PASS' if passed else 'FAIL'}: BF16 expert-parallel step (dW by gwgrad) vs the "
          f"FP32 single-device reference, tolerance {args.rtol:.0e} (relative)", flush=True)
    return 0 if passed else 1


def parse_args(argv: Optional[List[str]] = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "gpu", "cuda"), default=None,
                   help="gpu (alias cuda): JAX's CUDA devices; cpu: forced host devices "
                        "(default: gpu when JAX sees --ndev GPUs, else cpu)")
    p.add_argument("--ndev", type=int, default=2, help="devices in the mesh (default 2)")
    for name, help_ in (("tokens", "tokens per device"), ("hidden", "hidden size"),
                        ("ffn", "expert FFN size (fc1 has 2 * ffn outputs)"),
                        ("experts", "experts in all (a multiple of the devices)"),
                        ("top-k", "experts per token")):
        p.add_argument(f"--{name}", type=int, default=None,
                       help=f"{help_} (default: {SIZES['gpu'][name.replace('-', '_')]} on "
                            f"gpu, {SIZES['cpu'][name.replace('-', '_')]} on cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=3e-2,
                   help="largest relative error accepted (default 3e-2)")
    p.add_argument("--repeat", type=int, default=None,
                   help="steps to run (the last is checked; default 3 on gpu, 1 on cpu)")
    args = p.parse_args(argv)
    if args.hidden is not None and args.hidden % 8 or args.ffn is not None and args.ffn % 8:
        p.error("--hidden and --ffn must be multiples of 8 (gwgrad's contract)")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    # Before JAX starts its backends: CPU devices for a CPU mesh (the flag touches only the
    # CPU platform), and no preallocation of 75% of each GPU.
    flag = "--xla_force_host_platform_device_count"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={args.ndev}".strip()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.device == "cuda":
        args.device = "gpu"
    if args.device is None:
        try:
            args.device = "gpu" if len(jax.devices("gpu")) >= args.ndev else "cpu"
        except RuntimeError:
            args.device = "cpu"
    for key, value in SIZES[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.repeat is None:
        args.repeat = 3 if args.device == "gpu" else 1
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
