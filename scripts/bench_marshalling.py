#!/usr/bin/env python
"""Host cost of one kernel call's argument marshalling, measured without a GPU.

A host-only CuTe DSL function with the kernels' entry signature (five pointers, tokens_sum,
grid_size, a stream; no device code, so it runs anywhere) is called through:

  dsl_call        what CompiledGemm.launch does today: 5 make_ptr + CUstream + fn(...)
  dsl_prebuilt    fn(...) with the pointer objects made once (the DSL's marshalling alone)
  packed          gwgrad.backends._fastcall.PackedLauncher (values written into a pre-packed
                  argument array, then the compiled host function)
  tvm_ffi         the function compiled with --enable-tvm-ffi, called with plain ints
                  (needs the apache-tvm-ffi package)

and the adapters' own per-call cost with the kernel launch stubbed out:

  torch_adapter   gwgrad.adapters.torch.wgrad(x, dy, offsets, out=out) on CPU tensors, the
                  prepared call's launch replaced by a no-op (so: key, lookup, addresses)
  core_wrapper    gwgrad.grouped_gemm_wgrad(...) with the backend launch a no-op

    python scripts/bench_marshalling.py [--json out.json]

On the GPU host the CUDA-only parts (cudaGetDevice/SetDevice around the launch, torch's
current stream, the workspace allocation, cuLaunchKernelEx itself) come on top.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def per_call_us(fn, n=20000, repeats=5):
    for _ in range(min(n, 2000)):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(samples)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)

    import cuda.bindings.driver as cuda_driver
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32
    from cutlass.cute.runtime import make_ptr

    from gwgrad.backends._fastcall import PackedLauncher
    from scripts_entry import entry  # the host-only function (a file: the DSL needs source)

    gmem = cute.AddressSpace.gmem

    def ptr(dtype, address, align):
        return make_ptr(dtype, address, gmem, assumed_align=align)

    samples = [ptr(cutlass.BFloat16, 0, 16), ptr(cutlass.BFloat16, 0, 16),
               ptr(cutlass.Int32, 0, 4), ptr(cutlass.BFloat16, 0, 16), ptr(cutlass.Uint8, 0, 128)]
    fn = cute.compile(entry, *samples, Int32(0), Int32(1), cuda_driver.CUstream(0),
                      options="--gpu-arch sm_90a")
    a, b, o, c, w = 1 << 20, 2 << 20, 3 << 20, 4 << 20, 5 << 20

    def dsl_call():
        fn(ptr(cutlass.BFloat16, a, 16), ptr(cutlass.BFloat16, b, 16), ptr(cutlass.Int32, o, 4),
           ptr(cutlass.BFloat16, c, 16), ptr(cutlass.Uint8, w, 128), 4096, 132,
           cuda_driver.CUstream(7))

    prebuilt = [ptr(cutlass.BFloat16, a, 16), ptr(cutlass.BFloat16, b, 16),
                ptr(cutlass.Int32, o, 4), ptr(cutlass.BFloat16, c, 16), ptr(cutlass.Uint8, w, 128)]
    stream = cuda_driver.CUstream(7)
    packed = PackedLauncher(fn, 5, 2, None, samples)
    rows = {
        "dsl_call": per_call_us(dsl_call),
        "dsl_prebuilt": per_call_us(lambda: fn(*prebuilt, 4096, 132, stream)),
        "packed": per_call_us(lambda: packed.launch_entry(a, b, o, c, w, 4096, 132, 7)),
    }
    try:
        import tvm_ffi  # noqa: F401

        fn_tvm = cute.compile(entry, *samples, Int32(0), Int32(1), cuda_driver.CUstream(0),
                              options="--gpu-arch sm_90a --enable-tvm-ffi")
        rows["tvm_ffi"] = per_call_us(lambda: fn_tvm(a, b, o, c, w, 4096, 132, 7))
    except ImportError:
        rows["tvm_ffi"] = None

    rows.update(_adapter_rows())
    width = max(len(k) for k in rows)
    for name, us in rows.items():
        print(f"{name:<{width}}  " + (f"{us:7.2f} us" if us is not None else "   n/a (not installed)"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"python": sys.version, "per_call_us": rows}, f, indent=1)
    return 0


def _adapter_rows():
    rows = {}
    try:
        import torch
    except ImportError:
        return rows
    import gwgrad
    import gwgrad.adapters.torch as gwt
    from gwgrad.backends import reference

    x = torch.randn(512, 128, dtype=torch.bfloat16)
    dy = torch.randn(512, 128, dtype=torch.bfloat16)
    offsets = torch.tensor([128, 256, 384, 512], dtype=torch.int32)
    out = torch.empty(4, 128, 128)
    gwt.wgrad(x, dy, offsets, out=out)
    for call in gwt._prepared.values():  # as if the backend offered launch_pointers
        call._launch_pointers = lambda *args: None
    rows["torch_adapter"] = per_call_us(lambda: gwt.wgrad(x, dy, offsets, out=out))
    original = reference.ReferenceBackend.launch
    reference.ReferenceBackend.launch = lambda self, compiled, spec, args: None
    try:
        rows["core_wrapper"] = per_call_us(lambda: gwgrad.grouped_gemm_wgrad(
            x.T, dy, offsets_tensor=offsets, wgrad_tensor=out, validate_offsets=False))
    finally:
        reference.ReferenceBackend.launch = original
    return rows


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
