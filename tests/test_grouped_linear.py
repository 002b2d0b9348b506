"""gwgrad.adapters.torch.GroupedLinear on the CPU (gwgrad's reference backend, the loop
forward): per-expert parameters ``weight0..weight{E-1}`` with FP32 ``main_grad`` buffers that
the backward accumulates into in place (Megatron's ``gradient_accumulation_fusion``
convention), against autograd through a float64 per-expert loop of ``x_e @ W_e``.

Covers: gradients (y, dx, main grads) against the float64 reference; three backward passes
adding exactly (integer-valued inputs: every sum is exact); empty experts (first, middle,
last) leaving their main grads bit-for-bit unchanged; the ``main_grad=False`` path (bfloat16
``.grad``s); frozen experts; caller-owned main grads as views into one flat buffer;
``zero_main_grad``; argument errors as ValueErrors naming the argument.

    python -m pytest -q tests/test_grouped_linear.py

The same checks on a GPU, plus memory, no-sync and CUDA-graph checks:
tests/test_grouped_linear_gpu.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import gwgrad.adapters.torch as gwt  # noqa: E402

E, IN, OUT = 4, 32, 48
COUNTS = [50, 0, 70, 80]


def offsets_of(counts, device="cpu"):
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(device)


def make_layer(main_grad=True, experts=E, device="cpu"):
    layer = gwt.GroupedLinear(experts, IN, OUT, main_grad=main_grad, device=device)
    with torch.no_grad():
        for w in layer.weights:
            w.copy_(torch.randn(IN, OUT) / IN ** 0.5)
    return layer


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


def test_gradients_match_float64_loop():
    layer = make_layer()
    x = torch.randn(sum(COUNTS), IN).bfloat16()
    upstream = torch.randn(sum(COUNTS), OUT)
    y, dx = step(layer, x, offsets_of(COUNTS), upstream)
    y_ref, dx_ref, dw_ref = loop_reference(x, layer.weights, COUNTS, upstream)
    assert y.dtype == torch.bfloat16 and y.shape == (sum(COUNTS), OUT)
    assert rel_err(y, y_ref) < 1e-2
    assert rel_err(dx, dx_ref) < 1e-2
    mains = [w.main_grad for w in layer.weights]
    assert rel_err(mains, dw_ref) < 1e-2  # dy is upstream rounded to bfloat16
    for w in layer.weights:
        assert w.grad is None and w.grad_added_to_main_grad is True
    assert not mains[1].any()  # the empty expert


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


def test_empty_experts_keep_their_main_grads():
    layer = make_layer(experts=6)
    init = [torch.randn(IN, OUT) for _ in range(6)]
    for w, i in zip(layer.weights, init):
        w.main_grad.copy_(i)
    counts = [0, 40, 0, 0, 60, 0]  # first, middle and last experts empty
    x = torch.randn(sum(counts), IN).bfloat16()
    upstream = torch.randn(sum(counts), OUT)
    y, dx = step(layer, x, offsets_of(counts), upstream)
    y_ref, dx_ref, dw_ref = loop_reference(x, layer.weights, counts, upstream)
    for e, (w, i) in enumerate(zip(layer.weights, init)):
        if counts[e] == 0:
            assert torch.equal(w.main_grad, i), e  # bit-for-bit unchanged
        else:
            assert rel_err(w.main_grad - i, dw_ref[e]) < 1e-2
    assert rel_err(y, y_ref) < 1e-2 and rel_err(dx, dx_ref) < 1e-2
    # No tokens at all: nothing changes, and nothing fails.
    x0 = torch.zeros(0, IN, dtype=torch.bfloat16)
    y0, dx0 = step(layer, x0, offsets_of([0] * 6), torch.zeros(0, OUT))
    assert y0.shape == (0, OUT) and dx0.shape == (0, IN)
    for w, i, d in zip(layer.weights, init, dw_ref):
        assert rel_err(w.main_grad - i, d) < 1e-2


def test_main_grad_false_gives_bfloat16_grads():
    layer = make_layer(main_grad=False)
    x = torch.randn(sum(COUNTS), IN).bfloat16()
    upstream = torch.randn(sum(COUNTS), OUT)
    y, dx = step(layer, x, offsets_of(COUNTS), upstream)
    y_ref, dx_ref, dw_ref = loop_reference(x, layer.weights, COUNTS, upstream)
    grads = [w.grad for w in layer.weights]
    assert all(g.dtype == torch.bfloat16 and g.shape == (IN, OUT) for g in grads)
    assert rel_err(grads, dw_ref) < 1e-2
    assert not grads[1].any()  # the empty expert: zeros
    assert rel_err(dx, dx_ref) < 1e-2
    assert not any(hasattr(w, "main_grad") for w in layer.weights)
    # A second pass: autograd adds into the existing .grad as usual.
    first = [g.clone() for g in grads]
    step(layer, x, offsets_of(COUNTS), upstream)
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
