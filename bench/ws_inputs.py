"""Inputs of the warp-specialised kernel probes: q, kv (bf16) and the indexer's top-2048 of random
indexer inputs."""

import json
import os
import sys

import torch

from titan_glm52.kernels.indexer_topk import indexer_topk

DEV = "cuda"
H, D_QK, D_V, TOPK, H_I, D_I = 64, 576, 512, 2048, 32, 128


def inputs(lengths, seed, empty=()):
    total = sum(lengths)
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(total, H, D_QK, generator=g, device=DEV).to(torch.bfloat16)
    kv = torch.randn(total, D_QK, generator=g, device=DEV).to(torch.bfloat16)
    qi = torch.randn(total, H_I, D_I, generator=g, device=DEV).to(torch.bfloat16)
    ki = torch.randn(total, D_I, generator=g, device=DEV).to(torch.bfloat16)
    wi = torch.randn(total, H_I, generator=g, device=DEV) * H_I**-0.5
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    idx = indexer_topk(qi, ki, wi, cu, TOPK, D_I**-0.5)
    for r in empty:
        idx[r] = -1
    return q, kv, idx.to(torch.int32).contiguous()


def bwd_inputs(lengths, seed, go_gen, scale):
    """``inputs`` plus what the sparse MLA backward takes: (q, kv, idx, kend, grad_out drawn from
    ``go_gen``, the forward's out and lse at ``scale``)."""
    from titan_glm52.kernels import sparse_mla as SM

    q, kv, idx = inputs(lengths, seed)
    go = torch.randn(q.shape[0], H, D_V, generator=go_gen, device=DEV).to(torch.bfloat16)
    kend = SM.valid_extent(idx)
    out, lse = SM._fwd(q, kv, idx, kend, scale, D_V)
    return q, kv, idx, kend, go, out, lse


def cos(a, b) -> float:
    """1 - cosine similarity of two tensors, in fp32."""
    a, b = a.float().flatten(), b.float().flatten()
    return float(1 - (a @ b) / (a.norm() * b.norm()))


def variant() -> dict:
    """The launch variant given as the first argument (JSON of one part's keys, for
    ``tuning.launch_overrides``; "base" or none = the defaults)."""
    var = json.loads(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] != "base" else {}
    print("variant", var, flush=True)
    return var


def save(res: dict, prefix: str, var: dict) -> str:
    """Writes $OUT/<prefix>_<variant>.json; returns the variant's tag."""
    tag = "_".join(f"{k}{v}" for k, v in var.items()) or "base"
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"{prefix}_{tag}.json"), "w") as f:
        json.dump(res, f, indent=1)
    return tag
