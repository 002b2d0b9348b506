"""Shared test setup: the ``gpu`` marker skips cleanly where no CUDA GPU is usable; tests
marked ``compile`` (exhaustive full kernel compiles, seconds each on a small CPU) run only when
``-m`` names them (``python -m pytest -m compile``) or their node id is given, so that
``python -m pytest -q`` stays the fast tier; every test draws fresh random inputs from a seed of its own, printed when it fails
(replay one with ``GWGRAD_TEST_SEED=<seed>``); compiled kernels go to a per-session cache
directory, never the user's."""

from __future__ import annotations

import os
import random
import secrets
import sys
import tempfile

import pytest

# JAX would take 75% of GPU memory when first used; torch, CuPy and other pytest workers share
# the GPU in the same run. Set before any test module imports JAX.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# The disk cache of compiled kernels: a fresh directory per test session (subprocesses inherit it).
os.environ["GWGRAD_CACHE_DIR"] = tempfile.mkdtemp(prefix="gwgrad-test-cache-")
# The checkout's benchmarks/ and tools/ (not installed) import as `benchmarks`, whichever
# directory pytest starts in; appended: an installed gwgrad stays the one under test.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)

import gwgrad  # noqa: E402
from gwgrad import cuda  # noqa: E402


def _compile_tier_requested(config) -> bool:
    """Whether ``-m`` names the ``compile`` marker (``-m compile``, ``-m "compile and not gpu"``,
    ``-m "not compile"``): then the expression alone decides; otherwise the compile tier is
    left out."""
    return "compile" in (config.option.markexpr or "")


def _named_node_ids(config):
    """The node ids given on the command line (``path::test[...]``), relative to the rootdir."""
    named = []
    for arg in config.args:
        if "::" in arg:
            path, rest = arg.split("::", 1)
            path = os.path.join(str(config.invocation_params.dir), path)
            path = os.path.relpath(path, str(config.rootpath)).replace(os.sep, "/")
            named.append(f"{path}::{rest}")
    return named


def pytest_collection_modifyitems(config, items):
    if not _compile_tier_requested(config):
        named = _named_node_ids(config)  # a compile test asked for by its node id runs

        def left_out_test(item):
            return item.get_closest_marker("compile") is not None and not any(
                item.nodeid == n or item.nodeid.startswith((n + "[", n + "::")) for n in named)

        left_out = [item for item in items if left_out_test(item)]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if not left_out_test(item)]
    if cuda.available():
        return
    skip = pytest.mark.skip(reason="needs a usable CUDA GPU (none found)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    if not _compile_tier_requested(config):
        return "exhaustive kernel compiles (marker 'compile') left out: python -m pytest -m compile"
    return None


@pytest.fixture(autouse=True)
def _fresh_operator_cache():
    # Cache tests count constructions; every test starts from an empty wrapper cache.
    gwgrad.clear_cache()
    yield
    gwgrad.clear_cache()


@pytest.fixture(autouse=True)
def seed(request) -> int:
    """This test's seed: NumPy's, Python's and torch's global generators start from it, and
    ``rng`` is made from it."""
    value = int(os.environ.get("GWGRAD_TEST_SEED") or secrets.randbits(32))
    request.node.gwgrad_seed = value
    os.environ["GWGRAD_CHILD_SEED"] = str(value)  # what a test's subprocess seeds itself with
    random.seed(value)
    import numpy as np

    np.random.seed(value)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(value)
    return value


@pytest.fixture
def rng(seed):
    import numpy as np

    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    value = getattr(item, "gwgrad_seed", None)
    if report.failed and value is not None:
        report.sections.append(("gwgrad seed", f"replay with GWGRAD_TEST_SEED={value}"))
