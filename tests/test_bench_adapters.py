"""benchmarks.adapters' GPU-independent parts: step guards and (nested) deadlines, the
wall-clock timers, the tables, the host-overhead section run end to end on CPU tensors (the
reference backend: its figures are not overheads, the wiring is what is checked), the
ragged_dot_general competitor's formulation (on the CPU), and a clean exit without a GPU."""

from __future__ import annotations

import time

import numpy as np
import pytest

from benchmarks import adapters as ba


def test_guarded_records_errors_and_deadlines():
    results = {"errors": []}
    assert ba.guarded(results, "ok", 5, lambda: 42) == 42

    def boom():
        raise RuntimeError("no kernel")

    assert ba.guarded(results, "boom", 5, boom) is None
    assert ba.guarded(results, "slow", 1, lambda: time.sleep(5)) is None
    assert [e["step"] for e in results["errors"]] == ["boom", "slow"]
    assert "StepTimeout" in results["errors"][1]["error"]


def test_nested_deadlines_keep_the_outer_one():
    results = {"errors": []}

    def inner_steps():
        assert ba.guarded(results, "quick", 30, lambda: 1) == 1  # re-arms the outer deadline
        time.sleep(5)  # the outer deadline (1 s) still fires

    start = time.monotonic()
    assert ba.guarded(results, "outer", 1, inner_steps) is None
    assert time.monotonic() - start < 4
    assert [e["step"] for e in results["errors"]] == ["outer"]
    # an inner deadline never outlives the outer one
    start = time.monotonic()
    assert ba.guarded(results, "outer2", 1,
                      lambda: ba.guarded(results, "inner", 30, lambda: time.sleep(5))) is None
    assert time.monotonic() - start < 4


def test_per_call_us_batches_without_sync_inside():
    events = []
    samples = ba.per_call_us(lambda: events.append("call"), lambda: events.append("sync"),
                             batch=50, batches=3, warmup=2)
    assert len(samples) == 3 and all(s >= 0 for s in samples)
    assert events[:3] == ["call", "call", "sync"]
    assert events[3:] == (["call"] * 50 + ["sync"]) * 3
    slow = ba.per_call_us(lambda: time.sleep(0.001), lambda: None, batch=5, batches=2, warmup=0)
    assert min(slow) >= 900


def test_interleaved_calls_take_turns_and_a_failing_one_is_dropped():
    events, errors = [], []
    boom = {"n": 0}

    def flaky():
        boom["n"] += 1
        if boom["n"] > 3:  # fails in its second timed batch
            raise RuntimeError("flaky")
        events.append("f")

    calls = {"a": (lambda: events.append("a"), lambda: events.append("sync a")),
             "b": (lambda: events.append("b"), lambda: events.append("sync b")),
             "f": (flaky, lambda: None)}
    samples = ba.interleaved_per_call_us(calls, batch=2, batches=3, warmup=1,
                                         errors=lambda name, exc: errors.append((name, exc)))
    assert set(samples) == {"a", "b"} and all(len(v) == 3 for v in samples.values())
    assert [name for name, _ in errors] == ["f"] and str(errors[0][1]) == "flaky"
    timed = [e for e in events[5:] if e != "f"]  # after the warm-ups: a, sync a, b, sync b, f
    assert timed == ["a", "a", "sync a", "b", "b", "sync b"] * 3
    with pytest.raises(RuntimeError, match="flaky"):  # no error callback: re-raised
        boom["n"] = 0
        ba.interleaved_per_call_us({"f": (flaky, lambda: None)}, batch=2, batches=3, warmup=1)


