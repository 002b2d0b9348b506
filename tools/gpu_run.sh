#!/usr/bin/env bash
# One-shot run on the GPU host (H200), after staging the CuTe DSL wheels (.devwheels/, see
# shared/offline-gpu/README.md): the host overhead, the cold start, the benchmark and the
# isolated GPU tests, each step under its own timeout, the whole run within
# GWGRAD_RUN_BUDGET_S seconds (default 1200; a step gets at most what is left, and is skipped
# below 15 s).
#
# Usage: bash tools/gpu_run.sh [steps...]
#   default steps, in this order: tests overhead coldstart bench
#   also: accumulate (bench into FP32 outputs, the main-grad path), tune (gwgrad variants
#   alone), examples, unrounded (bench with counts not rounded to 256), adapters (kernel time
#   per adapter), fp8 (benchmarks/fp8.py: the FP8 recipes), qtests (the quantizers' GPU tests),
#   qbench (benchmarks/quantize.py), fuzz (tests/test_fuzz_gpu.py), sanitize (tools/sanitize.py),
#   soak (tools/soak.py), reliability (the main-grad layer, short soak and two-GPU tests),
#   ncu (tools/profile_gemm.py under Nsight Compute: gwgrad vs dense cuBLAS per row),
#   energy (tools/energy_bench.py: steady-state ms, clock and J per call); these are not in
#   the default run's budget.
#
# Files under $OUT (default /tmp/gwgrad-out; at most 6, one folder): run.log (every step's
# full output), overhead.json, coldstart.json, bench.json, bench.png, isolated.json
# (+ bench_unrounded.json, bench_adapters.json, bench_accumulate.json, bench_tune*.json for
# those steps). Stdout: each step's summary.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gwgrad-out}
mkdir -p "$OUT"
LOG="$OUT/run.log"
BUDGET=${GWGRAD_RUN_BUDGET_S:-1200}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-$(command -v python || command -v python3)}
# The whole GPU suite but the fuzz (its own step), the two-GPU tests and the SM100 files (they
# skip below SM100: run them with pytest on a Blackwell host, docs/BLACKWELL.md).
TESTS=${GWGRAD_GPU_TESTS:-$(ls tests/test_*gpu*.py tests/test_adapter_torch.py tests/test_adapter_cupy.py tests/test_kernel_cache.py tests/test_grouped_linear.py | grep -v -e test_fuzz_gpu -e test_expert_parallel_gpu -e test_sm100 | sort -u)}

say() { echo "$*" | tee -a "$LOG"; }
# allow CAP: the seconds a step may run (its cap, or what is left of the budget; 0: skip it)
allow() {
  local cap=$1 left=$((BUDGET - SECONDS))
  [ "$left" -lt "$cap" ] && cap=$left
  [ "$cap" -lt 15 ] && cap=0
  echo "$cap"
}
# step NAME CAP: announce a step; returns 1 (skip) when no time is left for it
step() {
  T=$(allow "$2")
  if [ "$T" -eq 0 ]; then say "=== $1 SKIPPED: budget spent ($SECONDS s of $BUDGET s)"; return 1; fi
  say "=== $1 (timeout ${T} s, at ${SECONDS} s of ${BUDGET} s, $(date +%T))"
}
done_step() { say "--- $1 rc=$2 (${SECONDS} s)"; }
# capture CMD...: run CMD under the step's timeout into step.txt, append that to the log; sets rc
capture() { timeout "$T" "$@" > "$OUT/step.txt" 2>&1; rc=$?; cat "$OUT/step.txt" >> "$LOG"; }

say "=== setup $(date +%T)"
if [ -f .devwheels/b/install.sh ]; then  # quick when the CuTe DSL is already in /tmp/site
  timeout 150 bash .devwheels/b/install.sh >> "$LOG" 2>&1 || say "install.sh rc=$?"
fi
if [ -f .devwheels/b/env.sh ]; then
  . .devwheels/b/env.sh
else
  export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
fi
timeout 90 "$PY" -m pip install -q --no-deps --no-build-isolation -e . >> "$LOG" 2>&1 \
  || say "pip install -e . rc=$? (the checkout stays on PYTHONPATH)"
