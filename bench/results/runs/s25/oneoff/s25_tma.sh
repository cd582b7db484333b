#!/bin/bash
# Session 25: TMA reductions (cp.reduce.async.bulk.tensor .add) against red.global.add.v4.f32 for part 2's dKV:
# the rate probe (runs/s25/tma_reduce_rate.json), then the whole backward with each (bench/ws_bwd_sweep.py), dq / dkv
# against the atomics. The second step needs a TMA-reduction variant of part 2 ("tma_reduce" in sparse_mla_ws.TUNE,
# tried in session 25 and not kept): it failed at run time ("illegal instruction"), and the probe shows no rate to win.
source bench/gpu_env.sh
OUTS=$OUT; export -n OUT
nvidia-smi --query-gpu=name,clocks.sm,power.draw,clocks_event_reasons.active --format=csv,noheader
(cd bench && timeout 240 python3 tma_reduce_probe.py --out $OUTS/tma_reduce_rate.json) 2>&1 | tail -25
OUT=$OUTS timeout 300 python3 bench/ws_bwd_sweep.py bwd_grad '{}' '{"tma_reduce": true}' 2>&1 | grep -v "^\s*$" | tail -12
