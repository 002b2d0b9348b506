"""Shared test setup: the ``gpu`` marker skips cleanly where no CUDA GPU is usable."""

from __future__ import annotations

import os

import pytest

# JAX would take 75% of GPU memory when first used; torch, CuPy and other pytest workers share
# the GPU in the same run. Set before any test module imports JAX.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import gwgrad
from gwgrad import cuda


def pytest_collection_modifyitems(config, items):
    if cuda.available():
        return
    skip = pytest.mark.skip(reason="needs a usable CUDA GPU (none found)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_operator_cache():
    # Cache tests count constructions; every test starts from an empty wrapper cache.
    gwgrad.clear_cache()
    yield
    gwgrad.clear_cache()


@pytest.fixture
def rng(request):
    # A different seed per test (and per run): fresh random inputs, never zeros.
    import numpy as np

    return np.random.default_rng()
