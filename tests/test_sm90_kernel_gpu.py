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
