"""gwgrad.adapters.torch.GroupedLinear: per-expert parameters ``weight0..weight{E-1}`` with FP32
``main_grad`` buffers that the backward accumulates into in place (Megatron's
``gradient_accumulation_fusion`` convention), against autograd through a float64 per-expert loop
of ``x_e @ W_e``; on the CPU (gwgrad's reference backend, the loop forward) and, parametrized by
device, on an SM90+ GPU (gwgrad's CuTe DSL kernel for the weight gradients,
``torch._grouped_mm`` for y and dx; marked ``gpu``, skipped without one).

Covers, on both: gradients (y, dx, main grads) against the float64 reference; empty experts
leaving their main grads bit-for-bit unchanged; the ``main_grad=False`` path (bfloat16
``.grad``s). On the CPU: backward passes adding exactly (integer-valued inputs: every sum is
exact); no tokens at all; frozen experts; caller-owned main grads as views into one flat
buffer; ``zero_main_grad``; argument errors as ValueErrors naming the argument. On the GPU:
FP32 main grads accumulated over three steps against float64 within 1e-5 and, with
integer-valued inputs, bit-exactly; the weight-gradient step allocating no temporary of dW's
size (``torch.cuda.max_memory_allocated`` around the backward: at most 256 KiB more than before
it, against 3 MiB of FP32 dW) and the main grads keeping their addresses; no host
synchronization in forward + backward (``torch.cuda.set_sync_debug_mode("error")``); a
``torch.cuda.graph`` capture of forward + backward replayed with new offsets copied into the
captured offsets tensor, every replay bit-equal to an eager step from the same main grads.

    python -m pytest -q tests/test_grouped_linear.py

On the GPU two kernels compile (discrete FP32 accumulate for the main grads, dense BF16 for
``main_grad=False``; once per session's cache directory, ~5-10 s with the DSL import); the
tests then run in seconds.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import gwgrad  # noqa: E402
import gwgrad.adapters.torch as gwt  # noqa: E402

try:
    import pytest_timeout  # noqa: F401

    _timeout = [pytest.mark.timeout(180)]
except ImportError:
    _timeout = []

GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available()
                       or torch.cuda.get_device_capability()[0] < 9,
                       reason="needs an SM90+ GPU"),
    *_timeout,
]
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]

E, IN, OUT = 4, 32, 48
COUNTS = [50, 0, 70, 80]
# On the GPU: counts not multiples of anything, empty experts, several tiles per expert.
CUDA_E, CUDA_IN, CUDA_OUT = 8, 256, 384
CUDA_COUNTS = [512, 0, 997, 3, 256, 0, 131, 100]
CUDA_TOKENS = sum(CUDA_COUNTS)
#: (experts, in_features, out_features, counts) of each device's problem
PROBLEMS = {"cpu": (E, IN, OUT, COUNTS), "cuda": (CUDA_E, CUDA_IN, CUDA_OUT, CUDA_COUNTS)}


def offsets_of(counts, device="cpu"):
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(device)


def make_layer(main_grad=True, experts=E, device="cpu", in_features=IN, out_features=OUT):
    layer = gwt.GroupedLinear(experts, in_features, out_features, main_grad=main_grad,
                              device=device)
    with torch.no_grad():
        for w in layer.weights:
            w.copy_(torch.randn(in_features, out_features) / in_features ** 0.5)
    return layer


def device_layer(device, main_grad=True):
    experts, in_features, out_features, _ = PROBLEMS[device]
    return make_layer(main_grad, experts, device, in_features, out_features)


def device_inputs(device, counts=None):
    """x, dy (bfloat16) and offsets of the device's problem (its counts unless given)."""
    _, in_features, out_features, default = PROBLEMS[device]
    counts = default if counts is None else counts
    x = torch.randn(sum(counts), in_features, dtype=torch.bfloat16, device=device)
    dy = torch.randn(sum(counts), out_features, dtype=torch.bfloat16, device=device)
    return x, dy, offsets_of(counts, device)


