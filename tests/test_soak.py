"""tools/soak.py: its command line, and its pure parts on the CPU (specs and expected kernel
counts, random offsets and schedules, the FP64 references -- checked against gwgrad's
reference backend --, the result checks catching wrong results, memory and kernel checks, the
summary); one call of every spec through gwgrad's CPU reference, verified; a short run of the
whole call mix on the CPU (``--device cpu``). Marked ``gpu``: a short soak on the GPU
(``--calls 300 --replays 50``: ~1 min with the kernels compiled cold).

    python -m pytest -q tests/test_soak.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gwgrad.adapters.torch as gwt  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "soak.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("gwgrad_soak_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module


def run_script(*args, timeout=120):
    env = dict(os.environ)
    root = str(SCRIPT.parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_help():
    out = run_script("--help", timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--calls", "--threads", "--replays", "--verify-every", "--json", "--fp8",
                 "--device", "--alloc-tol-mib", "--driver-tol-mib"):
        assert flag in out.stdout


def test_arguments(soak):
    args = soak.parse_args([])
    assert (args.calls, args.threads, args.replays, args.device) == (10_000, 4, 1000, "cuda")
    with pytest.raises(SystemExit):
        soak.parse_args(["--threads", "0"])


def test_specs_and_expected_kernels(soak):
    bf16 = soak.default_specs(fp8=False)
    both = soak.default_specs(fp8=True)
    assert len({s.name for s in both}) == len(both) == len(bf16) + 2
    assert {s.api for s in bf16} == {"adapter", "wrapper"}
    assert {s.out for s in bf16} == {"alloc", "dense", "discrete", "fresh_discrete"}
    assert any(s.accumulate and s.out_dtype == "float32" for s in bf16)
    for s in both:
        assert s.hidden % 8 == 0 and s.inter % 8 == 0
        assert all(t % s.multiple == 0 for t in s.tokens)
    # one kernel per BF16 spec; FP8: a GEMM each plus the quantizers of x and dy
    assert soak.expected_kernels(bf16) == {"total": 7, "gemm": 7, "quantize": 0}
    assert soak.expected_kernels(both) == {"total": 13, "gemm": 9, "quantize": 4}
    # the captured calls reuse kernels the mixed calls load
    keys = set().union(*(soak.kernel_keys(s) for s in bf16))
    for g in soak.graph_specs(bf16):
        assert soak.kernel_keys(g) <= keys
    assert soak.expected_kernels(both + list(soak.graph_specs(both)))["total"] == 13


def test_random_counts(soak):
    rng = np.random.default_rng(0)
    empty = one_expert = 0
    for _ in range(2000):
        experts = int(rng.integers(1, 17))
        multiple = int(rng.choice([1, 16]))
        tokens = multiple * int(rng.integers(1, 200))
        counts = soak.random_counts(rng, experts, tokens, multiple)
        assert counts.shape == (experts,) and counts.sum() == tokens
        assert (counts >= 0).all() and (counts % multiple == 0).all()
        empty += int((counts == 0).any())
        one_expert += int((counts == tokens).any() and experts > 1)
    assert empty > 800 and one_expert > 30
    offsets = soak.offsets_of([3, 0, 5])
    assert offsets.dtype == np.int32 and offsets.tolist() == [3, 3, 8]
    t = soak.device_offsets([3, 0, 5], torch.device("cpu"))
    assert t.dtype == torch.int32 and t.tolist() == [3, 3, 8]
    with pytest.raises(ValueError):
        soak.random_counts(rng, 4, 30, 16)


def test_schedule(soak):
    specs = soak.default_specs(fp8=True)
    plan = soak.make_schedule(1000, specs, 4, seed=1, verify_every=20)
    assert [len(p) for p in plan] == [250] * 4
    calls = sorted(c for p in plan for c in p)
    assert [c[0] for c in calls] == list(range(1000))
    assert all(c[2] in specs[c[1]].tokens for c in calls)
    assert {c[1] for c in calls} == set(range(len(specs)))  # every spec is drawn
    assert [sum(c[3] for c in p) for p in plan] == [13] * 4  # calls 0, 20, ..., 240 of each
    assert soak.make_schedule(1000, specs, 4, seed=1, verify_every=20) == plan
    assert soak.make_schedule(1000, specs, 4, seed=2, verify_every=20) != plan
    assert not any(c[3] for p in soak.make_schedule(50, specs, 2, 0, 0) for c in p)


def test_reference_matches_gwgrad(soak):
    counts = [30, 0, 50, 20]
    x = torch.randn(100, 32).bfloat16()
    dy = torch.randn(100, 48).bfloat16()
    offsets = torch.tensor(soak.offsets_of(counts))
    ref = soak.reference_wgrad(x, dy, counts)
    assert ref.dtype == torch.float64 and ref.shape == (4, 32, 48)
    assert not ref[1].any()
    got = gwt.wgrad(x, dy, offsets, out_dtype=torch.float32)
    assert soak.rel_error(got, ref) < 1e-6


@pytest.mark.parametrize("recipe", ["per_expert_channel", "block_1x128"])
def test_dequantize_matches_gwgrad_fp8(soak, recipe):
    counts = [160, 0, 32, 320, 16]  # more than one 128-token block per expert, an empty one
    tokens = sum(counts)
    offsets = torch.tensor(soak.offsets_of(counts))
    x = (torch.randn(tokens, 64) * 3).bfloat16()
    dy = torch.randn(tokens, 80).bfloat16()
    xq, sx, _ = gwt.quantize(x, offsets, recipe)
    dyq, sdy, _ = gwt.quantize(dy, offsets, recipe)
    deq_x = soak.dequantize(xq, sx, counts, recipe)
    assert deq_x.shape == (64, tokens) and deq_x.dtype == torch.float64
    assert soak.rel_error(deq_x.T, x.double()) < 0.06  # E4M3: 3 mantissa bits
    got = gwt.wgrad_fp8(xq.t(), dyq.t(), offsets, sx, sdy, scale_recipe=recipe,
                        out_dtype=torch.float32)
    ref = soak.reference_wgrad(deq_x.T, soak.dequantize(dyq, sdy, counts, recipe).T, counts)
    assert soak.rel_error(got, ref) < 1e-6
    with pytest.raises(ValueError, match="recipe"):
        soak.dequantize(xq, sx, counts, "mxfp8")


def test_check_result_catches_wrong_results(soak):
    counts = [10, 0, 20]
    ref = torch.randn(3, 8, 16, dtype=torch.float64)
    ref[1] = 0
    got = ref.float()
    assert soak.check_result(got, ref, counts, "float32")[1] == []
    bad = got.clone()
    bad[2, 3, 4] += 1.0
    err, problems = soak.check_result(bad, ref, counts, "float32")
    assert err > 1e-5 and "relative error" in problems[0]
    bad = got.clone()
    bad[1, 0, 0] = 1e-30  # an empty expert written
    assert any("empty expert 1 not zero" in p for p in soak.check_result(bad, ref, counts,
                                                                          "float32")[1])
    bad = got.clone()
    bad[0, 0, 0] = float("nan")
    assert soak.check_result(bad, ref, counts, "float32")[1]
    assert soak.check_result(got.bfloat16(), ref, counts, "bfloat16")[1] == []
    assert soak.check_result(got[:2], ref, counts, "float32")[1]  # shape
    # accumulation: got = before + ref, empty experts unchanged
    before = torch.randn(3, 8, 16)
    acc = (before.double() + ref).float()
    acc[1] = before[1]
    assert soak.check_result(acc, ref, counts, "float32", before)[1] == []
    acc[1, 0, 0] += 1
    assert any("changed by accumulate" in p
               for p in soak.check_result(acc, ref, counts, "float32", before)[1])


@pytest.mark.parametrize("fp8", [False, True])
def test_every_spec_runs_and_verifies_on_the_cpu(soak, fp8):
    device = torch.device("cpu")
    rng = np.random.default_rng(3)
    for spec in soak.default_specs(fp8)[(7 if fp8 else 0):]:
        bufs = soak.Buffers(spec, device, None)
        for tokens in spec.tokens[-1:]:
            counts = soak.random_counts(rng, spec.experts, tokens, spec.multiple)
            counts[-1] += counts[0]  # expert 0 empty
            counts[0] = 0
            result = soak.run_call(spec, bufs, tokens, counts, device, verify=True)
            assert result["problems"] == [], (spec.name, result)
            assert soak.run_call(spec, bufs, tokens, counts, device, verify=False) is None


def test_memory_and_kernel_checks(soak):
    a = {"allocated": 1000, "reserved": 4 << 20, "driver_free": 100 << 20, "driver_total": 1 << 30}
    same, problems = soak.memory_growth(a, dict(a), 1.0, 32.0)
    assert problems == [] and same == {"allocated": 0, "reserved": 0, "driver_used": 0,
                                       "outside_torch": 0}
    b = dict(a, allocated=1000 + (2 << 20), reserved=6 << 20, driver_free=60 << 20)
    growth, problems = soak.memory_growth(a, b, 1.0, 32.0)
    assert growth["driver_used"] == 40 << 20 and growth["outside_torch"] == 38 << 20
    assert len(problems) == 2
    expected = {"total": 3, "gemm": 2, "quantize": 1}
    total = {"compiles": 2, "disk_hits": 1, "rebuilds": 0, "loaded": 3, "dsl_compile_count": 2,
             "operators_constructed": 3}  # two GEMMs and a quantizer
    none = dict.fromkeys(total, 0)
    assert soak.kernel_problems(total, none, expected) == []
    assert soak.kernel_problems(dict(total, loaded=4, compiles=3, dsl_compile_count=3), none,
                                expected)
    assert soak.kernel_problems(total, dict(none, loaded=1), expected)
    assert soak.kernel_problems(dict(total, operators_constructed=4), none, expected)
    assert soak.kernel_problems(dict(total, operators_constructed=2), none, expected)
    counters = soak.kernel_counters()
    assert counters["loaded"] == counters["compiles"] + counters["disk_hits"]
    assert soak.counter_delta(counters, counters) == dict.fromkeys(counters, 0)
    assert set(soak.plan_cache_sizes()) == {"adapter_plans", "core_plans", "wrapper_call_plans",
                                            "pointer_arrays"}


def test_short_cpu_run_writes_json(soak, tmp_path):
    path = tmp_path / "soak.json"
    code = soak.main(["--device", "cpu", "--calls", "40", "--threads", "2", "--verify-every",
                      "3", "--fp8", "on", "--json", str(path)])
    report = json.loads(path.read_text())
    assert code == 0 and report["ok"], report["failures"]
    assert report["calls"]["total"] == 40 and sum(report["calls"]["per_thread"]) == 40 + \
        report["calls"]["warmup"]
    assert report["calls"]["warmup"] == 2 * sum(len(s["tokens"]) for s in report["specs"])
    assert sum(report["verification"]["per_spec"].values()) == 14  # 7 per thread
    assert report["check_errors"] == "clean"
    assert report["plans"]["after_warmup"] == report["plans"]["end"]
    assert report["memory"] == "skipped (CPU)"


def test_summary_reports_failures(soak):
    report = {"device": "cpu", "config": {"threads": 1}, "specs": [{}],
              "calls": {"total": 1, "warmup": 0, "per_spec": {"s": 1}},
              "verification": {"per_spec": {"s": 1}, "max_err": {"s": 0.5},
                               "max_err_vs_bf16": {}},
              "timings": {"mixed_s": 0.1}, "failures": ["boom"], "ok": False}
    lines = soak.summary_lines(report)
    assert "FAIL: boom" in lines and lines[-1] == "RESULT: FAIL"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability()[0] < 9, reason="needs an SM90+ GPU")
def test_short_soak_on_the_gpu(tmp_path):
    path = tmp_path / "soak.json"
    out = run_script("--calls", "300", "--replays", "50", "--json", str(path), timeout=900)
    assert path.exists(), out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(path.read_text())
    assert out.returncode == 0 and report["ok"], report["failures"]
    assert report["calls"]["total"] == 300
    kernels = report["kernels"]
    assert kernels["total"]["loaded"] == kernels["expected"]["total"]
    assert kernels["after_warmup"]["loaded"] == 0
    graphs = report["graphs"]
    assert graphs["replays"] == 50
    assert graphs["bit_equal"] == {"bf16": 50, "f32_acc": 50}
    assert report["memory"]["growth"]["allocated"] <= 1 << 20
    assert report["check_errors"] == "clean"


def test_a_wrong_result_fails_the_run(soak, tmp_path, monkeypatch):
    reference = soak.reference_wgrad
    monkeypatch.setattr(soak, "reference_wgrad", lambda x, dy, counts: 1.1 * reference(x, dy,
                                                                                        counts))
    path = tmp_path / "soak.json"
    code = soak.main(["--device", "cpu", "--calls", "4", "--threads", "1", "--fp8", "off",
                      "--json", str(path)])
    report = json.loads(path.read_text())
    assert code == 1 and not report["ok"]
    assert "relative error" in report["failures"][0]
    assert report["calls"]["total"] == 0  # the warm-up failed: no mixed calls
