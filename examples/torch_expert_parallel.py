"""An expert-parallel MoE training step in PyTorch, with gwgrad computing each rank's expert
weight gradients, checked against a single-process FP32 run of the same model and batch.

    torchrun --nproc-per-node 2 examples/torch_expert_parallel.py    # CUDA (NCCL), one GPU a rank
    python examples/torch_expert_parallel.py                         # spawns the 2 ranks itself
    python examples/torch_expert_parallel.py --device cpu            # gloo; gwgrad's CPU reference

The layer: top-k softmax router, then per expert ``y = swiglu(x @ w1[e]) @ w2[e]`` with
``w1`` (experts, hidden, 2 * ffn) and ``w2`` (experts, ffn, hidden) in bfloat16, the outputs
summed with the renormalized top-k gates. Expert parallelism over ``torch.distributed``: the
batch is split over the ranks (``--tokens`` each) and so are the experts (rank r owns experts
``r * E / world ... (r + 1) * E / world - 1``). One step:

1. route this rank's tokens; each (token, k) pair is an *assignment* to a global expert;
2. ``plan_dispatch``: sort the assignments by expert (hence by owning rank), exchange the
   per-expert counts with an all-to-all of counts and read the split sizes on the host (the
   one host synchronization a variable-size all-to-all needs);
3. ``dispatch``: ``all_to_all_single`` of the sorted rows; the received rows come grouped by
   source rank, and are permuted to be grouped by local expert (``offsets``: int32 cumulative
   counts, gwgrad's layout);
4. the local experts: ``gwgrad.adapters.torch.grouped_expert_linear`` (forward with
   ``torch._grouped_mm`` on CUDA, a loop on the CPU; backward: dx with torch, **dW with
   gwgrad**), fc1, SwiGLU, fc2;
5. ``combine``: the reverse permutation and all-to-all, then the gate-weighted sum per token.

Autograd runs through all of it (``AllToAll`` is an autograd Function: its backward is the
all-to-all with the splits swapped), so ``loss.backward()`` leaves in ``w1.grad`` / ``w2.grad``
the gradients of this rank's experts over the *global* batch (every rank's tokens reached
them through the all-to-all), computed by one gwgrad call per layer.

The check: every rank also runs the whole model on the whole global batch, in FP32, with a
plain per-expert loop and torch autograd (no gwgrad, no communication), from the same seed,
and compares (relative Frobenius error ``||got - ref|| / ||ref||``; for the expert weights per
expert, the maximum over the rank's experts is printed): the loss, its experts' ``w1.grad`` and
``w2.grad``, its tokens' ``x.grad``, and the router's gradient (summed over the ranks). The
step computes in BF16 (inputs, weights, activations and weight gradients in bfloat16, FP32
accumulation): expect errors of a few 1e-3; the default tolerance ``--rtol 3e-2`` is the
other examples'. The router runs in float64 in both, so that both pick the same experts (a
near-tie flipped by rounding would be an error unrelated to gwgrad); the picks are compared
too. Prints every rank's errors, then PASS or FAIL; exits non-zero on failure.

Run ``python examples/torch_expert_parallel.py --help`` for the sizes. Needs
``pip install -e ".[torch]"``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import gwgrad
import gwgrad.adapters.torch as gwt


# --- the router and the activation, shared by the expert-parallel step and the reference ----

def route(x: torch.Tensor, router: torch.Tensor, top_k: int):
    """Top-k softmax routing, computed in float64: (gates (T, k) float32, renormalized to sum
    to 1; experts (T, k) int64). Float64 makes both runs pick the same experts."""
    probs = torch.softmax(x.double() @ router.double(), dim=-1)
    top_p, top_i = probs.topk(top_k, dim=-1)
    return (top_p / top_p.sum(-1, keepdim=True)).float(), top_i


def swiglu(h1: torch.Tensor) -> torch.Tensor:
    """SwiGLU on fc1's output (T, 2 * ffn): silu(first half) * second half, in float32."""
    gate, up = h1.float().chunk(2, dim=-1)
    return F.silu(gate) * up


# --- dispatch and combine -------------------------------------------------------------------

