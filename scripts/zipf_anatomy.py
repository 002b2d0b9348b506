"""Where the zipf rows lose against dense cuBLAS: gwgrad's kernel time (plan.launch, CUDA
events, median of interleaved rounds) on variants of a zipf row's counts, each against the
dense GEMM of its own FLOPs. Diagnostic for docs/PERF_NOTES.md (issue #12).

Usage (GPU host): python scripts/zipf_anatomy.py out.json

As an ncu target, each chosen variant's gwgrad call and its dense GEMM once inside an NVTX
range ``prof`` (warm-up outside), in the order printed:

    ncu --clock-control none --nvtx --nvtx-include "prof/" --section SpeedOfLight --csv \
        --page details --log-file ncu.csv python scripts/zipf_anatomy.py --profile \
        "zipf|zipf, empty experts dropped"      (variant names, separated by |)
    python scripts/profile_gemm.py --summarize ncu.csv"""
import json
import sys

from gwgrad.bench import time_interleaved, token_counts

ROWS = (("qwen3-30b-fc2", 768, 2048, 128, 131072), ("qwen3-30b-fc1", 2048, 1536, 128, 131072))


def split_long(counts, chunk):
    """Each count over ``chunk`` as counts of ``chunk`` tokens and a remainder: the same tokens
    and FLOPs as more, shorter experts. What a K split of the long experts' units at ``chunk``
    tokens could reach at best: each piece writes its own output, as each K-chunk of a split
    tile would write (or reduce-add) its partial tile, but nothing waits for another piece."""
    out = []
    for c in counts:
        while c > chunk:
            out.append(chunk)
            c -= chunk
        out.append(c)
    return out


def variants(tokens_sum, num_experts):
    """name -> per-expert counts: the row's uniform and zipf counts, the zipf counts without
    the empty experts, without the short ones, or with only the longest, and the zipf counts
    with the long experts split (the bound of a K split, split_long)."""
    z = token_counts(tokens_sum, num_experts, "zipf")
    return {
        "uniform": token_counts(tokens_sum, num_experts, "uniform"),
        "zipf": z,
        "zipf, empty experts dropped": [c for c in z if c],
        "zipf, experts <= 512 tokens dropped": [c for c in z if c > 512],
        "zipf, experts <= 2048 tokens dropped": [c for c in z if c > 2048],
        "zipf, experts >= 8192 tokens only": [c for c in z if c >= 8192],
        "zipf, experts > 8192 tokens split at 8192": split_long(z, 8192),
        "zipf, experts > 4096 tokens split at 4096": split_long(z, 4096),
        "zipf, empty dropped, > 4096 split at 4096": split_long([c for c in z if c], 4096),
    }


def schedule_bound(counts, tiles_per_expert, slots=132):
    """The unit schedule's own loss, by a model: units take time proportional to their
    64-token K-tiles (nothing else), are handed out longest expert first to ``slots``
    workers that each take the next unit when free (the kernel's dynamic scheduler; a
    worker per SM). Returns makespan / (total work / slots): 1.0 when the hand-out keeps
    every worker busy to the end; what wave quantization alone costs otherwise."""
    import heapq

    units = []
    for c in sorted(counts, reverse=True):
        if c:
            units += [-(-c // 64)] * tiles_per_expert
    if not units:
        return 1.0
    free = [0] * slots
    for work in units:
        heapq.heappush(free, heapq.heappop(free) + work)
    return max(free) / (sum(units) / slots)


def case(hidden, inter, counts):
    import torch

    from gwgrad.bench import KernelRunner

    t = sum(counts)
    x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, inter, device="cuda", dtype=torch.bfloat16)
    off = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    out = torch.empty(len(counts), hidden, inter, device="cuda", dtype=torch.bfloat16)
    run = KernelRunner(x.t(), dy, off, out)
    a = x.t().contiguous()
    dense_out = torch.empty(hidden, inter, device="cuda", dtype=torch.bfloat16)
    return run, (lambda: torch.mm(a, dy, out=dense_out)), 2.0 * hidden * inter * t


def torch_sms():
    import torch

    return torch.cuda.get_device_properties(0).multi_processor_count


def main(path, only=None):
    """Every variant of both rows (``only``: those variant names) into ``path``."""
    rows = []
    for name, hidden, inter, experts, tokens in ROWS:
        for vname, counts in variants(tokens, experts).items():
            if only and vname not in only:
                continue
            run, dense, flops = case(hidden, inter, counts)
            ms = time_interleaved({"gwgrad": run, "dense": dense}, rounds=15)
            row = {"row": name, "variant": vname, "experts": len(counts), "tokens": sum(counts),
                   "gwgrad_ms": ms["gwgrad"], "dense_ms": ms["dense"],
                   "gwgrad_tflops": flops / ms["gwgrad"] / 1e9,
                   "dense_tflops": flops / ms["dense"] / 1e9,
                   "ratio_vs_dense": ms["dense"] / ms["gwgrad"], "tile": list(run.tile),
                   "schedule_bound": schedule_bound(
                       counts, -(-hidden // run.tile[0]) * -(-inter // run.tile[1]),
                       torch_sms())}
            rows.append(row)
            print(f"{name:14} {vname:38} E={len(counts):3d} T={sum(counts):6d} gwgrad "
                  f"{row['gwgrad_tflops']:6.1f} dense {row['dense_tflops']:6.1f} x dense "
                  f"{row['ratio_vs_dense']:.3f} ({row['gwgrad_ms'] * 1e3:.0f} us; schedule "
                  f"model {row['schedule_bound']:.3f})", flush=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


def profile(names):
    """One call of gwgrad and of the dense GEMM per row and chosen variant, each inside an
    NVTX range "prof" (ncu --nvtx-include "prof/"), after a warm-up outside it."""
    import torch

    for name, hidden, inter, experts, tokens in ROWS:
        chosen = variants(tokens, experts)
        for vname in names:
            run, dense, flops = case(hidden, inter, chosen[vname])
            for fn in (run, dense, run, dense):  # compile, cuBLAS heuristics: outside
                fn()
            torch.cuda.synchronize()
            for method, fn in (("gwgrad", run), ("dense", dense)):
                torch.cuda.nvtx.range_push("prof")
                fn()
                torch.cuda.nvtx.range_pop()
                torch.cuda.synchronize()
                print(f"prof: {name} | {vname} | {method}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--profile":
        profile([v.strip() for v in sys.argv[2].split("|") if v.strip()])
    else:  # python scripts/zipf_anatomy.py out.json ["uniform|zipf"]
        main(sys.argv[1], [v.strip() for v in sys.argv[2].split("|")] if len(sys.argv) > 2
             else None)
