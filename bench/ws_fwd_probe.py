"""The Gluon warp-specialised sparse MLA forward (titan_glm52/kernels/sparse_mla_ws.py) against the
Triton kernel and the fp32 reference on one GPU: correctness on a packed batch with empty rows and
-1 holes, then ms / TFLOP/s at T = 4K and 32K (one document, indexer top-2048).

    python3 bench/ws_fwd_probe.py base withtriton      # defaults, with the Triton kernel timed too
    python3 bench/ws_fwd_probe.py '{"bk": 32, "stages": 4}'   # a variant of the "fwd" launch

Writes $OUT/ws_probe_<variant>.json; lines starting RESULT summarise.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())
import torch
import triton
from titan_glm52.kernels import reference as R
from titan_glm52.kernels import sparse_mla as SM
from titan_glm52.kernels import sparse_mla_ws as W
from titan_glm52.kernels.tuning import launch_overrides

sys.path.insert(0, os.path.dirname(__file__))
from ws_inputs import DEV, H, D_QK, D_V, TOPK, cos, inputs, save, variant  # noqa: E402

VAR = variant()
BASE = len(sys.argv) > 2  # time the Triton kernel too


def ws(q, kv, idx, scale):
    kend = SM.valid_extent(idx)
    out = torch.empty(q.shape[0], H, D_V, dtype=q.dtype, device=DEV)
    lse = torch.empty(q.shape[0], H, dtype=torch.float32, device=DEV)
    W.fwd(q, kv, idx, kend, scale * SM.LOG2E, out, lse)
    return out, lse


def tri(q, kv, idx, scale):
    return SM._fwd(q, kv, idx, SM.valid_extent(idx), scale, D_V, gluon=False)  # the Triton kernel


def main():
    res = {"variant": VAR}
    scale = D_QK**-0.5
    # correctness
    q, kv, idx = inputs([1000, 3096], 1, empty=(0, 1, 2))
    idx[5, 7] = -1
    idx[6, :100] = -1  # holes inside rows
    t0 = time.time()
    o1, l1 = ws(q, kv, idx, scale)
    torch.cuda.synchronize()
    print("first ws call", time.time() - t0, flush=True)
    o2, l2 = tri(q, kv, idx, scale)
    ro, rl = R.sparse_mla(q.float(), kv.float(), idx, scale, D_V)
    fin = torch.isfinite(rl)
    m = {}
    for name, (o, lse) in {"ws": (o1, l1), "triton": (o2, l2)}.items():
        d = (o.float() - ro).abs()
        m[name] = dict(
            out_max_abs=float(d.max()),
            out_bad=int((d > 1e-2 + 0.024 * ro.abs()).sum()),
            out_cos=cos(o, ro),
            lse_max_abs=float((lse[fin] - rl[fin]).abs().max()),
            lse_inf_match=bool(torch.equal(fin, torch.isfinite(lse))),
            empty_ok=bool(torch.all(o[:3] == 0) and torch.all(lse[:3] == float("-inf"))),
            finite=bool(torch.isfinite(o).all()),
        )
    m["ws_vs_triton_out_max_abs"] = float((o1.float() - o2.float()).abs().max())
    print(json.dumps(m, indent=1), flush=True)
    res["correct"] = m
    # determinism
    o3, l3 = ws(q, kv, idx, scale)
    res["deterministic"] = bool(torch.equal(o1, o3) and torch.equal(l1, l3))
    print("deterministic", res["deterministic"], flush=True)
    del ro, rl
    # timing
    for T in [4096, 32768]:
        q, kv, idx = inputs([T], 2)
        kvalid = sum(min(TOPK, i + 1) for i in range(T))
        flop = 2 * H * kvalid * (D_QK + D_V)
        row = {}
        for name, fn in ((("triton", tri),) if BASE else ()) + (("ws", ws),):
            fn(q, kv, idx, scale)
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(lambda: fn(q, kv, idx, scale), warmup=50, rep=400)
            row[name] = dict(ms=ms, tflops=flop / ms / 1e9)
        o1, l1 = ws(q, kv, idx, scale)
        o2, l2 = tri(q, kv, idx, scale)
        row["ws_vs_triton_out_max_abs"] = float((o1.float() - o2.float()).abs().max())
        row["ws_vs_triton_lse_max_abs"] = float((l1 - l2).abs().max())
        res[f"T{T}"] = row
        print(T, json.dumps(row), flush=True)
    tag = save(res, "ws_probe", VAR)
    for T in [4096, 32768]:
        r = res[f"T{T}"]
        tr = r.get("triton")
        triton_ms = f" triton {tr['ms']:.2f} ms {tr['tflops']:.0f} TF/s" if BASE else ""
        print(
            f"RESULT | {tag} | {T} | {r['ws']['ms']:.2f} ms | {r['ws']['tflops']:.0f} TF/s | "
            f"ok={m['ws']['out_bad'] == 0 and m['ws']['empty_ok']} | "
            f"vs triton {r['ws_vs_triton_out_max_abs']:.3g} |" + triton_ms
        )


with launch_overrides({"sparse_mla_ws": {"fwd": VAR}}):  # the variant for the whole run
    main()
