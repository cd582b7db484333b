import os, sys, importlib.util, torch, triton
import torch.nn.functional as F
sys.path.insert(0, os.getcwd())
from titan_glm52.model import moe as new
spec = importlib.util.spec_from_file_location("moe_old", ".snap/moe_old.py"); old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
n, k, d, e = 32768, 8, 6144, 16
g = torch.Generator(device="cuda").manual_seed(0)
idx = torch.rand(n, e, device="cuda", generator=g).topk(k, dim=-1).indices
order = torch.argsort(idx.reshape(-1), stable=True)
routed = torch.randn(n * k, d, device="cuda", generator=g).bfloat16().requires_grad_()
weights = torch.rand(n, k, device="cuda", generator=g).requires_grad_()
grad = torch.randn(n, d, device="cuda", generator=g).bfloat16()
res = {}
for name, mod in (("old", old), ("new", new)):
    for comp in (False, True):
        f = (lambda r, w, o: mod.combine_routed(r, w, o, torch.bfloat16))
        if comp:
            f = torch.compile(f)
        def step():
            routed.grad = weights.grad = None
            out = f(routed, weights, order); out.backward(grad)
            return out
        out = step()
        ms = triton.testing.do_bench(step, warmup=3, rep=50)
        res[(name, comp)] = (out.detach().clone(), routed.grad.clone(), weights.grad.clone())
        print(f"combine {name} compiled={comp}: fwd+bwd {ms:.2f} ms", flush=True)
for comp in (False, True):
    a, b = res[("old", comp)], res[("new", comp)]
    print("compiled" if comp else "eager", "grads equal", torch.equal(a[1], b[1]), torch.equal(a[2], b[2]), "out max abs", float((a[0].float() - b[0].float()).abs().max()))
gate = torch.randn(n * k, 2048, device="cuda", generator=g).bfloat16().requires_grad_()
up = torch.randn(n * k, 2048, device="cuda", generator=g).bfloat16().requires_grad_()
dh = torch.randn(n * k, 2048, device="cuda", generator=g).bfloat16()
for name, f in (("torch silu*up", lambda a, b: F.silu(a) * b), ("fused", new.swiglu)):
    def st():
        gate.grad = up.grad = None
        f(gate, up).backward(dh)
    ms = triton.testing.do_bench(st, warmup=3, rep=50)
    msf = triton.testing.do_bench(lambda: f(gate.detach(), up.detach()), warmup=3, rep=50)
    print(f"swiglu {name}: fwd {msf:.2f} ms, fwd+bwd {ms:.2f} ms", flush=True)
h0 = F.silu(gate.float()) * up.float()
print("swiglu fused vs fp32 max abs", float((new.swiglu(gate.detach(), up.detach()).float() - h0).abs().max()), "torch bf16 vs fp32", float(((F.silu(gate.detach()) * up.detach()).float() - h0).abs().max()))
