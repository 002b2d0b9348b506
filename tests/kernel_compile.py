"""Helpers for the compile-only kernel tests: build a spec, compile it for an architecture
without a GPU (the DSL's --gpu-arch), and return the PTX."""

from __future__ import annotations

import dataclasses

from gwgrad.dtypes import DType
from gwgrad.spec import StaticSpec

OUT_DTYPES = {"bfloat16": DType.BFLOAT16, "float16": DType.FLOAT16, "float32": DType.FLOAT32}


def spec(arch, *, hidden=512, intermediate=768, experts=8, a_major="m", b_major="n",
         order="tensor2d", mode="dense", out="bfloat16", acc=False, tile=None, cluster=None):
    return StaticSpec(
        hidden=hidden, intermediate=intermediate, num_experts=experts,
        a_dtype=DType.BFLOAT16, b_dtype=DType.BFLOAT16, wgrad_dtype=OUT_DTYPES[out],
        acc_dtype=DType.FLOAT32, a_major=a_major, b_major=b_major, input_order=order,
        output_mode=mode, accumulate=acc, mma_tiler_mn=tile, cluster_shape_mn=cluster,
        sf_vec_size=16, arch=arch,
    )


def compile_ptx(s: StaticSpec) -> str:
    """Finalize the tiling with the backend's defaults, check support, compile, return PTX."""
    from gwgrad.backends import _cutedsl, finalize_spec

    s, backend = finalize_spec(s)
    kernel = backend.make_kernel(s)
    # The same compile as the backend's (never from the kernel cache), keeping the PTX.
    ptx = _cutedsl.compile_kernel(kernel, s, extra_options="--keep-ptx").artifacts.PTX
    assert ptx and ".entry" in ptx
    return ptx


def replace(s, **kw):
    return dataclasses.replace(s, **kw)