def loop_reference(x, weights, counts, upstream):
    """y, dx, [dW_e] in float64 by autograd through ``y_e = x_e @ W_e`` (a Python loop)."""
    x64 = x.detach().double().requires_grad_()
    w64 = [w.detach().double().requires_grad_() for w in weights]
    ys, begin = [], 0
    for e, c in enumerate(counts):
        ys.append(x64[begin:begin + c] @ w64[e])
        begin += c
    y = torch.cat(ys)
    (y * upstream.double()).sum().backward()
    return y.detach(), x64.grad, [w.grad for w in w64]


def rel_err(got, want):
    got = torch.stack(list(got)) if isinstance(got, (list, tuple)) else got
    want = torch.stack(list(want)) if isinstance(want, (list, tuple)) else want
    denom = want.double().norm()
    return float((got.double() - want.double()).norm() / (denom if denom else 1.0))


def step(layer, x, offsets, upstream):
    """One forward and backward with ``loss = sum(y * upstream)`` (dy = upstream in bf16)."""
    x = x.detach().clone().requires_grad_()
    y = layer(x, offsets)
    (y.float() * upstream).sum().backward()
    return y.detach(), x.grad


def step_dy(layer, x, offsets, dy, x_grad=True):
    """One forward and backward of the bfloat16 upstream gradient ``dy``."""
    x = x.detach().clone().requires_grad_(x_grad)
    y = layer(x, offsets)
    y.backward(dy)
    return y.detach(), x.grad


def test_parameters_and_main_grads():
    layer = gwt.GroupedLinear(E, IN, OUT)
    names = [name for name, _ in layer.named_parameters()]
    assert names == [f"weight{e}" for e in range(E)]
    assert list(layer.state_dict()) == names
    for w in layer.weights:
        assert isinstance(w, torch.nn.Parameter) and w.requires_grad
        assert w.shape == (IN, OUT) and w.dtype == torch.bfloat16
        assert w.main_grad.shape == (IN, OUT) and w.main_grad.dtype == torch.float32
        assert not w.main_grad.any() and w.grad is None
        assert w.grad_added_to_main_grad is False
        assert float(w.detach().abs().max()) <= IN ** -0.5
    assert "num_experts=4, in_features=32, out_features=48, main_grad=True" in repr(layer)
    plain = gwt.GroupedLinear(E, IN, OUT, main_grad=False)
    assert not any(hasattr(w, "main_grad") for w in plain.weights)


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_match_float64_loop(device):
    _, _, out_features, counts = PROBLEMS[device]
    layer = device_layer(device)
    x, dy, offsets = device_inputs(device)
    y, dx = step_dy(layer, x, offsets, dy)
    gwgrad.check_errors()
    y_ref, dx_ref, dw_ref = loop_reference(x, layer.weights, counts, dy)
    assert y.dtype == torch.bfloat16 and y.shape == (sum(counts), out_features)
    assert rel_err(y, y_ref) < 1e-2
    assert rel_err(dx, dx_ref) < 1e-2
    mains = [w.main_grad for w in layer.weights]
    assert rel_err(mains, dw_ref) < 1e-5  # FP32 sums of exact bfloat16 products
    for e, w in enumerate(layer.weights):
        assert w.grad is None and w.grad_added_to_main_grad is True
        if counts[e] == 0:
            assert not w.main_grad.any()


def test_upstream_rounded_to_bfloat16():
    # A float32 loss gradient reaches the layer rounded to bfloat16 (y's dtype).
    layer = make_layer()
    x = torch.randn(sum(COUNTS), IN).bfloat16()
    upstream = torch.randn(sum(COUNTS), OUT)
    step(layer, x, offsets_of(COUNTS), upstream)
    _, _, dw_ref = loop_reference(x, layer.weights, COUNTS, upstream)
    assert rel_err([w.main_grad for w in layer.weights], dw_ref) < 1e-2


