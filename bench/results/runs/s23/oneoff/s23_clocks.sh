# Session 23, third call (code e531e57 + docs): all GPU kernel tests at the session's final kernels, then the SM
# clock, power and clock-event reasons sampled every 20 ms (nvidia-smi, read-only) while (1) the whole sparse MLA
# backward runs alone (bench/ws_bwd_sweep.py, defaults) and (2) ours trains the proxy at 32K (compiled, AC none,
# no MTP), to see whether the GPU runs at lower clocks in training (part 2's per-chunk times in the s22 trace fall
# by 17-33% within each layer's backward, in step with part 1's).
source bench/gpu_env.sh >/dev/null; mkdir -p /tmp/r
OUTS=$OUT; export -n OUT
timeout 300 python3 -m pytest -q tests/kernels/test_kernels_gpu.py > $OUTS/gpu_tests.log 2>&1; echo "pytest rc $?"
tail -3 $OUTS/gpu_tests.log
Q=timestamp,clocks.sm,clocks.mem,power.draw,power.draw.instant,power.limit,temperature.gpu,clocks_event_reasons.active
nvidia-smi --query-gpu=$Q --format=csv,noheader -c 1 > /dev/null 2>&1 || Q=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active
echo "fields: $Q"
smi() { nvidia-smi --query-gpu=$Q --format=csv,noheader -lms 20 > $1 2>&1 & SMI=$!; }
smi $OUTS/smi_bwd_sweep.csv
timeout 150 python3 bench/ws_bwd_sweep.py bwd_grad '{}' > /tmp/g.log 2>&1; echo "sweep rc $?"; kill $SMI
grep RESULT /tmp/g.log
smi $OUTS/smi_32k_train.csv
E="--compile on --our-mtp off --ac none --budget-s 0 --cell-timeout 200 --logs /tmp/e2e_logs --no-peer --steps 6 --warmup 3 --seq-lens 32768"
timeout 230 python3 bench/e2e.py $E --out /tmp/r/c.json > /tmp/e.log 2>&1; echo "e2e rc $?"; kill $SMI
cp /tmp/r/c.json $OUTS/32k_ours_clocks.json; grep "^|" /tmp/r/c.md | tail -1
for f in smi_bwd_sweep smi_32k_train; do
  python3 - $OUTS/$f.csv <<'PY'
import sys, statistics
rows = [l.split(", ") for l in open(sys.argv[1]) if l.count(",") >= 5]
busy = [r for r in rows if float(r[3].split()[0]) > 250]  # samples while the GPU draws > 250 W
sm = [float(r[1].split()[0]) for r in busy]
if sm:
    print(sys.argv[1].split("/")[-1], "samples", len(rows), "busy", len(busy), "sm MHz min/median/max",
          min(sm), statistics.median(sm), max(sm), "reasons", sorted(set(r[-1].strip() for r in busy)))
PY
done
