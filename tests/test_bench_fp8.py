"""The FP8 benchmark's reporting (benchmarks/fp8.py) on synthetic rows; the timing itself
needs an SM90 GPU (tools/gpu_run.sh fp8)."""

from benchmarks import fp8


def _row(name="dsv3-fc1", **tflops):
    methods = {k: {"ms": 1.0, "tflops": v} for k, v in tflops.items()}
    row = {"name": name, "dist": "uniform", "methods": methods,
           "tiles": {"fp8_channel": "128x192", "fp8_1x128": "128x192", "fp8_mx": "128x128",
                     "fp8_mx_64x128": "64x128"}}
    t = {k: v for k, v in tflops.items()}
    for recipe in ("channel", "1x128", "mx"):
        cands = {k: v for k, v in t.items() if k.startswith(f"fp8_{recipe}")}
        best = max(cands, key=cands.get)
        row[f"{recipe}_best"] = {"method": best, "tflops": cands[best]}
        for comp in ("gwgrad_bf16", "torch_scaled_grouped_mm", "dense_fp8", "scaled_mm_loop"):
            row.setdefault("ratios", {})[f"{recipe}_vs_{comp}"] = cands[best] / t[comp]
    return row


def test_tables_show_each_recipe_at_its_best_tile():
    row = _row(gwgrad_bf16=700, fp8_channel=1200, fp8_1x128=840, fp8_mx=150, fp8_mx_64x128=180,
               torch_scaled_grouped_mm=960, dense_fp8=1400, scaled_mm_loop=1000)
    text = fp8.table([row])
    assert "1200" in text and "1.25" in text  # channel / torch
    md = fp8.markdown([row, {"name": "x", "dist": "zipf", "error": "skipped"}])
    lines = md.splitlines()
    assert len(lines) == 3  # header, rule, one row (the error row is left out)
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[3] == "1200 (128x192)" and cells[5] == "180 (64x128)"
    assert cells[7] == "1400" and cells[8] == "1000"  # dense, per-expert _scaled_mm
    assert cells[9] == "1.25" and cells[11] == "1.20" and cells[12] == "1.71"
    assert cells[14] == "0.26"


def test_scaled_mm_loop_is_each_experts_scaled_product():
    """The per-expert `_scaled_mm` competitor computes the channel recipe's answer: expert e's
    tokens of x.T and dy.T, its rows of the scales; an empty expert's output zeroed (torch's
    CPU `_scaled_mm`, against an FP64 reference)."""
    import torch

    gen = torch.Generator().manual_seed(3)
    m, n, counts = 16, 24, [32, 0, 16]
    t, e = sum(counts), len(counts)
    row = fp8.Fp8Row.__new__(fp8.Fp8Row)
    row.counts = counts
    row.a = torch.randn(m, t, generator=gen).to(torch.float8_e4m3fn)
    row.bt = torch.randn(n, t, generator=gen).to(torch.float8_e4m3fn)
    row.scales = {"channel": (torch.rand(e, m, generator=gen) + 0.5,
                              torch.rand(e, n, generator=gen) + 0.5)}
    row.ref = torch.full((e, m, n), float("nan"), dtype=torch.bfloat16)
    got = row.scaled_mm_loop()().double()
    sa, sb = (s.double() for s in row.scales["channel"])
    start = 0
    for i, c in enumerate(counts):
        a, b = row.a[:, start:start + c].double(), row.bt[:, start:start + c].double()
        want = (a @ b.t()) * sa[i][:, None] * sb[i][None, :]
        err = (got[i] - want).norm() / want.norm().clamp_min(1e-30)
        assert (got[i] == 0).all() if c == 0 else err < 1e-2, (i, err)
        start += c


