"""Auxiliary losses: attached to activations (pipeline- and recompute-safe), reported by name.

The indexer KL and the MoE sequence balance loss are formed inside the blocks. Their gradient is
attached to the block's activations by ``AuxLoss`` (so it needs no path to the final loss and works
unchanged under pipeline parallelism and activation checkpointing), weighted by the model option's
coefficient over the step's normaliser. The caller hands the normalisers in, and gets the detached
sums back, in one ``AuxTerms`` per step (or per forward): explicit dataflow through the forward
call, no state on the modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class AuxLoss(torch.autograd.Function):
    """Identity on ``x`` that makes backward through ``x`` also differentiate ``loss`` (with
    gradient 1).

    ``loss`` must already carry its coefficient and normaliser.
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


@dataclass
class AuxTerms:
    """The auxiliary terms of the forwards that receive it (one training step: all its
    micro-batches).

    In:
        tokens: the indexer KL's normaliser, the step's valid tokens over all ranks (the
            cross-entropy's): the gradient attached is ``indexer_loss_coeff * KL_sum / tokens``.
        sequences: the sequence balance loss's normaliser, the step's sequences over all ranks.
        recall_queries: > 0 measures the top-k recall of layer 0 on that many queries (a metric).
    Out (detached, summed over forwards; activation-checkpoint recomputes are not counted again):
        indexer_kl: layer id -> that layer's indexer KL summed over its tokens (empty: no layer
            trained its indexer; ``indexer_kl_sum`` adds the layers up). Complete after the
            backward: a sparse attention backward may add its layer's KL there.
        seq_aux: the sequence balance loss as added to the loss (``seq_aux_loss_coeff`` x the loss
            summed over sequences / ``sequences``), summed over MoE layers (None: off).
        recall: layer 0's top-k recall (None: not measured).
    """

    tokens: torch.Tensor | float = 1.0
    sequences: torch.Tensor | float = 1.0
    recall_queries: int = 0
    indexer_kl: dict[int, torch.Tensor] = field(default_factory=dict)
    seq_aux: torch.Tensor | None = None
    recall: torch.Tensor | None = None

    def indexer_kl_sum(self) -> torch.Tensor | None:
        """The KL of every indexer layer, in forward order (None: none trained its indexer)."""
        return sum(self.indexer_kl.values()) if self.indexer_kl else None

    def indexer_kl_sink(self, layer_id: int, device: torch.device) -> torch.Tensor:
        """The fp32 scalar that layer ``layer_id``'s KL is summed into (zero when first asked): by
        ``attach_indexer_kl``, or by a sparse attention backward that forms the KL itself."""
        sink = self.indexer_kl.get(layer_id)
        if sink is None:
            sink = self.indexer_kl[layer_id] = torch.zeros((), dtype=torch.float32, device=device)
        return sink

    def attach_indexer_kl(
        self, out: torch.Tensor, kl: torch.Tensor, coeff: float, layer_id: int
    ) -> torch.Tensor:
        """``out``, with the gradient of ``coeff * kl / tokens`` attached; ``kl`` (summed) recorded
        for layer ``layer_id``."""
        if not in_backward():
            self.indexer_kl_sink(layer_id, kl.device).add_(kl.detach())
        return AuxLoss.apply(out, kl * (coeff / self.tokens))

    def attach_seq_aux(self, out: torch.Tensor, aux: torch.Tensor, coeff: float) -> torch.Tensor:
        """``out``, with the gradient of ``coeff * aux / sequences`` attached; that term
        recorded."""
        term = aux * (coeff / self.sequences)
        if not in_backward():
            self.seq_aux = _added(self.seq_aux, term)
        return AuxLoss.apply(out, term)


def _added(total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value.detach() if total is None else total + value.detach()
