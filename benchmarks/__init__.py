"""gwgrad's benchmarks: GPU timings against what an H100/H200 (or B200) user has today, and the
CPU demo. They live in the source checkout, not in the installed wheel; run them from the
repository root:

    python -m benchmarks.wgrad        # BF16 weight gradients (also `python -m gwgrad bench`)
    python -m benchmarks.fp8          # the FP8 recipes (SM90)
    python -m benchmarks.blockscaled  # MXFP8 / NVFP4 / MXFP4 (SM100)
    python -m benchmarks.quantize     # the GPU quantizers
    python -m benchmarks.adapters     # kernel time per adapter, host overhead per call
    python -m benchmarks.coldstart    # a new process's first call, with and without the disk cache
"""
