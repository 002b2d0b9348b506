"""gwgrad: grouped weight-gradient GEMM for Mixture-of-Experts training.

    for expert e:  W[e] = A[:, offsets[e-1]:offsets[e]] @ B[offsets[e-1]:offsets[e], :]

CuTe DSL kernels for NVIDIA SM90 / SM100 GPUs, a NumPy reference for CPU arrays, one API for
any DLPack array or raw pointer. Importing gwgrad needs neither a GPU nor torch, CuPy or JAX.
"""

from __future__ import annotations

import os as _os

from ._version import __version__


def _find_checkout_adapters() -> None:
    # Installed, ``gwgrad.adapters`` is mapped onto the repository's top-level ``adapters/``.
    # Run from a plain checkout on PYTHONPATH, that mapping does not exist; appending the
    # checkout root to this package's path makes ``gwgrad.adapters`` resolve to it. Appended,
    # never prepended: gwgrad's own modules always win.
    here = _os.path.dirname(_os.path.abspath(__file__))
    root = _os.path.dirname(here)
    if _os.path.isdir(_os.path.join(here, "adapters")):
        return
    marker = _os.path.join(root, "adapters", "_gwgrad_adapters.py")
    if _os.path.isfile(marker) and root not in __path__:
        __path__.append(root)


_find_checkout_adapters()

from .api import (  # noqa: E402
    GroupedGemmWgrad,
    GroupedGemmWgradSm100,
    TupleDict,
    cache_info,
    clear_cache,
    get_grouped_gemm_wgrad_workspace_size_sm100,
    grouped_gemm_wgrad,
    grouped_gemm_wgrad_wrapper_sm100,
)
from .autotune import autotune  # noqa: E402  (gwgrad.autotune: the function, over the module)
from .backends.base import Backend, LaunchArgs  # noqa: E402
from .dtypes import DType  # noqa: E402
from .errors import ArgumentError, UnsupportedError  # noqa: E402
from .interop import as_tensor_desc, from_dlpack  # noqa: E402
from .offsets import token_count_multiple  # noqa: E402
from .plan import LaunchPlan, plan_for  # noqa: E402
from .quantizers import quantize  # noqa: E402
from .spec import StaticSpec  # noqa: E402
from .status import check_errors  # noqa: E402
from .tensors import TensorDesc, from_pointer  # noqa: E402

__all__ = [
    "GroupedGemmWgrad",
    "grouped_gemm_wgrad",
    "GroupedGemmWgradSm100",
    "grouped_gemm_wgrad_wrapper_sm100",
    "get_grouped_gemm_wgrad_workspace_size_sm100",
    "autotune",
    "TupleDict",
    "LaunchPlan",
    "plan_for",
    "check_errors",
    "quantize",
    "ArgumentError",
    "UnsupportedError",
    "TensorDesc",
    "as_tensor_desc",
    "from_dlpack",
    "from_pointer",
    "DType",
    "StaticSpec",
    "Backend",
    "LaunchArgs",
    "token_count_multiple",
    "cache_info",
    "clear_cache",
    "__version__",
]


def __getattr__(name: str):
    # cuDNN frontend's JAX entry, imported on first use: importing gwgrad never imports JAX
    # (so it is not in __all__, which ``from gwgrad import *`` would import it through).
    if name == "grouped_gemm_wgrad_jax_sm100":
        from .adapters.jax import grouped_gemm_wgrad_jax_sm100

        return grouped_gemm_wgrad_jax_sm100
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
