"""Does GEMM work run beside the sparse MLA backward for free? One H200, T = 32K, one document,
indexer top-2048.

A = the whole sparse MLA backward as training runs it (``sparse_mla._bwd``: parts 1 and 2, chunked
through the P / dS scratch), L2-bound by part 2's fp32 dKV reductions. B = one MoE layer's expert
weight gradients at the proxy's 32K shapes (16 experts x 16,384 rows: w13 [6144 x 4096] and w2 [2048
x 6144], one ``torch.mm`` each, 19.8 TFLOP), tensor-core bound. Timed alone and on two streams at
once (B's stream at the lowest or the highest priority), alternating, CUDA events around the whole
of each; a ratio of "both" under "A + B" is what running the weight gradients beside the sparse
backward would give back.

    python3 bench/overlap_probe.py [--reps 7] [--b-scale 1.0]

Writes $OUT/overlap_probe.json; lines starting RESULT summarise.
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from titan_glm52.kernels import sparse_mla as SM  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from ws_inputs import DEV, D_QK, D_V, bwd_inputs  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--reps", type=int, default=7)
p.add_argument(
    "--b-scale", type=float, default=1.0, help="B's rows per expert x this (B's length against A's)"
)
p.add_argument("--T", type=int, default=32768)
a = p.parse_args()

T, E = a.T, 16
rows = int(T * 8 // E * a.b_scale)  # top-8 of 16 experts: T / 2 rows per expert
scale = D_QK**-0.5
q, kv, idx, kend, go, out, lse = bwd_inputs(
    [T], 2, torch.Generator(device=DEV).manual_seed(5), scale
)

g = torch.Generator(device=DEV).manual_seed(7)
x = torch.randn(rows, 6144, generator=g, device=DEV).to(torch.bfloat16)
dh = torch.randn(rows, 4096, generator=g, device=DEV).to(torch.bfloat16)
h = torch.randn(rows, 2048, generator=g, device=DEV).to(torch.bfloat16)
dy = torch.randn(rows, 6144, generator=g, device=DEV).to(torch.bfloat16)
dw13 = torch.empty(E, 6144, 4096, device=DEV, dtype=torch.bfloat16)
dw2 = torch.empty(E, 2048, 6144, device=DEV, dtype=torch.bfloat16)
b_flop = E * 2 * rows * (6144 * 4096 + 2048 * 6144)


def run_a():
    SM._bwd(q, kv, idx, kend, out, lse, go, scale, D_V)


def run_b():
    # each expert's rows are another slice in training; the same rows here (same work)
    for e in range(E):
        torch.mm(x.t(), dh, out=dw13[e])
        torch.mm(h.t(), dy, out=dw2[e])


# (lowest, highest) as ints: lowest is the larger number
lo, hi = torch.cuda.Stream.priority_range()
streams = {"low": torch.cuda.Stream(priority=lo), "high": torch.cuda.Stream(priority=hi)}
main = torch.cuda.current_stream()


def timed(kind: str) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    if kind == "A":
        run_a()
    elif kind == "B":
        run_b()
    elif kind == "A+B":
        run_a()
        run_b()
    else:  # "both_<priority>": B on a side stream beside A
        side = streams[kind.split("_")[1]]
        side.wait_stream(main)
        with torch.cuda.stream(side):
            run_b()
        run_a()
        main.wait_stream(side)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


kinds = ["A", "B", "A+B", "both_low", "both_high"]
for k in kinds:  # warm-up (Triton / cuBLAS selection)
    timed(k)
ms = {k: [] for k in kinds}
for r in range(a.reps):
    for k in kinds if r % 2 == 0 else kinds[::-1]:
        ms[k].append(timed(k))
med = {k: statistics.median(v) for k, v in ms.items()}
res = {
    "T": T,
    "rows_per_expert": rows,
    "b_tflop": b_flop / 1e12,
    "ms": ms,
    "median_ms": med,
    "b_tflops_alone": b_flop / med["B"] / 1e9,
    "device": torch.cuda.get_device_name(),
}
with open(os.path.join(os.environ.get("OUT", "/tmp"), "overlap_probe.json"), "w") as f:
    json.dump(res, f, indent=1)
print(json.dumps(res["median_ms"]))
gain = {k: 1 - med[k] / med["A+B"] for k in ("both_low", "both_high")}
print(
    f"RESULT | T {T} | A {med['A']:.2f} ms | B {med['B']:.2f} ms ({res['b_tflops_alone']:.0f} "
    "TFLOP/s) | "
    f"A+B {med['A+B']:.2f} | both (B low priority) {med['both_low']:.2f} ({gain['both_low']:+.1%}) "
    "| "
    f"both (B high) {med['both_high']:.2f} ({gain['both_high']:+.1%}) |"
)
