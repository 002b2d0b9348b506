"""The tuning defaults, frozen: ``backends.finalize_spec`` on a grid of problems (every
architecture and format, output dtypes, accumulation, expert counts, tokens unknown / short /
just past short, the tiling left open or half chosen) gives the tuning recorded in
``tests/data/tuning_defaults.json``. A default that changes on purpose regenerates the file
(``python tests/test_tuning_rules.py --write``) and says why in its commit; any other change
is a regression.

The grid's tunings are compared with ``check_support`` set aside (the rules alone, no CuTe DSL
needed); that every default of the grid passes ``check_support`` is its own test."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import string
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

from gwgrad.dtypes import DType
from gwgrad.spec import TUNING_FIELDS

DATA = Path(__file__).parent / "data" / "tuning_defaults.json"

#: hidden and intermediate extents, each against each (the order of a row's codes: hidden
#: major, intermediate minor).
DIMS = (128, 256, 384, 768, 2048, 2880, 4096, 7168, 8192)
#: Extents of the half-chosen tilings' grid (smaller: the same rules, fewer rows).
HALF_DIMS = (128, 256, 768, 2048, 2880, 7168)
EXPERTS = (8, 32, 128)
OUTPUTS = (("bfloat16", False), ("bfloat16", True), ("float16", False), ("float16", True),
           ("float32", False), ("float32", True))
#: (arch, format): BF16, the SM90 FP8 recipes, SM100's MXFP8 and NVFP4, the CPU reference.
FORMATS = (("sm_90a", "bf16"), ("sm_90a", "blocked"), ("sm_90a", "block_1x128"),
           ("sm_90a", "per_expert_channel"), ("sm_100a", "bf16"), ("sm_100a", "blocked"),
           ("sm_100a", "nvfp4"), ("cpu", "bf16"), ("cpu", "per_expert_channel"))
#: Tokens per expert: unknown, the last count the short-expert rules take, one past it.
TOKENS = ("none", "384", "385")
#: The caller's tiling per architecture: open, the tile alone, the cluster alone.
HALF = {"sm_90a": (("tile", (128, 128)), ("tile", (128, 256)), ("cluster", (1, 1)),
                   ("cluster", (1, 2))),
        "sm_100a": (("tile", (256, 128)), ("cluster", (1, 1))),
        "cpu": (("tile", (128, 128)), ("cluster", (1, 2)))}
CODES = string.digits + string.ascii_letters


def request(arch: str, fmt: str, hidden: int, intermediate: int, experts: int, out: str,
            acc: bool, tile=None, cluster=None):
    """The spec a caller would build (tests/kernel_compile.py's helpers)."""
    from kernel_compile import fp8_spec, spec

    shape = dict(hidden=hidden, intermediate=intermediate, experts=experts, out=out, acc=acc,
                 tile=tile, cluster=cluster)
    if fmt == "bf16":
        return spec(arch, **shape)
    if fmt == "nvfp4":
        return dataclasses.replace(fp8_spec(arch, "blocked", **shape),
                                   a_dtype=DType.FLOAT4_E2M1FN_X2, b_dtype=DType.FLOAT4_E2M1FN_X2,
                                   sf_dtype=DType.FLOAT8_E4M3FN, sf_vec_size=16,
                                   has_global_scale=True)
    return fp8_spec(arch, fmt, **shape)


def tokens_sum(tokens: str, experts: int) -> Optional[int]:
    return None if tokens == "none" else int(tokens) * experts


def rows() -> Iterator[Tuple[str, List[tuple]]]:
    """(row name, the arguments of ``request`` and the tokens of each of its cells)."""
    for (arch, fmt), (out, acc), experts, tokens in itertools.product(
            FORMATS, OUTPUTS, EXPERTS, TOKENS):
        name = f"{arch} {fmt} {out} acc={int(acc)} experts={experts} tokens={tokens} open"
        yield name, [((arch, fmt, h, n, experts, out, acc), tokens_sum(tokens, experts))
                     for h, n in itertools.product(DIMS, DIMS)]
    for (arch, fmt), (out, acc), tokens in itertools.product(FORMATS, OUTPUTS, TOKENS[:2]):
        for field, value in HALF[arch]:
            name = (f"{arch} {fmt} {out} acc={int(acc)} experts=32 tokens={tokens} "
                    f"{field}={value[0]}x{value[1]}")
            yield name, [((arch, fmt, h, n, 32, out, acc), tokens_sum(tokens, 32), field, value)
                         for h, n in itertools.product(HALF_DIMS, HALF_DIMS)]


def describe(spec) -> str:
    """The tuning of a finalized spec, as the table writes it."""
    (m, n), (cm, cn) = spec.mma_tiler_mn, spec.cluster_shape_mn
    return (f"{m}x{n} cluster {cm}x{cn} raster {spec.raster_group} epi_n {spec.epi_tile_n} "
            f"sets {spec.epi_buffer_sets} launches {spec.launches} "
            f"schedule {spec.unit_schedule}")


def finalized(cell: tuple) -> str:
    """The finalized tuning of one grid cell, ``check_support`` set aside."""
    from gwgrad import backends

    args, tokens, *half = cell
    tiling = {half[0]: half[1]} if half else {}
    spec = request(*args, **tiling)
    backend = backends.get_backend(spec)
    saved = backend.__dict__.get("check_support")
    backend.check_support = lambda spec: None
    try:
        final, _ = backends.finalize_spec(spec, tokens)
    finally:
        if saved is None:
            del backend.check_support
        else:
            backend.check_support = saved
    return describe(final)


def compute() -> Dict[str, object]:
    tunings: List[str] = []
    table: Dict[str, str] = {}
    for name, cells in rows():
        codes = []
        for cell in cells:
            tuning = finalized(cell)
            if tuning not in tunings:
                tunings.append(tuning)
            codes.append(CODES[tunings.index(tuning)])
        table[name] = "".join(codes)
    return {"note": ("Generated by `python tests/test_tuning_rules.py --write`: "
                     "backends.finalize_spec with check_support set aside. Regenerate only for "
                     "a default changed on purpose (its rule and measurement in "
                     "docs/PERFORMANCE.md). A row holds one code per cell: hidden in DIMS "
                     "(HALF_DIMS for half-chosen tilings) major, intermediate minor; a code "
                     "indexes 'tunings'."),
            "dims": list(DIMS), "half_dims": list(HALF_DIMS), "tunings": tunings,
            "rows": table}


def test_the_defaults_are_the_frozen_ones():
    want = json.loads(DATA.read_text())
    assert want["dims"] == list(DIMS) and want["half_dims"] == list(HALF_DIMS)
    changed = []
    for name, cells in rows():
        assert name in want["rows"], f"row {name!r} is not in {DATA.name}"
        for cell, code in zip(cells, want["rows"][name]):
            got = finalized(cell)
            expected = want["tunings"][CODES.index(code)]
            if got != expected:
                changed.append(f"{name} hidden={cell[0][2]} intermediate={cell[0][3]}: "
                               f"{got}, want {expected}")
    assert not changed, f"{len(changed)} defaults changed, e.g.\n" + "\n".join(changed[:20])
    assert len(want["rows"]) == sum(1 for _ in rows())


def test_the_table_covers_every_rule_outcome():
    """The frozen grid is not trivial: it holds each SM90 tiling the rules pick, both unit
    schedules, both staging-set counts and both launch counts."""
    tunings = " | ".join(json.loads(DATA.read_text())["tunings"])
    for part in ("128x128 cluster 1x2", "128x256 cluster 2x1", "128x256 cluster 1x1",
                 "128x192 cluster 2x1", "128x192 cluster 1x1", "64x128 cluster 1x1",
                 "256x256 cluster 2x1", "256x128 cluster 2x1", "sets 2", "sets 1",
                 "launches 1", "launches 2", "schedule 3", "schedule 1", "epi_n 32",
                 "epi_n 64", "epi_n 0"):
        assert part in tunings, part


@pytest.mark.parametrize("arch,fmt", [f for f in FORMATS if f[0] != "cpu"])
def test_every_default_passes_check_support(arch, fmt):
    """The open grid's defaults (tokens unknown and short) are runnable: ``finalize_spec``,
    ``check_support`` included, accepts each."""
    pytest.importorskip("cutlass")
    from gwgrad.backends import finalize_spec

    for (out, acc), experts in itertools.product(OUTPUTS, EXPERTS[:2]):
        for h, n in itertools.product(DIMS, DIMS):
            for tokens in (None, 384 * experts):
                finalize_spec(request(arch, fmt, h, n, experts, out, acc), tokens)


def test_every_rule_decides_a_field_on_the_grid():
    """No rule is dead: each decides some field of some grid cell (``decide`` names the rule
    behind every field; the pingpong staging sets need a caller's 128x128 tile there)."""
    from gwgrad import backends
    from gwgrad.backends.tuning_rules import TABLES, decide

    used = set()
    for _, cells in rows():
        for args, tokens, *half in cells:
            spec = request(*args, **({half[0]: half[1]} if half else {}))
            decided = decide(backends.get_backend(spec).tuning_rules, spec, tokens)
            used |= {rule for _, rule in decided.values()}
    # MXFP8 with mainloop=2 (a caller's choice, off the grid): its table's launches rule.
    spec = request("sm_90a", "blocked", 2048, 768, 8, "bfloat16", False).with_tuning(mainloop=2)
    used |= {rule for _, rule in decide(backends.get_backend(spec).tuning_rules, spec).values()}
    every = {rule.name for table in TABLES.values() for rule in table}
    assert sorted(every - used) == []


def test_the_plan_path_pins_what_the_tokens_decide():
    """``plan.compile_spec`` keys its operators by ``backends.tiling_for_tokens(request,
    tokens_sum)`` and finalizes that without the tokens: the same tuning as finalizing the
    request with them, on every open grid cell whose tokens are known."""
    from gwgrad import backends
    from gwgrad.backends.tuning_rules import resolve

    for name, cells in rows():
        if not name.endswith(" open") or "tokens=none" in name:
            continue
        for args, tokens in cells:
            spec = request(*args)
            rules = backends.get_backend(spec).tuning_rules
            pinned = backends.tiling_for_tokens(spec, tokens)
            assert resolve(rules, pinned) == resolve(rules, spec, tokens), (name, args)
            blind = resolve(rules, spec)
            assert pinned == spec or any(
                getattr(pinned.tuning, f) not in (None, 0, getattr(blind, f))
                for f in TUNING_FIELDS)


def test_the_caller_keeps_what_it_set():
    from gwgrad.backends.tuning_rules import SM90_BF16, decide

    spec = request("sm_90a", "bf16", 7168, 4096, 32, "bfloat16", False, tile=(128, 128))
    decided = decide(SM90_BF16, spec.with_tuning(unit_schedule=1, launches=2))
    assert decided["mma_tiler_mn"] == ((128, 128), "caller")
    assert decided["cluster_shape_mn"] == ((1, 1), "sm90-pingpong")  # pairs need an open tiling
    assert decided["unit_schedule"] == (1, "caller") and decided["launches"] == (2, "caller")
    assert decided["epi_tile_n"] == (64, "sm90-epi-16bit")


def test_rules_are_read_strictly():
    from gwgrad.backends.tuning_rules import REFERENCE, Rule, decide, rules

    assert Rule.parse("x: tiles >= 4096 and not acc -> 128x256 1x1 launches=2").sets == (
        ("mma_tiler_mn", (128, 256)), ("cluster_shape_mn", (1, 1)), ("launches", 2))
    assert Rule.parse("x: -> unit_schedule=balanced").sets == (("unit_schedule", 3),)
    for line in ("x: tiles >= 4096", "x: flops > 1 -> launches=1", "x: not tiles > 1 -> launches=1",
                 "x: -> 128x256 cluster=1x1", "x: -> splits=2", "x: -> unit_schedule=static",
                 "x: -> launches=one", "x: -> launches=2 2x1"):
        with pytest.raises(ValueError):
            Rule.parse(line)
    with pytest.raises(ValueError, match="twice"):
        rules("x: -> launches=1", "x: -> launches=2")
    spec = request("cpu", "bf16", 512, 512, 8, "bfloat16", False)
    with pytest.raises(RuntimeError, match="set no mma_tiler_mn"):
        decide(rules("x: -> launches=1"), spec)
    with pytest.raises(RuntimeError, match="reads 'schedule' before the tiling"):
        decide(rules("x: schedule == pingpong -> 128x128 1x1") + REFERENCE, spec)
    # A comparison with the tokens unknown is false; with them known, exact (no rounding).
    short = rules("short: tokens <= 384 -> 128x128 1x2") + REFERENCE
    assert decide(short, spec)["mma_tiler_mn"] == ((128, 256), "cpu-tiling")
    assert decide(short, spec, 384 * 8)["mma_tiler_mn"] == ((128, 128), "short")
    assert decide(short, spec, 384 * 8 + 1)["mma_tiler_mn"] == ((128, 256), "cpu-tiling")


@pytest.mark.parametrize("arch,fmt", FORMATS)
def test_one_launch_by_default_exactly_where_the_backend_runs_one(arch, fmt):
    """The launches rule of each table agrees with the backend's ``single_launch_problem``:
    one launch wherever the GEMM can do the prep work itself (JAX asks for two)."""
    from gwgrad import backends

    spec = request(arch, fmt, 2048, 768, 8, "bfloat16", False)
    backend = backends.get_backend(spec)
    launches = backends.tuning_rules.resolve(backend.tuning_rules, spec).launches
    assert launches == (1 if backend.single_launch_problem(spec) is None else 2)


def test_every_rule_is_cited_with_its_measurement():
    """docs/PERFORMANCE.md's "Defaults and why" names every rule of every table, and each of
    its bullets names at least one rule and nothing that looks like a rule but is not one."""
    import re

    from gwgrad.backends.tuning_rules import TABLES

    text = (Path(__file__).parents[1] / "docs" / "PERFORMANCE.md").read_text()
    section = text.split("## Defaults and why", 1)[1].split("\n## ", 1)[0]
    every = {rule.name for table in TABLES.values() for rule in table}
    cited = set(re.findall(r"`((?:sm90|fp8|sm100|cpu)-[\w-]+)`", section))
    assert sorted(every - cited) == [] and sorted(cited - every) == []
    bullets = re.findall(r"^- .*(?:\n  .*)*", section, flags=re.M)
    assert bullets and all(re.search(r"`(?:sm90|fp8|sm100|cpu)-[\w-]+`", b) for b in bullets)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {DATA}")
    args = parser.parse_args(argv)
    table = compute()
    if args.write:
        DATA.parent.mkdir(exist_ok=True)
        DATA.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {DATA}: {len(table['rows'])} rows, {len(table['tunings'])} tunings")
    else:
        print(json.dumps(table["tunings"], indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
