"""Which exact kernel path is fastest for a DSA layer's attention at a given length (GPU, bf16, fwd
+ bwd).

DSA attends each query to the keys its top-k selects. Two exact ways to compute that:

* sparse (ours): the absorbed / MQA form over the gathered latent rows
  (``titan_glm52.kernels.sparse_mla``), 2 * (576 + 512) FLOPs per (query, key, head) over the
  selected keys only;
* masked dense: the plain MLA form (per-head 256-d keys and values from ``wkv_b``) over every causal
  key with a boolean mask that keeps the selected ones, 2 * (256 + 256) FLOPs per visible (query,
  key, head), on a dense attention kernel (SDPA cuDNN / memory-efficient with a mask, or
  FlexAttention).

At T <= 2 * topk the masked dense form does ~1.5x the pairs at 0.47x the FLOPs each on faster
kernels; at long T the sparse form wins. This script times both (plus unmasked causal cuDNN, the
dense peer's cost) at the proxy's widths for a list of T, checks that the paths agree, and prints a
table (JSON to ``$OUT/attn_paths.json``).

    source bench/gpu_env.sh && python3 bench/attn_paths.py --seq-lens 2048,4096,8192,16384
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

H, NOPE, ROPE, V, RANK, TOPK = 64, 192, 64, 256, 512, 2048


def random_topk(t: int, topk: int, device) -> torch.Tensor:
    """Causal top-k of random scores, -1 padded (the indexer's output format)."""
    out = torch.full((t, topk), -1, dtype=torch.int32, device=device)
    for a in range(0, t, 2048):
        b = min(a + 2048, t)
        s = torch.rand(b - a, b, device=device)
        rows = torch.arange(a, b, device=device)[:, None]
        s = s.masked_fill(torch.arange(b, device=device)[None, :] > rows, -1.0)
        k = min(topk, b)
        val, idx = s.topk(k, dim=-1)
        idx = torch.where(val >= 0, idx, -1).to(torch.int32)
        out[a:b, :k] = idx
    return out


def selection_mask(topk: torch.Tensor, t: int) -> torch.Tensor:
    mask = torch.zeros(t, t + 1, dtype=torch.bool, device=topk.device)
    mask.scatter_(1, torch.where(topk >= 0, topk, t).long(), True)
    return mask[:, :t]


def time_fn(fn, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seq-lens", default="2048,4096,8192,16384")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from titan_glm52.kernels import triton_sparse_mla

    dev = torch.device("cuda")
    torch.manual_seed(0)
    flex = torch.compile(flex_attention, dynamic=False)
    scale = (NOPE + ROPE) ** -0.5
    results = []
    for t in [int(x) for x in args.seq_lens.split(",")]:
        q_nope = (torch.randn(t, H, NOPE, device=dev) * 0.5).bfloat16().requires_grad_()
        q_rope = (torch.randn(t, H, ROPE, device=dev) * 0.5).bfloat16().requires_grad_()
        c_kv = torch.randn(t, RANK, device=dev).bfloat16().requires_grad_()
        k_rope = torch.randn(t, ROPE, device=dev).bfloat16().requires_grad_()
        w = (torch.randn(H * (NOPE + V), RANK, device=dev) * RANK**-0.5).bfloat16().requires_grad_()
        leaves = (q_nope, q_rope, c_kv, k_rope, w)
        topk = random_topk(t, TOPK, dev)
        mask = selection_mask(topk, t)
        grad = torch.randn(t, H, V, device=dev).bfloat16()

        def sparse():
            wk = w.view(H, NOPE + V, RANK)
            q_abs = torch.cat((torch.einsum("thn,hnr->thr", q_nope, wk[:, :NOPE]), q_rope), -1)
            o_lat, _ = triton_sparse_mla(q_abs, torch.cat((c_kv, k_rope), -1), topk, scale, RANK)
            return torch.einsum("thr,hvr->thv", o_lat, wk[:, NOPE:])

        def plain_qkv():
            kvb = F.linear(c_kv, w).view(t, H, NOPE + V)
            k = torch.cat((kvb[..., :NOPE], k_rope[:, None].expand(t, H, ROPE)), -1)
            q = torch.cat((q_nope, q_rope), -1)
            return (x.transpose(0, 1)[None] for x in (q, k, kvb[..., NOPE:]))

        def sdpa(backend, masked):
            def fn():
                q, k, v = plain_qkv()
                with sdpa_kernel([backend]):
                    if masked:
                        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
                    else:
                        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
                return o[0].transpose(0, 1)

            return fn

        block_mask = None

        def flex_fn():
            nonlocal block_mask
            if block_mask is None:
                block_mask = create_block_mask(
                    lambda b, h, qi, ki: mask[qi, ki], None, None, t, t, device=dev, _compile=True
                )
            q, k, v = plain_qkv()
            return flex(q, k, v, block_mask=block_mask, scale=scale)[0].transpose(0, 1)

        paths = {
            "sparse (ours, absorbed)": sparse,
            "masked dense cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION, True),
            "masked dense efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION, True),
            "masked dense flex": flex_fn,
            "causal dense cuDNN (unmasked, not DSA)": sdpa(SDPBackend.CUDNN_ATTENTION, False),
        }
        ref = None
        for name, fn in paths.items():
            row = {"T": t, "path": name}
            try:
                out = fn()
                if ref is None:
                    ref = out.detach().float()
                elif "unmasked" not in name:
                    row["max_rel_diff_vs_sparse"] = float(
                        (out.float() - ref).abs().max() / ref.abs().max()
                    )
                del out

                def fwd_bwd():
                    for x in leaves:
                        x.grad = None
                    fn().backward(grad)

                row["fwd_ms"] = time_fn(lambda: fn(), args.reps, args.warmup)
                torch.cuda.reset_peak_memory_stats()
                row["fwd_bwd_ms"] = time_fn(fwd_bwd, args.reps, args.warmup)
                row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            except Exception as e:  # record and go on: some backends reject some shapes
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            results.append(row)
            print(json.dumps(row), flush=True)
        block_mask = None
        torch.cuda.empty_cache()
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "attn_paths.json"), "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "rows": results,
                },
                f,
                indent=1,
            )
    print(
        f"\n{'T':>6} | {'path':<40} | {'fwd ms':>8} | {'fwd+bwd ms':>10} | {'peak GiB':>8} | rel "
        "diff"
    )
    for r in results:
        if "error" in r:
            print(f"{r['T']:>6} | {r['path']:<40} | {r['error']}")
        else:
            print(
                f"{r['T']:>6} | {r['path']:<40} | {r['fwd_ms']:8.2f} | {r['fwd_bwd_ms']:10.2f} | "
                f"{r['peak_gib']:8.2f} | {r.get('max_rel_diff_vs_sparse', float('nan')):.1e}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
