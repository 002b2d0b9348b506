"""``python -m gwgrad [info|demo|bench|selftest] [bench / selftest options]``.

With no command: on a machine with a CUDA GPU, the benchmark (``benchmarks.wgrad``); without
one, what the machine can do: the CPU demo through the public API, and a compile-only check of
the kernels. The benchmark and the demo live in the source checkout's ``benchmarks/``, which the
wheel does not install: run from a checkout (an editable install or the checkout on
``PYTHONPATH``) for them; ``info`` and ``selftest`` (gwgrad/selftest.py: a short correctness
check of every kernel family and format the GPU supports, the first thing to run on a new GPU)
work anywhere.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
from importlib import metadata
from typing import List, Optional

from . import cuda
from ._version import __version__


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def info() -> int:
    print(f"gwgrad {__version__}  (python {platform.python_version()}, {sys.platform})")
    for dist in ("numpy", "nvidia-cutlass-dsl", "cuda-bindings", "torch", "cupy-cuda13x", "jax",
                 "jaxlib", "ml_dtypes"):
        print(f"  {dist:20s} {_version(dist)}")
    print(f"  CUTE_DSL_ARCH        {os.environ.get('CUTE_DSL_ARCH', '(unset)')}")
    from . import kernel_cache

    print(f"  kernel cache         {kernel_cache.cache_dir() or '(disabled)'}")
    count = cuda.device_count()
    if count == 0:
        print("CUDA: no usable GPU (CPU arrays run on the reference backend)")
        return 0
    from .backends import detect_arch

    print(f"CUDA: driver {cuda.driver_version()}, runtime {cuda.runtime_version()}, {count} device(s)")
    for device in range(count):
        major, minor = cuda.compute_capability(device)
        try:
            arch = detect_arch(device)
        except RuntimeError as exc:
            arch = f"unsupported ({exc})"
        print(f"  cuda:{device} {cuda.device_name(device)}: compute capability {major}.{minor}, "
              f"{cuda.sm_count(device)} SMs, arch {arch}")
    return 0


NO_CHECKOUT = ("python -m gwgrad {command}: needs gwgrad's source checkout: the benchmarks and "
               "the demo live in its benchmarks/ folder, which the installed wheel does not "
               "hold. Clone the repository and run from its root (pip install -e . there, or "
               "put the checkout on PYTHONPATH), e.g. `python -m benchmarks.wgrad --help`.")


def _benchmarks(module: str, command: str):
    """``benchmarks.<module>`` from the checkout this gwgrad was imported from (its parent
    folder); SystemExit with the way out where there is none (an installed wheel)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folder = os.path.join(root, "benchmarks")
    if not all(os.path.isfile(os.path.join(folder, name)) for name in ("__init__.py", "wgrad.py")):
        raise SystemExit(NO_CHECKOUT.format(command=command))
    loaded = sys.modules.get("benchmarks")
    if loaded is not None and os.path.dirname(os.path.abspath(loaded.__file__ or "")) != folder:
        raise SystemExit(f"python -m gwgrad {command}: another 'benchmarks' package "
                         f"({loaded.__file__}) is already imported; run "
                         f"`python -m benchmarks.{module}` from {root}")
    if root not in sys.path:
        sys.path.insert(0, root)
    package = importlib.import_module("benchmarks")
    if os.path.dirname(os.path.abspath(package.__file__ or "")) != folder:
        raise SystemExit(f"python -m gwgrad {command}: 'benchmarks' resolves to "
                         f"{package.__file__}, not {folder}; run "
                         f"`python -m benchmarks.{module}` from {root}")
    return importlib.import_module(f"benchmarks.{module}")


def _demo() -> int:
    return 0 if _benchmarks("demo", "demo").cpu_demo() else 1


def _compile_checks() -> None:
    from .backends import compile_check

    for arch in ("sm_90a", "sm_100a"):
        print(compile_check(arch))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gwgrad",
        description="gwgrad: grouped weight-gradient GEMM for Mixture-of-Experts training.",
        epilog="With no command: the benchmark on a GPU machine; the CPU demo and a "
               "compile-only kernel check without one. `python -m gwgrad bench --help` lists "
               "the benchmark's options.")
    parser.add_argument("--version", action="version", version=f"gwgrad {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{info,demo,bench,selftest}")
    sub.add_parser("info", help="versions, GPUs, the kernel cache")
    sub.add_parser("demo", help="the CPU demo (reference backend)")
    sub.add_parser("bench", help="the H100/H200 benchmark (needs a GPU and the source "
                   "checkout: python -m benchmarks.wgrad)", add_help=False)
    sub.add_parser("selftest", help="check every kernel family and format this GPU supports "
                   "against the CPU reference (the first run on a new GPU; `python -m gwgrad "
                   "selftest --help`)", add_help=False)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # the benchmark parses its own options (and --help)
        return int(_benchmarks("wgrad", "bench").main(argv[1:]) or 0)
    if argv and argv[0] == "selftest":  # its own options (and --help)
        from . import selftest

        return selftest.main(argv[1:])
    args = _parser().parse_args(argv)  # --help, --version; unknown options exit with code 2
    if args.command == "info":
        return info()
    if args.command == "demo":
        return _demo()
    if cuda.available():
        return int(_benchmarks("wgrad", "bench").main([]) or 0)
    print("no CUDA GPU found: running the CPU demo (reference backend) instead of the benchmark")
    try:
        status = _demo()
    except SystemExit as exc:  # an installed wheel: no demo, the compile check still runs
        print(exc, file=sys.stderr)
        status = 0
    _compile_checks()
    return status


if __name__ == "__main__":
    sys.exit(main())
