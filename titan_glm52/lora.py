"""LoRA: low-rank adapters applied to a plain ``GLM52Model`` from outside, and PEFT's format.

``apply_lora(model, spec)`` runs first in the parallelize recipe (before EP, compile, AC and FSDP).
It replaces every targeted ``nn.Linear`` of the decoder layers by a ``LoRALinear`` that keeps the
same base weight ``Parameter`` under the same name (``...wq_a.weight``) and adds ``...wq_a.lora_A
.weight [r, in]`` and ``...wq_a.lora_B.weight [out, r]``: ``y = x W^T + scale * B(A(dropout(x)))``
with ``scale = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), PEFT's update. Every other parameter
is frozen (no gradient, so no optimizer state and, on GPUs, no fp32 master: frozen parameters are
cast to the compute dtype, ``LoRASpec.base_dtype``). Names never change afterwards, so DCP
checkpoints of the adapters, the optimizer state and resumes work under any parallel layout.

Targets are named as in PEFT, by the HF module names (``TARGETS``): the attention projections and
the dense and shared-expert MLPs. The attention uses ``kv_b_proj``'s weight directly (the absorbed
MLA form folds the key up-projection into the queries and applies the value up-projection to the
latent output), so ``LoRALinear.effective_weight`` gives it ``W + scale * B @ A``; that is the
same map as the module call, which the dense-prefix rows use. What cannot be adapted here, or not
saved in PEFT's format for transformers' ``GlmMoeDsaForCausalLM``, is refused (``REFUSED``). The
MTP layer gets no adapters (transformers builds no MTP layer, so PEFT could not load them) and
stays frozen; the MTP loss still trains the decoder layers' adapters through the hidden states.

``save_adapter`` writes ``adapter_config.json`` and ``adapter_model.safetensors`` with PEFT's keys
(``base_model.model.model.layers.{i}.self_attn.q_a_proj.lora_A.weight``), gathered from sharded and
pipelined models. ``merge_adapters`` folds the adapters into the base weights for a full HF export.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from titan_glm52.model.args import GLM52ModelArgs
from titan_glm52.model.init import local_view
from titan_glm52.model.state_dict_adapter import to_hf

# HF module name (PEFT's ``target_modules``) -> our modules relative to a decoder block.
TARGETS = {
    "q_a_proj": ("attention.wq_a",),
    "q_b_proj": ("attention.wq_b",),
    "kv_a_proj_with_mqa": ("attention.wkv_a",),
    "kv_b_proj": ("attention.wkv_b",),
    "o_proj": ("attention.wo",),
    "gate_proj": ("feed_forward.w1", "moe.shared_experts.w1"),
    "up_proj": ("feed_forward.w3", "moe.shared_experts.w3"),
    "down_proj": ("feed_forward.w2", "moe.shared_experts.w2"),
}
ATTENTION_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")

_EXPERTS_WHY = (
    "the routed experts are 3-D weights (PEFT 0.21 adapts them as target_parameters "
    "mlp.experts.gate_up_proj / down_proj, lora_A [r * E, in], lora_B [out, r * E]); adapters on "
    "them are not implemented: adapt the shared expert (gate_proj, up_proj, down_proj) instead"
)
_INDEXER_WHY = (
    "the DSA indexer sees detached inputs and learns only from its KL loss, so the LM loss never "
    "reaches an adapter there; it stays frozen with the base model"
)
# Names a user may try, and why they are refused.
REFUSED = {
    "experts": _EXPERTS_WHY,
    "gate_up_proj": _EXPERTS_WHY,
    "wq_b": _INDEXER_WHY,
    "wk": _INDEXER_WHY,
    "weights_proj": _INDEXER_WHY,
    "indexer": _INDEXER_WHY,
    "gate": "the MoE router (mlp.gate) is an fp32 parameter read directly by the routing, whose "
    "choice is discrete; it stays frozen",
    "lm_head": "the fused loss reads lm_head's weight directly (model/head.py); it stays frozen",
    "embed_tokens": "the embedding is not a linear layer; it stays frozen",
    "eh_proj": "the MTP layer's projection: transformers builds no MTP layer, so PEFT could not "
    "load an adapter there",
    "all-linear": f"name the targets: {', '.join(TARGETS)}",
}


def target_refusal(name: str) -> str | None:
    """Why ``name`` cannot be a LoRA target (one line), or None where it can."""
    if name in TARGETS:
        return None
    if name in REFUSED:
        return f"{name!r}: {REFUSED[name]}"
    return f"{name!r} is not a module of GLM-5.2; choose from {', '.join(TARGETS)}"


@dataclass(frozen=True)
class LoRASpec:
    """What ``apply_lora`` adapts and how (the ``[lora]`` section); ``base_dtype`` is the dtype the
    frozen parameters are kept in (the compute dtype: bf16 on GPUs, fp32 on CPU)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ATTENTION_TARGETS
    use_rslora: bool = False
    base_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.rank < 1 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ValueError("LoRASpec: rank >= 1, alpha > 0 and 0 <= dropout < 1")
        for name in self.target_modules:
            if (why := target_refusal(name)) is not None:
                raise ValueError(f"LoRASpec.target_modules: {why}")

    @property
    def scale(self) -> float:
        """PEFT's scaling of ``B @ A``: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


class LoRALinear(nn.Module):
    """A bias-free linear layer with a LoRA adapter: ``x W^T + scale * B(A(dropout(x)))``.

    ``weight`` is the base layer's own ``Parameter`` (same name, frozen); ``lora_A.weight [r, in]``
    and ``lora_B.weight [out, r]`` are fp32 and train. Built on the base weight's device (also
    meta); ``init_adapters_`` gives them their initial values."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, dropout: float = 0.0) -> None:
        super().__init__()
        if base.bias is not None:
            raise ValueError("LoRALinear: GLM-5.2's projections have no bias")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        device = base.weight.device
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device)
        self.scale = scale
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + self.lora_B(self.lora_A(self.dropout(x))) * self.scale

    def effective_weight(self) -> torch.Tensor:
        """``W + scale * B @ A`` ``[out, in]``: the map ``forward`` applies (without dropout), for
        code that uses the weight directly (model/attention.py's absorbed MLA)."""
        return self.weight + (self.lora_B.weight @ self.lora_A.weight) * self.scale

    def extra_repr(self) -> str:
        return (
            f"{self.in_features}, {self.out_features}, r={self.lora_A.out_features}, "
            f"scale={self.scale}"
        )


