"""Compiled CuTe DSL kernels kept on disk across processes, and launched through ctypes.

``load_or_compile`` returns a ``KernelFunction`` for a kernel: from memory, else from the disk
cache (with ctypes only: no CuTe DSL import, which alone costs 2-3 s, and no compile, 1-2 s),
else it compiles (``cute.compile``), exports the result as an ELF object holding the host launch
function and the cubin (``dump_to_object``), links it into a shared library with the system C
compiler (``cc -shared``) and stores it. Where no C compiler is found the object itself is
stored and loaded through the DSL (``cutlass.runtime.load_module``): the same three functions,
called the same way by the same ``KernelFunction``.

Directory: ``$GWGRAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/gwgrad``, else ``~/.cache/gwgrad``;
``GWGRAD_CACHE_DIR=off`` (or ``0``) keeps kernels in memory only (their binaries then go to a
private temporary directory removed at exit), as does an unwritable directory (with one
warning). An entry is ``<key>.so`` (``<key>.o`` without a linker) and ``<key>.json``: symbol
names, argument signature, binary size and sha256, DSL version, runtime library path. Writers
replace files atomically (same-directory temporary file + ``os.replace``) under a per-key
``flock``, so concurrent processes are safe. An entry that fails any check (unreadable or
mismatching JSON, missing or altered binary, missing runtime library or symbol, load error) is
deleted and rebuilt, never launched.

The key is a sha256 over gwgrad's version, the installed nvidia-cutlass-dsl version, the source
bytes of ``SOURCES`` (what the compiled code depends on), the target arch, the compile options,
the signature and the caller's key parts.

XLA FFI modules (``load_or_compile_module``): the JAX adapter's custom calls run through the CuTe
DSL runtime's JAX target, which takes the compiled code as an object file in an attribute of
the call. Such an entry is ``<key>.xla`` (the object's bytes) and ``<key>.json`` (with what the
call needs besides: the target's name and FFI version, the results' shapes and dtypes, the
input-output aliases, the operands' layouts, and the runtime library that implements the
target), under the same key rules, checks and locks; a fresh process reads it and makes the call
with JAX and ctypes alone (``gwgrad.interop.jax``).

Calling convention (the DSL's C export, see ``JitCompiledFunction.export_to_c``): every function
takes ``void **args``: the addresses of storage holding each value. ``_mlir_<prefix>_cuda_init``
takes (``cudaLibrary_t **``, ``cudaError_t *``); ``_mlir_<prefix>_cuda_load_to_device``
(``cudaLibrary_t **``, ``int32 *device``, ``cudaError_t *``); the entry
``_mlir_<prefix>__mlir_ciface_<function_name>(void **args, int32 n)`` one slot per argument
(pointers and the stream as 8-byte values, int32 as 4 bytes) and then an int32 ``cudaError_t``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

from . import cuda as _cuda

__all__ = ["KernelFunction", "XlaModule", "load_or_compile", "load_or_compile_module",
           "entry_key", "cache_dir", "usable_cache_dir", "write_atomic", "stats", "clear_memory",
           "remembered", "SOURCES"]

FORMAT = 1
#: Argument kinds of a signature: an 8-byte pointer, an int32, the CUDA stream (exactly one).
KINDS = ("ptr", "i32", "stream")
#: The signature an XLA FFI module's key is built with (its arguments are the call's buffers).
MODULE_SIGNATURE = ("xla-ffi",)
#: What the compiled code depends on, relative to the gwgrad package: the kernels (their
#: compile, kernels/compiler.py, and JAX entries included), the backends' spec -> kernel config
#: mapping, and the modules those import from (tests check the list).
SOURCES = ("kernels", "backends", "dsl.py", "dtypes.py", "errors.py", "offsets.py", "scales.py",
           "spec.py")

_lock = threading.RLock()
_memory: Dict[str, Any] = {}  # key -> KernelFunction or XlaModule
_stats = {"compiles": 0, "memory_hits": 0, "disk_hits": 0, "rebuilds": 0}
_writable: Dict[Path, bool] = {}  # cache directory -> usable (checked once per process)
_binaries: Dict[str, "_Binary"] = {}  # .so path -> loaded library (dlopen shares it anyway)
_scratch: Optional[Path] = None

_VOID_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_ENTRY_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32)


class _BadEntry(Exception):
    """A cache entry that must not be used (the message says why)."""


# -- keys and directories ----------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def dsl_version() -> str:
    """The installed nvidia-cutlass-dsl version (package metadata: no import)."""
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """sha256 over gwgrad's ``SOURCES`` (computed once per process)."""
    return hash_sources(Path(__file__).resolve().parent, SOURCES)