timeout 60 "$PY" -m gwgrad info 2>&1 | tee -a "$LOG"

steps=${*:-tests overhead coldstart bench}
for s in $steps; do
  case $s in
    overhead)
      step overhead 110 || continue
      capture "$PY" -m benchmarks.adapters --skip-kernel --step-timeout 30 \
        --json "$OUT/overhead.json"
      sed -n '/^host overhead per cached call/,$p' "$OUT/step.txt" | head -24
      [ $rc -eq 0 ] || tail -5 "$OUT/step.txt"
      done_step overhead $rc ;;
    coldstart)
      step coldstart 100 || continue
      capture "$PY" -m benchmarks.coldstart --timeout $(( (T - 5) / 2 )) \
        --json "$OUT/coldstart.json"
      tail -8 "$OUT/step.txt"
      done_step coldstart $rc ;;
    bench)
      # 8 rows x 2 distributions, ~9 methods each; rows not started after T-45 s are skipped
      # (and say so in the JSON, which is rewritten after every row).
      step bench 220 || continue
      # GWGRAD_BENCH_TILES: variants timed besides the default (e.g. a sweep:
      # "128x128,128x128:epi_buffer_sets=2"); GWGRAD_BENCH_ROWS: a subset of rows.
      capture "$PY" -m gwgrad bench --tiles "${GWGRAD_BENCH_TILES-}" \
        --rows "${GWGRAD_BENCH_ROWS-}" --rounds ${GWGRAD_BENCH_ROUNDS:-20} \
        --sample-ms 12 --time-budget $((T > 90 ? T - 45 : T / 2)) --json "$OUT/bench.json" \
        --plot "$OUT/bench.png"
      sed -n '/^wrapper\/adapter, worst row/,$p' "$OUT/step.txt" | head -60
      [ $rc -eq 0 ] || tail -5 "$OUT/step.txt"
      done_step bench $rc ;;
    tune)
      # A tuning sweep: gwgrad's default and GWGRAD_TUNE_TILES alone, interleaved (no
      # competitors between their samples: identical configs agree within ~0.3 %, against
      # +-4 % in the full bench); GWGRAD_TUNE_ACCUMULATE=1 sweeps the FP32 main-grad path.
      step tune 200 || continue
      capture "$PY" -m gwgrad bench --gwgrad-only --tiles "${GWGRAD_TUNE_TILES-}" \
        --rows "${GWGRAD_BENCH_ROWS-}" --rounds ${GWGRAD_BENCH_ROUNDS:-20} --sample-ms 12 \
        ${GWGRAD_TUNE_ACCUMULATE:+--accumulate} --time-budget $((T > 90 ? T - 30 : T / 2)) \
        --json "$OUT/bench_tune${GWGRAD_TUNE_ACCUMULATE:+_accumulate}.json" --plot ""
      sed -n '/^gwgrad variants/,$p' "$OUT/step.txt" | head -40
      [ $rc -eq 0 ] || tail -5 "$OUT/step.txt"
      done_step tune $rc ;;
    accumulate)
      # The main-grad path: gwgrad accumulating into FP32 vs torch._grouped_mm + add_, and the
      # HBM roofline on every row (the FP32 table); same variables as bench.
      step accumulate 220 || continue
      capture "$PY" -m gwgrad bench --accumulate --tiles "${GWGRAD_BENCH_TILES-}" \
        --rows "${GWGRAD_BENCH_ROWS-}" --rounds ${GWGRAD_BENCH_ROUNDS:-20} \
        --sample-ms 12 --time-budget $((T > 90 ? T - 45 : T / 2)) \
        --json "$OUT/bench_accumulate.json" --plot ""
      sed -n '/^wrapper\/adapter, worst row/,$p' "$OUT/step.txt" | head -60
      [ $rc -eq 0 ] || tail -5 "$OUT/step.txt"
      done_step accumulate $rc ;;
    tests)
      # The whole default set takes ~500 s with 13 workers; the cap is GWGRAD_TESTS_CAP
      # (default 560 s), tests not started by then are reported "not run".
      step tests ${GWGRAD_TESTS_CAP:-560} || continue
      capture "$PY" tools/gpu_isolated.py --workers 14 --timeout 150 --budget $((T - 8)) \
        --json "$OUT/isolated.json" $TESTS
      grep -E "^(fail|TIMEOUT|missing)|^summary" "$OUT/step.txt" | tail -14
      done_step tests $rc ;;
    examples)
      for ex in examples/torch_moe_layer.py examples/torch_fp8_wgrad.py examples/jax_moe_layer.py examples/cupy_research.py; do
        step "$ex" 120 || continue
        timeout "$T" "$PY" "$ex" >> "$LOG" 2>&1; done_step "$ex" $?
      done ;;
    unrounded)
      step unrounded 200 || continue
      capture "$PY" -m gwgrad bench --tiles 128x256,128x128 --unrounded --no-check \
        --time-budget $((T > 80 ? T - 40 : T / 2)) --json "$OUT/bench_unrounded.json" --plot ""
      sed -n '/^wrapper\/adapter, worst row/,$p' "$OUT/step.txt" | head -40
      done_step unrounded $rc ;;
    adapters)
      step adapters 300 || continue
      capture "$PY" -m benchmarks.adapters --dist uniform --skip-overhead --step-timeout 120 \
        --json "$OUT/bench_adapters.json"; tail -20 "$OUT/step.txt"
      done_step adapters $rc ;;
    fp8)
      # FP8 recipes vs torch._scaled_grouped_mm, dense FP8 and gwgrad BF16 (benchmarks/fp8.py).
      step fp8 300 || continue
      capture "$PY" -m benchmarks.fp8 --tiles "${GWGRAD_FP8_TILES-128x128}" \
        --rows "${GWGRAD_FP8_ROWS-}" --rounds ${GWGRAD_BENCH_ROUNDS:-10} \
        --time-budget $((T > 90 ? T - 60 : T / 2)) --json "$OUT/bench_fp8.json"
      tail -20 "$OUT/step.txt"
      done_step fp8 $rc ;;
    qtests)
      # The GPU quantizers: bit-exactness, guards, graphs, quantize -> FP8 GEMM.
      step qtests 240 || continue
      capture "$PY" -m pytest -q -p no:cacheprovider tests/test_quantize_gpu.py \
        ${GWGRAD_QTESTS_EXTRA-}
      tail -25 "$OUT/step.txt"
      done_step qtests $rc ;;
    qbench)
      # benchmarks/quantize.py: every format on the shapes' x and dy vs torch ops and a copy.
      step qbench 300 || continue
      capture "$PY" -m benchmarks.quantize --rows "${GWGRAD_Q_ROWS-}" \
        --rounds ${GWGRAD_BENCH_ROUNDS:-10} --markdown --step \
        --time-budget $((T > 90 ? T - 60 : T / 2)) --json "$OUT/bench_quantize.json"
      tail -40 "$OUT/step.txt"
      done_step qbench $rc ;;
    fuzz)
      # tests/test_fuzz_gpu.py: >= 500 random cases against FP64, guard memory, seeds logged.
      step fuzz 330 || continue
      GWGRAD_FUZZ_LOG="$OUT/fuzz.json" capture "$PY" -m pytest -q -s -p no:cacheprovider \
        tests/test_fuzz_gpu.py
      grep -E "^fuzz:|passed|failed|error" "$OUT/step.txt" | tail -8
      done_step fuzz $rc ;;
    sanitize)
      # tools/sanitize.py: compute-sanitizer memcheck / racecheck / synccheck over the kernels.
      step sanitize 330 || continue
      capture "$PY" tools/sanitize.py --json "$OUT/sanitize.json" ${GWGRAD_SANITIZE_ARGS-}
      tail -20 "$OUT/step.txt"
      done_step sanitize $rc ;;
    ncu)
      # tools/profile_gemm.py under Nsight Compute: per row gwgrad's kernels and the dense
      # cuBLAS GEMM of equal FLOPs (SpeedOfLight, + the tensor pipe's active share: on the
      # H200's ncu, sm__pipe_tensor_cycles_active counts HGMMA; added where ncu lists it).
      # GWGRAD_NCU_ROWS, GWGRAD_NCU_DISTS (default uniform; e.g. uniform,zipf),
      # GWGRAD_NCU_ACCUMULATE=1: which calls are profiled; GWGRAD_NCU_TILES: gwgrad variants
      # beside the default (the bench's --tiles syntax). GWGRAD_NCU_STALLS=1: also every
      # per-reason warp stall metric ncu lists (the summary prints the largest; the
      # WarpStateStats section alone has no per-reason figures). GWGRAD_NCU_EXTRA: more ncu
      # arguments.
      step ncu 240 || continue
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
      TENSOR=sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active
      METRICS=""
      QUERY=$("$NCU" --query-metrics 2>/dev/null)
      echo "$QUERY" | grep -q "^${TENSOR%%.*} " && METRICS="--metrics $TENSOR"
      if [ -n "${GWGRAD_NCU_STALLS-}" ]; then  # every per-reason warp stall metric ncu lists
        STALLS=$(echo "$QUERY" | grep -oE "^smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active" \
          | sed 's/$/.ratio/' | paste -sd, -)
        [ -n "$STALLS" ] && METRICS="${METRICS:---metrics }${METRICS:+,}$STALLS"
      fi
      capture "$NCU" --clock-control none --nvtx --nvtx-include "prof/" --section SpeedOfLight \
        $METRICS ${GWGRAD_NCU_EXTRA-} --csv --page details --log-file "$OUT/ncu.csv" \
        "$PY" tools/profile_gemm.py \
        --rows "${GWGRAD_NCU_ROWS:-dsv3-fc1,qwen3-30b-fc1,qwen3-30b-fc2,gptoss-fc1,dsv2lite-fc1,fine-256e}" \
        --dists "${GWGRAD_NCU_DISTS:-uniform}" ${GWGRAD_NCU_ACCUMULATE:+--accumulate} \
        --tiles "${GWGRAD_NCU_TILES-}"
      cat "$OUT/step.txt"
      "$PY" tools/profile_gemm.py --summarize "$OUT/ncu.csv" | tee "$OUT/ncu_summary.txt"
      done_step ncu $rc ;;
    energy)
      # tools/energy_bench.py: steady-state ms, SM clock, power and J per call of gwgrad's
      # variants and dense cuBLAS (nvidia-smi sampled). GWGRAD_ENERGY_ROWS / _DISTS / _TILES.
      step energy 300 || continue
      capture "$PY" tools/energy_bench.py --rows "${GWGRAD_ENERGY_ROWS:-dsv3-fc1,gptoss-fc1}" \
        --dist "${GWGRAD_ENERGY_DISTS:-uniform}" --tiles "${GWGRAD_ENERGY_TILES-}" \
        --json "$OUT/energy.json"
      grep -v "^nvidia-smi fields" "$OUT/step.txt" | tail -40
      done_step energy $rc ;;
    soak)
      # tools/soak.py: mixed calls over threads and streams, memory, compiles, graph replays.
      step soak 240 || continue
      capture "$PY" tools/soak.py --json "$OUT/soak.json" ${GWGRAD_SOAK_ARGS-}
      tail -20 "$OUT/step.txt"
      done_step soak $rc ;;
    reliability)
      # The reliability GPU tests: the main-grad layer, the short soak, two-GPU expert
      # parallelism (skips with one GPU).
      step reliability 300 || continue
      capture "$PY" -m pytest -q -rs -rP -p no:cacheprovider tests/test_grouped_linear.py \
        tests/test_soak.py tests/test_expert_parallel_gpu.py ${GWGRAD_RELIABILITY_EXTRA-}
      grep -E "PASS|FAIL|passed|failed|error|max relative" "$OUT/step.txt" | tail -30
      done_step reliability $rc ;;
    *) say "unknown step: $s (steps: overhead coldstart bench tests examples unrounded adapters fp8 qtests qbench fuzz sanitize soak reliability ncu energy)" ;;
  esac
done
rm -f "$OUT/step.txt" "$OUT"/*.tmp
say "=== done in ${SECONDS} s; files: $(cd "$OUT" && ls | tr '\n' ' ')"
