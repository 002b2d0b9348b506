"""Where the host time of one cached call goes, per entry point (GPU host): cProfile over
back-to-back calls of the contract's wrapper, the torch adapter and the raw plan launch on
a small problem, top functions by own time. A development aid next to
``python -m gwgrad.bench.adapters --skip-kernel`` (which gives the medians)."""

from __future__ import annotations

import cProfile
import itertools
import pstats
import sys

import torch

import gwgrad
import gwgrad.adapters.torch as gwt


def main(calls: int = 3000) -> None:
    e, h, n, t = 8, 256, 256, 2048
    x = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(t, n, dtype=torch.bfloat16, device="cuda")
    pool = [torch.arange(1, e + 1, dtype=torch.int32, device="cuda") * (t // e) for _ in range(16)]
    out = torch.empty(e, h, n, dtype=torch.bfloat16, device="cuda")
    nxt = itertools.cycle(pool).__next__
    plan = gwgrad.plan_for(*(gwgrad.as_tensor_desc(v, k) for v, k in
                             ((x.T, "a"), (dy, "b"), (pool[0], "o"))),
                           wgrad=gwgrad.as_tensor_desc(out, "w"))
    ws = torch.zeros(plan.workspace_bytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    entries = {
        "wrapper": lambda: gwgrad.grouped_gemm_wgrad_wrapper_sm100(
            a_tensor=x.T, b_tensor=dy, sfa_tensor=None, sfb_tensor=None, offsets_tensor=nxt(),
            wgrad_tensor=out),
        "torch_wgrad_out": lambda: gwt.wgrad(x, dy, nxt(), out=out),
        "plan_launch": lambda: plan.launch(x.data_ptr(), dy.data_ptr(), pool[0].data_ptr(),
                                           out.data_ptr(), stream=stream,
                                           workspace=ws.data_ptr()),
    }
    for name, fn in entries.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(calls):
            fn()
        profile.disable()
        torch.cuda.synchronize()
        stats = pstats.Stats(profile, stream=sys.stdout)
        total = stats.total_tt / calls * 1e6
        print(f"== {name}: {total:.2f} us per call under cProfile (inflated); own time:")
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:10]
        for (file, line, func), (_, ncalls, tottime, _, _) in rows:
            where = f"{file.rsplit('/', 2)[-1]}:{line}" if line else file
            print(f"   {tottime / calls * 1e6:7.2f} us  {ncalls // calls:3d}x  {func}  ({where})")
    gwgrad.check_errors()


if __name__ == "__main__":
    main()
