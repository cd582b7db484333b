#!/bin/bash
# Session 25: the backward's part 1 of chunk c+1 on a side stream beside part 2 of chunk c (sparse_mla.OVERLAP_PARTS
# = the side stream's priority), against the sequential order, in bench/ws_bwd_sweep.py (whole backward, T = 4K and
# 32K); nvidia-smi samples power and clocks meanwhile. Ran at 9f8ea7f with overlap_parts.patch applied (git apply
# bench/results/runs/s25/oneoff/overlap_parts.patch); not kept (no gain). Output: runs/s25/ws_bwd_sweep_overlap_parts.json,
# runs/s25/smi_overlap.csv.
source bench/gpu_env.sh
OUTS=$OUT; export -n OUT
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw.instant,clocks_event_reasons.active --format=csv,noheader \
  -lms 20 > $OUTS/smi_overlap.csv &
SMI=$!
OUT=$OUTS timeout 400 python3 bench/ws_bwd_sweep.py bwd_grad '{}' '{"overlap_parts": -100}' '{"overlap_parts": 0}' \
  '{"overlap_parts": -100, "scratch_bytes": 536870912}' '{}' 2>&1 | grep -v "^\s*$" | tail -14
kill $SMI
