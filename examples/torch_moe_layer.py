"""A PyTorch MoE layer's training step with gwgrad computing the expert weight gradients.

    python examples/torch_moe_layer.py

Top-1 routing, tokens grouped by expert, then per expert ``y = gelu(x @ w1[e]) @ w2[e]``
through ``gwgrad.adapters.torch.grouped_expert_linear`` (forward: torch._grouped_mm or a loop;
backward: dx with torch, dw with gwgrad). The step's gradients are checked against autograd
through a float64 per-expert loop. Runs on CUDA when present, else on the CPU (gwgrad's
reference implementation).
"""

import torch

import gwgrad.adapters.torch as gwt

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
tokens, hidden, ffn, experts = (4096, 512, 1024, 8) if device == "cuda" else (256, 64, 128, 4)

x = torch.randn(tokens, hidden, device=device)
router = torch.randn(hidden, experts, device=device) / hidden ** 0.5
w1 = (torch.randn(experts, hidden, ffn, device=device) / hidden ** 0.5).bfloat16().requires_grad_()
w2 = (torch.randn(experts, ffn, hidden, device=device) / ffn ** 0.5).bfloat16().requires_grad_()


def route(x):
    """Top-1 routing: the permutation grouping tokens by expert, and the offsets."""
    expert = (x @ router).argmax(dim=1)
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=experts)
    return order, torch.cumsum(counts, 0).to(torch.int32)


def moe(x, w1, w2, linear):
    order, offsets = route(x)
    xs = x[order].bfloat16()
    h = torch.nn.functional.gelu(linear(xs, w1, offsets).float()).bfloat16()
    ys = linear(h, w2, offsets)
    return torch.empty_like(ys).index_copy_(0, order, ys)  # back to token order


# One training step: loss, backward (gwgrad computes w1.grad and w2.grad).
target = torch.randn(tokens, hidden, device=device)
loss = ((moe(x, w1, w2, gwt.grouped_expert_linear).float() - target) ** 2).mean()
loss.backward()

# The reference: autograd through a float64 loop over experts.
w1_ref = w1.detach().double().requires_grad_()
w2_ref = w2.detach().double().requires_grad_()


def loop_linear(xs, w, offsets):
    return gwt.grouped_mm_reference(xs.double(), w, offsets)


order, offsets = route(x)
xs = x[order].bfloat16()
h = torch.nn.functional.gelu(loop_linear(xs, w1_ref, offsets)).bfloat16()
ys = loop_linear(h, w2_ref, offsets)
loss_ref = ((torch.empty_like(ys).index_copy_(0, order, ys) - target.double()) ** 2).mean()
loss_ref.backward()

for name, got, want in (("w1", w1.grad, w1_ref.grad), ("w2", w2.grad, w2_ref.grad)):
    err = float((got.double() - want).norm() / want.norm())
    print(f"{device}: {name}.grad {tuple(got.shape)} relative error {err:.2e}")
    assert err < 3e-2, (name, err)
print(f"loss {loss.item():.4f} (reference {loss_ref.item():.4f}); tokens per expert "
      f"{torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()}")