def test_three_backward_passes_add_exactly():
    # Integer-valued x, dy and main grads: every product and sum below is exact in float32
    # (and in float64), so the accumulated main grads must equal the reference exactly.
    layer = make_layer()
    with torch.no_grad():
        for w in layer.weights:
            w.copy_(torch.randint(-2, 3, (IN, OUT)))
            w.main_grad.copy_(torch.randint(-100, 101, (IN, OUT)))
    want = [w.main_grad.double().clone() for w in layer.weights]
    addresses = [w.main_grad.data_ptr() for w in layer.weights]
    for counts in ([30, 0, 50, 20], [0, 64, 1, 35], [10, 20, 30, 40]):
        x = torch.randint(-2, 3, (sum(counts), IN)).bfloat16()
        upstream = torch.randint(-2, 3, (sum(counts), OUT)).float()
        step(layer, x, offsets_of(counts), upstream)
        _, _, dw = loop_reference(x, layer.weights, counts, upstream)
        want = [a + b for a, b in zip(want, dw)]
    for w, expected, address in zip(layer.weights, want, addresses):
        assert w.main_grad.data_ptr() == address  # added in place, never replaced
        assert torch.equal(w.main_grad.double(), expected)
        assert w.grad is None


@pytest.mark.parametrize("device", DEVICES)
def test_empty_experts_keep_their_main_grads(device):
    # first, middle and last experts empty
    counts = {"cpu": [0, 40, 0, 0, 60, 0, 0, 0], "cuda": [0, 400, 0, 0, 600, 0, 0, 0]}[device]
    experts, in_features, out_features, _ = PROBLEMS[device]
    layer = make_layer(experts=len(counts), device=device, in_features=in_features,
                       out_features=out_features)
    init = [torch.randn(in_features, out_features, device=device) for _ in counts]
    for w, i in zip(layer.weights, init):
        w.main_grad.copy_(i)
    x, dy, offsets = device_inputs(device, counts)
    y, dx = step_dy(layer, x, offsets, dy)
    y_ref, dx_ref, dw_ref = loop_reference(x, layer.weights, counts, dy)
    for e, (w, i) in enumerate(zip(layer.weights, init)):
        if counts[e] == 0:
            assert torch.equal(w.main_grad, i), e  # bit-for-bit unchanged
        else:
            assert rel_err(w.main_grad - i, dw_ref[e]) < 1e-5
    assert rel_err(y, y_ref) < 1e-2 and rel_err(dx, dx_ref) < 1e-2


def test_no_tokens_change_nothing():
    layer = make_layer(experts=6)
    init = [torch.randn(IN, OUT) for _ in range(6)]
    for w, i in zip(layer.weights, init):
        w.main_grad.copy_(i)
    x0 = torch.zeros(0, IN, dtype=torch.bfloat16)
    y0, dx0 = step(layer, x0, offsets_of([0] * 6), torch.zeros(0, OUT))
    assert y0.shape == (0, OUT) and dx0.shape == (0, IN)
    for w, i in zip(layer.weights, init):
        assert torch.equal(w.main_grad, i)


@pytest.mark.parametrize("device", DEVICES)
def test_main_grad_false_gives_bfloat16_grads(device):
    _, in_features, out_features, counts = PROBLEMS[device]
    layer = device_layer(device, main_grad=False)
    x, dy, offsets = device_inputs(device)
    y, dx = step_dy(layer, x, offsets, dy)
    y_ref, dx_ref, dw_ref = loop_reference(x, layer.weights, counts, dy)
    grads = [w.grad for w in layer.weights]
    assert all(g.dtype == torch.bfloat16 and g.shape == (in_features, out_features)
               for g in grads)
    assert rel_err(grads, dw_ref) < 1e-2
    assert all(not g.any() for g, c in zip(grads, counts) if c == 0)  # empty experts: zeros
    assert rel_err(dx, dx_ref) < 1e-2
    assert not any(hasattr(w, "main_grad") for w in layer.weights)
    # A second pass: autograd adds into the existing .grad as usual.
    first = [g.clone() for g in grads]
    step_dy(layer, x, offsets, dy)
    assert rel_err([w.grad for w in layer.weights], [2 * f.double() for f in first]) < 1e-2


