"""``python -m gwgrad selftest`` (gwgrad/selftest.py) on the CPU: the no-GPU run checks the
reference and exits 0; ``--list`` names every case and the architectures that run it; the
parent reports a case that hangs as "timeout" and one that dies as "crashed" while the others
still run, and a wrong result as FAIL (faults injected through GWGRAD_SELFTEST_INJECT); the
GPU path's comparison and "needs SMxx" logic on a stand-in device; the command runs from an
installed wheel with nothing but NumPy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import gwgrad
from gwgrad import selftest as st
from gwgrad.errors import UnsupportedError
from cudnn_cases import stand_in  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[1]

#: Every case and the architectures whose kernels run it (FP32 scale factors: SM90's FP8
#: kernel only; FP4: SM100's block-scaled kernel only).
EXPECTED_CASES = {
    "bf16_dense": "sm_90a sm_100a sm_103a",
    "bf16_discrete": "sm_90a sm_100a sm_103a",
    "bf16_accumulate": "sm_90a sm_100a sm_103a",
    "fp8_per_expert_channel": "sm_90a",
    "fp8_block_1x128": "sm_90a",
    "mxfp8": "sm_90a sm_100a sm_103a",
    "nvfp4": "sm_100a sm_103a",
    "mxfp4": "sm_100a sm_103a",
    "quantize_mxfp8": "sm_90a sm_100a sm_103a",
    "quantize_block_1x128": "sm_90a sm_100a sm_103a",
    "quantize_per_expert_channel": "sm_90a sm_100a sm_103a",
    "quantize_nvfp4": "sm_90a sm_100a sm_103a",
    "quantize_mxfp4": "sm_90a sm_100a sm_103a",
}


def _env(**extra):
    """No GPU (the CPU path on any machine), this checkout's gwgrad."""
    env = {k: v for k, v in os.environ.items() if k != st.INJECT_ENV}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT), **extra)
    return env


def _selftest(args, timeout=180, **env):
    return subprocess.run([sys.executable, "-m", "gwgrad", "selftest", *args], cwd=ROOT,
                          env=_env(**env), capture_output=True, text=True, timeout=timeout)


