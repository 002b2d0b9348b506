"""The benchmark's pieces that need no GPU: token distributions, the HBM roofline arithmetic,
the ratios, the table and summary, the robust timing wrapper, argument handling, and every
method's wiring (kernel plan, adapter, contract wrapper, loop, dense) run once on CPU tensors
(the reference backend) and cross-checked."""

import json
import math
import types

import pytest

from benchmarks import wgrad as bench
from benchmarks.wgrad import format_table, token_counts

SHAPE = {"name": "tiny", "hidden": 16, "intermediate": 24, "num_experts": 4, "tokens_sum": 1024}


@pytest.mark.parametrize("dist", ["uniform", "zipf"])
@pytest.mark.parametrize("tokens,experts", [(65536, 32), (131072, 128), (32768, 8),
                                            (32768, 64), (65536, 256)])
def test_token_counts_sum_and_rounding(dist, tokens, experts):
    counts = token_counts(tokens, experts, dist)
    assert len(counts) == experts and sum(counts) == tokens
    assert all(c % 256 == 0 and c >= 0 for c in counts)
    if dist == "uniform":
        assert len(set(counts)) == 1
    else:  # skewed: the hottest expert holds far more than the average
        assert max(counts) > 2 * tokens // experts
    assert token_counts(tokens, experts, dist) == counts  # fixed seed


def test_unrounded_counts_and_bad_dist():
    counts = token_counts(1000, 7, "zipf", multiple=1)
    assert sum(counts) == 1000
    with pytest.raises(ValueError, match="dist"):
        token_counts(1000, 7, "gauss")


def test_hbm_bytes_is_the_shapes_json_formula():
    # fine-256e: A and B read once in BF16, the BF16 output written once.
    h, n, e, t = 1536, 1024, 256, 65536
    assert bench.hbm_bytes(h, n, e, t) == 2 * (h + n) * t + 2 * e * h * n == 1_140_850_688
    # accumulating reads the output too; an FP32 output is 4 bytes an element
    assert bench.hbm_bytes(h, n, e, t, accumulate=True) == 2 * (h + n) * t + 4 * e * h * n
    assert bench.hbm_bytes(h, n, e, t, out_bytes=4) == 2 * (h + n) * t + 4 * e * h * n


def test_copy_bandwidth_and_roofline_fraction():
    gib2 = 2 * 2 ** 30
    bw = bench.copy_bandwidth(gib2, 1.0)  # 2 GiB read + 2 GiB written in 1 ms
    assert bw == pytest.approx(2 * gib2 / 1e-3)
    # a method moving 1 GB at 4 TB/s needs 0.25 ms: at 0.5 ms it reaches half the roofline
    assert bench.roofline_fraction(10 ** 9, 4e12, 0.5) == pytest.approx(0.5)
    assert bench.roofline_fraction(10 ** 9, 4e12, 0.25) == pytest.approx(1.0)


def test_small_expert_rows_are_the_last_two_of_shapes_json():
    with open(bench.DEFAULT_SHAPES) as f:
        data = json.load(f)
    small = [s["name"] for s in data["shapes"] if bench.is_small_experts(s)]
    assert small == ["dsv2lite-fc1", "fine-256e"]
    assert "roofline" in data["about"]
    assert bench.is_small_experts({**data["shapes"][0], "small_experts": True})


def _row(times, small=True, copy_bytes=2 ** 31):
    row = bench.new_row({**SHAPE, "hidden": 1536, "intermediate": 1024, "num_experts": 256,
                         "tokens_sum": 65536}, "uniform")
    row["small_experts"] = small
    row["gwgrad_config"] = [128, 128]
    return bench.summarize(row, times, copy_bytes)


