"""The documents' figures against the canonical result files in docs/results/ (CPU, no GPU).

README.md and docs/PERFORMANCE.md mark every table of measured figures with a comment on the
line above it, ``<!-- table NAME: docs/results/FILE -->``. This module computes each such table
from FILE (``TABLES``: header and every cell, rounded as printed) and compares it with the
document, cell by cell. Ratios are always computed from the same medians as the TFLOP/s
columns beside them. Figures in prose (ranges, geomeans, times) are ``claims()``, computed from
the same files; in the documents' measured sections every figure with a unit must be one.

Also checked: at most ``MAX_RESULT_FILES`` files in docs/results/, each named in
docs/PERFORMANCE.md, every file named there present, each table's run statement (file, GPU,
driver, commit, date, re-run command), and the documents' line limits.

``python tests/test_docs.py`` prints every table and claim as the documents should hold them.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
README = ROOT / "README.md"
PERFORMANCE = ROOT / "docs" / "PERFORMANCE.md"
DESIGN = ROOT / "docs" / "DESIGN.md"
CONTRACT = ROOT / "docs" / "CONTRACT.md"
MAX_RESULT_FILES = 11
LINE_LIMITS = {README: 300, PERFORMANCE: 150, DESIGN: 200}

BENCH = "h200_bench.json"
ACCUMULATE = "h200_bench_accumulate.json"
FP8 = "h200_bench_fp8.json"
QUANTIZE = "h200_bench_quantize.json"
OVERHEAD = "h200_host_overhead.json"
COLDSTART = "h200_coldstart.json"
GPU_TESTS = "h200_gpu_tests.json"
FUZZ = "h200_fuzz.json"
SANITIZE = "h200_sanitize.json"
SOAK = "h200_soak.json"


def load(name: str):
    return json.loads((RESULTS / name).read_text())


# --- how the documents print a figure -------------------------------------------------------

def tflops(x: float) -> str:
    return f"{x:.0f}"


def ratio(x: float) -> str:
    return f"{x:.2f}"


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def percent(x: float) -> str:
    """A fraction inside a range of percentages (the unit follows the range)."""
    return f"{100 * x:.0f}"


def us(x: float) -> str:
    return f"{x:.1f}"


def seconds(x: float) -> str:
    return f"{x:.3f}"


def span(values: Sequence[float], fmt: Callable[[float], str] = ratio, unit: str = "x") -> str:
    """A range as the prose prints it: ``1.03-2.04x`` (one value when both ends print alike)."""
    lo, hi = fmt(min(values)), fmt(max(values))
    return (lo if lo == hi else f"{lo}-{hi}") + unit


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def by_shape(rows) -> List[Tuple[dict, dict]]:
    """(uniform, zipf) pairs of rows, in the file's order of shapes."""
    pairs = []
    for r in rows:
        if r["dist"] == "uniform":
            z = next(z for z in rows if z["name"] == r["name"] and z["dist"] == "zipf")
            pairs.append((r, z))
    return pairs


def both(pair, fmt: Callable) -> str:
    """One cell for a shape's two count distributions, ``uniform / zipf``; a setting (not a
    figure) that is the same for both is printed once."""
    u, z = fmt(pair[0]), fmt(pair[1])
    return u if u == z and not re.fullmatch(r"[\d.]+%?", u) else f"{u} / {z}"


# --- the bench files: BF16, FP32 accumulation -----------------------------------------------

def speedup(row, method: str, over: str = "adapter") -> float:
    """``over``'s speed over ``method``'s: method's median time over over's (the same medians
    as the TFLOP/s columns)."""
    m = row["methods"]
    return m[method]["ms"] / m[over]["ms"]


def rate(method: str) -> Callable:
    return lambda r: tflops(r["methods"][method]["tflops"])


def tiling(row) -> str:
    m, n = row["gwgrad_config"]
    tuning = row["gwgrad_tuning"]
    text = f"{m}x{n}"
    cm, cn = tuning["cluster_shape_mn"]
    if (cm, cn) != (1, 1):
        text += f", {cm}x{cn} " + ("pair" if cm * cn == 2 else "cluster")
    if tuning["epi_buffer_sets"] == 2:
        text += ", 2 staging sets"
    return text


