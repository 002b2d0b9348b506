"""CPU tests of the fuzz suite (tests/fuzz_cases.py, run on the GPU by tests/test_fuzz_gpu.py)
and of tools/sanitize.py, so that neither can pass vacuously on the GPU host:

* the generator is deterministic per master seed, needs neither torch nor a GPU, and a case can
  be replayed alone;
* a default run (500 cases) covers every category the fuzz suite promises (dims, experts,
  majors, orders, modes, output dtypes, accumulate, tiles, FP8 recipes / formats / global
  scales / quantized operands, zero / one-hot / unaligned / huge counts, entry points, invalid
  offsets of every kind), within its bounds (<= 44 specs, memory per case);
* every generated call is one the contract accepts: the project's own predicates say so
  (``gwgrad.offsets.find_problem`` with ``token_count_multiple``, ``validation.build_spec`` on
  the call's descriptors, ``backends.finalize_spec`` for sm_90a), and invalid draws are
  rejected naming the expected argument;
* the checker fails on a wrong value, a NaN left in the output, a missing row, a guard write
  and a write under invalid offsets (the runner itself, on CPU torch tensors);
* generated cases run end to end on the CPU reference backend through the same runner (the
  operand layouts, scale placement and read-back, entry points and FP64 reference);
* ``tools/sanitize.py --list`` works, its cases pass the same support checks and run on the
  CPU, its output parser and its parent / child orchestration work (with a stand-in for
  compute-sanitizer).

    python -m pytest -q tests/test_fuzz_cases.py
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import fuzz_cases as F
from gwgrad.kernels.tiling import SM90_TILES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
SANITIZE = os.path.join(ROOT, "tools", "sanitize.py")
SEEDS = (0, 1, 1234, 2 ** 32 - 1)


def _sanitize_module():
    name = "gwgrad_sanitize_script"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SANITIZE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture
def torch1():
    """CPU torch with one thread (the small per-expert ops are much faster so)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("ml_dtypes")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield torch
    torch.set_num_threads(threads)


def cost(case) -> float:
    s, d = case.spec, case.draw
    t = d.tokens_sum
    quantize = 20 * (s.hidden + s.intermediate) * t if s.source == "quantize" else 0
    return s.hidden * s.intermediate * (t + 4 * s.experts) + quantize


# --- the generator ---------------------------------------------------------------------------

def test_the_generator_needs_neither_torch_nor_a_gpu():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['cutlass'] = None; "
            "import fuzz_cases as F; cases = F.generate(7); "
            "assert len(cases) == 500 and 'torch' not in [m for m in sys.modules if "
            "sys.modules[m] is not None]; print('generated', len(cases))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=_env(), cwd=HERE, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "generated 500" in out.stdout


def test_the_generator_is_deterministic_per_seed(seed):
    a, b = F.generate(seed), F.generate(seed)
    assert a == b
    assert [c.id for c in a] == [c.id for c in b]
    other = F.generate(seed + 1)
    assert [c.spec for c in other] != [c.spec for c in a]
    # A case is a function of (master seed, spec index, draw index) only: the run's size does
    # not change it, so GWGRAD_FUZZ_ONLY replays it alone.
    specs = F.plan_specs(seed)
    for case in F.generate(seed, 100) + a[::37]:
        assert case.spec == specs[case.spec.index]
        assert case.draw == F.make_draw(case.spec, seed, case.draw.index)
        (again,) = F.replay_cases(seed, case.id)
        assert again == case
    assert [c.id for c in F.replay_cases(seed, "s03")] == [c.id for c in a if c.spec.id == "s03"]
    assert len({c.draw.seed for c in a}) == len(a)  # every case has its own data seed


