"""Random initialisation that does not depend on how the model is parallelised.

Every parameter is drawn from its own random streams, seeded by (seed, parameter name, block of
rows), and a sharded parameter (a DTensor under FSDP/EP) draws only the row blocks it holds. A model
split into pipeline stages, sharded over any number of ranks, or kept whole therefore starts from
the same weights: runs on different layouts can be compared step for step, and no two shards repeat
each other's values.

Rules (by parameter name): RMSNorm and LayerNorm weights 1, the indexer ``k_norm.bias`` 0, every
other weight ``normal(0, std)``; buffers (routing bias, load counts) 0.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

_BLOCK_ELEMS = 1 << 20  # about a million values per random stream


def _is_one(name: str) -> bool:
    return name.endswith("norm.weight")


def _is_zero(name: str) -> bool:
    return name.endswith(".bias")


def _seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def local_view(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, its shape, its offset in the global tensor)."""
    if hasattr(param, "to_local"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = param.to_local()
        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
        return local, tuple(shape), tuple(offset)
    return param, tuple(param.shape), (0,) * param.dim()


@torch.no_grad()
def _normal_(name: str, param: torch.Tensor, std: float, seed: int) -> None:
    local, shape, offset = local_view(param)
    if local.numel() == 0:
        return
    if param.dim() == 0:
        g = torch.Generator(device=local.device).manual_seed(_seed(seed, name, 0))
        local.copy_(torch.normal(0.0, std, (), generator=g, device=local.device))
        return
    rows = param.shape[0]
    row_elems = max(param.numel() // max(rows, 1), 1)
    per_block = max(_BLOCK_ELEMS // row_elems, 1)
    lo, hi = offset[0], offset[0] + shape[0]
    pieces = []
    for block in range(lo // per_block, (hi - 1) // per_block + 1):
        b_lo, b_hi = block * per_block, min((block + 1) * per_block, rows)
        g = torch.Generator(device=local.device).manual_seed(_seed(seed, name, block))
        values = torch.normal(
            0.0,
            std,
            (b_hi - b_lo, *param.shape[1:]),
            generator=g,
            device=local.device,
            dtype=torch.float32,
        )
        pieces.append(values[max(lo - b_lo, 0) : hi - b_lo])
    full_rows = torch.cat(pieces)
    index = tuple(slice(o, o + s) for o, s in zip(offset[1:], shape[1:]))
    local.copy_(full_rows[(slice(None), *index)].to(local.dtype))


@torch.no_grad()
def init_weights_(module: nn.Module, std: float, seed: int = 0) -> None:
    """Initialises every parameter and buffer of ``module`` in place (see the module docstring)."""
    for name, param in module.named_parameters():
        if _is_one(name):
            param.fill_(1.0)
        elif _is_zero(name):
            param.zero_()
        else:
            _normal_(name, param, std, seed)
    for _, buf in module.named_buffers():
        buf.zero_()