def tokens_per_expert(row) -> float:
    return row["tokens_sum"] / row["num_experts"]


def dims(row) -> str:
    return f"{row['num_experts']} x {row['hidden']} x {row['intermediate']}, {row['tokens_sum']}"


def table_bf16(bench):
    header = ["shape", "experts x hidden x intermediate, tokens", "gwgrad (torch adapter)",
              "default tiling", "contract wrapper", "`torch._grouped_mm`", "per-expert `torch.mm`",
              "QuACK default", "QuACK autotuned", "dense cuBLAS", "x `_grouped_mm`", "x loop",
              "x QuACK default", "x QuACK autotuned", "x dense", "HBM roofline"]
    rows = []
    for p in by_shape(bench["rows"]):
        rows.append([p[0]["name"], dims(p[0]), both(p, rate("adapter")), both(p, tiling),
                     both(p, rate("wrapper")), both(p, rate("torch_grouped_mm")),
                     both(p, rate("torch_mm_loop")), both(p, rate("quack_default")),
                     both(p, rate("quack_tuned")), both(p, rate("dense_cublas")),
                     both(p, lambda r: ratio(speedup(r, "torch_grouped_mm"))),
                     both(p, lambda r: ratio(speedup(r, "torch_mm_loop"))),
                     both(p, lambda r: ratio(speedup(r, "quack_default"))),
                     both(p, lambda r: ratio(speedup(r, "quack_tuned"))),
                     both(p, lambda r: ratio(speedup(r, "dense_cublas"))),
                     both(p, lambda r: pct(r["hbm"]["fraction"]["adapter"]))
                     if p[0]["small_experts"] else "-"])
    return header, rows


def table_bf16_readme(bench):
    header = ["shape", "gwgrad TFLOP/s", "default tiling", "`torch._grouped_mm`",
              "QuACK autotuned", "dense cuBLAS", "x `_grouped_mm`", "x QuACK default",
              "x QuACK autotuned", "x dense"]
    rows = []
    for p in by_shape(bench["rows"]):
        rows.append([p[0]["name"], both(p, rate("adapter")), both(p, tiling),
                     both(p, rate("torch_grouped_mm")), both(p, rate("quack_tuned")),
                     both(p, rate("dense_cublas")),
                     both(p, lambda r: ratio(speedup(r, "torch_grouped_mm"))),
                     both(p, lambda r: ratio(speedup(r, "quack_default"))),
                     both(p, lambda r: ratio(speedup(r, "quack_tuned"))),
                     both(p, lambda r: ratio(speedup(r, "dense_cublas")))])
    return header, rows


def table_accumulate(acc):
    header = ["shape", "gwgrad (torch adapter)", "default tiling", "contract wrapper",
              "`_grouped_mm` + `add_`", "loop `+=`", "x grouped + add", "x loop", "HBM roofline"]
    rows = []
    for p in by_shape(acc["rows"]):
        rows.append([p[0]["name"], both(p, rate("adapter")), both(p, tiling),
                     both(p, rate("wrapper")), both(p, rate("torch_grouped_mm")),
                     both(p, rate("torch_mm_loop")),
                     both(p, lambda r: ratio(speedup(r, "torch_grouped_mm"))),
                     both(p, lambda r: ratio(speedup(r, "torch_mm_loop"))),
                     both(p, lambda r: pct(r["hbm"]["fraction"]["adapter"]))])
    return header, rows


# --- FP8 recipes ----------------------------------------------------------------------------

#: The FP8 run's variant timing MXFP8's promoting kernel at its default tile (the
#: wrapper's default is the two-pass path).
PROMOTE = "64x128:mainloop=1"
FP8_METHODS = (("fp8_channel", "FP8 channel"), ("fp8_1x128", "FP8 1x128"), ("fp8_mx", "MXFP8"))


def fp8_tile(fp8, method: str) -> str:
    """The default tile of ``method`` where every row has the same, else "tile per row" (MXFP8
    in two passes takes the BF16 kernel's default tiling, which follows the shape)."""
    tiles = {r["tiles"][method] for r in fp8["rows"]}
    return tiles.pop() if len(tiles) == 1 else "tile per row"


