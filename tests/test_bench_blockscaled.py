"""Without a GPU: the SM100 block-scaled benchmark (benchmarks/blockscaled.py) -- its command
line, its refusal to run off SM100 (exit status 2), its rows, counts, FLOP formula, targets and
reporting, and its whole row wiring on the CPU (gwgrad.quantize -> plan -> launch on the
reference backend, spot checks included; torch's grouped and dense calls checked on the meta
device) -- and the SM100 block-scaled path's argument rules through the public API for sm_100a
(CUTE_DSL_ARCH; CUDA descriptors of addresses nothing reads), plus the GPU test module's own
construction (tests/test_sm100_blockscaled_gpu.py) run against the reference backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import gwgrad
from gwgrad import DType, from_pointer
from gwgrad.backends import finalize_spec
from benchmarks.wgrad import DEFAULT_SHAPES
from benchmarks import blockscaled as bs
from gwgrad.errors import ArgumentError
from gwgrad.offsets import check_offsets_values, token_count_multiple
from gwgrad.validation import build_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = json.load(open(DEFAULT_SHAPES))["shapes"]


def _run_module(*args, env_extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "benchmarks.blockscaled", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


# --- the command line ----------------------------------------------------------------------------

def test_help_works():
    proc = _run_module("--help")
    assert proc.returncode == 0, proc.stderr
    for needle in ("SM100", "--json", "--markdown", "--rows", "--formats", "--tiles", "2.4 PFLOP/s"):
        assert needle in proc.stdout, needle


def test_without_a_gpu_it_exits_2_saying_it_needs_sm100(tmp_path):
    out = tmp_path / "b.json"
    proc = _run_module("--rows", "fine-256e", "--json", str(out),
                       env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "needs an SM100" in proc.stderr and "compute capability 10.x" in proc.stderr
    assert not out.exists()


def test_on_another_gpu_it_exits_2(monkeypatch, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert bs.main(["--rows", "dsv3-fc1", "--json", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err
    assert "needs an SM100" in err and "NVIDIA H200" in err and "9.0" in err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bs.main(["--json", ""]) == 2


@pytest.mark.parametrize("bad", [["--formats", "fp8"], ["--formats", ""], ["--dist", "gauss"],
                                 ["--tiles", "128by256"]])
def test_bad_arguments_are_usage_errors(bad):
    with pytest.raises(SystemExit) as exc:
        bs.main(bad)
    assert exc.value.code == 2


def test_unknown_row_is_refused():
    with pytest.raises(SystemExit, match="unknown"):
        bs.main(["--rows", "nope"])


def test_arguments():
    args = bs.parser().parse_args([])
    assert args.formats == "mxfp8,nvfp4,mxfp4" and args.dist == "uniform,zipf"
    assert args.shapes == DEFAULT_SHAPES and args.json == "bench_blockscaled.json"
    assert not args.markdown and args.rows == "" and args.tiles == ""
    assert bs.parse_formats("NVFP4, mxfp8,nvfp4") == ["nvfp4", "mxfp8"]
    with pytest.raises(ValueError, match="mxfp8, nvfp4, mxfp4"):
        bs.parse_formats("mxfp8,e4m3")
    assert bs.parse_tiling("256x256") == ((256, 256), (2, 1))
    assert bs.parse_tiling("128X256@1x1") == ((128, 256), (1, 1))


def test_device_problem():
    assert bs.device_problem(True, (10, 0), "B200") is None
    assert bs.device_problem(True, (10, 3), "B300") is None
    msg = bs.device_problem(True, (9, 0), "H200")
    assert "needs an SM100" in msg and "H200" in msg and "9.0" in msg
    assert "12.0" in bs.device_problem(True, (12, 0), "RTX")
    assert "no CUDA GPU" in bs.device_problem(False)


# --- rows, counts, FLOPs, targets ------------------------------------------------------------------

def test_bundled_shapes_are_the_shared_ones():
    shared = os.path.join(ROOT, "..", "shared", "bench", "shapes.json")
    if not os.path.exists(shared):
        pytest.skip("no shared/bench/shapes.json next to this checkout")
    assert json.load(open(shared))["shapes"] == SHAPES


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s["name"])
@pytest.mark.parametrize("dist", ["uniform", "zipf"])
def test_row_counts(shape, dist):
    counts = bs.row_counts(shape, dist)
    assert len(counts) == shape["num_experts"] and sum(counts) == shape["tokens_sum"]
    assert all(c >= 0 and c % 256 == 0 for c in counts)
    # every format's token-count rule (32 MXFP8, 64 FP4) holds
    assert all(c % 64 == 0 for c in counts)
    if dist == "uniform":
        assert len(set(counts)) == 1
    else:
        assert len(set(counts)) > 1 and max(counts) > shape["tokens_sum"] // shape["num_experts"]
    assert counts == bs.row_counts(shape, dist)  # deterministic


def test_flops_and_coarse_rows():
    assert bs.flops(7168, 4096, 65536) == 2 * 7168 * 4096 * 65536 == 3848290697216
    coarse = sorted(s["name"] for s in SHAPES if bs.is_coarse(s))
    assert coarse == ["dsv3-fc1", "dsv3-fc2", "gptoss-fc1", "mixtral-fc1"]
    assert bs.tokens_per_expert({"tokens_sum": 65536, "num_experts": 32}) == 2048
    row = bs.new_row(SHAPES[0], "zipf")
    assert row["coarse"] and row["tokens_per_expert"] == 2048 and row["methods"] == {}
    # TFLOP/s from median milliseconds: flops / ms / 1e9
    bs.summarize(row, {"gwgrad_mxfp8": 1.0, "gwgrad_bf16": 4.0, "copy": 0.5}, ["mxfp8"],
                 copy_bytes=2 ** 30, counts=bs.row_counts(SHAPES[0], "zipf"))
    assert row["methods"]["gwgrad_mxfp8"]["tflops"] == pytest.approx(3848.290697216)
    assert row["ratios"]["mxfp8_vs_bf16"] == pytest.approx(4.0)
    assert row["methods"]["copy"]["gbps"] == pytest.approx(2 * 2 ** 30 / 0.5e-3 / 1e9)
    assert 0 < row["hbm"]["mxfp8"]["fraction"] < 1


def test_scale_columns_and_hbm_bytes():
    assert bs.scale_columns([256, 0, 96, 32], 32) == 8 + 0 + 4 + 4
    assert bs.scale_columns([64, 448], 16) == 4 + 28
    h, n, counts = 256, 384, [256, 0, 512]
    t = sum(counts)
    assert bs.hbm_bytes("mxfp8", h, n, counts) == (h + n) * t + (256 + 384) * 24 + 2 * 3 * h * n
    assert bs.hbm_bytes("nvfp4", h, n, counts) == (h + n) * t // 2 + (256 + 384) * 48 + 2 * 3 * h * n


def _timed_row(coarse=True, **tflops):
    shape = dict(SHAPES[0]) if coarse else dict(SHAPES[-1])
    row = bs.new_row(shape, "uniform")
    total = bs.flops(row["hidden"], row["intermediate"], row["tokens_sum"])
    times = {k: total / (v * 1e9) for k, v in tflops.items()}
    bs.summarize(row, times, ["mxfp8", "nvfp4", "mxfp4"])
    return bs.evaluate_targets(row, ["mxfp8", "nvfp4", "mxfp4"])


def test_targets_pass_and_miss():
    row = _timed_row(gwgrad_mxfp8=2500, gwgrad_mxfp8_128x256=2300, gwgrad_nvfp4=3900,
                     gwgrad_mxfp4=3000, gwgrad_bf16=1500, torch_scaled_grouped_mm_mxfp8=1800)
    assert row["best"]["mxfp8"] == {"method": "gwgrad_mxfp8", "tflops": pytest.approx(2500)}
    assert row["targets"] == {"mxfp8>=2.4PF": "PASS", "nvfp4>=4.0PF": "MISS",
                              "mxfp8>=1.3x_torch": "PASS"}
    assert row["verdict"] == "MISS" and row["ratios"]["mxfp8_vs_torch"] == pytest.approx(2500 / 1800)
    row = _timed_row(gwgrad_mxfp8=2450, gwgrad_nvfp4=4100, torch_scaled_grouped_mm_mxfp8=1800)
    assert row["verdict"] == "PASS"
    row = _timed_row(gwgrad_mxfp8=2450, gwgrad_nvfp4=4100, torch_scaled_grouped_mm_mxfp8=2000)
    assert row["targets"]["mxfp8>=1.3x_torch"] == "MISS" and row["verdict"] == "MISS"
    # small experts: only the ratio over torch applies; torch missing -> n/a, no verdict
    row = _timed_row(coarse=False, gwgrad_mxfp8=900)
    assert row["targets"] == {"mxfp8>=1.3x_torch": "n/a"} and row["verdict"] == "-"
    row = _timed_row(coarse=False, gwgrad_mxfp8=900, torch_scaled_grouped_mm_mxfp8=600)
    assert row["targets"] == {"mxfp8>=1.3x_torch": "PASS"} and row["verdict"] == "PASS"
    # a coarse row whose gwgrad method failed misses its target
    row = _timed_row(gwgrad_nvfp4=4100)
    assert row["targets"]["mxfp8>=2.4PF"] == "MISS"


def test_reports():
    rows = [_timed_row(gwgrad_mxfp8=2500, gwgrad_nvfp4=3900, gwgrad_mxfp4=3000, gwgrad_bf16=1500,
                       torch_scaled_grouped_mm_mxfp8=1800),
            _timed_row(coarse=False, gwgrad_mxfp8=900, torch_scaled_grouped_mm_mxfp8=600)]
    rows[0]["methods"]["dense_scaled_mm_nvfp4"] = {"error": "RuntimeError: not supported"}
    text = bs.table(rows)
    assert "MISS (nvfp4>=4.0PF)" in text and "PASS" in text and bs.TARGET_TEXT in text
    assert "n/a" in text  # the dense NVFP4 method that could not run
    md = bs.markdown(rows + [{"name": "x", "dist": "zipf", "error": "skipped", "methods": {}}])
    lines = md.splitlines()
    assert len(lines) == 2 + 2 + 2  # header, rule, two rows, blank, targets
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[0] == "dsv3-fc1" and cells[4] == "2500" and cells[-1].startswith("MISS")
    s = bs.summary(rows)
    assert s["miss"] == ["dsv3-fc1/uniform"] and s["pass"] == ["fine-256e/uniform"]
    assert any("not supported" in e for e in s["errors"])


# --- the row's wiring, on the CPU --------------------------------------------------------------------

TINY = {"name": "tiny", "hidden": 256, "intermediate": 384, "num_experts": 5, "tokens_sum": 2560}


def _fake_timer(fns, rounds, sample_ms):
    return {name: 1.0 + i for i, name in enumerate(fns)}


def test_row_on_the_cpu_quantizes_runs_and_checks_every_format():
    """gwgrad.quantize -> launch plan -> reference backend for every format, the spot checks
    against float64 of the dequantized quantizer outputs, the BF16 method; torch's grouped MXFP8
    is n/a on the CPU with its reason, the row still completes."""
    pytest.importorskip("torch")
    row = bs.run_row(TINY, "zipf", ["mxfp8", "nvfp4", "mxfp4"], rounds=1, sample_ms=1,
                     device="cpu", timer=_fake_timer)
    meth = row["methods"]
    for name in ("gwgrad_bf16", "gwgrad_mxfp8", "gwgrad_nvfp4", "gwgrad_mxfp4"):
        assert "tflops" in meth[name], (name, meth.get(name))
        assert row["rel_err"][name] <= bs.CHECK_TOLERANCE, row["rel_err"]
    assert not row["check_failed"], row.get("check_errors")
    assert "error" in meth["torch_scaled_grouped_mm_mxfp8"]
    assert row["tiles"]["gwgrad_mxfp8"]
    assert row["targets"]["mxfp8>=1.3x_torch"] == "n/a" and row["verdict"] == "-"


def test_spot_check_catches_a_wrong_output():
    pytest.importorskip("torch")
    inp = bs.BlockScaledRow(TINY, "uniform", ["nvfp4"], device="cpu")
    fns = {"gwgrad_nvfp4": inp.runner("nvfp4")}
    row = {}
    bs.check_row(row, inp, fns, ["nvfp4"], lambda: None)
    assert row["rel_err"]["gwgrad_nvfp4"] <= bs.CHECK_TOLERANCE and not row["check_failed"]

    def broken():  # right everywhere but one expert's block, scaled by 1.1
        fns["gwgrad_nvfp4"]()
        inp.out[inp.check_experts()[0]] *= 1.1

    row = {}
    bs.check_row(row, inp, {"gwgrad_nvfp4": broken}, ["nvfp4"], lambda: None)
    assert row["check_failed"] == ["gwgrad_nvfp4"]
    row = {}
    bs.check_row(row, inp, {"gwgrad_nvfp4": lambda: inp.out.zero_()}, ["nvfp4"], lambda: None)
    assert row["check_failed"] == ["gwgrad_nvfp4"]
    row = {}
    bs.check_row(row, inp, {"gwgrad_nvfp4": lambda: None}, ["nvfp4"], lambda: None)  # NaN left
    assert "NaN" in row["check_errors"]["gwgrad_nvfp4"]


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "mxfp4"])
def test_dequantize_block_matches_the_quantizer_model(fmt):
    """The bench's dequantization (byte formula) against gwgrad's NumPy model of the quantizer
    (gwgrad.formats) on each expert, scales included."""
    pytest.importorskip("torch")
    from gwgrad import formats as F

    inp = bs.BlockScaledRow(TINY, "zipf", [fmt], device="cpu", seed=3)
    f = bs.FORMATS[fmt]
    q = inp.q[fmt]["x"]
    x = inp.x.float().numpy().astype(np.float64)
    for e, (begin, count) in enumerate(zip(inp.starts, inp.counts)):
        if not count:
            continue
        start = bs.scale_columns(inp.counts[:e], f.sf_vec)
        got = bs.dequantize_block(q["data"], q["scales"], fmt, inp.hidden, (0, inp.hidden), begin,
                                  count, start).numpy()
        xe = x[begin:begin + count].T
        if fmt == "nvfp4":
            codes, scales, g = F.quantize_nvfp4(xe)
            want = F.decode_codes(codes, "e2m1") * np.repeat(F.decode_codes(scales, "e4m3"), 16, 1)
            assert float(q["global_scale"][e]) == pytest.approx(float(g))
        else:
            codes, scales = F.quantize_mx(xe, 32, f.elem)
            want = F.decode_codes(codes, f.elem) * np.repeat(F.decode_codes(scales, "e8m0"), 32, 1)
        np.testing.assert_array_equal(got, want)


def _meta(t):
    import torch

    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")


def test_torch_calls_have_valid_arguments_on_the_meta_device():
    """The shapes, strides and dtypes given to torch._scaled_grouped_mm (MXFP8 2D-2D) and to the
    dense torch._scaled_mm pass torch's own checks (its meta kernels)."""
    torch = pytest.importorskip("torch")
    inp = bs.BlockScaledRow(TINY, "zipf", ["mxfp8", "nvfp4", "mxfp4"], device="cpu")
    a, b, sfa, sfb, _, _ = (None if t is None else _meta(t) for t in inp.operands("mxfp8"))
    out = torch._scaled_grouped_mm(a, b, sfa, sfb, offs=_meta(inp.offsets),
                                   out_dtype=torch.bfloat16)
    assert out.shape == (TINY["num_experts"], TINY["hidden"], TINY["intermediate"])
    for fmt in ("mxfp8", "nvfp4", "mxfp4"):
        a, b, sfa, sfb, _, _ = (None if t is None else _meta(t) for t in inp.operands(fmt))
        out = torch._scaled_mm(a, b, sfa, sfb, out_dtype=torch.bfloat16)
        assert out.shape == (TINY["hidden"], TINY["intermediate"]), fmt


