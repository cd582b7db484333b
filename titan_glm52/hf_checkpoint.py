"""Read and write HF safetensors directories with exactly the published GLM-5.2 names and shapes.

``load_hf_model(hf_dir)`` builds the model from ``config.json`` and fills every parameter and buffer
from the safetensors files (single file or sharded with ``model.safetensors.index.json``); missing
or unexpected keys and shape mismatches are errors. The published block-wise FP8 checkpoint is read
as well: its quantised weights are dequantised to the model's dtype as they are read
(``fp8_checkpoint``). ``save_hf_model(model, out_dir)`` writes ``config.json`` plus shards and an
index, in bf16 by default or in the block-wise FP8 format with ``fp8=True``;
``e_score_correction_bias`` stays fp32 as in the published checkpoint. It needs the whole model in
one process; a sharded or pipelined model is written unit by unit by
``hf_export.save_hf_distributed``.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from contextlib import ExitStack

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from titan_glm52.fp8_checkpoint import (
    BlockFp8,
    checked_slice,
    kept_modules,
    pair_scales,
    quantize_hf_tensors,
    read_format,
)
from titan_glm52.lora import adapter_scales, is_adapter_key, merge_adapters
from titan_glm52.model.args import GLM52ModelArgs
from titan_glm52.model.init import local_view
from titan_glm52.model.model import GLM52Model
from titan_glm52.model.options import ModelOptions
from titan_glm52.model.state_dict_adapter import FP32_KEYS, ExpertSlice, hf_to_ours, to_hf

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def hf_weight_files(hf_dir: str) -> dict[str, str]:
    """HF key -> file path, from the index or the single safetensors file."""
    index = os.path.join(hf_dir, INDEX_NAME)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(hf_dir, v) for k, v in weight_map.items()}
    single = os.path.join(hf_dir, SINGLE_NAME)
    if not os.path.exists(single):
        raise FileNotFoundError(f"{hf_dir} holds neither {INDEX_NAME} nor {SINGLE_NAME}")
    with safe_open(single, "pt") as f:
        return {k: single for k in f.keys()}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@torch.no_grad()
def load_hf_state(model: GLM52Model, hf_dir: str, partial: bool = False) -> None:
    """Copies an HF checkpoint into ``model`` (already materialised), reading only what each tensor
    holds.

    Sharded parameters (DTensors under FSDP / EP) read just their own rows and columns from the
    safetensors files, so every rank can load a large model without ever holding it whole.
    ``partial=True`` is for a pipeline stage: checkpoint tensors of other stages are skipped. Every
    tensor of ``model`` must be found, with the published shape. A model built without its MTP layer
    (``with_mtp=False``, ``[mtp] enable = false``) skips the checkpoint's MTP layer
    (``model.layers.<num_hidden_layers>.*``).

    A block-wise FP8 checkpoint (``quantization_config`` in ``hf_dir/config.json``, fp8 weights with
    their ``*_scale_inv``) loads the same way: each rank dequantises only the part of a weight it
    holds, with the scale blocks covering it, and the result is cast to the model's dtype
    (``fp8_checkpoint``).
    """
    args = model.args
    mtp_prefix = (
        None
        if getattr(model, "mtp", None) is not None
        else f"model.layers.{args.num_hidden_layers}."
    )
    # LoRA adapters are not part of the base checkpoint (they are initialised or resumed apart)
    targets = {k: v for k, v in model.named_parameters() if not is_adapter_key(k)}
    targets.update({k: v for k, v in model.named_buffers() if "tokens_per_expert" not in k})
    seen: dict[str, set[ExpertSlice] | bool] = {}  # per 3-D weight: the per-expert slices copied
    with _Checkpoint(hf_dir) as ckpt:
        for path, keys in ckpt.keys_by_file():
            with safe_open(path, "pt", device="cpu") as f:
                for hf_key in keys:
                    if mtp_prefix is not None and hf_key.startswith(mtp_prefix):
                        continue  # the MTP layer of a model trained without it
                    name, where = hf_to_ours(hf_key, args)
                    if name not in targets:
                        if partial:
                            continue
                        raise KeyError(
                            f"{hf_key!r} maps to {name!r}, which this model does not have "
                            "(indexer weights on a shared layer? MTP layer disabled?)"
                        )
                    _copy_slice(ckpt.slice(f, path, hf_key), hf_key, targets[name], where)
                    if where is None:
                        seen[name] = True
                    else:
                        seen.setdefault(name, set()).add(where)
    missing = [
        name
        for name, t in targets.items()
        if seen.get(name) is None
        or (
            isinstance(seen[name], set)
            and len(seen[name]) != t.shape[0] * next(iter(seen[name])).parts
        )
    ]
    if missing:
        raise KeyError(f"{len(missing)} tensors missing from {hf_dir}: {missing[:8]}")


class _Checkpoint:
    """The tensors of an HF checkpoint directory, bf16 / fp32 or block-wise FP8, as slices to read
    from.

    FP8 block scales are not tensors to load of their own: each is read with its weight (``slice``),
    whose reads it dequantises. Refuses a broken or unsupported FP8 checkpoint on entry, before
    anything is read.
    """

    def __init__(self, hf_dir: str) -> None:
        self.files = hf_weight_files(hf_dir)
        self.fmt = read_format(hf_dir)
        self.scales = pair_scales(self.files, self.fmt, hf_dir)  # weight key -> its scale's key
        self._stack = ExitStack()
        # files opened for a scale that sits apart from its weight
        self._others: dict[str, object] = {}

    def __enter__(self) -> _Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def keys_by_file(self) -> list[tuple[str, list[str]]]:
        """(file, its keys to load), in file order; the scales left out."""
        scale_keys = set(self.scales.values())
        by_file: dict[str, list[str]] = defaultdict(list)
        for key, path in self.files.items():
            if key not in scale_keys:
                by_file[path].append(key)
        return sorted(by_file.items())

    def slice(self, f, path: str, key: str):
        """Tensor ``key`` of the open file ``f`` (at ``path``) to read from: its safetensors slice,
        or for an FP8 weight a slice that dequantises what is read of it."""
        scale = self.scales.get(key)
        if scale is not None:
            scale_path = self.files[scale]
            if scale_path == path:
                scale = f.get_slice(scale)
            else:
                if scale_path not in self._others:
                    self._others[scale_path] = self._stack.enter_context(
                        safe_open(scale_path, "pt", device="cpu")
                    )
                scale = self._others[scale_path].get_slice(scale)
        return checked_slice(f.get_slice(key), key, scale, self.fmt)


def _copy_slice(src, hf_key: str, dst: torch.Tensor, where: ExpertSlice | None) -> None:
    """Copies the part of checkpoint tensor ``src`` (a safetensors slice) that ``dst``'s local shard
    holds (for one expert's tensor of a 3-D weight: its rows ``where`` says, see
    ``ExpertSlice``)."""
    local, shape, offset = local_view(dst)
    global_shape = tuple(dst.shape)
    if where is not None:
        global_shape = (dst.shape[1] // where.parts, *dst.shape[2:])
    if tuple(src.get_shape()) != global_shape:
        raise ValueError(
            f"{hf_key}: checkpoint shape {tuple(src.get_shape())} != model {global_shape}"
        )
    if where is not None:
        if not offset[0] <= where.expert < offset[0] + shape[0]:
            return  # another rank's expert
        local, shape, offset = local[where.expert - offset[0]], shape[1:], offset[1:]
        # The slice's rows within the expert, intersected with the rows this shard holds (FSDP may
        # split dim 1); the offset from here on is in the slice's own rows.
        first = where.part * global_shape[0]
        lo, hi = max(offset[0], first), min(offset[0] + shape[0], first + global_shape[0])
        if lo >= hi:
            return
        local, shape, offset = (
            local[lo - offset[0] : hi - offset[0]],
            (hi - lo, *shape[1:]),
            (lo - first, *offset[1:]),
        )
    if local.numel() == 0:
        return
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    local.copy_(src[index] if index else src[:])


def load_hf_model(
    hf_dir: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    with_mtp: bool | None = None,
    options: ModelOptions | None = None,
    **arg_overrides,
) -> GLM52Model:
    """Builds a GLM52Model from ``hf_dir/config.json`` (computed as ``options`` say) and loads its
    safetensors weights.

    ``with_mtp=None`` keeps the MTP layer when the config has one and the checkpoint holds it.
    """
    args = GLM52ModelArgs.from_hf_config(hf_dir, **arg_overrides)
    if with_mtp is None:
        mtp_prefix = f"model.layers.{args.num_hidden_layers}."
        with_mtp = args.num_nextn_predict_layers > 0 and any(
            k.startswith(mtp_prefix) for k in hf_weight_files(hf_dir)
        )
    if not with_mtp:
        args = args.replace(num_nextn_predict_layers=0)
    with torch.device("meta"):
        model = GLM52Model(args, options, with_mtp=with_mtp)
    model.to_empty(device=device)
    model.to(dtype)
    for mod in model.modules():  # the routing bias stays fp32 whatever the dtype
        if hasattr(mod, "e_score_correction_bias"):
            mod.e_score_correction_bias.data = mod.e_score_correction_bias.data.float()
        if hasattr(mod, "tokens_per_expert"):
            mod.tokens_per_expert.data = torch.zeros_like(
                mod.tokens_per_expert, dtype=torch.float32
            )
    load_hf_state(model, hf_dir)
    return model


def hf_state_dict(model: GLM52Model, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's weights under published HF names (per-expert tensors, fp32 routing bias)."""
    return to_hf_tensors(model.state_dict(), model.args, dtype)


