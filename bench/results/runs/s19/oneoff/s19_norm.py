"""Probe: the gradient norm over the proxy's parameter shapes (bf16 grads, fp32 accumulation): torch._foreach_norm
(the trainer's path now) vs torch.linalg.vector_norm per tensor vs a hybrid."""
import functools, json, os, torch
from bench.attn_paths import time_fn
from titan_glm52.model.args import get_flavor
from titan_glm52.model.model import GLM52Model
args = get_flavor("glm52_proxy"); args.num_nextn_predict_layers = 0
with torch.device("meta"):
    m = GLM52Model(args)
shapes = [tuple(p.shape) for p in m.parameters()]
g = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
n = sum(x.numel() for x in g)
t_ms = functools.partial(time_fn, reps=10, warmup=3)  # mean ms per call (the repo root on PYTHONPATH)
foreach = lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(g, 2, dtype=torch.float32)), 2)
per = lambda: torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x, 2, dtype=torch.float32) for x in g]), 2)
big = [x for x in g if x.numel() >= (1 << 22)]; small = [x for x in g if x.numel() < (1 << 22)]
hyb = lambda: torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x, 2, dtype=torch.float32) for x in big]
                                                    + list(torch._foreach_norm(small, 2, dtype=torch.float32))), 2)
res = {"params": n, "tensors": len(g)}
for k, f in (("foreach", foreach), ("per_tensor", per), ("hybrid", hyb)):
    ms = t_ms(f); res[k] = {"ms": round(ms, 3), "TB/s": round(2 * n / ms / 1e9, 2), "value": float(f())}
print(json.dumps(res, indent=1))
json.dump(res, open(f"{os.environ.get('OUT', '.')}/s19_norm.json", "w"), indent=1)