def test_cpu_run_checks_the_reference_and_exits_0(tmp_path, seed):
    out = tmp_path / "results.json"
    proc = _selftest(["--json", str(out), "--jobs", "2", "--seed", str(seed)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    assert "no CUDA GPU found: checking the reference backend" in text
    assert f"seed {seed}" in text and text.rstrip().endswith("selftest: PASS")
    report = json.loads(out.read_text())
    assert report["target"] == "cpu" and report["exit_code"] == 0 and report["seed"] == seed
    records = {r["case"]: r for r in report["results"]}
    assert set(records) == set(EXPECTED_CASES)
    for name, r in records.items():
        assert r["status"] == "pass", r
        assert r["seed"] == seed and r["target"] == "cpu"
        row = next(line for line in text.splitlines() if line.startswith(name + " "))
        assert " pass " in row, row
        if name.startswith("quantize"):
            assert r["detail"].startswith("bit-exact vs a per-expert loop"), r
            assert r["roundtrip_rel_error"] <= r["roundtrip_bound"]
        else:
            assert r["versus"] == "a direct float64 loop" and r["rel_error"] <= r["tolerance"]
            counts = r["counts"]
            assert len(counts) == 5 and counts[1] == 0 and counts[-1] % 128 and counts[0] > 128


def test_list_names_every_case_and_its_architectures():
    proc = _selftest(["--list"], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {}
    for line in proc.stdout.splitlines()[1:]:
        name, rest = line.split(None, 1)
        rows[name] = " ".join(w for w in rest.split() if w.startswith("sm_"))
    assert rows == EXPECTED_CASES
    assert "bf16_sm90 / bf16_sm100" in proc.stdout and "fp8_sm90 / blockscaled_sm100" in proc.stdout


FAULTS = {"bf16_discrete": "sleep", "mxfp8": "abort", "quantize_nvfp4": "exit",
          "bf16_accumulate": "wrong", "quantize_mxfp8": "wrong"}
TIMEOUT = 10


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    """One parent run: two healthy cases beside a hang, an abort, an exit and two wrong
    references, all at once."""
    out = tmp_path_factory.mktemp("selftest") / "results.json"
    names = ["bf16_dense", "quantize_block_1x128", *FAULTS]
    inject = ",".join(f"{k}={v}" for k, v in FAULTS.items())
    proc = _selftest(["--only", ",".join(names), "--timeout", str(TIMEOUT), "--jobs",
                      str(len(names)), "--json", str(out), "--seed", "5"],
                     timeout=TIMEOUT + 120, **{st.INJECT_ENV: inject})
    return proc, {r["case"]: r for r in json.loads(out.read_text())["results"]}


def _row(proc, name):
    return next(line for line in proc.stdout.splitlines() if line.startswith(name + " "))


def test_a_hang_is_reported_as_a_timeout_and_killed(faulty_run):
    proc, records = faulty_run
    r = records["bf16_discrete"]
    assert r["status"] == "timeout" and TIMEOUT <= r["seconds"] < TIMEOUT + 30, r
    assert f"no result after {TIMEOUT} s" in r["detail"]
    assert " timeout " in _row(proc, "bf16_discrete")
    with pytest.raises(ProcessLookupError):  # killed, and reaped by the parent
        os.kill(r["pid"], 0)


def test_a_dying_case_is_reported_as_crashed(faulty_run):
    proc, records = faulty_run
    assert records["mxfp8"]["status"] == "crashed"
    assert "crashed (signal SIGABRT)" in _row(proc, "mxfp8")
    assert records["quantize_nvfp4"]["status"] == "crashed"
    assert records["quantize_nvfp4"]["exit_code"] == 3
    assert "crashed (exit code 3)" in _row(proc, "quantize_nvfp4")


def test_a_wrong_result_is_a_failure(faulty_run):
    proc, records = faulty_run
    r = records["bf16_accumulate"]
    assert r["status"] == "fail" and r["detail"].startswith("relative error ")
    assert r["rel_error"] > r["tolerance"]
    assert " FAIL " in _row(proc, "bf16_accumulate")
    r = records["quantize_mxfp8"]
    assert r["status"] == "fail" and r["detail"].startswith("data: 1 of "), r


def test_the_other_cases_still_run_and_the_run_fails(faulty_run):
    proc, records = faulty_run
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for name in ("bf16_dense", "quantize_block_1x128"):
        assert records[name]["status"] == "pass", records[name]
    assert proc.stdout.rstrip().endswith("selftest: FAIL")
    summary = next(line for line in proc.stdout.splitlines() if line.startswith("total "))
    for part in ("7 cases", "2 pass", "1 timeout", "2 crashed", "2 fail"):
        assert part in summary, summary


class _FakeGpuArrays(st.TorchArrays):
    """torch CPU tensors standing in for a GPU's: the device branch of a case, which compares
    with the reference backend on NumPy arrays."""

    def __init__(self, device):
        super().__init__(None)
        self.is_cuda = True

    def sync(self):
        pass


@pytest.fixture
def fake_gpu(monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setattr(st, "device_arrays", _FakeGpuArrays)
    arch = {"value": "sm_90a"}
    monkeypatch.setattr(gwgrad.backends, "detect_arch", lambda device: arch["value"])
    real = gwgrad.api.grouped_gemm_wgrad

    def wrapper(**kw):  # FP4 on the stand-in "GPU": what Fp8Sm90Backend raises
        a = kw["a_tensor"]
        if hasattr(a, "data_ptr") and str(a.dtype) == "torch.float4_e2m1fn_x2":
            raise UnsupportedError("a_tensor", "float4_e2m1fn_x2 (NVFP4/MXFP4) needs an SM100 "
                                   "GPU (sm_100a/sm_103a); this is sm_90a", arch="sm_90a",
                                   needs=("sm_100a", "sm_103a"))
        return real(**kw)

    monkeypatch.setattr(gwgrad.api, "grouped_gemm_wgrad", wrapper)  # what selftest calls
    return arch


def test_device_branch_compares_with_the_reference_and_reports_needs(fake_gpu, seed):
    for name in ("bf16_discrete", "mxfp8", "quantize_nvfp4"):
        r = st.run_case(name, "gpu", 0, seed)
        assert r["status"] == "pass", r
        assert "the reference" in r["detail"] and r["arch"] == "sm_90a"
    r = st.run_case("bf16_dense", "gpu", 0, seed)
    assert r["family"] == "bf16_sm90" and r["arrays"].startswith("torch")
    r = st.run_case("nvfp4", "gpu", 0, seed)
    assert r["status"] == "needs" and r["detail"].startswith("needs SM100: NotImplementedError")
    assert r["family"] == "blockscaled_sm100"
    record = dict(r, seconds=1.0)
    assert st.result_text(record) == "needs SM100"
    assert st.verdict([record, dict(record, status="pass")]) == 0  # not a failure
    assert st.verdict([record, dict(record, status="timeout")]) == 1
    # A case run on an architecture its table says cannot run it is a failure, not a pass.
    fake_gpu["value"] = "sm_100a"
    r = st.run_case("fp8_per_expert_channel", "gpu", 0, seed)
    assert r["status"] == "fail" and "expected NotImplementedError on sm_100a" in r["detail"]


@pytest.mark.parametrize("case", st.CASES, ids=lambda c: c.name)
def test_torch_arrays_round_trip_every_dtype(case, seed):
    """The torch conversions the GPU run uses (FP8, E8M0, packed FP4, BF16 views), on CPU
    tensors through the reference backend against the direct loop."""
    pytest.importorskip("torch")
    runner = st.run_quant if case.kind == "quantize" else st.run_gemm
    outcome = runner(case, st.TorchArrays(None), "cpu", np.random.default_rng(seed), False)
    assert outcome.status == "pass", outcome.detail


def test_runs_from_an_installed_wheel_with_only_numpy(tmp_path):
    from test_packaging import _build, _copy_project, _numpy_only_dir, _run_isolated

    wheel = _build(_copy_project(tmp_path), "build_wheel", tmp_path / "dist")
    assert "gwgrad/selftest.py" in zipfile.ZipFile(wheel).namelist()
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    out = tmp_path / "results.json"
    code = (
        "import os, runpy\n"
        "os.environ['CUDA_VISIBLE_DEVICES'] = ''\n"
        f"sys.argv = ['gwgrad', 'selftest', '--only', 'bf16_dense,nvfp4,quantize_nvfp4', "
        f"'--json', {str(out)!r}]\n"
        "try:\n"
        "    runpy.run_module('gwgrad', run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "assert 'torch' not in sys.modules and 'benchmarks' not in sys.modules\n")
    text = _run_isolated(code, [_numpy_only_dir(tmp_path), site], cwd=tmp_path)
    assert "selftest: PASS" in text
    for r in json.loads(out.read_text())["results"]:
        assert r["status"] == "pass", r
        assert r["gwgrad"] == str(site / "gwgrad")  # the children ran the wheel's gwgrad too


# --- the GPU path's calls on every architecture, without a GPU ------------------------------

class _Descriptors:
    """Made-up CUDA descriptors (tests/cudnn_cases.py): the wrapper's CUDA path up to the
    (stand-in) launch; outputs read back as zeros."""

    is_cuda = True
    name = "descriptors"

    def put(self, t):
        from cudnn_cases import cuda

        return cuda(t.shape, t.strides, t.dtype)

    def address(self, arg):
        return arg.ptr

    def read(self, arg):
        from gwgrad.hostview import RAW_NUMPY

        return np.zeros(arg.shape, RAW_NUMPY[arg.dtype])

    def sync(self):
        pass


GEMM_CELLS = [(c, arch) for c in st.CASES if c.kind != "quantize" for arch in st.ALL_ARCHS]


def _check_cell(case, arch, launches, seed, monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    monkeypatch.setattr(gwgrad.cuda, "device_synchronize", lambda device: None)  # check_errors
    gwgrad.clear_cache()
    g = case.what
    problem = st.build_gemm(g, np.random.default_rng(seed))
    if arch in case.archs:
        st.call_gemm(_Descriptors(), problem, g)  # no UnsupportedError, no ArgumentError
        assert len(launches.calls) == 1
    else:
        with pytest.raises(NotImplementedError) as info:
            st.call_gemm(_Descriptors(), problem, g)
        assert set(info.value.needs) & set(case.archs), info.value
        assert launches.calls == []


@pytest.mark.parametrize("case,arch", GEMM_CELLS, ids=lambda v: getattr(v, "name", v))
def test_case_architectures_are_the_backends(case, arch, stand_in, seed,  # noqa: F811
                                             monkeypatch):
    """Each GEMM case's architectures are the ones whose backend takes its call (the wrapper's
    CUDA path with stand-in kernels): a listed architecture launches, another raises
    NotImplementedError naming one that runs it (what "needs SMxx" reports)."""
    _check_cell(case, arch, stand_in, seed, monkeypatch)


@pytest.fixture
def compiling_stand_in(monkeypatch):
    """``stand_in`` (tests/cudnn_cases.py) with the kernels compiled for real, which needs no
    GPU; only the launch is a recorder."""
    import contextlib
    import ctypes

    from cudnn_cases import Launches, _record
    from gwgrad.backends import CuteDslBackend

    launches = Launches()
    monkeypatch.setattr(CuteDslBackend, "launcher",
                        lambda self, compiled, spec, device: (
                            lambda *values: launches.calls.append(values)))
    ctypes.memset(_record, 0, ctypes.sizeof(_record))
    monkeypatch.setattr(gwgrad.status, "_address", ctypes.addressof(_record))
    monkeypatch.setattr(gwgrad.status, "_code",
                        ctypes.c_int32.from_address(ctypes.addressof(_record)))
    monkeypatch.setattr(gwgrad.interop, "workspace", lambda device, stream, nbytes: 0xABC000)
    monkeypatch.setattr(gwgrad.cuda, "stream_is_capturing", lambda stream: False)
    monkeypatch.setattr(gwgrad.cuda, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(gwgrad.cuda, "memset_async", lambda ptr, nbytes, stream: None)
    gwgrad.clear_cache()
    yield launches
    gwgrad.clear_cache()


@pytest.mark.compile
@pytest.mark.parametrize("case,arch", [(c, a) for c, a in GEMM_CELLS if a in c.archs],
                         ids=lambda v: getattr(v, "name", v))
def test_case_kernels_compile(case, arch, compiling_stand_in, seed, monkeypatch):
    """The kernel each supported case launches on the GPU compiles for its architecture."""
    pytest.importorskip("cutlass")
    _check_cell(case, arch, compiling_stand_in, seed, monkeypatch)


@pytest.mark.compile
@pytest.mark.parametrize("case,arch", [(c, a) for c in st.CASES if c.kind == "quantize"
                                       for a in ("sm_90a", "sm_100a")],
                         ids=lambda v: getattr(v, "name", v))
def test_case_quantizers_compile(case, arch):
    pytest.importorskip("cutlass")
    from gwgrad import quantizers as Q

    q = case.what
    elem = Q._elem(q.fmt, q.elem)
    Q.compile_quantizer(Q.kernel_config(q.fmt, elem, st.QUANT_CHANNELS, st.EXPERTS), arch)
