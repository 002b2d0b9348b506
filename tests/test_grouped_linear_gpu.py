"""gwgrad.adapters.torch.GroupedLinear on an SM90+ GPU (gwgrad's CuTe DSL kernel for the
weight gradients, ``torch._grouped_mm`` for y and dx).

Covers: gradients against autograd through a float64 per-expert loop (counts that are not
multiples of anything, empty experts); FP32 main grads accumulated over three steps against
float64 within 1e-5 and, with integer-valued inputs, bit-exactly; empty experts leaving their
main grads unchanged; the ``main_grad=False`` path; the weight-gradient step allocating no
temporary of dW's size (``torch.cuda.max_memory_allocated`` around the backward: at most
256 KiB more than before it, against 3 MiB of FP32 dW) and the main grads keeping their
addresses; no host synchronization in forward + backward (``torch.cuda.set_sync_debug_mode
("error")``); a ``torch.cuda.graph`` capture of forward + backward replayed with new offsets
copied into the captured offsets tensor, every replay bit-equal to an eager step from the
same main grads.

    python -m pytest -q tests/test_grouped_linear_gpu.py      # on the GPU host

Two kernels compile (discrete FP32 accumulate for the main grads, dense BF16 for
``main_grad=False``; once per session's cache directory, ~5-10 s with the DSL import); the
tests then run in seconds. Skipped without an SM90+ GPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import gwgrad  # noqa: E402
import gwgrad.adapters.torch as gwt  # noqa: E402
from test_grouped_linear import loop_reference  # noqa: E402  (y, dx, dW in float64)

try:
    import pytest_timeout  # noqa: F401

    _timeout = [pytest.mark.timeout(180)]
except ImportError:
    _timeout = []

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available()
                       or torch.cuda.get_device_capability()[0] < 9,
                       reason="needs an SM90+ GPU"),
    *_timeout,
]

E, IN, OUT = 8, 256, 384
COUNTS = [512, 0, 997, 3, 256, 0, 131, 100]  # not multiples of anything; empty experts
TOKENS = sum(COUNTS)


def offsets_of(counts, device="cuda"):
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(device)


def make_layer(main_grad=True):
    layer = gwt.GroupedLinear(E, IN, OUT, main_grad=main_grad, device="cuda")
    with torch.no_grad():
        for w in layer.weights:
            w.copy_(torch.randn(IN, OUT, device="cuda") / IN ** 0.5)
    return layer




def rel_err(got, want):
    got = torch.stack(list(got)) if isinstance(got, (list, tuple)) else got
    want = torch.stack(list(want)) if isinstance(want, (list, tuple)) else want
    denom = want.double().norm()
    return float((got.double() - want.double()).norm() / (denom if denom else 1.0))


def step(layer, x, offsets, dy, x_grad=True):
    x = x.detach().clone().requires_grad_(x_grad)
    y = layer(x, offsets)
    y.backward(dy)
    return y.detach(), x.grad


def inputs(counts=COUNTS):
    tokens = sum(counts)
    x = torch.randn(tokens, IN, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(tokens, OUT, dtype=torch.bfloat16, device="cuda")
    return x, dy, offsets_of(counts)


def test_gradients_match_float64_loop():
    layer = make_layer()
    x, dy, offsets = inputs()
    y, dx = step(layer, x, offsets, dy)
    gwgrad.check_errors()
    y_ref, dx_ref, dw_ref = loop_reference(x, layer.weights, COUNTS, dy)
    assert rel_err(y, y_ref) < 1e-2
    assert rel_err(dx, dx_ref) < 1e-2
    assert rel_err([w.main_grad for w in layer.weights], dw_ref) < 1e-5  # FP32, exact inputs
    for e, w in enumerate(layer.weights):
        assert w.grad is None and w.grad_added_to_main_grad is True
        if COUNTS[e] == 0:
            assert not w.main_grad.any()


def test_main_grads_accumulate_over_steps():
    layer = make_layer()
    init = [torch.randn(IN, OUT, device="cuda") for _ in range(E)]
    for w, i in zip(layer.weights, init):
        w.main_grad.copy_(i)
    addresses = [w.main_grad.data_ptr() for w in layer.weights]
    want = [torch.zeros(IN, OUT, dtype=torch.float64, device="cuda") for _ in range(E)]
    for counts in (COUNTS, [0, 300, 0, 700, 1, 999, 0, 0], [250] * 8):
        x, dy, offsets = inputs(counts)
        step(layer, x, offsets, dy)
        _, _, dw = loop_reference(x, layer.weights, counts, dy)
        want = [a + b for a, b in zip(want, dw)]
    gwgrad.check_errors()
    assert [w.main_grad.data_ptr() for w in layer.weights] == addresses
    added = [w.main_grad.double() - i.double() for w, i in zip(layer.weights, init)]
    assert rel_err(added, want) < 1e-5


def test_main_grads_add_exactly_with_integer_values():
    # Integer-valued x, dy and main grads: every product and FP32 sum is exact.
    layer = make_layer()
    with torch.no_grad():
        for w in layer.weights:
            w.copy_(torch.randint(-2, 3, (IN, OUT), device="cuda"))
            w.main_grad.copy_(torch.randint(-100, 101, (IN, OUT), device="cuda"))
    want = [w.main_grad.double().clone() for w in layer.weights]
    for counts in (COUNTS, [0, 64, 1, 35, 0, 0, 200, 7], [10] * 8):
        x = torch.randint(-2, 3, (sum(counts), IN), device="cuda").bfloat16()
        dy = torch.randint(-2, 3, (sum(counts), OUT), device="cuda").bfloat16()
        step(layer, x, offsets_of(counts), dy)
        _, _, dw = loop_reference(x, layer.weights, counts, dy)
        want = [a + b for a, b in zip(want, dw)]
    for w, expected in zip(layer.weights, want):
        assert torch.equal(w.main_grad.double(), expected)


def test_empty_experts_keep_their_main_grads():
    layer = make_layer()
    init = [torch.randn(IN, OUT, device="cuda") for _ in range(E)]
    for w, i in zip(layer.weights, init):
        w.main_grad.copy_(i)
    counts = [0, 400, 0, 0, 600, 0, 0, 0]
    x, dy, offsets = inputs(counts)
    step(layer, x, offsets, dy)
    _, _, dw_ref = loop_reference(x, layer.weights, counts, dy)
    for e, (w, i) in enumerate(zip(layer.weights, init)):
        if counts[e] == 0:
            assert torch.equal(w.main_grad, i), e
        else:
            assert rel_err(w.main_grad - i, dw_ref[e]) < 1e-5


def test_main_grad_false_gives_bfloat16_grads():
    layer = make_layer(main_grad=False)
    x, dy, offsets = inputs()
    _, dx = step(layer, x, offsets, dy)
    _, dx_ref, dw_ref = loop_reference(x, layer.weights, COUNTS, dy)
    grads = [w.grad for w in layer.weights]
    assert all(g.dtype == torch.bfloat16 and g.shape == (IN, OUT) for g in grads)
    assert rel_err(grads, dw_ref) < 1e-2
    assert not grads[1].any() and not grads[5].any()
    assert rel_err(dx, dx_ref) < 1e-2


def test_weight_gradient_step_allocates_no_dw_temporary():
    layer = make_layer()
    x, dy, offsets = inputs()
    step(layer, x, offsets, dy)  # warm-up: compile, plan, pointer array, workspace
    step(layer, x, offsets, dy, x_grad=False)
    addresses = [w.main_grad.data_ptr() for w in layer.weights]
    dw_fp32 = E * IN * OUT * 4
    stack_bf16 = E * IN * OUT * 2
    dx_bytes = TOKENS * IN * 2

    def backward_peak(x_grad):
        xx = x.detach().clone().requires_grad_(x_grad)
        y = layer(xx, offsets)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y.backward(dy)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    # The weight-gradient step alone (x needs no gradient): nothing of dW's size.
    extra = backward_peak(False)
    bound = 256 << 10
    assert extra <= bound, f"weight-gradient backward allocated {extra} B (bound {bound} B, " \
                           f"FP32 dW is {dw_fp32} B)"
    # The whole backward: dx and the stacked bfloat16 weights (for dx), no FP32 dW on top.
    extra_all = backward_peak(True)
    assert extra_all < dx_bytes + stack_bf16 + dw_fp32, (extra_all, dx_bytes, stack_bf16)
    assert extra_all <= dx_bytes + stack_bf16 + bound, (extra_all, dx_bytes, stack_bf16)
    assert [w.main_grad.data_ptr() for w in layer.weights] == addresses
    assert all(w.grad is None for w in layer.weights)


def test_forward_and_backward_do_not_synchronize():
    layer = make_layer()
    x, dy, offsets = inputs()
    step(layer, x, offsets, dy)  # warm-up (compiles; caches the pointer array)
    xx = x.detach().clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = layer(xx, offsets)
        y.backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert xx.grad is not None


def test_cuda_graph_capture_of_forward_and_backward():
    layer = make_layer()
    x = torch.randn(TOKENS, IN, dtype=torch.bfloat16, device="cuda").requires_grad_()
    dy = torch.randn(TOKENS, OUT, dtype=torch.bfloat16, device="cuda")
    offsets = offsets_of(COUNTS)
    # Warm up on a side stream, as capture wants: compiles, caches plans and the pointer array.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            layer(x, offsets).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    # Capture on a stream of the tensors' device: torch.cuda.graph's default capture
    # stream is made once per process, on the device current at its first use.
    with torch.cuda.graph(graph, stream=side):
        y = layer(x, offsets)
        y.backward(dy)
    dx_graph = x.grad  # allocated in the graph's pool; every replay rewrites it
    assert dx_graph is not None
    layer.zero_main_grad()
    replays = [COUNTS, [0, 0, 0, TOKENS, 0, 0, 0, 0], [TOKENS // 8] * 7 + [TOKENS - 7 * (TOKENS // 8)],
               [1, 2, 3, 4, 5, 6, 7, TOKENS - 28], [0, 1000, 0, 999, 0, 0, 0, 0]]
    for counts in replays:
        assert sum(counts) == TOKENS
        offsets.copy_(offsets_of(counts))  # the captured tensor, new values
        before = [w.main_grad.clone() for w in layer.weights]
        graph.replay()
        got_y, got_dx = y.detach().clone(), dx_graph.clone()
        got_main = [w.main_grad.clone() for w in layer.weights]
        # An eager step from the same main grads, on the same inputs and offsets.
        for w, b in zip(layer.weights, before):
            w.main_grad.copy_(b)
        want_y, want_dx = step(layer, x, offsets, dy)
        gwgrad.check_errors()
        assert torch.equal(got_y, want_y), counts
        assert torch.equal(got_dx, want_dx), counts
        for e, (g, w) in enumerate(zip(got_main, layer.weights)):
            assert torch.equal(g, w.main_grad), (counts, e)
        # and against float64
        _, _, dw_ref = loop_reference(x, layer.weights, counts, dy)
        assert rel_err([g - b for g, b in zip(got_main, before)], dw_ref) < 1e-5
        for e, c in enumerate(counts):
            if c == 0:
                assert torch.equal(got_main[e], before[e])


def test_device_errors_name_the_argument():
    layer = make_layer()
    x, _, offsets = inputs()
    # The current device, which is not cuda:0 in a process where JAX initialized two GPUs.
    device = str(layer.weight0.device)
    assert x.device == layer.weight0.device
    with pytest.raises(ValueError, match=rf"^offsets: expected a tensor on {device} like x"):
        layer(x, offsets.cpu())
    with pytest.raises(ValueError, match=rf"^x: expected a tensor on {device}"):
        layer(x.cpu(), offsets)
    layer.weight4.main_grad = torch.zeros(IN, OUT)  # on the CPU
    with pytest.raises(ValueError, match=rf"^weight4.main_grad: expected .*on {device}"):
        layer(x, offsets)
