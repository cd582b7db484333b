"""Replaces the 4K and 32K compiled AC-none cells of bench/results/e2e_h200.json with a side-by-side pair run.

    python3 bench/results/runs/s21/oneoff/s21_merge.py CODE RUNS_DIR   # e.g. 0a446eb bench/results/runs/s21
"""
import json
import sys

code, runs = sys.argv[1], sys.argv[2].rstrip("/")
path = "bench/results/e2e_h200.json"
d = json.load(open(path))
rel = runs.split("bench/results/")[-1]
pairs = {4096: (f"{runs}/4k_on_none_pair_autocast_{code}.json", "peer_autocast"),
         32768: (f"{runs}/32k_on_none_pair_{code}.json", "peer")}
for seq, (f, peer_key) in pairs.items():
    new = json.load(open(f))["cells"][0]
    cell = next(c for c in d["cells"] if c["config"].startswith(f"1 GPU, S={seq}, compile on, AC none")
                and "MTP" not in c["config"])
    prev = f"session {cell['session']}'s cell: {cell['source'].split(' ')[0]}"
    cell["ours"] = new["ours"]
    cell[peer_key] = new["peer"]
    cell.update(ratio=new["ratio"], ratio_best_peer=new["ratio"], ratio_median=new.get("ratio_median"), code=code,
                session=21, command=json.load(open(f))["meta"]["command"],
                source=f"{rel}/{f.split('/')[-1]} (ours and the peer side by side, same run); {prev}")
    print(cell["config"], round(cell["ours"]["tokens_per_s"]), round(cell[peer_key]["tokens_per_s"]),
          round(cell["ratio"], 3), round(cell["ours"]["mfu_pct"], 1))
d.update(date="2026-12-02", session=21)
json.dump(d, open(path, "w"), indent=1)
