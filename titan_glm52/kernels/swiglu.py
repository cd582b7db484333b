"""SwiGLU of the routed experts, ``silu(gate) * up``, forward and backward in one pass each.

Formed in fp32 and rounded once into the inputs' dtype (``silu``'s output is not rounded on its own), the backward
``d_gate = d_h * up * s * (1 + gate * (1 - s))`` (``s = sigmoid(gate)``) and ``d_up = d_h * silu(gate)`` likewise,
from ``gate`` and ``up`` alone: nothing but the two inputs is kept from forward to backward. In torch the same
takes two kernels forward (silu, product) and three backward (two products, silu's backward), each a pass over
``tokens x top-k x moe_intermediate_size`` values (1 G values per MoE layer at 32K tokens on the proxy).
``model/moe.py`` computes the same numbers in torch where this kernel does not run (CPU).
"""

from __future__ import annotations

import torch

from ._triton_env import check_device, elementwise_block  # (first: the interpreter switch before triton)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

BLOCK = 2048


@triton.jit
def _swiglu_fwd_kernel(g_ptr, u_ptr, h_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(g_ptr, u_ptr, dh_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = dh * u * s * (1.0 + g * (1.0 - s))
    du = dh * (g * s)
    tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(du_ptr + offs, du.to(du_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def _grid(n: int) -> tuple[tuple[int], int]:
    block = elementwise_block(BLOCK)
    return (triton.cdiv(n, block),), block


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (same shape and dtype, contiguous)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         "must match")
    gate, up = gate.contiguous(), up.contiguous()
    check_device(gate, up)
    h = torch.empty_like(gate)
    if gate.numel():
        grid, block = _grid(gate.numel())
        _swiglu_fwd_kernel[grid](gate, up, h, gate.numel(), BLOCK=block, num_warps=4)
    return h


def swiglu_backward(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``d_gate``, ``d_up``) of ``silu(gate) * up`` for the output gradient ``grad``."""
    gate, up, grad = gate.contiguous(), up.contiguous(), grad.contiguous()
    check_device(gate, up, grad)
    d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
    if gate.numel():
        grid, block = _grid(gate.numel())
        _swiglu_bwd_kernel[grid](gate, up, grad, d_gate, d_up, gate.numel(), BLOCK=block, num_warps=4)
    return d_gate, d_up


__all__ = ["swiglu_forward", "swiglu_backward"]
