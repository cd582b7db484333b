# Session 24, power of both sides: the 32K pair (compiled, AC none on ours, the peer at its fitting AC full) with
# nvidia-smi sampling power.draw.instant / SM clock every 20 ms (read-only); each side's timed steps are taken as
# the last (steps x its median step time) seconds before its log's last write (s24_power_split.py).
# Optional: $1 = sequence length (default 32768), $2 = extra bench/e2e.py arguments (the 4K pair: 4096 and
# '--peer-args=--mp autocast'); the results go to $OUT/pair_<S> instead of $OUT.
S=${1:-32768}
source bench/gpu_env.sh >/dev/null
OUTS=$OUT; export -n OUT; mkdir -p /tmp/r /tmp/e2e_logs
if [ -n "$1" ]; then OUTS=$OUTS/pair_$S; mkdir -p $OUTS; fi
Q=timestamp,clocks.sm,power.draw.instant,power.draw,clocks_event_reasons.active
nvidia-smi --query-gpu=$Q --format=csv,noheader -c 1 > /dev/null 2>&1 || Q=timestamp,clocks.sm,power.draw,power.draw,clocks_event_reasons.active
nvidia-smi --query-gpu=$Q --format=csv,noheader -lms 20 > $OUTS/smi_pair.csv 2>&1 & SMI=$!
timeout 300 python3 bench/e2e.py --compile on --our-mtp off --ac none --budget-s 0 --cell-timeout 240 \
  --logs /tmp/e2e_logs --steps 3 --warmup 3 --seq-lens $S ${2:+"$2"} --out /tmp/r/pair.json > $OUTS/pair.log 2>&1
echo "e2e rc $?"; kill $SMI
cp /tmp/r/pair.json $OUTS/s${S}_on_none_pair_power.json; cp /tmp/r/pair.md $OUTS/ 2>/dev/null
grep "^|" /tmp/r/pair.md | tail -2
ls -l --time-style=+%s.%N /tmp/e2e_logs > $OUTS/logs_ls.txt; cp -rp /tmp/e2e_logs $OUTS/e2e_logs
python3 - $OUTS <<'PY'
import sys, os, json, datetime, statistics
d = sys.argv[1]
rows = []
for l in open(f"{d}/smi_pair.csv"):
    p = l.strip().split(", ")
    if len(p) < 5 or "MHz" not in p[1]:
        continue
    t = datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
    rows.append((t, float(p[1].split()[0]), float(p[2].split()[0]), p[4]))
print("smi samples", len(rows))
logs = {f: os.path.getmtime(f"/tmp/e2e_logs/{f}") for f in os.listdir("/tmp/e2e_logs")}
print("logs", sorted(logs.items(), key=lambda kv: kv[1]))
json.dump(dict(logs=logs), open(f"{d}/log_times.json", "w"))
PY
