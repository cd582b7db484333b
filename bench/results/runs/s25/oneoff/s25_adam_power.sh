#!/bin/bash
# Session 25: the optimizer step's power draw, for the question whether running it beside the next step's forward
# would save energy per step at 32K: bench/adam.py with 150 timed steps per variant, nvidia-smi every 20 ms.
source bench/gpu_env.sh
OUTS=$OUT; export -n OUT
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw.instant,power.draw.average,clocks_event_reasons.active,temperature.gpu \
  --format=csv,noheader -lms 20 > $OUTS/smi_adam.csv &
SMI=$!
sleep 1
timeout 300 python3 bench/adam.py --flavor glm52_proxy --warmup 5 --steps 150 --sweep 1024x4 --out $OUTS/adam_power.json 2>&1 \
  | while IFS= read -r line; do echo "$(date +%s.%N) $line"; done | tail -8
sleep 1
kill $SMI
