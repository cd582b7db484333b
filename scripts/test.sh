#!/usr/bin/env bash
# The test suite (CPU): unit, parity vs transformers, Triton kernels under the interpreter, distributed (gloo), e2e.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python -m pytest -q tests "$@"