def fp8_over(row, method: str, over: str) -> float:
    """``method``'s speed over ``over``'s (over's median time / method's)."""
    m = row["methods"]
    return m[over]["ms"] / m[method]["ms"]


def fp8_ratio(method: str, over: str) -> Callable:
    return lambda r: ratio(fp8_over(r, method, over))


def table_fp8(fp8):
    header = (["shape", "gwgrad BF16"]
              + [f"{label} ({fp8_tile(fp8, key)})" for key, label in FP8_METHODS]
              + ["`torch._scaled_grouped_mm`", "dense FP8 `_scaled_mm`", "channel / torch",
                 "channel / dense FP8", "channel / BF16", "1x128 / BF16", "MXFP8 / BF16"])
    rows = []
    for p in by_shape(fp8["rows"]):
        rows.append([p[0]["name"], both(p, rate("gwgrad_bf16"))]
                    + [both(p, rate(key)) for key, _ in FP8_METHODS]
                    + [both(p, rate("torch_scaled_grouped_mm")), both(p, rate("dense_fp8")),
                       both(p, fp8_ratio("fp8_channel", "torch_scaled_grouped_mm")),
                       both(p, fp8_ratio("fp8_channel", "dense_fp8")),
                       both(p, fp8_ratio("fp8_channel", "gwgrad_bf16")),
                       both(p, fp8_ratio("fp8_1x128", "gwgrad_bf16")),
                       both(p, fp8_ratio("fp8_mx", "gwgrad_bf16"))])
    return header, rows


def fp8_large_rows(fp8, bench):
    """FP8 rows of the shapes with >= 2048 tokens per expert on average (the BF16 bench holds
    the shapes' dimensions)."""
    tpe = {r["name"]: tokens_per_expert(r) for r in bench["rows"]}
    return [r for r in fp8["rows"] if tpe[r["name"]] >= 2048]


# --- quantizers -----------------------------------------------------------------------------

QUANT_FORMATS = ("mxfp8", "block_1x128", "per_expert_channel", "nvfp4", "mxfp4")
STEP_RECIPES = ("per_expert_channel", "block_1x128", "mxfp8")


def operands(q) -> List[Tuple[dict, dict]]:
    """(x, dy) pairs of the quantizer bench's rows, in the file's order of shapes."""
    pairs = []
    for r in q["rows"]:
        if r["operand"] == "x":
            dy = next(d for d in q["rows"] if d["shape"] == r["shape"] and d["operand"] == "dy")
            pairs.append((r, dy))
    return pairs


def table_quantize(q):
    header = ["shape", "tokens x channels (x / dy)"] + [f"{f} (us)" for f in QUANT_FORMATS]
    rows = []
    for x, dy in operands(q):
        rows.append([x["shape"], f"{x['tokens']} x {x['channels']} / {dy['channels']}"]
                    + [f"{x['methods'][f'gwgrad:{f}']['us']:.0f} / "
                       f"{dy['methods'][f'gwgrad:{f}']['us']:.0f}" for f in QUANT_FORMATS])
    return header, rows


def step_speedup(step, recipe: str) -> float:
    m = step["methods"]
    return m["bf16"]["us"] / m[f"step:{recipe}"]["us"]


# --- host overhead, cold start --------------------------------------------------------------

OVERHEAD_ROWS = (
    ("plan_launch", "`plan.launch`"),
    ("plan_launch_two_launches", "two launches"),
    ("wrapper", "wrapper"),
    ("wrapper_same_offsets", "wrapper, same offsets"),
    ("class_execute", "class `execute`"),
    ("torch_wgrad_out", "torch `out=`"),
    ("torch_wgrad_alloc", "torch, allocating"),
    ("torch_op_into", "torch op"),
    ("cupy_wgrad_out", "CuPy `out=`"),
    ("jax_jit_call", "JAX `jit`"),
)


