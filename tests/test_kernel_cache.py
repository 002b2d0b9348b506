"""gwgrad.kernel_cache: keys, the disk cache across processes (a fresh process loads a compiled
kernel with ctypes alone, without importing the CuTe DSL), bad entries deleted and rebuilt, the
launcher's calling convention (a host-only CuTe DSL function records the values it receives,
so this runs without a GPU), and on a GPU the GEMM loaded from disk in a fresh process."""

import ast
import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import gwgrad
from gwgrad import kernel_cache

REPO = Path(__file__).resolve().parents[1]
#: The recorder's signature: the stream in the middle, to check each slot's place.
SIGNATURE = ("ptr", "i32", "stream", "ptr", "i32")
RECORDER_KEY = ("test_kernel_cache.recorder", 1)
ARCH, OPTIONS = "sm_90a", "--gpu-arch sm_90a"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty disk cache of this test; nothing in memory before or after."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("GWGRAD_CACHE_DIR", str(directory))
    kernel_cache.clear_memory()
    yield directory
    kernel_cache.clear_memory()


def counters_since(before):
    after = kernel_cache.stats()
    return {name: after[name] - before[name] for name in after}


# -- keys and directories (no DSL needed) --------------------------------------------------------


def test_key_changes_with_every_input(monkeypatch):
    def key(parts=("spec",), arch="sm_90a", options="--gpu-arch sm_90a", signature=SIGNATURE):
        return kernel_cache.entry_key(parts, arch, options, signature)

    base = key()
    assert key() == base and len(base) == 64
    variants = [key(parts=("spec", 2)), key(parts=("other",)), key(arch="sm_100a"),
                key(options="--gpu-arch sm_90a --keep-ptx"), key(signature=SIGNATURE[:-1])]
    monkeypatch.setattr(gwgrad._version, "__version__", "0.0.0-test")
    variants.append(key())
    monkeypatch.undo()
    monkeypatch.setattr(kernel_cache, "dsl_version", lambda: "4.0.0")
    variants.append(key())
    monkeypatch.undo()
    monkeypatch.setattr(kernel_cache, "source_hash", lambda: "0" * 64)
    variants.append(key())
    monkeypatch.undo()
    assert key() == base
    assert len(set(variants)) == len(variants) and base not in variants


def test_source_hash_sees_every_byte_and_file(tmp_path):
    (tmp_path / "kernels" / "sub").mkdir(parents=True)
    (tmp_path / "kernels" / "a.py").write_text("x = 1\n")
    (tmp_path / "kernels" / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "spec.py").write_text("z = 3\n")
    names = ("kernels", "spec.py")
    hashes = {kernel_cache.hash_sources(tmp_path, names)}
    for edit in (lambda: (tmp_path / "kernels" / "sub" / "b.py").write_text("y = 3\n"),
                 lambda: (tmp_path / "spec.py").write_text("z = 3 \n"),
                 lambda: (tmp_path / "kernels" / "c.py").write_text(""),
                 lambda: (tmp_path / "kernels" / "c.py").rename(tmp_path / "kernels" / "d.py")):
        edit()
        hashes.add(kernel_cache.hash_sources(tmp_path, names))
    assert len(hashes) == 5
    assert kernel_cache.hash_sources(tmp_path, names) in hashes  # deterministic


