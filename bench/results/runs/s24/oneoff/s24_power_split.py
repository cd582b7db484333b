"""Each side's power and SM clock over its timed steps in a session-24 pair with power sampled
(s24_pair_power.sh), run locally on the fetched files: each side's window is the last (timed steps x median step
time) seconds before its log's last write.

    python3 bench/results/runs/s24/oneoff/s24_power_split.py bench/results/runs/s24/pair_power \
        bench/results/runs/s24/32k_on_none_pair_374f6bb.json
"""
import datetime
import json
import os
import statistics
import sys

d, result = sys.argv[1], sys.argv[2]
cell = json.load(open(result))["cells"][0]
ends = json.load(open(f"{d}/log_times.json"))["logs"]
rows = []
for line in open(f"{d}/smi_pair.csv"):
    p = line.strip().split(", ")
    if len(p) >= 5 and "MHz" in p[1]:
        t = datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        rows.append((t, float(p[1].split()[0]), float(p[2].split()[0]), p[4]))
for name in ("ours", "peer"):
    r = cell[name] if name in cell else cell["peer_autocast"]
    end = ends[os.path.basename(r["log"])]
    step_s = r["tokens_per_step"] / r["tokens_per_s"]
    w = [x for x in rows if end - r.get("steps", 3) * step_s <= x[0] <= end]
    watts = statistics.mean(x[2] for x in w)
    clocks = [x[1] for x in w]
    print(f"{name}: tok/s {r['tokens_per_s']:.0f}, step {step_s:.3f} s, {len(w)} samples, power mean {watts:.0f} W "
          f"(median {statistics.median(x[2] for x in w):.0f}), SM clock median {statistics.median(clocks):.0f} MHz "
          f"(min {min(clocks):.0f}, max {max(clocks):.0f}), energy per token "
          f"{watts * step_s / r['tokens_per_step'] * 1e3:.1f} mJ, SW power cap (0x4) in "
          f"{sum(x[3] == '0x0000000000000004' for x in w)} samples")
