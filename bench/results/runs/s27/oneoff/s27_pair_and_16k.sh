#!/bin/bash
# Session 27: the 32K side-by-side pair with power sampled (the default moe.grouped_mm = auto: one cuBLAS product per
# expert at 32K), then the per-expert / grouped A/B at 16K and 8K tokens (ours alone).
bash bench/results/runs/s24/oneoff/s24_pair_power.sh
bash bench/results/runs/s27/oneoff/s27_expert_mm_16k.sh
