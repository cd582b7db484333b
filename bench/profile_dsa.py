"""Per-kernel profile of the Triton DSA kernels at one size: what limits them.

    python bench/profile_dsa.py --T 32768  # torch.profiler: time of every kernel launch
    ncu --clock-control none --set full \\
        -k regex:'^_(fwd|bwd_ps|bwd_grad|score|select|kl_fwd|kl_bwd)_kernel' \\
        -o dsa python bench/profile_dsa.py --T 32768 --once  # hardware counters, one launch of each

Shapes as bench/kernels.py (H = 64, D_qk = 576, d_v = 512, topk = 2048, H_I = 32, D_I = 128, bf16,
one document of T tokens, random data). The backward runs as one chunk (one launch per kernel).
Prints one table: per kernel, ms per call and TFLOP/s by the FLOP counts of bench/kernels.py split
per kernel (backward part 1, ps: S, dP = 2*H*K_valid*(D_qk + d_v); part 2, grad: dK, dV, dQ =
2*H*K_valid*(2*D_qk + d_v)); JSON to --out.

    # chunked backward
    python bench/profile_dsa.py --T 32768 --chunked 1024,1024:maxnreg=none,1024:maxnreg=96

``--chunked`` instead times the sparse MLA backward as training runs it, in chunks of queries, per
variant ``SCRATCH_MiB[:KEY=VALUE...]`` (the P / dS scratch, and launch overrides of the Triton part
2, ``sparse_mla``'s "bwd_grad", e.g. maxnreg=none for the compiler's register choice): CUDA-event
ms per backward (median of --reps, after one warm-up), and the largest difference of dQ / dKV to
the first variant (dKV sums with atomics, so only its order differs). ``--no-gluon``: the Triton
kernels only, also where the Gluon ones would run (on an H100 / H200 part 2's overrides only
matter then).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

# noqa: E402  (bench/kernels.py)
from kernels import D_I, D_QK, D_V, H, H_I, TOPK, counts, make_inputs


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--once", action="store_true", help="one call of each op (for ncu), no timing")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--chunked", default=None, help="variants SCRATCH_MiB[:KEY=VALUE...],... (see above)"
    )
    p.add_argument("--no-gluon", dest="gluon", action="store_false", help="the Triton kernels only")
    a = p.parse_args(argv)
    if a.chunked:
        return chunked(a)
    from titan_glm52.kernels import indexer_topk as it_mod, sparse_mla as sm_mod
    from titan_glm52.kernels.indexer_loss import indexer_kl_sparse
    from titan_glm52.kernels.tuning import launch_overrides

    # one chunk: one launch of each backward kernel
    one_chunk = launch_overrides({"sparse_mla": {"bwd": {"scratch_bytes": 1 << 40}}})
    T = a.T
    pairs, kvalid = counts([T])
    cu, qi, ki, wi, q, kv, do = _inputs(T)
    iscale, scale = D_I**-0.5, D_QK**-0.5
    qi_, ki_, wi_ = (x.clone().requires_grad_() for x in (qi, ki, wi))
    grow = torch.ones(T, device="cuda")

    def step():
        idx = it_mod.indexer_topk(qi, ki, wi, cu, TOPK, iscale, gluon=a.gluon)
        o, lse = sm_mod.sparse_mla(q, kv, idx, scale, D_V, gluon=a.gluon)
        torch.autograd.grad(o, (q, kv), do)
        kl = indexer_kl_sparse(q.detach(), kv.detach(), scale, lse, qi_, ki_, wi_, iscale, idx)
        torch.autograd.grad(kl, (qi_, ki_, wi_), grow)

    with one_chunk:
        step()  # compile everything (under ncu: these are the profiled launches)
        torch.cuda.synchronize()
        if a.once:
            return 0
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(a.reps):
                step()
            torch.cuda.synchronize()
    times: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name].append(e.device_time / 1e3)
    flops = {
        "_score_kernel": 2 * H_I * D_I * pairs,
        "_fwd_kernel": 2 * H * kvalid * (D_QK + D_V),
        "_bwd_ps_kernel": 2 * H * kvalid * (D_QK + D_V),
        "_bwd_grad_kernel": 2 * H * kvalid * (2 * D_QK + D_V),
        "_kl_fwd_kernel": 2 * H * kvalid * D_QK + 2 * H_I * D_I * kvalid,
        "_kl_bwd_kernel": 2 * 2 * H_I * D_I * kvalid,
    }
    rows = []
    for name, ts in sorted(times.items(), key=lambda kv_: -sum(kv_[1])):
        ms = sum(ts) / a.reps
        f = flops.get(name)
        rows.append(
            {
                "kernel": name[:80],
                "calls_per_step": len(ts) / a.reps,
                "ms_per_step": ms,
                "tflops": f / ms / 1e9 if f else None,
            }
        )
    total = sum(r["ms_per_step"] for r in rows)
    print(f"\nT={T} (one document), {a.reps} reps; GPU time per step {total:.1f} ms")
    print(f"{'kernel':<42} {'calls':>5} {'ms':>9} {'TFLOP/s':>8}")
    for r in rows[:14]:
        tf = f"{r['tflops']:.0f}" if r["tflops"] else "-"
        print(f"{r['kernel'][:42]:<42} {r['calls_per_step']:>5g} {r['ms_per_step']:>9.2f} {tf:>8}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"T": T, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


def _inputs(T: int):
    """Indexer inputs (bench/kernels.py) and bf16 q, kv (with gradients) and dO of one document of T
    tokens."""
    cu, qi, ki, wi = make_inputs(T, [T])
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(T, H, D_QK, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
    kv = torch.randn(T, D_QK, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
    do = torch.randn(T, H, D_V, generator=g, device="cuda").to(torch.bfloat16)
    return cu, qi, ki, wi, q, kv, do


def chunked(a) -> int:
    from titan_glm52.kernels import indexer_topk as it_mod, sparse_mla as sm_mod
    from titan_glm52.kernels.tuning import launch_overrides

    T = a.T
    cu, qi, ki, wi, q, kv, do = _inputs(T)
    idx = it_mod.indexer_topk(qi, ki, wi, cu, TOPK, D_I**-0.5, gluon=a.gluon)
    o, _ = sm_mod.sparse_mla(q, kv, idx, D_QK**-0.5, D_V, gluon=a.gluon)
    rows, first = [], None
    for spec in a.chunked.split(","):
        mib, *kvs = spec.split(":")
        scratch = int(mib) << 20
        grad_cfg = {k: None if v == "none" else int(v) for k, v in (x.split("=") for x in kvs)}
        ms = []
        variant = {"sparse_mla": {"bwd": {"scratch_bytes": scratch}, "bwd_grad": grad_cfg}}
        with launch_overrides(variant):
            cap = sm_mod._config(H, D_QK, D_V, "bwd_grad")[0].get("maxnreg")
            for r in range(a.reps + 1):
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
                dq, dkv = torch.autograd.grad(o, (q, kv), do, retain_graph=True)
                t1.record()
                torch.cuda.synchronize()
                if r:
                    ms.append(t0.elapsed_time(t1))
        if first is None:
            first = (dq, dkv)
        diff = [float((x.float() - y.float()).abs().max()) for x, y in zip((dq, dkv), first)]
        chunk = sm_mod.chunk_rows(T, H, TOPK, q.element_size(), scratch)
        rows.append(
            {
                "variant": spec,
                "maxnreg": cap,
                "chunk_rows": chunk,
                "ms": sorted(ms)[len(ms) // 2],
                "ms_all": ms,
                "max_diff_dq": diff[0],
                "max_diff_dkv": diff[1],
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            }
        )
    print(f"\nT={T} (one document), sparse MLA backward, median of {a.reps}")
    print(f"{'variant':<16} {'regs':>4} {'rows':>6} {'ms':>8} {'d dq':>9} {'d dkv':>9}")
    for r in rows:
        print(
            f"{r['variant']:<16} {str(r['maxnreg']):>4} {r['chunk_rows']:>6} {r['ms']:>8.2f} "
            f"{r['max_diff_dq']:>9.2e} {r['max_diff_dkv']:>9.2e}"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {"T": T, "device": torch.cuda.get_device_name(), "chunked": rows}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
