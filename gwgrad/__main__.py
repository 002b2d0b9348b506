"""``python -m gwgrad [info|demo|bench] [bench options]``.

With no command: on a machine with a CUDA GPU, the benchmark (gwgrad.bench); without one,
what the machine can do: the CPU demo through the public API, and a compile-only check of
the kernels.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from importlib import metadata
from typing import List, Optional

from . import __version__, cuda


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


def _demo() -> int:
    from .bench.demo import cpu_demo

    return 0 if cpu_demo() else 1


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
    sub = parser.add_subparsers(dest="command", metavar="{info,demo,bench}")
    sub.add_parser("info", help="versions, GPUs, the kernel cache")
    sub.add_parser("demo", help="the CPU demo (reference backend)")
    sub.add_parser("bench", help="the H100/H200 benchmark (needs a GPU)", add_help=False)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # the benchmark parses its own options (and --help)
        from . import bench

        return int(bench.main(argv[1:]) or 0)
    args = _parser().parse_args(argv)  # --help, --version; unknown options exit with code 2
    if args.command == "info":
        return info()
    if args.command == "demo":
        return _demo()
    if cuda.available():
        from . import bench

        return int(bench.main([]) or 0)
    print("no CUDA GPU found: running the CPU demo (reference backend) instead of the benchmark")
    status = _demo()
    _compile_checks()
    return status


if __name__ == "__main__":
    sys.exit(main())