# --- the SM100 block-scaled path's argument rules (sm_100a, no GPU) --------------------------------

H, N, E = 128, 256, 4
E4M3, E5M2, FP4 = DType.FLOAT8_E4M3FN, DType.FLOAT8_E5M2, DType.FLOAT4_E2M1FN_X2
E8M0 = DType.FLOAT8_E8M0FNU
PTR = 1 << 32


def cuda_desc(shape, strides=None, dtype=DType.FLOAT32, ptr=PTR):
    return from_pointer(ptr, shape, strides, dtype, 0, device_type="cuda")


def call_args(fmt, tokens=256, a_major="k", b_major="k", global_scales=None, sf=None, vec=None):
    """Contract arguments of a block-scaled call on CUDA descriptors (nothing is read)."""
    fp4 = fmt in ("nvfp4", "mxfp4")
    elem = FP4 if fp4 else {"mxfp8": E4M3, "mxfp8_e5m2": E5M2}[fmt]
    k = tokens // 2 if fp4 else tokens
    a = cuda_desc((H, k), (k, 1) if a_major == "k" else (1, H), elem)
    b = cuda_desc((k, N), (1, k) if b_major == "k" else (N, 1), elem)
    sf = sf or (DType.FLOAT8_E4M3FN if fmt == "nvfp4" else E8M0)
    vec = vec or (16 if fmt == "nvfp4" else 32)
    cols = max(-(-tokens // vec // 4) * 4, 4) + 4 * E
    kw = dict(a_tensor=a, b_tensor=b, sfa_tensor=cuda_desc((128, cols), None, sf),
              sfb_tensor=cuda_desc((256, cols), None, sf),
              offsets_tensor=cuda_desc((E,), None, DType.INT32),
              wgrad_tensor=cuda_desc((E, H, N)), sf_vec_size=vec)
    if global_scales if global_scales is not None else fmt == "nvfp4":
        kw.update(global_scale_a=cuda_desc((E,)), global_scale_b=cuda_desc((E,)))
    return kw


@pytest.fixture
def sm100(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")


def wrapper_raises(name, **kw):
    with pytest.raises(ValueError) as info:
        gwgrad.grouped_gemm_wgrad_wrapper_sm100(**kw)
    assert isinstance(info.value, ArgumentError) and info.value.argument == name, str(info.value)
    assert str(info.value).startswith(f"{name}: expected ")
    return str(info.value)


def class_raises(name, **kw):
    samples = {"a_tensor": "sample_a", "b_tensor": "sample_b", "sfa_tensor": "sample_sfa",
               "sfb_tensor": "sample_sfb", "offsets_tensor": "sample_offsets",
               "wgrad_tensor": "sample_wgrad", "global_scale_a": "sample_global_scale_a",
               "global_scale_b": "sample_global_scale_b"}
    kw = {samples.get(k, k): v for k, v in kw.items()}
    with pytest.raises(ValueError) as info:
        gwgrad.GroupedGemmWgradSm100(**kw)
    assert info.value.argument == name, str(info.value)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_mn_major_operand_is_a_value_error_naming_it(sm100, fmt):
    msg = wrapper_raises("a_tensor", **call_args(fmt, a_major="m"))
    assert "K-major" in msg and "float4_e2m1fn_x2" in msg
    wrapper_raises("b_tensor", **call_args(fmt, b_major="n"))
    class_raises("sample_a", **call_args(fmt, a_major="m"))
    class_raises("sample_b", **call_args(fmt, b_major="n"))


def test_fp8_mn_major_operands_are_accepted_for_sm100(sm100):
    for majors in (("m", "n"), ("k", "n"), ("m", "k")):
        kw = call_args("mxfp8", a_major=majors[0], b_major=majors[1])
        spec = build_spec(a=kw["a_tensor"], b=kw["b_tensor"], offsets=kw["offsets_tensor"],
                          sfa=kw["sfa_tensor"], sfb=kw["sfb_tensor"], wgrad=kw["wgrad_tensor"],
                          sf_vec_size=32, arch="sm_100a")
        assert (spec.a_major, spec.b_major) == majors


def test_nvfp4_without_global_scales_names_global_scale_a(sm100):
    msg = wrapper_raises("global_scale_a", **call_args("nvfp4", global_scales=False))
    assert "NVFP4" in msg
    class_raises("sample_global_scale_a", **call_args("nvfp4", global_scales=False))
    kw = call_args("nvfp4")
    del kw["global_scale_b"]
    wrapper_raises("global_scale_b", **kw)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8", "mxfp8_e5m2"])
def test_sf_vec_16_with_e8m0_names_sf_vec_size(sm100, fmt):
    msg = wrapper_raises("sf_vec_size", **call_args(fmt, vec=16))
    assert "32" in msg
    class_raises("sf_vec_size", **call_args(fmt, vec=16))


def test_other_format_mismatches(sm100):
    # NVFP4 (E4M3 scales) at 32 tokens per scale; FP8 with E4M3 scales; the default sf_vec_size
    # (16) with MXFP8 operands: each a ValueError naming what is wrong.
    wrapper_raises("sf_vec_size", **call_args("nvfp4", vec=32))
    wrapper_raises("sfa_tensor", **call_args("mxfp8", sf=DType.FLOAT8_E4M3FN, vec=32))
    kw = call_args("mxfp8")
    del kw["sf_vec_size"]
    wrapper_raises("sf_vec_size", **kw)


def _spec(fmt, tokens=256, **kw):
    args = call_args(fmt, tokens=tokens, **kw)
    return build_spec(a=args["a_tensor"], b=args["b_tensor"], offsets=args["offsets_tensor"],
                      sfa=args["sfa_tensor"], sfb=args["sfb_tensor"],
                      global_scale_a=args.get("global_scale_a"),
                      global_scale_b=args.get("global_scale_b"), wgrad=args["wgrad_tensor"],
                      sf_vec_size=args["sf_vec_size"], arch="sm_100a")


@pytest.mark.parametrize("fmt,multiple", [("mxfp8", 32), ("mxfp8_e5m2", 32), ("nvfp4", 64),
                                          ("mxfp4", 64)])
def test_token_count_multiple_per_format(fmt, multiple):
    spec = _spec(fmt)
    assert token_count_multiple(spec) == multiple
    from test_sm100_blockscaled_gpu import FORMATS as GPU_FORMATS

    gpu_name = {"mxfp8": "mxfp8_e4m3"}.get(fmt, fmt)
    assert GPU_FORMATS[gpu_name].multiple == multiple  # the GPU tests' counts follow it


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_counts_not_multiples_of_64_name_offsets_tensor_on_the_host(fmt):
    spec = _spec(fmt)
    check_offsets_values(np.array([64, 128, 192, 256]), 256, spec)  # multiples of 64: fine
    with pytest.raises(ArgumentError) as info:
        check_offsets_values(np.array([32, 128, 192, 256]), 256, spec)
    assert info.value.argument == "offsets_tensor"
    assert "multiple of 64" in str(info.value) and "got 32 tokens for expert 0" in str(info.value)
    # the same counts are valid MXFP8 counts
    check_offsets_values(np.array([32, 128, 192, 256]), 256, _spec("mxfp8"))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_counts_through_the_public_api_on_host_arrays(fmt):
    """CPU arrays: the wrapper checks the offsets on the host (reference backend) with the FP4
    rule: a count of 32 is a ValueError naming offsets_tensor, 64 runs."""
    torch = pytest.importorskip("torch")
    from test_sm100_blockscaled_gpu import FORMATS as GPU_FORMATS, run_case

    with pytest.raises(ValueError, match=r"^offsets_tensor: .*multiple of 64.*got 32 tokens"):
        run_case(0, fmt, [32, 96, 128], device="cpu", out_dtype=torch.float32)
    run_case(0, fmt, [64, 64, 128], device="cpu", out_dtype=torch.float32)
    assert GPU_FORMATS[fmt].fp4


def test_fp4_tokens_sum_not_a_multiple_of_64_names_a_tensor(sm100):
    msg = wrapper_raises("a_tensor", **call_args("nvfp4", tokens=224))
    assert "multiple of 64" in msg


# --- the GPU test module's configurations and construction, checked here -------------------------------

def _gpu_configs():
    """(format, spec kwargs) of every distinct configuration tests/test_sm100_blockscaled_gpu.py
    runs (formats x modes x majors x tilings)."""
    import torch

    import test_sm100_blockscaled_gpu as g

    configs = []
    for fmt in g.FORMATS:
        for m in g.MODES:
            configs.append((fmt, dict(mode=m["mode"], out=m["out_dtype"], acc=m["accumulate"],
                                      order=m["order"])))
        for tiling in g.TILINGS:
            configs.append((fmt, dict(tiling=tiling, out=torch.float32, global_scales=True)))
    for fmt in g.FP8_FORMATS:
        for majors in (("m", "n"), ("k", "n"), ("m", "k")):
            for order in ("tensor2d", "tensor_ragged"):
                configs.append((fmt, dict(majors=majors, order=order, out=torch.float32)))
    return configs


def _final_spec(fmt, mode="dense", out=None, acc=False, order="tensor2d", majors=("k", "k"),
                tiling=None, global_scales=None):
    from gwgrad.interop.torch import DTYPES

    import test_sm100_blockscaled_gpu as g

    f = g.FORMATS[fmt]
    name = {"mxfp8_e4m3": "mxfp8"}.get(fmt, fmt)
    args = call_args(name, a_major=majors[0], b_major=majors[1],
                     global_scales=f.needs_global if global_scales is None else global_scales)
    tile, cluster = tiling if tiling is not None else (None, None)
    wgrad_dtype = DTYPES[out] if out is not None else DType.BFLOAT16
    spec = build_spec(a=args["a_tensor"], b=args["b_tensor"], offsets=args["offsets_tensor"],
                      sfa=args["sfa_tensor"], sfb=args["sfb_tensor"],
                      global_scale_a=args.get("global_scale_a"),
                      global_scale_b=args.get("global_scale_b"), output_mode=mode,
                      wgrad=cuda_desc((E, H, N), None, wgrad_dtype) if mode == "dense" else None,
                      wgrad_dtype=wgrad_dtype, sf_vec_size=f.sf_vec, accumulate=acc,
                      input_order=order, mma_tiler_mn=tile, cluster_shape_mn=cluster,
                      arch="sm_100a")
    return finalize_spec(spec)


def test_every_gpu_test_configuration_passes_check_support_for_sm100a():
    """check_support() (the backend's rules and the kernel's can_implement) accepts everything
    the GPU tests run, so none of them can fail for its arguments on a B200."""
    pytest.importorskip("torch")
    pytest.importorskip("cutlass")
    seen = set()
    for fmt, kw in _gpu_configs():
        spec, backend = _final_spec(fmt, **kw)
        assert type(backend).__name__ == "BlockScaledSm100Backend"
        seen.add(spec)
    assert len(seen) > 60
    spec, _ = _final_spec("nvfp4")
    assert (spec.mma_tiler_mn, spec.cluster_shape_mn) == ((256, 256), (2, 1))  # the default


@pytest.mark.parametrize("tiling,name", [(((128, 192), (1, 1)), "mma_tiler_mn"),
                                         (((64, 128), (1, 1)), "mma_tiler_mn"),
                                         (((256, 128), (1, 1)), "cluster_shape_mn"),
                                         (((128, 128), (1, 2)), "cluster_shape_mn")])
def test_unsupported_tilings_are_value_errors_for_sm100a(tiling, name):
    pytest.importorskip("torch")
    with pytest.raises(ArgumentError) as info:
        _final_spec("mxfp4", tiling=tiling)
    assert info.value.argument == name


CPU_CASES = [
    ("mxfp8_e4m3", dict(mode="dense", out_dtype="bfloat16")),
    ("mxfp8_e5m2", dict(mode="discrete", out_dtype="float16", accumulate=True,
                        order="tensor_ragged")),
    ("mxfp8_e4m3", dict(majors=("m", "n"), order="tensor_ragged", out_dtype="float32",
                        accumulate=True)),
    ("mxfp8_e5m2", dict(majors=("m", "k"), out_dtype="float32")),
    ("nvfp4", dict(mode="discrete", out_dtype="bfloat16", accumulate=True,
                   order="tensor_ragged")),
    ("nvfp4", dict(hidden=352, inter=416, tiling=((256, 256), (2, 1)), out_dtype="float32",
                   extra=1)),
    ("mxfp4", dict(mode="dense", out_dtype="float32", accumulate=True, order="tensor_ragged",
                   global_scales=True)),
    ("mxfp4", dict(api="class", mode="discrete", out_dtype="float32")),
    ("mxfp8_e4m3", dict(api="class", mode="dense", out_dtype="float32", accumulate=True)),
]


@pytest.mark.parametrize("fmt,kw", CPU_CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_gpu_test_construction_agrees_with_the_reference_backend(seed, fmt, kw):
    """run_case of the GPU module on CPU tensors: its operands, byte-formula scale placement,
    FP4 packing and float64 expectations agree with gwgrad's reference backend (which reads the
    layouts through gwgrad/scales.py and gwgrad/formats.py), within the GPU tolerances."""
    torch = pytest.importorskip("torch")
    from test_sm100_blockscaled_gpu import counts_for, run_case

    kw = dict(kw, device="cpu")
    kw["out_dtype"] = getattr(torch, kw["out_dtype"])
    run_case(seed, fmt, counts_for(fmt), **kw)


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "nvfp4", "mxfp4"])
def test_gpu_test_padding_poison_and_empty_cases_on_the_cpu(seed, fmt):
    torch = pytest.importorskip("torch")
    from test_sm100_blockscaled_gpu import FORMATS as G, NAN_BYTE, counts_for, run_case

    nan = NAN_BYTE[G[fmt].sf]
    kw = dict(hidden=224, inter=416, out_dtype=torch.float32, extra=2, device="cpu")
    clean = run_case(seed, fmt, counts_for(fmt), **kw)
    poisoned = run_case(seed, fmt, counts_for(fmt), pad={"quad": nan, "rows": nan, "tail": nan},
                        **kw)
    assert all(torch.equal(c, p) for c, p in zip(clean.outs, poisoned.outs))
    # the poison really is in the scale bytes
    assert (poisoned.sfa.view(torch.uint8) == nan).any()
    run_case(seed, fmt, [0, 0, 0], accumulate=True, out_dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("fmt", ["mxfp8_e5m2", "nvfp4"])
def test_gpu_test_quantize_case_on_the_cpu(seed, fmt):
    pytest.importorskip("torch")
    from test_sm100_blockscaled_gpu import QUANT, quantize_case

    errors = quantize_case(seed, fmt, device="cpu")
    assert errors and max(errors) < QUANT[fmt][2]


def test_gpu_module_is_collected_and_skips_off_sm100():
    pytest.importorskip("torch")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           os.path.join("tests", "test_sm100_blockscaled_gpu.py")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" not in proc.stdout and "skipped" in proc.stdout
