"""What the empty experts' zeros cost (issue #12): an A/B (scripts/ab_bench.py) of this
checkout against a copy of it whose SM90 zero warps write nothing, on the zipf rows (the
rows with empty experts). The copy's outputs of empty experts are left as they were, so the
bench runs with --no-check; nothing else in the copy differs (`no_zeros_tree` patches one
line and fails if that line moved).

    python scripts/zero_fill_cost.py --reps 2 --json $OUT/zero_fill_cost.json
    bash scripts/gpu_run.sh zerocost

new / old < 1 is the share of the time the zeros cost (session 15: 0.746 on fine-256e zipf,
0.915 on qwen3-30b-fc1 zipf; docs/PERF_NOTES.md). Arguments after ``--`` replace the bench's
row and distribution defaults below.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL = os.path.join("gwgrad", "kernels", "sm90_bf16.py")
ZERO_LOOP = "for rank in range(ws.live[0], cfg.num_experts):"
NO_ZERO_LOOP = "for rank in range(cfg.num_experts, cfg.num_experts):  # zero_fill_cost.py: no zeros"
DEFAULT_BENCH = ["--dist", "zipf", "--rows", "qwen3-30b-fc1,qwen3-30b-fc2,dsv2lite-fc1,fine-256e"]


def no_zeros_tree(dest: str, root: str = HERE) -> str:
    """Copy ``root``'s gwgrad/ (and adapters/ as gwgrad/adapters, as the package maps it) to
    ``dest`` with zero_empty_experts' loop over the empty experts made empty; returns dest."""
    shutil.copytree(os.path.join(root, "gwgrad"), os.path.join(dest, "gwgrad"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    adapters = os.path.join(root, "adapters")
    if os.path.isdir(adapters):
        shutil.copytree(adapters, os.path.join(dest, "gwgrad", "adapters"),
                        ignore=shutil.ignore_patterns("__pycache__"))
    path = os.path.join(dest, KERNEL)
    with open(path) as f:
        lines = f.read().split("\n")
    hits = [i for i, line in enumerate(lines) if line.strip() == ZERO_LOOP]
    if len(hits) != 1:
        raise RuntimeError(f"{KERNEL}: expected zero_empty_experts' loop {ZERO_LOOP!r} once, "
                           f"found it {len(hits)} times; update scripts/zero_fill_cost.py")
    line = lines[hits[0]]
    lines[hits[0]] = line[:len(line) - len(line.lstrip())] + NO_ZERO_LOOP
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return dest


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = DEFAULT_BENCH
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2, help="runs of each tree (default 2)")
    p.add_argument("--json", default="", help="ab_bench.py's table")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gwgrad-nozeros-") as tmp:
        no_zeros_tree(tmp)
        cmd = [sys.executable, os.path.join(HERE, "scripts", "ab_bench.py"), "--old", tmp,
               "--reps", str(args.reps)]
        if args.json:
            cmd += ["--json", args.json]
        print("old: this checkout without the zero fill; new: this checkout", flush=True)
        return subprocess.run(cmd + ["--", "--no-check"] + extra, cwd=HERE).returncode


if __name__ == "__main__":
    sys.exit(main())
