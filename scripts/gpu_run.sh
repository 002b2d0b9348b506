#!/usr/bin/env bash
# Developer script for the offline GPU host (after staging the CuTe DSL wheels, see
# shared/offline-gpu/README.md): isolated GPU tests, the examples and the benchmark tables,
# each step under its own timeout; JSON under $OUT and one log, $OUT/run.log.
# Usage: bash scripts/gpu_run.sh [steps...]   steps: tests examples bench unrounded adapters
set -uo pipefail
OUT=${OUT:-/tmp/gwgrad-out}
mkdir -p "$OUT"
LOG="$OUT/run.log"
. .devwheels/b/env.sh
pip install -q --no-deps --no-build-isolation -e . >> "$LOG" 2>&1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
steps=${*:-tests examples bench unrounded adapters}
TESTS=${GWGRAD_GPU_TESTS:-tests/test_sm90_kernel_gpu.py tests/test_api_gpu.py tests/test_adapter_torch_gpu.py tests/test_adapter_jax_gpu.py tests/test_adapter_cupy_gpu.py}
for step in $steps; do
  echo "=== $step $(date +%T)" >> "$LOG"
  case $step in
    tests)
      timeout 400 python scripts/gpu_isolated.py --workers 14 --timeout 180 \
        --json "$OUT/isolated.json" $TESTS >> "$LOG" 2>&1
      grep -E "^(fail|TIMEOUT)|^summary" "$LOG" | tail -12 ;;
    examples)
      for ex in examples/torch_moe_layer.py examples/jax_moe_layer.py examples/cupy_research.py; do
        timeout 120 python "$ex" >> "$LOG" 2>&1; echo "$ex rc=$?"
      done ;;
    bench)
      timeout 420 python -m gwgrad bench --tiles 128x256,128x128,256x128 --json "$OUT/bench.json" \
        --plot "$OUT/bench.png" > "$OUT/bench.txt" 2>&1; echo "bench rc=$?"
      cat "$OUT/bench.txt" >> "$LOG"; tail -16 "$OUT/bench.txt" ;;
    unrounded)
      timeout 200 python -m gwgrad bench --tiles 128x256,128x128 --unrounded --no-check \
        --json "$OUT/bench_unrounded.json" --plot "" > "$OUT/u.txt" 2>&1
      echo "unrounded rc=$?"; cat "$OUT/u.txt" >> "$LOG"; tail -16 "$OUT/u.txt" | head -15 ;;
    adapters)
      timeout 300 python -m gwgrad.bench_adapters --dist uniform --step-timeout 120 \
        --json "$OUT/bench_adapters.json" > "$OUT/a.txt" 2>&1
      echo "adapters rc=$?"; cat "$OUT/a.txt" >> "$LOG"; tail -30 "$OUT/a.txt" ;;
  esac
done
rm -f "$OUT"/*.txt
