"""``F.linear(x.float(), w.float())``: the fp32 projections of the published model (the MoE router,
the indexer's head weights) on a bf16 residual stream.

On CUDA with a bf16 ``x`` each direction is one Triton pass over ``x`` on the tensor cores
(``kernels/linear_fp32.py``: fp32 operands split into three bf16 terms, exact products, fp32 sums):
no fp32 copy of ``x`` is formed, kept or cast back, and no small-tile fp32 cuBLAS kernel runs (32K
tokens x 6144 -> 16 on an H200: forward + backward 1.92 -> 0.63 ms). Elsewhere (CPU, other dtypes,
more than ``MAX_N`` outputs) the same products in torch, and for DTensor weights the torch
expression itself. Both are fp32 products and differ by fp32 summation order only. The input
gradient is summed in fp32 and rounded once into x's dtype, the weight gradient into w's, as
autograd does through the two casts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_glm52.kernels import triton_available

# kernels/linear_fp32.MAX_N (not imported here: importing the model must not import triton)
MAX_N = 64
_W_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _on_kernel(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``kernels/linear_fp32.py`` takes the product: CUDA, bf16 x, at most ``MAX_N``
    outputs."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and w.dtype in _W_DTYPES
        and 1 <= w.shape[0] <= MAX_N
        and triton_available()
    )


class _LinearFp32(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        if _on_kernel(x, w):
            # lazy, as in model/moe.py
            from titan_glm52.kernels.linear_fp32 import linear_fp32_forward

            out = linear_fp32_forward(x2, w)
        else:
            out = F.linear(x2.float(), w.float())
        return out.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        g = grad.reshape(-1, w.shape[0]).float()
        x2 = x.reshape(-1, x.shape[-1])
        dx = dw = None
        if _on_kernel(x, w):
            from titan_glm52.kernels.linear_fp32 import (
                linear_fp32_grad_input,
                linear_fp32_grad_weight,
            )

            if ctx.needs_input_grad[0]:
                dx = linear_fp32_grad_input(g, w, x.dtype)
            if ctx.needs_input_grad[1]:
                dw = linear_fp32_grad_weight(g, x2)
        else:
            if ctx.needs_input_grad[0]:
                dx = (g @ w.float()).to(x.dtype)
            if ctx.needs_input_grad[1]:
                dw = g.t() @ x2.float()
        return (None if dx is None else dx.view(x.shape)), (None if dw is None else dw.to(w.dtype))


def linear_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x.float(), w.float())`` (fp32 ``[..., N]``) for ``w [N, D]``; see the module
    docstring."""
    if hasattr(w, "to_local"):  # DTensor weights: the torch expression, which DTensor dispatches
        return F.linear(x.float(), w.float())
    return _LinearFp32.apply(x, w)
