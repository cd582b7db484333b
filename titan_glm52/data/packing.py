"""Packing: token pieces -> one training row with document boundaries, and rows -> a batch.

A row is cut from the token stream (each document's ids followed by eos, documents back to back) as
exactly ``seq_len + 1`` tokens ``t``: ``input_ids = t[:-1]``, ``labels = t[1:]``. Consecutive rows
do not overlap, so the last token of a row is only a label. The row arrives as *pieces*: the parts
of the documents it holds, in order (the first may be the tail of a document begun in the previous
row, the last may be cut by the row's end).

Promises of a row (``S = seq_len``):

* ``cu_seqlens`` (int32) lists the start of every piece that has at least one input token, then
  ``S``: it starts at 0, is strictly increasing and ends at ``S``. A document cut at a row edge
  continues in the next row as a new document (its positions restart at 0; attention does not reach
  back into the previous row, which the model cannot see anyway).
* ``positions[i]`` is ``i`` minus the start of the piece holding input ``i``: 0 at every boundary.
* ``labels[i] = t[i + 1]``, except ``IGNORE_INDEX`` (-100) where input ``i`` is the last token of a
  piece and ``t[i + 1]`` belongs to the next piece. A piece ends inside a row only where its
  document ends, so these are exactly the positions whose input is a document's eos: predicting the
  next document's first token from another document is a cross-document prediction and gets no loss.
  The token before an eos does get the eos as its label (the model learns to end documents).

Chat rows (``chat_loader``) pass ``targets`` too: one boolean per token saying whether the token is
trained (an assistant's token, say). Then ``labels[i]`` is also ``IGNORE_INDEX`` wherever ``t[i +
1]`` is not a target; everything above still holds. A row of padding is one more piece whose targets
are all False.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

IGNORE_INDEX = -100


def pack_row(
    pieces: Sequence[Sequence[int]], seq_len: int, targets: Sequence[Sequence[bool]] | None = None
) -> dict[str, torch.Tensor]:
    """One row from pieces whose lengths sum to ``seq_len + 1`` (see the module docstring).

    ``targets`` (optional): per piece, one bool per token; a token that is not a target is no label.
    Returns ``input_ids``, ``labels``, ``positions`` (int64 ``[seq_len]``) and ``cu_seqlens``
    (int32).
    """
    lengths = np.array([len(p) for p in pieces], dtype=np.int64)
    if lengths.sum() != seq_len + 1 or (lengths == 0).any():
        raise ValueError(
            f"pieces must be non-empty and hold seq_len + 1 = {seq_len + 1} tokens, "
            f"got lengths {lengths.tolist()}"
        )
    tokens = np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    ends = starts + lengths  # exclusive, in [1, seq_len + 1]

    labels = tokens[1:].copy()
    if targets is not None:
        if [len(m) for m in targets] != lengths.tolist():
            raise ValueError(
                f"targets must hold one bool per token of each piece, got lengths "
                f"{[len(m) for m in targets]} for pieces of {lengths.tolist()}"
            )
        trained = np.concatenate([np.asarray(m, dtype=bool) for m in targets])
        labels[~trained[1:]] = IGNORE_INDEX
    labels[ends[ends <= seq_len] - 1] = IGNORE_INDEX  # the next token is another piece's
    positions = np.arange(seq_len + 1) - np.repeat(starts, lengths)
    cu_seqlens = np.append(starts[starts < seq_len], seq_len)
    return {
        "input_ids": torch.from_numpy(tokens[:-1]),
        "labels": torch.from_numpy(labels),
        "positions": torch.from_numpy(positions[:-1]),
        "cu_seqlens": torch.from_numpy(cu_seqlens.astype(np.int32)),
    }


def collate(rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack rows of equal length ``S`` into a batch.

    ``input_ids``, ``labels``, ``positions``: int64 ``[B, S]``. ``cu_seqlens``: int32 over the
    flattened ``B * S`` stream (row ``b``'s boundaries shifted by ``b * S``; every row start is a
    boundary), from 0 to ``B * S``.
    """
    seq_len = rows[0]["input_ids"].numel()
    cu = [row["cu_seqlens"][:-1] + b * seq_len for b, row in enumerate(rows)]
    cu.append(torch.tensor([len(rows) * seq_len], dtype=torch.int32))
    return {
        "input_ids": torch.stack([r["input_ids"] for r in rows]),
        "labels": torch.stack([r["labels"] for r in rows]),
        "positions": torch.stack([r["positions"] for r in rows]),
        "cu_seqlens": torch.cat(cu).to(torch.int32),
    }
