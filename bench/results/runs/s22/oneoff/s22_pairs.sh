# Session 22, third call: the Gluon kernels' GPU tests at the new part-1 defaults (column-chunked, two loaders), then
# side by side with the peer at 32K (compiled, AC none, no MTP; the peer falls back to AC full) and 4K (peer autocast).
source bench/gpu_env.sh >/dev/null; mkdir -p /tmp/r
timeout 150 python3 -m pytest -q tests/kernels/test_kernels_gpu.py -k "sparse_mla" > /tmp/t.log 2>&1; echo "pytest rc $?"
tail -3 /tmp/t.log
E="--compile on --our-mtp off --ac none --budget-s 0 --cell-timeout 240 --logs /tmp/e2e_logs"
OUTS=$OUT; export -n OUT
python3 bench/e2e.py $E --steps 3 --warmup 3 --seq-lens 32768 --out /tmp/r/32k.json > /tmp/32k.log 2>&1
cp /tmp/r/32k.json $OUTS/32k_on_none_pair.json; grep "^|" /tmp/r/32k.md
python3 bench/e2e.py $E --steps 4 --warmup 4 --seq-lens 4096 --peer-args "--mp autocast" --out /tmp/r/4k.json > /tmp/4k.log 2>&1
cp /tmp/r/4k.json $OUTS/4k_on_none_pair_autocast.json; grep "^|" /tmp/r/4k.md