def to_hf_tensors(
    state: dict[str, torch.Tensor], args: GLM52ModelArgs, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Our (full, unsharded or DTensor) state dict -> contiguous CPU tensors under published HF
    names."""
    state = {k: v for k, v in state.items() if "tokens_per_expert" not in k}
    out = {}
    for hf_key, t in to_hf(state, args):
        t = _full(t).detach()
        if FP32_KEYS.match(hf_key):
            t = t.float()
        elif dtype is not None:
            t = t.to(dtype)
        out[hf_key] = t.contiguous().cpu()
    return out


def save_hf_model(
    model: GLM52Model,
    out_dir: str,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 5 * 1024**3,
    fp8: bool = False,
) -> None:
    """Writes ``config.json`` and safetensors (sharded with an index when over ``max_shard_bytes``).

    ``fp8=True`` writes the published block-wise FP8 format: the linear weights of attention, MLP
    and experts in e4m3 with 128 x 128 block scales (quantised from their ``dtype`` values), the
    rest in ``dtype``.
    """
    args = model.args
    if model.mtp is None and args.num_nextn_predict_layers:
        args = args.replace(num_nextn_predict_layers=0)
    state = merge_adapters(model.state_dict(), adapter_scales(model))
    save_hf_state(state, args, out_dir, dtype, max_shard_bytes, fp8)


def save_hf_state(
    state: dict[str, torch.Tensor],
    args: GLM52ModelArgs,
    out_dir: str,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 5 * 1024**3,
    fp8: bool = False,
) -> None:
    """``save_hf_model`` for a state dict under our names (e.g. gathered from a sharded model)."""
    os.makedirs(out_dir, exist_ok=True)
    tensors = to_hf_tensors(state, args, dtype)
    fmt = BlockFp8() if fp8 else None
    if fmt is not None:
        tensors = quantize_hf_tensors(tensors, fmt)
    write_hf_config(args, out_dir, dtype, fmt and fmt.config(kept_modules(tensors)))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, SINGLE_NAME), metadata=metadata)
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        name = shard_file_name(i - 1, len(shards))
        save_file(shard, os.path.join(out_dir, name), metadata=metadata)
        for key, t in shard.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
    write_hf_index(out_dir, weight_map, total)


def shard_file_name(i: int, n: int) -> str:
    """The name of file ``i`` (0-based) of ``n``: ``model-0000{i+1}-of-0000{n}.safetensors``."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_hf_config(
    args: GLM52ModelArgs, out_dir: str, dtype: torch.dtype, quantization_config: dict | None = None
) -> None:
    """``config.json`` of ``args`` with ``dtype`` = the export dtype and the written files' own
    ``quantization_config`` (none for an unquantised export, whatever format the model was loaded
    from)."""
    cfg = args.replace(dtype=str(dtype).removeprefix("torch.")).to_hf_config()
    cfg.pop("quantization_config", None)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(dict(sorted(cfg.items())), f, indent=2)
        f.write("\n")


def write_hf_index(out_dir: str, weight_map: dict[str, str], total_size: int) -> None:
    """``model.safetensors.index.json``: HF key -> file name, and the total bytes of the tensors."""
    with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2)