def table_overhead(o):
    header = [label for _, label in OVERHEAD_ROWS] + ["GPU time, one launch / two"]
    row = [us(o["overhead_us"][key]) for key, _ in OVERHEAD_ROWS]
    row.append(f"{us(o['overhead_gpu_floor_us'])} / {us(o['overhead_gpu_floor_two_launches_us'])}")
    return header, [row]


def table_coldstart(c):
    header = ["kernel cache", "`import gwgrad` (s)", "first call (s)", "total (s)",
              "CuTe DSL imported"]
    runs = [(f"warm (run {i + 1})", run) for i, run in enumerate(c["warm"])]
    runs.append(("empty", c["cold"]))
    return header, [[label, seconds(r["import_s"]), seconds(r["first_call_s"]),
                     seconds(r["total_s"]), "yes" if r["cutlass_imported"] else "no"]
                    for label, r in runs]


# --- verification runs ----------------------------------------------------------------------

def gpu_test_counts(tests) -> Dict[str, int]:
    counts = {"pass": 0, "skip": 0, "fail": 0}
    for t in tests:
        counts[t["status"]] = counts.get(t["status"], 0) + 1
    return counts


def gpu_tests_line(tests) -> str:
    c = gpu_test_counts(tests)
    return f"{c['pass']} passed, {c['skip']} skipped, {c['fail']} failed"


def fuzz_line(f) -> str:
    s = f["summary"]
    return (f"{s['cases']} cases over {s['specs']} specs: {s['mismatches']} mismatches, "
            f"{s['guard_writes']} guard writes")


def sanitize_line(s) -> str:
    t = s["tools"]
    errors = sum(v["errors"] for v in t.values())
    hazards = sum(v["racecheck_hazards"] for v in t.values())
    return (f"memcheck {len(t['memcheck']['cases'])} cases, racecheck "
            f"{len(t['racecheck']['cases'])}, synccheck {len(t['synccheck']['cases'])}: "
            f"{errors} errors, {hazards} hazards")


def soak_line(s) -> str:
    growth = s["memory"]["growth"]
    kernels = s["kernels"]
    return (f"{s['calls']['total']} calls from {s['config']['threads']} threads over "
            f"{len(s['specs'])} specs; memory +{growth['allocated']} B allocated, "
            f"+{growth['driver_used']} B driver; {kernels['total']['compiles']} kernels compiled, "
            f"{kernels['after_warmup']['compiles']} after warm-up")


def soak_graph_line(s) -> str:
    g = s["graphs"]
    equal = min(g["bit_equal"].values())
    every = "every replay" if equal == g["replays"] else f"{equal} replays"
    return (f"{len(g['bit_equal'])} captured calls replayed {g['replays']} times each with new "
            f"offsets, {every} bit-equal to an eager call")


def table_verification(data):
    header = ["run on the H200", "result", "re-run"]
    rows = [["GPU tests: kernels, API, adapters, status", gpu_tests_line(data[GPU_TESTS]),
             "`bash tools/gpu_run.sh tests`"],
            ["fuzz against FP64, guard bytes around outputs", fuzz_line(data[FUZZ]),
             "`bash tools/gpu_run.sh fuzz`"],
            ["compute-sanitizer", sanitize_line(data[SANITIZE]),
             "`python tools/sanitize.py --json out.json`"],
            ["soak: threads, streams, memory, compiles", soak_line(data[SOAK]),
             "`python tools/soak.py --json out.json`"],
            ["soak: CUDA graphs", soak_graph_line(data[SOAK]), "(the same run)"]]
    return header, rows


#: table name -> (source file, builder). A builder gets its loaded file (the verification
#: table: a dict of every file it names).
TABLES: Dict[str, Tuple[str, Callable]] = {
    "bf16": (BENCH, table_bf16),
    "bf16-readme": (BENCH, table_bf16_readme),
    "fp32-accumulate": (ACCUMULATE, table_accumulate),
    "fp8": (FP8, table_fp8),
    "quantize": (QUANTIZE, table_quantize),
    "host-overhead": (OVERHEAD, table_overhead),
    "coldstart": (COLDSTART, table_coldstart),
    "verification": (GPU_TESTS, table_verification),
}
README_TABLES = {"bf16-readme", "verification"}