def test_the_environment_picks_seed_size_and_cases(monkeypatch):
    monkeypatch.setenv("GWGRAD_FUZZ_SEED", "77")
    monkeypatch.setenv("GWGRAD_FUZZ_CASES", "2000")
    master, cases = F.from_env(default_master=5)
    assert master == 77 and len(cases) == 2000
    assert len({c.spec.key for c in cases}) <= F.MAX_SPECS
    monkeypatch.setenv("GWGRAD_FUZZ_CASES", "20")
    master, cases = F.from_env()
    assert len(cases) == 20 and len({c.spec.index for c in cases}) == 2
    monkeypatch.setenv("GWGRAD_FUZZ_ONLY", "s05d40,s01")
    master, cases = F.from_env()
    assert [c.id for c in cases][:1] == ["s05d40"]
    assert {c.spec.id for c in cases[1:]} == {"s01"}
    monkeypatch.setenv("GWGRAD_FUZZ_SKIP", "s01d00, s01d01")
    master, skipped = F.from_env()
    assert [c.id for c in skipped] == [c.id for c in cases if c.id not in ("s01d00", "s01d01")]
    monkeypatch.delenv("GWGRAD_FUZZ_SKIP")
    monkeypatch.delenv("GWGRAD_FUZZ_SEED")
    monkeypatch.delenv("GWGRAD_FUZZ_ONLY")
    master, _ = F.from_env(default_master=99)
    assert master == 99
    monkeypatch.setenv("GWGRAD_FUZZ_ONLY", "nonsense")
    with pytest.raises(ValueError, match="GWGRAD_FUZZ_ONLY"):
        F.from_env()


def test_the_tile_tables_are_the_kernels():
    from gwgrad.kernels.tiling import SM90_FP8_TILES, SM90_TILES

    assert set(F.SM90_BF16_TILES) == set(SM90_TILES)
    assert set(F.SM90_FP8_TILES) == set(SM90_FP8_TILES)


def coverage(cases):
    """name -> whether the cases cover it."""
    bf16 = [c for c in cases if c.spec.kind == "bf16"]
    fp8 = [c for c in cases if c.spec.kind == "fp8"]
    specs = list({c.spec.key: c.spec for c in cases}.values())
    got = {}

    def has(name, cond):
        got[name] = bool(cond)

    for group, cs in (("bf16", bf16), ("fp8", fp8)):
        ss = {c.spec for c in cs}
        for order in F.ORDERS:
            has(f"{group} order {order}", any(s.order == order for s in ss))
        for mode in F.MODES:
            has(f"{group} mode {mode}", any(s.mode == mode for s in ss))
        for dt in F.OUT_DTYPES:
            for acc in (False, True):
                has(f"{group} out {dt} acc={acc}",
                    any(s.out_dtype == dt and s.accumulate == acc for s in ss))
        tiles = F.SM90_BF16_TILES if group == "bf16" else F.SM90_FP8_TILES
        for tile in (None,) + tiles:
            has(f"{group} tile {tile}", any(s.tiling == tile for s in ss))
        if group == "bf16":
            has("bf16 a CTA cluster", any(s.cluster for s in ss))
        g = 8 if group == "bf16" else 16
        has(f"{group} hidden {g}", any(s.hidden == g for s in ss))
        has(f"{group} intermediate {g}", any(s.intermediate == g for s in ss))
        has(f"{group} a dim >= 2048", any(max(s.hidden, s.intermediate) >= 2048 for s in ss))
        has(f"{group} a dim not a multiple of 64",
            any(s.hidden % 64 or s.intermediate % 64 for s in ss))
        has(f"{group} a dim multiple of 128", any(s.hidden % 128 == 0 for s in ss))
    for a, b in F.BF16_MAJORS:
        has(f"bf16 majors A{a}B{b}", any(c.spec.a_major == a and c.spec.b_major == b
                                         for c in bf16))
    has("fp8 K-major only", all(c.spec.a_major == c.spec.b_major == "k" for c in fp8))
    for r in F.RECIPES:
        has(f"recipe {r}", any(c.spec.recipe == r for c in fp8))
        has(f"recipe {r} quantized operands",
            any(c.spec.recipe == r and c.spec.source == "quantize" for c in fp8))
    has("blocked e4m3", any(s.recipe == "blocked" and s.a_fmt == "e4m3" for s in specs))
    has("blocked e5m2", any(s.recipe == "blocked" and s.a_fmt == "e5m2" for s in specs))
    has("fp32 recipe e4m3 x e5m2", any(s.recipe in F.FP32_RECIPES and s.a_fmt != s.b_fmt
                                       for s in specs))
    has("global scales", any(s.global_scales for s in specs))
    has("no global scales", any(s.kind == "fp8" and not s.global_scales for s in specs))
    # MXFP8 through both SM90 kernels: two passes (the wrapper, tensor2d, no global scales, a
    # tile the BF16 kernel runs) and the promoting kernel (global scales or tensor_ragged).
    has("MXFP8 two passes", any(s.recipe == "blocked" and s.order == "tensor2d"
                                and not s.global_scales
                                and (s.tiling is None or tuple(s.tiling) in SM90_TILES)
                                for s in specs))
    has("MXFP8 promoting", any(s.recipe == "blocked" and (s.global_scales
                                                          or s.order == "tensor_ragged")
                               for s in specs))
    for name, lo, hi in (("1 expert", 1, 1), ("2-8 experts", 2, 8), ("9-64 experts", 9, 64),
                         ("65-511 experts", 65, 511), ("512 experts", 512, 512)):
        has(name, any(lo <= s.experts <= hi for s in specs))
    valid = [c for c in cases if c.draw.invalid is None]
    for dist in F.DISTS:
        has(f"dist {dist}", any(c.draw.dist == dist for c in valid))
    has("zero counts among nonzero", any(0 in c.draw.counts and c.draw.tokens_sum > 0
                                          for c in valid))
    has("all empty", any(c.draw.tokens_sum == 0 for c in valid))
    has("one hot", any(c.spec.experts > 1 and sum(x > 0 for x in c.draw.counts) == 1
                       for c in valid))
    has("huge expert (>= 16384 tokens)", any(max(c.draw.counts) >= 16384 for c in valid))
    has("a call of >= 32768 tokens", any(c.draw.tokens_sum >= 32768 for c in valid))
    has("counts not multiples of 8 (M/N-major BF16)",
        any(c.spec.count_multiple == 1 and any(x % 8 for x in c.draw.counts) for c in valid))
    for m in (8, 16, 32):
        has(f"counts multiples of {m}, not of 128",
            any(c.spec.count_multiple == m and any(x % 128 for x in c.draw.counts)
                for c in valid))
    for entry in F.ENTRIES:
        for kind in ("bf16", "fp8"):
            has(f"entry {entry} {kind}", any(c.draw.entry == entry and c.spec.kind == kind
                                             for c in valid))
    has("adapter discrete", any(c.draw.entry == "adapter" and c.spec.mode == "discrete"
                                for c in valid))
    for kind in F.INVALID_KINDS:
        has(f"invalid {kind}", any(c.draw.invalid == kind for c in cases))
    has("validate_offsets valid", any(c.draw.validate_offsets for c in valid))
    has("validate_offsets invalid", any(c.draw.validate_offsets and c.draw.invalid
                                        for c in cases))
    has("flat per_expert_channel scales", any(c.draw.flat_scales for c in valid))
    has("scale_recipe='blocked' and None", {c.draw.explicit_blocked for c in valid
                                            if c.spec.recipe == "blocked"} == {False, True})
    has("extra scale capacity", any(c.draw.extra_capacity and c.spec.recipe in
                                    ("blocked", "block_1x128") for c in valid))
    return got


