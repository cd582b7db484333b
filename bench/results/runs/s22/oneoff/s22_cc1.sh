# Session 22, first call: the column-chunked part 1 of the sparse MLA backward (sparse_mla_ws._bwd_ps_cc_kernel,
# TUNE["bwd_ps"]["chunked"]): GPU tests of part 1 (both kernels) and the backward part sweep at 4K / 32K.
# Ran on the working tree before 620cfbd, where TUNE["bwd_ps"] still chose between the session-16 kernel
# ("chunked": false) and the new one; since 43c52e8 the chunked kernel with a loader per consumer is the only one.
source bench/gpu_env.sh >/dev/null
timeout 150 python3 -m pytest -q -x tests/kernels/test_kernels_gpu.py -k "part1" > /tmp/t.log 2>&1; echo "pytest rc $?"
tail -8 /tmp/t.log
timeout 240 python3 bench/ws_bwd_sweep.py bwd_ps '{}' '{"chunked": true, "bk": 64, "stages": 8}' \
  '{"chunked": true, "bk": 64, "stages": 10}' > /tmp/s.log 2>&1; echo "sweep rc $?"
grep -v "^\s*$" /tmp/s.log | tail -10; cp $OUT/*.json /dev/null 2>&1 || true
