# Session 26: one profiled 32K step of ours alone (compiled, AC none, no MTP) at 5551bb6's kernels (the Gluon indexer
# scoring); the trace summary, then the trace itself gzipped.
source bench/gpu_env.sh >/dev/null; mkdir -p /tmp/r
E="--compile on --our-mtp off --ac none --budget-s 0 --cell-timeout 240 --logs /tmp/e2e_logs"
OUTS=$OUT; export -n OUT
python3 bench/e2e.py $E --no-peer --steps 2 --warmup 3 --seq-lens 32768 --trace --out /tmp/r/32kt.json > /tmp/32kt.log 2>&1
cp /tmp/r/32kt.json $OUTS/32k_on_none_trace_5551bb6.json; grep -A 32 "GPU kernel time" /tmp/32kt.log | head -45
T=$(ls /tmp/e2e_logs/ours_*_trace.json | head -1); gzip -c "$T" > $OUTS/32k_trace_5551bb6.json.gz; ls -la $OUTS
