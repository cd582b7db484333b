"""The routed experts' products as one ordinary GEMM per expert: ``expert_mm(x, w, splits)``.

``x [rows, K]`` holds the tokens sorted by expert (``splits[e]`` rows for expert e, host integers),
``w [E, N, K]`` the experts' weights as stored (``nn.Linear``'s out x in); the result ``[rows, N]``
has ``x_e @ w[e]^T`` in expert e's rows. Forward and backward write each expert's product straight
into its slice of one output (``torch.mm`` with ``out=``; the weight gradient into ``dw[e]``), so
nothing is concatenated, split or scattered.

It is ``torch._grouped_mm``'s product computed by cuBLAS one expert at a time. On one H200 at the
proxy's 32K shapes (16 experts x 16,384 rows; ``bench/energy_probe.py``,
``bench/results/2026-12-03_h200_kernels.md``) cuBLAS formed the same bits (max abs difference 0 in
all four products) with 9-11 % less energy and time than the grouped CUTLASS kernel for the forward
and input-gradient products and 4-5 % less for the weight gradient; the power-capped training step
gains what the GEMMs save. Its price is ``splits`` on the host: one device-to-host read of the
expert counts per MoE layer in forward (the backward reuses them).

A registered op (``model/ops.py``; not an ``autograd.Function``) so that op-level activation
checkpointing can save its output like any other matmul's (``parallelize._MATMULS``).
"""

from __future__ import annotations

import torch

from titan_glm52.model.ops import define


def _spans(splits: list[int]):
    start = 0
    for e, n in enumerate(splits):
        yield e, start, n
        start += n


def _check(x: torch.Tensor, w: torch.Tensor, splits: list[int]) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2] or len(splits) != w.shape[0]:
        raise ValueError(
            f"expert_mm: x {tuple(x.shape)}, w {tuple(w.shape)} and {len(splits)} splits do not "
            "fit (x [rows, K], w [E, N, K], one split per expert)"
        )
    if sum(splits) != x.shape[0] or min(splits, default=0) < 0:
        raise ValueError(
            f"expert_mm: the splits ({sum(splits)} rows) must be non-negative and cover x's "
            f"{x.shape[0]} rows"
        )


def _expert_mm(x: torch.Tensor, w: torch.Tensor, splits: list[int]) -> torch.Tensor:
    _check(x, w, splits)
    out = x.new_empty(x.shape[0], w.shape[1])
    for e, s, n in _spans(splits):
        if n:
            torch.mm(x[s : s + n], w[e].t(), out=out[s : s + n])
    return out


def _expert_mm_fake(x, w, splits):
    _check(x, w, splits)
    return x.new_empty(x.shape[0], w.shape[1])


def _setup(ctx, inputs, output) -> None:
    x, w, splits = inputs
    ctx.save_for_backward(x, w)
    ctx.splits = splits


def _backward(ctx, grad: torch.Tensor):
    x, w = ctx.saved_tensors
    grad = grad.contiguous()
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = x.new_empty(x.shape)
        for e, s, n in _spans(ctx.splits):
            if n:
                torch.mm(grad[s : s + n], w[e], out=dx[s : s + n])
    if ctx.needs_input_grad[1]:
        dw = weight_grad(grad, x, ctx.splits, w.new_empty(w.shape))
    return dx, dw, None


def weight_grad(
    grad: torch.Tensor, x: torch.Tensor, splits: list[int], dw: torch.Tensor
) -> torch.Tensor:
    """``dw[e] = grad[rows of e]^T @ x[rows of e]`` into ``dw [E, N, K]`` (zero for an expert
    without rows); returns ``dw``. The weight gradient of ``expert_mm`` (also timed alone by
    ``bench/energy_probe.py``)."""
    for e, s, n in _spans(splits):
        if n:
            torch.mm(grad[s : s + n].t(), x[s : s + n], out=dw[e])
        else:  # an expert without tokens gets a zero gradient
            dw[e].zero_()
    return dw


# ``out[rows of e] = x[rows of e] @ w[e]^T`` for every expert e (the module docstring)
expert_mm = define(
    "expert_mm(Tensor x, Tensor w, SymInt[] splits) -> Tensor",
    _expert_mm, _expert_mm_fake, _backward, _setup,
)  # fmt: skip

__all__ = ["expert_mm"]
