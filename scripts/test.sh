#!/usr/bin/env bash
# The test suite (CPU): unit, parity vs transformers, Triton kernels under the interpreter, distributed (gloo), e2e.
# TEST_WORKERS (default 2) pytest-xdist processes, one test file at a time each (module fixtures run once);
# TEST_WORKERS=0 runs everything in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
workers="${TEST_WORKERS:-2}"
if [ "$workers" -gt 0 ]; then
  python -m pytest -q -n "$workers" --dist loadfile tests "$@"
else
  python -m pytest -q tests "$@"
fi
