"""Published HF checkpoint names <-> this project's module names.

HF (``zai-org/GLM-5.2``) keeps one tensor per expert (``mlp.experts.{e}.gate_proj.weight``) and
stores the MTP layer as ``model.layers.{num_hidden_layers}`` with
``enorm``/``hnorm``/``eh_proj``/``shared_head.norm``; we keep 3-D expert weights, gate and up
stacked (``moe.experts.w13 [E, 2F, D]``: ``gate_proj`` in rows ``:F``, ``up_proj`` in rows ``F:``;
``moe.experts.w2 [E, D, F]``), and the MTP layer under ``mtp``. Indexer weights exist only on full
layers and the MTP layer, exactly as in the checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from titan_glm52.model.args import GLM52ModelArgs

# Per-layer names: ours (relative to a Block) -> HF (relative to model.layers.{i}).
_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.indexer.wq_b.weight": "self_attn.indexer.wq_b.weight",
    "attention.indexer.wk.weight": "self_attn.indexer.wk.weight",
    "attention.indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "attention.indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "attention.indexer.weights_proj.weight": "self_attn.indexer.weights_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "moe.router.weight": "mlp.gate.weight",
    "moe.router.e_score_correction_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
# Ours -> the HF projections it stacks along dim 1 (equal parts, in this order).
_EXPERTS = {"moe.experts.w13": ("gate_proj", "up_proj"), "moe.experts.w2": ("down_proj",)}
_MTP_OWN = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
_GLOBAL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_REV = {v: k for k, v in _LAYER.items()}
_EXPERT_REV = {hf: (k, part) for k, hfs in _EXPERTS.items() for part, hf in enumerate(hfs)}
_MTP_REV = {v: k for k, v in _MTP_OWN.items()}
_GLOBAL_REV = {v: k for k, v in _GLOBAL.items()}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")

# fp32 in the published checkpoint whatever the export dtype.
FP32_KEYS = re.compile(r".*mlp\.gate\.e_score_correction_bias$")


def _split_block_key(key: str) -> tuple[str, str] | None:
    """Ours -> (HF prefix, remainder) for keys living in a decoder block (backbone or MTP)."""
    m = re.match(r"layers\.(\d+)\.(.+)", key)
    if m:
        return f"model.layers.{m.group(1)}.", m.group(2)
    return None


def to_hf(
    state: dict[str, torch.Tensor], args: GLM52ModelArgs
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(hf_name, tensor)`` for our state dict (3-D experts become per-expert tensors)."""
    mtp_prefix = f"model.layers.{args.num_hidden_layers}."
    for key, t in state.items():
        if key in _GLOBAL:
            yield _GLOBAL[key], t
            continue
        if key.startswith("mtp."):
            rest = key[len("mtp.") :]
            if rest in _MTP_OWN:
                yield mtp_prefix + _MTP_OWN[rest], t
                continue
            prefix, rest = mtp_prefix, rest[len("block.") :]
        else:
            split = _split_block_key(key)
            if split is None:
                raise KeyError(f"no HF name for {key!r}")
            prefix, rest = split
        if rest in _EXPERTS:
            parts = _EXPERTS[rest]
            rows = t.shape[1] // len(parts)
            for e in range(t.shape[0]):
                for part, hf in enumerate(parts):
                    yield (
                        f"{prefix}mlp.experts.{e}.{hf}.weight",
                        t[e, part * rows : (part + 1) * rows],
                    )
        elif rest in _LAYER:
            yield prefix + _LAYER[rest], t
        else:
            raise KeyError(f"no HF name for {key!r}")


@dataclass(frozen=True)
class ExpertSlice:
    """Where a per-expert HF tensor lies in our 3-D weight: ``weight[expert, part * rows:(part + 1)
    * rows]`` with ``rows = weight.shape[1] // parts``."""

    expert: int
    part: int = 0
    parts: int = 1


def hf_to_ours(hf_key: str, args: GLM52ModelArgs) -> tuple[str, ExpertSlice | None]:
    """Our name for an HF key, and where in it the HF tensor lies when it is one expert's slice of a
    3-D weight."""
    if hf_key in _GLOBAL_REV:
        return _GLOBAL_REV[hf_key], None
    m = _HF_LAYER.fullmatch(hf_key)
    if not m:
        raise KeyError(f"unexpected key in the HF checkpoint: {hf_key!r}")
    layer, rest = int(m.group(1)), m.group(2)
    if layer > args.num_hidden_layers or (
        layer == args.num_hidden_layers and not args.num_nextn_predict_layers
    ):
        raise KeyError(
            f"{hf_key!r}: layer {layer} does not exist for "
            f"num_hidden_layers={args.num_hidden_layers} "
            f"and num_nextn_predict_layers={args.num_nextn_predict_layers}"
        )
    if layer == args.num_hidden_layers:
        if rest in _MTP_REV:
            return "mtp." + _MTP_REV[rest], None
        prefix = "mtp.block."
    else:
        prefix = f"layers.{layer}."
    em = _HF_EXPERT.fullmatch(rest)
    if em:
        name, part = _EXPERT_REV[em.group(2)]
        return prefix + name, ExpertSlice(int(em.group(1)), part, len(_EXPERTS[name]))
    if rest in _LAYER_REV:
        return prefix + _LAYER_REV[rest], None
    raise KeyError(f"unexpected key in the HF checkpoint: {hf_key!r}")