def test_tiles_take_tuning_fields(monkeypatch, tmp_path):
    seen = []

    def run_row(shape, dist, rounds, sample_ms, tiles, recipes, fp8_only):
        seen.append(tiles)
        assert recipes == fp8.RECIPES and not fp8_only
        return {"name": shape["name"], "dist": dist, "error": "not timed here"}

    monkeypatch.setattr(fp8, "run_row", run_row)
    assert fp8.main(["--rows", "dsv3-fc1", "--dist", "uniform", "--json",
                     str(tmp_path / "out.json"),
                     "--tiles", "128x128,128x192:epi_tile_n=32"]) == 0
    assert seen == [[(128, 128), (128, 192, ("epi_tile_n", 32))]]
    assert fp8.variant_name("1x128", seen[0][1]) == "fp8_1x128_128x192:epi_tile_n=32"
    assert fp8.variant_name("mx", seen[0][0]) == "fp8_mx_128x128"


def test_recipes_and_fp8_only(monkeypatch, tmp_path):
    """--recipes picks gwgrad's FP8 recipes, --fp8-only leaves out BF16 and torch (an A/B of
    FP8 variants alone); an unknown recipe is an error naming --recipes."""
    import pytest

    seen = []

    def run_row(shape, dist, rounds, sample_ms, tiles, recipes, fp8_only):
        seen.append((recipes, fp8_only))
        return {"name": shape["name"], "dist": dist, "error": "not timed here"}

    monkeypatch.setattr(fp8, "run_row", run_row)
    out = str(tmp_path / "out.json")
    assert fp8.main(["--rows", "dsv3-fc1", "--dist", "uniform", "--json", out,
                     "--recipes", "mx", "--fp8-only"]) == 0
    assert seen == [(("mx",), True)]
    seen.clear()
    monkeypatch.setattr(fp8, "run_row", lambda shape, dist, rounds, sample_ms, tiles, *a: (
        seen.append(tiles) or {"name": shape["name"], "dist": dist, "error": "not timed"}))
    assert fp8.main(["--rows", "dsv3-fc1", "--dist", "uniform", "--json", out,
                     "--tiles", " "]) == 0  # a blank --tiles: no variants
    assert seen == [[]]
    with pytest.raises(SystemExit):
        fp8.main(["--rows", "dsv3-fc1", "--json", out, "--recipes", "mx,fp4"])


def test_a_variant_naming_a_mainloop_runs_for_mxfp8_only():
    from benchmarks.wgrad import parse_tile

    for spec in ("128x128:cluster=1x2:mainloop=2", "64x128:mainloop=1"):
        tile = parse_tile(spec)
        assert fp8.variant_applies("mx", tile)
        assert not fp8.variant_applies("channel", tile)
        assert not fp8.variant_applies("1x128", tile)
    plain = parse_tile("128x192:cluster=2x1:epi_buffer_sets=2")
    assert all(fp8.variant_applies(r, plain) for r in fp8.RECIPES)


def test_per_expert_loop_is_timed_only_on_torchs_answer(monkeypatch):
    """run_row checks the per-expert `_scaled_mm` loop against torch._scaled_grouped_mm before
    timing it: a loop with a wrong answer (or none) is left out, with the reason in the row."""
    import torch

    want = torch.ones(2, 4, 4)

    class Row:
        def __init__(self, shape, dist, seed=0):
            self.counts, self.flops = [256, 256], 1e9
            self.ref = torch.empty(2, 4, 4)

        def runner(self, recipe):
            return lambda: None

        def bf16(self):
            return lambda: None

        def torch_scaled_grouped(self):
            return lambda: want

        def dense_fp8(self):
            return lambda: None

        def scaled_mm_loop(self):
            def loop():
                self.ref.copy_(want * factor)
                return self.ref
            return loop

    monkeypatch.setattr(fp8, "Fp8Row", Row)
    monkeypatch.setattr(fp8, "time_methods", lambda fns, meth, **kw: {k: 1.0 for k in fns})
    shape = {"name": "s", "hidden": 4, "intermediate": 4, "num_experts": 2, "tokens_sum": 512}
    for factor, timed in ((1.0, True), (1.5, False), (float("nan"), False)):
        row = fp8.run_row(shape, "uniform", 1, 1.0, [], ("1x128",))
        assert ("ms" in row["methods"]["scaled_mm_loop"]) == timed, (factor, row)
        assert "ratios" in row and ("1x128_vs_scaled_mm_loop" in row["ratios"]) == timed
        if not timed:
            assert "relative error" in row["methods"]["scaled_mm_loop"]["error"]
