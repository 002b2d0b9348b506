"""The weight gradient of an MoE expert layer with torch tensors (CUDA if present, else CPU).

    python examples/torch_moe_wgrad.py
"""

import torch

import gwgrad

device = "cuda" if torch.cuda.is_available() else "cpu"
# Smaller on the CPU, where the NumPy reference backend computes it.
hidden, intermediate, experts = (1024, 2048, 8) if device == "cuda" else (128, 256, 4)
counts = torch.randint(0, 1024 if device == "cuda" else 128, (experts,))
offsets = torch.cumsum(counts, 0).to(torch.int32).to(device)
tokens_sum = int(counts.sum())

x = torch.randn(tokens_sum, hidden, dtype=torch.bfloat16, device=device)  # expert inputs
dy = torch.randn(tokens_sum, intermediate, dtype=torch.bfloat16, device=device)  # output grads

# W[e] = x[begin:end].T @ dy[begin:end]: A = x.T (M-major) and B = dy (N-major), no copies.
(wgrad,) = gwgrad.grouped_gemm_wgrad(x.T, dy, offsets_tensor=offsets, wgrad_dtype=torch.float32)

# Reusable operator: compiled once, then any tokens_sum / offsets.
op = gwgrad.GroupedGemmWgrad(sample_a=x.T, sample_b=dy, sample_sfa=None, sample_sfb=None,
                             sample_offsets=offsets, sample_wgrad=wgrad)
op.check_support()
op.compile()
op.execute(a_tensor=x.T, b_tensor=dy, sfa_tensor=None, sfb_tensor=None, offsets_tensor=offsets,
           wgrad_tensor=wgrad)

bounds = [0] + offsets.tolist()
want = torch.stack([x[s:e].double().T @ dy[s:e].double() for s, e in zip(bounds, bounds[1:])])
print(f"{device}: relative error {float((wgrad.double() - want).norm() / want.norm()):.2e}")
