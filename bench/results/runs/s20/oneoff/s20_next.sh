# For the next device call (not run in session 20): the measured code (d4e636b) against the working tree, ours
# alone, compiled, AC none, no MTP, 4K then 32K, alternately, on one machine. First, on this side:
#   git archive d4e636b | gzip > .snap/base.tgz      (carry [".whl", ".snap"])
source bench/gpu_env.sh >/dev/null
mkdir -p /tmp/base /tmp/r && tar xzf .snap/base.tgz -C /tmp/base
python3 -m pytest -q -rf -p no:cacheprovider tests/kernels/test_linear_fp32.py tests/unit/test_forward_determinism.py 2>&1 | tail -3
E="--compile on --our-mtp off --ac none --no-peer --budget-s 0 --cell-timeout 240 --logs /tmp/e2e_logs"
for S in 4096 32768 4096; do
  (cd /tmp/base && python3 bench/e2e.py $E --steps 4 --warmup 4 --seq-lens $S --out /tmp/r/base_$S.json > /dev/null 2>&1)
  python3 bench/e2e.py $E --steps 4 --warmup 4 --seq-lens $S --out /tmp/r/new_$S.json > /dev/null 2>&1
  cp /tmp/r/base_$S.json $OUT/base_${S}_$(date +%s).json; cp /tmp/r/new_$S.json $OUT/new_${S}_$(date +%s).json
done
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*.json")):
    o = json.load(open(f))["cells"][0]["ours"]
    print(f"{os.path.basename(f):28s} tok/s {o.get('tokens_per_s', 0):8.0f} fwd+bwd {o.get('forward_backward_s', 0):.4f} "
          f"median step {o.get('step_s_median', 0):.4f} peak {o.get('peak_allocated_gib', 0):.2f}")
PY
