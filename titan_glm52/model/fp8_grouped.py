"""The routed experts' products in FP8 with rowwise scaling, one grouped GEMM each: torchao's
``_to_fp8_rowwise_then_scaled_grouped_mm`` (torchtitan's float8 MoE recipe) on a Hopper-class GPU;
elsewhere the same quantisation with each product formed on the dequantised operands in fp32.

Every operand is e4m3 with power-of-two scales ``2^floor(log2(448 / max(amax, 1e-12)))`` (torchao's
``round_scales_to_power_of_2``):

| product | first operand | second operand |
|---|---|---|
| forward ``y_e = x_e W_e^T`` | ``x`` per row | ``W_e`` per output feature |
| input gradient ``dx_e = dy_e W_e`` | ``dy`` per row | ``W_e`` per input feature |
| weight gradient ``dW_e = dy_e^T x_e`` | ``dy`` per column over expert e's rows | ``x`` likewise |

Unlike the block-wise experts (``model/fp8_mm.py``: one GEMM per expert, so the host reads the
expert counts in every MoE layer), nothing here needs the counts on the host: the grouped GEMM
takes the experts' row offsets on the device. It needs each expert's rows to start on a multiple of
``ALIGN`` rows, so ``aligned_layout`` places the expert-sorted rows in a buffer of a size fixed by
the row count alone, each expert's rows followed by zero rows up to the next multiple, the buffer's
tail belonging to the last expert. Zero rows add nothing to a weight gradient and give zero rows of
output, which nobody reads.
"""

from __future__ import annotations

import torch

from titan_glm52.model.expert_mm import _spans
from titan_glm52.model.fp8_mm import E4M3, EPS, FP8_MAX  # EPS: torchao's floor under an amax too

ALIGN = 16  # torch._scaled_grouped_mm: every group starts on a multiple of 16 rows


def aligned_layout(counts: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For ``rows`` expert-sorted rows with ``counts[e]`` rows of expert e: ``dest [rows]`` (each
    row's row in the aligned buffer), ``ends [E]`` int32 (each expert's end there; the last is the
    buffer's size) and that size, ``rows + (ALIGN - 1) E`` rounded up to ``ALIGN``: known without
    reading the counts."""
    n = counts.numel()
    total = -(-(rows + (ALIGN - 1) * n) // ALIGN) * ALIGN
    counts = counts.to(torch.int64)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    shift = (torch.cumsum(padded, 0) - padded) - (torch.cumsum(counts, 0) - counts)
    dest = torch.arange(rows, device=counts.device)
    dest = dest + torch.repeat_interleave(shift, counts, output_size=rows)
    # the tail after the last expert's rows joins it (made on the device: writing a host int into
    # a CUDA tensor would copy it over and wait)
    ends = torch.cat([torch.cumsum(padded, 0)[:-1], padded.new_full((1,), total)])
    return dest, ends.to(torch.int32), total


def to_aligned(x: torch.Tensor, dest: torch.Tensor, total: int) -> torch.Tensor:
    """``[total, D]``: ``x``'s rows at ``dest``, zeros elsewhere."""
    return x.new_zeros(total, x.shape[1]).index_copy(0, dest, x)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    s = (FP8_MAX / amax.clamp_min(EPS).double()).float()
    return torch.exp2(torch.floor(torch.log2(s)))


def quant_dequant(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` in fp32 as its e4m3 copy scaled along ``dim`` (one scale per slice across it) sees it:
    ``e4m3(clamp(x s)) / s``."""
    xf = x.float()
    s = _scale(xf.abs().amax(dim, keepdim=True))
    return (xf * s).clamp(-FP8_MAX, FP8_MAX).to(E4M3).float() / s


def _groups(ends: torch.Tensor):
    """(expert, first row, row count) of each group of the int32 group ends ``ends``."""
    return _spans(torch.diff(ends, prepend=ends.new_zeros(1)).tolist())


class _EmulatedRowwise(torch.autograd.Function):
    """The module docstring's products, each on the dequantised operands in fp32 (no FP8 GEMM on
    this device); ``x [rows, K]`` with expert e's rows in ``[ends[e-1], ends[e])``, ``w [E, N,
    K]``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, ends)
        xd, wd = quant_dequant(x, 1), quant_dequant(w, 2)
        out = x.new_zeros(x.shape[0], w.shape[1])
        for e, s, n in _groups(ends):
            out[s : s + n] = (xd[s : s + n] @ wd[e].t()).to(x.dtype)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, ends = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gd, wd = quant_dequant(grad, 1), quant_dequant(w, 1)
            dx = torch.zeros_like(x)
            for e, s, n in _groups(ends):
                dx[s : s + n] = (gd[s : s + n] @ wd[e]).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = torch.zeros_like(w)
            for e, s, n in _groups(ends):
                if n:
                    ge, xe = quant_dequant(grad[s : s + n], 0), quant_dequant(x[s : s + n], 0)
                    dw[e] = (ge.t() @ xe).to(w.dtype)
        return dx, dw, None


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9


def rowwise_grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``out[rows of e] = x[rows of e] @ w[e]^T`` in FP8 (module docstring) for ``x [rows, K]`` laid
    out by ``aligned_layout`` (``ends`` its int32 group ends) and ``w [E, N, K]``."""
    if not _on_gpu(x):
        return _EmulatedRowwise.apply(x, w, ends)
    # lazy: torchao is needed only by this recipe, and only on a GPU
    from torchao.prototype.moe_training.fp8_grouped_mm import (
        _to_fp8_rowwise_then_scaled_grouped_mm,
    )

    # w^T [E, K, N] is column-major per expert, as the grouped GEMM wants its right operand
    return _to_fp8_rowwise_then_scaled_grouped_mm(
        x, w.transpose(-2, -1), ends, out_dtype=x.dtype, pad_token_groups_for_grouped_mm=False
    )