def hash_sources(root: Path, names: Sequence[str]) -> str:
    """sha256 over the relative paths and bytes of the files ``names`` under ``root`` (a
    folder: its .py files, recursively)."""
    files = []
    for name in names:
        path = root / name
        files += sorted(p for p in path.rglob("*.py") if p.is_file()) if path.is_dir() \
            else [path]
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def entry_key(key_parts: Tuple, arch: str, options: str, signature: Sequence[str]) -> str:
    """The hex sha256 naming a kernel's cache entry."""
    from ._version import __version__

    text = json.dumps([FORMAT, __version__, dsl_version(), source_hash(), arch, options,
                       list(signature), [repr(part) for part in key_parts]])
    return hashlib.sha256(text.encode()).hexdigest()


def cache_dir() -> Optional[Path]:
    """The disk cache's directory (None: disabled by ``GWGRAD_CACHE_DIR=off`` or ``0``)."""
    value = os.environ.get("GWGRAD_CACHE_DIR", "").strip()
    if value.lower() in ("off", "0"):
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gwgrad"


def _usable_cache_dir() -> Optional[Path]:
    """``cache_dir()`` when it can be written (created if needed), else None with one warning."""
    directory = cache_dir()
    if directory is None:
        return None
    usable = _writable.get(directory)
    if usable is None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=directory, prefix=".probe-")
            os.close(fd)
            os.unlink(probe)
            usable = True
        except OSError as exc:
            warnings.warn(f"gwgrad kernel cache: cannot write to {directory} ({exc}); compiled "
                          "kernels are kept in memory only (set GWGRAD_CACHE_DIR to a writable "
                          "directory, or to 'off')", RuntimeWarning, stacklevel=3)
            usable = False
        _writable[directory] = usable
    return directory if usable else None


def usable_cache_dir() -> Optional[Path]:
    """The disk cache's directory when it is on and can be written (created if needed), else
    None (off; or unwritable, with one warning). What gwgrad keeps beside its kernels (device
    facts, gwgrad.autotune's winners) goes there."""
    return _usable_cache_dir()


def _scratch_dir() -> Path:
    """A private directory for the binaries of a process without a disk cache."""
    global _scratch
    if _scratch is None:
        _scratch = Path(tempfile.mkdtemp(prefix="gwgrad-kernels-"))
        atexit.register(shutil.rmtree, _scratch, True)
    return _scratch


# -- the public entry ----------------------------------------------------------------------------


def load_or_compile(key_parts: Tuple, arch: str, options: str, signature: Sequence[str],
                    compile_fn: Callable[[], Tuple[Any, Dict[str, Any]]]) -> "KernelFunction":
    """The kernel for these inputs: from memory, from disk (without importing the DSL), or
    compiled now.

    ``key_parts``: what identifies the kernel besides arch and options (their reprs are hashed);
    ``signature``: the kinds (``KINDS``) of the compiled entry's arguments in order;
    ``compile_fn()``: returns ``(compiled, info)``, ``compiled`` a ``cute.compile`` result of
    that signature and ``info`` a JSON-serializable dict kept with the entry
    (``KernelFunction.info``).
    """
    signature = _checked_signature(signature)
    key = entry_key(key_parts, arch, options, signature)
    with _lock:
        kernel = _stored(key, signature)
        if kernel is None:
            compiled, info = compile_fn()
            _stats["compiles"] += 1
            kernel = _store_entry(_usable_cache_dir() or _scratch_dir(), key, signature,
                                  compiled, info, {"arch": arch, "options": options})
            _memory[key] = kernel
        return kernel


def lookup(key_parts: Tuple, arch: str, options: str,
           signature: Sequence[str]) -> Optional["KernelFunction"]:
    """The kernel for these inputs from memory or disk, or None: never compiles (a backend
    asks this to know that a spec compiled before, without importing the DSL)."""
    signature = _checked_signature(signature)
    key = entry_key(key_parts, arch, options, signature)
    with _lock:
        return _stored(key, signature)