def test_summarize_names_a_tuned_best():
    times = {"gwgrad_128x128": 0.40, "gwgrad_128x128:epi_buffer_sets=2": 0.30, "adapter": 0.40,
             "wrapper": 0.41, "dense_cublas": 0.30, "copy": 1.0}
    row = _row(times)
    assert row["gwgrad_best_config"] == [128, 128]
    assert row["gwgrad_best_tuning"] == {"epi_buffer_sets": 2}
    assert row["gwgrad_best_vs_default"] == pytest.approx(0.40 / 0.30)


def test_summarize_ratios_and_roofline():
    times = {"gwgrad_128x128": 0.40, "gwgrad_128x256": 0.36, "adapter": 0.40, "wrapper": 0.41,
             "torch_grouped_mm": 0.60, "torch_mm_loop": 1.2, "dense_cublas": 0.30, "copy": 1.0}
    row = _row(times)
    meth = row["methods"]
    flops = 2.0 * 1536 * 1024 * 65536
    assert meth["gwgrad"]["ms"] == 0.40  # the default tiling's time
    assert meth["gwgrad"]["tflops"] == pytest.approx(flops / 0.40e-3 / 1e12)
    assert row["gwgrad_best_config"] == [128, 256]
    assert row["gwgrad_best_vs_default"] == pytest.approx(0.40 / 0.36)
    assert row["ratio_vs_torch_grouped_mm"] == pytest.approx(1.5)
    assert row["ratio_vs_dense_cublas"] == pytest.approx(0.75)
    assert row["wrapper_over_adapter"] == pytest.approx(0.40 / 0.41)
    assert "tflops" not in meth["copy"]
    bw = 2 * 2 ** 31 / 1e-3
    assert meth["copy"]["gbps"] == pytest.approx(bw / 1e9)
    hbm = row["hbm"]
    assert hbm["bytes"] == 1_140_850_688
    assert hbm["roofline_ms"] == pytest.approx(hbm["bytes"] / bw * 1e3)
    assert hbm["fraction"]["gwgrad"] == pytest.approx(hbm["roofline_ms"] / 0.40)
    assert set(hbm["fraction"]) >= {"gwgrad", "adapter", "wrapper", "torch_grouped_mm"}


def test_summarize_without_copy_or_competitors():
    row = _row({"gwgrad_128x128": 0.5})
    assert "fraction" not in row["hbm"] and "wrapper_over_adapter" not in row
    assert not any(k.startswith("ratio_vs_") for k in row)


def test_table_lists_every_row_and_ratio():
    row = {"name": "dsv3-fc1", "dist": "uniform", "gwgrad_config": [128, 128],
           "methods": {"gwgrad": {"tflops": 685.0}, "torch_grouped_mm": {"tflops": 628.3},
                       "torch_mm_loop": {"tflops": 616.5}, "dense_cublas": {"tflops": 701.1},
                       "adapter": {"tflops": 684.2}, "wrapper": {"tflops": 680.4},
                       "copy": {"gbps": 4300.0}},
           "ratio_vs_torch_grouped_mm": 1.09, "ratio_vs_torch_mm_loop": 1.11,
           "ratio_vs_dense_cublas": 0.98, "wrapper_over_adapter": 0.994,
           "hbm": {"fraction": {"gwgrad": 0.2}}, "rel_err": {"gwgrad": 0.0}}
    table = format_table([row])
    assert "dsv3-fc1" in table and "685.0" in table and "1.09" in table and "128x128" in table
    assert "684.2" in table and "680.4" in table and "0.99" in table and " ok" in table
    assert "20%" not in table  # not a small-expert row: no HBM share
    small = {**row, "name": "fine-256e", "small_experts": True,
             "hbm": {"fraction": {"gwgrad": 0.83}}, "check_failed": ["wrapper"]}
    small["methods"] = {**row["methods"], "wrapper": {"error": "boom"}}
    table = format_table([row, small])
    line = [l for l in table.splitlines() if l.startswith("fine-256e")][0]
    assert "83%" in line and "FAIL" in line and "err" in line


