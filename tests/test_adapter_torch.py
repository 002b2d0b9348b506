"""gwgrad.adapters.torch: the ops' registration, opcheck (CPU and meta tensors), wgrad()'s
semantics, torch.compile and the example autograd Function, on the CPU (the reference path)
and, parametrized by device, on a GPU (gwgrad's kernels; marked ``gpu``, skipped without one).
On the GPU only: CUDA-graph capture replayed with new offsets values, a non-default stream,
and the caller's current device left alone. Small shapes: the GPU tests run in seconds once
compiled."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import gwgrad  # noqa: E402
import gwgrad.adapters.torch as gwt  # noqa: E402
from torch.library import opcheck  # noqa: E402

try:
    import pytest_timeout  # noqa: F401

    _timeout = [pytest.mark.timeout(120)]
except ImportError:
    _timeout = []

GPU = [pytest.mark.gpu,
       pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with a CUDA GPU"),
       *_timeout]
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]

HIDDEN, INTER = 32, 48
COUNTS = [50, 0, 70, 80]  # any count >= 0 for M/N-major operands; one empty expert
# On the GPU: counts not multiples of 256, one empty expert, several tiles per expert.
CUDA_HIDDEN, CUDA_INTER = 256, 384
CUDA_COUNTS = [512, 0, 997, 3, 256]
SIZES = {"cpu": (HIDDEN, INTER, COUNTS), "cuda": (CUDA_HIDDEN, CUDA_INTER, CUDA_COUNTS)}
#: Relative error allowed on FP32 outputs: the reference's FP64 sums rounded once; the tensor
#: cores' FP32 accumulation.
FP32_TOL = {"cpu": 1e-6, "cuda": 1e-5}


def inputs(counts=COUNTS, hidden=HIDDEN, inter=INTER, device="cpu"):
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(device)
    tokens = int(sum(counts))
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
    dy = torch.randn(tokens, inter, dtype=torch.bfloat16, device=device)
    return x, dy, offsets


def reference(x, dy, offsets):
    bounds = [0] + offsets.tolist()
    return torch.stack([x[s:e].double().T @ dy[s:e].double() for s, e in zip(bounds, bounds[1:])])


def rel_err(got, want):
    got = torch.stack(list(got)) if isinstance(got, (list, tuple)) else got
    return float((got.double() - want).norm() / want.norm())


def sized(device, counts=None):
    """(hidden, intermediate, counts) and fresh inputs of the device's problem size."""
    hidden, inter, default = SIZES[device]
    counts = default if counts is None else counts
    return (hidden, inter, counts), inputs(counts, hidden, inter, device)


def poisoned(*shape, dtype=torch.float32, device="cuda"):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def test_ops_are_registered_with_their_schemas():
    schemas = {name: str(getattr(torch.ops.gwgrad, name).default._schema)
               for name in ("grouped_gemm_wgrad", "grouped_gemm_wgrad_into",
                            "grouped_gemm_wgrad_discrete")}
    assert "ScalarType out_dtype) -> Tensor" in schemas["grouped_gemm_wgrad"]
    assert "Tensor(a!) out, bool accumulate) -> ()" in schemas["grouped_gemm_wgrad_into"]
    assert "Tensor(a!)[] outs, bool accumulate) -> ()" in schemas["grouped_gemm_wgrad_discrete"]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_opcheck(device):
    x, dy, offsets = (t.to(device) for t in inputs())
    e = offsets.shape[0]
    opcheck(torch.ops.gwgrad.grouped_gemm_wgrad.default, (x, dy, offsets, torch.float32))
    opcheck(torch.ops.gwgrad.grouped_gemm_wgrad_into.default,
            (x, dy, offsets, torch.randn(e, HIDDEN, INTER, device=device), True))
    opcheck(torch.ops.gwgrad.grouped_gemm_wgrad_discrete.default,
            (x, dy, offsets, [torch.randn(HIDDEN, INTER, device=device) for _ in range(e)], False))


