"""gwgrad.adapters.torch on a GPU: against the reference (dense, discrete, accumulate),
CUDA-graph capture replayed with new offsets values, a non-default stream, torch.compile and
the example autograd Function. Small shapes: the whole file runs in seconds once compiled."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import gwgrad.adapters.torch as gwt  # noqa: E402

try:
    import pytest_timeout  # noqa: F401

    _timeout = [pytest.mark.timeout(120)]
except ImportError:
    _timeout = []

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with a CUDA GPU"),
    *_timeout,
]

HIDDEN, INTER = 256, 384
COUNTS = [512, 0, 997, 3, 256]  # not multiples of 256, one empty expert


def inputs(counts=COUNTS):
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).cuda()
    tokens = int(sum(counts))
    x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(tokens, INTER, dtype=torch.bfloat16, device="cuda")
    return x, dy, offsets


def reference(x, dy, offsets):
    bounds = [0] + offsets.tolist()
    return torch.stack([x[s:e].double().T @ dy[s:e].double() for s, e in zip(bounds, bounds[1:])])


def rel_err(got, want):
    got = torch.stack(list(got)) if isinstance(got, (list, tuple)) else got
    return float((got.double() - want).norm() / want.norm())


def poisoned(*shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_dense_against_reference(out_dtype):
    x, dy, offsets = inputs()
    w = gwt.wgrad(x, dy, offsets, out_dtype=out_dtype)
    want = reference(x, dy, offsets)
    assert w.dtype == out_dtype and w.is_cuda
    assert rel_err(w, want) < (1e-5 if out_dtype == torch.float32 else 1e-2)
    assert (w[1] == 0).all()
    out = poisoned(5, HIDDEN, INTER)
    base = torch.randn_like(out)
    out.copy_(base)
    gwt.wgrad(x, dy, offsets, out=out, accumulate=True)
    assert rel_err(out, want + base.double()) < 1e-5


def test_discrete_outputs_and_accumulate():
    x, dy, offsets = inputs()
    want = reference(x, dy, offsets)
    outs = [poisoned(HIDDEN, INTER, dtype=torch.bfloat16) for _ in range(5)]
    gwt.wgrad(x, dy, offsets, out=outs)
    assert rel_err(outs, want) < 1e-2
    outs = [poisoned(HIDDEN, INTER) for _ in range(5)]
    gwt.wgrad(x, dy, offsets, out=outs)
    gwt.wgrad(x, dy, offsets, out=outs, accumulate=True)
    assert rel_err(outs, 2 * want) < 1e-5


def test_cuda_graph_replay_reads_new_offsets():
    x, dy, offsets = inputs()
    out = poisoned(5, HIDDEN, INTER)
    outs = [poisoned(HIDDEN, INTER) for _ in range(5)]
    # Warm up on a side stream (compiles; caches the prepared calls), as graph capture wants.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gwt.wgrad(x, dy, offsets, out=out)
        gwt.wgrad(x, dy, offsets, out=outs)
        fresh = gwt.wgrad(x, dy, offsets, out_dtype=torch.float32)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # Capture on a stream of the tensors' device: torch.cuda.graph's default capture
    # stream is made once per process, on the device current at its first use.
    with torch.cuda.graph(graph, stream=side):
        gwt.wgrad(x, dy, offsets, out=out)
        gwt.wgrad(x, dy, offsets, out=outs)
        fresh = gwt.wgrad(x, dy, offsets, out_dtype=torch.float32)  # allocated in the graph
    for counts in ([100, 700, 0, 968, 0], COUNTS):
        offsets.copy_(torch.cumsum(torch.tensor(counts), 0).to(torch.int32))  # same tensor
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = reference(x, dy, offsets)
        assert rel_err(out, want) < 1e-5
        assert rel_err(outs, want) < 1e-5
        assert rel_err(fresh, want) < 1e-5


def test_allocating_call_first_seen_in_a_capture_caches_no_template():
    """wgrad()'s allocating fast path keeps a one-element output template per signature; a
    signature first seen during CUDA-graph capture gets none (its element would come from the
    graph's private pool and pin its block): the capture and its replays work, and the next
    eager call of that signature makes the entry."""
    x, dy, offsets = inputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the plan (compiled) for a bfloat16 output, no template
        gwt.wgrad(x, dy, offsets, out=poisoned(5, HIDDEN, INTER, dtype=torch.bfloat16))
    torch.cuda.current_stream().wait_stream(side)
    gwt._allocating.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        fresh = gwt.wgrad(x, dy, offsets)
    assert len(gwt._allocating) == 0
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(fresh, reference(x, dy, offsets)) < 1e-2
    eager = gwt.wgrad(x, dy, offsets)
    assert len(gwt._allocating) == 1 and rel_err(eager, reference(x, dy, offsets)) < 1e-2


def test_runs_on_the_current_stream():
    x, dy, offsets = inputs()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = gwt.wgrad(x, dy, offsets, out_dtype=torch.float32)
        done = torch.cuda.Event()
        done.record()
    done.synchronize()  # the work was enqueued on `stream`: recorded after it, it is complete
    assert rel_err(out, reference(x, dy, offsets)) < 1e-5


def test_torch_compile():
    x, dy, offsets = inputs()

    def step(x, dy, offsets, acc):
        gwt.wgrad(x, dy, offsets, out=acc, accumulate=True)
        return gwt.wgrad(x * 2, dy, offsets, out_dtype=torch.float32) + acc

    acc = torch.randn(5, HIDDEN, INTER, device="cuda")
    got_acc = acc.clone()
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(x, dy, offsets, got_acc)
    want = reference(x, dy, offsets)
    assert rel_err(got_acc, want + acc.double()) < 1e-5
    assert rel_err(got, 3 * want + acc.double()) < 1e-5


def test_grouped_expert_linear_matches_autograd():
    x, _, offsets = inputs(counts=[256, 512, 0, 256, 128])
    w = torch.randn(5, HIDDEN, INTER, dtype=torch.bfloat16, device="cuda")
    up = torch.randn(x.shape[0], INTER, device="cuda")
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    (gwt.grouped_expert_linear(x1, w1, offsets).float() * up).sum().backward()
    x2, w2 = x.double().requires_grad_(), w.double().requires_grad_()
    (gwt.grouped_mm_reference(x2, w2, offsets) * up.double()).sum().backward()
    assert rel_err(x1.grad, x2.grad) < 2e-2
    assert rel_err(w1.grad, w2.grad) < 2e-2


_DEVICE_SCRIPT = r"""
import torch
import gwgrad.adapters.torch as gwt
from gwgrad import kernel_cache

counts = [300, 0, 77, 651]
offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
for current, target in [(0, 1), (0, 0), (1, 0), (1, 1)]:
    torch.cuda.set_device(current)
    x = torch.randn(1028, 128, dtype=torch.bfloat16, device=f"cuda:{target}")
    dy = torch.randn(1028, 192, dtype=torch.bfloat16, device=f"cuda:{target}")
    w = gwt.wgrad(x, dy, offsets.to(f"cuda:{target}"), out_dtype=torch.float32)
    bounds = [0] + offsets.tolist()
    want = torch.stack([x[s:e].double().T @ dy[s:e].double() for s, e in zip(bounds, bounds[1:])])
    err = float((w.double() - want).norm() / want.norm())
    now = torch.cuda.current_device()
    print(f"current {current} -> {now} after a call on cuda:{target} (w on {w.device}), "
          f"error {err:.1e}")
    assert now == current and w.device == x.device and err < 1e-5
print("compiles", kernel_cache.stats()["compiles"])
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_the_callers_current_device_is_left_alone(tmp_path):
    """gwgrad launches on the arrays' device and must give the caller back its current
    device after a compile (first process, empty disk cache), a load from the disk cache
    (second process) and a launch on the other GPU, or a later ``device="cuda"`` silently
    lands on the wrong GPU. (gwgrad passes this on two H200s. JAX's backend initialization,
    by contrast, leaves the last GPU current, so the GPU tests do not assume that ``"cuda"``
    is ``cuda:0``.)"""
    import os
    import subprocess
    import sys

    env = {**os.environ, "GWGRAD_CACHE_DIR": str(tmp_path)}
    for run in ("compile", "disk cache"):
        done = subprocess.run([sys.executable, "-c", _DEVICE_SCRIPT], env=env, text=True,
                              capture_output=True, timeout=300)
        print(f"--- {run}\n{done.stdout}{done.stderr[-3000:]}")
        assert done.returncode == 0, f"{run}: {done.stderr[-3000:]}"
        compiles = int(done.stdout.rsplit("compiles", 1)[1])
        assert (compiles > 0) if run == "compile" else (compiles == 0), run