def is_adapter_key(name: str) -> bool:
    """Whether a parameter or state-dict name is a LoRA adapter's (``...lora_A.weight`` /
    ``...lora_B.weight``)."""
    return ".lora_A." in name or ".lora_B." in name


def _decoder_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    layers = getattr(model, "layers", None)
    return [] if layers is None else [(f"layers.{i}", b) for i, b in layers.items()]


def apply_lora(model: nn.Module, spec: LoRASpec) -> list[str]:
    """Adapts ``spec.target_modules`` of every decoder layer of ``model`` (a ``GLM52Model`` or a
    pipeline stage, on any device, meta included) in place and freezes everything else, cast to
    ``spec.base_dtype``. Returns the adapted modules' names. Call it before any parallelism."""
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise RuntimeError("apply_lora was already applied to this model")
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = []
    for prefix, block in _decoder_blocks(model):
        for hf_name in spec.target_modules:
            for path in TARGETS[hf_name]:
                parent_path, _, attr = path.rpartition(".")
                parent = block.get_submodule(parent_path) if _has(block, parent_path) else None
                base = getattr(parent, attr, None) if parent is not None else None
                if not isinstance(base, nn.Linear):
                    continue  # a dense layer has no shared expert, an MoE layer no feed_forward
                setattr(parent, attr, LoRALinear(base, spec.rank, spec.scale, spec.dropout))
                adapted.append(f"{prefix}.{path}")
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and not p.requires_grad and p.dtype != spec.base_dtype:
                module._parameters[name] = nn.Parameter(
                    p.detach().to(spec.base_dtype), requires_grad=False
                )
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.lora_A.weight.requires_grad_(True)
            module.lora_B.weight.requires_grad_(True)
    return adapted


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"lora/{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_adapters_(model: nn.Module, seed: int = 0) -> None:
    """PEFT's default initial adapters: ``B = 0`` (the model starts as the base model) and ``A``
    uniform in ``+-1 / sqrt(in)`` (the bound of ``kaiming_uniform_(a=sqrt(5))``), drawn from a
    stream seeded by (seed, parameter name) and sliced to what a shard holds, so every parallel
    layout starts from the same values. Valid after ``to_empty``."""
    for name, module in model.named_modules():
        if not isinstance(module, LoRALinear):
            continue
        a = module.lora_A.weight
        bound = 1.0 / math.sqrt(module.in_features)
        g = torch.Generator().manual_seed(_seed(seed, f"{name}.lora_A.weight"))
        values = (torch.rand(a.shape, generator=g, dtype=torch.float64) * 2 - 1) * bound
        local, shape, offset = local_view(a)
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
        local.copy_(values[index].to(local.dtype))
        local_view(module.lora_B.weight)[0].zero_()


