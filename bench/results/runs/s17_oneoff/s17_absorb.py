import sys, os, torch, triton
sys.path.insert(0, os.getcwd())
from titan_glm52.model import attention as A
T, H = 32768, 64
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(T, H, 256, device="cuda", generator=g).bfloat16()
w = torch.randn(H, 448, 512, device="cuda", generator=g).bfloat16() * 0.05
qn, qr = q.split((192, 64), dim=-1); qr = qr.contiguous(); wu = w[:, :192]
old = lambda: torch.cat((torch.einsum("thn,hnr->thr", qn, wu), qr), dim=-1)
new = lambda: A._absorb(qn, qr, wu)
print("equal", torch.equal(old(), new()), "maxabs", float((old().float() - new().float()).abs().max()))
for name, f in (("cat(einsum)", old), ("_LatentQuery", new)):
    print(name, "ms", round(triton.testing.do_bench(f, warmup=5, rep=100), 3))
qn2 = qn.detach().requires_grad_(); wu2 = wu.detach().requires_grad_(); gr = torch.randn(T, H, 576, device="cuda", generator=g).bfloat16()
def fb(f):
    o = f(qn2, qr, wu2); o.backward(gr)
print("fwd+bwd cat(einsum) ms", round(triton.testing.do_bench(lambda: fb(lambda a, b, c: torch.cat((torch.einsum("thn,hnr->thr", a, c), b), dim=-1)), warmup=3, rep=100), 3))
print("fwd+bwd _LatentQuery ms", round(triton.testing.do_bench(lambda: fb(A._absorb), warmup=3, rep=100), 3))
