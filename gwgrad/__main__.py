"""``python -m gwgrad [demo|bench|info]``.

With no subcommand: on a machine with a CUDA GPU, the benchmark (gwgrad.bench); without one,
what the machine can do: the CPU demo through the public API, and a compile-only check of
the kernels when they are there.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from importlib import metadata
from typing import List, Optional

from . import __version__, cuda

_USAGE = "usage: python -m gwgrad [demo|bench|info] [bench options]"


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


def _bench(argv: List[str]) -> int:
    try:
        from . import bench
    except ModuleNotFoundError as exc:
        if exc.name != "gwgrad.bench":
            raise
        print("gwgrad.bench is not there yet: no benchmark to run", file=sys.stderr)
        return 1
    result = bench.main(argv)
    return int(result or 0)


def _demo() -> int:
    from .demo import cpu_demo

    return 0 if cpu_demo() else 1


def _compile_checks() -> None:
    if importlib.util.find_spec("gwgrad.backends.bf16_sm90") is None:
        print("compile check: skipped, the kernel modules are not there yet")
        return
    from .backends import compile_check

    for arch in ("sm_90a", "sm_100a"):
        print(compile_check(arch))


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and not argv[0].startswith("-") else None
    rest = argv[1:] if command else argv
    if command == "info":
        return info()
    if command == "demo":
        return _demo()
    if command == "bench":
        return _bench(rest)
    if command is not None:
        print(_USAGE, file=sys.stderr)
        return 2
    if cuda.available():
        return _bench(rest)
    print("no CUDA GPU found: running the CPU demo (reference backend) instead of the benchmark")
    status = _demo()
    _compile_checks()
    return status


if __name__ == "__main__":
    sys.exit(main())