@pytest.mark.parametrize("which", range(len(SEEDS) + 1))
def test_a_default_run_covers_every_category(which, seed):
    master = SEEDS[which] if which < len(SEEDS) else seed
    cases = F.generate(master)
    assert len(cases) == F.DEFAULT_CASES
    missing = [name for name, ok in coverage(cases).items() if not ok]
    assert not missing, f"master seed {master}: not covered: {missing}"


@pytest.mark.parametrize("master", SEEDS)
def test_a_run_stays_within_its_bounds(master):
    cases = F.generate(master)
    specs = {c.spec.key for c in cases}
    assert len(specs) == -(-F.DEFAULT_CASES // F.DRAWS_PER_SPEC) <= F.MAX_SPECS
    assert F.DRAWS_PER_SPEC - 1 <= min(collections.Counter(c.spec.key for c in cases).values())
    for c in cases:
        s, d = c.spec, c.draw
        assert s.experts * s.hidden * s.intermediate <= F.OUT_ELEMS_CAP, c.id
        assert s.hidden * s.intermediate <= F.HN_CAP, c.id
        assert max(s.hidden, s.intermediate) <= F.MAX_DIM
        assert d.tokens_sum <= min(F.TOKENS_CAP, s.max_tokens), c.id
        assert (s.hidden + s.intermediate) * d.tokens_sum * s.token_bytes <= F.IN_BYTES_CAP
        assert F.case_bytes(c) <= 512 << 20, (c.id, F.case_bytes(c) >> 20)
        assert len(d.counts) == len(d.offsets) == s.experts
        assert d.entry in s.entries


# --- the project's own predicates accept every generated call --------------------------------

@pytest.mark.parametrize("master", SEEDS[:2])
def test_counts_follow_the_kernels_rules(master):
    from gwgrad import quantizers
    from gwgrad import scales as S
    from gwgrad.offsets import find_problem, problem_argument, token_count_multiple

    for c in F.generate(master):
        s, d = c.spec, c.draw
        static = F.to_static_spec(s)
        m = token_count_multiple(static)
        assert s.count_multiple == m
        t = d.tokens_sum
        assert all(x >= 0 and x % m == 0 for x in d.counts), (c.id, d.counts)
        assert t % m == 0
        rule = capacity = None
        if s.kind == "fp8" and s.recipe != "per_expert_channel":
            rule = S.column_rule(static.scale_recipe, static.sf_vec_size)
            if s.source == "quantize":
                capacity = quantizers.layout(F.QUANTIZE_FMT[s.recipe], t, s.hidden, s.experts,
                                             s.a_fmt).scale_capacity
            else:
                capacity = F.scale_capacity(s, d)
            assert capacity >= F.capacity_lower_bound(s.recipe, t)
        problem = find_problem(np.asarray(d.offsets), t, m, rule, capacity or 0)
        if d.invalid is None:
            assert problem is None, (c.id, problem)
            assert list(d.offsets) == list(np.cumsum(d.counts))
        else:
            assert problem is not None, (c.id, d.invalid)
            assert problem_argument(problem[0]) == d.expect_error, (c.id, problem)


@pytest.mark.parametrize("master", SEEDS[:2])
def test_every_generated_call_passes_the_contracts_checks(master):
    """build_spec (the contract's checks) of every call's descriptors is the case's spec, and
    the SM90 backends accept every spec (check_support: its tiling, the kernels'
    can_implement): the GPU run compiles each, and no more than MAX_SPECS of them."""
    pytest.importorskip("cutlass")
    from gwgrad.backends import finalize_spec

    cases = F.generate(master)
    for c in cases:
        assert F.build_spec_of(c) == F.to_static_spec(c.spec), c.id
    finals = set()
    for spec in {c.spec.key: c.spec for c in cases}.values():
        final, backend = finalize_spec(F.to_static_spec(spec))
        assert type(backend).__name__ == ("Bf16Sm90Backend" if spec.kind == "bf16"
                                          else "Fp8Sm90Backend")
        if spec.tiling is not None:
            assert final.mma_tiler_mn == spec.tiling
            assert final.cluster_shape_mn == (spec.cluster or (1, 1))
        finals.add(final)
    assert len(finals) <= F.MAX_SPECS


def test_the_runner_lays_operands_out_as_described(torch1):
    """The tensors run_case hands the API have the shapes / strides static_descs describes
    (which the contract checks above ran on), empty calls included."""
    torch = torch1
    from gwgrad.interop.torch import describe

    cases = F.generate(4321)
    picks = {}
    for c in sorted(cases, key=cost):
        key = (c.spec.kind, c.spec.a_major, c.spec.b_major, c.spec.order, c.spec.source,
               c.draw.tokens_sum == 0)
        picks.setdefault(key, c)
    assert len(picks) >= 10
    for c in picks.values():
        if c.spec.source == "quantize":
            continue  # the quantizer's outputs: checked by the end-to-end runs
        gen = F._gen(torch, "cpu", 1)
        for which, fmt in (("a", c.spec.a_fmt), ("b", c.spec.b_fmt)):
            dtype = torch.bfloat16 if c.spec.kind == "bf16" else F._fp8_dtype(torch, fmt)
            full, block = F._operand(torch, c.spec, which, c.draw.counts, gen, "cpu", dtype)
            want = F.static_descs(c)[which]
            got = describe(full, which)
            assert (got.shape, got.strides, got.dtype) == (want.shape, want.strides,
                                                           want.dtype), (c.id, which)
            for e, n in enumerate(c.draw.counts):
                shape = tuple(block(e).shape)
                assert shape == ((c.spec.hidden, n) if which == "a" else (n, c.spec.intermediate))


# --- the checker fails when it should ----------------------------------------------------------

def _cheapest(cases, cond):
    found = sorted((c for c in cases if cond(c)), key=cost)
    assert found, "no such case"
    return found[0]


def test_compare_expert_flags_wrong_values(torch1):
    torch = torch1
    ref = torch.randn(256, 192, dtype=torch.float64)
    good = ref.to(torch.bfloat16)
    r = F.compare_expert(good, ref, ref, 1e-2, 3e-4, 2.0 ** -8)
    assert r["ok"] and r["rel"] < 5e-3 and r["elem"] == 0.0
    bad = good.clone()
    bad[13, 7] += 1.0  # one element off by about the rms: the Frobenius norm hardly moves
    r = F.compare_expert(bad, ref, ref, 1e-2, 3e-4, 2.0 ** -8)
    assert not r["ok"] and r["rel"] < 1e-2 and r["elem"] > 0.5
    bad = good.clone()
    bad[0, 0] = float("nan")
    r = F.compare_expert(bad, ref, ref, 1e-2, 3e-4, 2.0 ** -8)
    assert not r["ok"] and r["nans"] == 1
    zero = torch.zeros(8, 8, dtype=torch.float64)
    assert F.compare_expert(zero.float(), zero, zero, 1e-5, 3e-4, 2.0 ** -24)["ok"]
    assert not F.compare_expert(zero.float() + 1e-3, zero, zero, 1e-5, 3e-4, 2.0 ** -24)["ok"]


@pytest.mark.parametrize("kind", ["bf16_dense", "bf16_discrete_acc", "fp8"])
def test_the_runner_fails_on_corrupted_results(torch1, kind):
    cases = F.generate(1234)
    cond = {
        "bf16_dense": lambda c: c.spec.kind == "bf16" and c.spec.mode == "dense",
        "bf16_discrete_acc": lambda c: (c.spec.kind == "bf16" and c.spec.mode == "discrete"
                                        and c.spec.accumulate),
        "fp8": lambda c: c.spec.kind == "fp8" and c.spec.source == "direct",
    }[kind]
    case = _cheapest(cases, lambda c: cond(c) and c.draw.invalid is None
                     and c.draw.tokens_sum > 0)
    clean = F.run_case(case, "cpu")
    assert clean["ok"], clean  # the same case passes untouched: the failures below are real
    for corrupt in ("value", "nan", "row"):
        rec = F.run_case(case, "cpu", corrupt=corrupt)
        assert not rec["ok"] and rec["mismatch"] and rec["guard_bytes"] == 0, (corrupt, rec)
        assert "experts wrong" in rec["error"]
    rec = F.run_case(case, "cpu", corrupt="guard")
    assert not rec["ok"] and not rec["mismatch"] and rec["guard_bytes"] == 1, rec


def test_the_runner_fails_on_writes_under_invalid_offsets(torch1):
    cases = F.generate(1234)
    case = _cheapest(cases, lambda c: c.draw.invalid is not None)
    clean = F.run_case(case, "cpu")
    assert clean["ok"], clean
    rec = F.run_case(case, "cpu", corrupt="inside")
    assert not rec["ok"] and rec["mismatch"] and "written despite invalid offsets" in rec["error"]
    # An invalid draw whose error is not raised is a failure too.
    import dataclasses

    valid_offsets = tuple(int(x) for x in np.cumsum(case.draw.counts))
    unflagged = F.Case(case.spec, dataclasses.replace(case.draw, offsets=valid_offsets),
                       case.master_seed)
    rec = F.run_case(unflagged, "cpu")
    assert not rec["ok"] and "not reported" in rec["error"]


def test_run_all_reports_and_logs(torch1, tmp_path):
    cases = F.generate(99)
    first = _cheapest(cases, lambda c: c.spec.kind == "bf16" and c.draw.invalid is None)
    picks = [first, _cheapest(cases, lambda c: c.draw.invalid is not None
                              and c.spec.index != first.spec.index)]
    log = tmp_path / "fuzz.json"
    lines = []
    summary = F.run_all(picks, "cpu", log_path=str(log), master_seed=99, echo=lines.append)
    assert re.fullmatch(r"fuzz: 2 cases, 2 specs, 0 mismatches, 0 guard writes, \d+ s, "
                        r"master seed 99", summary["line"]), summary["line"]
    assert not lines and not summary["failures"]
    data = json.loads(log.read_text())
    assert data["summary"]["cases"] == 2
    for rec in data["cases"]:
        assert {"id", "seed", "spec", "counts", "rel_err", "elem_err", "guard_bytes",
                "ok"} <= set(rec)
        assert rec["ok"]


# --- generated cases end to end on the CPU reference ------------------------------------------

def test_generated_cases_run_on_the_cpu_reference(torch1, seed, tmp_path):
    """For every spec of a default run: its cheapest valid call and its cheapest invalid or
    empty one, through the same runner as on the GPU (CPU tensors run gwgrad's reference)."""
    cases = F.generate(seed)
    by_spec = collections.defaultdict(list)
    for c in cases:
        if cost(c) <= 3e8:
            by_spec[c.spec.index].append(c)
    picks = []
    for cs in by_spec.values():
        cs.sort(key=cost)
        full = [c for c in cs if c.draw.invalid is None and c.draw.tokens_sum > 0]
        other = [c for c in cs if c.draw.invalid is not None or c.draw.tokens_sum == 0]
        picks += full[:1] + other[:1]
        entries = {c.draw.entry for c in picks}
        picks += [c for c in full[1:] if c.draw.entry not in entries][:1]
    assert len(by_spec) >= 36, "too few specs have a case the CPU can run"
    kinds = {(c.spec.kind, c.spec.recipe, c.spec.source) for c in picks}
    assert {k[1] for k in kinds if k[0] == "fp8"} == set(F.RECIPES)
    assert {c.draw.entry for c in picks} == set(F.ENTRIES)
    lines = []
    summary = F.run_all(picks, "cpu", log_path=str(tmp_path / "cpu.json"), echo=lines.append)
    assert summary["mismatches"] == 0 and summary["guard_writes"] == 0, "\n".join(lines)
    assert summary["cases"] == len(picks)


# --- tools/sanitize.py -----------------------------------------------------------------------

def test_sanitize_lists_its_cases_and_each_passes_the_support_check():
    out = subprocess.run([sys.executable, SANITIZE, "--list"], capture_output=True, text=True,
                         env=_env(), timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    S = _sanitize_module()
    cases = S.cases()
    names = [c.name for c in cases]
    assert len(names) == len(set(names))
    for n in names:
        assert re.search(rf"^{re.escape(n)}\s", out.stdout, re.M), n
    pytest.importorskip("cutlass")
    from gwgrad import quantizers
    from gwgrad.backends import finalize_spec
    from gwgrad.kernels.quantize import problem
    from gwgrad.offsets import find_problem, problem_argument, token_count_multiple

    schedules = set()
    for c in cases:
        if c.quant is not None:
            q = c.quant
            elem = quantizers._elem(q.fmt, q.elem)
            assert problem(quantizers.kernel_config(q.fmt, elem, q.channels,
                                                    len(q.counts))) is None
            assert all(x % quantizers.count_multiple(q.fmt) == 0 for x in q.counts)
            continue
        spec, draw = c.gemm.spec, c.gemm.draw
        assert F.build_spec_of(c.gemm) == F.to_static_spec(spec), c.name
        final, backend = finalize_spec(F.to_static_spec(spec))
        schedules.add((spec.kind, backend.config(final).schedule, final.mma_tiler_mn))
        assert spec.hidden <= 264 and spec.intermediate <= 264 and spec.experts <= 64
        assert draw.tokens_sum < 2048
        m = token_count_multiple(final)
        problem_ = find_problem(np.asarray(draw.offsets), draw.tokens_sum, m)
        if draw.invalid is None:
            assert problem_ is None and all(x % m == 0 for x in draw.counts), c.name
        elif draw.invalid != "scales":
            assert problem_argument(problem_[0]) == draw.expect_error, c.name
    from gwgrad.kernels.tiling import SM90_FP8_TILES, SM90_TILES

    assert {t for k, _, t in schedules if k == "bf16"} == set(SM90_TILES)
    assert {t for k, _, t in schedules if k == "fp8"} == set(SM90_FP8_TILES)
    assert {s for _, s, _ in schedules} == {"cooperative", "pingpong"}
    fmts = {c.quant.fmt for c in cases if c.quant is not None}
    assert fmts == set(quantizers.FORMATS)
    for tool in S.TOOLS:
        assert any(tool in c.tools for c in cases)
    assert 4 <= sum("racecheck" in c.tools for c in cases) <= 14
    for recipe in F.RECIPES:
        assert any(c.gemm and c.gemm.spec.recipe == recipe and c.gemm.draw.invalid
                   for c in cases), recipe


def test_sanitize_cases_run_on_the_cpu():
    pytest.importorskip("torch")  # the sanitizer's cases are torch programs
    out = subprocess.run([sys.executable, SANITIZE, "--child", "--device", "cpu", "--cases",
                          "all"], capture_output=True, text=True, env=_env(), timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    S = _sanitize_module()
    parsed = S.parse_output(out.stdout)
    assert parsed["done"]
    assert set(parsed["results"]) == {c.name for c in S.cases()}
    bad = {n: r for n, r in parsed["results"].items()
           if not (r.startswith("ok") or r.startswith("skip"))}
    assert not bad, bad


def test_sanitize_parses_sanitizer_reports():
    S = _sanitize_module()
    text = "\n".join([
        "========= COMPUTE-SANITIZER",
        f"{S.MARK} BEGIN case_a",
        f"{S.MARK} END case_a ok 0.10s",
        f"{S.MARK} BEGIN case_b",
        "========= Invalid __global__ write of size 16 bytes",
        "=========     at kernel_cutlass_kernel_gwgradkernelssm90_bf16...+0x1a0",
        "========= Error: Race reported between Write access at ... and Read access at ...",
        f"{S.MARK} END case_b FAIL 0.20s data wrong",
        f"{S.MARK} DONE 1/2",
        "========= RACECHECK SUMMARY: 3 hazards displayed (1 error, 2 warnings)",
        "========= ERROR SUMMARY: 2 errors",
    ])
    p = S.parse_output(text)
    assert p["done"] and p["error_summary"] == [2] and p["racecheck"] == [(3, 1, 2)]
    assert p["findings"] == {"case_b": 2}
    assert p["results"]["case_a"].startswith("ok") and p["results"]["case_b"].startswith("FAIL")
    batch = {"tool": "racecheck", "cases": ["case_a", "case_b"], "rc": 1, "timed_out": False,
             "seconds": 1.0, **p}
    s = S.summarize("racecheck", [batch], ["case_a", "case_b"])
    assert not s["clean"] and s["errors"] == 2 and s["failed_checks"] == ["case_b"]
    assert s["racecheck_errors"] == 1 and s["racecheck_warnings"] == 2
    clean = S.parse_output("\n".join([f"{S.MARK} BEGIN case_a", f"{S.MARK} END case_a ok 0.1s",
                                      f"{S.MARK} DONE 1/1", "========= ERROR SUMMARY: 0 errors"]))
    s = S.summarize("memcheck", [{**batch, **clean, "cases": ["case_a"]}], ["case_a"])
    assert s["clean"] and s["errors"] == 0
    # A child that died before DONE, or printed no ERROR SUMMARY, is never clean.
    died = S.parse_output(f"{S.MARK} BEGIN case_a\n========= ERROR SUMMARY: 0 errors")
    assert not S.summarize("memcheck", [{**batch, **died, "cases": ["case_a"]}],
                           ["case_a"])["clean"]
    silent = S.parse_output(f"{S.MARK} BEGIN case_a\n{S.MARK} END case_a ok\n{S.MARK} DONE 1/1")
    assert not S.summarize("memcheck", [{**batch, **silent, "cases": ["case_a"]}],
                           ["case_a"])["clean"]
    # racecheck may print its own summary only.
    race_only = S.parse_output("\n".join([
        f"{S.MARK} BEGIN case_a", f"{S.MARK} END case_a ok", f"{S.MARK} DONE 1/1",
        "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"]))
    assert S.summarize("racecheck", [{**batch, **race_only, "cases": ["case_a"]}],
                       ["case_a"])["clean"]


FAKE_SANITIZER = r'''#!{python}
"""Stand-in for compute-sanitizer: drops its options, runs the program, prints a summary
(and, with FAKE_SANITIZER_FINDING=<case>, an error while that case runs)."""
import os, subprocess, sys
args = sys.argv[1:]
tool = "memcheck"
while args and args[0].startswith("--"):
    if args[0] == "--tool":
        tool = args[1]
    args = args[2:]
bad = os.environ.get("FAKE_SANITIZER_FINDING")
proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
errors = 0
for line in proc.stdout:
    sys.stdout.write(line)
    if bad and line.startswith("GWGRAD-SANITIZE BEGIN " + bad):
        sys.stdout.write("========= Invalid __global__ read of size 4 bytes\n")
        errors += 1
rc = proc.wait()
if tool == "racecheck":
    print("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)")
print(f"========= ERROR SUMMARY: {{errors}} error{{'' if errors == 1 else 's'}}")
sys.exit(1 if errors else rc)
'''


def test_sanitize_parent_runs_baseline_and_tools(tmp_path):
    """The parent's whole flow on the CPU (children with --device cpu) with a stand-in for
    compute-sanitizer: baseline, two tools, the JSON, the exit status; then a reported error
    makes the run fail and is attributed to its case."""
    pytest.importorskip("torch")  # the sanitizer's cases are torch programs
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER.format(python=sys.executable))
    fake.chmod(0o755)
    cases = "bf16_pp_128x128,quant_mxfp8_e4m3,invalid_bf16_decreasing"
    cmd = [sys.executable, SANITIZE, "--device", "cpu", "--sanitizer", str(fake), "--cases",
           cases, "--tools", "memcheck,racecheck", "--jobs", "2", "--json",
           str(tmp_path / "s.json"), "--cache-dir", str(tmp_path / "cache"), "--timeout", "300"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["ok"] and report["baseline"]["clean"]
    assert set(report["tools"]) == {"memcheck", "racecheck"}
    assert report["tools"]["memcheck"]["cases"] == cases.split(",")
    assert report["tools"]["racecheck"]["cases"] == ["bf16_pp_128x128", "quant_mxfp8_e4m3"]
    for tool in report["tools"].values():
        assert tool["errors"] == 0 and tool["clean"] and not tool["failed_checks"]
    assert re.search(r"^memcheck\s+3\s+0\s", out.stdout, re.M), out.stdout

    env = _env()
    env["FAKE_SANITIZER_FINDING"] = "quant_mxfp8_e4m3"
    out = subprocess.run(cmd[:-4] + ["--tools", "memcheck", "--skip-baseline"] + cmd[-4:],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 1, out.stdout[-3000:]
    report = json.loads((tmp_path / "s.json").read_text())
    mem = report["tools"]["memcheck"]
    assert not report["ok"] and mem["errors"] == 1
    assert mem["findings_by_case"] == {"quant_mxfp8_e4m3": 1}


@pytest.mark.compile
def test_sanitize_kernels_compile_for_sm90():
    """Every kernel the sanitizer run needs compiles for sm_90a (no GPU needed: the DSL's
    --gpu-arch), so its baseline cannot fail on a compile: the GEMMs through the operator the
    API builds, the quantizers through gwgrad.quantizers.compile_quantizer. (A default fuzz
    run's specs pass the same support check above; their compiles take ~2 minutes on a CPU
    and are left to the GPU host.)"""
    pytest.importorskip("cutlass")
    from gwgrad import plan, quantizers
    from gwgrad.backends import finalize_spec

    S = _sanitize_module()
    finals, quant = {}, set()
    for c in S.cases():
        if c.quant is not None:
            q = c.quant
            quant.add((q.fmt, quantizers._elem(q.fmt, q.elem), q.channels, len(q.counts)))
            continue
        spec = c.gemm.spec
        final, backend = finalize_spec(F.to_static_spec(spec))
        finals.setdefault(final, backend)
        if spec.source == "quantize":
            for channels, elem in ((spec.hidden, spec.a_fmt), (spec.intermediate, spec.b_fmt)):
                quant.add((F.QUANTIZE_FMT[spec.recipe], elem, channels, spec.experts))
    for final, backend in finals.items():
        operator = plan.CompiledOperator(final, backend)
        assert operator.handle is not None and operator.workspace_bytes > 0
    for fmt, elem, channels, experts in sorted(quant):
        assert quantizers.compile_quantizer(quantizers.kernel_config(fmt, elem, channels,
                                                                     experts), "sm_90a")
    assert len(finals) <= 40 and len(quant) <= 10
