"""tools/energy_bench.py: nvidia-smi's samples parsed, a window's power, clock and per-call
figures (CPU; the windows themselves run on the GPU)."""

import importlib.util
from datetime import datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("timestamp", "total_energy_consumption", "power.draw.instant", "clocks.sm")


def load(name="energy_bench"):
    """tools/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def epoch(text):
    return datetime.strptime(text, "%Y/%m/%d %H:%M:%S.%f").timestamp()


LOG = """2026/12/02 18:00:00.000, 1000000, 650.00, 1500
2026/12/02 18:00:00.500, 1350000, 700.00, 1400
garbage line
2026/12/02 18:00:01.000, 1700000, [N/A], 1600
2026/12/02 18:00:02.000, 2400000, 690.00, 1450
"""


def test_parse_samples_units_and_bad_fields():
    eb = load()
    samples = eb.parse_samples(LOG, FIELDS)
    assert len(samples) == 4  # the garbage line is dropped
    assert samples[0] == {"t": epoch("2026/12/02 18:00:00.000"), "energy_j": 1000.0,
                          "power_w": 650.0, "mhz": 1500.0}
    assert "power_w" not in samples[2] and samples[2]["energy_j"] == 1700.0  # [N/A] left out


def test_window_power_from_the_energy_counter_else_the_samples():
    eb = load()
    samples = eb.parse_samples(LOG, FIELDS)
    t0 = epoch("2026/12/02 18:00:00.000")
    # 0.0 .. 1.0 s: 700 J over 1 s; the clock's mean over the three samples.
    stats = eb.window_stats(samples, t0, t0 + 1.0)
    assert stats["W"] == pytest.approx(700.0) and stats["power_from"] == "energy counter"
    assert stats["MHz"] == pytest.approx(1500.0) and stats["samples"] == 3
    # Without the counter: the power samples' mean (the [N/A] one is not a zero).
    no_energy = [{k: v for k, v in s.items() if k != "energy_j"} for s in samples]
    stats = eb.window_stats(no_energy, t0, t0 + 1.0)
    assert stats["W"] == pytest.approx(675.0) and stats["power_from"] == "power samples"
    # No sample inside: nothing derived, no division by zero.
    empty = eb.window_stats(samples, t0 + 5, t0 + 6)
    assert empty == {"samples": 0, "W": None, "MHz": None, "power_from": None}
    assert eb.derive(2.0, empty, 1e12)["J"] is None


def test_derive_per_call_figures():
    eb = load()
    row = eb.derive(4.0, {"W": 700.0, "MHz": 1500.0}, 2e12)
    assert row["J"] == pytest.approx(2.8) and row["Mcyc"] == pytest.approx(6.0)
    assert row["pJ_per_flop"] == pytest.approx(1.4)
    med = eb.medians([row, eb.derive(6.0, {"W": None, "MHz": 1000.0}, 2e12)])
    assert med["ms"] == pytest.approx(5.0) and med["J"] == pytest.approx(2.8)
    assert med["Mcyc"] == pytest.approx(6.0)


def test_mixed_calls_the_method_then_the_other():
    eb = load()
    calls = []
    step = eb.mixed(lambda: calls.append("gwgrad"), lambda: calls.append("dense"))
    step()
    step()
    assert calls == ["gwgrad", "dense", "gwgrad", "dense"]


def test_command_line_modes_and_the_settle_check():
    """--mix and --accumulate (the main-grad path, FP32 outputs) parse without a GPU; a
    settle window as long as the window is rejected."""
    eb = load()
    args = eb.parse_args(["--mix", "--accumulate", "--rows", "dsv3-fc1", "--reps", "3"])
    assert args.mix and args.accumulate and args.reps == 3 and args.rows == "dsv3-fc1"
    plain = eb.parse_args([])
    assert not plain.mix and not plain.accumulate and plain.settle < plain.window
    with pytest.raises(SystemExit):
        eb.parse_args(["--window", "1.0", "--settle", "1.0"])
