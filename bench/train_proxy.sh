#!/usr/bin/env bash
# The proxy config (GLM-5.2 widths, 4 layers, 16 experts, MTP) trained by train.py on one H200.
# Usage on the GPU machine (.whl carried): bash bench/train_proxy.sh [steps] [extra train.py args...]
set -uo pipefail
source bench/gpu_env.sh
steps=${1:-200}; shift || true
out=${OUT:-/tmp/out}/proxy
python3 train.py --job.config_file train_configs/glm52_proxy.toml --training.steps "$steps" \
  --metrics.log_freq 10 --job.dump_folder "$out" "$@" 2>&1 | grep -v "^\s*$" | tail -40
cp "$out/metrics.jsonl" "${OUT:-/tmp/out}/proxy_metrics.jsonl" 2>/dev/null
