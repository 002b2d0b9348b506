"""Does a gwgrad call wait for SMs that another stream's kernel holds?

In training, the weight gradient often runs beside a communication kernel on another stream
(NCCL's all-to-all or reduce-scatter), which holds some SMs for its whole duration. Here a
stand-in holds k SMs for ``--hold-ms``: a CuPy kernel of k CTAs, each with enough dynamic
shared memory (200 KiB) that no gwgrad CTA fits beside it, spinning on ``clock64``. It is
enqueued first, on its own stream; gwgrad's call follows on torch's stream. For each k the
script times gwgrad's call (CUDA events around it on its own stream, median of ``--reps``)
alone and beside the held SMs, as one launch (the default: the prep work inside the GEMM)
and as two (a prep kernel, then the GEMM).

What to expect: a GEMM whose CTAs go on by themselves takes about alone x SMs / (SMs - k)
beside k held SMs. A grid barrier (the single launch until the prep hand-off, commit
05eb609) makes every CTA wait for the ones that cannot start: the call then lasts at least
as long as the hold (H200: 0.63 ms alone, 3.60 ms beside 8 held SMs with the barrier, 0.67 ms
with the hand-off).

Usage (GPU host, torch and CuPy): python scripts/overlap_stall.py [--held 0,8,32]
    [--hold-ms 3] [--reps 5] [--json out.json]
"""
import argparse
import json
import statistics
import sys

HOLD_SMEM = 200 * 1024
HOLD_SRC = r"""
extern "C" __global__ void hold(long long cycles, int* sink) {
    extern __shared__ int smem[];
    long long start = clock64();
    while (clock64() - start < cycles) { }
    if (threadIdx.x == 0 && cycles < 0) { sink[0] = smem[0]; }  // keeps smem in use
}
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--held", default="0,8,32", help="SMs held, comma-separated")
    p.add_argument("--hold-ms", type=float, default=3.0, help="how long they are held")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--shape", default="2048,1536,128,65536",
                   help="hidden,intermediate,experts,tokens (uniform counts)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import cupy
    import torch

    from gwgrad.bench import KernelRunner

    hidden, inter, experts, tokens = (int(v) for v in args.shape.split(","))
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, inter, device="cuda", dtype=torch.bfloat16)
    offsets = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (tokens // experts)
    out = torch.empty(experts, hidden, inter, device="cuda", dtype=torch.bfloat16)
    runners = {"one launch": KernelRunner(x.t(), dy, offsets, out),
               "two launches": KernelRunner(x.t(), dy, offsets, out,
                                            tuning=(("launches", 2),))}
    kernel = cupy.RawKernel(HOLD_SRC, "hold")
    kernel.max_dynamic_shared_size_bytes = HOLD_SMEM
    side = cupy.cuda.Stream(non_blocking=True)
    sink = cupy.zeros(1, dtype=cupy.int32)

    def hold(sms: int, cycles: int):
        if sms:
            kernel((sms,), (32,), (cupy.int64(cycles), sink), shared_mem=HOLD_SMEM, stream=side)

    # Cycles per millisecond of the hold kernel, from one timed 1e7-cycle hold on one SM.
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    hold(1, 10**6)
    start.record(side)
    hold(1, 10**7)
    end.record(side)
    end.synchronize()
    cycles = int(args.hold_ms * 10**7 / cupy.cuda.get_elapsed_time(start, end))

    rows = []
    for name, run in runners.items():
        run()
        torch.cuda.synchronize()
        for held in (int(v) for v in args.held.split(",")):
            samples = []
            for _ in range(args.reps):
                hold(held, cycles)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                run()
                e.record()
                torch.cuda.synchronize()
                side.synchronize()
                samples.append(s.elapsed_time(e))
            ms = statistics.median(samples)
            rows.append({"launches": name, "held_sms": held, "hold_ms": args.hold_ms,
                         "gwgrad_ms": ms, "samples_ms": samples})
            print(f"{name:13} {held:3d} SMs held for {args.hold_ms} ms: gwgrad {ms:7.3f} ms",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
