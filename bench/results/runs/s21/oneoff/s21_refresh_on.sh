# Session 21: the compiled cells of the one-GPU table that earlier sessions measured (4K selective, 16K none and
# selective), side by side with the peer's autocast path (its faster or equal one-GPU path at 4K / 16K compiled in
# sessions 12-13), at the working tree's code. Only JSON comes back.
source bench/gpu_env.sh >/dev/null; mkdir -p /tmp/r; OUTS=$OUT; export -n OUT
E="--compile on --our-mtp off --budget-s 0 --cell-timeout 240 --logs /tmp/e2e_logs --peer-mp autocast"
python3 bench/e2e.py $E --steps 3 --warmup 3 --seq-lens 16384 --ac none,selective --out /tmp/r/16k_on.json > /tmp/16k.log 2>&1
python3 bench/e2e.py $E --steps 4 --warmup 4 --seq-lens 4096 --ac selective --out /tmp/r/4k_on_sel.json > /tmp/4k.log 2>&1
cp /tmp/r/16k_on.json $OUTS/16k_on_pairs_autocast.json; cp /tmp/r/4k_on_sel.json $OUTS/4k_on_sel_pair_autocast.json
cat /tmp/r/16k_on.md /tmp/r/4k_on_sel.md | grep "^|"; tail -n 3 /tmp/16k.log /tmp/4k.log
