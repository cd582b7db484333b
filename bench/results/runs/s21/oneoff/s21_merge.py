"""Puts a session's side-by-side runs into bench/results/e2e_h200.json: each run's cells replace the one-GPU cell
of the same sequence length, compile and AC mode (the cell keeps its config text; its earlier peer runs go, the
earlier source is named). Run from the repository root:

    python3 bench/results/runs/s21/oneoff/s21_merge.py 0a446eb bench/results/runs/s21
    python3 bench/results/runs/s21/oneoff/s21_merge.py 620cfbd bench/results/runs/s22 22 \
        4k_on_none_pair_autocast,32k_on_none_pair          # session 22
"""
import json
import sys

code, runs = sys.argv[1], sys.argv[2].rstrip("/")
rel = runs.split("bench/results/")[-1]
session = int(sys.argv[3]) if len(sys.argv) > 3 else 21
files = sys.argv[4].split(",") if len(sys.argv) > 4 else [
    "4k_on_none_pair_autocast", "32k_on_none_pair", "16k_on_pairs_autocast", "4k_on_sel_pair_autocast",
    "4k16k_off_pairs", "32k_off_none_pair"]
path = "bench/results/e2e_h200.json"
d = json.load(open(path))
for name in files:
    run = json.load(open(f"{runs}/{name}_{code}.json"))
    for new in run["cells"]:
        prefix = f"1 GPU, S={new['seq_len']}, compile {new['compile']}, AC {new['ac']}"
        cell = next(c for c in d["cells"] if (c["config"] == prefix or c["config"].startswith(prefix + " (the peer"))
                    and "MTP" not in c["config"])
        prev = f"session {cell['session']}'s cell: {cell['source'].split(' ')[0]}"
        for k in [k for k in cell if k == "peer" or k.startswith("peer_") and isinstance(cell[k], dict)]:
            del cell[k]
        peer = new["peer"]
        cell["ours"] = new["ours"]
        cell["peer_autocast" if peer.get("mp") == "autocast" else "peer"] = peer
        cell.update(ratio=new["ratio"], ratio_best_peer=new["ratio"], ratio_median=new.get("ratio_median"),
                    code=code, session=session, command=run["meta"]["command"],
                    source=f"{rel}/{name}_{code}.json (ours and the peer side by side, same run); {prev}")
        cell.pop("ratio_median_note", None)
        print(f"{cell['config'][:64]:64s} {cell['ours']['tokens_per_s']:7.0f} {peer['tokens_per_s']:7.0f} "
              f"{peer.get('mp')} {peer.get('ac')} {cell['ratio']:.3f} MFU {cell['ours']['mfu_pct']:.1f}")
d.update(date="2026-12-02", session=session)
json.dump(d, open(path, "w"), indent=1)
