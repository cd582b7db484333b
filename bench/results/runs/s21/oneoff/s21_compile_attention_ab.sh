# Session 21: 4K, ours alone, AC none, no MTP, on one machine: compiled (compile.attention true), compiled with the
# attention eager (--compile.no-attention), eager, alternately. Only JSON comes back. Runs on a checkout of 77a6ba6
# only: the compile.attention option was removed after this measurement.
source bench/gpu_env.sh >/dev/null; mkdir -p /tmp/r; OUTS=$OUT; export -n OUT
E="--our-mtp off --ac none --no-peer --budget-s 0 --cell-timeout 150 --logs /tmp/e2e_logs --steps 4 --warmup 4 --seq-lens 4096"
i=0
for V in on noatt off noatt on; do
  i=$((i+1))
  case $V in
    on) A="--compile on";; off) A="--compile off";; noatt) A="--compile on --our-args=--compile.no-attention";;
  esac
  python3 bench/e2e.py $E $A --out /tmp/r/${i}_$V.json > /tmp/r/${i}_$V.log 2>&1
done
python3 - <<'PY' | tee $OUTS/summary.txt
import json, glob, os
for f in sorted(glob.glob("/tmp/r/*_*.json")):
    o = json.load(open(f))["cells"][0]["ours"]
    print(f"{os.path.basename(f):12s} {o.get('status')} tok/s {o.get('tokens_per_s', 0):8.0f} MFU {o.get('mfu_pct', 0):5.2f} "
          f"fwd+bwd {o.get('forward_backward_s', 0):.4f} median step {o.get('step_s_median', 0):.4f} "
          f"peak {o.get('peak_allocated_gib', 0):.2f} loss {o.get('loss_last')}")
PY
mkdir -p $OUTS/ab && cp /tmp/r/*_*.json $OUTS/ab/
