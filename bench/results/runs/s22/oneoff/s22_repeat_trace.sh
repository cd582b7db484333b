# Session 22, fourth call: the 32K pair once more (compiled, AC none vs the peer's AC full), then one profiled 32K
# step of ours alone (trace summary + the gzipped trace), at 620cfbd's kernels.
source bench/gpu_env.sh >/dev/null; mkdir -p /tmp/r
E="--compile on --our-mtp off --ac none --budget-s 0 --cell-timeout 240 --logs /tmp/e2e_logs"
OUTS=$OUT; export -n OUT
python3 bench/e2e.py $E --steps 3 --warmup 3 --seq-lens 32768 --out /tmp/r/32k.json > /tmp/32k.log 2>&1
cp /tmp/r/32k.json $OUTS/32k_on_none_pair_b.json; grep "^|" /tmp/r/32k.md
python3 bench/e2e.py $E --no-peer --steps 2 --warmup 3 --seq-lens 32768 --trace --out /tmp/r/32kt.json > /tmp/32kt.log 2>&1
cp /tmp/r/32kt.json $OUTS/32k_on_none_trace.json; grep -A 30 "GPU kernel time" /tmp/32kt.log | head -45
T=$(ls /tmp/e2e_logs/ours_*_trace.json | head -1); gzip -c "$T" > $OUTS/32k_trace.json.gz; ls -la $OUTS
