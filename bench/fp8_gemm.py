"""FP8 against bf16 products at the proxy's shapes on one GPU: what each FP8 recipe's GEMMs and
quantisation cost, so that the choice of recipe and of the layers that stay bf16 rests on
measurement.

    python3 bench/fp8_gemm.py [--tokens 4096,32768] [--out fp8_gemm.json]

Per product of the proxy (attention projections, dense MLP, shared expert, MTP projection, LM
head, one routed expert's share of the rows) and token count, CUDA-event medians of:

* ``bf16``: ``x @ W^T`` (cuBLAS), the reference;
* ``blockwise_fwd`` / ``_dgrad`` / ``_wgrad``: ``F.scaled_mm`` (cuBLAS) on operands already in
  e4m3 with DeepSeek-V3's scales: activations and output gradients per 1x128 tile of the
  contraction, weights per 128x128 block; the weight gradient with both operands per 1x128 tile
  along the tokens;
* ``rowwise_fwd`` / ``tensorwise_fwd``: ``torch._scaled_mm`` with per-row / one scale;
* ``linear_bf16`` / ``linear_<impl>``: a whole linear forward + backward through autograd
  (quantisation included) for each FP8 implementation the script finds: torchao's
  ``fp8_blockwise_mm`` (Triton quantisation + cuBLAS) and this project's
  (``titan_glm52/model/fp8_mm.py``), where importable;
* the routed experts: 16 experts x tokens / 2 rows, ``torch._grouped_mm`` (bf16) against
  ``torch._scaled_grouped_mm`` (rowwise e4m3).

It also records which shapes cuBLAS's block-wise path refuses (a 576-wide output, a contraction
that is not a multiple of 128) and the error of each FP8 product against the bf16 product of the
dequantised operands. The table is printed last; JSON goes to ``--out`` and to ``$OUT`` when set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
D, Q_RANK, HQK, HV, KV_A, I_Q, FFN, MOE_F, VOCAB = (
    6144,
    2048,
    16384,
    16384,
    576,
    4096,
    12288,
    2048,
    154880,
)
EXPERTS, TOP_K = 16, 8

# (name, out features N, in features K) of the proxy's products, per token
SHAPES = [
    ("attn.wq_a", Q_RANK, D),
    ("attn.wq_b", HQK, Q_RANK),
    ("attn.wkv_a", KV_A, D),
    ("attn.wo", D, HV),
    ("indexer.wq_b", I_Q, Q_RANK),
    ("mlp.w1", FFN, D),
    ("mlp.w2", D, FFN),
    ("shared.w1", MOE_F, D),
    ("shared.w2", D, MOE_F),
    ("mtp.eh_proj", D, 2 * D),
    ("head", VOCAB, D),
]


def timed(fn, reps: int) -> float:
    """Median ms of ``reps`` calls after two warm-ups (CUDA events around each)."""
    for _ in range(2):
        fn()
    ev = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(reps)
    ]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def quant_tiles(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 of ``x [M, K]`` per 1x128 tile of K (the last tile may be short): (``q [M, K]``,
    ``scale [M, ceil(K / 128)]`` fp32, dequantise = q * scale)."""
    m, k = x.shape
    kb = -(-k // 128)
    pad = F.pad(x.float(), (0, kb * 128 - k)).view(m, kb, 128)
    scale = pad.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    q = (pad / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(E4M3).view(m, kb * 128)[:, :k]
    return q.contiguous(), scale


def quant_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 of ``w [N, K]`` per 128x128 block: (``q [N, K]``,
    ``scale [ceil(N/128), ceil(K/128)]``)."""
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    pad = F.pad(w.float(), (0, kb * 128 - k, 0, nb * 128 - n)).view(nb, 128, kb, 128)
    scale = pad.abs().amax((1, 3)).clamp_min(1e-12) / FP8_MAX
    q = (pad / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    return q.view(nb * 128, kb * 128)[:n, :k].contiguous(), scale


def mn_major(s: torch.Tensor) -> torch.Tensor:
    """``s [R, C]`` laid out with R contiguous (cuBLAS's 1x128 scale layout)."""
    return s.t().contiguous().t()


def k_major_padded(s: torch.Tensor) -> torch.Tensor:
    """A 128x128 scale ``[K/128, N/128]`` K-major, its K blocks padded to a multiple of 4
    (cuBLAS's layout for those scales)."""
    kb, nb = s.shape
    out = s.new_ones(nb, -(-kb // 4) * 4).t()
    out[:kb] = s
    return out


def blockwise_mm(a_q, a_s, b_q, b_s, b_recipe):
    """``a [M, K] @ b [K, N]`` (``b`` column-major) with 1x128 ``a_s [M, K/128]`` and ``b_s``:
    128x128 ``[K/128, N/128]`` or 1x128 ``[N, K/128]``."""
    st = F.ScalingType
    if b_recipe == "128x128":
        sb, rb = k_major_padded(b_s), st.BlockWise128x128
    else:
        sb, rb = mn_major(b_s), st.BlockWise1x128
    return F.scaled_mm(
        a_q,
        b_q,
        scale_a=mn_major(a_s),
        scale_recipe_a=st.BlockWise1x128,
        scale_b=sb,
        scale_recipe_b=rb,
        output_dtype=torch.bfloat16,
    )


ROWS: list[dict] = []


def add(**row) -> None:
    ROWS.append(row)
    ms, fl = row.get("ms"), row.get("flop")
    tf = f"{fl / ms / 1e9:7.1f}" if ms and fl else "      -"
    print(
        f"  {row['shape']:14s} M={row['M']:<6d} {row['impl']:22s} "
        f"{(f'{ms:8.3f} ms' if ms else row.get('status', '')):>12s} {tf} TFLOP/s"
        f"{'  err={:.2e}'.format(row['rel_err']) if row.get('rel_err') is not None else ''}",
        flush=True,
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def products(name: str, m: int, n: int, k: int, reps: int) -> None:
    """One product's bf16 and FP8 forms (forward, input gradient, weight gradient)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    flop = 2 * m * n * k
    base = {"shape": name, "M": m, "N": n, "K": k, "flop": flop}
    add(**base, impl="bf16_fwd", ms=timed(lambda: x @ w.t(), reps))
    add(**base, impl="bf16_dgrad", ms=timed(lambda: g @ w, reps))
    add(**base, impl="bf16_wgrad", ms=timed(lambda: g.t() @ x, reps))
    xq, xs = quant_tiles(x)
    wq, ws = quant_blocks(w)
    gq, gs = quant_tiles(g)
    try:
        # forward: x [M, K] (1x128 along K) @ W^T (128x128); W^T column-major is W row-major.t()
        ref = (
            (xq.float().view(m, -1, 128) * xs[..., None]).view(m, k).bfloat16()
            @ (
                (wq.float().view(-1, 128, k // 128, 128) * ws[:, None, :, None])
                .view(n, k)
                .bfloat16()
                .t()
            )
            if k % 128 == 0 and n % 128 == 0
            else None
        )

        def fwd():
            return blockwise_mm(xq, xs, wq.t(), ws.t(), "128x128")

        out = fwd()
        add(
            **base,
            impl="blockwise_fwd",
            ms=timed(fwd, reps),
            rel_err=rel_err(out, ref) if ref is not None else None,
        )
    except Exception as e:  # noqa: BLE001 (a shape cuBLAS's block-wise path refuses)
        add(**base, impl="blockwise_fwd", status=f"error: {str(e)[:160]}")
    try:
        wtq, wts = quant_blocks(w.t().contiguous())  # W [N, K] as B [N, K] contracted over N

        def dgrad():
            return blockwise_mm(gq, gs, wtq.t(), wts.t(), "128x128")

        add(**base, impl="blockwise_dgrad", ms=timed(dgrad, reps))
    except Exception as e:  # noqa: BLE001 (recorded as this cell's error)
        add(**base, impl="blockwise_dgrad", status=f"error: {str(e)[:160]}")
    try:
        # dW [N, K] = g^T [N, M] @ x [M, K]: both per 1x128 tile along M
        gtq, gts = quant_tiles(g.t().contiguous())
        xtq, xts = quant_tiles(x.t().contiguous())

        def wgrad():
            return blockwise_mm(gtq, gts, xtq.t(), xts, "1x128")

        add(**base, impl="blockwise_wgrad", ms=timed(wgrad, reps))
    except Exception as e:  # noqa: BLE001 (recorded as this cell's error)
        add(**base, impl="blockwise_wgrad", status=f"error: {str(e)[:160]}")
    try:
        xr = x.float().abs().amax(1, keepdim=True) / FP8_MAX
        wr = w.float().abs().amax(1, keepdim=True) / FP8_MAX
        xrq, wrq = (x / xr).to(E4M3), (w / wr).to(E4M3)

        def rw():
            return torch._scaled_mm(
                xrq,
                wrq.t(),
                scale_a=xr,
                scale_b=wr.t(),
                out_dtype=torch.bfloat16,
            )

        add(**base, impl="rowwise_fwd", ms=timed(rw, reps))
        one = torch.ones((), device="cuda")

        def tw():
            return torch._scaled_mm(
                xrq,
                wrq.t(),
                scale_a=one,
                scale_b=one,
                out_dtype=torch.bfloat16,
            )

        add(**base, impl="tensorwise_fwd", ms=timed(tw, reps))
    except Exception as e:  # noqa: BLE001 (recorded as this cell's error)
        add(**base, impl="rowwise_fwd", status=f"error: {str(e)[:160]}")


def linears(name: str, m: int, n: int, k: int, reps: int, impls: dict) -> None:
    """A whole linear, forward + backward through autograd, bf16 against each FP8 implementation."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    base = {"shape": name, "M": m, "N": n, "K": k, "flop": 6 * m * n * k}

    def step(fn):
        return lambda: torch.autograd.backward(fn(x, w), g)

    add(**base, impl="linear_bf16", ms=timed(step(lambda a, b: F.linear(a, b)), reps))
    ref = F.linear(x, w).float()
    for impl, fn in impls.items():
        try:
            err = rel_err(fn(x, w), ref)
            add(**base, impl=f"linear_{impl}", ms=timed(step(fn), reps), rel_err=err)
        except Exception as e:  # noqa: BLE001 (recorded as this cell's error)
            add(**base, impl=f"linear_{impl}", status=f"error: {str(e)[:160]}")


def experts(m: int, reps: int) -> None:
    """The routed experts' three products over ``m`` tokens: grouped bf16 against grouped rowwise
    e4m3, and per expert (one cuBLAS call each) bf16 against block-wise."""
    rows = m * TOP_K // EXPERTS
    x = torch.randn(rows * EXPERTS, D, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(EXPERTS, 2 * MOE_F, D, device="cuda", dtype=torch.bfloat16) * 0.02
    offs = torch.arange(1, EXPERTS + 1, device="cuda", dtype=torch.int32) * rows
    flop = 2 * rows * EXPERTS * 2 * MOE_F * D
    base = {"shape": "experts.w13", "M": m, "N": 2 * MOE_F, "K": D, "flop": flop}
    add(
        **base,
        impl="grouped_bf16",
        ms=timed(lambda: torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs), reps),
    )
    try:
        xs = x.float().abs().amax(1) / FP8_MAX
        ws = w13.float().abs().amax(2) / FP8_MAX
        xq, wq = (x / xs[:, None]).to(E4M3), (w13 / ws[..., None]).to(E4M3)

        def gr():
            return torch._scaled_grouped_mm(
                xq,
                wq.transpose(-2, -1),
                xs,
                ws,
                offs=offs,
                out_dtype=torch.bfloat16,
            )

        add(**base, impl="grouped_rowwise", ms=timed(gr, reps))
    except Exception as e:  # noqa: BLE001 (recorded as this cell's error)
        add(**base, impl="grouped_rowwise", status=f"error: {str(e)[:160]}")
    add(
        **base,
        impl="per_expert_bf16",
        ms=timed(lambda: [x[e * rows : (e + 1) * rows] @ w13[e].t() for e in range(EXPERTS)], reps),
    )
    try:
        xq, xs = quant_tiles(x)
        wq = [quant_blocks(w13[e]) for e in range(EXPERTS)]

        def per_expert():
            for e in range(EXPERTS):
                s = slice(e * rows, (e + 1) * rows)
                blockwise_mm(xq[s], xs[s], wq[e][0].t(), wq[e][1].t(), "128x128")

        add(**base, impl="per_expert_blockwise", ms=timed(per_expert, reps))
    except Exception as e:  # noqa: BLE001 (recorded as this cell's error)
        add(**base, impl="per_expert_blockwise", status=f"error: {str(e)[:160]}")


def refusals() -> None:
    """Shapes the block-wise path may refuse: a contraction that is not a multiple of 128 (an
    expert's token count in the weight gradient) and row offsets that are not 16-byte aligned."""
    for kk in (1040, 1000, 1024 + 64):
        g = torch.randn(kk, 2048, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(kk, 1024, device="cuda", dtype=torch.bfloat16)
        try:
            gtq, gts = quant_tiles(g.t().contiguous())
            xtq, xts = quant_tiles(x.t().contiguous())
            out = blockwise_mm(gtq, gts, xtq.t(), xts, "1x128")
            ref = (gtq.float() * gts.repeat_interleave(128, 1)[:, :kk]) @ (
                xtq.float() * xts.repeat_interleave(128, 1)[:, :kk]
            ).t()
            add(
                shape=f"wgrad_K{kk}",
                M=kk,
                impl="blockwise_wgrad",
                status="ok",
                rel_err=rel_err(out, ref),
            )
        except Exception as e:  # noqa: BLE001 (recorded as this cell's error)
            add(shape=f"wgrad_K{kk}", M=kk, impl="blockwise_wgrad", status=f"error: {str(e)[:200]}")


def fp8_impls() -> dict:
    impls = {}
    try:
        from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

        impls["torchao_blockwise"] = lambda a, b: fp8_blockwise_mm.apply(
            a, b, 128, torch.bfloat16, False
        )
    except Exception as e:  # noqa: BLE001 (recorded as this cell's error)
        print("torchao blockwise: not importable:", e)
    try:
        from titan_glm52.model.fp8_mm import fp8_linear

        impls["ours_blockwise"] = fp8_linear
    except Exception as e:  # noqa: BLE001 (recorded as this cell's error)
        print("titan_glm52.model.fp8_mm: not importable:", e)
    return impls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,32768")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="fp8_gemm.json")
    ap.add_argument("--skip-linears", action="store_true", help="no whole-linear timings")
    ap.add_argument(
        "--linears-only", action="store_true", help="only the whole-linear timings (and bf16's)"
    )
    args = ap.parse_args()
    t0 = time.time()
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    impls = {} if args.skip_linears else fp8_impls()
    for m in (int(t) for t in args.tokens.split(",")):
        print(f"tokens {m}", flush=True)
        for name, n, k in SHAPES:
            try:
                if not args.linears_only:
                    products(name, m, n, k, args.reps)
                if impls and name != "head":
                    linears(name, m, n, k, args.reps, impls)
            except Exception:  # noqa: BLE001 (the next shape still runs)
                traceback.print_exc()
            torch.cuda.empty_cache()
        if not args.linears_only:
            try:
                experts(m, args.reps)
            except Exception:  # noqa: BLE001 (the next shape still runs)
                traceback.print_exc()
    if not args.linears_only:
        refusals()
    meta["elapsed_s"] = round(time.time() - t0, 1)
    doc = {"meta": meta, "rows": ROWS}
    paths = [args.out] + (
        [os.path.join(os.environ["OUT"], "fp8_gemm.json")] if os.environ.get("OUT") else []
    )
    for p in paths:
        with open(p, "w") as f:
            json.dump(doc, f, indent=1)
    # the table: per shape and token count, each impl's ms and its speed-up over bf16
    print(f"\n{'shape':14s} {'M':>6s} {'impl':22s} {'ms':>9s} {'TFLOP/s':>8s} {'x bf16':>7s}")
    bf = {
        (r["shape"], r["M"], r["impl"].split("_")[-1]): r["ms"]
        for r in ROWS
        if r["impl"].startswith("bf16")
    }
    for r in ROWS:
        ms = r.get("ms")
        tf = r["flop"] / ms / 1e9 if ms and r.get("flop") else None
        ref = bf.get((r["shape"], r["M"], r["impl"].split("_")[-1]))
        if r["impl"].startswith("linear_"):
            ref = next(
                (
                    x["ms"]
                    for x in ROWS
                    if x["shape"] == r["shape"] and x["M"] == r["M"] and x["impl"] == "linear_bf16"
                ),
                None,
            )
        print(
            f"{r['shape']:14s} {r['M']:6d} {r['impl']:22s} "
            f"{(f'{ms:.3f}' if ms else r.get('status', '')[:40]):>9s} "
            f"{(f'{tf:.0f}' if tf else '-'):>8s} {(f'{ref / ms:.2f}' if ms and ref else '-'):>7s}"
        )


if __name__ == "__main__":
    main()
