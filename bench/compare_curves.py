"""Loss curves of runs of the same config side by side: does a candidate (FP8, say) stay within the
spread of two references that differ only in data order?

    python3 bench/compare_curves.py REF_A.jsonl REF_B.jsonl [CANDIDATE.jsonl ...] [--from-step 100]

Each file is a run's ``metrics.jsonl``. Prints ``loss/total`` at every 30th logged step and, from
``--from-step`` on, each run's mean and largest absolute difference to REF_A: the candidate agrees
when its differences are no larger than REF_B's (the spread of data order). Exit status 0 always.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics


def losses(path: str) -> dict[int, float]:
    with open(path) as f:
        return {r["step"]: r["loss/total"] for r in map(json.loads, f) if "loss/total" in r}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="metrics.jsonl files: two references, then candidates")
    ap.add_argument("--from-step", type=int, default=100)
    a = ap.parse_args()
    curves = {os.path.basename(p): losses(p) for p in a.runs}
    names = list(curves)
    ref = curves[names[0]]
    steps = sorted(set.intersection(*(set(c) for c in curves.values())))
    print("| step | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for s in steps[::6] + ([steps[-1]] if steps and steps[-1] not in steps[::6] else []):
        print(f"| {s} | " + " | ".join(f"{curves[n][s]:.3f}" for n in names) + " |")
    late = [s for s in steps if s >= a.from_step]
    print(
        f"\nabsolute difference to {names[0]} from step {a.from_step} "
        f"({len(late)} logged steps):"
    )
    for n in names[1:]:
        d = [abs(curves[n][s] - ref[s]) for s in late]
        if d:
            print(f"  {n}: mean {statistics.mean(d):.3f}, largest {max(d):.3f}")


if __name__ == "__main__":
    main()
