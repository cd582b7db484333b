"""SwiGLU of the routed experts, ``silu(gate) * up``, forward and backward in one pass each.

The input is the experts' fused gate/up projection ``gu [rows, 2F]``: the gate in the first F
columns of each row, the up projection in the last F (``GroupedExperts.w13``, one GEMM for both), so
the backward's ``d_gu`` is the gradient that one GEMM takes back to the tokens (no sum of two).

Formed in fp32 and rounded once into the input's dtype (``silu``'s output is not rounded on its
own), the backward ``d_gate = d_h * up * s * (1 + gate * (1 - s))`` (``s = sigmoid(gate)``) and
``d_up = d_h * silu(gate)`` likewise, from ``gu`` alone: nothing but the input is kept from forward
to backward. In torch the same takes two kernels forward (silu, product) and three backward (two
products, silu's backward), each a pass over ``tokens x top-k x moe_intermediate_size`` values (1 G
values per MoE layer at 32K tokens on the proxy). ``model/moe.py`` computes the same numbers in
torch where this kernel does not run (CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_env import check_device, elementwise_block

BLOCK = 2048


@triton.jit
def _gate_up(offs, F: tl.constexpr):
    """Offsets of the gate and up values of output element ``offs`` (row-major ``[rows, F]``) in
    ``[rows, 2F]``."""
    row = offs // F
    g_off = offs + row * F
    return g_off, g_off + F


@triton.jit
def _swiglu_fwd_kernel(gu_ptr, h_ptr, n, F: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g_off, u_off = _gate_up(offs, F)
    g = tl.load(gu_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + u_off, mask=mask, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(gu_ptr, dh_ptr, dgu_ptr, n, F: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g_off, u_off = _gate_up(offs, F)
    g = tl.load(gu_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + u_off, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = dh * u * s * (1.0 + g * (1.0 - s))
    du = dh * (g * s)
    tl.store(
        dgu_ptr + g_off, dg.to(dgu_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask
    )
    tl.store(
        dgu_ptr + u_off, du.to(dgu_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask
    )


def _launch(gu: torch.Tensor) -> tuple[torch.Tensor, int, tuple[int], int]:
    if gu.dim() < 1 or gu.shape[-1] % 2:
        raise ValueError(
            f"swiglu: the fused gate/up input needs an even last dimension, got {tuple(gu.shape)}"
        )
    gu = gu.contiguous()
    f = gu.shape[-1] // 2
    n = gu.numel() // 2
    block = elementwise_block(BLOCK, n)
    return gu, f, (triton.cdiv(n, block),), block


def swiglu_forward(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gu = [..., gate | up]`` (``[..., 2F]``) -> ``[..., F]``, contiguous,
    ``gu``'s dtype."""
    gu, f, grid, block = _launch(gu)
    check_device(gu)
    h = gu.new_empty(*gu.shape[:-1], f)
    if h.numel():
        _swiglu_fwd_kernel[grid](gu, h, h.numel(), F=f, BLOCK=block, num_warps=4)
    return h


def swiglu_backward(gu: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``d_gu = [d_gate | d_up]`` (``gu``'s shape) of ``silu(gate) * up`` for the output gradient
    ``grad``."""
    gu, f, grid, block = _launch(gu)
    if grad.shape != (*gu.shape[:-1], f):
        raise ValueError(
            f"swiglu: gradient {tuple(grad.shape)} does not match the input {tuple(gu.shape)}"
        )
    grad = grad.contiguous()
    check_device(gu, grad)
    d_gu = torch.empty_like(gu)
    if grad.numel():
        _swiglu_bwd_kernel[grid](gu, grad, d_gu, grad.numel(), F=f, BLOCK=block, num_warps=4)
    return d_gu


__all__ = ["swiglu_forward", "swiglu_backward"]