def test_fake_output_shape_and_dtype():
    x, dy, offsets = (t.to("meta") for t in inputs())
    w = gwt.wgrad(x, dy, offsets, out_dtype=torch.float16)
    assert w.device.type == "meta" and w.shape == (4, HIDDEN, INTER) and w.dtype == torch.float16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dense_against_reference(device, out_dtype):
    (hidden, inter, counts), (x, dy, offsets) = sized(device)
    want = reference(x, dy, offsets)
    w = gwt.wgrad(x, dy, offsets, out_dtype=out_dtype)
    assert w.dtype == out_dtype and w.shape == (len(counts), hidden, inter)
    assert w.device == x.device
    assert rel_err(w, want) < (FP32_TOL[device] if out_dtype == torch.float32 else 1e-2)
    assert (w[1] == 0).all()
    # through the op (what torch.compile calls) the same numbers
    w_op = torch.ops.gwgrad.grouped_gemm_wgrad(x, dy, offsets, out_dtype)
    assert torch.equal(w_op, w)
    # accumulated into a stacked FP32 output
    out = poisoned(len(counts), hidden, inter, device=device)
    base = torch.randn_like(out)
    out.copy_(base)
    gwt.wgrad(x, dy, offsets, out=out, accumulate=True)
    assert rel_err(out, want + base.double()) < FP32_TOL[device]


def test_allocating_calls_reuse_their_plan():
    """A repeated allocating call takes its (plan, output template) from a cache keyed by the
    inputs' signature and the out_dtype argument: a new contiguous output of its own storage
    each time, the numbers of the full path, other offsets with the same shape included;
    another dtype is another entry; what the cache cannot hold goes the checked way."""
    gwt._allocating.clear()
    x, dy, offsets = inputs()
    first = gwt.wgrad(x, dy, offsets)
    assert len(gwt._allocating) == 1
    other = torch.tensor([0, 120, 150, 200], dtype=torch.int32)  # same tokens, other counts
    second = gwt.wgrad(x, dy, other)
    assert len(gwt._allocating) == 1 and second is not first
    for w in (first, second):
        assert w.shape == (4, HIDDEN, INTER) and w.dtype == torch.bfloat16 and w.is_contiguous()
        assert w.untyped_storage().nbytes() == w.numel() * w.element_size()
    assert first.data_ptr() != second.data_ptr()
    assert rel_err(first, reference(x, dy, offsets)) < 1e-2
    assert rel_err(second, reference(x, dy, other)) < 1e-2
    assert (second[0] == 0).all()
    assert gwt.wgrad(x, dy, other, out_dtype=torch.float32).dtype == torch.float32
    assert gwt.wgrad(x, dy, other, out_dtype=torch.bfloat16).dtype == torch.bfloat16
    assert len(gwt._allocating) == 3  # None, float32, bfloat16
    third = gwt.wgrad(x, dy, other, out_dtype=torch.float32)  # a hit
    assert third.dtype == torch.float32 and rel_err(third, reference(x, dy, other)) < 1e-6
    with pytest.raises(ValueError, match="out_dtype"):
        gwt.wgrad(x, dy, offsets, out_dtype=[torch.float32])  # unhashable: no cache entry
    with pytest.raises(ValueError, match="out_dtype"):
        gwt.wgrad(x, dy, offsets, out_dtype=torch.float64)
    metas = [t.to("meta") for t in (x, dy, offsets)]
    assert gwt.wgrad(*metas).device.type == "meta"  # the op's fake kernel, not a hit
    assert len(gwt._allocating) == 3


