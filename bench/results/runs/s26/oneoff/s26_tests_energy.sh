#!/bin/bash
# Session 26: every GPU kernel test at the final code, then the energy per call of the 32K step's main kernels.
source bench/gpu_env.sh
OUTS=$OUT; export -n OUT
timeout 400 python3 -m pytest -q tests/kernels/test_kernels_gpu.py 2>&1 | tail -3 | tee $OUTS/gpu_tests_all.log
mkdir -p /tmp/en; OUT=/tmp/en timeout 150 python3 bench/energy_probe.py --seconds 3 2>&1 | grep -v "^{" | tail -8
cp /tmp/en/energy_probe.json $OUTS/
