"""Small CUDA runtime helpers over cuda-bindings.

Importing this module never touches the driver: machines without CUDA must be able to import
gwgrad and run the CPU reference. Every helper that needs CUDA raises ``RuntimeError`` with
a message saying what failed; ``available()`` and ``device_count()`` never raise.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Tuple


@functools.lru_cache(maxsize=None)
def _runtime():
    try:
        from cuda.bindings import runtime
    except Exception as exc:  # ImportError, or a broken install that fails while loading
        raise RuntimeError(
            "CUDA is unavailable: the cuda-bindings package cannot be imported "
            f"({type(exc).__name__}: {exc}); install it with `pip install cuda-bindings`"
        ) from exc
    return runtime


def _error_text(rt, err) -> str:
    try:
        name = rt.cudaGetErrorName(err)[1].decode()
        text = rt.cudaGetErrorString(err)[1].decode()
        return f"{name}: {text}"
    except Exception:
        return str(err)


def _call(what: str, fn, *args):
    """Call a runtime function; return its values (one value unwrapped) or raise RuntimeError."""
    rt = _runtime()
    try:
        result = fn(*args)
    except Exception as exc:  # the driver library itself could not be loaded
        raise RuntimeError(f"{what} failed: {type(exc).__name__}: {exc}") from exc
    err, values = result[0], result[1:]
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"{what} failed: {_error_text(rt, err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def device_count() -> int:
    """Number of usable CUDA devices; 0 without cuda-bindings, a driver or a GPU."""
    try:
        rt = _runtime()
        err, count = rt.cudaGetDeviceCount()
    except Exception:
        return 0
    return int(count) if err == rt.cudaError_t.cudaSuccess else 0


def available() -> bool:
    """True when at least one CUDA GPU can be used."""
    return device_count() > 0


def require(device_id: int = 0) -> None:
    """Raise RuntimeError unless CUDA device ``device_id`` exists."""
    count = device_count()
    if count == 0:
        raise RuntimeError(
            "CUDA is unavailable: no CUDA driver or GPU was found "
            "(CPU arrays run on the reference backend; CUDA arrays need a GPU)"
        )
    if not 0 <= device_id < count:
        raise RuntimeError(f"CUDA device {device_id} does not exist ({count} device(s) found)")


def driver_version() -> int:
    return int(_call("cudaDriverGetVersion", _runtime().cudaDriverGetVersion))


def runtime_version() -> int:
    return int(_call("cudaRuntimeGetVersion", _runtime().cudaRuntimeGetVersion))


def current_device() -> int:
    return int(_call("cudaGetDevice", _runtime().cudaGetDevice))


def _attribute(attr_name: str, device_id: int) -> int:
    rt = _runtime()
    require(device_id)
    attr = getattr(rt.cudaDeviceAttr, attr_name)
    return int(_call(f"cudaDeviceGetAttribute({attr_name}, device {device_id})",
                     rt.cudaDeviceGetAttribute, attr, device_id))


def compute_capability(device_id: int = 0) -> Tuple[int, int]:
    return (_attribute("cudaDevAttrComputeCapabilityMajor", device_id),
            _attribute("cudaDevAttrComputeCapabilityMinor", device_id))


def sm_count(device_id: int = 0) -> int:
    return _attribute("cudaDevAttrMultiProcessorCount", device_id)


def device_name(device_id: int = 0) -> str:
    rt = _runtime()
    require(device_id)
    props = _call(f"cudaGetDeviceProperties(device {device_id})", rt.cudaGetDeviceProperties, device_id)
    name = props.name
    return name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)


@contextlib.contextmanager
def on_device(device_id: int) -> Iterator[None]:
    """Make ``device_id`` current for the runtime calls inside, then restore the previous one."""
    rt = _runtime()
    previous = current_device()
    if previous != device_id:
        _call(f"cudaSetDevice({device_id})", rt.cudaSetDevice, device_id)
    try:
        yield
    finally:
        if previous != device_id:
            _call(f"cudaSetDevice({previous})", rt.cudaSetDevice, previous)


def malloc(nbytes: int, device_id: int = 0) -> int:
    rt = _runtime()
    require(device_id)
    with on_device(device_id):
        return int(_call(f"cudaMalloc({nbytes} bytes on device {device_id})", rt.cudaMalloc, nbytes))


def free(ptr: int, device_id: int = 0) -> None:
    rt = _runtime()
    with on_device(device_id):
        _call(f"cudaFree({ptr:#x})", rt.cudaFree, ptr)


def malloc_async(nbytes: int, stream: int) -> int:
    """Stream-ordered allocation (a memory node when ``stream`` is being captured)."""
    rt = _runtime()
    return int(_call(f"cudaMallocAsync({nbytes} bytes)", rt.cudaMallocAsync, nbytes, stream))


def free_async(ptr: int, stream: int) -> None:
    rt = _runtime()
    _call(f"cudaFreeAsync({ptr:#x})", rt.cudaFreeAsync, ptr, stream)


def memset(ptr: int, nbytes: int, device_id: int = 0) -> None:
    """Zero ``nbytes`` at ``ptr`` (synchronous: for memory not yet used by any stream)."""
    rt = _runtime()
    with on_device(device_id):
        _call(f"cudaMemset({ptr:#x}, 0, {nbytes})", rt.cudaMemset, ptr, 0, nbytes)


def memset_async(ptr: int, nbytes: int, stream: int) -> None:
    """Enqueue zeroing ``nbytes`` at ``ptr`` on ``stream`` (a memset node under capture)."""
    rt = _runtime()
    _call(f"cudaMemsetAsync({ptr:#x}, 0, {nbytes})", rt.cudaMemsetAsync, ptr, 0, nbytes, stream)


def memcpy_d2h(dst_host: int, src_device: int, nbytes: int, stream: int) -> None:
    """Enqueue a device-to-host copy on ``stream`` (call ``synchronize`` before reading)."""
    rt = _runtime()
    _call("cudaMemcpyAsync(device to host)", rt.cudaMemcpyAsync, dst_host, src_device, nbytes,
          rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream)


def memcpy_h2d(dst_device: int, src_host: int, nbytes: int, stream: int) -> None:
    """Enqueue a host-to-device copy on ``stream``.

    From pageable host memory the runtime stages the source before returning, so the host
    buffer may be released right after this call.
    """
    rt = _runtime()
    _call("cudaMemcpyAsync(host to device)", rt.cudaMemcpyAsync, dst_device, src_host, nbytes,
          rt.cudaMemcpyKind.cudaMemcpyHostToDevice, stream)


def synchronize(stream: int) -> None:
    _call("cudaStreamSynchronize", _runtime().cudaStreamSynchronize, stream)


def stream_is_capturing(stream: int) -> bool:
    """True while ``stream`` is being captured into a CUDA graph.

    The runtime refuses the query on the legacy stream while another stream is captured in
    global mode (an implicit synchronization would break that capture); that answers True
    too, since a host copy must not be attempted then either.
    """
    rt = _runtime()
    try:
        err, status = rt.cudaStreamIsCapturing(stream)
    except Exception as exc:
        raise RuntimeError(f"cudaStreamIsCapturing failed: {type(exc).__name__}: {exc}") from exc
    if err in (rt.cudaError_t.cudaErrorStreamCaptureImplicit,
               rt.cudaError_t.cudaErrorStreamCaptureUnsupported):
        return True
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaStreamIsCapturing failed: {_error_text(rt, err)}")
    return status != rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusNone


def pointer_device(ptr: int) -> int:
    """The device ordinal that owns device address ``ptr``."""
    rt = _runtime()
    attrs = _call(f"cudaPointerGetAttributes({ptr:#x})", rt.cudaPointerGetAttributes, ptr)
    return int(attrs.device)


def host_alloc_mapped(nbytes: int) -> int:
    """Pinned host memory that every device can read and write (mapped, portable); with
    unified addressing its host address is also its device address. Zero-filled."""
    import ctypes

    rt = _runtime()
    flags = rt.cudaHostAllocMapped | rt.cudaHostAllocPortable
    ptr = int(_call(f"cudaHostAlloc({nbytes} bytes, mapped)", rt.cudaHostAlloc, nbytes, flags))
    ctypes.memset(ptr, 0, nbytes)
    device_ptr = int(_call("cudaHostGetDevicePointer", rt.cudaHostGetDevicePointer, ptr, 0))
    if device_ptr != ptr:  # not unified addressing: gwgrad's status record needs it
        raise RuntimeError("cudaHostGetDevicePointer: mapped host memory has a different device "
                           "address (no unified addressing)")
    return ptr


def device_synchronize(device_id: int) -> None:
    with on_device(device_id):
        _call("cudaDeviceSynchronize", _runtime().cudaDeviceSynchronize)


def event_create():
    """A CUDA event that records time, on the current device (``event_destroy`` frees it)."""
    return _call("cudaEventCreate", _runtime().cudaEventCreate)


def event_record(event, stream: int) -> None:
    """Enqueue recording ``event`` on ``stream``."""
    _call("cudaEventRecord", _runtime().cudaEventRecord, event, stream)


def event_elapsed_ms(start, end) -> float:
    """Milliseconds between two recorded events, once ``end`` has completed (waits for it)."""
    rt = _runtime()
    _call("cudaEventSynchronize", rt.cudaEventSynchronize, end)
    return float(_call("cudaEventElapsedTime", rt.cudaEventElapsedTime, start, end))


def event_destroy(event) -> None:
    _call("cudaEventDestroy", _runtime().cudaEventDestroy, event)
