"""Energy per call of the 32K step's main kernels, each alone on one H200: where a power-capped
step's joules go.

At 32K both sides of bench/e2e.py run at the 700 W cap (e2e_h200.md), so a kernel saves time in
training only as far as it saves energy. This runs each piece back to back for ``--seconds`` and
reads the GPU's energy counter (NVML ``nvmlDeviceGetTotalEnergyConsumption``, mJ) around it: joules
per call, mean power, and for the products FLOP per joule. Pieces at the proxy's 32K shapes, one
layer's worth each:

* ``sparse_fwd`` / ``sparse_bwd``: the sparse MLA forward, the whole backward (parts 1 + 2, chunked
  as in training);
* ``indexer``: the indexer's scoring + exact top-2048 over one 32K document;
* ``moe_gemms``: the routed experts' products forward (16 experts x 16,384 rows, w13 6144 -> 4096
  and w2 2048 -> 6144), as one grouped product per weight (``torch._grouped_mm``);
* ``head_gemm``: the LM head's forward product for 4,096 tokens (one of the fused head's chunks).

Opt-in pieces (``--pieces``) put the routed experts' products beside other ways of forming them, on
the same tensors: ``moe_<w>_<form>`` for ``w`` in ``w13`` (6144 -> 4096), ``w2`` (2048 -> 6144),
``w13dx`` (the input gradient 4096 -> 6144) and ``w13dw`` (the weight gradient, summed over each
expert's rows), each ``grouped`` (``torch._grouped_mm``), ``loop`` (one cuBLAS ``torch.mm`` per
expert into slices of one output: ``expert_mm``, what training runs from 8,192 rows per expert, and
its backward's ``weight_grad``) or ``mm`` (one cuBLAS product of the same FLOPs with one expert's
weight: the dense bound); ``head_gemm_t`` is the head's product in the other orientation (``W @
h^T``).

    python3 bench/energy_probe.py [--seconds 3] [--pieces a,b,...] [--rounds 1]

Writes $OUT/energy_probe.json; lines starting RESULT summarise.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())
import pynvml  # noqa: E402  (nvidia-ml-py; torch.cuda.power_draw reads the same library)
import torch  # noqa: E402

from titan_glm52.kernels import sparse_mla as SM  # noqa: E402
from titan_glm52.kernels.indexer_topk import indexer_topk  # noqa: E402
from titan_glm52.model.expert_mm import expert_mm, weight_grad  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from ws_inputs import D_I, D_QK, D_V, DEV, H, H_I, TOPK, bwd_inputs  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--seconds", type=float, default=3.0)
p.add_argument(
    "--pieces",
    default="sparse_fwd,sparse_bwd,indexer,moe_gemms,head_gemm",
    help="comma-separated names (see the docstring)",
)
p.add_argument(
    "--rounds", type=int, default=1, help="measure the pieces this many times over, in turn"
)
a = p.parse_args()
pynvml.nvmlInit()
_nvml = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())


def joules() -> float:
    """The GPU's energy counter since the driver loaded (NVML, mJ) in J."""
    return pynvml.nvmlDeviceGetTotalEnergyConsumption(_nvml) / 1e3


T, E = 32768, 16
g = torch.Generator(device=DEV).manual_seed(3)
scale = D_QK**-0.5
q, kv, idx, kend, go, out, lse = bwd_inputs([T], 2, g, scale)
qi = torch.randn(T, H_I, D_I, generator=g, device=DEV).to(torch.bfloat16)
ki = torch.randn(T, D_I, generator=g, device=DEV).to(torch.bfloat16)
wi = torch.randn(T, H_I, generator=g, device=DEV) * H_I**-0.5
cu = torch.tensor([0, T], dtype=torch.int32, device=DEV)
rows = T * 8 // E
x = torch.randn(E * rows, 6144, generator=g, device=DEV).to(torch.bfloat16)
h = torch.randn(E * rows, 2048, generator=g, device=DEV).to(torch.bfloat16)
# stored as the model's
w13 = (torch.randn(E, 4096, 6144, generator=g, device=DEV) * 0.02).to(torch.bfloat16)
w2 = (torch.randn(E, 6144, 2048, generator=g, device=DEV) * 0.02).to(torch.bfloat16)
offs = torch.arange(rows, E * rows + 1, rows, device=DEV, dtype=torch.int32)
xh = torch.randn(4096, 6144, generator=g, device=DEV).to(torch.bfloat16)
wh = (torch.randn(154880, 6144, generator=g, device=DEV) * 0.02).to(torch.bfloat16)