def exchange(x: torch.Tensor, out_splits: List[int], in_splits: List[int],
             group=None) -> torch.Tensor:
    """``all_to_all_single``: rows ``in_splits[r]`` of ``x`` to rank r, ``out_splits[r]`` rows
    back from it (rank order)."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """``exchange`` with autograd: the gradient goes back the way the rows came."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return exchange(grad, in_splits, out_splits, ctx.group), None, None, None


@dataclass
class Dispatch:
    """Where every row goes in one dispatch, and back (all index tensors on the device)."""

    order: torch.Tensor        # (A,) the assignments sorted by global expert: send = x[order]
    order_inv: torch.Tensor    # (A,) its inverse permutation
    send_splits: List[int]     # rows to each rank
    recv_splits: List[int]     # rows from each rank
    regroup: torch.Tensor      # (R,) received rows -> grouped by local expert: recv[regroup]
    regroup_inv: torch.Tensor  # (R,) its inverse permutation
    counts: torch.Tensor       # (world, local experts) int64: rows received [source, expert]
    offsets: torch.Tensor      # (local experts,) int32: cumulative rows per local expert


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def regroup_permutation(counts: torch.Tensor, total: int) -> torch.Tensor:
    """The permutation taking rows received source-major (blocks [s][l]: source rank s, local
    expert l, ``counts[s, l]`` rows each) to local-expert-major order (blocks [l][s]), keeping
    the order within each block. ``total``: ``counts.sum()`` (known on the host: no sync)."""
    world, local = counts.shape
    block = torch.repeat_interleave(torch.arange(world * local, device=counts.device),
                                    counts.reshape(-1), output_size=total)
    return torch.argsort((block % local) * world + block // local, stable=True)


def plan_dispatch(expert: torch.Tensor, num_experts: int, group=None) -> Dispatch:
    """Plan the dispatch of assignments to ``expert`` (A,) (global expert ids; rank r owns
    experts r * L ... (r + 1) * L - 1, L = num_experts / world). Collective: every rank calls
    it. One all-to-all of counts and one host synchronization (the split sizes)."""
    world = dist.get_world_size(group)
    local = num_experts // world
    order = torch.argsort(expert, stable=True)
    send_counts = torch.zeros(num_experts, dtype=torch.int64, device=expert.device)
    send_counts.index_add_(0, expert, torch.ones_like(expert))
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # [source * L + local expert]
    counts = recv_counts.view(world, local)
    send_splits, recv_splits = torch.stack(
        [send_counts.view(world, local).sum(1), counts.sum(1)]).tolist()  # the host sync
    regroup = regroup_permutation(counts, sum(recv_splits))
    offsets = torch.cumsum(counts.sum(0), 0).to(torch.int32)
    return Dispatch(order, inverse_permutation(order), send_splits, recv_splits, regroup,
                    inverse_permutation(regroup), counts, offsets)


def dispatch(rows: torch.Tensor, plan: Dispatch, group=None) -> torch.Tensor:
    """``rows`` (A, ...) in assignment order -> this rank's received rows (R, ...), grouped by
    local expert as ``plan.offsets`` says."""
    received = AllToAll.apply(rows[plan.order], plan.recv_splits, plan.send_splits, group)
    return received[plan.regroup]


def combine(rows: torch.Tensor, plan: Dispatch, group=None) -> torch.Tensor:
    """The inverse of ``dispatch``: grouped rows (R, ...) -> (A, ...) in assignment order."""
    back = AllToAll.apply(rows[plan.regroup_inv], plan.send_splits, plan.recv_splits, group)
    return back[plan.order_inv]


# --- the expert-parallel layer --------------------------------------------------------------

def ep_moe(x: torch.Tensor, router: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
           top_k: int, group=None):
    """This rank's part of the MoE layer: x (T, hidden) its tokens, w1 / w2 its experts
    (bfloat16). Returns (y (T, hidden) float32, the chosen experts (T, k), the plan)."""
    tokens, hidden = x.shape
    gates, top_i = route(x, router, top_k)
    plan = plan_dispatch(top_i.reshape(-1), w1.shape[0] * dist.get_world_size(group), group)
    # Assignment a = t * top_k + k: token t's k-th expert.
    xs = dispatch(x.bfloat16().repeat_interleave(top_k, dim=0), plan, group)
    h = swiglu(gwt.grouped_expert_linear(xs, w1, plan.offsets)).bfloat16()
    ys = gwt.grouped_expert_linear(h, w2, plan.offsets)  # backward: dW by gwgrad
    y = combine(ys, plan, group).view(tokens, top_k, hidden).float()
    return (y * gates.unsqueeze(-1)).sum(1), top_i, plan


# --- the FP32 single-process reference ------------------------------------------------------

def reference_step(x, router, w1, w2, target, top_k):
    """The whole model on the whole batch in float32 (router in float64), a loop over experts,
    torch autograd; no gwgrad. Returns (loss, experts chosen, grads dict)."""
    x, router, w1, w2 = (t.detach().float().clone().requires_grad_() for t in (x, router, w1, w2))
    gates, top_i = route(x, router, top_k)
    y = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        token, slot = (top_i == e).nonzero(as_tuple=True)
        if token.numel():
            out = swiglu(x[token] @ w1[e]) @ w2[e]
            y = y.index_add(0, token, out * gates[token, slot].unsqueeze(-1))
    loss = ((y - target) ** 2).sum() / target.numel()
    loss.backward()
    return loss.detach(), top_i, {"x": x.grad, "router": router.grad, "w1": w1.grad,
                                  "w2": w2.grad}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (||got|| where want is zero)."""
    diff = float((got.double() - want.double()).norm())
    scale = float(want.double().norm())
    return diff / scale if scale > 0 else diff


# --- one rank -------------------------------------------------------------------------------

SIZES = {"cuda": dict(tokens=4096, hidden=1024, ffn=1024, experts=8, top_k=2),
         "cpu": dict(tokens=64, hidden=32, ffn=48, experts=4, top_k=2)}


def make_model(args, world: int):
    """The global batch, target and parameters, on the CPU, the same on every rank (one
    seed). Expert weights are rounded to bfloat16 once: both runs use the same values."""
    g = torch.Generator().manual_seed(args.seed)
    tokens, h, f, e = args.tokens * world, args.hidden, args.ffn, args.experts
    x = torch.randn(tokens, h, generator=g)
    target = torch.randn(tokens, h, generator=g)
    router = torch.randn(h, e, generator=g) / h ** 0.5
    w1 = (torch.randn(e, h, 2 * f, generator=g) / h ** 0.5).bfloat16()
    w2 = (torch.randn(e, f, h, generator=g) / f ** 0.5).bfloat16()
    return x, target, router, w1, w2


def run(args, rank: int, world: int, local_rank: int) -> int:
    """One rank's expert-parallel step and its check; returns the exit status (0: PASS)."""
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device,
                                timeout=datetime.timedelta(minutes=5))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=5))
    try:
        return _step_and_check(args, rank, world, device)
    finally:
        dist.destroy_process_group()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_and_check(args, rank: int, world: int, device: torch.device) -> int:
    torch.set_float32_matmul_precision("highest")  # the reference in true FP32 (no TF32)
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} is not a multiple of the {world} ranks")
    local = args.experts // world
    x_all, target_all, router_all, w1_all, w2_all = make_model(args, world)
    mine = slice(rank * args.tokens, (rank + 1) * args.tokens)
    experts = slice(rank * local, (rank + 1) * local)

    # This rank's shard: its tokens, its experts, a replica of the router.
    x = x_all[mine].to(device).requires_grad_()
    target = target_all[mine].to(device)
    router = router_all.to(device).requires_grad_()
    w1 = w1_all[experts].to(device).requires_grad_()
    w2 = w2_all[experts].to(device).requires_grad_()

    times = []
    for _ in range(args.repeat):
        for p in (x, router, w1, w2):
            p.grad = None
        _sync(device)
        start = time.perf_counter()
        y, top_i, plan = ep_moe(x, router, w1, w2, args.top_k)
        loss = ((y - target) ** 2).sum() / target_all.numel()  # this rank's part of the mean
        loss.backward()
        _sync(device)
        times.append(time.perf_counter() - start)
    gwgrad.check_errors()  # no gwgrad launch reported invalid offsets
    dist.all_reduce(router.grad)  # a replicated parameter: the ranks' parts summed
    total_loss = loss.detach().clone()
    dist.all_reduce(total_loss)

    ref_loss, ref_top_i, ref = reference_step(
        x_all.to(device), router_all.to(device), w1_all.to(device), w2_all.to(device),
        target_all.to(device), args.top_k)

    same_picks = torch.equal(top_i, ref_top_i[mine])
    errors = {
        "loss": rel_err(total_loss, ref_loss),
        "w1.grad": max(rel_err(w1.grad[i], ref["w1"][experts][i]) for i in range(local)),
        "w2.grad": max(rel_err(w2.grad[i], ref["w2"][experts][i]) for i in range(local)),
        "x.grad": rel_err(x.grad, ref["x"][mine]),
        "router.grad": rel_err(router.grad, ref["router"]),
    }
    ok = same_picks and all(err <= args.rtol for err in errors.values())
    assert w1.grad.dtype == torch.bfloat16 and w1.grad.shape == w1.shape
    counts = plan.counts.tolist()
    lines = [f"rank {rank} ({device}): experts {experts.start}-{experts.stop - 1}, "
             f"received rows per local expert {[sum(c) for c in zip(*counts)]} "
             f"(by source rank: {counts})",
             f"rank {rank}: max relative error "
             + "  ".join(f"{name} {err:.2e}" for name, err in errors.items())
             + ("" if same_picks else "  ROUTING DIFFERS from the reference (a near-tie: "
                                      "try another --seed)")
             + f"  -> {'ok' if ok else 'FAIL'}"]
    if args.repeat > 1:
        lines.append(f"rank {rank}: step (forward + backward) {times[0] * 1e3:.1f} ms first "
                     f"(compiles), then median {statistics.median(times[1:]) * 1e3:.2f} ms")
    else:
        lines.append(f"rank {rank}: step (forward + backward, first call: compiles) "
                     f"{times[0] * 1e3:.1f} ms")
    gathered = [None] * world
    dist.all_gather_object(gathered, (lines, ok))
    passed = all(r_ok for _, r_ok in gathered)
    if rank == 0:
        print(f"expert parallel MoE step: {world} ranks ({args.device}), tokens "
              f"{args.tokens} per rank, hidden {args.hidden}, ffn {args.ffn}, experts "
              f"{args.experts} ({local} per rank), top-{args.top_k}; loss {float(total_loss):.6f}"
              f" (FP32 reference {float(ref_loss):.6f})")
        for r_lines, _ in gathered:
            print("\n".join(r_lines))
        print(f"{'PASS' if passed else 'FAIL'}: BF16 expert-parallel step (dW by gwgrad) vs "
              f"the FP32 single-process reference, tolerance {args.rtol:.0e} (relative)",
              flush=True)
    return 0 if passed else 1


