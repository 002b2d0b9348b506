"""The expert-parallel examples without a GPU (issue #13).

examples/torch_expert_parallel.py on two gloo ranks (self-spawned and under torchrun), with
gwgrad's CPU reference computing the expert weight gradients; examples/jax_expert_parallel.py
on two forced CPU host devices (gwgrad's JAX primitive lowers to its jnp reference on the CPU),
and its step lowered for CUDA (the CuTe DSL custom call, compiled for ``CUTE_DSL_ARCH``: no GPU
needed). The dispatch / combine helpers of both: rows reach the right rank and local expert in
the documented order, the offsets are right, unused capacity slots are zero rows, and
``combine(dispatch(rows))`` gives the rows back exactly, gradients included. Every subprocess
gets this test's seed (``GWGRAD_CHILD_SEED``).

    python -m pytest -q tests/test_expert_parallel.py
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 240


def _env(**extra) -> dict:
    # The examples folder (the helpers' modules), the checkout, then whatever the parent had
    # (the GPU host puts the CuTe DSL there).
    path = os.pathsep.join(filter(None, [str(EXAMPLES), str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **extra)


def _run(args, env: dict, expect: str = "PASS", count: int = 1) -> str:
    proc = subprocess.run([str(a) for a in args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    output = proc.stdout + proc.stderr
    print(output)
    assert proc.returncode == 0 and proc.stdout.count(expect) == count, output[-6000:]
    return proc.stdout


def _torchrun(*args) -> list:
    """Two ranks on this host (``--standalone``: a free rendezvous port)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", *args]


def _example(name: str):
    sys.path.insert(0, str(EXAMPLES))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLES))


# --- PyTorch ---------------------------------------------------------------------------------

def test_torch_regroup_permutation_matches_a_loop(rng):
    torch = pytest.importorskip("torch")
    tep = _example("torch_expert_parallel")
    for world, local in ((2, 3), (2, 1), (4, 2), (1, 5)):
        counts = rng.integers(0, 4, (world, local))
        counts[0, 0] = 0  # an empty block
        total = int(counts.sum())
        perm = tep.regroup_permutation(torch.as_tensor(counts), total)
        # Received rows are numbered source-major; the wanted order is expert-major.
        starts = [[int(counts.reshape(-1)[: s * local + l].sum()) for l in range(local)]
                  for s in range(world)]
        want = [starts[s][l] + i for l in range(local) for s in range(world)
                for i in range(counts[s, l])]
        assert perm.tolist() == want
        inv = tep.inverse_permutation(perm)
        assert torch.equal(perm[inv], torch.arange(total))


TORCH_ROUND_TRIP = """
import os
import torch
import torch.distributed as dist
import torch_expert_parallel as tep
import gwgrad.adapters.torch as gwt

calls = []
_wgrad = gwt.wgrad


def counted(x, dy, offsets, **kwargs):  # GroupedExpertLinear's backward calls gwt.wgrad
    calls.append((x.shape[0], offsets.tolist()))
    return _wgrad(x, dy, offsets, **kwargs)


gwt.wgrad = counted
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
seed = int(os.environ["GWGRAD_CHILD_SEED"])
# (experts, assignments on this rank, how experts are drawn)
cases = [(4, 37, "random"), (6, 50, "random"), (4, 0 if rank == 0 else 9, "random"),
         (4, 21, "to rank 1"), (2, 13, "one expert")]
for case, (experts, assignments, how) in enumerate(cases):
    g = torch.Generator().manual_seed(seed + 1000 * case + rank)
    local = experts // world
    low, high = {"random": (0, experts), "to rank 1": (local, 2 * local),
                 "one expert": (0, 1)}[how]
    expert = torch.randint(low, high, (assignments,), generator=g)
    rows = torch.randn(assignments, 3, generator=g)
    plan = tep.plan_dispatch(expert, experts)
    got = tep.dispatch(rows, plan)
    everyone = [None] * world
    dist.all_gather_object(everyone, (expert, rows))
    # Received: grouped by local expert, then by source rank, in assignment order.
    want = torch.cat([r[e == rank * local + l] for l in range(local) for e, r in everyone])
    assert torch.equal(got, want), (case, how)
    sizes = [sum(int((e == rank * local + l).sum()) for e, _ in everyone) for l in range(local)]
    assert plan.offsets.dtype == torch.int32 and plan.offsets.tolist() == \\
        torch.tensor(sizes).cumsum(0).tolist(), (case, plan.offsets, sizes)
    # The round trip, values and gradients, exactly.
    v = rows.clone().requires_grad_()
    back = tep.combine(tep.dispatch(v, plan), plan)
    assert torch.equal(back, rows), case
    w = torch.randn(assignments, 3, generator=g)
    (back * w).sum().backward()
    assert torch.equal(v.grad, w), case

# The layer's backward computes the local experts' dW with gwgrad: one call per layer, over
# every row this rank received (offsets[-1] == rows).
g = torch.Generator().manual_seed(seed + rank)
x = torch.randn(24, 16, generator=g, requires_grad=True)
router = torch.randn(16, 4, generator=g, requires_grad=True)
w1 = (torch.randn(2, 16, 32, generator=g) / 4).bfloat16().requires_grad_()
w2 = (torch.randn(2, 16, 16, generator=g) / 4).bfloat16().requires_grad_()
y, top_i, plan = tep.ep_moe(x, router, w1, w2, 2)
y.square().sum().backward()
assert len(calls) == 2 and all(rows == offsets[-1] == sum(plan.recv_splits)
                               for rows, offsets in calls), calls
assert w1.grad.dtype == torch.bfloat16 and w1.grad.abs().sum() > 0
dist.destroy_process_group()
print("round trip ok")
"""


