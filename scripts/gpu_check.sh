#!/usr/bin/env bash
# Developer script for the offline GPU host: kernel tests then the benchmark, logs under $OUT.
# Usage (after staging the CuTe DSL wheels): bash scripts/gpu_check.sh [pytest args...]
set -uo pipefail
OUT=${OUT:-/tmp/gwgrad-out}
mkdir -p "$OUT"
. .devwheels/b/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python -m pytest -q -x -m gpu -n ${GWGRAD_TEST_WORKERS:-8} "${@:-tests}" 2>&1 | tee "$OUT/pytest.txt" | tail -40
