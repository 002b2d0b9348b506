"""A/B of two source trees of gwgrad on the GPU: the same tuning bench (gwgrad's variants
alone, `python -m gwgrad bench --gwgrad-only`) run in turn from an old tree and from this
checkout, in the order A B B A A B ... (each tree first as often as last), each run a fresh
process. The kernel cache keys on the source hash, so the two trees never share a kernel.

For a kernel change that has no spec field to tell the two versions apart in one process:
    mkdir ab_old && git archive <old commit> gwgrad | tar -x -C ab_old
    python scripts/ab_bench.py --old ab_old --reps 2 --json $OUT/ab.json -- --rows dsv3-fc1
(ab_old/ and every ab_*/ are git-ignored: name them in the device tool's carry to send them
to the GPU.) --new DIR times another tree instead of this checkout (two variants of one
baseline: ab_bench.py --old ab_old --new ab_v1, then --new ab_v2).

Prints, per row and variant, old and new TFLOP/s (median over the reps, each rep's figure
beside it), new / old, and a verdict from the reps: rep r pairs the r-th run of each tree,
which ran next to each other; "faster" / "slower" when every rep's new / old lies on that
side of 1, "mixed" otherwise (the noise is larger than the difference). A last line counts
the verdicts and gives the geomean of new / old. Arguments after ``--`` go to the bench
(default: every row, --rounds 10 --sample-ms 12). Exit status 1 when a bench run fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time


def bench_cmd(json_path: str, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "gwgrad", "bench", "--gwgrad-only", "--plot", "",
           "--json", json_path]
    if "--tiles" not in extra:
        cmd += ["--tiles", ""]
    if "--rounds" not in extra:
        cmd += ["--rounds", "10"]
    if "--sample-ms" not in extra:
        cmd += ["--sample-ms", "12"]
    return cmd + extra


def order(reps: int) -> list[str]:
    """A B, B A, A B, ...: each tree runs first in half the reps."""
    out = []
    for r in range(reps):
        out += ["old", "new"] if r % 2 == 0 else ["new", "old"]
    return out


def rates(path: str) -> dict:
    """{(row, dist, variant): TFLOP/s} of one bench JSON (variant 'gwgrad' is the default)."""
    with open(path) as f:
        doc = json.load(f)
    return {(r["name"], r["dist"], m): v["tflops"] for r in doc["rows"]
            for m, v in r["methods"].items() if v.get("tflops")}


def summarize(runs: dict) -> list[dict]:
    keys = sorted(set().union(*(set(r) for rs in runs.values() for r in rs)))
    table = []
    for key in keys:
        old = [r[key] for r in runs["old"] if key in r]
        new = [r[key] for r in runs["new"] if key in r]
        if not old or not new:
            continue
        per_rep = [n / o for o, n in zip(old, new)]
        verdict = ("faster" if all(r > 1 for r in per_rep) else
                   "slower" if all(r < 1 for r in per_rep) else "mixed")
        table.append({"row": key[0], "dist": key[1], "variant": key[2], "old": old, "new": new,
                      "new_over_old": statistics.median(new) / statistics.median(old),
                      "per_rep": per_rep, "verdict": verdict})
    return table


def overall(table: list[dict]) -> str:
    """The verdicts counted and the geomean of new / old over the table's lines."""
    if not table:
        return "no rows"
    counts = {v: sum(t["verdict"] == v for t in table) for v in ("faster", "slower", "mixed")}
    geomean = math.exp(sum(math.log(t["new_over_old"]) for t in table) / len(table))
    return (f"{len(table)} lines: {counts['faster']} faster, {counts['slower']} slower, "
            f"{counts['mixed']} mixed in every rep; geomean new/old {geomean:.3f}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, help="a directory holding the old tree's gwgrad/")
    p.add_argument("--new", default="",
                   help="a directory holding the new tree's gwgrad/ (default: this checkout)")
    p.add_argument("--reps", type=int, default=2, help="runs of each tree (default 2)")
    p.add_argument("--timeout", type=int, default=240, help="seconds per bench run")
    p.add_argument("--json", default="", help="write the table here")
    args = p.parse_args(argv)
    old_dir = os.path.abspath(args.old)
    if not os.path.isfile(os.path.join(old_dir, "gwgrad", "__init__.py")):
        p.error(f"--old: expected a directory holding gwgrad/__init__.py, got {args.old!r}")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if args.new:
        here = os.path.abspath(args.new)
        if not os.path.isfile(os.path.join(here, "gwgrad", "__init__.py")):
            p.error(f"--new: expected a directory holding gwgrad/__init__.py, got {args.new!r}")
    runs = {"old": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="gwgrad-ab-") as tmp:
        for i, tag in enumerate(order(args.reps)):
            env = dict(os.environ)
            root = old_dir if tag == "old" else here
            env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
            where = subprocess.run([sys.executable, "-c", "import gwgrad; print(gwgrad.__file__)"],
                                   env=env, cwd=root, capture_output=True, text=True)
            if not where.stdout.strip().startswith(os.path.join(root, "gwgrad")):
                print(f"{tag}: gwgrad imports from {where.stdout.strip()!r}, not {root}/gwgrad"
                      f" {where.stderr[-500:]}")
                return 1
            path = os.path.join(tmp, f"{i}_{tag}.json")
            start = time.time()
            proc = subprocess.run(bench_cmd(path, extra), env=env, cwd=root,
                                  capture_output=True, text=True, timeout=args.timeout)
            print(f"run {i} {tag}: rc={proc.returncode} {time.time() - start:.0f} s", flush=True)
            if proc.returncode != 0:
                print(proc.stdout[-2000:], proc.stderr[-3000:], sep="\n")
                return 1
            runs[tag].append(rates(path))
    table = summarize(runs)
    print(f"{'row':14} {'dist':8} {'variant':42} {'old':>8} {'new':>8} {'new/old':>8} "
          f"{'verdict':7}  each rep (old/new)")
    for t in table:
        reps = " ".join(f"{o:.1f}/{n:.1f}" for o, n in zip(t["old"], t["new"]))
        print(f"{t['row']:14} {t['dist']:8} {t['variant'][:42]:42} "
              f"{statistics.median(t['old']):8.1f} {statistics.median(t['new']):8.1f} "
              f"{t['new_over_old']:8.3f} {t['verdict']:7}  {reps}")
    print(overall(table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"old": args.old, "new": args.new or "checkout", "reps": args.reps, "bench_args": extra, "rows": table,
                       "summary": overall(table)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
