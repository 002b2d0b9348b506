"""Compile the SM100 block-scaled kernel for the whole product the kernel's predicate accepts:
every format x mode x tiling x cluster x arch (sm_100a, sm_103a), 2,900 compiles, checking
each one's PTX as tests/test_compile_sm100_blockscaled.py does (block-scaled MMA kind and
scale vector, tcgen05.cp, CTA group, 512 TMEM columns, reduce store iff accumulating, the CLC
schedule's barrier counts, the offsets check). CI runs the two faces of the product and a
seeded sample of it; this runs all of it (no GPU needed).

    python scripts/compile_sm100_blockscaled_product.py [--jobs N] [--json out.json]
"""
import argparse
import json
import multiprocessing
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _one(point):
    from kernel_compile import compile_ptx
    from test_compile_sm100 import check_schedule_counts
    from test_compile_sm100_blockscaled import bs_spec, check_blockscaled_ptx

    (fmt, majors, order, mode, out, acc), (tile, cluster), arch = point
    try:
        s = bs_spec(arch, fmt, a_major=majors[0], b_major=majors[1], order=order, mode=mode,
                    out=out, acc=acc, tile=tile, cluster=cluster)
        ptx = compile_ptx(s)
        check_blockscaled_ptx(ptx, fmt, acc, two_cta=tile[0] == 256)
        check_schedule_counts(ptx, cluster[0] * cluster[1])
        return None
    except Exception:  # noqa: BLE001 - every failure is reported with its point
        return f"{point}: {traceback.format_exc(limit=3)}"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", default="")
    a = p.parse_args()
    from test_compile_sm100_blockscaled import ARCHS, MODES, TILINGS

    points = [(m, t, arch) for m in MODES for t in TILINGS for arch in ARCHS]
    start = time.time()
    with multiprocessing.get_context("spawn").Pool(a.jobs) as pool:
        failures = [f for f in pool.imap_unordered(_one, points, chunksize=8) if f]
    seconds = time.time() - start
    print(f"sm100 block-scaled product: {len(points)} compiles, {len(failures)} failed, "
          f"{seconds:.0f} s")
    for f in failures[:20]:
        print(f)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"compiles": len(points), "failed": failures, "seconds": seconds}, fh,
                      indent=1)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
