"""Plain-torch losses the tests compare the fused ones against."""

import torch
import torch.nn.functional as F


def cross_entropy_sum(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Summed token cross-entropy in fp32 (callers divide by the global count of valid tokens)."""
    return F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=ignore_index, reduction="sum"
    )
