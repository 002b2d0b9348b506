"""One full kernel compile per kernel family, in the fast tier (no GPU: the DSL's --gpu-arch):
the SM90 BF16, SM90 FP8, SM100 BF16 and SM100 block-scaled GEMMs and the grouped quantizers, each
on a default configuration and checked as the family's exhaustive tests check every one. Those
(every mode, tiling, format and sm_103a) are marked ``compile``: ``python -m pytest -m compile``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("cutlass")

import test_compile_fp8_sm90 as fp8_sm90  # noqa: E402
import test_compile_quantize as quantize  # noqa: E402
import test_compile_sm90 as bf16_sm90  # noqa: E402
import test_compile_sm100 as bf16_sm100  # noqa: E402
import test_compile_sm100_blockscaled as blockscaled_sm100  # noqa: E402
from kernel_compile import private_dump_dir  # noqa: E402

# The training layout: A = x.T (M-major), B = dy (N-major), dense BF16 output.
TRAINING = (("m", "n"), "tensor2d", "dense", "bfloat16", False)


def test_sm90_bf16():
    bf16_sm90.test_every_mode_compiles(*TRAINING)


def test_sm90_fp8():
    fp8_sm90.test_recipe_compiles_with_fp8_wgmma("blocked", 0)


def test_sm100_bf16():
    bf16_sm100.test_every_mode_compiles(*TRAINING)


def test_sm100_blockscaled():
    # FP8 operands are K-major in the block-scaled recipes.
    blockscaled_sm100.test_every_mode_compiles("mxfp8", ("k", "k"), *TRAINING[1:])


def test_quantize():
    """NVFP4 on sm_100a: the two-pass quantizer (three kernels) with the E2M1 conversions."""
    fmt, elem, arch = "nvfp4", "e2m1", "sm_100a"
    cfg = quantize.Q.kernel_config(fmt, elem, quantize.CHANNELS, quantize.EXPERTS)
    with private_dump_dir() as options:
        ptx = quantize.Q.compile_quantizer(cfg, arch, options).artifacts.PTX

    def ptx_of(*_):
        return ptx

    for check in (quantize.test_kernels_and_targets, quantize.test_conversions,
                  quantize.test_ieee_fp32_arithmetic, quantize.test_stores,
                  quantize.test_amax_pass):
        check(ptx_of, fmt, elem, arch)


@pytest.mark.parametrize("case", ["sm90-dense", "sm90-discrete-2-launches", "sm100-mxfp8"])
def test_descriptor_slots_written_in_full(case):
    """A caller's workspace has only its first 16 bytes zeroed: the prep work writes every
    byte of each descriptor slot (A, B, the discrete output, and SM100's SFA / SFB)."""
    from kernel_compile import check_descriptor_slots_ptx, compile_ptx, fp8_spec, replace, spec

    s, descriptors = {
        "sm90-dense": (spec("sm_90a"), 2),
        "sm90-discrete-2-launches": (replace(spec("sm_90a", mode="discrete"), launches=2), 3),
        "sm100-mxfp8": (fp8_spec("sm_100a", "blocked"), 4),
    }[case]
    check_descriptor_slots_ptx(compile_ptx(s), descriptors)
