#!/bin/bash
# Session 27: per-expert products ("off") against torch._grouped_mm ("on") at 16K and 8K tokens (8,192 and 4,096 rows
# per expert), ours alone, compiled, AC none, no MTP.
source bench/gpu_env.sh >/dev/null
OUTS=$OUT; export -n OUT
mkdir -p /tmp/r /tmp/e2e_logs
run() {  # $1 label, $2 seq, $3 grouped_mm (empty: the config's default)
  timeout 170 python3 bench/e2e.py --compile on --our-mtp off --ac none --budget-s 0 --cell-timeout 160 \
    --logs /tmp/e2e_logs/$1 --no-peer --steps 4 --warmup 3 --seq-lens $2 ${3:+--our-args "--moe.grouped_mm $3"} \
    --out /tmp/r/$1.json > /tmp/r/$1.log 2>&1
  cp /tmp/r/$1.json $OUTS/ 2>/dev/null; python3 -c "
import json; o = json.load(open('/tmp/r/$1.json'))['cells'][0]['ours']
print('RESULT $1', round(o['tokens_per_s']), 'tok/s, median step', round(o['step_s_median'], 4), 'peak', round(o['peak_allocated_gib'], 1), 'GiB', o['status'])" || tail -5 /tmp/r/$1.log
}
run 16k_off 16384 off
run 16k_on 16384 on
run 8k_off 8192 off
run 8k_on 8192 on
