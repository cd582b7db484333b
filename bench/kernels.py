"""GPU benchmark of the Triton DSA kernels at GLM-5.2 sizes, side by side with the torch reference
and dense causal attention of the same model.

    python bench/kernels.py [--sizes 4096,16384,32768,65536,131072] \\
        [--out bench/results/kernels_h200.json]
    python bench/kernels.py --sweep-only --tune-out chosen.json  # launch alternatives, fastest kept
    python bench/kernels.py --sweep-only --sweep-parts indexer_loss.fwd_given,indexer_loss.bwd
    python bench/kernels.py --overrides chosen.json              # every size with those launches

``--overrides``: launch variants (``titan_glm52.kernels.tuning.launch_overrides``; JSON or a file
of it) for the whole run; ``--no-gluon``: the Triton kernels only (``gluon=False``) where the Gluon
ones would run.

Shapes: H = 64, D_qk = 576, d_v = 512, topk = 2048, H_I = 32, D_I = 128, bf16. One document of T
tokens ("single"), plus packed 8K documents ("packed8k") for the indexer and the sparse forward.
FLOPs (per query, K_valid = min(topk, visible keys)): sparse fwd 2*H*K_valid*(D_qk+d_v), sparse bwd
2*H*K_valid*(3*D_qk+2*d_v), indexer 2*H_I*D_I*visible pairs (its tensor-core floor at 790 TFLOP/s is
reported next to it), KL loss fwd+bwd 2*H*K_valid*D_qk (target recompute) + 3*2*H_I*D_I*K_valid;
"sparse_mla_bwd_with_kl": the sparse backward that also forms the KL (``sparse_mla_indexer_kl``),
its ``kl_ms`` = its time minus the plain backward's (measured beside it), and the KL's two kernels
alone: ``kl_given_fwd_ms`` (the logits and the KL from the stored target), ``kl_bwd_ms`` (the
gradients; ``dk_atomic_adds`` fp32 atomic adds into dk_idx).
Dense: F.scaled_dot_product_attention (flash), 64 heads, q/k head dim 256 (192 + 64), v 256, causal.
The torch reference runs only where it fits and finishes quickly; elsewhere it is recorded as
skipped. JSON is rewritten after every measurement (a killed run keeps what it measured); with $OUT
set a copy goes to $OUT/kernels_h200.json.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

H, D_QK, D_V, TOPK, H_I, D_I = 64, 576, 512, 2048, 32, 128
BF16_PEAK = 790e12  # measured dense bf16 GEMM on one H200 (dsa_kernels.md 2.0)
RESULTS: list[dict] = []
META: dict = {}


def _save(path: str) -> None:
    doc = {"meta": META, "results": RESULTS}
    paths = {os.path.abspath(path)}
    out_dir = os.environ.get("OUT")
    if out_dir and os.path.dirname(os.path.abspath(path)) != os.path.abspath(out_dir):
        # on the device machine, also bring it back
        paths.add(os.path.join(out_dir, "kernels_h200.json"))
    for p in paths:
        os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
        with open(p, "w") as f:
            json.dump(doc, f, indent=1)


def record(
    path, kernel, impl, T, layout, ms=None, flop=None, nbytes=None, peak=None, status="ok", **extra
):
    r = {
        "kernel": kernel,
        "impl": impl,
        "T": T,
        "layout": layout,
        "status": status,
        "ms": ms,
        "tflops": (flop / ms / 1e9 if ms and flop else None),
        "gbps": (nbytes / ms / 1e6 if ms and nbytes else None),
        "peak_mem_gb": peak,
        **extra,
    }
    RESULTS.append(r)
    _save(path)
    tf = f"{r['tflops']:.1f}" if r["tflops"] else "-"
    print(
        f"  {kernel:22s} {impl:7s} T={T:<7d} {layout:9s} {status:8s} "
        f"{(f'{ms:.3f} ms' if ms else ''):>12s} {tf:>7s} TFLOP/s",
        flush=True,
    )


def bench(fn, rep_ms=200):
    """do_bench for fast calls; two timed calls after one warm-up for slow ones (seconds at
    128K)."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    t0 = time.time()
    fn()
    torch.cuda.synchronize()
    if time.time() - t0 > 0.05:
        return timed_once(fn, reps=2)
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms)


