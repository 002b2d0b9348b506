"""gwgrad.bench_adapters' GPU-independent parts: step guards and deadlines, the wall-clock
timer, the table, the ragged_dot_general competitor's formulation (on the CPU), and a clean
exit without a GPU."""

from __future__ import annotations

import time

import numpy as np
import pytest

from gwgrad import bench_adapters as ba


def test_guarded_records_errors_and_deadlines():
    results = {"errors": []}
    assert ba.guarded(results, "ok", 5, lambda: 42) == 42

    def boom():
        raise RuntimeError("no kernel")

    assert ba.guarded(results, "boom", 5, boom) is None
    assert ba.guarded(results, "slow", 1, lambda: time.sleep(5)) is None
    assert [e["step"] for e in results["errors"]] == ["boom", "slow"]
    assert "StepTimeout" in results["errors"][1]["error"]


def test_wall_ms_and_table():
    ms = ba.wall_ms({"a": lambda: time.sleep(0.002), "b": lambda: None},
                    {"a": lambda _: None, "b": lambda _: None}, rounds=3, sample_ms=10)
    assert ms["a"] >= 1.9 and ms["b"] < ms["a"]
    results = {"kernel": [{"name": "dsv3-fc1", "dist": "uniform",
                           "ms": {"core": 5.0, "torch": 5.05, "jax": 5.1, "core_wall": 5.0,
                                  "jax_ragged_dot_general": 7.5},
                           "ratio_vs_core": {"torch": 1.01, "jax": 1.02},
                           "ragged_dot_over_gwgrad": 1.47}],
               "overhead_us": {"torch_wgrad_out": 14.0}, "errors": [{"step": "s", "error": "e"}]}
    table = ba.format_tables(results)
    assert "dsv3-fc1" in table and "1.010" in table and "1.47" in table
    assert "torch_wgrad_out" in table and "errors: s: e" in table


def test_ragged_dot_general_weight_gradient_form():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import gwgrad.adapters.jax as gwj

    rng = np.random.default_rng()
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
