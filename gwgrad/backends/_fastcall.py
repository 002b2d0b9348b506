"""Calling a compiled CuTe DSL function without per-call Python objects.

A compiled function's ``__call__`` spends ~30 us per call on argument marshalling: five
``make_ptr`` objects, a ``CUstream``, ``Int32`` casts and the DSL's ``generate_execution_args``
(adapter lookups, ctypes objects), then ``JitExecutor._get_invoke_packed_args``. What reaches
the compiled host function is only an array of ``void*``: for each runtime argument the
address of storage holding its value (a pointer's address, an int32, a stream handle),
followed by the address of the CUDA result slot and the kernel function handles of the
device's executor.

``PackedLauncher`` builds that array once, with storage of its own, and per call writes the
new values into the storage and calls the host function (~1 us). At construction it packs
one sample call both ways and compares every slot with what the DSL produced, so a DSL
version that marshals differently is detected (``PackingMismatch``) instead of launching
with wrong arguments; the caller then keeps the DSL's own call.

Signature it serves: ``(ptr, ..., ptr, int32, ..., int32, stream)`` as gwgrad's kernels'
``GemmEntryPoints.__call__`` (five pointers, ``tokens_sum``, ``grid_size``, the stream).
Used by ``gwgrad/backends/_cutedsl.py`` (``CompiledGemm``), one launcher per device.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Sequence

__all__ = ["PackedLauncher", "PackingMismatch"]


class PackingMismatch(RuntimeError):
    """The DSL marshals this signature differently from what PackedLauncher assumes."""


class PackedLauncher:
    """Launch ``compiled`` on the device its executor was made for, from plain ints.

    ``compiled``: a ``cute.compile`` result whose runtime signature is ``n_pointers``
    ``cute.Pointer``s, ``n_int32`` ``Int32``s and one ``cuda.CUstream``; ``device``: the
    CUDA device ordinal (None: the current one), for ``compiled.to(device)`` (one executor
    per device: its kernel handles belong to that device's context).
    """

    def __init__(self, compiled: Any, n_pointers: int, n_int32: int, device: Any = None,
                 sample_pointers: Sequence[Any] = ()):
        self._n_ptr, self._n_i32 = n_pointers, n_int32
        self._executor = executor = compiled.to(device)
        self._capi = executor.capi_func
        self._ptrs = (ctypes.c_void_p * max(n_pointers, 1))()
        self._ints = (ctypes.c_int32 * max(n_int32, 1))()
        self._stream = (ctypes.c_void_p * 1)()
        slots = [ctypes.addressof(self._ptrs) + i * ctypes.sizeof(ctypes.c_void_p)
                 for i in range(n_pointers)]
        slots += [ctypes.addressof(self._ints) + i * ctypes.sizeof(ctypes.c_int32)
                  for i in range(n_int32)]
        slots.append(ctypes.addressof(self._stream))
        # What JitExecutor appends after the arguments: the result slot, then the kernels.
        self._result = executor.cuda_result if executor._has_cuda_result else None
        tail = [executor._cuda_result_addr] if self._result is not None else []
        tail += [p.value for p in (executor._kernel_ptrs or [])]
        self._packed = (ctypes.c_void_p * (len(slots) + len(tail)))(*(slots + tail))
        self._lock = threading.Lock()
        self._verify(compiled, sample_pointers)

    def __call__(self, *values: int) -> None:
        """``values``: the pointers' addresses, the int32 values, the stream handle."""
        if self._n_ptr == 5 and self._n_i32 == 2:  # gwgrad's entry: no slicing, no loops
            return self.launch_entry(*values)
        n_ptr, n_args = self._n_ptr, self._n_ptr + self._n_i32
        with self._lock:  # one shared argument storage
            self._ptrs[:n_ptr] = values[:n_ptr]
            self._ints[:self._n_i32] = values[n_ptr:n_args]
            self._stream[0] = values[n_args]
            self._capi(self._packed)
            error = self._result.value if self._result is not None else 0
        if error:
            self._raise(error)

    def launch_entry(self, a: int, b: int, offsets: int, c: int, workspace: int,
                     tokens_sum: int, grid_size: int, stream: int) -> None:
        """gwgrad's ``GemmEntryPoints.__call__`` signature (5 pointers, 2 Int32, a stream)."""
        ptrs, ints = self._ptrs, self._ints
        with self._lock:
            ptrs[0] = a
            ptrs[1] = b
            ptrs[2] = offsets
            ptrs[3] = c
            ptrs[4] = workspace
            ints[0] = tokens_sum
            ints[1] = grid_size
            self._stream[0] = stream
            self._capi(self._packed)
            error = self._result.value if self._result is not None else 0
        if error:
            self._raise(error)

    @staticmethod
    def _raise(error: int) -> None:
        from cutlass.base_dsl.runtime import cuda as cuda_helpers

        raise cuda_helpers.create_cuda_runtime_error(error, cuda_helpers.cudart.cudaError_t)

    def _verify(self, compiled: Any, sample_pointers: Sequence[Any]) -> None:
        """Pack one sample call with the DSL and compare every slot with ours."""
        import cuda.bindings.driver as cuda_driver

        if len(sample_pointers) != self._n_ptr:
            raise ValueError(f"sample_pointers: expected {self._n_ptr} cute pointers (make_ptr "
                             f"objects of the compiled dtypes and alignments), got "
                             f"{len(sample_pointers)}")
        ints = [1000 + 7 * i for i in range(self._n_i32)]
        stream = 0x5EED
        try:
            exe_args, _keep = compiled.execution_args.generate_execution_args(
                (*sample_pointers, *ints, cuda_driver.CUstream(stream)), {})
            reference = self._executor._get_invoke_packed_args(list(exe_args))
        except Exception as exc:  # noqa: BLE001 - whatever the DSL objects to
            raise PackingMismatch(f"the DSL cannot pack the assumed signature: {exc}") from exc
        exe_args = [a.value if isinstance(a, ctypes.c_void_p) else a for a in exe_args]
        n_args = self._n_ptr + self._n_i32 + 1
        if len(exe_args) != n_args:
            raise PackingMismatch(f"the DSL packs {len(exe_args)} argument slots, expected "
                                  f"{n_args}")
        for i, ptr in enumerate(sample_pointers):
            got = ctypes.c_void_p.from_address(exe_args[i]).value or 0
            if got != (ctypes.c_void_p.from_address(ptr.__c_pointers__()[0]).value or 0):
                raise PackingMismatch(f"pointer slot {i} holds {got:#x}")
        for i, value in enumerate(ints):
            got = ctypes.c_int32.from_address(exe_args[self._n_ptr + i]).value
            if got != value:
                raise PackingMismatch(f"int32 slot {i} holds {got}, expected {value}")
        got = ctypes.c_void_p.from_address(exe_args[n_args - 1]).value
        if got != stream:
            raise PackingMismatch(f"stream slot holds {got}, expected {stream:#x}")
        tail_dsl = [reference[i] for i in range(n_args, len(self._packed))]
        tail_ours = [self._packed[i] for i in range(n_args, len(self._packed))]
        if tail_dsl != tail_ours or len(reference) < len(self._packed):
            raise PackingMismatch(f"trailing slots differ: DSL {tail_dsl}, ours {tail_ours}")
