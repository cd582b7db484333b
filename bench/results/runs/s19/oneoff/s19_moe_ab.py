"""A/B: a whole compiled MoE block (proxy widths) fwd+bwd, with whichever titan_glm52 is first on sys.path."""
import json, os, sys, torch, triton
import titan_glm52
from titan_glm52 import get_flavor
from titan_glm52.model import moe as M
from titan_glm52.model.init import init_weights_
D, F, K, E = 6144, 2048, 8, 16
tag = sys.argv[1]
out = {"code": os.path.dirname(titan_glm52.__file__), "tag": tag}
for n in (32768, 4096):
    args = get_flavor("debug").replace(hidden_size=D, moe_intermediate_size=F, num_experts_per_tok=K,
                                       n_routed_experts=E, n_shared_experts=1, n_group=1, topk_group=1)
    torch.manual_seed(0)
    block = M.MoE(args); init_weights_(block, 0.02); block = block.cuda().bfloat16()
    x = torch.randn(n, D, device="cuda").bfloat16().requires_grad_()
    g = torch.randn(n, D, device="cuda").bfloat16()
    torch._dynamo.reset()
    f = torch.compile(lambda inp: block(inp))
    params = list(block.parameters())
    def step():
        for t in [x] + params: t.grad = None
        f(x).backward(g)
    step(); step()
    torch.cuda.reset_peak_memory_stats()
    ms = [triton.testing.do_bench(step, warmup=3, rep=1500, return_mode="median") for _ in range(3)]
    out[n] = {"ms": ms, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    print(tag, n, out[n], flush=True)
    del block, x, g, f; torch.cuda.empty_cache()
json.dump(out, open(f"{os.environ.get('OUT', '.')}/moe_ab_{tag}.json", "w"), indent=1)