def test_into_and_accumulate():
    """Into one stacked output, overwriting and adding; the repeated calls take the cached
    plan (wgrad's per-call path), with the same checks for what the cache cannot vouch for."""
    x, dy, offsets = inputs()
    want = reference(x, dy, offsets)
    out = torch.full((4, HIDDEN, INTER), float("nan"))
    for _ in range(2):  # the first call builds the plan, the second finds it
        out.fill_(float("nan"))
        assert gwt.wgrad(x, dy, offsets, out=out) is out
        assert rel_err(out, want) < 1e-6
    base = torch.randn(4, HIDDEN, INTER)
    for _ in range(2):
        out.copy_(base)
        assert gwt.wgrad(x, dy, offsets, out=out, accumulate=True) is out
        assert rel_err(out, want + base.double()) < 1e-6
    assert gwt.wgrad(x, dy, offsets, out=out, out_dtype=torch.float32) is out
    with pytest.raises(ValueError, match="out_dtype"):
        gwt.wgrad(x, dy, offsets, out=out, out_dtype=torch.bfloat16)
    for bad in ([1], 1, 0, None):  # 1 and 0 hash like the cached plans' True and False
        with pytest.raises(ValueError, match="accumulate: expected a bool"):
            gwt.wgrad(x, dy, offsets, out=out, accumulate=bad)
    with pytest.raises(ValueError, match="accumulate: expected a bool"):
        gwt.wgrad(x, dy, offsets, accumulate=0)  # allocating: the cached plan's key has False
    other = torch.full((4, INTER, HIDDEN), float("nan")).transpose(1, 2)  # not a hit
    with pytest.raises(ValueError, match="out"):
        gwt.wgrad(x, dy, offsets, out=other)


@pytest.mark.parametrize("device", DEVICES)
def test_discrete_outputs_and_accumulate(device):
    (hidden, inter, counts), (x, dy, offsets) = sized(device)
    tol = FP32_TOL[device]
    want = reference(x, dy, offsets)
    outs = [poisoned(hidden, inter, dtype=torch.bfloat16, device=device) for _ in counts]
    assert gwt.wgrad(x, dy, offsets, out=outs) == outs
    assert rel_err(outs, want) < 1e-2
    outs = [poisoned(hidden, inter, device=device) for _ in counts]
    assert gwt.wgrad(x, dy, offsets, out=outs) == outs
    assert rel_err(outs, want) < tol
    gwt.wgrad(x, dy, offsets, out=outs, accumulate=True)
    assert rel_err(outs, 2 * want) < tol
    # the same outputs at new addresses
    outs2 = [poisoned(hidden, inter, device=device) for _ in counts]
    gwt.wgrad(x, dy, offsets, out=tuple(outs2))
    assert rel_err(outs2, want) < tol


def test_k_major_x_and_any_storage_reuse_one_operator():
    x, dy, offsets = inputs(counts=[16, 0, 40, 8])  # K-major A: counts multiples of 8
    gwgrad.clear_cache()
    before = gwgrad.cache_info()["constructed"]
    for _ in range(3):  # fresh storage each time, one operator
        x2, dy2 = x.clone(), dy.clone()
        w = gwt.wgrad(x2, dy2, offsets, out_dtype=torch.float32)
        assert rel_err(w, reference(x, dy, offsets)) < 1e-6
    assert gwgrad.cache_info()["constructed"] - before == 1
    x_kmajor = x.T.contiguous().T  # x.T is then K-major: (hidden, tokens) with strides (tokens, 1)
    w = gwt.wgrad(x_kmajor, dy, offsets, out_dtype=torch.float32)
    assert rel_err(w, reference(x, dy, offsets)) < 1e-6


