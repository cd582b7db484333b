"""The Gluon part 1 of the sparse MLA backward (P, dS; titan_glm52/kernels/sparse_mla_ws.py)
against the Triton kernel on one GPU, and the Gluon part 2 (dKV, dQ): P / dS equality, the whole
backward's gradients against the fp32 reference and against the Triton part 2, then part 1 alone
(the first 4096 rows) and the whole backward at T = 4K and 32K with the Triton kernels, the Gluon
part 1, and both Gluon parts.

    python3 bench/ws_bwd_probe.py base
    python3 bench/ws_bwd_probe.py '{"consumer_regs": 184, "loader_regs": 72}'   # "bwd_ps" variant
    python3 bench/ws_bwd_probe.py '{"stages": 2}' bwd_grad                      # "bwd_grad" variant

Writes $OUT/ws_bwd_<variant>.json; lines starting RESULT summarise.
"""

import json
import os
import sys

sys.path.insert(0, os.getcwd())
import torch
import triton
from titan_glm52.kernels import reference as R
from titan_glm52.kernels import sparse_mla as SM
from titan_glm52.kernels import sparse_mla_ws as W
from titan_glm52.kernels.tuning import launch_overrides

sys.path.insert(0, os.path.dirname(__file__))
from ws_inputs import DEV, H, D_QK, D_V, TOPK, bwd_inputs, cos, inputs, save, variant  # noqa: E402

VAR = variant()
PART = sys.argv[2] if len(sys.argv) > 2 else "bwd_ps"
scale = D_QK**-0.5


def enabled(ps: bool, grad: bool):
    """Overrides taking the Gluon kernel (True) or the Triton one (False) for each backward part."""
    return launch_overrides(
        {"sparse_mla_ws": {"bwd_ps": {"enable": ps}, "bwd_grad": {"enable": grad}}}
    )


def part1(q, kv, idx, out, lse, go, ws, rows=None):
    kend = SM.valid_extent(idx)
    n = rows or q.shape[0]
    p = torch.zeros((n, idx.shape[1], H), dtype=q.dtype, device=DEV)
    ds = torch.zeros_like(p)
    (W.bwd_ps if ws else SM._triton_bwd_ps)(q, kv, idx, kend, out, go, lse, p, ds, scale, 0, n)
    return p, ds


def main():
    res = {"variant": VAR}
    q, kv, idx = inputs([1000, 3096], 1, empty=(0, 1, 2))
    idx[5, 7] = -1
    idx[6, :100] = -1
    idx = idx.contiguous()
    g = torch.Generator(device=DEV).manual_seed(3)
    go = torch.randn(q.shape[0], H, D_V, generator=g, device=DEV).to(torch.bfloat16)
    kend = SM.valid_extent(idx)
    out, lse = SM._fwd(q, kv, idx, kend, scale, D_V)
    p1, d1 = part1(q, kv, idx, out, lse, go, True)
    p2, d2 = part1(q, kv, idx, out, lse, go, False)
    m = {
        "p_max_abs": float((p1.float() - p2.float()).abs().max()),
        "ds_max_abs": float((d1.float() - d2.float()).abs().max()),
        "ds_scale": float(d2.float().abs().max()),
        "p_equal": bool(torch.equal(p1, p2)),
        "ds_equal": bool(torch.equal(d1, d2)),
    }
    qt2, kvt2 = q.clone().requires_grad_(), kv.clone().requires_grad_()
    with launch_overrides({"sparse_mla_ws": {"bwd_grad": {"enable": False}}}):  # Triton part 2
        o, _ = SM.sparse_mla(qt2, kvt2, idx, scale, D_V)
        o.backward(go)
    qt, kvt = q.clone().requires_grad_(), kv.clone().requires_grad_()
    o, _ = SM.sparse_mla(qt, kvt, idx, scale, D_V)
    o.backward(go)
    m.update(
        dq_vs_triton_part2_max_abs=float((qt.grad.float() - qt2.grad.float()).abs().max()),
        dkv_vs_triton_part2_max_abs=float((kvt.grad.float() - kvt2.grad.float()).abs().max()),
        dkv_scale=float(kvt2.grad.float().abs().max()),
        dq_scale=float(qt2.grad.float().abs().max()),
    )
    qr, kvr = q.float().requires_grad_(), kv.float().requires_grad_()
    ro, _ = R.sparse_mla(qr, kvr, idx, scale, D_V)
    ro.backward(go.float())
    m.update(
        dq_cos=cos(qt.grad, qr.grad),
        dkv_cos=cos(kvt.grad, kvr.grad),
        empty_ok=bool(torch.all(qt.grad[:3] == 0)),
        finite=bool(torch.isfinite(qt.grad).all() and torch.isfinite(kvt.grad).all()),
    )
    print("correct", json.dumps(m), flush=True)
    res["correct"] = m
    del qt, kvt, qr, kvr, ro, o
    for T in [4096, 32768]:
        q, kv, idx, kend, go, out, lse = bwd_inputs([T], 2, g, scale)
        rows = min(T, 4096)
        kv_rows = sum(min(TOPK, i + 1) for i in range(rows))
        f1 = 2 * H * kv_rows * (D_QK + D_V)
        row = {}
        for name, ws in (("triton", False), ("ws", True)):
            ms = triton.testing.do_bench(
                lambda: part1(q, kv, idx, out, lse, go, ws, rows), warmup=30, rep=300
            )
            row[f"part1_{name}"] = dict(ms=ms, tflops=f1 / ms / 1e9)
        # whole backward: Triton parts 1 + 2, Gluon part 1 + Triton part 2, Gluon parts 1 + 2
        for name, ps, grad in (
            ("triton", False, False),
            ("ws", True, False),
            ("ws_both", True, True),
        ):
            with enabled(ps, grad):
                ms = triton.testing.do_bench(
                    lambda: SM._bwd(q, kv, idx, kend, out, lse, go, scale, D_V), warmup=5, rep=300
                )
            row[f"bwd_{name}"] = dict(ms=ms)
        res[f"T{T}"] = row
        print(T, json.dumps(row), flush=True)
    tag = save(res, "ws_bwd", VAR)
    for T in [4096, 32768]:
        r = res[f"T{T}"]
        p1t, p1w = r["part1_triton"], r["part1_ws"]
        print(
            f"RESULT | {tag} | {T} | part1 (first {min(T, 4096)} rows) triton {p1t['ms']:.2f} ms "
            f"{p1t['tflops']:.0f} TF/s, ws {p1w['ms']:.2f} ms {p1w['tflops']:.0f} TF/s | "
            f"bwd triton {r['bwd_triton']['ms']:.2f} ms, ws part 1 {r['bwd_ws']['ms']:.2f} ms, "
            f"ws parts 1+2 {r['bwd_ws_both']['ms']:.2f} ms |"
        )


with launch_overrides({"sparse_mla_ws": {PART: VAR}}):  # the variant for the whole run
    main()
