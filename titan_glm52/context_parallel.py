"""Context parallelism for DSA: every sequence split over the CP ranks, queries local, the compact
key state gathered.

Split (zigzag): a sequence of S tokens is cut into 2N chunks of S / 2N (N = the CP degree); rank r
holds chunks r and 2N - 1 - r, in that order, so that the causal work (the indexer scores every
visible key) is balanced: for one document every rank scores the same number of (query, key) pairs.
A batch ``[B, S]`` becomes ``[B, S / N]`` on each rank (``zigzag_split``); its flattened local rows
have the global rows ``CPContext.rows`` in the flattened ``[B * S]`` stream, where ``cu_seqlens``
(known to every rank) describes the documents.

Gathered per layer (``CPContext.gather``): the 576-value latent row of every token (``kv_a``'s
normed latent and its rotated rope key, the ``kv`` the sparse kernels take) and, on full layers,
the indexer's key; never the hidden states. The gather is an all-gather over the CP group followed
by a reordering into the global row order, so that the kernels see exactly the single-process key
tensor and the indexer's top-k holds global key rows; its backward (autograd) reduce-scatters the
key-state gradients back to their owners.

Built on ``torch.distributed``'s functional collectives: traceable by torch.compile and
differentiable (``all_gather_into_tensor``'s autograd formula is a summed reduce-scatter). The
model reaches the group only through the ``CPContext`` in its packed context (per step), never
through module state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from titan_glm52.host_copy import host_to_device

# torch >= 2.13 names it all_gather_single_autograd; the older name warns there
_all_gather = (
    getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
)


# ----------------------------------------------------------------------------------- the split
def check_split(seq: int, size: int) -> None:
    """Raises ValueError unless a sequence of ``seq`` tokens splits into ``2 * size`` chunks."""
    if size < 1 or seq % (2 * size):
        raise ValueError(
            f"a sequence of {seq} tokens does not split into 2 x {size} equal chunks (zigzag "
            "context parallelism needs seq_len divisible by 2 x context_parallel_degree)"
        )


def zigzag_columns(seq: int, size: int, rank: int, device=None) -> torch.Tensor:
    """int64 ``[seq // size]``: the positions in a sequence that ``rank`` holds, chunk ``rank``
    then chunk ``2 * size - 1 - rank``."""
    check_split(seq, size)
    c = seq // (2 * size)
    back = 2 * size - 1 - rank
    return torch.cat(
        (
            torch.arange(rank * c, (rank + 1) * c, device=device),
            torch.arange(back * c, (back + 1) * c, device=device),
        )
    )


def zigzag_split(x: torch.Tensor, size: int, rank: int, dim: int = 1) -> torch.Tensor:
    """``rank``'s part of ``x`` along the sequence dim ``dim`` (a new tensor)."""
    seq = x.shape[dim]
    check_split(seq, size)
    c = seq // (2 * size)
    back = 2 * size - 1 - rank
    return torch.cat((x.narrow(dim, rank * c, c), x.narrow(dim, back * c, c)), dim=dim)


def zigzag_order(seq: int, size: int) -> torch.Tensor:
    """int64 ``[seq]``: the positions of every rank's part, rank after rank (a permutation)."""
    return torch.cat([zigzag_columns(seq, size, r) for r in range(size)])


def zigzag_inverse(seq: int, size: int) -> torch.Tensor:
    """int64 ``[seq]``: the inverse of ``zigzag_order``: where each position sits in the ranks'
    parts laid rank after rank."""
    order = zigzag_order(seq, size)
    return torch.empty_like(order).scatter_(0, order, torch.arange(seq))


def zigzag_merge(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part (``parts[r]`` from ``zigzag_split(x, N, r)``)."""
    laid = torch.cat(parts, dim=dim)
    return laid.index_select(dim, zigzag_inverse(laid.shape[dim], len(parts)).to(laid.device))


def next_token_ids(tokens: torch.Tensor) -> torch.Tensor:
    """``tokens [B, S]`` shifted left by one within each row, 0 after the last position: the ids
    whose embeddings the MTP layer takes at each position (split like the tokens, so no rank needs
    another's; the model zeroes the last position's embedding)."""
    return torch.cat((tokens[:, 1:], torch.zeros_like(tokens[:, :1])), dim=1)


def laid_to_global(laid: torch.Tensor, size: int, batch: int, seq: int) -> torch.Tensor:
    """Every rank's flattened local rows laid rank after rank (``[size * batch * seq // size,
    ...]``, what the all-gather returns) -> the global row order ``[batch * seq, ...]``: one copy,
    differentiable (the backward writes the gradient back in the laid order, one buffer)."""
    return _ToGlobal.apply(laid, size, batch, seq)


class _ToGlobal(torch.autograd.Function):
    """The reordering of ``laid_to_global``: one output written chunk by chunk in forward, one
    laid-order buffer in backward (autograd's own formulas for the views and the concatenation
    would allocate a zero-filled input-sized tensor per chunk)."""

    @staticmethod
    def forward(ctx, laid: torch.Tensor, size: int, batch: int, seq: int) -> torch.Tensor:
        c, rest = seq // (2 * size), laid.shape[1:]
        ctx.shape = (size, batch, 2, c, *rest)
        parts = laid.view(ctx.shape)
        # chunk j < size is rank j's front chunk; chunk size + j is rank size - 1 - j's back chunk
        chunks = [parts[r, :, 0] for r in range(size)]
        chunks += [parts[size - 1 - j, :, 1] for j in range(size)]
        return torch.cat(chunks, dim=1).view(batch * seq, *rest)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size, batch, _, c = ctx.shape[:4]
        g = grad.view(batch, 2 * size, c, *ctx.shape[4:])
        out = grad.new_empty(ctx.shape)
        for r in range(size):
            out[r, :, 0].copy_(g[:, r])
            out[r, :, 1].copy_(g[:, 2 * size - 1 - r])
        return out.view(-1, *ctx.shape[4:]), None, None, None


# ----------------------------------------------------------------------------------- the group
@dataclass(frozen=True)
class CPGroup:
    """The CP group of this rank: what a forward needs to build its ``CPContext``. Held by name,
    which the functional collectives take and torch.compile traces as a constant."""

    group_name: str
    rank: int
    size: int

    @staticmethod
    def of(group: dist.ProcessGroup) -> CPGroup:
        return CPGroup(group.group_name, dist.get_rank(group), dist.get_world_size(group))


@dataclass
class CPContext:
    """One forward's view of the CP split (in ``PackedContext.cp``): the group, the batch shape and
    the global rows of the local tokens.

    ``batch`` sequences of ``seq`` tokens each (the global length); this rank holds ``seq // size``
    of each; ``rows [batch * seq // size]`` (int64) are their rows in the flattened global stream,
    in local order."""

    group_name: str
    rank: int
    size: int
    batch: int
    seq: int
    rows: torch.Tensor

    @staticmethod
    def build(group: CPGroup, batch: int, seq: int, device: torch.device) -> CPContext:
        """The context of ``batch`` sequences of ``seq`` (global) tokens; no host sync."""
        cols = zigzag_columns(seq, group.size, group.rank, device=device)
        starts = torch.arange(batch, device=device)[:, None] * seq
        rows = (starts + cols[None, :]).reshape(-1)
        return CPContext(group.group_name, group.rank, group.size, batch, seq, rows)

    @property
    def total(self) -> int:
        """Tokens of the global stream (``batch * seq``)."""
        return self.batch * self.seq

    def row_end(self) -> torch.Tensor:
        """bool ``[local rows]``: the local tokens that are the last of their sequence."""
        return self.rows % self.seq == self.seq - 1

    def last_of_first_sequence(self, n: int) -> torch.Tensor:
        """int64: the local indices of this rank's tokens among the last ``n`` of the first
        sequence (from the host: no sync)."""
        cols = zigzag_columns(self.seq, self.size, self.rank)
        mine = torch.nonzero(cols >= self.seq - min(n, self.seq)).flatten()
        return host_to_device(mine, self.rows.device)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x [local rows, ...]`` of every CP rank, in the global row order: ``[batch * seq,
        ...]``. Differentiable: the gradient is reduce-scattered (summed) back to the owners."""
        laid = _all_gather(x.contiguous(), 0, self.group_name)
        return laid_to_global(laid, self.size, self.batch, self.seq)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the CP ranks (no gradient)."""
        return funcol.wait_tensor(funcol.all_reduce(x.detach(), "sum", self.group_name))
