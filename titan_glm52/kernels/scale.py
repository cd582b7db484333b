"""``x * g`` for a device-resident fp32 scalar ``g``, the product formed in fp32 and rounded once
into x's dtype, in one pass (read x, write the result). The fused loss (model/head.py) scales the
head gradient it formed in forward by the incoming gradient with it: in torch that takes a cast, a
product and a cast back (a 0-dim fp32 operand of a bf16 tensor is otherwise rounded to bf16 first),
three passes over ~1 G elements for GLM-5.2's head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_env import check_device, elementwise_block

BLOCK = 4096


@triton.jit
def _scale_kernel(x_ptr, g_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    y = (x.to(tl.float32) * g).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(out_ptr + offs, y, mask=mask)


def scaled(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A new tensor ``dtype(float(x) * float(g))`` shaped like ``x``; ``g`` is a one-element
    tensor."""
    if g.numel() != 1:
        raise ValueError(f"scaled: g must have one element, got shape {tuple(g.shape)}")
    x = x.contiguous()
    g = g.detach().to(device=x.device, dtype=torch.float32).reshape(1)
    check_device(x, g)
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        block = elementwise_block(BLOCK, n)
        _scale_kernel[(triton.cdiv(n, block),)](x, g, out, n, BLOCK=block, num_warps=8)
    return out


__all__ = ["scaled"]
