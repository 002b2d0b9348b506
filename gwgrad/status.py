"""Errors found on the device, reported on the host: the offsets check of every launch.

Every CUDA launch validates its offsets in the prep kernel (non-decreasing from 0, last ==
tokens_sum, counts a multiple of ``token_count_multiple``). When they are invalid the GEMM
writes nothing at all, and the prep kernel records the first problem in a small *status
record* in pinned, mapped host memory that every launch gets the address of (one record per
process, for every device; the first error is kept until it is reported). Nothing
synchronizes for it. The error is raised, as ``ArgumentError`` (a ``ValueError``) naming
``offsets_tensor`` (``sfa_tensor`` when the scale tensors are too small for the offsets,
``wgrad_ptrs`` for an invalid per-expert output address):

* by ``gwgrad.check_errors()``, which waits for the devices gwgrad launched on first;
* by the next gwgrad launch in the process once the failed launch has completed (its record
  is then visible without any synchronization): as CUDA reports asynchronous errors, at a
  later call. That call is not enqueued.

Record layout (int32): [0] code (0: none; offsets.NEGATIVE_COUNT, LAST_NOT_TOKENS_SUM,
COUNT_NOT_MULTIPLE, SCALES_TOO_SMALL, OUTPUT_PTR_INVALID), [1] expert, [2] offsets[expert], [3] the previous
offset (0 for expert 0), [4] tokens_sum, [5] the token-count multiple (>= 1; written last, so a
non-zero [5] says the fields are complete), [6], [7] reserved. For SCALES_TOO_SMALL (block-
scaled inputs whose scale tensors are too small for the offsets; raised naming
``sfa_tensor``): [2] the scale columns (blocked) or rows (block_1x128) experts 0..[1] need,
[3] the scale tensors' capacity. For OUTPUT_PTR_INVALID (discrete output: an expert's
address in ``wgrad_ptrs`` is null or not 16-byte aligned; raised naming ``wgrad_ptrs``): [2]
and [3] the address's low and high 32 bits.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Optional, Set

from . import cuda
from .errors import ArgumentError
from .offsets import problem_argument, problem_detail

__all__ = ["status_address", "check_errors", "raise_pending", "record", "RECORD_BYTES"]

RECORD_INT32 = 8
RECORD_BYTES = 4 * RECORD_INT32
_lock = threading.Lock()
_address = 0
_code: Optional[ctypes.c_int32] = None  # a view of field [0]: reading it costs ~0.1 us
_host_record = (ctypes.c_int32 * RECORD_INT32)()  # used until a device record exists
_devices: Set[int] = set()


def status_address(device_id: Optional[int] = None) -> int:
    """The device address of the status record (allocated on first use; needs CUDA).
    ``device_id``: a device that will launch with it (``check_errors`` synchronizes those)."""
    global _address, _code
    if device_id is not None and device_id not in _devices:
        with _lock:
            _devices.add(device_id)
    if _address:
        return _address
    with _lock:
        if not _address:
            address = cuda.host_alloc_mapped(128)
            ctypes.memmove(address, _host_record, RECORD_BYTES)  # an error recorded on the host
            _code = ctypes.c_int32.from_address(address)
            _address = address
    return _address


def pending_view() -> ctypes.c_int32:
    """A view of field [0] (non-zero: an error is recorded) for a quick per-launch check: of
    the device record once it exists, else of the host record (a plan built without CUDA)."""
    return _code if _code is not None else ctypes.c_int32.from_address(
        ctypes.addressof(_host_record))


def _fields() -> ctypes.Array:
    if _address:
        return (ctypes.c_int32 * RECORD_INT32).from_address(_address)
    return _host_record


def record(code: int, expert: int, value: int, prev: int, tokens_sum: int,
           multiple: int) -> None:
    """Record a problem found on the host side of a device computation (the JAX CPU path);
    like the kernel, keeps the first one."""
    with _lock:
        fields = _fields()
        if fields[0] == 0 and code:
            fields[1:6] = [expert, value, prev, tokens_sum, max(multiple, 1)]
            fields[0] = code


def _take(wait_s: float = 0.0) -> Optional[ArgumentError]:
    """The recorded error (cleared), or None. The kernel claims field [0] first and writes
    [5] last: a claimed record whose [5] is still 0 is completed within microseconds."""
    fields = _fields()
    if fields[0] == 0:
        return None
    deadline = time.monotonic() + max(wait_s, 0.01)
    while fields[5] == 0 and time.monotonic() < deadline:
        pass
    with _lock:
        code, expert, value, prev, tokens_sum, multiple = list(fields[:6])
        if code == 0:
            return None
        for i in range(1, RECORD_INT32):
            fields[i] = 0
        fields[0] = 0
    detail = problem_detail(code, expert, value, prev, tokens_sum, multiple)
    return ArgumentError(problem_argument(code), f"{detail} (found by the device-side check of an "
                                           "earlier launch, which wrote nothing)")


def raise_pending() -> None:
    """Raise the recorded error, if any (the check every launch makes; no synchronization)."""
    if (_code is not None and _code.value) or (_code is None and _host_record[0]):
        error = _take()
        if error is not None:
            raise error


def check_errors(synchronize: bool = True) -> None:
    """Raise the first invalid-offsets error of an earlier launch as ``ArgumentError``
    naming ``offsets_tensor`` (or ``sfa_tensor`` / ``wgrad_ptrs``: offsets.problem_argument).
    ``synchronize``: first wait for every device gwgrad launched
    on (otherwise only launches that already completed are seen)."""
    if synchronize and _address:
        for device_id in sorted(_devices):
            cuda.device_synchronize(device_id)
    error = _take(wait_s=1.0)
    if error is not None:
        raise error
