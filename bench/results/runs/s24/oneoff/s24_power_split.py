"""Each side's power and SM clock over its timed steps in the session-24 32K pair (run locally on the fetched
files): the window is the last (timed steps x median step time) seconds before the side's log's last write.

    python3 bench/results/runs/s24/oneoff/s24_power_split.py bench/results/runs/s24/pair_power
"""
import datetime
import json
import statistics
import sys

d = sys.argv[1]
res = json.load(open(f"{d}/../32k_on_none_pair_374f6bb.json"))
ends = json.load(open(f"{d}/log_times.json"))["logs"]
rows = []
for line in open(f"{d}/smi_pair.csv"):
    p = line.strip().split(", ")
    if len(p) >= 5 and "MHz" in p[1]:
        t = datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        rows.append((t, float(p[1].split()[0]), float(p[2].split()[0]), p[4]))
cell = res["cells"][0] if "cells" in res else res["results"][0]
sides = {"ours": (ends["ours_s32768_con_none.log"], cell["ours"]), "peer": (ends["peer_s32768_con_none_acfull.log"], cell["peer"])}
for name, (end, r) in sides.items():
    step_s = r["tokens_per_step"] / r["tokens_per_s"] if "tokens_per_step" in r else 32768 / r["tokens_per_s"]
    start = end - 3 * step_s
    w = [x for x in rows if start <= x[0] <= end]
    watts = statistics.mean(x[2] for x in w)
    print(f"{name}: tok/s {r['tokens_per_s']:.0f}, step {step_s:.3f} s, {len(w)} samples, power mean {watts:.0f} W "
          f"(median {statistics.median(x[2] for x in w):.0f}), SM clock median {statistics.median(x[1] for x in w):.0f} MHz "
          f"(min {min(x[1] for x in w):.0f}, max {max(x[1] for x in w):.0f}), energy per token "
          f"{watts * step_s / 32768 * 1e3:.1f} mJ, SW power cap (0x4) in {sum(x[3] == '0x0000000000000004' for x in w)} samples")