def test_frozen_experts_keep_their_main_grads():
    layer = make_layer()
    layer.weight2.requires_grad_(False)
    x = torch.randn(sum(COUNTS), IN).bfloat16()
    upstream = torch.randn(sum(COUNTS), OUT)
    step(layer, x, offsets_of(COUNTS), upstream)
    _, _, dw_ref = loop_reference(x, layer.weights, COUNTS, upstream)
    assert not layer.weight2.main_grad.any()
    assert layer.weight2.grad_added_to_main_grad is False
    for e in (0, 1, 3):
        assert rel_err(layer.weights[e].main_grad, dw_ref[e]) < 1e-2
        assert layer.weights[e].grad_added_to_main_grad is True


def test_caller_owned_main_grads_in_one_flat_buffer():
    # Megatron's DDP: every main_grad is a view into one contiguous FP32 buffer.
    layer = make_layer(main_grad=False)
    n = IN * OUT
    flat = torch.zeros(E * n + 16)
    for e, w in enumerate(layer.weights):
        w.main_grad = flat[e * n:(e + 1) * n].view(IN, OUT)
    layer.use_main_grad = True
    x = torch.randn(sum(COUNTS), IN).bfloat16()
    upstream = torch.randn(sum(COUNTS), OUT)
    step(layer, x, offsets_of(COUNTS), upstream)
    _, _, dw_ref = loop_reference(x, layer.weights, COUNTS, upstream)
    assert rel_err(flat[:E * n].view(E, IN, OUT), dw_ref) < 1e-2
    assert not flat[E * n:].any()
    assert all(w.grad is None for w in layer.weights)


def test_zero_main_grad_keeps_the_buffers():
    layer = make_layer()
    step(layer, torch.randn(sum(COUNTS), IN).bfloat16(), offsets_of(COUNTS),
         torch.randn(sum(COUNTS), OUT))
    addresses = [w.main_grad.data_ptr() for w in layer.weights]
    layer.zero_main_grad()
    assert [w.main_grad.data_ptr() for w in layer.weights] == addresses
    assert all(not w.main_grad.any() and w.grad_added_to_main_grad is False
               for w in layer.weights)
    layer.allocate_main_grad(torch.bfloat16)  # bfloat16 main grads work too
    step(layer, torch.randn(sum(COUNTS), IN).bfloat16(), offsets_of(COUNTS),
         torch.randn(sum(COUNTS), OUT))
    assert layer.weight0.main_grad.dtype == torch.bfloat16 and layer.weight0.main_grad.any()


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_experts=0), "num_experts"),
    (dict(num_experts=True), "num_experts"),
    (dict(in_features=12), "in_features"),
    (dict(out_features="48"), "out_features"),
    (dict(dtype=torch.float32), "dtype"),
    (dict(main_grad="yes"), "main_grad"),
])
def test_constructor_errors_name_the_argument(kwargs, name):
    args = dict(num_experts=E, in_features=IN, out_features=OUT)
    args.update(kwargs)
    positional = [args.pop(k) for k in ("num_experts", "in_features", "out_features")]
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        gwt.GroupedLinear(*positional, **args)


def test_forward_errors_name_the_argument():
    layer = make_layer()
    x = torch.randn(sum(COUNTS), IN).bfloat16()
    offsets = offsets_of(COUNTS)
    cases = [
        ((x.float(), offsets), r"^x: expected a bfloat16 \(tokens, 32\)"),
        ((x[:, :16], offsets), r"^x: expected a bfloat16 \(tokens, 32\)"),
        ((x[None], offsets), r"^x: expected"),
        ((x.tolist(), offsets), r"^x: expected a torch.Tensor, got list"),
        ((x.to("meta"), offsets), r"^x: expected a tensor on cpu"),
        ((x, offsets.long()), r"^offsets: expected an int32 \(4,\) tensor"),
        ((x, offsets[:3]), r"^offsets: expected an int32 \(4,\) tensor"),
        ((x, offsets.numpy()), r"^offsets: expected a torch.Tensor, got ndarray"),
        ((x, offsets.to("meta")), r"^offsets: expected a tensor on cpu like x"),
    ]
    for args, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            layer(*args)


