"""Times the proxy's large GEMMs at 32K tokens alone and in the order one MoE layer's backward runs
them.

In a profiled 32K training step (bench/results/2026-12-03_h200_e2e.md) the attention output
projection's backward products (``dX = dY @ W_o`` [32768, 6144] x [6144, 16384] and ``dW = dY^T @
X``) took 10.4-17.0 ms each in the MoE layers against 7.9-8.9 ms for the forward product of the same
FLOPs (and 8.0-8.3 in the dense layer). This script separates the product's own speed from its
context: each product alone (CUDA events around every call), then the backward sequence of one MoE
layer (grouped expert products, then the output projection's two) repeated, then the same sequence
with the output-projection products computed in other layouts.

    python3 bench/gemm_probe.py [--reps 8] [--out probe.json]

Prints one line per (case, product): median / min / max ms and TFLOP/s at the median.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

T, D, HV, E, F, TOPK = 32768, 6144, 16384, 16, 2048, 8


def _timed(fns, reps):
    """Runs the list of (name, fn, flops) reps times in order; returns {name: [ms, ...]}."""
    ev = [
        [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in fns]
        for _ in range(reps)
    ]
    for r in range(reps):
        for (name, fn, _), (a, b) in zip(fns, ev[r]):
            a.record()
            fn()
            b.record()
    torch.cuda.synchronize()
    out = {name: [] for name, _, _ in fns}
    for r in range(reps):
        for (name, _, _), (a, b) in zip(fns, ev[r]):
            out[name].append(a.elapsed_time(b))
    return out


def _report(case, fns, times, rows):
    for name, _, flops in fns:
        ts = times[name]
        med = statistics.median(ts)
        rows.append(
            dict(
                case=case,
                product=name,
                median_ms=med,
                min_ms=min(ts),
                max_ms=max(ts),
                tflops=flops / med / 1e9,
                ms=ts,
            )
        )
        print(
            f"{case:14s} {name:22s} median {med:7.2f} min {min(ts):7.2f} max {max(ts):7.2f} ms "
            f"{flops / med / 1e9:6.0f} TFLOP/s",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--out", default="")
    a = p.parse_args()
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, dtype=bf, generator=g) * 0.02

    # the output projection's input (attention output, heads x v_head_dim)
    x_attn = rnd(T, HV)
    w_o = rnd(D, HV)  # o_proj weight [out, in]
    dy = rnd(T, D)  # gradient at the output projection's output
    n_rows = T * TOPK
    xs = rnd(n_rows, D)  # routed rows (expert-sorted)
    w13 = rnd(E, 2 * F, D)
    w2 = rnd(E, D, F)
    h = rnd(n_rows, F)
    d_out = rnd(n_rows, D)
    d_gu = rnd(n_rows, 2 * F)
    offs = torch.full((E,), n_rows // E, device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    w_o_t = w_o.t().contiguous()  # the same weight stored [in, out]

    f_o = 2 * T * D * HV
    f_13 = 2 * n_rows * D * 2 * F
    f_2 = 2 * n_rows * F * D
    o_fwd = ("o_proj fwd", lambda: x_attn @ w_o.t(), f_o)
    o_dw = ("o_proj dW", lambda: dy.t() @ x_attn, f_o)
    o_dx = ("o_proj dX", lambda: dy @ w_o, f_o)
    moe_bwd = [
        ("w2 dW (grouped)", lambda: torch._grouped_mm(d_out.t(), h, offs=offs), f_2),
        ("w2 dX (grouped)", lambda: torch._grouped_mm(d_out, w2, offs=offs), f_2),
        ("w13 dW (grouped)", lambda: torch._grouped_mm(d_gu.t(), xs, offs=offs), f_13),
        ("w13 dX (grouped)", lambda: torch._grouped_mm(d_gu, w13, offs=offs), f_13),
    ]
    moe_fwd = [
        (
            "w13 fwd (grouped)",
            lambda: torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs),
            f_13,
        ),
        ("w2 fwd (grouped)", lambda: torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs), f_2),
    ]
    variants = {
        "o_proj dX, W^T stored": ("o_proj dX W^T", lambda: dy @ w_o_t.t(), f_o),
        "o_proj dX^T": ("o_proj dX^T", lambda: w_o.t() @ dy.t(), f_o),
        "o_proj dW^T": ("o_proj dW^T", lambda: x_attn.t() @ dy, f_o),
    }
    rows: list[dict] = []
    singles = [o_fwd, o_dw, o_dx, *moe_fwd, *moe_bwd, *variants.values()]
    for _, fn, _ in singles:
        fn()
    torch.cuda.synchronize()
    for one in singles:
        _report("alone", [one], _timed([one], a.reps), rows)
    seq = [*moe_bwd, o_dw, o_dx]
    _report("moe bwd seq", seq, _timed(seq, a.reps), rows)
    seq2 = [*moe_bwd, variants["o_proj dW^T"], variants["o_proj dX^T"]]
    _report("seq, T layouts", seq2, _timed(seq2, a.reps), rows)
    fwd_seq = [o_fwd, *moe_fwd]
    _report("moe fwd seq", fwd_seq, _timed(fwd_seq, a.reps), rows)
    # The expert products as one cuBLAS product per expert (host-known row counts), written into
    # slices of one output, against the grouped kernel, alternating in one sequence.
    bounds = [(e * (n_rows // E), (e + 1) * (n_rows // E)) for e in range(E)]
    o13, o2 = (
        torch.empty(n_rows, 2 * F, device=dev, dtype=bf),
        torch.empty(n_rows, D, device=dev, dtype=bf),
    )
    dx13, dx2 = (
        torch.empty(n_rows, D, device=dev, dtype=bf),
        torch.empty(n_rows, F, device=dev, dtype=bf),
    )
    dw13, dw2 = torch.empty_like(w13), torch.empty_like(w2)

    def loop(fn):
        def run():
            for e, (s, t) in enumerate(bounds):
                fn(e, s, t)

        return run

    loops = [
        ("w13 fwd (loop)", loop(lambda e, s, t: torch.mm(xs[s:t], w13[e].t(), out=o13[s:t])), f_13),
        ("w2 fwd (loop)", loop(lambda e, s, t: torch.mm(h[s:t], w2[e].t(), out=o2[s:t])), f_2),
        ("w2 dW (loop)", loop(lambda e, s, t: torch.mm(d_out[s:t].t(), h[s:t], out=dw2[e])), f_2),
        ("w2 dX (loop)", loop(lambda e, s, t: torch.mm(d_out[s:t], w2[e], out=dx2[s:t])), f_2),
        (
            "w13 dW (loop)",
            loop(lambda e, s, t: torch.mm(d_gu[s:t].t(), xs[s:t], out=dw13[e])),
            f_13,
        ),
        ("w13 dX (loop)", loop(lambda e, s, t: torch.mm(d_gu[s:t], w13[e], out=dx13[s:t])), f_13),
    ]
    for fn in loops:
        fn[1]()
    both = [x for pair in zip([*moe_fwd, *moe_bwd], loops) for x in pair]
    _report("grouped/loop", both, _timed(both, a.reps), rows)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                dict(device=torch.cuda.get_device_name(), torch=torch.__version__, T=T, rows=rows),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
