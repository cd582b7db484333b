"""Session 20 probe: the fp32 router / indexer-weight projection, torch (cast + cuBLAS fp32) against
model/fp32_linear.py's Triton kernels, forward and forward + backward, at 32K tokens x 6144 on one GPU."""
import json
import sys

import torch
import torch.nn.functional as F

from s20_head_probe import timed  # (this folder: the script's own, first on sys.path)
from titan_glm52.model.fp32_linear import linear_fp32


out = []
for t, n in ((32768, 16), (32768, 32), (4096, 16)):
    x = torch.randn(t, 6144, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(n, 6144, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    g = torch.randn(t, n, device="cuda")
    for name, fn in (("torch", lambda: F.linear(x.float(), w.float())), ("triton", lambda: linear_fp32(x, w))):
        fwd = timed(fn, reps=20, warm=3)
        fb = timed(lambda: torch.autograd.grad(fn(), (x, w), g), reps=20, warm=3)
        cell = {"T": t, "N": n, "impl": name, "fwd_ms": fwd, "fwd_bwd_ms": fb}
        out.append(cell); print(cell, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