def expected_table(name: str):
    source, build = TABLES[name]
    if name == "verification":
        return build({f: load(f) for f in (GPU_TESTS, FUZZ, SANITIZE, SOAK)})
    return build(load(source))


# --- prose claims ---------------------------------------------------------------------------

def claims() -> Dict[str, List[str]]:
    """The figures the documents' prose states, each as printed, per document."""
    bench, acc, fp8 = load(BENCH), load(ACCUMULATE), load(FP8)
    q, o, c = load(QUANTIZE), load(OVERHEAD), load(COLDSTART)
    rows = bench["rows"]
    large = [r for r in rows if not r["small_experts"]]
    small = [r for r in rows if r["small_experts"]]
    grouped = [speedup(r, "torch_grouped_mm") for r in rows]
    same_kernel = [speedup(r, "gwgrad") for r in rows]  # plan.launch and the adapter: one kernel
    acc_grouped = [speedup(r, "torch_grouped_mm") for r in acc["rows"]]
    acc_small = [r for r in acc["rows"] if r["small_experts"]]
    big_fp8 = fp8_large_rows(fp8, bench)
    fp8_formats = ("mxfp8", "block_1x128", "per_expert_channel")
    share = {f: [r["methods"][f"gwgrad:{f}"]["of_copy_bw"] for r in q["rows"]]
             for f in QUANT_FORMATS}
    vs_torch = [r["methods"][f"gwgrad:{f}"]["vs_torch"] for r in q["rows"] for f in fp8_formats]
    ov = o["overhead_us"]
    entry = [ov[k] for k in ("wrapper", "class_execute", "torch_wgrad_out", "torch_wgrad_alloc",
                             "torch_op_into", "cupy_wgrad_out")]
    quack = {k: [speedup(r, f"quack_{k}") for r in rows] for k in ("default", "tuned")}
    common = {
        "bf16 grouped": span(grouped) + " `torch._grouped_mm`",
        "bf16 quack": f"{span(quack['tuned'])} QuACK autotuned ({span(quack['default'])} its "
                      "default config)",
        "bf16 geomean": f"geomean {ratio(geomean(grouped))}",
        "bf16 dense": span([speedup(r, "dense_cublas") for r in large]) + " dense cuBLAS",
        "bf16 hbm": span([r["hbm"]["fraction"]["adapter"] for r in small], percent, "%"),
        "acc grouped": span(acc_grouped) + " `torch._grouped_mm` + `add_`",
        "acc geomean": f"geomean {ratio(geomean(acc_grouped))}",
        "acc hbm": span([r["hbm"]["fraction"]["adapter"] for r in acc_small], percent, "%"),
        "fp8 channel torch": span([fp8_over(r, "fp8_channel", "torch_scaled_grouped_mm")
                                   for r in fp8["rows"]]),
        "fp8 channel bf16": span([fp8_over(r, "fp8_channel", "gwgrad_bf16") for r in big_fp8]),
        "fp8 1x128 bf16": span([fp8_over(r, "fp8_1x128", "gwgrad_bf16") for r in big_fp8]),
        "fp8 mx bf16": span([fp8_over(r, "fp8_mx", "gwgrad_bf16") for r in fp8["rows"]]),
        "fp8 mx bf16 large": span([fp8_over(r, "fp8_mx", "gwgrad_bf16") for r in big_fp8]),
        "fp8 mx promote": span([fp8_over(r, "fp8_mx", f"fp8_mx_{PROMOTE}") for r in fp8["rows"]]),
        "quant fp8": span([v for f in fp8_formats for v in share[f]], percent, "%"),
        "quant fp4": span(share["nvfp4"] + share["mxfp4"], percent, "%"),
        "quant torch": span(vs_torch, lambda v: f"{v:.0f}"),
        "step channel": span([step_speedup(s, "per_expert_channel") for s in q["steps"]]),
        "launch": f"{us(ov['plan_launch'])} us",
        "entry points": span(entry, us, " us"),
        "jax": f"{us(ov['jax_jit_call'])} us",
        "warm": f"{c['summary']['warm_s']:.2f} s",
        "cold": f"{c['summary']['cold_s']:.1f} s",
    }
    readme = {k: common[k] for k in (
        "bf16 grouped", "bf16 geomean", "bf16 quack", "bf16 dense", "bf16 hbm", "acc grouped", "acc geomean",
        "fp8 channel torch", "fp8 channel bf16", "fp8 1x128 bf16", "fp8 mx bf16 large", "quant fp8",
        "step channel", "launch", "entry points", "jax", "warm", "cold")}
    performance = dict(common)
    performance.update({
        "sample": f"{bench['settings']['rounds']} rounds of {bench['settings']['sample_ms']:.0f} ms",
        "copy": f"{bench['summary']['copy_gbps_median'] / 1000:.2f} TB/s",
        "noise": span(same_kernel),
    })
    return {"README.md": list(readme.values()), "PERFORMANCE.md": list(performance.values())}


