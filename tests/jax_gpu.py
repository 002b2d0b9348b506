"""What the JAX GPU test files share: JAX's CUDA devices and the module marks that skip them
cleanly without one (import after ``pytest.importorskip("jax")``)."""

from __future__ import annotations

import jax
import pytest


def gpus() -> list:
    """JAX's CUDA devices (none without a CUDA-enabled jaxlib or a GPU)."""
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def module_marks(timeout_s: int) -> list:
    """``pytestmark`` of a JAX GPU test file: the ``gpu`` marker, a skip without a GPU, and a
    per-test timeout where pytest-timeout is installed."""
    try:
        import pytest_timeout  # noqa: F401  (the timeout marker needs the plugin)

        timeout = [pytest.mark.timeout(timeout_s)]
    except ImportError:
        timeout = []
    return [pytest.mark.gpu, pytest.mark.skipif(not gpus(), reason="needs JAX with a CUDA GPU"),
            *timeout]


def timeout(seconds: int):
    """A test's own timeout (over its module's), where pytest-timeout is installed."""
    try:
        import pytest_timeout  # noqa: F401
    except ImportError:
        return lambda test: test
    return pytest.mark.timeout(seconds)
