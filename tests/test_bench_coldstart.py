"""benchmarks.coldstart without a GPU: the child script's construction, its environment, the
parsing of its result, the summary against the target, and the whole measurement run end to
end on the CPU (``--device cpu``: the reference backend; real child processes)."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import coldstart as cs


def test_child_script_is_valid_python_with_the_problem():
    src = cs.child_script({"hidden": 64, "tokens_sum": 512}, device="cpu")
    compile(src, "<coldstart child>", "exec")
    head = src.splitlines()[:4]
    assert "DEVICE = 'cpu'" in head
    assert "HIDDEN, INTERMEDIATE, EXPERTS, TOKENS = 64, 256, 8, 512" in head
    # torch comes first, untimed; the timer starts before gwgrad's imports, stops after a sync
    body = src[src.index("import torch"):]
    assert body.index("t0 = time.perf_counter()") < body.index("import gwgrad\n")
    assert body.index("import gwgrad.adapters.torch") < body.index("w = gwt.wgrad(")
    assert body.index("w = gwt.wgrad(") < body.index("sync()\nt2")
    assert '"cutlass" in sys.modules' in src
    with pytest.raises(ValueError, match="hidden"):
        cs.child_script({"hidden": 0})
    with pytest.raises(ValueError, match="device"):
        cs.child_script(device="tpu")


def test_child_env_points_the_caches_and_the_import_path(tmp_path):
    env = cs.child_env(str(tmp_path / "g"), str(tmp_path / "d"), base={"PYTHONPATH": "/x"})
    assert env["GWGRAD_CACHE_DIR"] == str(tmp_path / "g")
    assert env["CUTE_DSL_CACHE_DIR"] == str(tmp_path / "d")
    root = env["PYTHONPATH"].split(os.pathsep)[0]
    assert os.path.isfile(os.path.join(root, "gwgrad", "__init__.py"))
    assert env["PYTHONPATH"].endswith(os.pathsep + "/x")
    assert "CUTE_DSL_CACHE_DIR" not in cs.child_env("/c", None, base={})


def test_parse_child_output_takes_the_marked_line():
    out = "noise\n" + cs.MARKER + json.dumps({"total_s": 1.5}) + "\nmore noise\n"
    assert cs.parse_child_output(out) == {"total_s": 1.5}
    assert cs.parse_child_output("Traceback ...") is None


def test_summary_against_the_target():
    cold = {"total_s": 9.0, "rel_err": 0.002}
    warm = [{"total_s": 0.3, "cutlass_imported": False, "rel_err": 0.002},
            {"total_s": 0.4, "cutlass_imported": False, "rel_err": 0.002}]
    s = cs.summarize(cold, warm)
    assert s["cold_s"] == 9.0 and s["warm_s"] == pytest.approx(0.35)
    assert s["warm_target_met"] and s["results_ok"] and s["cutlass_imported_warm"] is False
    s = cs.summarize(cold, [{"total_s": 2.5, "cutlass_imported": True, "rel_err": 0.002},
                            {"error": "timed out after 90 s"}])
    assert not s["warm_target_met"] and s["cutlass_imported_warm"] is None
    assert s["errors"] == ["timed out after 90 s"] and s["warm_s"] == 2.5
    text = cs.format_report({"cold": cold, "warm": [{"error": "boom", "stderr_tail": "Trace"}],
                             "summary": cs.summarize(cold, [{"error": "boom"}])})
    assert "ERROR boom" in text and "NOT met" in text and "Trace" in text


def test_a_child_that_fails_is_reported(tmp_path):
    r = cs.run_child("import sys; print('x'); sys.exit(3)", dict(os.environ), timeout=60)
    assert r["returncode"] == 3 and "no result" in r["error"]
    r = cs.run_child("import time; time.sleep(30)", dict(os.environ), timeout=1)
    assert "timed out" in r["error"]


def test_the_measurement_end_to_end_on_the_cpu(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "cold.json"
    rc = cs.main(["--device", "cpu", "--warm-runs", "1", "--hidden", "32", "--intermediate",
                  "48", "--experts", "4", "--tokens", "256", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["problem"] == {"hidden": 32, "intermediate": 48, "num_experts": 4,
                                 "tokens_sum": 256}
    assert len(report["warm"]) == 1
    for run in (report["cold"], report["warm"][0]):
        assert "error" not in run, run
        assert run["total_s"] == pytest.approx(run["import_s"] + run["first_call_s"])
        assert run["cache_dir_env"].startswith(report["cache_dir"])
        assert run["rel_err"] < 1e-2
    assert report["summary"]["results_ok"]
    assert not os.path.exists(report["cache_dir"])  # the temporary cache is removed


def test_without_a_gpu_the_cuda_run_exits_cleanly(monkeypatch, tmp_path):
    from gwgrad import cuda

    monkeypatch.setattr(cuda, "available", lambda: False)
    assert cs.main(["--json", str(tmp_path / "x.json")]) == 2