def test_errors_name_the_adapter_arguments():
    x, dy, offsets = inputs()
    with pytest.raises(ValueError, match=r"^x \(a_tensor = x.T\): .*bfloat16"):
        gwt.wgrad(x.float(), dy, offsets)
    with pytest.raises(ValueError, match=r"^offsets: .*int32"):
        gwt.wgrad(x, dy, offsets.long())
    with pytest.raises(ValueError, match=r"^dy \(b_tensor\): "):
        gwt.wgrad(x, dy[:-1], offsets)
    with pytest.raises(ValueError, match=r"^x: expected 2 dims"):
        gwt.wgrad(x[None], dy, offsets)
    with pytest.raises(ValueError, match=r"^out: .*accumulate"):
        gwt.wgrad(x, dy, offsets, accumulate=True)
    with pytest.raises(ValueError, match=r"^out_dtype: "):
        gwt.wgrad(x, dy, offsets, out=torch.zeros(4, HIDDEN, INTER), out_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"^out \(wgrad_tensor\): .*shape"):
        gwt.wgrad(x, dy, offsets, out=torch.zeros(4, HIDDEN, INTER + 8))
    with pytest.raises(ValueError, match=r"^out: expected 4 per-expert outputs"):
        gwt.wgrad(x, dy, offsets, out=[torch.zeros(HIDDEN, INTER)] * 3)
    with pytest.raises(ValueError, match=r"^out: expected every output to be a contiguous"):
        gwt.wgrad(x, dy, offsets, out=[torch.zeros(INTER, HIDDEN).T] * 4)
    with pytest.raises(ValueError, match=r"^offsets: .*last offset"):  # the reference checks
        gwt.wgrad(x, dy, offsets - 1)


def test_bad_argument_kinds_and_devices_are_value_errors():
    x, dy, offsets = inputs()
    with pytest.raises(gwgrad.ArgumentError, match=r"^x: expected a torch.Tensor, got list"):
        gwt.wgrad(x.tolist(), dy, offsets)
    with pytest.raises(ValueError, match=r"^offsets: expected a torch.Tensor, got ndarray"):
        gwt.wgrad(x, dy, offsets.numpy())
    with pytest.raises(ValueError, match=r"^out_dtype: expected None, torch.bfloat16"):
        gwt.wgrad(x, dy, offsets, out_dtype=torch.float64)  # not blamed on out
    with pytest.raises(ValueError, match=r"^out: expected None, a tensor or a non-empty list"):
        gwt.wgrad(x, dy, offsets, out=[])
    # A meta tensor among real ones would reach the op's fake kernel: a ValueError instead.
    for name, args in (("offsets", (x, dy, offsets.to("meta"))), ("dy", (x, dy.to("meta"), offsets))):
        with pytest.raises(ValueError, match=f"^{name}: expected a tensor on cpu like x, got one "
                                             "on meta"):
            gwt.wgrad(*args)
    out = torch.full((4, HIDDEN, INTER), float("nan"))
    with pytest.raises(ValueError, match=r"^out: expected a tensor on cpu like x"):
        gwt.wgrad(x, dy, offsets, out=out.to("meta"))
    # All on meta: shape propagation through the op (tracing), as before.
    w = gwt.wgrad(x.to("meta"), dy.to("meta"), offsets.to("meta"))
    assert w.is_meta and w.shape == (4, HIDDEN, INTER)


def test_validate_offsets_refused_under_compile():
    x, dy, offsets = inputs()

    def f(x, dy, offsets):
        return gwt.wgrad(x, dy, offsets, validate_offsets=True)

    with pytest.raises(Exception, match="validate_offsets"):
        torch.compile(f, backend="eager", fullgraph=True)(x, dy, offsets)


@pytest.mark.parametrize("device,backend", [
    ("cpu", "aot_eager"), ("cpu", "inductor"), pytest.param("cuda", "aot_eager", marks=GPU)])