# (query, key) pairs the sparse kernels see (row t has min(t + 1, TOPK))
n_sel = T * TOPK - TOPK * (TOPK - 1) // 2
pieces = {
    "sparse_fwd": (lambda: SM._fwd(q, kv, idx, kend, scale, D_V), 2 * H * n_sel * (D_QK + D_V)),
    "sparse_bwd": (
        lambda: SM._bwd(q, kv, idx, kend, out, lse, go, scale, D_V),
        2 * H * n_sel * (3 * D_QK + 2 * D_V),
    ),
    "indexer": (
        lambda: indexer_topk(qi, ki, wi, cu, TOPK, D_I**-0.5, max_len=T),
        2 * H_I * D_I * (T * (T + 1) // 2 - TOPK * (TOPK + 1) // 2),
    ),
    "head_gemm": (lambda: torch.mm(xh, wh.t()), 2 * 4096 * 6144 * 154880),
    "head_gemm_t": (lambda: torch.mm(wh, xh.t()), 2 * 4096 * 6144 * 154880),
}
dgu = torch.randn(E * rows, 4096, generator=g, device=DEV).to(torch.bfloat16)
splits = [rows] * E
# (the weight as stored, [E, N, K]: out_e = rows_e @ w[e]^T; the rows it multiplies)
moe_forms = {"w13": (w13, x), "w2": (w2, h), "w13dx": (w13.transpose(-2, -1), dgu)}
for wname, (w, a_rows) in moe_forms.items():
    flop = 2 * E * rows * w.shape[1] * w.shape[2]
    pieces[f"moe_{wname}_grouped"] = (
        lambda a=a_rows, w=w: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs),
        flop,
    )
    # what training runs
    pieces[f"moe_{wname}_loop"] = (lambda a=a_rows, w=w: expert_mm(a, w, splits), flop)
    pieces[f"moe_{wname}_mm"] = (lambda a=a_rows, w=w: torch.mm(a, w[0].t()), flop)
(g13, f13), (g2, f2) = pieces["moe_w13_grouped"], pieces["moe_w2_grouped"]
pieces["moe_gemms"] = (lambda: (g13(), g2()), f13 + f2)
dw = torch.empty(E, 4096, 6144, device=DEV, dtype=torch.bfloat16)
flop = 2 * E * rows * 6144 * 4096
pieces["moe_w13dw_grouped"] = (lambda: torch._grouped_mm(dgu.t(), x, offs=offs), flop)
pieces["moe_w13dw_loop"] = (lambda: weight_grad(dgu, x, splits, dw), flop)  # expert_mm's backward
pieces["moe_w13dw_mm"] = (lambda: torch.mm(dgu.t(), x), flop)
unknown = set(a.pieces.split(",")) - set(pieces)
if unknown:
    raise SystemExit(f"energy_probe: unknown pieces {sorted(unknown)}; known: {sorted(pieces)}")
pieces = {k: pieces[k] for k in a.pieces.split(",")}
for wname in [*moe_forms, "w13dw"]:  # the per-expert products form the grouped product's numbers
    if f"moe_{wname}_loop" in pieces and f"moe_{wname}_grouped" in pieces:
        ref = pieces[f"moe_{wname}_grouped"][0]().float()
        got = pieces[f"moe_{wname}_loop"][0]().float()
        print(
            f"check {wname}: loop vs grouped max abs diff {(got - ref).abs().max().item():.3g} "
            f"(max {ref.abs().max().item():.3g})",
            flush=True,
        )

res = {
    "T": T,
    "device": torch.cuda.get_device_name(),
    "seconds": a.seconds,
    "meter": "nvml energy counter",
    "pieces": {},
}
for rnd in range(a.rounds):
    for name, (fn, flop) in pieces.items():
        key = name if rnd == 0 else f"{name}#{rnd + 1}"
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as exc:  # an unsupported form: say so and measure the others
            print(f"{key}: failed: {type(exc).__name__}: {exc}"[:400], flush=True)
            continue
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        n = max(3, int(a.seconds / (time.perf_counter() - t0)))
        time.sleep(0.5)  # let the counter settle between pieces
        e0, t0 = joules(), time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        dt, de = time.perf_counter() - t0, joules() - e0
        r = {
            "calls": n,
            "ms_per_call": dt / n * 1e3,
            "j_per_call": de / n,
            "mean_w": de / dt,
            "flop": flop,
            "tflops": flop / (dt / n) / 1e12,
            "pj_per_flop": de / n / flop * 1e12,
        }
        res["pieces"][key] = r
        print(key, json.dumps(r), flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "energy_probe.json"), "w") as f:
    json.dump(res, f, indent=1)
for name, r in res["pieces"].items():
    print(
        f"RESULT | {name} | {r['ms_per_call']:.2f} ms | {r['j_per_call']:.2f} J | "
        f"{r['mean_w']:.0f} W | "
        f"{r['tflops']:.0f} TFLOP/s | {r['pj_per_flop']:.2f} pJ/FLOP |"
    )
