"""HF export of a sharded (FSDP / HSDP / EP) and pipelined model, one unit at a time, one file per
unit.

Units, in file order: the token embedding, each decoder layer, the MTP layer (when exported), the
final norm with the output head. Their number ``N`` follows from the model args, so unit ``u`` is
written to ``model-{u+1:05d}-of-{N:05d}.safetensors`` by whichever rank holds it, without asking
anyone.

For each unit, every rank of the unit's pipeline stage materialises the unit's full tensors together
(``DTensor.full_tensor`` is a collective over the FSDP / EP meshes; all ranks of a stage walk the
same units and tensors in the same order, and the stages' meshes are disjoint), each tensor cast to
the export dtype before the gather. Routed experts come out whole: the gather runs over the
expert-FSDP and EP dims. The stage's writer (data-parallel rank 0 of the stage) moves each tensor to
the host, renames the unit with the state-dict adapter (``to_hf_tensors``) and writes its file; the
other ranks drop each tensor at once. Rank 0 then gathers the small key -> file maps and writes
``model.safetensors.index.json`` and ``config.json`` as ``save_hf_state`` does.

LoRA adapters found in the parts (``lora.LoRALinear``) are merged into their base weights, ``W +
scale * B @ A`` in fp32, before the weights are cast to the export dtype: the export is the
fine-tuned model.

With ``fp8=True`` each unit's attention, MLP and expert linear weights are written in the published
block-wise FP8 format (``fp8_checkpoint.quantize_hf_tensors``) by its writer, after the gather, and
``config.json`` carries the matching ``quantization_config``.

Peak memory: one unit's full weights in the export dtype on each writer's host (a 744B MoE layer is
about 19 GB in bf16; with ``fp8=True`` plus their e4m3 copies, about 10 GB more), and one full
parameter at a time on every rank's device.
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from titan_glm52.fp8_checkpoint import BlockFp8, kept_modules, quantize_hf_tensors
from titan_glm52.hf_checkpoint import (
    shard_file_name,
    to_hf_tensors,
    write_hf_config,
    write_hf_index,
)
from titan_glm52.lora import adapter_scales, is_adapter_key, merge_adapters
from titan_glm52.model.args import GLM52ModelArgs
from titan_glm52.model.state_dict_adapter import FP32_KEYS, to_hf


def num_units(args: GLM52ModelArgs) -> int:
    """Embedding + decoder layers + MTP layer (when ``num_nextn_predict_layers``) + final norm and
    head."""
    return args.num_hidden_layers + 2 + (1 if args.num_nextn_predict_layers else 0)


def unit_of(key: str, args: GLM52ModelArgs) -> int:
    """The export unit (0-based file index) of one of our state-dict keys."""
    if key.startswith("tok_embeddings."):
        return 0
    if key.startswith("layers."):
        return 1 + int(key.split(".", 2)[1])
    if key.startswith("mtp.") and args.num_nextn_predict_layers:
        return args.num_hidden_layers + 1
    if key.startswith(("norm.", "output.")):
        return num_units(args) - 1
    raise KeyError(
        f"{key!r} belongs to no export unit (an MTP layer with num_nextn_predict_layers = 0?)"
    )


def _export_dtype(
    key: str, t: torch.Tensor, args: GLM52ModelArgs, dtype: torch.dtype
) -> torch.dtype:
    """The dtype ``key`` is written in: fp32 for ``FP32_KEYS`` (routing bias), else ``dtype``; asked
    of the adapter on a meta tensor of the same shape."""
    probe = {key: torch.empty(t.shape, device="meta")}
    return (
        torch.float32 if any(FP32_KEYS.match(hf_key) for hf_key, _ in to_hf(probe, args)) else dtype
    )


@torch.no_grad()
def save_hf_distributed(
    parts: list[nn.Module],
    args: GLM52ModelArgs,
    out_dir: str,
    dtype: torch.dtype = torch.bfloat16,
    writer: bool = True,
    fp8: bool = False,
) -> None:
    """Writes the model held by ``parts`` (this rank's model or pipeline stages, sharded or not) as
    an HF safetensors directory, streaming one unit at a time (module docstring).

    Collective over the default process group when there is one: every rank calls it with its parts,
    and ``writer`` is True on exactly one rank of each pipeline stage (its data-parallel rank 0;
    rank 0 must be one). ``args`` decide the files and ``config.json``: ``num_nextn_predict_layers``
    = 0 when the MTP layer is not exported. ``fp8=True``: the block-wise FP8 format (module
    docstring). Returns when the directory is complete, on every rank.
    """
    fmt = BlockFp8() if fp8 else None
    distributed = dist.is_initialized()
    n = num_units(args)
    sizes: dict[str, tuple[str, int]] = {}  # HF key -> (file, bytes), of the units this rank wrote
    if writer:
        os.makedirs(out_dir, exist_ok=True)
    for part in parts:
        # LoRA: adapted weights and their adapters are gathered in fp32 and merged by the writer
        scales = adapter_scales(part)
        units: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
        for key, t in part.state_dict().items():
            if "tokens_per_expert" not in key:
                units[unit_of(key, args)][key] = t
        for unit in sorted(units):
            state = {}
            for key, t in units[unit].items():
                merged = key in scales or is_adapter_key(key)
                t = t.to(torch.float32 if merged else _export_dtype(key, t, args, dtype))
                t = t.full_tensor() if isinstance(t, DTensor) else t
                if writer:
                    state[key] = t.cpu()
                del t  # a non-writer holds no full tensor past its gather
            if writer:
                name = shard_file_name(unit, n)
                tensors = to_hf_tensors(merge_adapters(state, scales), args, dtype)
                if fmt is not None:
                    tensors = quantize_hf_tensors(tensors, fmt)
                save_file(tensors, os.path.join(out_dir, name), metadata={"format": "pt"})
                sizes.update({k: (name, v.numel() * v.element_size()) for k, v in tensors.items()})
                del state, tensors  # the unit is on disk: free it before the next unit's gather
    pieces = [sizes]
    if distributed:
        pieces = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(sizes, pieces, dst=0)
    if not distributed or dist.get_rank() == 0:
        _write_index_and_config(pieces, args, out_dir, dtype, fmt)
    if distributed:
        dist.barrier()


def _write_index_and_config(
    pieces: list[dict[str, tuple[str, int]]],
    args: GLM52ModelArgs,
    out_dir: str,
    dtype: torch.dtype,
    fmt: BlockFp8 | None,
) -> None:
    merged = {k: v for piece in pieces for k, v in piece.items()}
    expected = {shard_file_name(u, num_units(args)) for u in range(num_units(args))}
    missing = sorted(expected - {name for name, _ in merged.values()})
    if missing:
        raise RuntimeError(
            f"HF export to {out_dir}: no rank wrote {missing} (is every pipeline stage's writer "
            "set, "
            "and does num_nextn_predict_layers match the MTP layer?)"
        )
    write_hf_index(
        out_dir, {k: merged[k][0] for k in sorted(merged)}, sum(size for _, size in merged.values())
    )
    write_hf_config(args, out_dir, dtype, fmt and fmt.config(kept_modules(merged)))