def test_main_grad_errors_name_the_weight():
    layer = make_layer()
    x = torch.randn(sum(COUNTS), IN).bfloat16()
    offsets = offsets_of(COUNTS)
    del layer.weight1.main_grad
    with pytest.raises(ValueError, match=r"^weight1.main_grad: expected .*got None"):
        layer(x, offsets)
    layer.weight1.main_grad = torch.zeros(IN, OUT, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"^weight1.main_grad: expected .*float16"):
        layer(x, offsets)
    layer.weight1.main_grad = torch.zeros(OUT, IN).T
    with pytest.raises(ValueError, match=r"^weight1.main_grad: .*not contiguous"):
        layer(x, offsets)
    layer.weight1.main_grad = torch.zeros(IN, OUT, dtype=torch.bfloat16)  # not weight0's dtype
    with pytest.raises(ValueError, match=r"^weight1.main_grad: .*bfloat16"):
        layer(x, offsets)
    layer.weight1.main_grad = torch.zeros(IN * OUT + 1)[1:].view(IN, OUT)  # 4-byte aligned
    with pytest.raises(ValueError, match=r"^weight1.main_grad: .*not 16-byte aligned"):
        layer(x, offsets)
    # Replaced between forward and backward: the backward checks again.
    layer.weight1.main_grad = torch.zeros(IN, OUT)
    y = layer(x, offsets)
    layer.weight3.main_grad = None
    with pytest.raises(ValueError, match=r"^weight3.main_grad: "):
        y.float().sum().backward()
    # Without gradients the main grads are not needed.
    with torch.no_grad():
        assert layer(x, offsets).shape == (sum(COUNTS), OUT)
    # A weight changed behind the layer's back.
    layer.weight2 = torch.nn.Parameter(torch.zeros(IN, OUT))
    with pytest.raises(ValueError, match=r"^weight2: expected a bfloat16 \(32, 48\) parameter"):
        layer(x, offsets)


# --- on a GPU only -------------------------------------------------------------------------------


def cuda_offsets(counts):
    return offsets_of(counts, "cuda")


def cuda_layer(main_grad=True):
    return device_layer("cuda", main_grad)


def cuda_inputs(counts=CUDA_COUNTS):
    return device_inputs("cuda", counts)


