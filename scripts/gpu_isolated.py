#!/usr/bin/env python
"""Developer tool for the GPU host: run pytest node ids one process each, in parallel, with a
timeout, so that one kernel fault or hang cannot take the other checks down with it.

    python scripts/gpu_isolated.py [--workers 12] [--timeout 120] [--json out.json] tests/...
"""
import argparse
import concurrent.futures as cf
import json
import subprocess
import sys
import time


def collect(paths):
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                          "no:cacheprovider", *paths], capture_output=True, text=True)
    return [l.strip() for l in out.stdout.splitlines() if "::" in l]


def run_one(node, timeout):
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                            "-W", "ignore", node], capture_output=True, text=True, timeout=timeout)
        status = "pass" if p.returncode == 0 else ("skip" if "skipped" in p.stdout and p.returncode == 0 else "fail")
        tail = (p.stdout + p.stderr)[-1500:] if p.returncode != 0 else ""
    except subprocess.TimeoutExpired:
        status, tail = "TIMEOUT", ""
    return {"node": node, "status": status, "seconds": round(time.time() - t0, 1), "tail": tail}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--json", default="isolated.json")
    a = ap.parse_args()
    nodes = collect(a.paths)
    print(f"{len(nodes)} tests", flush=True)
    results = []
    with cf.ThreadPoolExecutor(a.workers) as ex:
        for r in ex.map(lambda n: run_one(n, a.timeout), nodes):
            results.append(r)
            print(f"{r['status']:8} {r['seconds']:6.1f}s {r['node']}", flush=True)
    with open(a.json, "w") as f:
        json.dump(results, f, indent=1)
    bad = [r for r in results if r["status"] not in ("pass", "skip")]
    for r in bad[:6]:
        print("----", r["node"], r["status"])
        print(r["tail"][-700:])
    print(f"summary: {len(results) - len(bad)} ok, {len(bad)} not ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
