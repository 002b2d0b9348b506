"""tools/profile_gemm.py --summarize: the per-kernel table of an ncu CSV report (CPU)."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")  # the script's profile target imports it

ROOT = Path(__file__).resolve().parents[1]


def load():
    spec = importlib.util.spec_from_file_location("profile_gemm", ROOT / "tools" /
                                                  "profile_gemm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value"\n')


def row(kid, name, metric, unit, value):
    return (f'"{kid}","1","python","h","{name}","1","7","(384,1,1)","(132,1,1)","0","9.0",'
            f'"GPU Speed Of Light Throughput","{metric}","{unit}","{value}"\n')


def test_units_and_columns(tmp_path):
    csv = tmp_path / "ncu.csv"
    csv.write_text("==PROF== Connected to process 1\n" + HEADER
                   + row(0, "prep", "Duration", "ns", "2,624")
                   + row(1, "gemm", "Duration", "ms", "1.5")
                   + row(1, "gemm", "Memory Throughput", "Gbyte/s", "2,000")  # not a percent
                   + row(1, "gemm", "Memory Throughput", "%", "86.4")
                   + row(1, "gemm", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained"
                                    "_active", "%", "91.5"))
    lines = load().summarize(str(csv)).splitlines()
    assert lines[0].split() == ["id", "kernel", "us", "sm%", "mem%", "l1%", "l2%", "dram%",
                                "tensor%", "ghz", "Mcyc"]
    assert lines[1].split() == ["0", "prep", "2.6", "-", "-", "-", "-", "-", "-", "-", "-"]
    assert lines[2].split() == ["1", "gemm", "1500.0", "-", "86.4", "-", "-", "-", "91.5", "-",
                                "-"]


def test_clock_and_cycles(tmp_path):
    """The SM clock in GHz whatever unit ncu gives it in, and the duration in Mcycles."""
    csv = tmp_path / "ncu.csv"
    csv.write_text(HEADER + row(0, "gemm", "Duration", "ms", "5")
                   + row(0, "gemm", "SM Frequency", "hz", "1,500,000,000")
                   + row(1, "cublas", "Duration", "us", "4,000")
                   + row(1, "cublas", "SM Frequency", "cycle/nsecond", "1.75")
                   + row(2, "odd", "Duration", "us", "10")
                   + row(2, "odd", "SM Frequency", "furlong", "3"))
    lines = load().summarize(str(csv)).splitlines()
    assert lines[1].split()[-2:] == ["1.500", "7.500"]
    assert lines[2].split()[-2:] == ["1.750", "7.000"]
    assert lines[3].split()[-2:] == ["nan", "nan"]  # an unknown unit is no figure


def test_a_stored_report():
    lines = load().summarize(str(ROOT / "tests/data/ncu_report_h200.csv")).splitlines()
    assert len(lines) == 7  # header + prep, GEMM, cuBLAS for two rows
    gemm = lines[2].split()
    assert "Sm90Grou" in gemm[1] and float(gemm[2]) == pytest.approx(1145.0, abs=0.1)


def test_empty_report(tmp_path):
    (tmp_path / "none.csv").write_text("==PROF== nothing profiled\n")
    assert "no CSV rows" in load().summarize(str(tmp_path / "none.csv"))


def test_warp_stall_reasons(tmp_path):
    """With the per-reason stall metrics in the report (GWGRAD_NCU_STALLS=1), the summary
    lists each kernel's largest reasons, largest first; kernels without them get no line."""
    mod = load()
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    values = {"long_scoreboard": "3.25", "barrier": "1.5", "wait": "0.75", "math_pipe_throttle":
              "2.0", "selected": "1", "sleeping": "0.01", "not_selected": "0.5"}
    text = HEADER + row(0, "prep", "Duration", "ns", "2,624") + row(1, "gemm", "Duration", "us",
                                                                     "400")
    text += "".join(row(1, "gemm", stall.format(k), "", v) for k, v in values.items())
    (tmp_path / "ncu.csv").write_text(text)
    lines = mod.summarize(str(tmp_path / "ncu.csv")).splitlines()
    assert lines[2].split()[:3] == ["1", "gemm", "400.0"]  # the stall rows are no column
    assert lines[3].startswith("warp stalls") and len(lines) == 5
    assert lines[4].split() == ["1", "gemm", "long_scoreboard", "3.25", "math_pipe_throttle",
                                "2.00", "barrier", "1.50", "selected", "1.00", "wait", "0.75"]
    assert mod.stall_reason(stall.format("barrier")) == "barrier"
    assert mod.stall_reason("smsp__warps_issue_stalled_barrier") is None


def test_variant_methods_on_the_reference_backend():
    """--tiles: each variant is the bench's KernelRunner with that tiling and tuning, named as
    the bench names it; on CPU tensors it runs the reference backend and must give the
    per-expert product."""
    import torch

    from benchmarks.wgrad import RowInputs

    shape = {"name": "tiny", "hidden": 24, "intermediate": 40, "num_experts": 3,
             "tokens_sum": 48}
    inp = RowInputs(shape, "zipf", 8, device="cpu")
    out = inp.outs["gwgrad"]
    methods = load().variant_methods(
        inp, "128x128:cluster=1x2:unit_schedule=3, 64x128,", out, False)
    assert list(methods) == ["gwgrad_128x128:cluster=1x2:unit_schedule=3", "gwgrad_64x128"]
    for fn in methods.values():
        out.fill_(float("nan"))
        fn()
        start = 0
        for e, count in enumerate(inp.counts):
            want = inp.x[start:start + count].double().t() @ inp.dy[start:start + count].double()
            torch.testing.assert_close(out[e].double(), want, rtol=2e-2, atol=2e-2)
            start += count
    with pytest.raises(ValueError, match="unknown tuning field"):
        load().variant_methods(inp, "128x128:bogus=1", out, False)
