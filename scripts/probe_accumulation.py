"""How far FP32-output weight gradients drift from FP64 as experts grow (one expert of K
tokens, randn BF16 inputs): gwgrad's tensor-core FP32 accumulation next to cuBLAS's BF16 GEMM
with FP32 output (torch.mm out_dtype) and FP32 SGEMM of the same BF16 values. Prints the
relative Frobenius error and the largest element error relative to the output's scale, per K;
the fuzz suite's FP32 tolerance (tests/fuzz_cases.py) is fitted on these figures.

    python scripts/probe_accumulation.py [--m 256] [--n 128] [--ks 1024,8192,32768,65536]
"""
import argparse

import torch

import gwgrad.adapters.torch as gwt


def rel(got, want):
    got, want = got.double(), want.double()
    fro = ((got - want).norm() / want.norm()).item()
    elem = ((got - want).abs().max() / want.abs().max()).item()
    return fro, elem


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=256)
    p.add_argument("--n", type=int, default=128)
    p.add_argument("--ks", default="1024,8192,32768,65536")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(a.seed)
    print(f"{'K':>7} {'gwgrad fro':>11} {'elem':>9} {'cuBLAS bf16->fp32':>18} {'elem':>9} "
          f"{'SGEMM fro':>10} {'elem':>9}   (relative to FP64)")
    for k in (int(v) for v in a.ks.split(",")):
        x = torch.randn(k, a.m, device="cuda", generator=gen).bfloat16()
        dy = torch.randn(k, a.n, device="cuda", generator=gen).bfloat16()
        offsets = torch.tensor([k], dtype=torch.int32, device="cuda")
        want = x.double().T @ dy.double()
        gw = gwt.wgrad(x, dy, offsets, out_dtype=torch.float32)[0]
        try:
            cb = torch.mm(x.T, dy, out_dtype=torch.float32)
            cb_err = rel(cb, want)
        except (TypeError, RuntimeError):
            cb_err = (float("nan"), float("nan"))
        sg = x.float().T @ dy.float()
        g, s = rel(gw, want), rel(sg, want)
        print(f"{k:>7} {g[0]:>11.2e} {g[1]:>9.2e} {cb_err[0]:>18.2e} {cb_err[1]:>9.2e} "
              f"{s[0]:>10.2e} {s[1]:>9.2e}")


if __name__ == "__main__":
    main()