class TestCuda:
    pytestmark = GPU

    def test_main_grads_accumulate_over_steps(self):
        layer = cuda_layer()
        init = [torch.randn(CUDA_IN, CUDA_OUT, device="cuda") for _ in range(CUDA_E)]
        for w, i in zip(layer.weights, init):
            w.main_grad.copy_(i)
        addresses = [w.main_grad.data_ptr() for w in layer.weights]
        want = [torch.zeros(CUDA_IN, CUDA_OUT, dtype=torch.float64, device="cuda")
                for _ in range(CUDA_E)]
        for counts in (CUDA_COUNTS, [0, 300, 0, 700, 1, 999, 0, 0], [250] * 8):
            x, dy, offsets = cuda_inputs(counts)
            step_dy(layer, x, offsets, dy)
            _, _, dw = loop_reference(x, layer.weights, counts, dy)
            want = [a + b for a, b in zip(want, dw)]
        gwgrad.check_errors()
        assert [w.main_grad.data_ptr() for w in layer.weights] == addresses
        added = [w.main_grad.double() - i.double() for w, i in zip(layer.weights, init)]
        assert rel_err(added, want) < 1e-5

    def test_main_grads_add_exactly_with_integer_values(self):
        # Integer-valued x, dy and main grads: every product and FP32 sum is exact.
        layer = cuda_layer()
        with torch.no_grad():
            for w in layer.weights:
                w.copy_(torch.randint(-2, 3, (CUDA_IN, CUDA_OUT), device="cuda"))
                w.main_grad.copy_(torch.randint(-100, 101, (CUDA_IN, CUDA_OUT), device="cuda"))
        want = [w.main_grad.double().clone() for w in layer.weights]
        for counts in (CUDA_COUNTS, [0, 64, 1, 35, 0, 0, 200, 7], [10] * 8):
            x = torch.randint(-2, 3, (sum(counts), CUDA_IN), device="cuda").bfloat16()
            dy = torch.randint(-2, 3, (sum(counts), CUDA_OUT), device="cuda").bfloat16()
            step_dy(layer, x, cuda_offsets(counts), dy)
            _, _, dw = loop_reference(x, layer.weights, counts, dy)
            want = [a + b for a, b in zip(want, dw)]
        for w, expected in zip(layer.weights, want):
            assert torch.equal(w.main_grad.double(), expected)

    def test_weight_gradient_step_allocates_no_dw_temporary(self):
        layer = cuda_layer()
        x, dy, offsets = cuda_inputs()
        step_dy(layer, x, offsets, dy)  # warm-up: compile, plan, pointer array, workspace
        step_dy(layer, x, offsets, dy, x_grad=False)
        addresses = [w.main_grad.data_ptr() for w in layer.weights]
        dw_fp32 = CUDA_E * CUDA_IN * CUDA_OUT * 4
        stack_bf16 = CUDA_E * CUDA_IN * CUDA_OUT * 2
        dx_bytes = CUDA_TOKENS * CUDA_IN * 2

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

    def test_forward_and_backward_do_not_synchronize(self):
        layer = cuda_layer()
        x, dy, offsets = cuda_inputs()
        step_dy(layer, x, offsets, dy)  # warm-up (compiles; caches the pointer array)
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

    def test_cuda_graph_capture_of_forward_and_backward(self):
        layer = cuda_layer()
        x = torch.randn(CUDA_TOKENS, CUDA_IN, dtype=torch.bfloat16, device="cuda").requires_grad_()
        dy = torch.randn(CUDA_TOKENS, CUDA_OUT, dtype=torch.bfloat16, device="cuda")
        offsets = cuda_offsets(CUDA_COUNTS)
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
        eighth = CUDA_TOKENS // 8
        replays = [CUDA_COUNTS, [0, 0, 0, CUDA_TOKENS, 0, 0, 0, 0],
                   [eighth] * 7 + [CUDA_TOKENS - 7 * eighth],
                   [1, 2, 3, 4, 5, 6, 7, CUDA_TOKENS - 28], [0, 1000, 0, 999, 0, 0, 0, 0]]
        for counts in replays:
            assert sum(counts) == CUDA_TOKENS
            offsets.copy_(cuda_offsets(counts))  # the captured tensor, new values
            before = [w.main_grad.clone() for w in layer.weights]
            graph.replay()
            got_y, got_dx = y.detach().clone(), dx_graph.clone()
            got_main = [w.main_grad.clone() for w in layer.weights]
            # An eager step from the same main grads, on the same inputs and offsets.
            for w, b in zip(layer.weights, before):
                w.main_grad.copy_(b)
            want_y, want_dx = step_dy(layer, x, offsets, dy)
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

    def test_device_errors_name_the_argument(self):
        layer = cuda_layer()
        x, _, offsets = cuda_inputs()
        # The current device, which is not cuda:0 in a process where JAX initialized two GPUs.
        device = str(layer.weight0.device)
        assert x.device == layer.weight0.device
        with pytest.raises(ValueError, match=rf"^offsets: expected a tensor on {device} like x"):
            layer(x, offsets.cpu())
        with pytest.raises(ValueError, match=rf"^x: expected a tensor on {device}"):
            layer(x.cpu(), offsets)
        layer.weight4.main_grad = torch.zeros(CUDA_IN, CUDA_OUT)  # on the CPU
        with pytest.raises(ValueError, match=rf"^weight4.main_grad: expected .*on {device}"):
            layer(x, offsets)
