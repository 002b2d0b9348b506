"""Seeded fuzzing of the grouped weight-gradient GEMMs on the GPU (issue #13): >= 500 random
calls (tests/fuzz_cases.py: random dims and expert counts, token counts with zeros, one-hot,
unaligned and huge experts, every major / input order / output mode / output dtype /
accumulate / SM90 tile, the SM90 FP8 recipes, invalid offsets) through the public API (the
contract's wrapper, the ``GroupedGemmWgrad`` class and the torch adapter), each against a float64
reference of the (dequantized) inputs, with NaN-poisoned (or random, when accumulating) outputs
inside guard bytes that must stay bit-unchanged. One test function loops over every case (no
per-case pytest overhead) and reports every failing case, not just the first.

About 42 distinct static specs (kernel compiles, 2-3 s each on the H200) and ~12 calls each;
expected under 5 minutes on an H200 including the compiles.

Re-run / replay (on an SM90 GPU host; the FP8 cases and the explicit SM90 tiles are skipped
on other architectures):

    python -m pytest -q tests/test_fuzz_gpu.py                       # 500 cases, random seed
    GWGRAD_FUZZ_SEED=1234 GWGRAD_FUZZ_CASES=2000 GWGRAD_FUZZ_LOG=fuzz.json \\
        python -m pytest -q tests/test_fuzz_gpu.py                   # a bigger, logged run
    GWGRAD_FUZZ_SEED=1234 GWGRAD_FUZZ_ONLY=s07d03,s12 python -m pytest -q tests/test_fuzz_gpu.py
    GWGRAD_FUZZ_SEED=1234 GWGRAD_FUZZ_SKIP=s07d03 python -m pytest -q tests/test_fuzz_gpu.py

A fatal CUDA error (illegal address, ...) leaves the context unusable: the run stops there and
reports the case; ``GWGRAD_FUZZ_SKIP`` leaves it out to run the rest.

Without GWGRAD_FUZZ_SEED the master seed is the test's own seed (tests/conftest.py), so the
``GWGRAD_TEST_SEED=...`` line of a failure report replays the run too. ``GWGRAD_FUZZ_LOG``:
a JSON log of every case (id, data seed, spec, counts summary, entry, worst errors, guard bytes,
pass) and the summary. The summary line is printed even without ``-s``:
``fuzz: N cases, S specs, 0 mismatches, 0 guard writes, T s, master seed X``.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

import fuzz_cases as F  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available()
                       or torch.cuda.get_device_capability()[0] < 9,
                       reason="needs an SM90+ GPU"),
]


def test_fuzz(seed, capsys):
    master, cases = F.from_env(default_master=seed)
    assert cases, "GWGRAD_FUZZ_ONLY / GWGRAD_FUZZ_CASES selected no case"
    skipped = []
    if torch.cuda.get_device_capability() != (9, 0):
        # The FP8 kernel and the explicit tiles are SM90's (test_fp8_sm90_gpu.py skips alike).
        skipped = [c for c in cases if c.spec.kind == "fp8" or c.spec.tiling is not None]
        cases = [c for c in cases if c not in skipped]
    lines = []
    summary = F.run_all(cases, "cuda", log_path=os.environ.get("GWGRAD_FUZZ_LOG") or None,
                        master_seed=master, echo=lines.append)
    line = summary["line"]
    if skipped:
        line += f" ({len(skipped)} FP8 / SM90-tile cases skipped off SM90)"
    with capsys.disabled():
        print()
        for text in lines[:40]:
            print(text)
        if len(lines) > 40:
            print(f"... and {len(lines) - 40} more failing cases (GWGRAD_FUZZ_LOG has them all)")
        print(line, flush=True)
    failures = summary["failures"]
    report = "\n".join(
        f"{r['id']} seed={r['seed']} guard_bytes={r['guard_bytes']} "
        f"rel={r['rel_err']} elem={r['elem_err']}: {r['error']}" for r in failures)
    assert not summary["not_run"], (
        f"a fatal CUDA error stopped the run; {len(summary['not_run'])} cases not run\n{report}")
    assert summary["mismatches"] == 0 and summary["guard_writes"] == 0, (
        f"{line}\nreplay one with GWGRAD_FUZZ_SEED={master} GWGRAD_FUZZ_ONLY=<id>; failing "
        f"cases ({len(failures)}): {','.join(r['id'] for r in failures)}\n{report}")
    assert not failures, report
