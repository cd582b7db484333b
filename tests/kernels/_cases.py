"""Small packed inputs shared by the interpreter kernel tests."""

from __future__ import annotations

import torch


def cu_seqlens(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def indices_for(lengths, topk: int, seed: int, shuffle: bool = True, empty_rows=()) -> torch.Tensor:
    """Top-k indices of a random indexer (reference), slots shuffled so -1s sit anywhere;
    ``empty_rows`` -> all -1."""
    from titan_glm52.kernels import reference as R

    g = gen(seed + 1000)
    total = sum(lengths)
    idx = R.indexer_topk(
        torch.randn(total, 2, 8, generator=g),
        torch.randn(total, 8, generator=g),
        torch.randn(total, 2, generator=g),
        cu_seqlens(lengths),
        topk,
        1.0,
    )
    if shuffle:
        idx = torch.stack([row[torch.randperm(topk, generator=g)] for row in idx])
    for r in empty_rows:
        idx[r] = -1
    return idx.contiguous()


def cos_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """1 - 2<a,b>/(|a|^2+|b|^2) (FlashMLA / TileLang similarity metric); 0 for identical tensors."""
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    den = (a * a).sum() + (b * b).sum()
    return 0.0 if den == 0 else float(1 - 2 * (a * b).sum() / den)
