# Ran in session 23 on the tree of branch s23-l2-hints (31f25c4; the TUNE keys store_evict / rotate are not on main:
# measured no gain). Output: ../*_l2.json, ../32k_ours_base.json, ../32k_ours_evict_rotate.json.
# Session 23, second call: the GPU tests of the new part-1 / part-2 options, then A/B of (1) part 1's P / dS scratch
# stored with L2 evict_first (TUNE bwd_ps store_evict), (2) part 2's steps rotated per row (bwd_grad rotate), (3) a
# 2 GB backward scratch (4K-query chunks instead of 2K), each at the kernel level (bench/ws_bwd_sweep.py), then the
# first two in a 32K training step (ours only, compiled, AC none, no MTP) against the defaults on the same machine.
source bench/gpu_env.sh >/dev/null; mkdir -p /tmp/r
OUTS=$OUT; export -n OUT
timeout 200 python3 -m pytest -q -x tests/kernels/test_kernels_gpu.py -k "sparse_mla_ws" > /tmp/t.log 2>&1; echo "pytest rc $?"
tail -3 /tmp/t.log
OUT=$OUTS timeout 150 python3 bench/ws_bwd_sweep.py bwd_ps '{}' '{"store_evict": "evict_first"}' '{}' > /tmp/p.log 2>&1; echo "ps rc $?"
grep RESULT /tmp/p.log
OUT=$OUTS timeout 200 python3 bench/ws_bwd_sweep.py bwd_grad '{}' '{"rotate": true}' '{"scratch_bytes": 2147483648}' '{}' > /tmp/g.log 2>&1; echo "grad rc $?"
grep RESULT /tmp/g.log
echo '{"sparse_mla_ws": {"bwd_ps": {"store_evict": "evict_first"}, "bwd_grad": {"rotate": true}}}' > /tmp/v.json
E="--compile on --our-mtp off --ac none --budget-s 0 --cell-timeout 200 --logs /tmp/e2e_logs --no-peer --steps 4 --warmup 3 --seq-lens 32768"
timeout 230 python3 bench/e2e.py $E --out /tmp/r/base.json > /tmp/e0.log 2>&1; echo "e2e base rc $?"
cp /tmp/r/base.json $OUTS/32k_ours_base.json; grep "^|" /tmp/r/base.md | tail -2
TITAN_DSA_TUNE_FILE=/tmp/v.json timeout 230 python3 bench/e2e.py $E --out /tmp/r/var.json > /tmp/e1.log 2>&1; echo "e2e var rc $?"
cp /tmp/r/var.json $OUTS/32k_ours_evict_rotate.json; grep "^|" /tmp/r/var.md | tail -2