def _checked_signature(signature: Sequence[str]) -> Tuple[str, ...]:
    signature = tuple(signature)
    if any(kind not in KINDS for kind in signature) or signature.count("stream") != 1:
        raise ValueError(f"signature: expected kinds from {KINDS} with exactly one 'stream', "
                         f"got {signature}")
    return signature


def _stored(key: str, signature: Tuple[str, ...]) -> Optional["KernelFunction"]:
    """Memory, then disk (a disk hit is kept in memory); call with _lock held."""
    kernel = _memory.get(key)
    if kernel is not None:
        _stats["memory_hits"] += 1
        return kernel
    directory = _usable_cache_dir()
    kernel = _load_entry(directory, key, signature) if directory is not None else None
    if kernel is not None:
        _memory[key] = kernel
    return kernel


#: Facts about a device that cost a CuTe DSL import to learn (how many clusters of a size fit
#: at once), kept beside the kernels so that a process loading cached kernels needs no DSL.
FACTS_FILE = "device-facts.json"
_facts: Dict[str, int] = {}


def remembered(fact: str, learn: Callable[[], Tuple[int, bool]]) -> int:
    """The integer ``fact`` (a key naming the device and the question): from this process's
    memory, else from the cache directory's ``FACTS_FILE``, else ``learn()``, which returns
    ``(value, keep)``; a kept value is written to the file (merged under a lock, replaced
    atomically). An unreadable file counts as empty; without a usable cache directory the
    value stays in memory."""
    with _lock:
        value = _facts.get(fact)
        if value is not None:
            return value
        directory = _usable_cache_dir()
        stored = _read_facts(directory)
        value = stored.get(fact)
        if not isinstance(value, int) or isinstance(value, bool):
            value, keep = learn()
            if keep and directory is not None:
                with _key_lock(directory, "device-facts"):
                    stored = _read_facts(directory)  # another process may have added some
                    stored[fact] = value
                    write_atomic(directory / FACTS_FILE,
                                  json.dumps(stored, indent=1, sort_keys=True).encode())
        _facts[fact] = value
        return value


