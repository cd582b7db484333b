# Session 21, first pair call: the working tree (0a446eb) side by side with the peer at 4K (peer autocast) and 32K
# (compiled, AC none, no MTP), then one profiled 4K step of ours alone (trace summary + the gzipped trace).
source bench/gpu_env.sh >/dev/null; mkdir -p /tmp/r
E="--compile on --our-mtp off --ac none --budget-s 0 --cell-timeout 240 --logs /tmp/e2e_logs"
OUTS=$OUT; export -n OUT
python3 bench/e2e.py $E --steps 4 --warmup 4 --seq-lens 4096 --peer-args "--mp autocast" --out /tmp/r/4k.json > /tmp/4k.log 2>&1
python3 bench/e2e.py $E --steps 3 --warmup 3 --seq-lens 32768 --out /tmp/r/32k.json > /tmp/32k.log 2>&1
cp /tmp/r/4k.json $OUTS/4k_on_none_pair_autocast.json; cp /tmp/r/32k.json $OUTS/32k_on_none_pair.json
cat /tmp/r/4k.md /tmp/r/32k.md | grep "^|"
python3 bench/e2e.py $E --no-peer --steps 2 --warmup 4 --seq-lens 4096 --trace --out /tmp/r/4kt.json > /tmp/4kt.log 2>&1
tail -45 /tmp/4kt.log | head -40
cp /tmp/r/4kt.json $OUTS/4k_on_none_trace.json
T=$(ls /tmp/e2e_logs/ours_*_trace.json | head -1)
echo "trace: $T"; gzip -c "$T" > $OUTS/4k_trace.json.gz && ls -la $OUTS
