# Session 20 A/B #2 on one H200: the fp32-projection probe, then at 32K and 4K (compiled, AC none, no MTP) the
# session's base (48cd9c4, .snap/base.tgz) alone and the working tree side by side with the peer.
source bench/gpu_env.sh >/dev/null
mkdir -p /tmp/base && tar xzf .snap/base.tgz -C /tmp/base
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear_fp32.py 2>&1 | tail -1
python3 bench/results/runs/s20/oneoff/s20_lin_probe.py $OUT/lin_probe.json 2>&1 | grep "^{"
E="--compile on --our-mtp off --ac none --budget-s 0 --cell-timeout 240 --steps 3 --warmup 3"
(cd /tmp/base && python3 bench/e2e.py $E --no-peer --seq-lens 32768 --out $OUT/base_32768.json > $OUT/base_32768.log 2>&1)
python3 bench/e2e.py $E --seq-lens 32768 --out $OUT/new_32768.json > $OUT/new_32768.log 2>&1
(cd /tmp/base && python3 bench/e2e.py $E --no-peer --seq-lens 4096 --out $OUT/base_4096.json > $OUT/base_4096.log 2>&1)
python3 bench/e2e.py $E --seq-lens 4096 --peer-args "--mp autocast" --out $OUT/new_4096.json > $OUT/new_4096.log 2>&1
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*_*.json")):
    if "probe" in f:
        continue
    for c in json.load(open(f))["cells"]:
        for side in ("ours", "peer"):
            o = c.get(side) or {}
            if o:
                print(f"{os.path.basename(f):16s} {side} {o.get('status')} tok/s {o.get('tokens_per_s', 0):9.0f} "
                      f"step {o.get('step_s', 0):.4f} med {o.get('step_s_median', 0):.4f} "
                      f"peak {o.get('peak_allocated_gib', 0):.2f} mfu {o.get('mfu_pct', 0)}")
PY
