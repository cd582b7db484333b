#!/bin/bash
# Session 26: the Gluon scoring kernel of the indexer (indexer_topk_ws): GPU tests, the indexer alone against the
# Triton kernel (bench/indexer_sweep.py), then ours alone at 32K with it on / off, alternating.
source bench/gpu_env.sh
OUTS=$OUT; export -n OUT
timeout 300 python3 -m pytest -q -x tests/kernels/test_kernels_gpu.py -k "indexer" 2>&1 | tail -4 | tee $OUTS/gpu_tests.log
grep -q " passed" $OUTS/gpu_tests.log && ! grep -q "failed\|error" $OUTS/gpu_tests.log || { echo "GPU tests failed"; exit 1; }
mkdir -p /tmp/sw; OUT=/tmp/sw timeout 200 python3 bench/indexer_sweep.py '{"ws": {}}' '{}' '{"ws": {"stages": 6}}' \
  '{"ws": {"bq": 4}}' 2>&1 | grep RESULT; cp /tmp/sw/indexer_sweep.json $OUTS/
echo '{"indexer_topk_ws": {"score": {"enable": false}}}' > /tmp/ws_off.json
COMMON="--compile on --our-mtp off --ac none --budget-s 0 --cell-timeout 240 --logs /tmp/e2e_logs --no-peer"
for i in 1 2; do
  for mode in ws triton; do
    if [ $mode = triton ]; then export TITAN_DSA_TUNE_FILE=/tmp/ws_off.json; else unset TITAN_DSA_TUNE_FILE; fi
    timeout 250 python3 bench/e2e.py $COMMON --steps 4 --warmup 3 --seq-lens 32768 --out /tmp/32k_${mode}_$i.json \
      > /tmp/e2e_${mode}_$i.log 2>&1; cp /tmp/32k_${mode}_$i.json $OUTS/ 2>/dev/null
    grep -E "tok/s" /tmp/e2e_${mode}_$i.log | tail -1
  done
done
unset TITAN_DSA_TUNE_FILE
python3 - $OUTS <<'PY'
import json, sys, glob, os
for f in sorted(glob.glob(os.path.join(sys.argv[1], "32k_*.json"))):
    for c in json.load(open(f)).get("cells", []):
        o = c.get("ours", {})
        print(f"RESULT {os.path.basename(f)} {o.get('tokens_per_s', 0):.0f} tok/s, median step {o.get('step_s_median', 0):.4f} s, {o.get('status')}")
PY