def test_sources_cover_what_the_kernels_import():
    """Every gwgrad module the kernel sources import is hashed into the key."""
    package = REPO / "gwgrad"
    for path in (package / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2:
                names = [node.module] if node.module else [a.name for a in node.names]
                for name in names:
                    top = name.split(".")[0]
                    assert top in kernel_cache.SOURCES or f"{top}.py" in kernel_cache.SOURCES, \
                        f"{path.name} imports gwgrad.{name}: add it to kernel_cache.SOURCES"
    for name in kernel_cache.SOURCES:
        assert (package / name).exists(), name


def test_cache_dir_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GWGRAD_CACHE_DIR", str(tmp_path / "here"))
    assert kernel_cache.cache_dir() == tmp_path / "here"
    for off in ("off", "0", "OFF"):
        monkeypatch.setenv("GWGRAD_CACHE_DIR", off)
        assert kernel_cache.cache_dir() is None
    monkeypatch.delenv("GWGRAD_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache.cache_dir() == tmp_path / "xdg" / "gwgrad"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernel_cache.cache_dir() == tmp_path / "home" / ".cache" / "gwgrad"


@pytest.mark.parametrize("signature", [("ptr", "i32"), ("ptr", "stream", "stream"),
                                       ("ptr", "f32", "stream")])
def test_signature_is_checked(signature):
    def never():
        raise AssertionError("compiled a bad signature")

    with pytest.raises(ValueError, match="signature"):
        kernel_cache.load_or_compile(("x",), ARCH, OPTIONS, signature, never)


# -- a host-only CuTe DSL function: the whole path without a GPU -----------------------------------


@pytest.fixture(scope="module")
def recorder():
    pytest.importorskip("cutlass")
    return compile_recorder()


def compile_recorder():
    """A compiled host-only function of SIGNATURE that writes what it received into `out`."""
    import cuda.bindings.driver as cuda_driver
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32
    from cutlass.cute.runtime import make_ptr

    @cute.jit
    def record(out: cute.Pointer, a: Int32, stream: cuda_driver.CUstream, x: cute.Pointer,
               b: Int32):
        seen = cute.make_tensor(out, cute.make_layout(4))
        seen[0] = a
        seen[1] = b
        seen[2] = Int32(x.toint() & 0x7FFFFFFF)
        seen[3] = Int32(x.toint() >> 32)

    def ptr():
        return make_ptr(cutlass.Int32, 0, cute.AddressSpace.generic, assumed_align=4)

    return cute.compile(record, ptr(), Int32(0), cuda_driver.CUstream(0), ptr(), Int32(0),
                        options=OPTIONS)


def load_recorder(compiled=None):
    def compile_fn():
        if compiled is None:
            raise AssertionError("compiled although the entry should be cached")
        return compiled, {"what": "recorder"}

    return kernel_cache.load_or_compile(RECORDER_KEY, ARCH, OPTIONS, SIGNATURE, compile_fn)


def check_records(kernel):
    seen = (ctypes.c_int32 * 4)()
    x = 0x1234_5678_9ABC
    kernel.launch(0, 0x5EED, ctypes.addressof(seen), -5, x, 2**31 - 1)
    assert list(seen) == [-5, 2**31 - 1, x & 0x7FFFFFFF, x >> 32]


def test_launch_delivers_every_value(cache, recorder):
    before = kernel_cache.stats()
    kernel = load_recorder(recorder)
    assert counters_since(before) == {"compiles": 1, "memory_hits": 0, "disk_hits": 0,
                                      "rebuilds": 0}
    assert kernel.info == {"what": "recorder"} and kernel.signature == SIGNATURE
    check_records(kernel)
    check_records(kernel)  # the argument storage is reused
    assert load_recorder() is kernel
    with pytest.raises(TypeError, match="expected 4 argument values"):
        kernel.launch(0, 0, 1, 2, 3)
    files = sorted(p.suffix for p in cache.iterdir() if not p.name.startswith("."))
    assert files == [".json", ".lock", ".so"]
    meta = json.loads(next(cache.glob("*.json")).read_text())
    assert meta["signature"] == list(SIGNATURE) and meta["symbols"]["init"] is None


CHILD = """
import json, sys
from gwgrad import kernel_cache
sys.path.insert(0, {tests!r})
from test_kernel_cache import load_recorder, check_records
kernel = load_recorder()
check_records(kernel)
gemm = None
if {gemm!r}:
    from gwgrad.backends import finalize_spec
    from test_kernel_cache import gemm_spec
    spec, backend = finalize_spec(gemm_spec())  # check_support: no DSL for a cached kernel
    compiled = backend.compile(spec)
    try:
        compiled.kernel.load(0)
        gemm = "loaded"
    except RuntimeError as exc:
        gemm = str(exc)
print(json.dumps({{"stats": kernel_cache.stats(), "cutlass": "cutlass" in sys.modules,
                  "gemm": gemm}}))
"""


def python_path() -> str:
    """This checkout first, then the caller's PYTHONPATH (where the DSL may live)."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def run_child(code: str, cache_dir: Path) -> str:
    """Run ``code`` in a fresh Python with this disk cache; its stdout."""
    environment = dict(os.environ, GWGRAD_CACHE_DIR=str(cache_dir), CUTE_DSL_ARCH="sm_90a",
                       PYTHONPATH=python_path())
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=environment, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def gemm_spec():
    """A GEMM spec with every tuning field set (what backends.finalize_spec would give)."""
    from gwgrad.dtypes import DType
    from gwgrad.spec import StaticSpec, Tuning

    return StaticSpec(hidden=256, intermediate=512, num_experts=4, a_dtype=DType.BFLOAT16,
                      b_dtype=DType.BFLOAT16, wgrad_dtype=DType.FLOAT32,
                      acc_dtype=DType.FLOAT32, a_major="m", b_major="n", input_order="tensor2d",
                      output_mode="dense", accumulate=False, sf_vec_size=16, arch="sm_90a",
                      tuning=Tuning(mma_tiler_mn=(128, 128), cluster_shape_mn=(1, 1),
                                    raster_group=16, epi_tile_n=32, epi_buffer_sets=1,
                                    launches=1, unit_schedule=1, mainloop=1))


def test_fresh_process_loads_from_disk_without_the_dsl(cache, recorder):
    from gwgrad import cuda
    from gwgrad.backends import finalize_spec
    from gwgrad.backends.bf16_sm90 import Bf16Sm90Backend

    load_recorder(recorder)
    assert finalize_spec(gemm_spec())[0] == gemm_spec()  # the spec a caller would compile
    compiled = Bf16Sm90Backend().compile(gemm_spec())
    assert compiled.num_units > 0 and compiled.workspace_bytes > 0
    out = json.loads(run_child(CHILD.format(tests=str(REPO / "tests"), gemm=True), cache))
    stats = out["stats"]
    assert (stats["compiles"], stats["disk_hits"], stats["rebuilds"]) == (0, 2, 0), stats
    assert out["cutlass"] is False
    if cuda.available():
        assert out["gemm"] == "loaded"
    else:  # init ran through ctypes and reported the CUDA error it got
        assert "cuda_init" in out["gemm"] and "cudaError" in out["gemm"], out["gemm"]


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _edit_json(**changes):
    def edit(path):
        meta = json.loads(path.read_text())
        meta.update({k: v(meta) for k, v in changes.items()})
        path.write_text(json.dumps(meta))
    return edit


CORRUPTIONS = {
    "none (control)": (".json", lambda p: None),
    "truncated binary": (".so", _truncate),
    "flipped byte": (".so", lambda p: p.write_bytes(p.read_bytes()[:-1] + bytes(
        [p.read_bytes()[-1] ^ 1]))),
    "binary deleted": (".so", os.unlink),
    "garbled json": (".json", lambda p: p.write_text(p.read_text()[:-20] + "#")),
    "json not an object": (".json", lambda p: p.write_text("[1, 2]")),
    "other signature": (".json", _edit_json(signature=lambda m: ["ptr", "stream"])),
    "other dsl version": (".json", _edit_json(dsl_version=lambda m: "0.1")),
    "missing symbol": (".json", _edit_json(symbols=lambda m: dict(
        m["symbols"], entry=f"_mlir_{m['prefix']}_no_such_function"))),
    "missing runtime": (".json", _edit_json(runtime=lambda m: "/nonexistent/libcute.so")),
}


@pytest.fixture(scope="module")
def pristine(recorder, tmp_path_factory):
    """A good recorder entry, built once. Tests corrupt copies: a library this process has
    loaded must never be rewritten in place (that crashes the process, whatever it checks;
    gwgrad's writers replace files, never rewrite them)."""
    directory = tmp_path_factory.mktemp("pristine")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GWGRAD_CACHE_DIR", str(directory))
        kernel_cache.clear_memory()
        load_recorder(recorder)
        kernel_cache.clear_memory()
    return directory


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_bad_entries_are_rebuilt(cache, recorder, pristine, corruption):
    cache.mkdir()
    for path in pristine.glob("*.*"):
        shutil.copy(path, cache / path.name)
    suffix, corrupt = CORRUPTIONS[corruption]
    corrupt(next(cache.glob(f"*{suffix}")))
    before = kernel_cache.stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernel = load_recorder(recorder)
    bad = corruption != "none (control)"
    assert counters_since(before) == {"compiles": bad, "memory_hits": 0, "disk_hits": not bad,
                                      "rebuilds": bad}
    check_records(kernel)
    kernel_cache.clear_memory()  # the rebuilt entry is good
    before = kernel_cache.stats()
    check_records(load_recorder())
    assert counters_since(before)["disk_hits"] == 1


def test_object_file_without_a_linker(cache, recorder, monkeypatch):
    """Without a C compiler the object file is stored and loaded through the DSL: the same
    symbols, called by the same launcher."""
    monkeypatch.setattr(kernel_cache, "_linker", lambda: None)
    check_records(load_recorder(recorder))
    assert sorted(p.suffix for p in cache.glob("*.*")) == [".json", ".lock", ".o"]
    kernel_cache.clear_memory()
    before = kernel_cache.stats()
    check_records(load_recorder())
    assert counters_since(before)["disk_hits"] == 1


def test_gemm_object_file_symbols_resolve_through_the_dsl(cache, monkeypatch):
    """The real kernel's three symbols resolve from its object file without a GPU; init then
    reports the CUDA error it meets (none on a GPU)."""
    pytest.importorskip("cutlass")
    from gwgrad import cuda
    from gwgrad.backends.bf16_sm90 import Bf16Sm90Backend

    monkeypatch.setattr(kernel_cache, "_linker", lambda: None)
    Bf16Sm90Backend().compile(gemm_spec())
    kernel_cache.clear_memory()
    before = kernel_cache.stats()
    compiled = Bf16Sm90Backend().compile(gemm_spec())
    assert counters_since(before)["disk_hits"] == 1
    if not cuda.available():
        with pytest.raises(RuntimeError, match=r"cuda_init\) failed: cudaError"):
            compiled.kernel.load(0)


def test_unwritable_cache_dir_warns_once(tmp_path, monkeypatch, recorder):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("GWGRAD_CACHE_DIR", str(blocker / "cache"))
    kernel_cache.clear_memory()
    before = kernel_cache.stats()
    with pytest.warns(RuntimeWarning, match="cannot write") as caught:
        check_records(load_recorder(recorder))
        kernel_cache.clear_memory()
        check_records(load_recorder(recorder))
    assert len(caught) == 1
    assert counters_since(before)["compiles"] == 2
    kernel_cache.clear_memory()


def test_disabled_cache_keeps_memory_only(monkeypatch, recorder):
    monkeypatch.setenv("GWGRAD_CACHE_DIR", "off")
    kernel_cache.clear_memory()
    before = kernel_cache.stats()
    kernel = load_recorder(recorder)
    assert load_recorder() is kernel
    kernel_cache.clear_memory()
    check_records(load_recorder(recorder))
    assert counters_since(before) == {"compiles": 2, "memory_hits": 1, "disk_hits": 0,
                                      "rebuilds": 0}
    kernel_cache.clear_memory()


WRITER = """
import sys
sys.path.insert(0, {tests!r})
import test_kernel_cache as t
t.check_records(t.load_recorder(t.compile_recorder()))
"""


def test_a_writer_keeps_the_entry_another_process_stored_meanwhile(cache, recorder):
    """Two processes missed the cache and both compiled: the second to store loads the first
    one's entry instead of replacing its files (replacing them raced with the first one's
    load of its binary: CI saw "cannot open shared object file")."""
    load_recorder(recorder)
    key = kernel_cache.entry_key(RECORDER_KEY, ARCH, OPTIONS, SIGNATURE)
    stored = {p.name: p.stat().st_ino for p in cache.iterdir()}
    kernel_cache.clear_memory()
    kernel = kernel_cache._store_entry(cache, key, SIGNATURE, recorder, {"what": "second"},
                                       {"arch": ARCH, "options": OPTIONS})
    assert kernel.info == {"what": "recorder"}  # the first writer's entry
    assert {p.name: p.stat().st_ino for p in cache.iterdir()} == stored
    check_records(kernel)


def test_concurrent_writers(cache):
    """Processes compiling the same kernel at once leave one good entry."""
    pytest.importorskip("cutlass")
    code = WRITER.format(tests=str(REPO / "tests"))
    env = dict(os.environ, GWGRAD_CACHE_DIR=str(cache), PYTHONPATH=python_path())
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    for proc in procs:
        assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    before = kernel_cache.stats()
    check_records(load_recorder())
    assert counters_since(before)["disk_hits"] == 1
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temporary files


# -- XLA FFI modules (the JAX adapter's custom calls): fake bytes, no DSL ------------------------

MODULE_KEY = ("test_kernel_cache.module", (((8, 4), "bfloat16"),), ("tokens_sum", 8))


@pytest.fixture
def runtime(tmp_path):
    """A stand-in for the DSL runtime library's path (entries check that it exists)."""
    path = tmp_path / "libcute_dsl_runtime.so"
    path.write_bytes(b"\x7fELF stand-in")
    return str(path)


def fake_module(runtime, data=b"\x7fELF module bytes", builds=None):
    """A compile_fn for load_or_compile_module: fake object bytes and call description."""

    def build():
        if builds is not None:
            builds.append(1)
        return {"module": data, "target": "CuteDSLRT_NvJaxCutlassCall_v2", "ffi_version": 2,
                "results": [[[4, 8, 8], "float32"], [[256], "uint8"], [[16], "int32"]],
                "aliases": [[3, 2]], "input_layouts": [[1, 0], [1, 0], [0], [0]],
                "output_layouts": [[0, 1, 2], [0], [0]], "runtime": runtime,
                "info": {"grid_size": 132}}
    return build


def test_a_module_is_stored_and_read_back_by_a_fresh_process(cache, runtime):
    builds = []
    before = kernel_cache.stats()
    found = kernel_cache.load_or_compile_module(MODULE_KEY, ARCH, OPTIONS,
                                                fake_module(runtime, builds=builds))
    assert builds == [1] and counters_since(before)["compiles"] == 1
    key = found.key
    assert (cache / f"{key}.xla").read_bytes() == b"\x7fELF module bytes"
    meta = json.loads((cache / f"{key}.json").read_text())
    assert meta["kind"] == "xla-ffi" and meta["dsl_version"] == kernel_cache.dsl_version()
    kernel_cache.clear_memory()  # as a new process
    before = kernel_cache.stats()
    again = kernel_cache.load_or_compile_module(MODULE_KEY, ARCH, OPTIONS,
                                                fake_module(runtime, builds=builds))
    assert builds == [1] and counters_since(before) == {"compiles": 0, "memory_hits": 0,
                                                        "disk_hits": 1, "rebuilds": 0}
    assert again.module == found.module and again.key == key
    assert again.fingerprint == hashlib.sha256(b"\x7fELF module bytes").digest()
    assert (again.target, again.ffi_version, again.runtime) == (
        "CuteDSLRT_NvJaxCutlassCall_v2", 2, runtime)
    assert again.results == (((4, 8, 8), "float32"), ((256,), "uint8"), ((16,), "int32"))
    assert again.aliases == ((3, 2),) and again.input_layouts[2] == (0,)
    assert again.output_layouts[0] == (0, 1, 2) and again.info == {"grid_size": 132}
    assert kernel_cache.lookup_module(MODULE_KEY, ARCH, OPTIONS) is again  # memory now
    assert kernel_cache.lookup_module(MODULE_KEY + ("other",), ARCH, OPTIONS) is None


def _set_meta(cache, key, **fields):
    path = cache / f"{key}.json"
    meta = json.loads(path.read_text())
    meta.update(fields)
    path.write_text(json.dumps(meta))


MODULE_CORRUPTIONS = {
    "module bytes": lambda cache, key, runtime: (cache / f"{key}.xla").write_bytes(b"other"),
    "module missing": lambda cache, key, runtime: (cache / f"{key}.xla").unlink(),
    "metadata not json": lambda cache, key, runtime: (cache / f"{key}.json").write_text("{"),
    "another dsl version": lambda cache, key, runtime: _set_meta(cache, key,
                                                                 dsl_version="0.0.1"),
    "a .so entry's metadata": lambda cache, key, runtime: _set_meta(cache, key, kind=None),
    "runtime library gone": lambda cache, key, runtime: os.unlink(runtime),
    "results not shapes": lambda cache, key, runtime: _set_meta(cache, key,
                                                                results=[["4x8", "f32"]]),
    "no target": lambda cache, key, runtime: _set_meta(cache, key, target=""),
    "unknown ffi version": lambda cache, key, runtime: _set_meta(cache, key, ffi_version=3),
    "layouts": lambda cache, key, runtime: _set_meta(cache, key, input_layouts=[["1", 0]]),
}


@pytest.mark.parametrize("corruption", sorted(MODULE_CORRUPTIONS))
def test_bad_module_entries_are_rebuilt(cache, runtime, corruption):
    """A module entry failing any check is deleted and compiled again, never used."""
    found = kernel_cache.load_or_compile_module(MODULE_KEY, ARCH, OPTIONS, fake_module(runtime))
    MODULE_CORRUPTIONS[corruption](cache, found.key, runtime)
    if corruption == "runtime library gone":  # the rebuilt entry records the new path
        runtime = str(cache.parent / "moved-libcute_dsl_runtime.so")
        Path(runtime).write_bytes(b"\x7fELF stand-in")
    kernel_cache.clear_memory()
    assert kernel_cache.lookup_module(MODULE_KEY, ARCH, OPTIONS) is None  # checked, deleted
    assert not (cache / f"{found.key}.json").exists()
    builds = []
    before = kernel_cache.stats()
    again = kernel_cache.load_or_compile_module(MODULE_KEY, ARCH, OPTIONS,
                                                fake_module(runtime, builds=builds))
    assert builds == [1] and again.module == found.module
    assert counters_since(before)["compiles"] == 1


def test_a_module_compile_that_would_be_rejected_is_refused(cache, runtime):
    build = fake_module(runtime)

    def bad():
        return dict(build(), results=[])

    with pytest.raises(Exception, match="results"):
        kernel_cache.load_or_compile_module(MODULE_KEY, ARCH, OPTIONS, bad)
    assert not list(cache.glob("*.xla"))


def test_a_module_key_changes_with_the_sources_and_the_dsl(cache, runtime, monkeypatch):
    """Another DSL version or other kernel sources name another entry: compiled again."""
    first = kernel_cache.load_or_compile_module(MODULE_KEY, ARCH, OPTIONS, fake_module(runtime))
    for name, value in (("dsl_version", "9.9.9"), ("source_hash", "0" * 64)):
        with monkeypatch.context() as patched:
            patched.setattr(kernel_cache, name, lambda value=value: value)
            kernel_cache.clear_memory()
            assert kernel_cache.lookup_module(MODULE_KEY, ARCH, OPTIONS) is None
            builds = []
            other = kernel_cache.load_or_compile_module(MODULE_KEY, ARCH, OPTIONS,
                                                        fake_module(runtime, builds=builds))
            assert builds == [1] and other.key != first.key
    kernel_cache.clear_memory()
    assert kernel_cache.lookup_module(MODULE_KEY, ARCH, OPTIONS).key == first.key
    assert len(list(cache.glob("*.xla"))) == 3


def test_modules_without_a_disk_cache_stay_in_memory(monkeypatch, runtime, tmp_path):
    monkeypatch.setenv("GWGRAD_CACHE_DIR", "off")
    kernel_cache.clear_memory()
    builds = []
    found = kernel_cache.load_or_compile_module(MODULE_KEY, ARCH, OPTIONS,
                                                fake_module(runtime, builds=builds))
    assert kernel_cache.load_or_compile_module(MODULE_KEY, ARCH, OPTIONS,
                                               fake_module(runtime, builds=builds)) is found
    assert builds == [1]
    kernel_cache.clear_memory()


# -- on a GPU ---------------------------------------------------------------------------------


def needs_sm90():
    from gwgrad import cuda

    if cuda.compute_capability(0) != (9, 0):
        pytest.skip("the GEMM of gemm_spec() is compiled for sm_90a")


def launch_gemm(compiled, device, stream=None):
    """Launch the GEMM of gemm_spec() on fresh inputs on ``device``: (output, a function
    returning the FP64 reference)."""
    import torch

    from gwgrad import status

    spec, counts = compiled.spec, [100, 0, 600, 300]
    with torch.cuda.device(device):
        t = sum(counts)
        x = torch.randn(t, spec.hidden, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(t, spec.intermediate, device="cuda", dtype=torch.bfloat16)
        offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
        out = torch.full((spec.num_experts, spec.hidden, spec.intermediate), float("nan"),
                         device="cuda")
        ws = torch.zeros(compiled.workspace_bytes, dtype=torch.uint8, device="cuda")
        if stream is None:
            stream = torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())  # the inputs are written there
    compiled.launch(device, stream.cuda_stream, x.data_ptr(), dy.data_ptr(), offsets.data_ptr(),
                    out.data_ptr(), ws.data_ptr(), status.status_address(device), t)

    def reference():
        bounds = [0] + offsets.tolist()
        return torch.stack([x[b:e].double().T @ dy[b:e].double()
                            for b, e in zip(bounds, bounds[1:])])

    return out, reference


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


GPU_CHILD = """
import sys, time
import torch
start = time.perf_counter()
import gwgrad
from gwgrad import kernel_cache
from gwgrad.backends.bf16_sm90 import Bf16Sm90Backend
sys.path.insert(0, {tests!r})
from test_kernel_cache import gemm_spec, launch_gemm, rel_err
stream = torch.cuda.Stream()
out, reference = launch_gemm(Bf16Sm90Backend().compile(gemm_spec()), 0, stream)
stream.synchronize()
seconds = time.perf_counter() - start
err = rel_err(out, reference())
assert kernel_cache.stats()["disk_hits"] == 1 and kernel_cache.stats()["compiles"] == 0
assert "cutlass" not in sys.modules
print(f"import gwgrad -> result: {{seconds:.3f}} s, rel err {{err:.2e}}")
assert err < 1e-5, err
"""


@pytest.mark.gpu
def test_gemm_from_disk_in_a_fresh_process(tmp_path):
    """Compile in one process; a second one loads the kernel from disk (no DSL import) and
    computes a real problem on a side stream."""
    pytest.importorskip("torch")
    needs_sm90()
    compile_child = ("import sys; sys.path.insert(0, {tests!r}); from test_kernel_cache import "
                     "gemm_spec; from gwgrad.backends.bf16_sm90 import Bf16Sm90Backend; "
                     "Bf16Sm90Backend().compile(gemm_spec())").format(tests=str(REPO / "tests"))
    run_child(compile_child, tmp_path)
    print(run_child(GPU_CHILD.format(tests=str(REPO / "tests")), tmp_path))


@pytest.mark.gpu
def test_launch_on_a_device_that_is_not_current(cache):
    """The kernel is loaded onto each device on first use, made current for the launch, and
    the caller's current device is left as it was."""
    torch = pytest.importorskip("torch")
    from gwgrad import cuda
    from gwgrad.backends.bf16_sm90 import Bf16Sm90Backend

    if cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    needs_sm90()
    compiled = Bf16Sm90Backend().compile(gemm_spec())
    torch.cuda.set_device(0)
    for device in (1, 0, 1):
        out, reference = launch_gemm(compiled, device)
        assert cuda.current_device() == 0
        torch.cuda.synchronize(device)
        assert rel_err(out, reference()) < 1e-5


def test_device_facts_are_learned_once_and_kept_on_disk(cache):
    """kernel_cache.remembered: learned once, then read back by a "new process" (memory
    cleared) from the cache directory; an unkept answer is asked again; a broken file is
    empty."""
    calls = []

    def learn(value, keep):
        def answer():
            calls.append(value)
            return value, keep
        return answer

    assert kernel_cache.remembered("clusters of 2 | GPU A", learn(60, True)) == 60
    assert kernel_cache.remembered("clusters of 2 | GPU A", learn(99, True)) == 60
    kernel_cache.clear_memory()  # as a new process
    assert kernel_cache.remembered("clusters of 2 | GPU A", learn(99, True)) == 60
    assert kernel_cache.remembered("clusters of 4 | GPU A", learn(30, False)) == 30
    kernel_cache.clear_memory()
    assert kernel_cache.remembered("clusters of 4 | GPU A", learn(31, True)) == 31
    assert calls == [60, 30, 31]
    stored = json.loads((cache / kernel_cache.FACTS_FILE).read_text())
    assert stored == {"clusters of 2 | GPU A": 60, "clusters of 4 | GPU A": 31}
    (cache / kernel_cache.FACTS_FILE).write_text("{not json")
    kernel_cache.clear_memory()
    assert kernel_cache.remembered("clusters of 2 | GPU A", learn(61, True)) == 61


CLUSTER_CHILD = """
import builtins, json, sys
sys.path.insert(0, {tests!r})
import gwgrad
from gwgrad import backends, cuda, grid, kernel_cache
from gwgrad.validation import build_spec
from gwgrad import DType, from_pointer

# A CUDA device as the host sees it, without one: an H200's answers.
cuda.compute_capability = lambda device=0: (9, 0)
cuda.device_name = lambda device=0: "NVIDIA H200"
cuda.driver_version = lambda: 13000
grid._sm_count = lambda device: 132

class Cached:  # a kernel found in the disk cache
    info = {{"num_units": 64, "workspace_bytes": 4096}}
    def bound(self, device, grid):
        self.grid = grid
        return lambda *values: None

kernel_cache.lookup = lambda *a, **k: Cached()
kernel_cache.load_or_compile = lambda *a, **k: Cached()
H = N = 256; E = 8; T = 2048
a = from_pointer(1 << 32, (H, T), (1, H), DType.BFLOAT16, 0)
b = from_pointer(2 << 32, (T, N), (N, 1), DType.BFLOAT16, 0)
off = from_pointer(3 << 32, (E,), None, DType.INT32, 0)
out = from_pointer(4 << 32, (E, H, N), None, DType.BFLOAT16, 0)
request = backends.tiling_for_tokens(build_spec(a=a, b=b, offsets=off, wgrad=out,
                                                arch="sm_90a"), T)
spec, backend = backends.finalize_spec(request)
compiled = backend.compile(spec)
compiled.launcher(0)
print(json.dumps({{"cluster": list(spec.cluster_shape_mn), "grid": compiled.kernel.grid,
                  "cutlass": "cutlass" in sys.modules}}))
"""


def test_a_cached_clustered_kernel_runs_without_the_dsl(cache):
    """A process running a cached kernel of a clustered default tiling (a 2x1 pair here)
    sizes its grid from the cluster occupancy kept in the cache directory: no CuTe DSL
    import. Without that fact (first process on this device) it would ask the DSL."""
    key = ("max_active_clusters 2 CTAs | NVIDIA H200 | sm_90 | 132 SMs | driver 13000")
    cache.mkdir(parents=True, exist_ok=True)
    (cache / kernel_cache.FACTS_FILE).write_text(json.dumps({key: 60}))
    out = json.loads(run_child(CLUSTER_CHILD.format(tests=str(REPO / "tests")),
                               cache).strip().splitlines()[-1])
    # 64 units, 60 resident pairs (the kept fact, under 132 // 2): a grid of 60 pairs.
    assert out == {"cluster": [2, 1], "grid": 120, "cutlass": False}


WARM_CHILD = """
import json, sys
import numpy as np
import torch
import gwgrad
import gwgrad.adapters.torch as gwt
from gwgrad.kernels import compiler
counts = [256] * 8
x = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16)
dy = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16)
offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
w = gwt.wgrad(x, dy, offsets, out_dtype=torch.float32)
w2 = gwgrad.grouped_gemm_wgrad(x.T, dy, offsets_tensor=offsets, wgrad_dtype="float32")[0]
data, scales, _ = gwt.quantize(x, offsets, "mxfp8")
torch.cuda.synchronize()
want = torch.stack([x[i:i + 256].double().T @ dy[i:i + 256].double() for i in range(0, 2048, 256)])
err = max(float((o.double() - want).norm() / want.norm()) for o in (w, w2))
ref = gwgrad.quantizers.reference_quantize(x.float().cpu().numpy(), offsets.cpu().numpy(),
                                           "mxfp8")
same = [np.array_equal(t.view(torch.uint8).cpu().numpy(), r) for t, r in zip((data, scales), ref)]
print(json.dumps({"cutlass": "cutlass" in sys.modules, "err": err, "quantize_equal": all(same),
                  "cache": gwgrad.kernel_cache.stats(), "dsl_compiles": compiler.compile_count}))
"""


@pytest.mark.gpu
def test_a_warm_process_never_imports_the_dsl(tmp_path):
    """The torch adapter (wgrad and quantize) and the contract's wrapper in a fresh process
    whose kernels (a clustered default tiling, a quantizer) and device facts are on disk: a
    result, no compile, no CuTe DSL import."""
    pytest.importorskip("torch")
    needs_sm90()
    cold = json.loads(run_child(WARM_CHILD, tmp_path).strip().splitlines()[-1])
    # At least a GEMM and the quantizer, each compiled once by the DSL.
    assert cold["cache"]["compiles"] >= 2, cold
    assert cold["dsl_compiles"] == cold["cache"]["compiles"], cold
    out = json.loads(run_child(WARM_CHILD, tmp_path).strip().splitlines()[-1])
    assert out["cutlass"] is False and out["cache"]["compiles"] == 0, out
    # Every kernel the cold process compiled (the wrapper and the adapter share one GEMM)
    # comes from the disk here.
    assert out["dsl_compiles"] == 0, out
    assert out["cache"]["disk_hits"] == cold["cache"]["compiles"], (cold, out)
    assert out["err"] < 1e-5 and out["quantize_equal"], out
