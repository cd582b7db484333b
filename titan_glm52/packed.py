"""Packed sequences: several documents back to back in one token stream, described by
``cu_seqlens``.

``cu_seqlens`` is int32 ``[N + 1]`` over the flattened ``T = B * S`` tokens of a batch:
``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == T``, non-decreasing; document ``i`` holds rows
``cu_seqlens[i] : cu_seqlens[i + 1]``. ``positions [B, S]`` is the same packing seen per row: each
token's position inside its document (0 where a document starts). The data loader, the model, the
kernels, the pipeline stages and the metrics all use these helpers, so they live here rather than in
any one of them.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch


def doc_starts(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[T]`` int64: the first row of each token's document."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    return torch.repeat_interleave(cu[:-1], lengths, output_size=total)


def doc_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[T]`` int64: 0-based position of each token inside its document."""
    return torch.arange(total, device=cu_seqlens.device) - doc_starts(cu_seqlens, total)


def doc_lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[N]`` int64: the length of each document."""
    return (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)


def check_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int], total: int) -> list[int]:
    """Validates ``cu_seqlens`` (a tensor, or a host sequence of ints) and returns it as a host list
    (a tensor on the GPU costs one device-to-host copy)."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(
                f"cu_seqlens must be 1-D with >= 2 entries, got shape {tuple(cu_seqlens.shape)}"
            )
        bounds = cu_seqlens.tolist()
    else:
        bounds = [operator.index(b) for b in cu_seqlens]
        if len(bounds) < 2:
            raise ValueError(f"cu_seqlens must have >= 2 entries, got {len(bounds)}")
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={total}, got {bounds[:4]}...")
    if any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError("cu_seqlens must be non-decreasing")
    return bounds


def cu_seqlens_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """int32 ``cu_seqlens`` of the flattened ``[B, S]`` stream: a document starts wherever position
    == 0 (every row starts a document)."""
    flat = positions.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    row_starts = torch.arange(0, flat.numel(), positions.shape[-1], device=flat.device)
    starts = torch.unique(torch.cat((starts, row_starts)))
    return torch.cat((starts, starts.new_tensor([flat.numel()]))).to(torch.int32)


def one_document_per_row(batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``cu_seqlens``, ``positions [B, S]``) of a batch whose every row is one document."""
    cu_seqlens = torch.arange(0, batch * seq + 1, seq, dtype=torch.int32)
    return cu_seqlens, torch.arange(seq).repeat(batch, 1)
