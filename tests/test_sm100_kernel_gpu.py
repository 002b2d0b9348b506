"""The SM100 BF16 kernel on a B200/GB200-class GPU, through the backend interface, against
FP64 (the checks are in gpu_kernel_checks.py). Skipped on other GPUs: no Blackwell GPU was
reachable while it was written, so these wait for one."""

import pytest

torch = pytest.importorskip("torch")

from gpu_kernel_checks import KernelChecks  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 10,
        reason="needs an SM100-family GPU",
    ),
]


class TestSm100(KernelChecks):
    ARCH = "sm_100a" if not torch.cuda.is_available() or \
        torch.cuda.get_device_capability() != (10, 3) else "sm_103a"
    # 2-CTA 256x256 on a (2, 1) cluster, and 1-CTA 128x128
    TILINGS = [((256, 256), (2, 1)), ((128, 128), (1, 1))]
