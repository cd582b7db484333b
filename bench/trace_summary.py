"""Top GPU kernels of a torch.profiler Chrome trace, per profiled step, grouped by kernel and by
category.

    python bench/trace_summary.py TRACE.json[.gz] [--steps 1] [--top 40] [--json OUT.json] [--gemms]

``--gemms`` adds each GEMM shape's rate: the kernels launched under ``aten::mm`` / ``addmm`` /
``addmm_`` / ``bmm`` / ``_grouped_mm`` (traces recorded with shapes, as ``bench/e2e.py --trace``
records them), grouped by op and input dims, with their calls, time and TFLOP/s, and every call of
at least 1 ms in launch order.

Used by ``bench/e2e.py --trace`` on both sides of a cell; also works on the traces ``train.py
--profiling.enable_profiling`` writes. Times are the sum of kernel durations on the GPU (overlapping
streams are added, so the total can exceed the step's wall time when communication overlaps
compute).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import sys
from collections import defaultdict

# first match wins; names are matched lower-cased
CATEGORIES = (
    ("dsa: sparse mla fwd", r"^_fwd_(ws_)?kernel"),
    ("dsa: sparse mla bwd", r"^_bwd_(dq_|dkv_|ps_|grad_)(ws_)?kernel|^_bwd_kernel"),
    ("dsa: indexer top-k", r"^_(score|score_ws|select)_kernel"),
    ("dsa: indexer kl", r"^_kl_(fwd|bwd)_kernel"),
    ("fp8 quantisation", r"^_quant_(rows|cols|blocks)_kernel"),
    ("dense attention (flash/cudnn/efficient)", r"flash|fmha|cudnn|attention|sdpa|efficient"),
    ("grouped gemm (moe)", r"grouped|group_gemm|groupproblem|ragged"),
    ("nccl", r"nccl"),
    ("gemm (cublas/cutlass)", r"gemm|nvjet|xmma|cutlass|sm90_|wgmma|splitk"),
    ("inductor triton", r"^triton_"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("copy / cat / index", r"copy|cat|index|gather|scatter|memcpy|memset|fill"),
    (
        "reduce / softmax / norm",
        r"reduce|softmax|norm|cross_entropy|logsumexp|sum|^_ce_rows_kernel",
    ),
    ("elementwise", r"elementwise|vectorized|unrolled|^_swiglu_(fwd|bwd)_kernel"),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, pat in CATEGORIES:
        if re.search(pat, low):
            return cat
    return "other"


def _union_ms(spans: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """Total length (ms) of the union of ``(start, end)`` spans in us, and the merged spans."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return sum(b - a for a, b in merged) / 1e3, merged