def adapter_scales(model: nn.Module) -> dict[str, float]:
    """Base weight name (state-dict key) -> the scale of its adapter, for every ``LoRALinear``."""
    return {
        f"{name}.weight": m.scale for name, m in model.named_modules() if isinstance(m, LoRALinear)
    }


def merge_adapters(
    state: dict[str, torch.Tensor], scales: dict[str, float]
) -> dict[str, torch.Tensor]:
    """``state`` (full tensors under our names) with each adapted weight replaced by ``W + scale *
    B @ A`` (formed in fp32, returned in W's dtype) and the adapter entries dropped."""
    out = {k: v for k, v in state.items() if not is_adapter_key(k)}
    for key, scale in scales.items():
        if key not in out:
            continue
        prefix = key.removesuffix(".weight")
        a, b = state[f"{prefix}.lora_A.weight"].float(), state[f"{prefix}.lora_B.weight"].float()
        w = out[key]
        out[key] = (w.float() + (b @ a) * scale).to(w.dtype)
    return out


def peft_key(name: str, args: GLM52ModelArgs) -> str:
    """PEFT's key of one of our adapter parameters: ``layers.3.attention.wq_a.lora_A.weight`` ->
    ``base_model.model.model.layers.3.self_attn.q_a_proj.lora_A.weight``."""
    module, _, rest = name.partition(".lora_")
    probe = {f"{module}.weight": torch.empty(0, device="meta")}
    hf_weight = next(iter(to_hf(probe, args)))[0]
    return f"base_model.model.{hf_weight.removesuffix('.weight')}.lora_{rest}"


def adapter_config(spec: LoRASpec, base_model_name_or_path: str | None) -> dict:
    """The ``adapter_config.json`` PEFT's ``LoraConfig`` reads back for these adapters."""
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": spec.rank,
        "lora_alpha": alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(spec.target_modules),
        "bias": "none",
        "use_rslora": spec.use_rslora,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": False,
        "lora_bias": False,
        "target_parameters": None,
        "revision": None,
    }


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@torch.no_grad()
def save_adapter(
    parts: list[nn.Module],
    spec: LoRASpec,
    args: GLM52ModelArgs,
    out_dir: str,
    writer: bool = True,
    base_model_name_or_path: str | None = None,
) -> None:
    """Writes the adapters of ``parts`` (this rank's model or pipeline stages, sharded or not) in
    PEFT's format to ``out_dir``: ``adapter_config.json`` and ``adapter_model.safetensors`` (fp32).

    Collective over the default process group when there is one: every rank calls it; the ranks of
    a stage gather each adapter's full tensor together (``DTensor.full_tensor``), the stage's
    ``writer`` (its data-parallel rank 0; rank 0 must be one) keeps it, and rank 0 collects the
    writers' tensors and writes both files. Returns when they are written, on every rank."""
    tensors = {}
    for part in parts:
        for name, p in part.named_parameters():
            if not is_adapter_key(name):
                continue
            t = p.detach().float()
            t = t.full_tensor() if isinstance(t, DTensor) else t
            if writer:
                tensors[peft_key(name, args)] = t.cpu().contiguous()
            del t
    pieces = [tensors]
    distributed = dist.is_initialized()
    if distributed:
        pieces = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(tensors, pieces, dst=0)
    if not distributed or dist.get_rank() == 0:
        merged = {k: v for piece in pieces for k, v in piece.items()}
        os.makedirs(out_dir, exist_ok=True)
        save_file(merged, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
            json.dump(adapter_config(spec, base_model_name_or_path), f, indent=2)
    if distributed:
        dist.barrier()


def parameter_counts(parts: list[nn.Module]) -> dict[str, int]:
    """``{"trainable": n, "frozen": n}``: the parameters of ``parts`` (global sizes, each once)."""
    seen, counts = set(), {"trainable": 0, "frozen": 0}
    for part in parts:
        for p in part.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                counts["trainable" if p.requires_grad else "frozen"] += p.numel()
    return counts
