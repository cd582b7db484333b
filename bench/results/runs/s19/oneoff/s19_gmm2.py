"""Probe: each grouped GEMM of the MoE experts by operand layout, against cuBLAS per expert (host-known counts)."""
import functools, json, os, torch
from bench.attn_paths import time_fn
torch.manual_seed(0)
dev = "cuda"
E, K, D, F = 16, 8, 6144, 2048
res = {}

t_ms = functools.partial(time_fn, reps=10, warmup=3)  # mean ms per call (the repo root on PYTHONPATH)

for n_tok in (4096, 32768):
    logits = torch.randn(n_tok, E, device=dev) + torch.linspace(0, 1.0, E, device=dev)
    counts = torch.bincount(logits.topk(K, -1).indices.reshape(-1), minlength=E)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    cl = counts.tolist(); n = sum(cl)
    fl = 2 * n * D * F / 1e12
    x = torch.randn(n, D, device=dev, dtype=torch.bfloat16)
    g = torch.randn(n, F, device=dev, dtype=torch.bfloat16)
    W_fd = torch.randn(E, F, D, device=dev, dtype=torch.bfloat16)  # as stored now (w1/w3)
    W_df = W_fd.transpose(1, 2).contiguous()                      # [E, D, F]
    r = {}
    # forward  g = x @ W^T   (W [F, D] per expert)
    r["fwd_now (b=W_fd^T view)"] = t_ms(lambda: torch._grouped_mm(x, W_fd.transpose(-2, -1), offs=offs))
    r["fwd_alt (b=W_df contiguous)"] = t_ms(lambda: torch._grouped_mm(x, W_df, offs=offs))
    # dX = g @ W
    r["dx_now (b=W_fd)"] = t_ms(lambda: torch._grouped_mm(g, W_fd, offs=offs))
    r["dx_alt (b=W_df^T view)"] = t_ms(lambda: torch._grouped_mm(g, W_df.transpose(-2, -1), offs=offs))
    # dW [E, F, D] = g^T x  (K grouped)
    gT = g.t().contiguous(); xT = x.t().contiguous()
    r["dw_fd (a=g^T view, b=x)"] = t_ms(lambda: torch._grouped_mm(g.t(), x, offs=offs))
    r["dw_df (a=x^T view, b=g)"] = t_ms(lambda: torch._grouped_mm(x.t(), g, offs=offs))
    # cuBLAS per expert with host-known counts
    xs, gs = x.split(cl), g.split(cl)
    r["cublas_fwd"] = t_ms(lambda: [torch.mm(a, W_fd[e].t()) for e, a in enumerate(xs)])
    r["cublas_dx"] = t_ms(lambda: [torch.mm(a, W_fd[e]) for e, a in enumerate(gs)])
    r["cublas_dw"] = t_ms(lambda: [torch.mm(gs[e].t(), xs[e]) for e in range(E)])
    res[n_tok] = {"rows": n, "tflop": fl, "ms": {k: round(v, 3) for k, v in r.items()},
                  "tflops": {k: round(fl / (v / 1e3), 1) for k, v in r.items()}}
    print(n_tok, json.dumps(res[n_tok], indent=1), flush=True)
json.dump(res, open(f"{os.environ.get('OUT', '.')}/s19_gmm2.json", "w"), indent=1)
