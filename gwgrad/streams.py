"""CUDA stream handles from whatever a caller passes as ``current_stream``."""

from __future__ import annotations

import sys
from typing import Any, Optional


def stream_handle(stream: Any, name: str = "current_stream") -> int:
    """The ``cudaStream_t`` value of ``stream``.

    Accepts an int (0 is the legacy default stream), an object implementing
    ``__cuda_stream__`` (cuda.core's protocol: it returns ``(version, handle)``), torch
    streams (``.cuda_stream``), CuPy streams (``.ptr``) and cuda-bindings stream objects
    (``int(stream)``).
    """
    if isinstance(stream, bool):
        raise ValueError(f"{name}: expected a CUDA stream handle, got {stream!r}")
    if isinstance(stream, int):
        if stream < 0:
            raise ValueError(f"{name}: expected a non-negative cudaStream_t value, got {stream}")
        return stream
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        value = protocol() if callable(protocol) else protocol
        if isinstance(value, tuple) and len(value) == 2:
            value = value[1]
        return int(value)
    for attr in ("cuda_stream", "ptr", "handle"):
        value = getattr(stream, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    try:
        return int(stream)
    except Exception:
        raise ValueError(
            f"{name}: expected None, an int cudaStream_t, an object with __cuda_stream__, or a "
            f"torch / CuPy stream, got {type(stream).__name__}") from None


def resolve_stream(stream: Any, framework: Optional[str], device_id: int) -> int:
    """The stream a call runs on: ``stream`` if given, else the framework's current stream.

    With no stream and an array from torch or CuPy, the work goes where that framework would
    put its own next kernel, so it is ordered after the producer of the inputs. Otherwise the
    legacy default stream (0) is used.
    """
    if stream is not None:
        return stream_handle(stream)
    if framework == "torch":
        torch = sys.modules.get("torch")
        if torch is not None:
            return int(torch.cuda.current_stream(device_id).cuda_stream)
    elif framework == "cupy":
        cupy = sys.modules.get("cupy")
        if cupy is not None:
            with cupy.cuda.Device(device_id):
                return int(cupy.cuda.get_current_stream().ptr)
    return 0
