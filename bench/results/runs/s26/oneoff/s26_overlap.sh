# session 26: GEMM work (one MoE layer's expert weight gradients) beside the sparse MLA backward, T = 32K
source bench/gpu_env.sh
OUTS=$OUT; export -n OUT
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,clocks_event_reasons.active --format=csv -lms 50 > $OUTS/smi_overlap.csv &
SMI=$!
for s in 1.0 2.5; do
  mkdir -p /tmp/ov_$s; OUT=/tmp/ov_$s timeout 240 python3 bench/overlap_probe.py --b-scale $s --reps 7 2>&1 | tail -3
  mkdir -p /tmp/ov_$s; cp /tmp/ov_$s/overlap_probe.json $OUTS/overlap_probe_b$s.json 2>/dev/null
done
kill $SMI
