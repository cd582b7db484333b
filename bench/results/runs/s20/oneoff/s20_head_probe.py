"""Session 20 probe: the fused loss head's forward (loss + dh + dW) at the proxy's widths on one GPU, by chunk size
and by how the weight gradient is summed over chunks; plus each of its GEMMs alone. Writes JSON to argv[1]."""
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from titan_glm52.kernels.cross_entropy import cross_entropy_rows

D, V = 6144, 154880
dev = "cuda"


def timed(fn, reps=5, warm=2):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts), min(ts)


def head(h, w, labels, chunk, mode):
    dh = torch.empty_like(h)
    dw = tmp = None
    start = 0
    total = torch.zeros((), dtype=torch.float32, device=dev)
    for h_c, l_c in zip(h.split(chunk), labels.split(chunk)):
        z = F.linear(h_c, w)
        total += cross_entropy_rows(z, l_c, -100, grad_in_place=True).sum()
        torch.mm(z, w, out=dh[start:start + h_c.shape[0]])
        if dw is None:
            dw = torch.mm(z.t(), h_c)
        elif mode == "addmm":
            dw.addmm_(z.t(), h_c)
        elif mode == "addmm_t":
            dw.t().addmm_(h_c.t(), z)
        elif mode == "fresh_add":
            if tmp is None:
                tmp = torch.empty_like(dw)
            torch.mm(z.t(), h_c, out=tmp)
            dw.add_(tmp)
        start += h_c.shape[0]
    return total, dh, dw


def main():
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cells": []}
    torch.manual_seed(0)
    w = (torch.randn(V, D, device=dev) * 0.02).to(torch.bfloat16)
    for t in (32768, 16384):
        h = torch.randn(t, D, device=dev, dtype=torch.bfloat16)
        labels = torch.randint(0, V, (t,), device=dev)
        for chunk in (4096, 8192, 16384):
            if chunk > t:
                continue
            for mode in ("addmm", "addmm_t", "fresh_add"):
                torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                try:
                    med, mn = timed(lambda: head(h, w, labels, chunk, mode), reps=3, warm=1)
                except torch.OutOfMemoryError:
                    med = mn = None
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                cell = {"T": t, "chunk": chunk, "mode": mode, "ms_median": med, "ms_min": mn, "extra_peak_gib": peak}
                out["cells"].append(cell); print(cell, flush=True)
                torch.cuda.empty_cache()
        del h, labels
    # the single GEMMs at chunk 4096 / 8192
    for c in (4096, 8192):
        hc = torch.randn(c, D, device=dev, dtype=torch.bfloat16)
        g = torch.randn(c, V, device=dev, dtype=torch.bfloat16) * 1e-3
        dw = torch.zeros(V, D, device=dev, dtype=torch.bfloat16)
        flop = 2 * c * V * D
        gemms = {
            "z = h W^T": lambda: F.linear(hc, w),
            "dh = g W": lambda: torch.mm(g, w),
            "dW = g^T h (fresh)": lambda: torch.mm(g.t(), hc),
            "dW += g^T h (addmm_)": lambda: dw.addmm_(g.t(), hc),
            "dW^T += h^T g (addmm_ on dW.t())": lambda: dw.t().addmm_(hc.t(), g),
            "dW^T = h^T g (fresh, [D, V])": lambda: torch.mm(hc.t(), g),
        }
        for name, fn in gemms.items():
            med, mn = timed(fn, reps=7, warm=2)
            cell = {"chunk": c, "gemm": name, "ms_median": med, "tflops": flop / med / 1e9}
            out["cells"].append(cell); print(cell, flush=True)
        del hc, g, dw
        torch.cuda.empty_cache()
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