# --- launching ------------------------------------------------------------------------------

def parse_args(argv: Optional[List[str]] = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"),
                   default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda: NCCL, one GPU per rank; cpu: gloo (default: cuda if available)")
    p.add_argument("--nproc", type=int, default=2,
                   help="ranks to spawn when not launched by torchrun (default 2)")
    for name, help_ in (("tokens", "tokens per rank"), ("hidden", "hidden size"),
                        ("ffn", "expert FFN size (fc1 has 2 * ffn outputs)"),
                        ("experts", "experts in all (a multiple of the ranks)"),
                        ("top-k", "experts per token")):
        p.add_argument(f"--{name}", type=int, default=None,
                       help=f"{help_} (default: {SIZES['cuda'][name.replace('-', '_')]} on "
                            f"cuda, {SIZES['cpu'][name.replace('-', '_')]} on cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=3e-2,
                   help="largest relative error accepted (default 3e-2)")
    p.add_argument("--repeat", type=int, default=None,
                   help="steps to run (the gradients of the last are checked; default 3 on "
                        "cuda, 1 on cpu)")
    args = p.parse_args(argv)
    for key, value in SIZES[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.repeat is None:
        args.repeat = 3 if args.device == "cuda" else 1
    if args.hidden % 8 or args.ffn % 8:
        p.error("--hidden and --ffn must be multiples of 8 (gwgrad's contract)")
    return args


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, args, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    status = run(args, rank, args.nproc, rank)
    if status:
        sys.exit(status)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        return run(args, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                   int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        print(f"--device cuda needs {args.nproc} GPUs, found {torch.cuda.device_count()}",
              file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    try:
        mp.spawn(_spawned, args=(args, free_port()), nprocs=args.nproc, join=True)
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:
        print(f"FAIL: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
