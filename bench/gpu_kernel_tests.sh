#!/usr/bin/env bash
# On one H200: pick launch parameters (sweep at T=32K), check real-size correctness with them, then benchmark.
#   bash bench/gpu_kernel_tests.sh [bench/kernels.py args for the benchmark...]
# Logs, the chosen parameters (tune.json) and the JSON results go to $OUT when set (device machine), else
# bench/results/. Set SWEEP=0 to skip the sweep and use the built-in launch parameters.
set -o pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>&1 | tee "$OUT/gpu_tests.log"
if [ "${SWEEP:-1}" = "1" ]; then
  "$PY" bench/kernels.py --sweep-only --time-budget "${SWEEP_BUDGET:-150}" --tune-out "$OUT/tune.json" \
    --out "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.log"
  [ -s "$OUT/tune.json" ] && export TITAN_DSA_TUNE_FILE="$OUT/tune.json"
fi
timeout "${TEST_TIMEOUT:-180}" "$PY" -m pytest -q -rA -p no:cacheprovider tests/kernels/test_kernels_gpu.py 2>&1 \
  | tee -a "$OUT/gpu_tests.log"
"$PY" bench/kernels.py --out "$OUT/kernels_h200.json" "$@" 2>&1 | tee "$OUT/bench.log"
