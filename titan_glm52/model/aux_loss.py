"""Auxiliary losses attached to activations (PP- and recompute-safe)."""

import torch


class AuxLoss(torch.autograd.Function):
    """Identity on ``x`` that makes backward through ``x`` also differentiate ``loss`` (with gradient 1).

    An auxiliary loss (indexer KL, MoE balance) then needs no path to the final loss: it works unchanged under
    pipeline parallelism and activation checkpointing. ``loss`` must already carry its coefficient and
    normaliser.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad.device)


def in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. an activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1
