#!/usr/bin/env python
"""Developer tool for the GPU host: run pytest node ids one process each, in parallel, with a
timeout, so that one kernel fault or hang cannot take the other checks down with it.

    python tools/gpu_isolated.py [--workers 12] [--timeout 120] [--budget S] [--json out.json] tests/...

``--budget``: seconds for the whole run; tests not started by then are reported "not run",
and a test's timeout never reaches past it. The JSON is rewritten after every test, so an
outer ``timeout`` still leaves what finished.
"""
import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import threading
import time


def collect(paths, timeout=None):
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                          "no:cacheprovider", *paths], capture_output=True, text=True,
                         timeout=timeout)
    nodes = [l.strip() for l in out.stdout.splitlines() if "::" in l]
    if not nodes:
        print((out.stdout + out.stderr)[-3000:], flush=True)
    return nodes


def classify(returncode, stdout):
    """pass / skip / fail from a one-test pytest run (exit code 5: nothing collected)."""
    if returncode == 0:
        return "skip" if " skipped" in stdout and " passed" not in stdout else "pass"
    return "fail"


def run_one(node, timeout):
    t0 = time.time()
    if timeout <= 0:
        return {"node": node, "status": "not run", "seconds": 0.0, "tail": "budget spent"}
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                            "-W", "ignore", node], capture_output=True, text=True, timeout=timeout)
        status = classify(p.returncode, p.stdout)
        tail = (p.stdout + p.stderr)[-1500:] if status == "fail" else ""
    except subprocess.TimeoutExpired:
        status, tail = "TIMEOUT", f"after {timeout:.0f} s"
    return {"node": node, "status": status, "seconds": round(time.time() - t0, 1), "tail": tail}


def write(path, results):
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=120, help="seconds per test")
    ap.add_argument("--budget", type=float, default=0, help="seconds for everything (0: none)")
    ap.add_argument("--json", default="isolated.json")
    a = ap.parse_args(argv)
    start = time.time()

    def left():
        return a.budget - (time.time() - start) if a.budget else float("inf")

    missing = [p for p in a.paths if not os.path.exists(p.split("::")[0])]
    for p in missing:
        print(f"missing: {p} (left out)", flush=True)
    paths = [p for p in a.paths if p not in missing]
    nodes = collect(paths, timeout=max(10, min(120, left()))) if paths else []
    print(f"{len(nodes)} tests", flush=True)
    results, lock = [], threading.Lock()

    def job(node):
        r = run_one(node, min(a.timeout, left() - 2))
        with lock:
            results.append(r)
            write(a.json, results)
        print(f"{r['status']:8} {r['seconds']:6.1f}s {r['node']}", flush=True)
        return r

    with cf.ThreadPoolExecutor(a.workers) as ex:
        list(ex.map(job, nodes))
    results.sort(key=lambda r: nodes.index(r["node"]))
    write(a.json, results)
    bad = [r for r in results if r["status"] not in ("pass", "skip")]
    for r in bad[:6]:
        print("----", r["node"], r["status"])
        print(r["tail"][-700:])
    counts = {s: sum(r["status"] == s for r in results)
              for s in ("pass", "skip", "fail", "TIMEOUT", "not run")}
    print(f"summary: {len(results) - len(bad)} ok, {len(bad)} not ok "
          f"({', '.join(f'{k} {v}' for k, v in counts.items() if v)}; "
          f"{time.time() - start:.0f} s)", flush=True)
    return 1 if bad or not nodes else 0


if __name__ == "__main__":
    sys.exit(main())
