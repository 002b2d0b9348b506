#!/usr/bin/env bash
# Runs cuDNN frontend's published grouped-GEMM wgrad tests against gwgrad's contract names.
#
#   bash tools/cudnn_published/run.sh CUDNN_FRONTEND_CHECKOUT [pytest args...]
#   CUDNN_TESTS_JSON=out.json bash tools/cudnn_published/run.sh ...   (also writes the counts)
#
# CUDNN_FRONTEND_CHECKOUT: a checkout of github.com/NVIDIA/cudnn-frontend (or any directory
# holding its test/python/). The tests are copied into a temporary directory, never into this
# repository, with one change: the compute-capability skip of test_grouped_gemm_wgrad_utils.py
# is lowered from 100 to 90 (gwgrad runs MXFP8 on SM90; FP4 raises NotImplementedError there,
# which the tests turn into a skip). Beside them: this directory's conftest.py (a float64
# reference where torch has no block-scaled grouped GEMM, i.e. below SM100) and cudnn/ (the
# package name resolving to gwgrad). The test bodies run unedited.
set -euo pipefail
src=${1:?usage: run.sh CUDNN_FRONTEND_CHECKOUT [pytest args...]}
shift
here=$(cd "$(dirname "$0")" && pwd)
tests="$src/test/python"
work=$(mktemp -d "${TMPDIR:-/tmp}/gwgrad-cudnn-tests.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/fe_api"
cp "$tests"/fe_api/test_grouped_gemm_wgrad*.py "$tests/fe_api/test_fe_api_utils.py" "$work/fe_api/"
cp "$tests/test_utils.py" "$tests/pytest.ini" "$work/"
touch "$work/fe_api/__init__.py"
cp "$here/conftest.py" "$here/test_low_precision_matmul.py" "$work/"
cp -r "$here/cudnn" "$work/cudnn"
utils="$work/fe_api/test_grouped_gemm_wgrad_utils.py"
changed=$(grep -c "if compute_capability < 100:" "$utils" || true)
[ "$changed" -eq 1 ] || { echo "expected one compute-capability check in $utils, found $changed" >&2; exit 2; }
sed -i 's/if compute_capability < 100:/if compute_capability < 90:/' "$utils"
commit=$(cat "$src/COMMIT" 2>/dev/null || git -C "$src" rev-parse HEAD 2>/dev/null || echo unknown)
echo "== cuDNN frontend tests at $commit"
cd "$work"
rc=0
python -m pytest -p no:cacheprovider -rs --junitxml="$work/junit.xml" "$@" \
  fe_api/test_grouped_gemm_wgrad.py || rc=$?
if [ -n "${CUDNN_TESTS_JSON:-}" ]; then
  python "$here/summary.py" "$work/junit.xml" "$commit" "$CUDNN_TESTS_JSON"
fi
exit $rc
