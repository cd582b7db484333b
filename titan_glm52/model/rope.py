"""Rotary position embedding (RoPE) for MLA and the DSA indexer.

GLM-5.2 uses the interleaved (GPT-J / DeepSeek "complex") pairing in both places: dims (2j, 2j+1)
form pair j and rotate by angle ``p * theta ** (-2j / d)``. ``interleave=False`` selects the NeoX
half-split pairing (dims j and j + d/2), which some configs of other models use. The output keeps
the input layout.
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions: torch.Tensor, dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos``/``sin`` of shape ``[*positions.shape, dim // 2]``."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)
    )
    angles = positions.to(torch.float32)[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = True
) -> torch.Tensor:
    """Rotates ``x [T, ..., d]`` by per-token ``cos``/``sin [T, d // 2]`` (computed in fp32,
    returned in x's dtype).

    One complex multiply per pair, ``(x0 + i x1)(cos + i sin)``: the same products and sums as the
    real form, in one elementwise pass instead of six (plus the casts)."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    rot = torch.complex(cos, sin).view(shape)
    xf = x.float().contiguous()
    if interleave:
        out = torch.view_as_real(torch.view_as_complex(xf.unflatten(-1, (-1, 2))) * rot).flatten(-2)
    else:
        x0, x1 = xf.chunk(2, dim=-1)
        r = torch.complex(x0, x1) * rot
        out = torch.cat((r.real, r.imag), dim=-1)
    return out.to(x.dtype)
