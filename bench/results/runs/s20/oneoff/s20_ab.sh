# Session 20 A/B on one H200: tests of the changed code, then ours alone (compiled, AC none, no MTP) at 32K and 4K,
# the session's base (48cd9c4, from .snap/base.tgz) and the working tree alternately.
source bench/gpu_env.sh >/dev/null
mkdir -p /tmp/base && tar xzf .snap/base.tgz -C /tmp/base
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear_fp32.py tests/kernels/test_latent_query_recompute.py 2>&1 | tail -2
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_gpu.py -k "sparse_mla_real_size" 2>&1 | tail -2
E="--compile on --our-mtp off --ac none --no-peer --budget-s 0 --cell-timeout 200"
for S in ${SEQS:-32768 4096}; do
  (cd /tmp/base && python3 bench/e2e.py $E --steps 3 --warmup 3 --seq-lens $S --out $OUT/base_$S.json > $OUT/base_$S.log 2>&1)
  python3 bench/e2e.py $E --steps 3 --warmup 3 --seq-lens $S --out $OUT/new_$S.json > $OUT/new_$S.log 2>&1
done
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*_*.json")):
    for c in json.load(open(f))["cells"]:
        o = c["ours"]
        print(f"{os.path.basename(f):16s} {o.get('status')} tok/s {o.get('tokens_per_s', 0):9.0f} step {o.get('step_s', 0):.4f} "
              f"med {o.get('step_s_median', 0):.4f} fb {o.get('forward_backward_s', 0):.4f} peak {o.get('peak_allocated_gib', 0):.2f}")
PY