def test_summary_targets_errors_and_failures():
    good = _row({"gwgrad_128x128": 0.4, "adapter": 0.4, "wrapper": 0.404, "copy": 1.0})
    s = bench.summary([good])
    assert s["wrapper_target_met"] and s["wrapper_over_adapter_min"] == pytest.approx(0.4 / 0.404)
    assert list(s["hbm_fraction_small_experts"]) == ["tiny/uniform"]
    assert s["copy_gbps_median"] == pytest.approx(2 * 2 ** 31 / 1e-3 / 1e9)
    slow = _row({"gwgrad_128x128": 0.4, "adapter": 0.4, "wrapper": 0.5})
    slow["methods"]["torch_grouped_mm"] = {"error": "RuntimeError: nope"}
    slow["check_failed"] = ["adapter"]
    broken = {**bench.new_row(SHAPE, "zipf"), "error": "RuntimeError: out of memory"}
    s = bench.summary([good, slow, broken])
    assert not s["wrapper_target_met"] and s["wrapper_over_adapter_min"] == pytest.approx(0.8)
    assert s["check_failed"] == ["tiny/uniform"]
    assert any("nope" in e for e in s["errors"]) and any("out of memory" in e for e in s["errors"])
    text = bench.format_summary(s)
    assert "NOT met" in text and "CHECK FAILED" in text and "out of memory" in text
    line = bench.progress_line(3, 16, broken)
    assert line.startswith("[3/16] tiny zipf") and "ERROR" in line


def test_time_methods_records_a_failing_method_and_times_the_rest():
    def boom():
        raise RuntimeError("no kernel for this tile")

    calls = []

    def timer(fns, rounds, sample_ms):
        calls.append(sorted(fns))
        return {k: 1.0 for k in fns}

    methods = {}
    times = bench.time_methods({"a": lambda: None, "bad": boom, "b": lambda: None}, methods,
                               timer=timer, sync=lambda: None)
    assert times == {"a": 1.0, "b": 1.0} and calls == [["a", "b"]]
    assert methods == {"bad": {"error": "RuntimeError: no kernel for this tile"}}

    def flaky_timer(fns, rounds, sample_ms):  # fails when "b" is timed
        if "b" in fns:
            raise RuntimeError("illegal address")
        return {k: 2.0 for k in fns}

    methods = {}
    times = bench.time_methods({"a": lambda: None, "b": lambda: None}, methods,
                               timer=flaky_timer, sync=lambda: None)
    assert times == {"a": 2.0} and "illegal address" in methods["b"]["error"]


def test_every_method_runs_and_agrees_on_the_cpu():
    """The row's wiring on CPU tensors (reference backend): kernel plan at the default and a
    given tile, the torch adapter, the contract wrapper with rotating offsets tensors, the
    loop and the dense GEMM; a tile no backend takes is recorded, not raised."""
    pytest.importorskip("torch")
    row = bench.new_row(SHAPE, "zipf")
    inp = bench.RowInputs(SHAPE, "zipf", 256, device="cpu")
    assert len({t.data_ptr() for t in inp.offsets_pool}) == bench.OFFSETS_POOL
    fns, default = bench.build_methods(inp, [(128, 128), (64, 64)], row)
    assert default is not None and row["gwgrad_config"] == list(default.tile)
    assert {"adapter", "wrapper", "torch_mm_loop", "dense_cublas", "gwgrad_128x128"} <= set(fns)
    assert "torch_grouped_mm" not in fns  # CUDA only
    assert "mma_tiler_mn" in row["methods"]["gwgrad_64x64"]["error"]
    for fn in fns.values():
        fn()
    bench.check_row(row, inp, fns, default)
    assert set(row["rel_err"]) == {"gwgrad", "adapter", "wrapper"}
    assert all(err < bench.CHECK_TOLERANCE for err in row["rel_err"].values())
    assert "check_failed" not in row and row["rel_err_vs_loop"] == row["rel_err"]["gwgrad"]
    dense = inp.a.float() @ inp.b.float()
    assert (inp.dense_out.float() - dense).abs().max().item() < 0.5