def test_torch_compile(device, backend):
    (hidden, inter, counts), (x, dy, offsets) = sized(device)

    def step(x, dy, offsets, acc):
        w = gwt.wgrad(x * 2, dy, offsets, out_dtype=torch.float32)
        gwt.wgrad(x, dy, offsets, out=acc, accumulate=True)
        outs = [torch.zeros(hidden, inter, device=device) for _ in counts]
        gwt.wgrad(x, dy, offsets, out=outs)
        return w + acc + torch.stack(outs)

    acc = torch.randn(len(counts), hidden, inter, device=device)
    want = reference(x, dy, offsets)
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    got_acc = acc.clone()
    got = compiled(x, dy, offsets, got_acc)
    assert rel_err(got_acc, want + acc.double()) < FP32_TOL[device]
    assert rel_err(got, 4 * want + acc.double()) < FP32_TOL[device]
    eager_acc = acc.clone()
    assert torch.allclose(got, step(x, dy, offsets, eager_acc), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_expert_linear_matches_autograd(device):
    # On the GPU the forward and dx run torch._grouped_mm: counts of whole 128-row blocks.
    counts = {"cpu": None, "cuda": [256, 512, 0, 256, 128]}[device]
    tol = {"cpu": 1e-2, "cuda": 2e-2}[device]
    (hidden, inter, counts), (x, _, offsets) = sized(device, counts)
    w = torch.randn(len(counts), hidden, inter, dtype=torch.bfloat16, device=device)
    upstream = torch.randn(x.shape[0], inter, device=device)
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = gwt.grouped_expert_linear(x1, w1, offsets)
    (y.float() * upstream).sum().backward()
    # the reference: autograd through a float64 per-expert loop
    x2, w2 = x.double().requires_grad_(), w.double().requires_grad_()
    y2 = gwt.grouped_mm_reference(x2, w2, offsets)
    (y2 * upstream.double()).sum().backward()
    assert rel_err(y.detach(), y2.detach()) < tol
    assert rel_err(x1.grad, x2.grad) < tol
    assert rel_err(w1.grad, w2.grad) < tol
    assert w1.grad.dtype == torch.bfloat16


def test_eager_path_and_op_path_agree_under_a_dispatch_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x, dy, offsets = inputs()
    with Log():
        w = gwt.wgrad(x, dy, offsets, out_dtype=torch.float32)
    assert any("gwgrad.grouped_gemm_wgrad" in name for name in seen)  # the op, not the bypass
    assert rel_err(w, reference(x, dy, offsets)) < 1e-6


# --- on a GPU only -------------------------------------------------------------------------------


def cuda_inputs(counts=CUDA_COUNTS):
    return inputs(counts, CUDA_HIDDEN, CUDA_INTER, "cuda")


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


class TestCuda:
    pytestmark = GPU

    def test_cuda_graph_replay_reads_new_offsets(self):
        x, dy, offsets = cuda_inputs()
        out = poisoned(5, CUDA_HIDDEN, CUDA_INTER)
        outs = [poisoned(CUDA_HIDDEN, CUDA_INTER) for _ in range(5)]
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
        for counts in ([100, 700, 0, 968, 0], CUDA_COUNTS):
            offsets.copy_(torch.cumsum(torch.tensor(counts), 0).to(torch.int32))  # same tensor
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            want = reference(x, dy, offsets)
            assert rel_err(out, want) < 1e-5
            assert rel_err(outs, want) < 1e-5
            assert rel_err(fresh, want) < 1e-5

    def test_allocating_call_first_seen_in_a_capture_caches_no_template(self):
        """wgrad()'s allocating fast path keeps a one-element output template per signature; a
        signature first seen during CUDA-graph capture gets none (its element would come from the
        graph's private pool and pin its block): the capture and its replays work, and the next
        eager call of that signature makes the entry."""
        x, dy, offsets = cuda_inputs()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the plan (compiled) for a bfloat16 output, no template
            gwt.wgrad(x, dy, offsets,
                      out=poisoned(5, CUDA_HIDDEN, CUDA_INTER, dtype=torch.bfloat16))
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

    def test_runs_on_the_current_stream(self):
        x, dy, offsets = cuda_inputs()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = gwt.wgrad(x, dy, offsets, out_dtype=torch.float32)
            done = torch.cuda.Event()
            done.record()
        done.synchronize()  # the work was enqueued on `stream`: recorded after it, it is complete
        assert rel_err(out, reference(x, dy, offsets)) < 1e-5

    @pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
    def test_the_callers_current_device_is_left_alone(self, tmp_path):
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
