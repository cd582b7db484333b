#!/bin/bash
# Session 27: the routed experts' products as one cuBLAS GEMM per expert (moe.grouped_mm = "off", model/expert_mm.py)
# against torch._grouped_mm ("on"), ours alone, compiled, AC none, no MTP, alternating in one call: 32K twice each,
# then 4K once each; then the MoE GPU unit tests.
source bench/gpu_env.sh >/dev/null
OUTS=$OUT; export -n OUT
mkdir -p /tmp/r /tmp/e2e_logs
run() {  # $1 label, $2 seq, $3 grouped_mm
  timeout 170 python3 bench/e2e.py --compile on --our-mtp off --ac none --budget-s 0 --cell-timeout 160 \
    --logs /tmp/e2e_logs/$1 --no-peer --steps 4 --warmup 3 --seq-lens $2 --our-args "--moe.grouped_mm $3" \
    --out /tmp/r/$1.json > /tmp/r/$1.log 2>&1
  cp /tmp/r/$1.json $OUTS/ 2>/dev/null; python3 -c "
import json; o = json.load(open('/tmp/r/$1.json'))['cells'][0]['ours']
print('RESULT $1', round(o['tokens_per_s']), 'tok/s, median step', round(o['step_s_median'], 4), 'peak', round(o['peak_allocated_gib'], 1), 'GiB', o['status'])" || tail -5 /tmp/r/$1.log
}
run 32k_off_1 32768 off
run 32k_on_1 32768 on
run 32k_off_2 32768 off
run 32k_on_2 32768 on
run 4k_off 4096 off
run 4k_on 4096 on
timeout 150 python3 -m pytest -q tests/unit/test_moe_backward_memory.py tests/unit/test_moe_recompute.py tests/unit/test_model.py \
  tests/unit/test_forward_determinism.py 2>&1 | tail -3 | tee $OUTS/gpu_unit_moe.log