def test_torch_dispatch_combine_round_trip_on_two_ranks(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "torch_round_trip.py"
    script.write_text(textwrap.dedent(TORCH_ROUND_TRIP))
    _run(_torchrun(script), _env(), expect="round trip ok", count=2)


def test_torch_example_self_spawned_on_cpu(seed):
    pytest.importorskip("torch")
    out = _run([sys.executable, EXAMPLES / "torch_expert_parallel.py", "--device", "cpu",
                "--seed", seed % 2 ** 31], _env())
    assert "rank 0: max relative error" in out and "rank 1: max relative error" in out


def test_torch_example_under_torchrun_on_cpu(seed):
    pytest.importorskip("torch")
    _run(_torchrun(EXAMPLES / "torch_expert_parallel.py", "--device", "cpu", "--seed",
                   seed % 2 ** 31, "--tokens", 40, "--experts", 6, "--top-k", 3,
                   "--hidden", 16, "--ffn", 24), _env())


def test_torch_example_fails_loudly(seed):
    # A tolerance nothing meets: FAIL, and a non-zero exit status.
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(EXAMPLES / "torch_expert_parallel.py"),
                           "--device", "cpu", "--rtol", "1e-9"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode != 0 and "FAIL" in proc.stdout, proc.stdout + proc.stderr


# --- JAX -------------------------------------------------------------------------------------

def _jax_env(**extra) -> dict:
    return _env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
                **extra)