def _read_facts(directory: Optional[Path]) -> Dict[str, Any]:
    if directory is None:
        return {}
    try:
        stored = json.loads((directory / FACTS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


def stats() -> Dict[str, int]:
    """Counters of this process: compiles, memory_hits, disk_hits, rebuilds (bad entries
    deleted and compiled again)."""
    with _lock:
        return dict(_stats)


def clear_memory() -> None:
    """Forget the kernels held in memory: the next request reads the disk cache (loaded code
    stays mapped: a binary loaded again from the same path is the same library)."""
    with _lock:
        _memory.clear()
        _facts.clear()


# -- entries on disk ------------------------------------------------------------------------------


@contextlib.contextmanager
def _key_lock(directory: Path, key: str) -> Iterator[None]:
    """An exclusive lock on one key's entry across processes (a no-op without fcntl)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(directory / f"{key}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove(directory: Path, key: str) -> None:
    """Delete a key's entry (both binary kinds), whatever of it exists."""
    for suffix in (".json", ".so", ".o", ".xla"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(directory / f"{key}{suffix}")


def _load_entry(directory: Path, key: str,
                signature: Tuple[str, ...]) -> Optional["KernelFunction"]:
    """The stored kernel, or None (no entry; or a bad one, deleted)."""
    if not (directory / f"{key}.json").exists():
        return None
    try:
        kernel = _open_entry(directory, key, signature)
    except _BadEntry:
        with _key_lock(directory, key):
            try:  # a writer may just have replaced it
                kernel = _open_entry(directory, key, signature)
            except _BadEntry:
                _remove(directory, key)
                _stats["rebuilds"] += 1
                return None
    _stats["disk_hits"] += 1
    return kernel


def _read_meta(directory: Path, key: str) -> Dict[str, Any]:
    """An entry's JSON metadata, or _BadEntry saying why it cannot be read."""
    try:
        meta = json.loads((directory / f"{key}.json").read_text())
    except (OSError, ValueError) as exc:
        raise _BadEntry(f"unreadable metadata: {exc}") from exc
    if not isinstance(meta, dict):
        raise _BadEntry("metadata is not an object")
    return meta


def _open_entry(directory: Path, key: str, signature: Tuple[str, ...]) -> "KernelFunction":
    """Check an entry's metadata and binary, load it; raise _BadEntry saying what is wrong."""
    meta = _read_meta(directory, key)
    expected = {"format": FORMAT, "key": key, "signature": list(signature),
                "dsl_version": dsl_version(), "prefix": _prefix(key)}
    for name, value in expected.items():
        if meta.get(name) != value:
            raise _BadEntry(f"metadata {name} is {meta.get(name)!r}, expected {value!r}")
    symbols = meta.get("symbols")
    if not _valid_symbols(symbols, meta["prefix"]):
        raise _BadEntry(f"metadata symbols are {symbols!r}")
    binary = meta.get("binary")
    if binary not in (f"{key}.so", f"{key}.o"):
        raise _BadEntry(f"metadata binary is {binary!r}")
    try:
        data = (directory / binary).read_bytes()
    except OSError as exc:
        raise _BadEntry(f"unreadable binary: {exc}") from exc
    # Checked before loading: a truncated shared library can crash the dynamic loader.
    if len(data) != meta.get("size") or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise _BadEntry(f"{binary} differs from its metadata (size {len(data)})")
    return KernelFunction(_load_binary(directory / binary, meta), key, signature, meta)


def _valid_symbols(symbols: Any, prefix: str) -> bool:
    """The entry named; init and load_to_device both named (a kernel) or both None (a
    host-only function); every name with the entry's prefix."""
    if not isinstance(symbols, dict) or set(symbols) != {"init", "load_to_device", "entry"}:
        return False
    named = [name for name in symbols.values() if name is not None]
    return (symbols["entry"] is not None and len(named) in (1, 3)
            and all(isinstance(name, str) and name.startswith(f"_mlir_{prefix}_")
                    for name in named))


def _prefix(key: str) -> str:
    """The symbol prefix of a key's functions (unique per kernel, a C identifier)."""
    return f"gwgrad_{key[:24]}"


def _linker() -> Optional[str]:
    """A C compiler driver that links shared libraries, or None."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        path = shutil.which(name) if name else None
        if path:
            return path
    return None


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` through a temporary file of its folder and ``os.replace``: a reader sees
    the old file or the new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _store_entry(directory: Path, key: str, signature: Tuple[str, ...], compiled: Any,
                 info: Dict[str, Any], extra: Dict[str, str]) -> "KernelFunction":
    """Export ``compiled``, link it (when a C compiler exists), store the entry, load it."""
    data, meta = _export(key, signature, compiled, info, extra)
    try:
        return _write_and_load(directory, key, signature, meta, data)
    except OSError as exc:  # disk full, permissions changed...
        if directory == _scratch:
            raise
        warnings.warn(f"gwgrad kernel cache: writing to {directory} failed ({exc}); this "
                      "kernel is kept in memory only", RuntimeWarning, stacklevel=3)
        return _write_and_load(_scratch_dir(), key, signature, meta, data)


def _write_and_load(directory: Path, key: str, signature: Tuple[str, ...],
                    meta: Dict[str, Any], data: bytes) -> "KernelFunction":
    """Under the key's lock: the entry another process stored meanwhile, else ours written
    (binary, then the metadata that vouches for it) and loaded. Loading under the lock keeps
    a concurrent writer from replacing the binary between our write and our load."""
    with _key_lock(directory, key):
        with contextlib.suppress(_BadEntry):
            return _open_entry(directory, key, signature)
        _remove(directory, key)
        write_atomic(directory / meta["binary"], data)
        write_atomic(directory / f"{key}.json", json.dumps(meta, indent=1).encode())
        try:
            return KernelFunction(_load_binary(directory / meta["binary"], meta), key,
                                  signature, meta)
        except _BadEntry as exc:
            raise RuntimeError(f"loading the kernel just compiled failed: {exc}") from exc


def _export(key: str, signature: Tuple[str, ...], compiled: Any, info: Dict[str, Any],
            extra: Dict[str, str]) -> Tuple[bytes, Dict[str, Any]]:
    """(binary, metadata) of ``compiled``: its object file, linked when a C compiler exists."""
    from cutlass.runtime import find_runtime_libraries

    prefix = _prefix(key)
    runtime = find_runtime_libraries(enable_tvm_ffi=False)
    if not runtime:
        raise RuntimeError("the CuTe DSL's runtime library (libcute_dsl_runtime.so) was not "
                           "found (cutlass.runtime.find_runtime_libraries)")
    # Exporting resolves the object's symbols in a JIT session: the runtime must be loaded
    # (cute.compile loads it only when this machine's GPU can run the code).
    ctypes.CDLL(runtime[0], mode=ctypes.RTLD_GLOBAL)
    try:
        obj = compiled.dump_to_object(prefix)
    except Exception as exc:
        raise RuntimeError(f"exporting kernel {compiled.function_name} as an object file "
                           f"(dump_to_object) failed: {exc}") from exc
    data, suffix = _link(obj)
    gpu = bool(getattr(compiled, "has_gpu_module", True))  # False: a host-only function
    return data, {
        "format": FORMAT, "key": key, "prefix": prefix, "signature": list(signature),
        "symbols": {"init": f"_mlir_{prefix}_cuda_init" if gpu else None,
                    "load_to_device": f"_mlir_{prefix}_cuda_load_to_device" if gpu else None,
                    "entry": f"_mlir_{prefix}__mlir_ciface_{compiled.function_name}"},
        "binary": f"{key}{suffix}", "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(), "dsl_version": dsl_version(),
        "runtime": runtime[0], "info": info, "created": time.time(), **extra}


def _link(obj: bytes) -> Tuple[bytes, str]:
    """(binary, suffix): a shared library linked from ``obj``, or the object itself (".o")
    when no C compiler is found or linking fails (with a warning)."""
    linker = _linker()
    if linker is None:
        return obj, ".o"
    with tempfile.TemporaryDirectory(prefix="gwgrad-link-") as tmp:
        src, out = os.path.join(tmp, "kernel.o"), os.path.join(tmp, "kernel.so")
        with open(src, "wb") as handle:
            handle.write(obj)
        result = subprocess.run([linker, "-shared", "-o", out, src], capture_output=True,
                                text=True)
        if result.returncode == 0:
            with open(out, "rb") as handle:
                return handle.read(), ".so"
    warnings.warn(f"gwgrad kernel cache: `{linker} -shared` failed (exit {result.returncode}: "
                  f"{result.stderr.strip()[-500:]}); storing the object file, which loading "
                  "needs the CuTe DSL for", RuntimeWarning, stacklevel=4)
    return obj, ".o"


# -- XLA FFI modules ----------------------------------------------------------------------------------


class XlaModule:
    """An XLA FFI module from the cache: ``module`` (the object file's bytes), ``fingerprint``
    (their sha256, the call's ``key`` attribute) and, from its metadata, ``target`` and
    ``ffi_version``, ``results`` ((shape, dtype name) per result), ``aliases`` ((input, output)
    pairs), ``input_layouts`` / ``output_layouts`` (JAX's major-to-minor order, or None),
    ``runtime`` (the library implementing the target) and ``info``."""

    def __init__(self, key: str, module: bytes, meta: Dict[str, Any]):
        self.key, self.module = key, module
        self.fingerprint = hashlib.sha256(module).digest()
        self.target, self.ffi_version = meta["target"], meta["ffi_version"]
        self.results = tuple((tuple(shape), dtype) for shape, dtype in meta["results"])
        self.aliases = tuple((int(i), int(o)) for i, o in meta["aliases"])
        self.input_layouts = tuple(_layout(x) for x in meta["input_layouts"])
        self.output_layouts = tuple(_layout(x) for x in meta["output_layouts"])
        self.runtime = meta["runtime"]
        self.info = meta.get("info") or {}


def _layout(order: Any) -> Optional[Tuple[int, ...]]:
    return None if order is None else tuple(int(i) for i in order)


#: Metadata fields of an XLA FFI module that ``compile_fn`` provides (``load_or_compile_module``).
MODULE_FIELDS = ("target", "ffi_version", "results", "aliases", "input_layouts",
                 "output_layouts", "runtime")


def load_or_compile_module(key_parts: Tuple, arch: str, options: str,
                           compile_fn: Callable[[], Dict[str, Any]]) -> XlaModule:
    """The XLA FFI module for these inputs: from memory, from disk (no DSL import), or compiled
    now. ``compile_fn()`` returns a dict of ``module`` (bytes), the ``MODULE_FIELDS`` and
    optionally ``info`` (kept with the entry); ``key_parts`` as for ``load_or_compile`` (the
    call's buffers' shapes and dtypes, its constants and the FFI version belong there)."""
    key = entry_key(key_parts, arch, options, MODULE_SIGNATURE)
    with _lock:
        found = _stored_module(key)
        if found is None:
            built = compile_fn()
            _stats["compiles"] += 1
            data = bytes(built["module"])
            meta = {"format": FORMAT, "kind": "xla-ffi", "key": key, "binary": f"{key}.xla",
                    "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                    "dsl_version": dsl_version(), "info": built.get("info") or {},
                    "created": time.time(), "arch": arch, "options": options,
                    **{name: built[name] for name in MODULE_FIELDS}}
            _check_module_meta(meta)  # what a later process would reject, refused now
            found = _store_module(key, meta, data)
            _memory[key] = found
        return found


def lookup_module(key_parts: Tuple, arch: str, options: str) -> Optional[XlaModule]:
    """The XLA FFI module for these inputs from memory or disk, or None: never compiles."""
    key = entry_key(key_parts, arch, options, MODULE_SIGNATURE)
    with _lock:
        return _stored_module(key)


def _stored_module(key: str) -> Optional[XlaModule]:
    """Memory, then disk (a disk hit is kept in memory); call with _lock held."""
    found = _memory.get(key)
    if found is not None:
        _stats["memory_hits"] += 1
        return found
    directory = _usable_cache_dir()
    if directory is None or not (directory / f"{key}.json").exists():
        return None
    try:
        found = _open_module(directory, key)
    except _BadEntry:
        with _key_lock(directory, key):
            try:  # a writer may just have replaced it
                found = _open_module(directory, key)
            except _BadEntry:
                _remove(directory, key)
                _stats["rebuilds"] += 1
                return None
    _stats["disk_hits"] += 1
    _memory[key] = found
    return found


def _store_module(key: str, meta: Dict[str, Any], data: bytes) -> XlaModule:
    """Write the entry (the module, then the metadata that vouches for it) under the key's
    lock, unless another process stored a good one meanwhile; kept in memory only where the
    disk cache is off or unwritable."""
    directory = _usable_cache_dir()
    if directory is not None:
        try:
            with _key_lock(directory, key):
                with contextlib.suppress(_BadEntry):
                    return _open_module(directory, key)
                _remove(directory, key)
                write_atomic(directory / meta["binary"], data)
                write_atomic(directory / f"{key}.json", json.dumps(meta, indent=1).encode())
        except OSError as exc:  # disk full, permissions changed...
            warnings.warn(f"gwgrad kernel cache: writing to {directory} failed ({exc}); this "
                          "module is kept in memory only", RuntimeWarning, stacklevel=3)
    return XlaModule(key, data, meta)


def _open_module(directory: Path, key: str) -> XlaModule:
    """Check an XLA FFI module's metadata and bytes; raise _BadEntry saying what is wrong."""
    meta = _read_meta(directory, key)
    expected = {"format": FORMAT, "kind": "xla-ffi", "key": key, "binary": f"{key}.xla",
                "dsl_version": dsl_version()}
    for name, value in expected.items():
        if meta.get(name) != value:
            raise _BadEntry(f"metadata {name} is {meta.get(name)!r}, expected {value!r}")
    _check_module_meta(meta)
    try:
        data = (directory / meta["binary"]).read_bytes()
    except OSError as exc:
        raise _BadEntry(f"unreadable module: {exc}") from exc
    if len(data) != meta.get("size") or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise _BadEntry(f"{meta['binary']} differs from its metadata (size {len(data)})")
    return XlaModule(key, data, meta)


def _check_module_meta(meta: Dict[str, Any]) -> None:
    """The fields of an XLA FFI module's metadata have their types; the runtime library
    exists. _BadEntry otherwise."""

    def layouts(value: Any) -> bool:
        return isinstance(value, list) and all(
            x is None or (isinstance(x, list) and all(isinstance(i, int) for i in x))
            for x in value)

    results = meta.get("results")
    checks = {
        "target": isinstance(meta.get("target"), str) and bool(meta.get("target")),
        "ffi_version": meta.get("ffi_version") in (1, 2),
        "results": isinstance(results, list) and bool(results) and all(
            isinstance(r, list) and len(r) == 2 and isinstance(r[1], str)
            and isinstance(r[0], list) and all(isinstance(d, int) and d >= 0 for d in r[0])
            for r in results),
        "aliases": isinstance(meta.get("aliases"), list) and all(
            isinstance(a, list) and len(a) == 2 and all(isinstance(i, int) for i in a)
            for a in meta.get("aliases")),
        "input_layouts": layouts(meta.get("input_layouts")),
        "output_layouts": layouts(meta.get("output_layouts")),
        "runtime": isinstance(meta.get("runtime"), str),
    }
    for name, ok in checks.items():
        if not ok:
            raise _BadEntry(f"metadata {name} is {meta.get(name)!r}")
    if not os.path.isfile(meta["runtime"]):
        raise _BadEntry(f"the DSL runtime library {meta['runtime']!r} does not exist")


# -- loaded binaries and launches ------------------------------------------------------------------


class _Binary:
    """A loaded binary's functions and its CUDA state: the cudaLibrary (``init``, once) and
    the devices it is loaded on (``load_to_device``). A host-only function (no kernel: no
    ``init``) runs on the host: every device counts as loaded and current."""

    def __init__(self, addresses: Dict[str, Optional[int]], keepalive: Any):
        self.addresses = addresses
        self.host_only = addresses["init"] is None
        if not self.host_only:
            self.init = _VOID_FN(addresses["init"])
            self.load_to_device = _VOID_FN(addresses["load_to_device"])
        self.entry = _ENTRY_FN(addresses["entry"])
        self.keepalive = keepalive
        self.library = ctypes.c_void_p()  # cudaLibrary_t
        self.library_ptr = ctypes.pointer(self.library)
        self.initialized = False
        self.devices: set = set()
        # One visible device (or none needed): it is always the current one.
        self.single_device = self.host_only
        self.lock = threading.Lock()

    def load(self, device: int, name: str) -> None:
        """Initialize the library (first call) and load it onto ``device``."""
        with self.lock:
            if device in self.devices or self.host_only:
                self.devices.add(device)
                return
            ret, dev = ctypes.c_int32(0), ctypes.c_int32(device)
            lib = ctypes.addressof(self.library_ptr)
            if not self.initialized:
                self.init((ctypes.c_void_p * 2)(lib, ctypes.addressof(ret)))
                if ret.value:
                    raise _cuda_error(f"loading kernel {name} (cuda_init)", ret.value)
                self.initialized = True
                self.single_device = _cuda.device_count() == 1
            self.load_to_device((ctypes.c_void_p * 3)(lib, ctypes.addressof(dev),
                                                      ctypes.addressof(ret)))
            if ret.value:
                raise _cuda_error(f"loading kernel {name} onto device {device} "
                                  "(cuda_load_to_device)", ret.value)
            self.devices.add(device)


def _load_binary(path: Path, meta: Dict[str, Any]) -> _Binary:
    """Load ``path`` (.so: ctypes; .o: the DSL's load_module) and resolve its three symbols;
    raise _BadEntry saying what failed."""
    symbols = meta["symbols"]
    if path.suffix == ".so":
        runtime = meta.get("runtime")
        if not (isinstance(runtime, str) and os.path.isfile(runtime)):
            raise _BadEntry(f"the DSL runtime library {runtime!r} does not exist")
        try:
            ctypes.CDLL(runtime, mode=ctypes.RTLD_GLOBAL)  # resolves the binary's _cuda* symbols
            lib = ctypes.CDLL(str(path))
            addresses = {role: name and ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                         for role, name in symbols.items()}
        except (OSError, AttributeError) as exc:
            raise _BadEntry(f"loading {path} failed: {exc}") from exc
        # dlopen of a path loaded before returns that library, globals (CUDA state) included.
        binary = _binaries.get(str(path))
        if binary is None or binary.addresses != addresses:
            binary = _binaries[str(path)] = _Binary(addresses, lib)
        return binary
    try:
        from cutlass.runtime import load_module

        module = load_module(str(path))
        addresses = {role: name and module.engine.lookup(name) for role, name in symbols.items()}
    except Exception as exc:  # the DSL raises its own error types
        raise _BadEntry(f"loading {path} through cutlass.runtime.load_module failed: {exc}") \
            from exc
    if any(symbols[role] and not address for role, address in addresses.items()):
        raise _BadEntry(f"{path}: symbols not found: {addresses}")
    return _Binary(addresses, module)


def _cuda_error(what: str, code: int) -> RuntimeError:
    """RuntimeError naming the CUDA error ``code`` (a cudaError_t)."""
    try:
        from cuda.bindings import runtime as rt

        error = rt.cudaError_t(code)
        detail = (f"{rt.cudaGetErrorName(error)[1].decode()} ({code}): "
                  f"{rt.cudaGetErrorString(error)[1].decode()}")
    except Exception:  # cuda-bindings missing, or a code it does not know
        detail = f"CUDA error {code}"
    return RuntimeError(f"{what} failed: {detail}")


class KernelFunction:
    """A compiled kernel's host launch function, called through ctypes.

    ``launch(device, stream, *values)``: ``values`` are the signature's arguments in order
    without the stream (pointers as ints, int32 values). ``info``: what ``compile_fn`` stored
    with the kernel; ``key``: its cache key; ``name``: its entry symbol.
    """

    def __init__(self, binary: _Binary, key: str, signature: Tuple[str, ...],
                 meta: Dict[str, Any]):
        if sys.byteorder != "little":  # an int32 is read from the low half of its slot
            raise RuntimeError("gwgrad's kernel launcher needs a little-endian host")
        self.key, self.signature, self.info = key, signature, meta.get("info") or {}
        self.name = meta["symbols"]["entry"]
        self._binary = binary
        self._entry = binary.entry
        # Argument storage, made once: one 8-byte slot per value, the stream, the error slot.
        self._n_values = len(signature) - 1
        self._values = (ctypes.c_uint64 * max(self._n_values, 1))()
        self._stream = ctypes.c_void_p()
        self._error = ctypes.c_int32()
        slots = iter(range(self._n_values))
        addresses = [ctypes.addressof(self._stream) if kind == "stream"
                     else ctypes.addressof(self._values) + 8 * next(slots) for kind in signature]
        addresses.append(ctypes.addressof(self._error))
        self._args = (ctypes.c_void_p * len(addresses))(*addresses)
        self._args_address, self._n_args = ctypes.addressof(self._args), len(addresses)
        self._lock = threading.Lock()  # one argument storage

    def load(self, device: int) -> None:
        """Load the kernel onto ``device`` (``launch`` does it on first use); RuntimeError
        naming the CUDA error on failure."""
        self._binary.load(device, self.name)

    def launch(self, device: int, stream: int, *values: int) -> None:
        """Enqueue the kernel on ``stream`` of ``device`` (made current for the call if it is
        not); RuntimeError naming the CUDA error the launch returned."""
        binary = self._binary
        if device not in binary.devices:
            self.load(device)
        if binary.single_device or _cuda.current_device() == device:
            self._call(stream, values)
        else:
            with _cuda.on_device(device):
                self._call(stream, values)

    def bound(self, device: int, *tail: int) -> Callable[..., None]:
        """``launch`` on ``device`` as one function of ``(stream, *values)``, ``tail``
        appended to the values: the per-call path of gwgrad.plan (one Python frame between
        the caller and the host function when one GPU is visible)."""
        self.load(device)
        binary, call = self._binary, self._call
        if not binary.single_device:
            def launch_elsewhere(stream: int, *values: int) -> None:
                self.launch(device, stream, *values, *tail)
            return launch_elsewhere
        n, slots, stream_slot, error = self._n_values, self._values, self._stream, self._error
        entry, args, n_args, lock = self._entry, self._args_address, self._n_args, self._lock
        if len(tail) + 1 > n:
            raise TypeError(f"{self.name}: {len(tail)} bound values leave no room for the "
                            f"call's own ({self.signature})")

        def launch_here(stream: int, *values: int) -> None:
            values += tail
            if len(values) != n:
                call(stream, values)  # raises the TypeError naming the signature
            with lock:
                slots[:n] = values
                stream_slot.value = stream
                error.value = 0
                entry(args, n_args)
                code = error.value
            if code:
                raise _cuda_error(f"launching kernel {self.name}", code)
        return launch_here

    def _call(self, stream: int, values: Tuple[int, ...]) -> None:
        if len(values) != self._n_values:
            raise TypeError(f"{self.name}: expected {self._n_values} argument values "
                            f"({self.signature}, stream apart), got {len(values)}")
        with self._lock:
            self._values[:self._n_values] = values
            self._stream.value = stream
            self._error.value = 0
            self._entry(self._args_address, self._n_args)
            error = self._error.value
        if error:
            raise _cuda_error(f"launching kernel {self.name}", error)
