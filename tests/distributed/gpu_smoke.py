"""One-GPU smoke check (no test collected): inductor compile inside AC, bf16 with grouped_mm
experts.

``python -m tests.distributed.gpu_smoke``. fp32: compile (+ AC full / selective) equals eager
closely (H200, torch 2.11: 3.6e-7 relative gradient difference). bf16: compile + AC is within
run-to-run noise of compile (H200: eager run twice already differs by 2.4% relative, from atomic
adds; AC 2.7-3.1%); compile vs eager differs by bf16 rounding (inductor keeps fused intermediates in
fp32: ~9%, also on CPU without AC).
"""

import copy

import torch

from tests.distributed.cases import cross_entropy_sum, labels_of
from titan_glm52.model.args import get_flavor
from titan_glm52.model.model import GLM52Model
from titan_glm52.parallelize import parallelize_model

VARIANTS = {
    "eager": {},
    "compile": dict(compile=True),
    "compile+full": dict(compile=True, ac_mode="full"),
    "compile+selective": dict(compile=True, ac_mode="selective"),
}


def run(dtype: torch.dtype) -> dict:
    args = get_flavor("debug").replace(index_topk=8)
    torch.manual_seed(0)
    ref = GLM52Model(args).cuda()
    ref.init_weights()
    ref.to(dtype)
    tokens = torch.randint(1, args.vocab_size, (4, 64), device="cuda", generator=None)
    out = {}
    for name, kw in VARIANTS.items():
        model = copy.deepcopy(ref)
        parallelize_model(model, None, compile_backend="inductor", **kw)
        for _ in range(2):  # the second step runs the compiled code without recompiling
            model.zero_grad()
            logits, mtp = model(tokens, with_mtp=True)
            loss = (
                cross_entropy_sum(logits, labels_of(tokens, 1))
                + cross_entropy_sum(mtp, labels_of(tokens, 2))
            ) / 500
            loss.backward()
        grads = torch.cat(
            [p.grad.float().flatten() for p in model.parameters() if p.grad is not None]
        )
        out[name] = (loss.item(), grads)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


if __name__ == "__main__":
    for dtype, base, tol in ((torch.float32, "eager", 1e-3), (torch.bfloat16, "compile", 6e-2)):
        res = run(dtype)
        for name, (loss, grads) in res.items():
            print(
                f"{dtype} {name}: loss {loss:.6f}, rel grad diff vs eager "
                f"{rel(grads, res['eager'][1]):.2e}, "
                f"vs {base} {rel(grads, res[base][1]):.2e}",
                flush=True,
            )
            if name != "eager" and (dtype == torch.float32 or name != "compile"):
                assert rel(grads, res[base][1]) < tol, (dtype, name)
    print("GPU SMOKE OK", torch.__version__)
