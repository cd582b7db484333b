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
# ours alone at 32K at this code (peak memory with the larger indexer chunk, tok/s)
mkdir -p /tmp/r; timeout 200 python3 bench/e2e.py --compile on --our-mtp off --ac none --budget-s 0 --cell-timeout 180 \
  --logs /tmp/e2e_logs --no-peer --steps 4 --warmup 3 --seq-lens 32768 --out /tmp/r/32k_chunks.json > /tmp/e2e.log 2>&1
cp /tmp/r/32k_chunks.json $OUTS/; python3 -c "
import json; o = json.load(open('/tmp/r/32k_chunks.json'))['cells'][0]['ours']
print('RESULT 32K ours', round(o['tokens_per_s']), 'tok/s, median step', round(o['step_s_median'], 4), 'peak', round(o['peak_allocated_gib'], 1), 'GiB', o['status'])"
