"""The expert-parallel examples on two GPUs (issue #13): each example as a subprocess at its
default GPU sizes, which must exit 0 and print PASS (every rank's / device's expert weight
gradients, computed by gwgrad's kernel, within the tolerance of the FP32 single-device
reference). Each test prints the example's output; to see it for passing tests:

    python -m pytest -q -rP tests/test_expert_parallel_gpu.py

Skipped without two CUDA GPUs: torch.cuda.device_count() < 2 for the PyTorch example (NCCL),
fewer than two JAX GPU devices for the JAX one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 600  # first runs compile gwgrad's kernels (seconds each) and start NCCL

try:
    import pytest_timeout  # noqa: F401

    _timeout = [pytest.mark.timeout(TIMEOUT_S + 60)]
except ImportError:
    _timeout = []

pytestmark = [pytest.mark.gpu, *_timeout]


def _env() -> dict:
    # The checkout first, then whatever the parent had (the GPU host puts the CuTe DSL there);
    # JAX must not take 75% of each GPU (torch and other tests share them).
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, XLA_PYTHON_CLIENT_PREALLOCATE="false")


def _run(args) -> str:
    start = time.perf_counter()
    try:
        proc = subprocess.run([str(a) for a in args], cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
            else (exc.stdout or "")
        pytest.fail(f"timed out after {TIMEOUT_S} s: {' '.join(map(str, args))}\n{out[-6000:]}")
    elapsed = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    print(f"$ {' '.join(map(str, args))}\n(exit {proc.returncode}, {elapsed:.1f} s)\n{output}")
    assert proc.returncode == 0 and "PASS" in proc.stdout, output[-6000:]
    return proc.stdout


def _torch_gpus() -> int:
    torch = pytest.importorskip("torch")
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("launch", ["torchrun", "self-spawned"])
def test_torch_expert_parallel_on_two_gpus(launch):
    if _torch_gpus() < 2:
        pytest.skip("needs two CUDA GPUs (torch.cuda.device_count() < 2)")
    example = EXAMPLES / "torch_expert_parallel.py"
    if launch == "torchrun":
        args = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", example, "--device", "cuda"]
    else:
        args = [sys.executable, example, "--device", "cuda", "--nproc", "2"]
    out = _run(args)
    assert "rank 0 (cuda:0)" in out and "rank 1 (cuda:1)" in out


def test_jax_expert_parallel_on_two_gpus():
    pytest.importorskip("jax")
    from jax_gpu import gpus

    if len(gpus()) < 2:
        pytest.skip("needs two JAX GPU devices")
    out = _run([sys.executable, EXAMPLES / "jax_expert_parallel.py", "--device", "gpu"])
    assert "2 gpu devices" in out
