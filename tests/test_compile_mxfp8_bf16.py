"""The two-pass MXFP8 path (kernels/sm90_mxfp8_bf16.py, Tuning.mainloop=2) compiles for
sm_90a without a GPU: the expert-table prep, two dequantize kernels (FP8 -> f16x2 -> FP32,
the power-of-two multiply, one cvt to bf16x2), then the BF16 kernel with BF16 WGMMA and no
FP8 WGMMA; ptxas spills nothing."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("cutlass")

from kernel_compile import compile_cubin, compile_ptx, cubin_resources, fp8_spec  # noqa: E402

MODES = [
    dict(),
    dict(mode="discrete", out="float32", acc=True),
    dict(out="float16", acc=True, tile=(128, 192), cluster=(2, 1)),
    dict(a="e5m2", b="e4m3", tile=(128, 256), cluster=(1, 1)),
]


def entries(ptx: str):
    return {chunk.split("(")[0]: chunk for chunk in ptx.split(".entry ")[1:]}


@pytest.mark.compile
@pytest.mark.parametrize("case", range(len(MODES)))
def test_two_pass_compiles_with_bf16_wgmma(case):
    kw = dict(MODES[case])
    a, b = kw.pop("a", "e4m3"), kw.pop("b", "e4m3")
    ptx = compile_ptx(fp8_spec("sm_90a", "blocked", a=a, b=b, **kw).with_tuning(mainloop=2))
    bodies = entries(ptx)
    dequant = [body for name, body in bodies.items() if "dequant_kernel" in name]
    gemm = [body for name, body in bodies.items()
            if "Sm90GroupedWgrad" in name and "prep_kernel" not in name]
    # The expert table's (the quantizers') and the BF16 kernel's prep kernels (two launches:
    # the latter checks the scale tensors' capacity).
    assert len([name for name in bodies if "prep_kernel" in name]) == 2, list(bodies)
    assert len(dequant) == 2 and len(gemm) == 1, list(bodies)
    for body, elem in zip(dequant, (a, b)):
        # Per row of a CTA (8): one 8-byte load of 8 codes, one 16-byte store of 8 BF16.
        assert body.count("ld.global.nc.v2") == 8 and body.count("st.global.v4") == 8
        assert "ld.global.nc.v4" not in body
        assert body.count(f"cvt.rn.f16x2.{elem}x2") == 32
        assert body.count("mul.rn.f32") == 64 and "mul.rn.ftz" not in body
        assert body.count("cvt.rn.bf16x2.f32") == 32
        assert "wgmma" not in body
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16", gemm[0])
    assert not re.search(r"wgmma\.mma_async\S*\.e[45]m[23]", ptx)


@pytest.mark.compile
def test_two_pass_spills_nothing():
    res = cubin_resources(compile_cubin(fp8_spec(
        "sm_90a", "blocked", hidden=7168, intermediate=4096, experts=32).with_tuning(mainloop=2)))
    assert res["regs"] and res["frame"], res
    assert max(res["frame"]) == 0, f"ptxas spilled to a local-memory frame: {res}"
