"""The SM90 BF16 kernel on an H100/H200, through the backend interface, against FP64
(the checks are in gpu_kernel_checks.py)."""

import pytest

torch = pytest.importorskip("torch")

from gpu_kernel_checks import KernelChecks  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs an SM90 GPU",
    ),
]


class TestSm90(KernelChecks):
    ARCH = "sm_90a"
    # cooperative 128x256 and pingpong 128x128
    TILINGS = [((128, 256), (1, 1)), ((128, 128), (1, 1))]


class TestSm90PairSharingA(KernelChecks):
    """1x2 clusters: the CTA pair multicasts A (unit tile 128 x 2n; with an odd number of
    n-tiles the second CTA's half lies past the output: loaded as zeros, stored nowhere)."""
    ARCH = "sm_90a"
    TILINGS = [((128, 256), (1, 2)), ((128, 128), (1, 2))]


class TestSm90PairSharingB(KernelChecks):
    """2x1 clusters: the CTA pair multicasts B."""
    ARCH = "sm_90a"
    TILINGS = [((128, 256), (2, 1)), ((128, 128), (2, 1))]


class TestSm90Quad(KernelChecks):
    """2x2 clusters: each CTA multicasts A to its row peer and B to its column peer (unit
    tile 256 x 256 for 128x128 CTAs, or 128 x 256 for 64x128 ones)."""
    ARCH = "sm_90a"
    TILINGS = [((128, 128), (2, 2)), ((64, 128), (2, 2))]


# A set of epilogue staging buffers per pingpong consumer group (spec.epi_buffer_sets=2): the
# groups' epilogues overlap instead of taking one set in turn. Many short experts, so each CTA
# runs many units and both groups cycle through their buffers many times.
SPLIT_CASES = [
    (("m", "n"), "tensor2d", "dense", torch.bfloat16, False),
    (("k", "n"), "tensor_ragged", "dense", torch.float32, True),
    (("m", "k"), "tensor2d", "discrete", torch.float16, False),
    (("k", "k"), "tensor_ragged", "discrete", torch.float32, True),
]


@pytest.mark.parametrize("tile", [(128, 128), (64, 128)], ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("case", range(len(SPLIT_CASES)))
def test_pingpong_epilogue_buffer_set_per_group(seed, tile, case):
    import dataclasses

    from gpu_kernel_checks import make_spec, run_and_check

    majors, order, mode, out_dtype, acc = SPLIT_CASES[case]
    spec = dataclasses.replace(
        make_spec("sm_90a", 256, 384, 40, *majors, order, mode, out_dtype, acc,
                  (tile, (1, 1))), epi_buffer_sets=2)
    gen = torch.Generator().manual_seed(seed)
    counts = (torch.randint(0, 40, (40,), generator=gen) * 8).tolist()  # K-major: % 8
    counts[3] = 0
    run_and_check(spec, counts, out_dtype)
