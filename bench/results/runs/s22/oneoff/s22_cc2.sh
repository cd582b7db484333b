# Session 22, second call: part 1 with one loader per consumer (TUNE["bwd_ps"]["loaders"] = 2) against one loader,
# and the indexer's scoring with 8 queries per program (TUNE["score"]["BQ"]).
# Ran on the working tree before 620cfbd (TUNE["bwd_ps"]["chunked"] / ["loaders"] existed then; since 43c52e8
# neither does: the chunked kernel with a loader per consumer is the only one).
source bench/gpu_env.sh >/dev/null
timeout 100 python3 -m pytest -q -x tests/kernels/test_kernels_gpu.py -k "part1" > /tmp/t.log 2>&1; echo "pytest rc $?"
tail -3 /tmp/t.log
C='"chunked": true, "bk": 64, "stages": 10'
timeout 200 python3 bench/ws_bwd_sweep.py bwd_ps "{$C}" "{$C, \"loaders\": 2, \"maxnreg\": 128, \"consumer_regs\": 200, \"loader_regs\": 56}" \
  "{$C, \"loaders\": 2, \"maxnreg\": 128, \"consumer_regs\": 184, \"loader_regs\": 72}" > /tmp/s.log 2>&1; echo "sweep rc $?"
grep RESULT /tmp/s.log; grep -i error /tmp/s.log | head -3
timeout 150 python3 bench/indexer_sweep.py '{}' '{"BQ": 8, "BN": 64, "num_warps": 8, "num_stages": 3}' \
  '{"BQ": 8, "BN": 64, "num_warps": 16, "num_stages": 3}' '{"BQ": 8, "BN": 64, "num_warps": 8, "num_stages": 2}' \
  '{"BQ": 8, "BN": 32, "num_warps": 8, "num_stages": 3}' > /tmp/i.log 2>&1; echo "indexer rc $?"
grep RESULT /tmp/i.log; grep -i error /tmp/i.log | head -3