# --- reading the documents ------------------------------------------------------------------

MARKER = re.compile(r"^<!-- table ([\w-]+): docs/results/([\w.-]+) -->$")


def cells(line: str) -> List[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def marked_tables(text: str) -> Dict[str, Tuple[str, List[str], List[List[str]]]]:
    """name -> (source file, header, rows) of every marked table."""
    lines = text.splitlines()
    found = {}
    for i, line in enumerate(lines):
        m = MARKER.match(line.strip())
        if not m:
            continue
        body = []
        for row in lines[i + 1:]:
            if not row.startswith("|"):
                break
            body.append(row)
        assert len(body) >= 2, f"table {m.group(1)}: no table under its marker"
        assert m.group(1) not in found, f"table {m.group(1)} marked twice"
        found[m.group(1)] = (m.group(2), cells(body[0]), [cells(r) for r in body[2:]])
    return found


def unmarked_tables(text: str) -> List[str]:
    """The first line of every table without a marker on the line above."""
    lines = text.splitlines()
    return [line for i, line in enumerate(lines)
            if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|"))
            and (i == 0 or not MARKER.match(lines[i - 1].strip()))]


def sections(text: str) -> Dict[str, str]:
    """``## title`` -> that section's text."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2])}


#: A figure in prose: a number or a range with a unit; not part of a name (FP8, 1x128, sm_90a).
FIGURE = re.compile(r"(?<![\w.\-/])\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?"
                    r"(?:x(?!\w)|%| ?(?:us|ms|s|TB/s|GB/s|TFLOP/s|PFLOP/s|W|J|GHz|MHz)\b)")
#: Figures that are not measurements: the H200's power limit.
NOT_MEASURED = ("700 W",)


def paragraphs(text: str) -> List[str]:
    """The prose paragraphs of a text, each on one line: no tables, table markers or code
    blocks."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    kept = []
    for para in re.split(r"\n\s*\n", text):
        para = para.strip()
        if para and not para.startswith(("|", "<!--")):
            kept.append(" ".join(para.split()))
    return kept


def unchecked_figures(prose: str, stated: Sequence[str]) -> List[str]:
    """Figures of ``prose`` that are not among the ``stated`` claims."""
    text = "\n".join(paragraphs(prose))
    for claim in sorted(stated, key=len, reverse=True):
        text = text.replace(claim, " ")
    for fixed in NOT_MEASURED:
        text = text.replace(fixed, " ")
    text = re.sub(r"`[^`]*`", " ", text)  # code: commands, names
    text = re.sub(r"\]\([^)]*\)", "]", text)  # link targets
    return FIGURE.findall(text)


# --- the tests ------------------------------------------------------------------------------

def check_table(doc: str, name: str, source: str, header, rows) -> None:
    assert name in TABLES, f"{doc}: unknown table {name}"
    assert source == TABLES[name][0], f"{doc}: table {name} reads {TABLES[name][0]}, not {source}"
    want_header, want_rows = expected_table(name)
    assert header == want_header, f"{doc}, table {name}: header {header}, want {want_header}"
    assert len(rows) == len(want_rows), f"{doc}, table {name}: {len(rows)} rows, want {len(want_rows)}"
    for got, want in zip(rows, want_rows):
        assert got == want, f"{doc}, table {name}: row {got} should read {want}"


@pytest.mark.parametrize("path", [README, PERFORMANCE], ids=lambda p: p.name)
def test_tables_match_the_result_files(path):
    tables = marked_tables(path.read_text())
    for name, (source, header, rows) in tables.items():
        check_table(path.name, name, source, header, rows)
    want = README_TABLES if path == README else set(TABLES) - README_TABLES
    assert set(tables) == want, f"{path.name}'s tables"


def test_every_performance_table_is_checked():
    assert unmarked_tables(PERFORMANCE.read_text()) == []
    assert unmarked_tables(sections(README.read_text())["Performance"]) == []


def test_every_table_states_its_run():
    """Each marked table of PERFORMANCE.md has, in its section, a run statement naming its file,
    the GPU, the driver, the commit and date, and the command that re-runs it."""
    for title, body in sections(PERFORMANCE.read_text()).items():
        runs = re.findall(r"Run: `([\w.-]+)`, NVIDIA H200, driver [\d.]+[^;]*; commit "
                          r"[0-9a-f]{7,40}, \d{4}-\d{2}-\d{2}\. Re-run: `[^`]+`",
                          " ".join(body.split()))
        for source, _, _ in marked_tables(body).values():
            assert source in runs, f"section {title}: no run paragraph for {source}"


@pytest.mark.parametrize("path", [README, PERFORMANCE], ids=lambda p: p.name)
def test_prose_figures_are_claims(path):
    text = path.read_text()
    stated = claims()[path.name]
    flat = " ".join(text.split())  # a claim may wrap across lines
    missing = [c for c in stated if c not in flat]
    assert not missing, f"{path.name} should state (computed from the result files): {missing}"
    parts = sections(text)
    if path == README:
        measured = {t: parts[t] for t in ("Performance", "Reliability")}
    else:  # every section but the rules and the rejected experiments
        measured = {t: b for t, b in parts.items()
                    if t not in ("Defaults and why", "Tried and rejected")}
    for title, body in measured.items():
        assert unchecked_figures(body, stated) == [], (
            f"{path.name}, {title}: figures that no result file gives")


def test_result_files():
    files = sorted(p.name for p in RESULTS.iterdir())
    assert len(files) <= MAX_RESULT_FILES, files
    perf = PERFORMANCE.read_text()
    assert [f for f in files if f not in perf] == [], "result files PERFORMANCE.md does not name"
    rejected = sections(perf)["Tried and rejected"]  # files kept in git history, not in the tree
    named = set(re.findall(r"(h200\w*\.(?:json|csv|log|txt))", perf.replace(rejected, "")))
    named |= set(re.findall(r"docs/results/([\w.-]+)", README.read_text()))
    assert sorted(named - set(files)) == [], "named but not in docs/results/"


@pytest.mark.parametrize("path", list(LINE_LIMITS), ids=lambda p: p.name)
def test_line_limits(path):
    assert len(path.read_text().splitlines()) <= LINE_LIMITS[path]


def test_no_pointer_outside_the_repository():
    for path in (README, PERFORMANCE, DESIGN, CONTRACT):
        assert "shared/" not in path.read_text(), path.name


def test_a_changed_figure_fails():
    """The checks can fail: a figure of the BF16 table one unit off, a row missing, a figure in
    prose that no result file gives."""
    source, header, rows = marked_tables(PERFORMANCE.read_text())["bf16"]
    changed = list(rows[0])
    u, z = changed[2].split(" / ")
    changed[2] = f"{int(u) + 1} / {z}"
    with pytest.raises(AssertionError):
        check_table("PERFORMANCE.md", "bf16", source, header, [changed] + rows[1:])
    with pytest.raises(AssertionError):
        check_table("PERFORMANCE.md", "bf16", source, header, rows[:-1])
    assert unchecked_figures("runs 1.23x faster in 5 ms", []) == ["1.23x", "5 ms"]


if __name__ == "__main__":
    for name in TABLES:
        header, rows = expected_table(name)
        print(f"<!-- table {name}: docs/results/{TABLES[name][0]} -->")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        print()
    for doc, stated in claims().items():
        print(doc, stated)