def test_host_overhead_wiring_on_the_cpu():
    pytest.importorskip("torch")
    results = {"overhead_us": {}, "overhead": {}, "skipped": [], "errors": [], "kernel": []}
    ba.host_overhead(results, ["torch", "cupy", "jax"], batch=3, batches=2, step_s=60,
                     device="cpu", problem={"hidden": 16, "intermediate": 24,
                                            "num_experts": 4, "tokens_sum": 64})
    assert results["errors"] == []
    assert set(results["overhead_us"]) == {
        "wrapper", "wrapper_same_offsets", "class_execute", "plan_launch",
        "plan_launch_two_launches", "torch_wgrad_out", "torch_wgrad_alloc", "torch_op_into"}
    entry = results["overhead"]["wrapper"]
    assert entry["target_us"] == 20.0 and len(entry["samples_us"]) == 2
    assert results["overhead"]["torch_wgrad_out"]["target_us"] == 15.0
    assert "target_us" not in results["overhead"]["plan_launch"]
    assert results["overhead_settings"]["batch"] == 3
    table = ba.format_tables(results)
    assert "host overhead per cached call" in table and "class_execute" in table
    assert "row " not in table  # no kernel table without kernel rows


def test_the_default_overhead_problem_and_targets():
    assert ba.OVERHEAD_PROBLEM == {"hidden": 256, "intermediate": 256, "num_experts": 8,
                                   "tokens_sum": 2048}
    assert ba.OVERHEAD_TARGETS_US == {"wrapper": 20.0, "adapters": 15.0}
    assert set(ba.OVERHEAD_TARGET_OF) == {"wrapper", "class_execute", "torch_wgrad_out",
                                          "torch_wgrad_alloc", "torch_op_into",
                                          "cupy_wgrad_out"}
    assert "jax_jit_call" not in ba.OVERHEAD_TARGET_OF  # reported, not held to 15 us


def test_wall_ms_and_table():
    ms = ba.wall_ms({"a": lambda: time.sleep(0.002), "b": lambda: None},
                    {"a": lambda _: None, "b": lambda _: None}, rounds=3, sample_ms=10)
    assert ms["a"] >= 1.9 and ms["b"] < ms["a"]
    results = {"kernel": [{"name": "dsv3-fc1", "dist": "uniform",
                           "ms": {"core": 5.0, "torch": 5.05, "jax": 5.1, "core_wall": 5.0,
                                  "jax_ragged_dot_general": 7.5},
                           "ratio_vs_core": {"torch": 1.01, "jax": 1.02},
                           "ragged_dot_over_gwgrad": 1.47}],
               "overhead_us": {"torch_wgrad_out": 14.0, "wrapper": 25.0},
               "overhead": {"torch_wgrad_out": {"us": 14.0, "target_us": 15.0,
                                                "target_met": True},
                            "wrapper": {"us": 25.0, "target_us": 20.0, "target_met": False}},
               "overhead_gpu_floor_us": 4.2, "skipped": ["cupy_wgrad_out: not installed"],
               "errors": [{"step": "s", "error": "e"}]}
    table = ba.format_tables(results)
    assert "dsv3-fc1" in table and "1.010" in table and "1.47" in table
    assert "torch_wgrad_out" in table and "errors: s: e" in table
    assert "target <= 15: ok" in table and "target <= 20: MISSED" in table
    assert "4.20" in table and "skipped: cupy_wgrad_out" in table


def test_ragged_dot_general_weight_gradient_form():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import gwgrad.adapters.jax as gwj

    rng = np.random.default_rng(np.random.randint(1 << 31))
    counts = np.array([10, 0, 30, 24], np.int32)
    with jax.default_device(jax.devices("cpu")[0]):
        x = jnp.asarray(rng.standard_normal((64, 16)), jnp.bfloat16)
        dy = jnp.asarray(rng.standard_normal((64, 24)), jnp.bfloat16)
        got = jax.jit(ba._ragged_wgrad)(x, dy, jnp.asarray(counts))
        want = gwj.wgrad(x, dy, jnp.asarray(np.cumsum(counts).astype(np.int32)),
                         out_dtype=jnp.float32)
    assert got.shape == (4, 16, 24)
    err = np.linalg.norm(np.asarray(got, np.float32) - np.asarray(want)) / np.linalg.norm(want)
    assert err < 1e-2


def test_main_without_a_gpu_exits_cleanly(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ba.main(["--json", str(tmp_path / "out.json")]) == 2
    assert ba.main(["--skip-kernel", "--overhead-batch", "100", "--overhead-batches", "3",
                    "--json", str(tmp_path / "out.json")]) == 2
