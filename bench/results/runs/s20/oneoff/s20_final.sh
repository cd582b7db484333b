# Session 20, last device call: GPU tests of the fp32 projection, its probe, then the working tree side by side
# with the peer at 4K (peer autocast) and 32K (compiled, AC none, no MTP). Only JSON and a summary come back.
source bench/gpu_env.sh >/dev/null; mkdir -p /tmp/r
python3 -m pytest -q -rf -p no:cacheprovider tests/kernels/test_linear_fp32.py 2>&1 | tail -3
python3 bench/results/runs/s20/oneoff/s20_lin_probe.py $OUT/lin_probe.json 2>&1 | grep "^{"
E="--compile on --our-mtp off --ac none --budget-s 0 --cell-timeout 240 --logs /tmp/e2e_logs"
python3 bench/e2e.py $E --steps 4 --warmup 4 --seq-lens 4096 --peer-args "--mp autocast" --out /tmp/r/4k.json > /tmp/4k.log 2>&1
python3 bench/e2e.py $E --steps 3 --warmup 3 --seq-lens 32768 --out /tmp/r/32k.json > /tmp/32k.log 2>&1
cp /tmp/r/4k.json $OUT/4k_on_none_pair_autocast.json; cp /tmp/r/32k.json $OUT/32k_on_none_pair.json
cp /tmp/r/4k.md $OUT/4k_on_none_pair_autocast.md; cp /tmp/r/32k.md $OUT/32k_on_none_pair.md
cat /tmp/r/4k.md /tmp/r/32k.md | grep "^|"
