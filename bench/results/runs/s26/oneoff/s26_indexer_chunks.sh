#!/bin/bash
# Session 26: the indexer's chunk of query rows sized by the scratch's true bytes per row (4 x (width + cap) + 8
# instead of 8 x width: 3,168 rows per chunk at 32K with the Gluon scoring, 2,112 before), against the old sizing
# (scratch_bytes 715707120 gives the old row count under the new formula); then the indexer's GPU tests.
source bench/gpu_env.sh
OUTS=$OUT; export -n OUT
mkdir -p /tmp/sw; OUT=/tmp/sw timeout 240 python3 bench/indexer_sweep.py '{"ws": {}}' \
  '{"ws": {}, "scratch_bytes": 715707120}' '{}' '{"scratch_bytes": 715707120}' 2>&1 | grep RESULT
cp /tmp/sw/indexer_sweep.json $OUTS/indexer_sweep_chunks.json
timeout 200 python3 -m pytest -q -x tests/kernels/test_kernels_gpu.py -k "indexer" 2>&1 | tail -2 | tee $OUTS/gpu_tests_chunks.log
