# Session 24, first call: the proxy's large 32K GEMMs alone and in one MoE layer's backward order
# (bench/gemm_probe.py), with the SM clock / power sampled every 20 ms by nvidia-smi (read-only).
source bench/gpu_env.sh >/dev/null
OUTS=$OUT; export -n OUT
Q=timestamp,clocks.sm,power.draw,clocks_event_reasons.active
nvidia-smi --query-gpu=$Q --format=csv,noheader -lms 20 > $OUTS/smi_gemm_probe.csv 2>&1 & SMI=$!
timeout 240 python3 bench/gemm_probe.py --reps 8 --out $OUTS/gemm_probe.json 2>&1 | tee $OUTS/gemm_probe.log; echo "rc $?"
kill $SMI
python3 - $OUTS/smi_gemm_probe.csv <<'PY'
import sys, statistics
rows = [l.split(", ") for l in open(sys.argv[1]) if l.count(",") >= 3]
busy = [r for r in rows if float(r[2].split()[0]) > 250]
sm = sorted(float(r[1].split()[0]) for r in busy)
if sm:
    print("samples", len(rows), "busy", len(busy), "sm MHz deciles", [sm[len(sm) * i // 10] for i in range(10)], sm[-1])
PY
