#!/bin/bash
# Session 25, timing experiment only: the optimizer update on a side stream while the next step's forward runs
# WITHOUT waiting for it (side_update_hack.patch, applied here on the device only; the forward reads weights being
# written, so the losses mean nothing), the next backward waiting: an upper bound of what overlapping the update
# with the next forward could give. Ours alone, compiled, AC none, no MTP; baseline and hack alternating.
source bench/gpu_env.sh
OUTS=$OUT; export -n OUT
git apply bench/results/runs/s25/oneoff/side_update_hack.patch || exit 1
mkdir -p /tmp/r
COMMON="--compile on --our-mtp off --ac none --budget-s 0 --cell-timeout 240 --logs /tmp/e2e_logs --no-peer"
for i in 1 2; do
  for mode in base hack; do
    if [ $mode = hack ]; then export TITAN_HACK_SIDE_UPDATE=1; else unset TITAN_HACK_SIDE_UPDATE; fi
    timeout 250 python3 bench/e2e.py $COMMON --steps 5 --warmup 3 --seq-lens 32768 --out $OUTS/32k_${mode}_$i.json \
      2>&1 | grep -E "^\| *32768|tok/s" | tail -2
  done
done
for i in 1 2; do
  for mode in base hack; do
    if [ $mode = hack ]; then export TITAN_HACK_SIDE_UPDATE=1; else unset TITAN_HACK_SIDE_UPDATE; fi
    timeout 150 python3 bench/e2e.py $COMMON --steps 8 --warmup 3 --seq-lens 4096 --out $OUTS/4k_${mode}_$i.json \
      2>&1 | grep -E "^\| *4096|tok/s" | tail -2
  done
done
python3 - "$OUTS" <<'PY'
import json, sys, glob, os
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*_*_*.json"))):
    d = json.load(open(f))
    cells = d.get("cells") or d.get("results") or []
    for c in cells:
        o = c.get("ours", {})
        print(os.path.basename(f), o.get("tokens_per_s"), o.get("step_s_median"), o.get("status"))
PY
git checkout titan_glm52/trainer.py
