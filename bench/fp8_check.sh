#!/usr/bin/env bash
# FP8 training against bf16 on one H200 (docs/fp8_training.md), in two parts that each fit one call:
#   bash bench/fp8_check.sh speed    # the FP8 GPU tests at real size, then tokens/s at 4K and 32K of bf16,
#                                    # FP8 (the default filter: the head in FP8 too) and FP8 with the head
#                                    # bf16 (compiled, MTP off, AC none); about 6 minutes
#   bash bench/fp8_check.sh curves [all]  # the proxy trained 300 steps (eager, 4K, MTP on) in bf16 with two
#                                    # data orders and in FP8 (with "all" also FP8 with the head bf16),
#                                    # from the same start; the curve comparison
#                                    # (bench/compare_curves.py) printed last; about 4.5 minutes (6 with "all")
# SEQ_LENS=4096 bash bench/fp8_check.sh speed: other lengths (4K alone fits an 80 GB H100); SKIP_TESTS=1: no
# GPU tests first. CURVE_ARGS="--activation_checkpoint.mode full" bash bench/fp8_check.sh curves: more train.py
# arguments for every run of the curves (full AC fits the 4K runs with MTP into an 80 GB H100).
# On the GPU machine with .whl carried. Results in $OUT (or /tmp/out): e2e_*.json, the runs' *.jsonl.
set -uo pipefail
source bench/gpu_env.sh >/dev/null
out=${OUT:-/tmp/out}; mkdir -p "$out"
fp8="quantize.linear.float8,quantize.grouped_mm.float8"
head_bf16="--quantize.linear.float8.filter_fqns output,indexer,wkv_b"  # the default filter and "output"
run() {  # name, train.py args...
  # shellcheck disable=SC2086  # CURVE_ARGS holds several arguments
  timeout 240 python3 train.py --job.config_file train_configs/glm52_proxy.toml --training.steps 300 \
    --metrics.log_freq 5 --job.dump_folder "/tmp/$1" --checkpoint.no-enable \
    --metrics.no-enable_tensorboard ${CURVE_ARGS:-} "${@:2}" > "/tmp/$1.log" 2>&1
  echo "$1: exit $?"; grep "FP8\|run summary\|rror" "/tmp/$1.log" | tail -3
  cp "/tmp/$1/metrics.jsonl" "$out/$1.jsonl"
}
e2e() {  # name, bench/e2e.py args...
  python3 bench/e2e.py --no-peer --our-mtp off --compile on --ac none --seq-lens "${SEQ_LENS:-32768,4096}" \
    --steps 3 --warmup 2 --warmup-compiled 2 --cell-timeout 150 --logs "/tmp/$1" \
    --out "$out/$1.json" "${@:2}" 2>&1 | tee "/tmp/$1.log" | grep --line-buffered "\[e2e\]   ours"
  echo "$1: exit ${PIPESTATUS[0]}"
}
case "${1:-}" in
  speed)
    [ -n "${SKIP_TESTS:-}" ] || python3 -m pytest -q -x tests/kernels/test_kernels_gpu.py -k fp8 2>&1 | tail -3
    e2e e2e_bf16
    e2e e2e_fp8 --our-args="--model.converters $fp8"
    e2e e2e_fp8_head_bf16 --our-args="--model.converters $fp8 $head_bf16"
    ;;
  curves)
    run bf16_seed0
    run bf16_seed1 --data.seed 1
    # shellcheck disable=SC2086  # $head_bf16 is two arguments
    if [ "${2:-}" = all ]; then run fp8_head_bf16_seed0 --model.converters "$fp8" $head_bf16; fi
    run fp8_seed0 --model.converters "$fp8"
    python3 bench/compare_curves.py "$out"/bf16_seed0.jsonl "$out"/bf16_seed1.jsonl \
      "$out"/fp8*_seed0.jsonl
    ;;
  *) echo "usage: bash bench/fp8_check.sh speed | curves [all]"; exit 2 ;;
esac
