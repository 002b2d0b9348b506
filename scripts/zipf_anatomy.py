"""Where the zipf rows lose against dense cuBLAS: gwgrad's kernel time (plan.launch, CUDA
events, median of interleaved rounds) on variants of a zipf row's counts, each against the
dense GEMM of its own FLOPs. Diagnostic for docs/PERF_NOTES.md (issue #12)."""
import json, statistics, sys
import torch
from gwgrad.bench import KernelRunner, token_counts

def timed(fns, rounds=15, reps=3):
    ev = {k: [] for k in fns}
    for f in fns.values():
        f(); f()
    torch.cuda.synchronize()
    for r in range(rounds):
        for k, f in fns.items():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(reps):
                f()
            e.record(); torch.cuda.synchronize()
            ev[k].append(s.elapsed_time(e) / reps)
    return {k: statistics.median(v) for k, v in ev.items()}

def case(H, I, counts):
    T = sum(counts)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, I, device="cuda", dtype=torch.bfloat16)
    off = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    out = torch.empty(len(counts), H, I, device="cuda", dtype=torch.bfloat16)
    run = KernelRunner(x.t(), dy, off, out)
    a, b = x.t().contiguous(), dy
    dense_out = torch.empty(H, I, device="cuda", dtype=torch.bfloat16)
    return run, (lambda: torch.mm(a, b, out=dense_out)), 2.0 * H * I * T

rows = []
for name, H, I, E, T in (("qwen3-30b-fc2", 768, 2048, 128, 131072), ("qwen3-30b-fc1", 2048, 1536, 128, 131072)):
    z = token_counts(T, E, "zipf")
    variants = {
        "uniform": token_counts(T, E, "uniform"),
        "zipf": z,
        "zipf, empty experts dropped": [c for c in z if c],
        "zipf, experts <= 512 tokens dropped": [c for c in z if c > 512],
        "zipf, experts <= 2048 tokens dropped": [c for c in z if c > 2048],
        "zipf, experts >= 8192 tokens only": [c for c in z if c >= 8192],
    }
    for vname, counts in variants.items():
        run, dense, flops = case(H, I, counts)
        ms = timed({"gwgrad": run, "dense": dense})
        row = {"row": name, "variant": vname, "experts": len(counts), "tokens": sum(counts),
               "gwgrad_ms": ms["gwgrad"], "dense_ms": ms["dense"],
               "gwgrad_tflops": flops / ms["gwgrad"] / 1e9, "dense_tflops": flops / ms["dense"] / 1e9,
               "ratio_vs_dense": ms["dense"] / ms["gwgrad"], "tile": list(run.tile)}
        rows.append(row)
        print(f"{name:14} {vname:38} E={len(counts):3d} T={sum(counts):6d} gwgrad {row['gwgrad_tflops']:6.1f} dense {row['dense_tflops']:6.1f} x dense {row['ratio_vs_dense']:.3f} ({row['gwgrad_ms']*1e3:.0f} us)", flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