def test_run_row_end_to_end_on_the_cpu():
    pytest.importorskip("torch")

    def timer(fns, rounds, sample_ms):
        assert rounds == 2 and sample_ms == 1.0
        for fn in fns.values():
            fn()
        return {name: 1.0 + i / 10 for i, name in enumerate(fns)}

    row = bench.run_row(SHAPE, "zipf", [(128, 128)], 256, True, rounds=2, sample_ms=1.0,
                        device="cpu", timer=timer)
    meth = row["methods"]
    assert {"gwgrad", "adapter", "wrapper", "torch_mm_loop", "dense_cublas"} <= set(meth)
    assert all("ms" in v for v in meth.values())
    assert row["max_count"] >= row["min_count"] and row["small_experts"]
    assert "wrapper_over_adapter" in row and "ratio_vs_dense_cublas" in row
    assert "check_failed" not in row and set(row["rel_err"]) == {"gwgrad", "adapter", "wrapper"}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 10])
def test_round_orders_balance_positions_and_predecessors(n):
    """Over one cycle of rounds (n for an even n, 2n for an odd one) every method takes every
    position equally often and follows every other method equally often, and the cycle
    repeats (a rotation balanced the positions but gave each method one fixed predecessor)."""
    import collections

    names = [f"m{i}" for i in range(n)]
    cycle = n if n % 2 == 0 else 2 * n
    orders = [bench.round_order(names, r) for r in range(2 * cycle)]
    assert orders[cycle:] == orders[:cycle]
    orders = orders[:cycle]
    assert all(sorted(order) == names for order in orders)
    for pos in range(n):
        assert collections.Counter(o[pos] for o in orders) == {m: cycle // n for m in names}
    pairs = collections.Counter((o[i], o[i + 1]) for o in orders for i in range(n - 1))
    if n > 1:
        want = cycle * (n - 1) // (n * (n - 1))
        assert pairs == {(a, b): want for a in names for b in names if a != b}
    assert bench.round_order([], 4) == []


def test_a_gwgrad_only_sweep_times_the_kernel_variants_alone():
    pytest.importorskip("torch")

    def timer(fns, rounds, sample_ms):
        assert set(fns) == {"gwgrad_128x256", "gwgrad_128x128"}  # nothing else in between
        for fn in fns.values():
            fn()
        return {name: 1.0 for name in fns}

    row = bench.run_row(SHAPE, "uniform", [(128, 128)], 256, True, rounds=1, sample_ms=1.0,
                        device="cpu", timer=timer, gwgrad_only=True)
    assert set(row["methods"]) == {"gwgrad", "gwgrad_128x256", "gwgrad_128x128"}
    assert row["gwgrad_tuning"]["epi_buffer_sets"] == 1 and "check_failed" not in row
    assert set(row["rel_err"]) == {"gwgrad"} and "wrapper_over_adapter" not in row
    assert "wrapper/adapter" not in bench.format_summary(bench.summary([row]))


def test_the_variants_table_gives_each_variant_over_the_default():
    row = bench.new_row(SHAPE, "zipf")
    row["gwgrad_config"] = [128, 128]
    row["methods"] = {"gwgrad_128x128": {"tflops": 400.0},
                      "gwgrad_128x128:cluster=1x2": {"tflops": 440.0},
                      "gwgrad_64x64": {"error": "mma_tiler_mn: ..."}, "adapter": {"tflops": 1.0}}
    table = bench.format_variants([row]).splitlines()
    assert "128x128:cluster=1x2" in table[1] and "adapter" not in table[1]
    assert "400.0 (1.000)" in table[2] and "440.0 (1.100)" in table[2] and "err" in table[2]
    assert bench.format_variants([bench.new_row(SHAPE, "zipf")]) == ""


def test_the_accumulate_mode_adds_into_fp32_on_the_cpu():
    """--accumulate (the main-grad path): every method adds into an FP32 output, the check
    starts each from the same random init, a path that overwrites instead of adding is
    flagged, and the roofline counts the FP32 output read and written."""
    torch = pytest.importorskip("torch")

    def timer(fns, rounds, sample_ms):
        for fn in fns.values():
            fn()
        return {name: 1.0 for name in fns}

    row = bench.run_row(SHAPE, "zipf", [], 256, True, rounds=1, sample_ms=1.0, device="cpu",
                        timer=timer, accumulate=True)
    assert row["accumulate"] and "check_failed" not in row
    assert set(row["rel_err"]) == {"gwgrad", "adapter", "wrapper"}
    assert all(err < bench.CHECK_TOLERANCE for err in row["rel_err"].values())
    m, n, t = SHAPE["hidden"], SHAPE["intermediate"], SHAPE["tokens_sum"]
    e = row["nonempty_experts"]  # an empty expert's FP32 output need not be touched
    assert 0 < e <= SHAPE["num_experts"]
    assert row["hbm"]["bytes"] == 2 * (m + n) * t + 2 * 4 * e * m * n

    inp = bench.RowInputs(SHAPE, "uniform", 256, device="cpu", accumulate=True)
    assert all(o.dtype == torch.float32 for o in inp.outs.values())
    broken = bench.new_row(SHAPE, "uniform")
    fns, default = bench.build_methods(inp, [], broken)
    plain = bench.RowInputs(SHAPE, "uniform", 256, device="cpu").adapter()

    def overwrite():  # the product without the init: what a missing accumulate gives
        inp.outs["adapter"].copy_(plain().float())

    fns["adapter"] = overwrite
    bench.check_row(broken, inp, fns, default)
    assert broken["check_failed"] == ["adapter"]
    row.update(small_experts=False)  # accumulating, every row shows its roofline share
    row["hbm"]["fraction"] = {"gwgrad": 0.5}
    table = bench.format_table([row])
    assert "accumulating into FP32" in table and "  50%" in table.splitlines()[2]


def test_a_tuned_config_runs_its_own_spec_on_the_cpu():
    """--tiles 128x128:epi_buffer_sets=2: the runner's plan is compiled from the default's
    spec with that field replaced, and computes the same result."""
    torch = pytest.importorskip("torch")
    inp = bench.RowInputs(SHAPE, "uniform", 256, device="cpu")
    out = inp.outs["gwgrad"]
    plain = bench.KernelRunner(inp.a, inp.b, inp.offsets, out, mma_tiler_mn=(128, 128))
    tuned = bench.KernelRunner(inp.a, inp.b, inp.offsets, out, mma_tiler_mn=(128, 128),
                               tuning=(("epi_buffer_sets", 2),))
    assert plain.spec.epi_buffer_sets == 1 and tuned.spec.epi_buffer_sets == 2
    assert tuned.tile == (128, 128)
    plain()
    first = out.clone()
    out.zero_()
    tuned()
    assert torch.equal(out, first)
    paired = bench.KernelRunner(inp.a, inp.b, inp.offsets, out, mma_tiler_mn=(128, 128),
                                tuning=(("cluster_shape_mn", (1, 2)),))
    assert paired.spec.cluster_shape_mn == (1, 2)
    out.zero_()
    paired()
    assert torch.equal(out, first)
    coop = bench.KernelRunner(inp.a, inp.b, inp.offsets, out, mma_tiler_mn=(128, 256),
                              tuning=(("epi_buffer_sets", 2),))  # a staging set per group
    assert coop.spec.epi_buffer_sets == 2
    out.zero_()
    coop()
    assert torch.equal(out, first)
    with pytest.raises(ValueError, match="^epi_buffer_sets"):  # 256-row cooperative CTAs
        bench.KernelRunner(inp.a, inp.b, inp.offsets, out, mma_tiler_mn=(256, 128),
                           tuning=(("epi_buffer_sets", 2),))


def test_check_row_flags_a_wrong_result():
    pytest.importorskip("torch")
    row = bench.new_row(SHAPE, "uniform")
    inp = bench.RowInputs(SHAPE, "uniform", 256, device="cpu")
    fns, default = bench.build_methods(inp, [], row)
    fns["wrapper"] = lambda: inp.outs["wrapper"].zero_()  # a broken path
    bench.check_row(row, inp, fns, default)
    assert row["check_failed"] == ["wrapper"] and row["rel_err"]["wrapper"] == pytest.approx(1.0)


def test_a_wrong_competitor_is_flagged():
    """QuACK's outputs are checked like gwgrad's (against the loop, experts with tokens): a
    wrong one is named in the row and the summary, its speed ratio flagged as meaningless."""
    pytest.importorskip("torch")
    row = bench.new_row(SHAPE, "uniform")
    inp = bench.RowInputs(SHAPE, "uniform", 256, device="cpu")
    fns, default = bench.build_methods(inp, [], row)
    assert "quack_default" in inp.outs and "quack_tuned" in inp.outs
    loop = inp.mm_loop()
    ref = inp.outs["reference"]

    def right():
        loop()
        inp.outs["quack_default"].copy_(ref)

    fns["quack_default"] = right
    fns["quack_tuned"] = lambda: inp.outs["quack_tuned"].fill_(1.0)
    bench.check_row(row, inp, fns, default)
    assert row["rel_err"]["quack_default"] < bench.CHECK_TOLERANCE
    assert row["peer_check_failed"] == ["quack_tuned"] and "check_failed" not in row
    s = bench.summary([row])
    assert s["peer_check_failed"] == ["tiny/uniform: quack_tuned"]
    assert "competitor's result is wrong" in bench.format_summary(s)


def test_quack_ratios_and_the_peer_summary():
    fast = _row({"gwgrad_128x128": 0.40, "quack_default": 0.44, "quack_tuned": 0.38,
                 "torch_grouped_mm": 0.6})
    slow = _row({"gwgrad_128x128": 0.40, "quack_default": 0.36, "quack_tuned": 0.50})
    assert fast["ratio_vs_quack_default"] == pytest.approx(1.1)
    assert fast["ratio_vs_quack_tuned"] == pytest.approx(0.95)
    peers = bench.summary([fast, slow])["peers"]
    assert peers["quack_tuned"]["min"] == pytest.approx(0.95) and peers["quack_tuned"]["rows"] == 2
    assert peers["quack_default"]["geomean"] == pytest.approx(math.sqrt(1.1 * 0.9))
    assert peers["torch_grouped_mm"]["rows"] == 1 and peers["dense_cublas"] is None
    assert "gwgrad / quack_tuned: geomean" in bench.format_summary(bench.summary([fast, slow]))
    table = format_table([fast])
    assert "x qkT" in table and "1.10" in table and "0.95" in table


def test_arguments_and_row_selection():
    args = bench.parser().parse_args([])
    assert args.dist == "uniform,zipf" and args.tiles == "128x256,128x128"
    assert not args.unrounded and not args.no_check and args.copy_gib == 2.0
    assert args.rows == "" and args.time_budget == 0
    args = bench.parser().parse_args(["--rows", "fine-256e", "--unrounded", "--no-check",
                                      "--tiles", "128x256", "--rounds", "3", "--json", "x"])
    assert args.unrounded and args.no_check and args.rounds == 3
    assert [s["name"] for s in bench.select_shapes(bench.DEFAULT_SHAPES, "fine-256e,dsv3-fc1")] \
        == ["dsv3-fc1", "fine-256e"]
    assert len(bench.select_shapes(bench.DEFAULT_SHAPES, "")) == 8
    with pytest.raises(SystemExit, match="unknown"):
        bench.select_shapes(bench.DEFAULT_SHAPES, "nope")
    assert bench.parse_tile("128X256") == (128, 256)
    cfg = bench.parse_tile("128x128:epi_buffer_sets=2:raster_group=8")
    assert cfg == (128, 128, ("epi_buffer_sets", 2), ("raster_group", 8))
    assert bench.config_name(cfg) == "gwgrad_128x128:epi_buffer_sets=2:raster_group=8"
    assert bench.parse_tile(bench.config_name(cfg)[len("gwgrad_"):]) == cfg
    cfg = bench.parse_tile("128x128:cluster=1x2")
    assert cfg == (128, 128, ("cluster_shape_mn", (1, 2)))
    assert bench.parse_tile(bench.config_name(cfg)[len("gwgrad_"):]) == cfg
    with pytest.raises(ValueError, match="unknown tuning field 'tile_k'"):
        bench.parse_tile("128x128:tile_k=32")


def test_main_without_a_gpu_exits_cleanly(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--rows", "fine-256e", "--json", str(tmp_path / "b.json")]) == 2
    for bad in (["--dist", "gauss"], ["--tiles", "128by256"]):
        with pytest.raises(SystemExit) as exc:
            bench.main(bad)
        assert exc.value.code == 2


@pytest.mark.gpu
def test_one_small_row_on_the_gpu(tmp_path):
    """Every method of a small row timed on the GPU, cross-checked, the roofline computed."""
    torch = pytest.importorskip("torch")
    shape = {"name": "gpu-small", "hidden": 512, "intermediate": 768, "num_experts": 16,
             "tokens_sum": 8192}
    copy = bench.CopyBuffers(64 * 2 ** 20)
    row = bench.run_row(shape, "zipf", [(128, 128)], 256, True, copy, rounds=3, sample_ms=3)
    meth = row["methods"]
    for name in ("gwgrad", "adapter", "wrapper", "torch_mm_loop", "dense_cublas", "copy"):
        assert "ms" in meth[name], (name, meth.get(name))
    if hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability()[0] >= 9:
        assert "ms" in meth["torch_grouped_mm"] or "error" in meth["torch_grouped_mm"]
    assert not row.get("check_failed"), row.get("rel_err")
    assert 0 < row["wrapper_over_adapter"] < 2
    assert math.isfinite(row["hbm"]["fraction"]["gwgrad"])


def test_a_1x1_variant_of_the_default_tile_keeps_its_own_name(monkeypatch):
    """--tiles MxN (one CTA) where the default runs MxN on a CTA pair: both are timed, the
    variant as MxN:cluster=1x1 (the default holds the name gwgrad_MxN)."""
    pytest.importorskip("torch")

    class Runner:
        def __init__(self, a, b, offsets, out, mma_tiler_mn=None, accumulate=False, tuning=()):
            given = mma_tiler_mn is not None
            self.tile = tuple(mma_tiler_mn) if given else (192, 128)
            cluster = dict(tuning).get("cluster_shape_mn", (1, 1) if given else (1, 2))
            self.spec = types.SimpleNamespace(cluster_shape_mn=cluster, raster_group=16,
                                              epi_tile_n=64, epi_buffer_sets=1, launches=1,
                                              unit_schedule=3)

        def __call__(self):
            pass

    monkeypatch.setattr(bench, "KernelRunner", Runner)
    row = bench.new_row(SHAPE, "uniform")
    inp = bench.RowInputs(SHAPE, "uniform", 256, device="cpu")
    fns, default = bench.build_methods(inp, [(192, 128), (128, 128)], row, gwgrad_only=True)
    assert set(fns) == {"gwgrad_192x128", "gwgrad_192x128:cluster=1x1", "gwgrad_128x128"}
    assert fns["gwgrad_192x128"] is default
    assert fns["gwgrad_192x128:cluster=1x1"].spec.cluster_shape_mn == (1, 1)
    assert bench.parse_tile("192x128:cluster=1x1") == (192, 128, ("cluster_shape_mn", (1, 1)))
