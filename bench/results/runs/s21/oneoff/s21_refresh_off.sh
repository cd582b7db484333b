# Session 21: the eager (compile off) cells of the one-GPU table at the working tree's code, side by side with the
# peer: at 4K and 16K (AC none and selective) its autocast path (PEER_MP=fsdp,autocast runs both; not done in
# session 21), at 32K AC none its FSDP path, which falls back to AC full, its only fitting mode. Only JSON comes back.
source bench/gpu_env.sh >/dev/null; mkdir -p /tmp/r; OUTS=$OUT; export -n OUT
E="--compile off --our-mtp off --budget-s 0 --cell-timeout 200 --logs /tmp/e2e_logs --steps 3 --warmup 2"
python3 bench/e2e.py $E --seq-lens 4096,16384 --ac none,selective --peer-mp ${PEER_MP:-autocast} --out /tmp/r/off.json > /tmp/off.log 2>&1
cp /tmp/r/off.json $OUTS/4k16k_off_pairs.json
python3 bench/e2e.py $E --seq-lens 32768 --ac none --out /tmp/r/32k_off.json > /tmp/32k.log 2>&1
cp /tmp/r/32k_off.json $OUTS/32k_off_none_pair.json
cat /tmp/r/off.md /tmp/r/32k_off.md | grep "^|"; tail -n 3 /tmp/off.log /tmp/32k.log