def _uncovered_ms(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length (ms) of ``spans`` (merged) not inside the merged ``cover`` spans."""
    out, j = 0.0, 0
    for a, b in spans:
        t = a
        while j < len(cover) and cover[j][1] <= t:
            j += 1
        k = j
        while t < b:
            if k >= len(cover) or cover[k][0] >= b:
                out += b - t
                break
            if cover[k][0] > t:
                out += cover[k][0] - t
            t = max(t, cover[k][1])
            k += 1
    return out / 1e3


def timeline(kernels: list[tuple[str, float, float]], steps: int = 1) -> dict:
    """Per step: the GPU span (first kernel start to last kernel end), the time some kernel runs
    (busy), the time none does (idle), NCCL kernel time and the part of it no compute kernel
    overlaps (exposed communication). ``kernels``: (name, start us, duration us)."""
    if not kernels:
        return {}
    spans = [(t, t + d) for _, t, d in kernels]
    comm = [(t, t + d) for n, t, d in kernels if "nccl" in n.lower()]
    compute = [(t, t + d) for n, t, d in kernels if "nccl" not in n.lower()]
    busy, _ = _union_ms(spans)
    _, compute_m = _union_ms(compute)
    comm_ms, comm_m = _union_ms(comm)
    span = (max(b for _, b in spans) - min(a for a, _ in spans)) / 1e3
    return {
        "span_ms": span / steps,
        "busy_ms": busy / steps,
        "idle_ms": (span - busy) / steps,
        "nccl_ms": comm_ms / steps,
        "nccl_exposed_ms": _uncovered_ms(comm_m, compute_m) / steps,
    }


def _stretches(
    kernels: list[tuple[str, float, float]], min_us: float
) -> list[tuple[float, float, str, str]]:
    """The stretches of at least ``min_us`` in which no kernel runs, in time order: (start, end, the
    kernel that ended last before it, the kernel after it)."""
    gaps, end, prev = [], None, None
    for name, t, d in sorted(kernels, key=lambda k: k[1]):
        if end is not None and t - end >= min_us:
            gaps.append((end, t, prev, name))
        if end is None or t + d > end:
            end, prev = t + d, name
    return gaps


def idle_gaps(
    kernels: list[tuple[str, float, float]],
    host: list[tuple[str, float, float]],
    top: int = 8,
    min_us: float = 200.0,
) -> list[dict]:
    """The ``top`` longest stretches (>= ``min_us``) in which no kernel runs: their length, the
    kernels around them and the host ops (name, us of overlap) that ran meanwhile, longest overlap
    first (what the host was doing while the GPU waited)."""
    out = []
    gaps = sorted(
        ((b - a, a, b, before, after) for a, b, before, after in _stretches(kernels, min_us)),
        reverse=True,
    )
    for length, a, b, before, after in gaps[:top]:
        ops: dict[str, float] = defaultdict(float)
        for name, t, d in host:
            ov = min(b, t + d) - max(a, t)
            if ov > 0 and not name.startswith("ProfilerStep"):
                ops[name] += ov
        busiest = sorted(ops.items(), key=lambda kv: -kv[1])[:6]
        out.append(
            {
                "ms": length / 1e3,
                "after_kernel": (before or "")[:80],
                "before_kernel": (after or "")[:80],
                "host_ops": [[n[:80], round(v / 1e3, 3)] for n, v in busiest],
            }
        )
    return out


def idle_profile(
    kernels: list[tuple[str, float, float]],
    host: list[tuple[str, float, float]],
    steps: int = 1,
    bins: int = 10,
    min_us: float = 20.0,
    top: int = 12,
) -> dict:
    """Where in the step the GPU idles and what the host did meanwhile, over every stretch of at
    least ``min_us`` without a kernel: idle ms per tenth of the span (start to end), and the host
    ops that overlapped those stretches, summed (every nesting level: an outer span such as an FSDP
    hook or a compiled region and the op inside it both appear), longest first. Per step."""
    if not kernels:
        return {}
    t0 = min(t for _, t, _ in kernels)
    span = max(t + d for _, t, d in kernels) - t0
    per_bin = [0.0] * bins
    gaps = [(a, b) for a, b, _, _ in _stretches(kernels, min_us)]
    for a, b in gaps:  # split each stretch over the bins it covers
        for i in range(bins):
            lo, hi = t0 + span * i / bins, t0 + span * (i + 1) / bins
            ov = min(b, hi) - max(a, lo)
            if ov > 0:
                per_bin[i] += ov
    ops: dict[str, float] = defaultdict(float)
    starts = [a for a, _ in gaps]
    for name, t, d in host:
        if name.startswith("ProfilerStep"):
            continue
        i = bisect.bisect_right(starts, t + d) - 1
        # gaps that start before the op ends and end after it starts
        while i >= 0 and gaps[i][1] > t:
            ov = min(gaps[i][1], t + d) - max(gaps[i][0], t)
            if ov > 0:
                ops[name] += ov
            i -= 1
    busiest = sorted(ops.items(), key=lambda kv: -kv[1])[:top]
    return {
        "min_us": min_us,
        "idle_ms": sum(b - a for a, b in gaps) / 1e3 / steps,
        "idle_ms_by_tenth": [round(v / 1e3 / steps, 3) for v in per_bin],
        "host_ops": [[n[:100], round(v / 1e3 / steps, 3)] for n, v in busiest],
    }


SYNC_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
)


def host_syncs(
    host: list[tuple[str, float, float, object]], steps: int = 1, top: int = 10
) -> list[dict]:
    """Where the host waited for the GPU: each blocking CUDA runtime call (``SYNC_CALLS``) under the
    chain of host ops that enclose it (outermost first, the last four), with calls and wait time per
    step, longest first. ``host``: (name, start us, duration us, thread) of the host events; a
    thread's events nest."""
    sites: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_thread: dict[object, list[tuple[str, float, float]]] = defaultdict(list)
    for name, t, d, tid in host:
        by_thread[tid].append((name, t, d))
    for events in by_thread.values():
        stack: list[tuple[str, float]] = []  # (name, end) of the enclosing events
        for name, t, d in sorted(events, key=lambda e: (e[1], -e[2])):
            while stack and stack[-1][1] <= t:
                stack.pop()
            if name in SYNC_CALLS:
                chain = [n for n, _ in stack if not n.startswith("ProfilerStep")][-4:]
                site = sites[" > ".join(chain + [name])]
                site[0] += 1
                site[1] += d
            stack.append((name, t + d))
    rows = sorted(sites.items(), key=lambda kv: -kv[1][1])[:top]
    return [
        {"site": k[:200], "calls_per_step": c / steps, "ms_per_step": us / 1e3 / steps}
        for k, (c, us) in rows
    ]


def _events(path: str) -> list[dict]:
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        return json.load(f).get("traceEvents", [])


_GEMM_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::_grouped_mm")


def gemm_flops(op: str, dims: list) -> float:
    """2 x M x N x K of a GEMM op from its recorded input dims (``addmm``: ``(C, A, B)``;
    ``_grouped_mm``: 2-D x 3-D is row-grouped, 2-D x 2-D k-grouped, both 2 M K N over all groups); 0
    where the dims do not say."""
    try:
        if op in ("aten::addmm", "aten::addmm_"):
            dims = dims[1:]
        a, b = dims[0], dims[1]
        if op == "aten::bmm":
            return 2.0 * a[0] * a[1] * a[2] * b[2]
        if op == "aten::_grouped_mm" and len(b) == 3:
            return 2.0 * a[0] * a[1] * b[2]
        return 2.0 * a[0] * a[1] * b[1]
    except (IndexError, TypeError):
        return 0.0


def gemm_rates(events: list[dict], steps: int = 1, min_call_ms: float = 1.0) -> dict:
    """GEMM kernels by (op, input dims): calls and ms per step, TFLOP/s; and the calls >=
    ``min_call_ms`` in launch order (ms from the first kernel). A kernel belongs to the GEMM op
    whose "External id" it carries."""
    ops: dict = {}
    for e in events:
        if e.get("cat") == "cpu_op" and e.get("name") in _GEMM_OPS:
            ops[e.get("args", {}).get("External id")] = e
    kernels = sorted(
        (e for e in events if e.get("cat") == "kernel"), key=lambda e: float(e.get("ts", 0.0))
    )
    t0 = float(kernels[0]["ts"]) if kernels else 0.0
    shapes: dict = defaultdict(lambda: [0, 0.0, 0.0])
    calls = []
    for e in kernels:
        op = ops.get(e.get("args", {}).get("External id"))
        if op is None or e["name"].startswith("void at::cuda::detail::prepare_grouped"):
            continue
        dims = op.get("args", {}).get("Input Dims") or []
        ms = float(e.get("dur", 0.0)) / 1e3
        rec = shapes[(op["name"], json.dumps(dims[:3]))]
        rec[0] += 1
        rec[1] += ms
        rec[2] += gemm_flops(op["name"], dims)
        if ms >= min_call_ms:
            calls.append(
                {
                    "at_ms": (float(e["ts"]) - t0) / 1e3,
                    "ms": ms,
                    "op": op["name"],
                    "dims": dims[:2],
                    "kernel": e["name"][:60],
                }
            )
    rows = [
        {
            "op": op,
            "dims": json.loads(d),
            "calls_per_step": c / steps,
            "ms_per_step": ms / steps,
            "tflops": fl / ms / 1e9 if ms else 0.0,
        }
        for (op, d), (c, ms, fl) in shapes.items()
    ]
    return {"shapes": sorted(rows, key=lambda r: -r["ms_per_step"]), "calls": calls}


def gemm_text(rates: dict) -> str:
    lines = ["  GEMM shapes (ms per step, calls, TFLOP/s):"]
    for r in rates["shapes"]:
        lines.append(
            f"  {r['ms_per_step']:9.2f} ms x{r['calls_per_step']:<4g} {r['tflops']:6.0f} TFLOP/s "
            f"{r['op'][6:]} {r['dims']}"
        )
    lines.append("  GEMM calls >= 1 ms, in launch order (ms from the first kernel, ms):")
    for c in rates["calls"]:
        lines.append(f"  {c['at_ms']:9.1f} {c['ms']:6.2f} {c['op'][6:]} {c['dims']}")
    return "\n".join(lines)


def summarize(path: str, steps: int = 1, top: int = 40, gemms: bool = False) -> dict:
    """The summary of the trace at ``path``; with ``gemms`` also ``gemm_rates`` of the same
    events."""
    events = _events(path)
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    kernels, host, threads = [], [], []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            rec = per_name[e.get("name", "?")]
            rec[0] += float(e.get("dur", 0.0)) / 1e3  # us -> ms
            rec[1] += 1
            kernels.append((e.get("name", "?"), float(e.get("ts", 0.0)), float(e.get("dur", 0.0))))
        elif e.get("ph") == "X" and e.get("cat") in (
            "cpu_op",
            "user_annotation",
            "python_function",
            "cuda_runtime",
        ):
            host.append((e.get("name", "?"), float(e.get("ts", 0.0)), float(e.get("dur", 0.0))))
            threads.append(e.get("tid"))
    total = sum(v[0] for v in per_name.values())
    by_cat: dict[str, float] = defaultdict(float)
    for name, (ms, _) in per_name.items():
        by_cat[category(name)] += ms
    rows = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    return {
        "trace": path,
        "steps": steps,
        "gpu_ms_per_step": total / steps,
        "timeline": timeline(kernels, steps),
        "idle_gaps": idle_gaps(kernels, host),
        "idle_profile": idle_profile(kernels, host, steps),
        "host_syncs": host_syncs([h + (tid,) for h, tid in zip(host, threads)], steps),
        "categories": [
            {"category": c, "ms_per_step": ms / steps, "pct": 100.0 * ms / max(total, 1e-9)}
            for c, ms in sorted(by_cat.items(), key=lambda kv: -kv[1])
        ],
        "kernels": [
            {
                "name": n[:160],
                "category": category(n),
                "ms_per_step": ms / steps,
                "calls_per_step": c / steps,
                "pct": 100.0 * ms / max(total, 1e-9),
            }
            for n, (ms, c) in rows[:top]
        ],
        **({"gemms": gemm_rates(events, steps)} if gemms else {}),
    }


def text(summary: dict, title: str = "") -> str:
    lines = [
        (
            f"{title} GPU kernel time {summary['gpu_ms_per_step']:.1f} ms/step "
            f"({summary['trace']})"
        ).strip()
    ]
    tl = summary.get("timeline") or {}
    if tl:
        lines.append(
            "  timeline per step: "
            + ", ".join(f"{k.removesuffix('_ms')} {v:.1f} ms" for k, v in tl.items())
        )
    for g in summary.get("idle_gaps") or []:
        lines.append(
            f"  idle {g['ms']:.2f} ms before {g['before_kernel'][:40]}; host: "
            + ", ".join(f"{n} {v:.2f}" for n, v in g["host_ops"][:4])
        )
    ip = summary.get("idle_profile") or {}
    if ip:
        lines.append(
            f"  idle in stretches >= {ip['min_us']:g} us: {ip['idle_ms']:.1f} ms; by tenth of the "
            "span: " + " ".join(f"{v:.1f}" for v in ip["idle_ms_by_tenth"])
        )
        lines.append(
            "  host meanwhile: " + ", ".join(f"{n[:50]} {v:.1f}" for n, v in ip["host_ops"][:8])
        )
    for h in summary.get("host_syncs") or []:
        lines.append(
            f"  host sync x{h['calls_per_step']:g} {h['ms_per_step']:.2f} ms: {h['site'][:110]}"
        )
    for c in summary["categories"]:
        lines.append(f"  {c['ms_per_step']:9.2f} ms {c['pct']:5.1f}%  {c['category']}")
    lines.append("  top kernels:")
    for k in summary["kernels"]:
        lines.append(
            f"  {k['ms_per_step']:9.2f} ms {k['pct']:5.1f}% x{k['calls_per_step']:<5g} "
            f"{k['name'][:100]}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument(
        "--steps", type=int, default=1, help="profiled steps in the trace (times are divided by it)"
    )
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--gemms", action="store_true", help="add each GEMM shape's rate (module docstring)"
    )
    a = p.parse_args(argv)
    s = summarize(a.trace, a.steps, a.top, gemms=a.gemms)
    print(text(s))
    if a.gemms:
        print(gemm_text(s["gemms"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