JAX_ROUND_TRIP = """
import os
import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax_expert_parallel as jep

W = 2
mesh = Mesh(np.array(jax.devices("cpu")[:W]), ("ep",))
put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))
rng = np.random.default_rng(int(os.environ["GWGRAD_CHILD_SEED"]))
for experts, A, how in ((4, 24, "random"), (6, 30, "random"), (4, 16, "to device 1"),
                        (2, 10, "one expert"), (8, 1, "random")):
    L = experts // W
    low, high = {"random": (0, experts), "to device 1": (L, 2 * L), "one expert": (0, 1)}[how]
    expert = rng.integers(low, high, (W, A)).astype(np.int32)
    rows = rng.standard_normal((W, A, 3)).astype(np.float32)
    weights = rng.standard_normal((W, A, 3)).astype(np.float32)

    def local(expert, rows, weights):
        plan = jep.plan_dispatch(expert, experts, W)
        got = jep.dispatch(rows, plan)
        back = jep.combine(got, plan)
        grad = jax.grad(lambda v: jnp.sum(jep.combine(jep.dispatch(v, plan), plan)
                                          * weights))(rows)
        return got, plan.offsets, back, grad

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("ep"),) * 3,
                              out_specs=(P("ep"),) * 4))
    got, offsets, back, grad = f(put(expert.reshape(-1)), put(rows.reshape(W * A, 3)),
                                 put(weights.reshape(W * A, 3)))
    np.testing.assert_array_equal(np.asarray(back), rows.reshape(-1, 3))     # exact
    np.testing.assert_array_equal(np.asarray(grad), weights.reshape(-1, 3))  # exact
    got = np.asarray(got).reshape(W, W * A, 3)
    offsets = np.asarray(offsets).reshape(W, L)
    for d in range(W):
        # Received: grouped by local expert, then by source device, in assignment order;
        # the unused capacity slots last, zero rows, in the last expert's range.
        want = [rows[s][expert[s] == d * L + l] for l in range(L) for s in range(W)]
        sizes = [int(sum((expert[s] == d * L + l).sum() for s in range(W))) for l in range(L)]
        n = sum(sizes)
        np.testing.assert_array_equal(got[d][:n], np.concatenate(want))
        assert not got[d][n:].any(), (how, d)
        assert offsets[d].tolist() == np.cumsum(sizes)[:-1].tolist() + [W * A], (how, offsets)

# The step's backward holds gwgrad's primitive once per layer.
class Args:
    seed, tokens, hidden, ffn, experts, top_k = 0, 16, 16, 24, 4, 2
x, target, params = jep.make_model(Args, W)
sharded, replicated = NamedSharding(mesh, P("ep")), NamedSharding(mesh, P())
params = {"router": jax.device_put(params["router"], replicated),
          "w1": put(params["w1"]), "w2": put(params["w2"])}
step = jep.make_ep_step(mesh, Args.top_k, target.size)
text = str(jax.make_jaxpr(step)(params, put(x), put(target)))
assert text.count("gwgrad_grouped_gemm_wgrad") == 2, text.count("gwgrad_grouped_gemm_wgrad")
print("round trip ok")
"""


def test_jax_dispatch_combine_round_trip_on_two_cpu_devices():
    pytest.importorskip("jax")
    _run([sys.executable, "-c", textwrap.dedent(JAX_ROUND_TRIP)], _jax_env(),
         expect="round trip ok")


@pytest.mark.parametrize("sizes", [[], ["--tokens", "40", "--experts", "6", "--top-k", "3",
                                        "--hidden", "16", "--ffn", "24"]],
                         ids=["default", "6-experts-top-3"])
def test_jax_example_on_two_cpu_devices(seed, sizes):
    pytest.importorskip("jax")
    out = _run([sys.executable, EXAMPLES / "jax_expert_parallel.py", "--device", "cpu",
                "--seed", seed % 2 ** 31, *sizes], _jax_env())
    assert "device 0: max relative error" in out and "device 1: max relative error" in out


LOWER_FOR_CUDA = """
import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax_expert_parallel as jep

W = 2
mesh = Mesh(np.array(jax.devices("cpu")[:W]), ("ep",))
put = lambda a, spec=P("ep"): jax.device_put(a, NamedSharding(mesh, spec))
class Args:
    seed, tokens, hidden, ffn, experts, top_k = 0, 256, 256, 128, 4, 2
x, target, p = jep.make_model(Args, W)
params = {"router": put(p["router"], P()), "w1": put(p["w1"]), "w2": put(p["w2"])}
step = jep.make_ep_step(mesh, Args.top_k, target.size)
text = step.trace(params, put(x), put(target)).lower(lowering_platforms=("cuda",)).as_text()
calls = [line for line in text.splitlines()
         if "stablehlo.custom_call" in line and "python_cpu_callback" not in line]
assert len(calls) == 2 and all("CuteDSLRT_NvJaxCutlassCall" in c for c in calls), calls
assert "all_to_all" in text
# Each device's rows: W * tokens * top_k slots; fc1's and fc2's weight gradients.
assert "tensor<2x256x256xbf16>" in text and "tensor<2x128x256xbf16>" in text
print("lowered ok")
"""


@pytest.mark.compile
def test_jax_example_step_lowers_for_cuda_without_a_gpu():
    # CUTE_DSL_ARCH: the DSL compiles gwgrad's kernel for it without a GPU (read at its import).
    pytest.importorskip("jax")
    if importlib.util.find_spec("cutlass") is None:
        pytest.skip("needs the CuTe DSL (nvidia-cutlass-dsl)")
    _run([sys.executable, "-c", textwrap.dedent(LOWER_FOR_CUDA)],
         _jax_env(CUTE_DSL_ARCH="sm_90a"), expect="lowered ok")
