"""Top GPU kernels of a torch.profiler Chrome trace, per profiled step, grouped by kernel and by category.

    python bench/trace_summary.py TRACE.json [--steps 1] [--top 25] [--json OUT.json]

Used by ``bench/e2e.py --trace`` (issue 6: profile-driven work) on both sides of a cell; also works on the traces
``train.py --profiling.enable_profiling`` writes. Times are the sum of kernel durations on the GPU (overlapping
streams are added, so the total can exceed the step's wall time when communication overlaps compute).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict

# first match wins; names are matched lower-cased
CATEGORIES = (
    ("dsa: sparse mla fwd", r"^_fwd_kernel"),
    ("dsa: sparse mla bwd", r"^_bwd_(dq_|dkv_)?kernel"),
    ("dsa: indexer top-k", r"^_(score|select)_kernel"),
    ("dsa: indexer kl", r"^_kl_(fwd|bwd)_kernel"),
    ("dense attention (flash/cudnn/efficient)", r"flash|fmha|cudnn|attention|sdpa|efficient"),
    ("grouped gemm (moe)", r"grouped|group_gemm|groupproblem|ragged"),
    ("nccl", r"nccl"),
    ("gemm (cublas/cutlass)", r"gemm|nvjet|xmma|cutlass|sm90_|wgmma|splitk"),
    ("inductor triton", r"^triton_"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("copy / cat / index", r"copy|cat|index|gather|scatter|memcpy|memset|fill"),
    ("reduce / softmax / norm", r"reduce|softmax|norm|cross_entropy|logsumexp|sum"),
    ("elementwise", r"elementwise|vectorized|unrolled"),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, pat in CATEGORIES:
        if re.search(pat, low):
            return cat
    return "other"


def summarize(path: str, steps: int = 1, top: int = 25) -> dict:
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            rec = per_name[e.get("name", "?")]
            rec[0] += float(e.get("dur", 0.0)) / 1e3  # us -> ms
            rec[1] += 1
    total = sum(v[0] for v in per_name.values())
    by_cat: dict[str, float] = defaultdict(float)
    for name, (ms, _) in per_name.items():
        by_cat[category(name)] += ms
    rows = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    return {
        "trace": path, "steps": steps, "gpu_ms_per_step": total / steps,
        "categories": [{"category": c, "ms_per_step": ms / steps, "pct": 100.0 * ms / max(total, 1e-9)}
                       for c, ms in sorted(by_cat.items(), key=lambda kv: -kv[1])],
        "kernels": [{"name": n[:160], "category": category(n), "ms_per_step": ms / steps, "calls_per_step": c / steps,
                     "pct": 100.0 * ms / max(total, 1e-9)} for n, (ms, c) in rows[:top]],
    }


def text(summary: dict, title: str = "") -> str:
    lines = [f"{title} GPU kernel time {summary['gpu_ms_per_step']:.1f} ms/step ({summary['trace']})".strip()]
    for c in summary["categories"]:
        lines.append(f"  {c['ms_per_step']:9.2f} ms {c['pct']:5.1f}%  {c['category']}")
    lines.append("  top kernels:")
    for k in summary["kernels"]:
        lines.append(f"  {k['ms_per_step']:9.2f} ms {k['pct']:5.1f}% x{k['calls_per_step']:<5g} {k['name'][:100]}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=1, help="profiled steps in the trace (times are divided by it)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    s = summarize(a.trace, a.steps, a.top)
    print(text(s))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
