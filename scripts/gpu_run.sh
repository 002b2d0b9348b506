#!/usr/bin/env bash
# Developer script for the offline GPU host (after staging the CuTe DSL wheels, see
# shared/offline-gpu/README.md): isolated GPU tests, then the benchmark tables, each step
# under its own timeout; logs and JSON under $OUT. Usage: bash scripts/gpu_run.sh [steps...]
# Steps: tests bench unrounded epi64 (default: all).
set -uo pipefail
OUT=${OUT:-/tmp/gwgrad-out}
mkdir -p "$OUT"
. .devwheels/b/env.sh
steps=${*:-tests bench unrounded epi64}
TESTS=${GWGRAD_GPU_TESTS:-tests/test_sm90_kernel_gpu.py tests/test_api_gpu.py}
for step in $steps; do
  case $step in
    tests)
      timeout 420 python scripts/gpu_isolated.py --workers 14 --timeout 150 \
        --json "$OUT/isolated.json" $TESTS > "$OUT/isolated.log" 2>&1
      grep -E "^(fail|TIMEOUT)|summary" "$OUT/isolated.log" | tail -15 ;;
    bench)
      timeout 300 python -m gwgrad bench --tiles 128x256,128x128 --json "$OUT/bench.json" \
        --plot "$OUT/bench.png" > "$OUT/bench.log" 2>&1; echo "bench rc=$?"
      tail -17 "$OUT/bench.log" ;;
    unrounded)
      timeout 150 python -m gwgrad bench --tiles 128x256 --unrounded --no-check \
        --json "$OUT/bench_unrounded.json" --plot "" > "$OUT/bench_unrounded.log" 2>&1
      echo "unrounded rc=$?"; tail -16 "$OUT/bench_unrounded.log" | head -15 ;;
    epi64)
      GWGRAD_SM90_EPI_N=64 timeout 120 python -m gwgrad bench --tiles 128x256 --no-check \
        --rows qwen3-30b-fc2,dsv3-fc1,qwen3-30b-fc1 --dist uniform \
        --json "$OUT/bench_epi64.json" --plot "" > "$OUT/bench_epi64.log" 2>&1
      echo "epi64 rc=$?"; tail -6 "$OUT/bench_epi64.log" ;;
  esac
done
