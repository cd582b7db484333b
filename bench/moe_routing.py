"""The MoE's token-routing glue on one GPU at the proxy's widths (hidden 6144, top-8 of 16 experts,
expert width 2048), forward + backward, eager and compiled: ours (``model/moe.py``:
``dispatch_rows`` and ``combine_routed`` on the kernels of ``kernels/moe_routing.py``) against the
plain-torch formulation (``x[token_of]``, whose backward is a scatter-add, and the products'
``index_add_`` into zeros), each op alone and the whole MoE block.

    python3 bench/moe_routing.py [tokens ...]      # default 32768 4096

Writes $OUT/moe_routing.json; lines starting RESULT summarise.
"""

import json
import os
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402
import triton  # noqa: E402

from titan_glm52 import get_flavor  # noqa: E402
from titan_glm52.model import moe as M  # noqa: E402
from titan_glm52.model.init import init_weights_  # noqa: E402

D, F, K, E = 6144, 2048, 8, 16


def plain_dispatch(x, token_of, pos):
    return x[token_of]


def plain_combine(routed, weights, order, dtype, pos=None):
    k = weights.shape[1]
    products = (routed.float() * weights.reshape(-1)[order, None]).to(dtype)
    return torch.zeros(
        weights.shape[0], routed.shape[1], dtype=dtype, device=routed.device
    ).index_add_(0, order // k, products)


def plain_moe_forward(self, x, rows=1):
    """MoE.forward with the plain formulations (no seq-aux term: off here)."""
    k = self.router.top_k
    scores, idx, weights = self.router(x)
    flat = idx.reshape(-1)
    counts = M.expert_counts(flat, self.num_experts)
    order = torch.argsort(flat, stable=True)
    token_of = order // k
    routed = self.experts(x[token_of], counts, gathered_from=(x, token_of))
    return plain_combine(routed, weights, order, x.dtype) + self.shared_experts(x)


def compiled_block(fwd, block):
    """``torch.compile`` of ``fwd(block, inp)``: the block is bound here, not to a name of
    ``main``'s loop that the loop deletes."""
    return torch.compile(lambda inp: fwd(block, inp))


def bench(fn, inputs, grad, rep=100):
    """Median ms of forward + backward (do_bench: as many runs as fit in ``rep`` ms, at least
    one)."""

    def step():
        for t in inputs:
            t.grad = None
        fn().backward(grad)

    step()
    return triton.testing.do_bench(step, warmup=3, rep=rep, return_mode="median")


def main():
    tokens = [int(a) for a in sys.argv[1:]] or [32768, 4096]
    g = torch.Generator(device="cuda").manual_seed(0)
    res = {
        "command": "python3 " + " ".join(sys.argv),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "widths": dict(D=D, F=F, k=K, E=E),
    }
    for n in tokens:
        idx = torch.rand(n, E, device="cuda", generator=g).topk(K, dim=-1).indices
        order = torch.argsort(idx.reshape(-1), stable=True)
        token_of, pos = order // K, M.token_positions(order, K)
        x = torch.randn(n, D, device="cuda", generator=g).bfloat16().requires_grad_()
        routed = torch.randn(n * K, D, device="cuda", generator=g).bfloat16().requires_grad_()
        weights = torch.rand(n, K, device="cuda", generator=g).requires_grad_()
        g_rows = torch.randn(n * K, D, device="cuda", generator=g).bfloat16()
        g_out = torch.randn(n, D, device="cuda", generator=g).bfloat16()
        row = {}
        for comp in (False, True):
            wrap = torch.compile if comp else (lambda f: f)
            for name, disp, comb in (
                ("plain", plain_dispatch, plain_combine),
                ("ours", M.dispatch_rows, M.combine_routed),
            ):
                d_fn, c_fn = wrap(disp), wrap(comb)
                key = f"{name}_{'compiled' if comp else 'eager'}"
                row[key] = dict(
                    dispatch_ms=bench(lambda x=x: d_fn(x, token_of, pos), [x], g_rows),
                    combine_ms=bench(
                        lambda routed=routed, weights=weights: c_fn(
                            routed, weights, order, torch.bfloat16, pos
                        ),
                        [routed, weights],
                        g_out,
                    ),
                )
                print(n, key, json.dumps(row[key]), flush=True)
        # the whole block, compiled, both formulations
        args = get_flavor("debug").replace(
            hidden_size=D,
            moe_intermediate_size=F,
            num_experts_per_tok=K,
            n_routed_experts=E,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
        )
        torch.manual_seed(0)
        block = M.MoE(args)
        init_weights_(block, 0.02)
        block = block.cuda().bfloat16()
        for name, fwd in (("plain", plain_moe_forward), ("ours", M.MoE.forward)):
            torch._dynamo.reset()
            f = compiled_block(fwd, block)
            params = list(block.parameters())
            row[f"block_{name}_compiled_ms"] = bench(
                lambda f=f, x=x: f(x), [x] + params, g_out, rep=2000
            )
            print(n, f"block {name}", row[f"block_{name}_compiled_ms"], flush=True)
        res[f"N{n}"] = row
        del x, routed, weights, g_rows, g_out, block, f
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "moe_routing.json"), "w") as f:
        json.dump(res, f, indent=1)
    for n in tokens:
        r = res[f"N{n}"]
        cells = " | ".join(
            f"{k} dispatch {v['dispatch_ms']:.2f} combine {v['combine_ms']:.2f}"
            for k, v in r.items()
            if isinstance(v, dict)
        )
        print(
            f"RESULT | tokens {n} | {cells} | block compiled: plain "
            f"{r['block_plain_compiled_ms']:.2f} ms, "
            f"ours {r['block_ours_compiled_ms']:.2f} ms |"
        )


if __name__ == "__main__":
    main()
