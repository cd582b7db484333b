"""Our LoRA adapters in PEFT's format, against the installed ``peft`` on transformers'
``GlmMoeDsaForCausalLM``: the key names and shapes PEFT itself writes, ``PeftModel.from_pretrained``
giving our logits, and the merged HF export ``W + scale * B @ A`` that transformers loads.

The base is a tiny random GLM-5.2 written by transformers (as in test_hf_parity.py), with every
parameter randomised, and the adapters are random too (B != 0), so that each one changes the
logits."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

peft = pytest.importorskip("peft")
from safetensors.torch import load_file  # noqa: E402

from tests.parity.test_hf_parity import (  # noqa: E402
    PATTERNS,
    build_pair,
    capture_hf_topk,
    capture_our_topk,
    topk_sets_hf,
    topk_sets_ours,
)
from titan_glm52.hf_checkpoint import save_hf_model  # noqa: E402
from titan_glm52.lora import (  # noqa: E402
    ATTENTION_TARGETS,
    MLP_TARGETS,
    LoRASpec,
    adapter_config,
    apply_lora,
    is_adapter_key,
    save_adapter,
)

TOKENS = torch.randint(0, 97, (2, 29), generator=torch.Generator().manual_seed(11))


def randomise_adapters(model, seed: int, std: float = 0.1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter_key(name):
                p.copy_(std * torch.randn(p.shape, generator=g))


def adapted_pair(tmp_path, targets, seed: int = 0, **spec):
    """(transformers' base model, our model of the same checkpoint with random adapters, spec)."""
    hf, ours = build_pair(tmp_path / "base", PATTERNS["freq4_offset3"], seed)
    spec = LoRASpec(rank=4, alpha=8, target_modules=tuple(targets), **spec)
    apply_lora(ours, spec)
    randomise_adapters(ours, seed + 100)
    save_adapter([ours], spec, ours.args, str(tmp_path / "adapter"), base_model_name_or_path="b")
    return hf, ours, spec


def rel_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


def test_keys_and_shapes_are_those_peft_writes(tmp_path):
    hf, _, spec = adapted_pair(tmp_path, ATTENTION_TARGETS)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=list(ATTENTION_TARGETS), task_type="CAUSAL_LM"
    )
    peft.get_peft_model(hf, config).save_pretrained(tmp_path / "by_peft")
    theirs = load_file(tmp_path / "by_peft" / "adapter_model.safetensors")
    mine = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in theirs.items()}
    assert "base_model.model.model.layers.0.self_attn.kv_b_proj.lora_A.weight" in mine
    # the config reads back as the one PEFT wrote, in every field that decides the adapter
    ours_cfg = peft.LoraConfig.from_pretrained(tmp_path / "adapter")
    theirs_cfg = peft.LoraConfig.from_pretrained(tmp_path / "by_peft")
    for field in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "bias"):
        assert getattr(ours_cfg, field) == getattr(theirs_cfg, field), field
    assert set(ours_cfg.target_modules) == set(theirs_cfg.target_modules)
    assert ours_cfg.use_rslora is False and ours_cfg.base_model_name_or_path == "b"
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written == adapter_config(spec, "b")


# Seeds whose adapted models have no near-tie in an indexer's top-k: fp32 rounding may flip a
# near-tied key (seed 0: one query of layer 1 selects key 5 on one side, 11 on the other), and the
# logits then differ from that query on, as any sparse-attention comparison would.
@pytest.mark.parametrize("rslora, seed", [(False, 1), (True, 2)])
def test_peft_loads_the_adapter_onto_transformers_with_our_logits(tmp_path, rslora, seed):
    hf, ours, _ = adapted_pair(tmp_path, ATTENTION_TARGETS, seed=seed, use_rslora=rslora)
    with torch.no_grad():
        base = hf(TOKENS).logits
        model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
        hf_topk, our_topk = capture_hf_topk(hf), capture_our_topk(ours)
        got, ref = ours(TOKENS), model(TOKENS).logits
    for layer in hf_topk:  # the same keys selected everywhere
        for row, pos in itertools.product(range(2), range(TOKENS.shape[1])):
            assert topk_sets_hf(hf_topk[layer], row, pos) == topk_sets_ours(
                our_topk[layer], row, pos, TOKENS.shape[1]
            ), (layer, row, pos)
    assert rel_diff(base, ref) > 1e-2  # the adapters change the model
    assert rel_diff(got, ref) < 1e-4


def test_mlp_adapters_in_peft_format(tmp_path, monkeypatch):
    """The dense and shared-expert MLP adapters are written under PEFT's keys for those modules
    (``mlp.gate_proj``, ``mlp.shared_experts.gate_proj``); PEFT applies them and gives our logits
    once its conversion of transformers-v4 MoE names (next test) is out of the way."""
    from peft.utils import transformers_weight_conversion

    monkeypatch.setattr(
        transformers_weight_conversion, "convert_peft_config_for_transformers", lambda *a, **k: None
    )
    hf, ours, _ = adapted_pair(tmp_path, ATTENTION_TARGETS + MLP_TARGETS, seed=1)
    mine = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight" in mine
    assert "base_model.model.model.layers.3.mlp.shared_experts.down_proj.lora_B.weight" in mine
    with torch.no_grad():
        got = ours(TOKENS)
        model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
        ref = model(TOKENS).logits
    assert rel_diff(got, ref) < 1e-4


def test_installed_peft_maps_mlp_names_to_the_routed_experts(tmp_path):
    """A limitation of peft 0.21 with transformers 5 that docs/fine_tuning.md states: on
    GlmMoeDsaForCausalLM it rewrites the targets gate_proj / up_proj / down_proj to the fused
    routed experts (its v4 -> v5 MoE conversion), so ``PeftModel.from_pretrained`` leaves the dense
    and shared-expert MLPs unadapted. When this test fails, peft changed: update the docs."""
    hf, _, _ = adapted_pair(tmp_path, ATTENTION_TARGETS + MLP_TARGETS, seed=2)
    model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter")
    names = [n for n, _ in model.named_parameters()]
    assert any("self_attn.q_a_proj.lora_A" in n for n in names)
    assert not any("shared_experts.gate_proj.lora_A" in n for n in names)
    assert not any("layers.0.mlp.gate_proj.lora_A" in n for n in names)


def test_merged_export_is_base_plus_scaled_product_and_loads_in_transformers(tmp_path):
    from transformers import GlmMoeDsaForCausalLM

    hf, ours, spec = adapted_pair(tmp_path, ATTENTION_TARGETS + MLP_TARGETS, seed=3)
    save_hf_model(ours, str(tmp_path / "merged"), dtype=torch.float32)
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    base = hf.state_dict()
    exported = {}
    for path in sorted((tmp_path / "merged").glob("*.safetensors")):
        exported.update(load_file(path))
    n = 0
    for key, w in base.items():
        if not key.endswith(".weight") or key.removesuffix(".weight") + ".lora_A.weight" not in {
            k.removeprefix("base_model.model.") for k in adapter
        }:
            continue
        prefix = "base_model.model." + key.removesuffix(".weight")
        a, b = adapter[f"{prefix}.lora_A.weight"], adapter[f"{prefix}.lora_B.weight"]
        torch.testing.assert_close(exported[key], w + spec.scale * (b @ a), rtol=1e-6, atol=1e-6)
        n += 1
    assert n == 8 * 5 + 3 * 3 + 5 * 3  # attention everywhere, 3 dense MLPs, 5 shared experts
    merged = GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel_diff(ours(TOKENS), merged(TOKENS).logits) < 1e-4
