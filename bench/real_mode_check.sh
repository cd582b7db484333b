#!/usr/bin/env bash
# The real training mode (MTP and the indexer KL) on one H200 beside torchtitan's DeepSeek-V3, in parts that
# each fit one device call (bench/README.md, "The real training mode"):
#   bash bench/real_mode_check.sh short   # 4K and 16K, AC none; the peer's FSDP and autocast paths (~6 min)
#   bash bench/real_mode_check.sh long    # 32K (AC none, the MTP layer in 16K-token chunks, the latent query
#                                         # rebuilt) and 64K (AC full, MLPs and MTP in 16K-token chunks);
#                                         # the peer with FSDP, AC full where it runs out of memory (~6 min)
#   bash bench/real_mode_check.sh fp8     # ours alone in FP8 (the default filter) at 4K, 16K and 32K (~4 min)
#   bash bench/real_mode_check.sh plain32k  # ours alone at 32K, AC none, no chunking and the latent query kept:
#                                         # whether the MTP layer's backward fits as the config stands (~3 min)
# On the GPU machine with .whl carried. Results in $OUT (or /tmp/out): real_<part>_*.json / .md.
set -uo pipefail
source bench/gpu_env.sh >/dev/null
out=${OUT:-/tmp/out}; mkdir -p "$out"
fp8="--model.converters quantize.linear.float8,quantize.grouped_mm.float8"
at32k="--activation_checkpoint.mtp_token_chunk 16384 --dsa.recompute_latent_query"
at64k="--activation_checkpoint.mlp_token_chunk 16384 $at32k"
cell() {  # name, bench/e2e.py args...
  python3 bench/e2e.py --real-mode --compile on --steps 3 --warmup 2 --warmup-compiled 2 \
    --cell-timeout 260 --budget-s 280 --out "$out/real_$1.json" "${@:2}" 2>&1 \
    | tee "/tmp/real_$1.log" | grep --line-buffered "\[e2e\]   "
  echo "$1: exit ${PIPESTATUS[0]}"
}
case "${1:-}" in
  short)
    cell 4k --ac none --seq-lens 4096 --peer-mp fsdp,autocast
    cell 16k --ac none --seq-lens 16384 --peer-mp fsdp,autocast
    ;;
  long)
    cell 32k --ac none --seq-lens 32768 --our-args="$at32k"
    cell 64k --ac full --seq-lens 65536 --peer-oom-ac off --steps 2 --warmup 1 --our-args="$at64k"
    ;;
  fp8)
    cell fp8_short --no-peer --ac none --seq-lens 4096,16384 --our-args="$fp8"
    cell fp8_32k --no-peer --ac none --seq-lens 32768 --our-args="$at32k $fp8"
    ;;
  plain32k)
    cell plain32k --no-peer --ac none --seq-lens 32768
    ;;
  *) echo "usage: bash bench/real_mode_check.sh short | long | fp8 | plain32k"; exit 2 ;;
esac