def timed_once(fn, reps=2):
    fn()
    torch.cuda.synchronize()
    t0 = time.time()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.time() - t0) / reps * 1e3


def peak_of(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def layout_lengths(T, layout):
    if layout == "single":
        return [T]
    n = max(1, T // 8192)
    return [T // n] * (n - 1) + [T - (T // n) * (n - 1)]


def counts(lengths):
    """(visible (query, key) pairs, selected valid pairs = sum over queries of min(topk,
    visible))."""
    pairs = sum(L * (L + 1) // 2 for L in lengths)
    kvalid = sum(
        L * (L + 1) // 2 if L <= TOPK else TOPK * (TOPK + 1) // 2 + (L - TOPK) * TOPK
        for L in lengths
    )
    return pairs, kvalid


def make_inputs(T, lengths, seed=0):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    qi = torch.randn(T, H_I, D_I, generator=g, device=dev).to(torch.bfloat16)
    ki = torch.randn(T, D_I, generator=g, device=dev).to(torch.bfloat16)
    wi = torch.randn(T, H_I, generator=g, device=dev) * H_I**-0.5
    return cu, qi, ki, wi


def kl_parts(q, kv, lse, qi, ki, wi, idx, scale, iscale):
    """The fused KL's two kernels as training runs them after the sparse backward, on a stand-in
    target (they read it and never branch on it): (the forward from the given target, the
    backward)."""
    import titan_glm52.kernels.indexer_loss as IL

    q_i, k_i, w_i = IL._indexer_inputs(qi, ki, wi)
    idx32, tgt = idx.to(torch.int32).contiguous(), torch.rand(idx.shape, device="cuda")
    q, kv, lse = q.detach(), kv.detach(), lse.float().contiguous()
    ones = torch.ones(q.shape[0], device="cuda")

    def fwd():
        return IL._kl_forward(q, kv, lse, q_i, k_i, w_i, idx32, tgt, scale, iscale, True)

    stat = fwd()[1]
    return fwd, lambda: IL._kl_backward(q_i, k_i, w_i, idx32, tgt, stat, ones, iscale, H, D_QK)


def run_size(args, T, layout, deadline):
    from titan_glm52.kernels import reference as R
    from titan_glm52.kernels.indexer_loss import indexer_kl_sparse
    from titan_glm52.kernels import indexer_topk as IT
    from titan_glm52.kernels import sparse_mla as SM

    indexer_topk = functools.partial(IT.indexer_topk, gluon=args.gluon)
    sparse_mla = functools.partial(SM.sparse_mla, gluon=args.gluon)
    out = args.out
    lengths = layout_lengths(T, layout)
    pairs, kvalid = counts(lengths)
    cu, qi, ki, wi = make_inputs(T, lengths)
    iscale, scale = D_I**-0.5, D_QK**-0.5

    # ---------------- indexer + top-k
    flop = 2 * H_I * D_I * pairs
    fn = lambda: indexer_topk(qi, ki, wi, cu, TOPK, iscale)  # noqa: E731
    idx = fn()
    ms = bench(fn, rep_ms=300)
    record(
        out,
        "indexer_topk",
        "triton",
        T,
        layout,
        ms,
        flop,
        pairs * 4 * 3,
        peak_of(fn),
        floor_ms=flop / BF16_PEAK * 1e3,
        x_floor=ms / (flop / BF16_PEAK * 1e3),
    )
    if T <= args.ref_max_topk and time.time() < deadline:
        rms = timed_once(lambda: R.indexer_topk(qi, ki, wi, cu, TOPK, iscale), reps=1)
        record(
            out,
            "indexer_topk",
            "torch",
            T,
            layout,
            rms,
            flop,
            None,
            peak_of(lambda: R.indexer_topk(qi, ki, wi, cu, TOPK, iscale)),
        )
    else:
        record(out, "indexer_topk", "torch", T, layout, status="skipped")
    if layout != "single":
        return

    # ---------------- sparse MLA forward / backward
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(T, H, D_QK, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
    kv = torch.randn(T, D_QK, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
    do = torch.randn(T, H, D_V, generator=g, device="cuda").to(torch.bfloat16)
    f_flop, b_flop = 2 * H * kvalid * (D_QK + D_V), 2 * H * kvalid * (3 * D_QK + 2 * D_V)
    f_bytes = kvalid * D_QK * 2 + T * H * (D_QK + D_V) * 2 + T * TOPK * 4
    b_bytes = kvalid * D_QK * (2 + 4) + T * H * (2 * D_QK + 2 * D_V) * 2
    with torch.no_grad():
        fwd = lambda: sparse_mla(q, kv, idx, scale, D_V)  # noqa: E731
        ms = bench(fwd)
        record(out, "sparse_mla_fwd", "triton", T, layout, ms, f_flop, f_bytes, peak_of(fwd))
    o, lse = sparse_mla(q, kv, idx, scale, D_V)
    bwd = lambda: torch.autograd.grad(o, (q, kv), do, retain_graph=True)  # noqa: E731
    ms = bench(bwd)
    record(out, "sparse_mla_bwd", "triton", T, layout, ms, b_flop, b_bytes, peak_of(bwd))
    o = None  # frees the graph (bwd is not used again)
    if T <= args.ref_max_mla and time.time() < deadline:
        with torch.no_grad():
            rf = lambda: R.sparse_mla(q, kv, idx, scale, D_V)  # noqa: E731
            record(
                out,
                "sparse_mla_fwd",
                "torch",
                T,
                layout,
                timed_once(rf),
                f_flop,
                f_bytes,
                peak_of(rf),
            )
        ro, _ = R.sparse_mla(q, kv, idx, scale, D_V)
        rb = lambda: torch.autograd.grad(ro, (q, kv), do, retain_graph=True)  # noqa: E731
        record(
            out, "sparse_mla_bwd", "torch", T, layout, timed_once(rb), b_flop, b_bytes, peak_of(rb)
        )
        del ro
    else:
        record(out, "sparse_mla_fwd", "torch", T, layout, status="skipped")
        record(out, "sparse_mla_bwd", "torch", T, layout, status="skipped")

    # ---------------- indexer KL loss (forward + backward)
    kl_flop = 2 * H * kvalid * D_QK + 3 * 2 * H_I * D_I * kvalid
    qi_, ki_, wi_ = (x.clone().requires_grad_() for x in (qi, ki, wi))
    grow = torch.ones(T, device="cuda")

    def kl_step():
        kl = indexer_kl_sparse(q.detach(), kv.detach(), scale, lse, qi_, ki_, wi_, iscale, idx)
        torch.autograd.grad(kl, (qi_, ki_, wi_), grow)

    ms = bench(kl_step)
    record(out, "indexer_kl_fwd_bwd", "triton", T, layout, ms, kl_flop, None, peak_of(kl_step))
    if T <= args.ref_max_mla and time.time() < deadline:

        def kl_ref():
            kl = R.indexer_kl(
                q.detach(), kv.detach(), scale, qi_, ki_, wi_, iscale, cu, indices=idx
            )
            torch.autograd.grad(kl, (qi_, ki_, wi_), grow)

        record(
            out,
            "indexer_kl_fwd_bwd",
            "torch",
            T,
            layout,
            timed_once(kl_ref),
            kl_flop,
            None,
            peak_of(kl_ref),
        )
    else:
        record(out, "indexer_kl_fwd_bwd", "torch", T, layout, status="skipped")

    # ---------------- the KL formed in the sparse backward: that backward, minus the plain one
    from titan_glm52.kernels.indexer_loss import sparse_mla_indexer_kl

    sink = torch.zeros((), device="cuda")
    o, _ = sparse_mla_indexer_kl(
        q, kv, idx, scale, D_V, qi_, ki_, wi_, iscale, 1.0, sink, gluon=args.gluon
    )
    fused = lambda: torch.autograd.grad(  # noqa: E731
        o, (q, kv, qi_, ki_, wi_), do, retain_graph=True
    )
    ms_fused, peak_fused = bench(fused), peak_of(fused)
    o = None
    o, _ = sparse_mla(q, kv, idx, scale, D_V)
    ms_plain = bench(lambda: torch.autograd.grad(o, (q, kv), do, retain_graph=True))
    o = None
    # what kl_ms is made of: the KL's two kernels alone (the backward's dk_idx takes one fp32
    # atomic add per valid pair and column)
    kl_fwd, kl_bwd = kl_parts(q, kv, lse, qi, ki, wi, idx, scale, iscale)
    ms_kl_fwd, ms_kl_bwd = bench(kl_fwd), bench(kl_bwd)
    record(
        out,
        "sparse_mla_bwd_with_kl",
        "triton",
        T,
        layout,
        ms_fused,
        b_flop + 3 * 2 * H_I * D_I * kvalid,
        None,
        peak_fused,
        plain_bwd_ms=ms_plain,
        kl_ms=ms_fused - ms_plain,
        kl_given_fwd_ms=ms_kl_fwd,
        kl_bwd_ms=ms_kl_bwd,
        dk_atomic_adds=kvalid * D_I,
    )
    print(f"  KL alone: given forward {ms_kl_fwd:.3f} ms, backward {ms_kl_bwd:.3f} ms", flush=True)


def run_dense(args, T, layout, deadline):
    """Dense causal attention of the same model (flash SDPA, 64 heads, head dim 256) over T
    tokens."""
    out = args.out
    if time.time() < deadline:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qd = torch.randn(1, H, T, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kd = torch.randn(1, H, T, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        vd = torch.randn(1, H, T, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dd = torch.randn(1, H, T, 256, device="cuda", dtype=torch.bfloat16)
        d_flop = 2 * H * (T * (T + 1) // 2) * (256 + 256)
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):

                def df():
                    return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)

                with torch.no_grad():
                    record(
                        out,
                        "dense_attn_fwd",
                        "sdpa",
                        T,
                        layout,
                        bench(df),
                        d_flop,
                        None,
                        peak_of(df),
                    )
                od = df()

                def db():
                    return torch.autograd.grad(od, (qd, kd, vd), dd, retain_graph=True)

                record(
                    out,
                    "dense_attn_bwd",
                    "sdpa",
                    T,
                    layout,
                    bench(db),
                    2.5 * d_flop,
                    None,
                    peak_of(db),
                )
        except Exception as e:  # flash may refuse head dim 256 on some builds
            record(
                out,
                "dense_attn_fwd",
                "sdpa",
                T,
                layout,
                status=f"error: {type(e).__name__}: {e}"[:200],
            )
        del qd, kd, vd, dd
        torch.cuda.empty_cache()


SWEEP = {  # (module, part) -> alternatives to the built-in default ({}); the fastest is kept
    ("indexer_topk", "score"): [
        dict(BN=128, num_warps=8, num_stages=2),
        dict(BN=64, num_warps=4, num_stages=2),
        dict(BN=64, num_warps=4, num_stages=4),
        dict(BN=64, num_warps=8, num_stages=3),
    ],
    ("indexer_topk", "select"): [dict(BLOCK=2048, num_warps=8), dict(BLOCK=512, num_warps=4)],
    ("sparse_mla", "fwd"): [dict(BK=32, num_stages=3)],
    ("sparse_mla", "bwd_ps"): [dict(BK=32, num_stages=2), dict(BH=32, BK=64, num_stages=2)],
    ("sparse_mla", "bwd_grad"): [dict(DC=128, num_stages=1), dict(BK=32)],
    ("indexer_loss", "fwd"): [dict(BK=64, num_stages=1)],
    ("indexer_loss", "fwd_given"): [
        dict(num_stages=3),
        dict(num_warps=8),
        dict(BK=128),
        dict(BK=128, num_warps=8),
    ],
    ("indexer_loss", "bwd"): [
        dict(num_stages=2),
        dict(num_stages=4),
        dict(num_warps=8),
        dict(BK=128, num_warps=8, num_stages=2),
        dict(BK=32, num_stages=2),
    ],
}


def sweep(args, deadline) -> dict:
    """Time the launch alternatives of SWEEP at one size (single document), each group with the
    fastest of the groups before it, and time the indexer's scoring alone (selection skipped) to
    split its time. Returns the fastest of each group that beat the defaults
    (``{module: {part: {...}}}``, the form of ``launch_overrides``), also written to --tune-out."""
    from titan_glm52.kernels import indexer_loss as IL
    from titan_glm52.kernels import indexer_topk as IT
    from titan_glm52.kernels import sparse_mla as SM
    from titan_glm52.kernels.tuning import launch_overrides

    gluon = args.gluon
    T = args.sweep_T
    lengths = [T]
    pairs, kvalid = counts(lengths)
    cu, qi, ki, wi = make_inputs(T, lengths)
    idx = IT.indexer_topk(qi, ki, wi, cu, TOPK, 1.0, gluon=gluon)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(T, H, D_QK, generator=g, device="cuda").to(torch.bfloat16)
    kv = torch.randn(T, D_QK, generator=g, device="cuda").to(torch.bfloat16)
    do = torch.randn(T, H, D_V, generator=g, device="cuda").to(torch.bfloat16)
    kend = SM.valid_extent(idx)
    o, lse = SM._fwd(q, kv, idx, kend, 0.04, D_V, gluon)
    qi_, ki_, wi_ = (x.clone().requires_grad_() for x in (qi, ki, wi))

    def kl_step():
        kl = IL.indexer_kl_sparse(q, kv, 0.04, lse, qi_, ki_, wi_, 0.09, idx)
        torch.autograd.grad(kl, (qi_, ki_, wi_), torch.ones_like(kl))

    kl_fwd, kl_bwd = kl_parts(q, kv, lse, qi, ki, wi, idx, 0.04, 0.09)
    work = {
        "indexer_topk": (
            lambda: IT.indexer_topk(qi, ki, wi, cu, TOPK, 1.0, gluon=gluon),
            2 * H_I * D_I * pairs,
        ),
        "fwd": (lambda: SM._fwd(q, kv, idx, kend, 0.04, D_V, gluon), 2 * H * kvalid * (D_QK + D_V)),
        "bwd": (
            lambda: SM._bwd(q, kv, idx, kend, o, lse, do, 0.04, D_V, gluon),
            2 * H * kvalid * (3 * D_QK + 2 * D_V),
        ),
        "indexer_loss": (kl_step, 2 * H * kvalid * D_QK + 3 * 2 * H_I * D_I * kvalid),
        # the fused KL's kernels alone (training runs these after the sparse backward)
        "indexer_loss.fwd_given": (kl_fwd, 2 * H_I * D_I * kvalid),
        "indexer_loss.bwd": (kl_bwd, 3 * 2 * H_I * D_I * kvalid),
    }
    chosen = {}

    def measure(name, fn, flop, cfg):
        try:
            ms = bench(fn)
            record(
                args.out, f"sweep_{name}", "triton", T, "single", ms, flop, None, None, config=cfg
            )
            return ms
        except Exception as e:
            record(
                args.out,
                f"sweep_{name}",
                "triton",
                T,
                "single",
                status=f"error: {e}"[:300],
                config=cfg,
            )
            return float("inf")

    if not args.sweep_parts:
        with launch_overrides({"indexer_topk": {"select": {"skip": True}}}):
            measure("indexer_score_only", *work["indexer_topk"], {"skip": True})
    only = [p for p in args.sweep_parts.split(",") if p]
    for (mod, part), alts in SWEEP.items():
        if time.time() > deadline:
            break
        if only and f"{mod}.{part}" not in only:
            continue
        key = f"{mod}.{part}" if f"{mod}.{part}" in work else mod
        fn, flop = work[key if mod != "sparse_mla" else ("fwd" if part == "fwd" else "bwd")]
        best_ms, best = float("inf"), {}
        for cfg in [{}, *alts]:
            trial = {m: dict(parts) for m, parts in chosen.items()}
            trial.setdefault(mod, {})[part] = cfg
            with launch_overrides(trial):
                ms = measure(f"{mod}.{part}", fn, flop, cfg)
            if ms < best_ms:
                best_ms, best = ms, cfg
        if best:
            chosen.setdefault(mod, {})[part] = best
    META["tune"] = chosen
    if args.tune_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.tune_out)), exist_ok=True)
        with open(args.tune_out, "w") as f:
            json.dump(chosen, f, indent=1)
    print("chosen:", json.dumps(chosen), flush=True)
    return chosen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096,16384,32768,65536,131072")
    ap.add_argument(
        "--out",
        default=os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "results", "kernels_h200.json"
        ),
    )
    ap.add_argument("--ref-max-topk", type=int, default=16384)
    ap.add_argument("--ref-max-mla", type=int, default=8192)
    ap.add_argument(
        "--packed", default="32768,131072", help="sizes also run as packed 8K documents (indexer)"
    )
    ap.add_argument(
        "--sweep", action="store_true", help="also time a few launch configurations, keep the best"
    )
    ap.add_argument("--sweep-only", action="store_true", help="only the sweep")
    ap.add_argument("--tune-out", default="", help="write the chosen launch parameters here (JSON)")
    ap.add_argument(
        "--overrides", default="", help="launch overrides for the whole run: JSON or a JSON file"
    )
    ap.add_argument(
        "--no-gluon",
        dest="gluon",
        action="store_false",
        help="the Triton kernels only, also where the Gluon ones would run",
    )
    ap.add_argument("--sweep-T", type=int, default=32768)
    ap.add_argument(
        "--sweep-parts",
        default="",
        help="only these groups of the sweep, by 'module.part' (comma-separated; default all)",
    )
    ap.add_argument(
        "--time-budget",
        type=float,
        default=330.0,
        help="seconds; later work is recorded as skipped",
    )
    args = ap.parse_args()
    import triton

    from titan_glm52.kernels import tuning

    t_start = time.time()
    deadline = t_start + args.time_budget
    META.update(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        shapes=dict(H=H, D_qk=D_QK, d_v=D_V, topk=TOPK, H_I=H_I, D_I=D_I),
        bf16_peak=BF16_PEAK,
        command=" ".join(sys.argv),
        started=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    sizes = [int(s) for s in args.sizes.split(",") if s]
    packed = [int(s) for s in args.packed.split(",") if s]
    work = [(T, "single") for T in sizes] + [(T, "packed8k") for T in packed if T in sizes]
    if args.sweep_only:
        work = [("sweep", None)]
    elif args.sweep:  # first, so that every size runs with the chosen parameters
        work.insert(0, ("sweep", None))
    META["gluon"] = args.gluon
    with contextlib.ExitStack() as launches:
        launches.enter_context(tuning.launch_overrides(tuning.parse(args.overrides)))
        META["overrides"] = tuning.active()
        for T, layout in work:
            at = (0 if T == "sweep" else T, layout or "-")
            if time.time() > deadline:
                record(args.out, "all", "-", *at, status="skipped: time budget")
                continue
            try:
                if T == "sweep":
                    print("sweep", flush=True)
                    # the sizes after the sweep run with its choice
                    launches.enter_context(tuning.launch_overrides(sweep(args, deadline)))
                else:
                    print(f"T={T} {layout}", flush=True)
                    run_size(args, T, layout, deadline)
                    torch.cuda.empty_cache()
                    if layout == "single":
                        run_dense(args, T, layout, deadline)
            except Exception as e:
                traceback.print_exc()
                record(args.out, "all", "-", *at, status=f"error: {type(e).__name__}: {e}"[:300])
            torch.cuda.empty_cache()
    META["elapsed_s"] = round(time.time() - t_start, 1)
    _save(args.out)
    print_table()


def print_table():
    print(
        "\nkernel                 impl    T        layout    status        ms   TFLOP/s    GB/s  "
        "peakGB  note"
    )
    for r in RESULTS:
        note = (
            f"x_floor={r['x_floor']:.2f}"
            if r.get("x_floor")
            else (str(r.get("config")) if r.get("config") else "")
        )

        def f(v, p):
            return f"{v:.{p}f}" if isinstance(v, (int, float)) and v is not None else "-"

        print(
            f"{r['kernel']:22s} {r['impl']:7s} {r['T']:<8d} {r['layout']:9s} "
            f"{r['status'][:10]:10s} "
            f"{f(r['ms'], 3):>9s} {f(r['tflops'], 1):>8s} {f(r['gbps'], 0):>7s} "
            f"{f(r['peak_mem_gb'], 2):>7s}  {note}"
        )


if __name__ == "__main__":
    main()
