# Session 24: part 2's program order in a power-capped 32K training step (ours alone, compiled, AC none, no MTP),
# alternating: the default group_rows -1 (one 192-column group over every row, then the next: the P / dS scratch
# read three times, the atomics' dKV columns 25 MB at a time) against 0 (a row's three groups side by side: the
# scratch read once, all 75 MB of dKV columns hit at a time). Alone at T = 32K session 22 measured 88.5 vs 91.3 ms.
source bench/gpu_env.sh >/dev/null
OUTS=$OUT; export -n OUT; mkdir -p /tmp/r
echo '{"sparse_mla_ws": {"bwd_grad": {"group_rows": 0}}}' > /tmp/g0.json
E="--compile on --our-mtp off --ac none --budget-s 0 --cell-timeout 150 --logs /tmp/e2e_logs --no-peer --steps 3 --warmup 3 --seq-lens 32768"
for run in base g0 base2 g0b; do
  case $run in g0*) export TITAN_DSA_TUNE_FILE=/tmp/g0.json;; *) unset TITAN_DSA_TUNE_FILE;; esac
  timeout 160 python3 bench/e2e.py $E --out /tmp/r/$run.json > /tmp/r/$run.log 2>&1; echo "$run rc $?"
  cp /tmp/r/$run.json $OUTS/32k_group_rows_$run.json 2>/dev/null
  python3 -c "import json; c=json.load(open('/tmp/r/$run.json'))['cells'][0]['ours']; print('$run', round(c['tokens_per_s']), round(c['step_s_median'], 4), round(c['forward_backward_s'], 4))"
done
