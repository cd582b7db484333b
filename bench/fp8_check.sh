#!/usr/bin/env bash
# FP8 training against bf16 on one H200, in one call (docs/fp8_training.md): the FP8 products at real
# size, the proxy trained 300 steps in bf16 (two data orders) and in FP8, then tokens/s of both at
# 4K and 32K (compiled, MTP off, AC none). About 8 minutes. Usage on the GPU machine (.whl carried):
#   bash bench/fp8_check.sh
# Results in $OUT (or /tmp/out): the three runs' metrics.jsonl, e2e_bf16.json / e2e_fp8.json and the
# curve comparison (bench/compare_curves.py) printed last.
set -uo pipefail
source bench/gpu_env.sh >/dev/null
out=${OUT:-/tmp/out}; mkdir -p "$out"
fp8="quantize.linear.float8,quantize.grouped_mm.float8"
python3 -m pytest -q -x tests/kernels/test_kernels_gpu.py -k fp8 2>&1 | tail -3
run() {  # name, train.py args...
  timeout 150 python3 train.py --job.config_file train_configs/glm52_proxy.toml --training.steps 300 \
    --metrics.log_freq 5 --job.dump_folder "/tmp/$1" --checkpoint.no-enable \
    --metrics.no-enable_tensorboard "${@:2}" > "/tmp/$1.log" 2>&1
  echo "$1: exit $?"; grep "FP8\|run summary\|rror" "/tmp/$1.log" | tail -3
  cp "/tmp/$1/metrics.jsonl" "$out/$1.jsonl"
}
run bf16_seed0
run bf16_seed1 --data.seed 1
run fp8_seed0 --model.converters "$fp8"
e2e() {  # name, bench/e2e.py args...
  python3 bench/e2e.py --no-peer --our-mtp off --compile on --ac none --seq-lens 4096,32768 \
    --steps 3 --warmup 2 --warmup-compiled 2 --cell-timeout 150 --logs "/tmp/$1" \
    --out "$out/$1.json" "${@:2}" > "/tmp/$1.log" 2>&1
  echo "$1: exit $?"; grep "S=" "/tmp/$1.log"
}
e2e e2e_bf16
e2e e2e_fp8 --our-args="--model.converters $fp8"
python3 bench/compare_curves.py "$out/bf16_seed0.jsonl" "$out/bf16_seed1.jsonl" "$out/fp8_seed0.jsonl"
