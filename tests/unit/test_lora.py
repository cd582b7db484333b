"""LoRA on one process (titan_glm52/lora.py): names, freezing, every weight use of a target,
training that moves only the adapters, the merge, the memory it saves, the config's refusals."""

from __future__ import annotations

import copy

import pytest
import torch

from titan_glm52.config import ConfigError, JobConfig, validate
from titan_glm52.lora import (
    ATTENTION_TARGETS,
    TARGETS,
    LoRALinear,
    LoRASpec,
    adapter_scales,
    apply_lora,
    init_adapters_,
    is_adapter_key,
    merge_adapters,
    parameter_counts,
)
from titan_glm52.master_weights import MasterWeights
from titan_glm52.model.args import get_flavor
from titan_glm52.model.model import GLM52Model
from titan_glm52.model.options import ModelOptions
from titan_glm52.parallelize import parallelize_model

ALL = tuple(TARGETS)


def debug_model(seed: int = 0) -> GLM52Model:
    torch.manual_seed(seed)
    model = GLM52Model(get_flavor("debug").replace(index_topk=8))
    model.init_weights()
    return model


def randomise_adapters(model, seed: int = 1, std: float = 0.05) -> None:
    """Non-zero B (and A), so that every adapter changes the model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter_key(name):
                p.copy_(std * torch.randn(p.shape, generator=g))


def tokens(vocab: int, batch: int = 2, seq: int = 32) -> torch.Tensor:
    return torch.randint(1, vocab, (batch, seq), generator=torch.Generator().manual_seed(3))


def test_names_freezing_and_the_start_as_the_base_model():
    base = debug_model()
    model = copy.deepcopy(base)
    adapted = apply_lora(model, LoRASpec(rank=4, alpha=8, target_modules=ALL))
    init_adapters_(model)
    names = dict(model.named_parameters())
    # the base names are unchanged; each adapted projection adds lora_A / lora_B
    assert {n for n in names if not is_adapter_key(n)} == {n for n, _ in base.named_parameters()}
    assert {n for n in names if is_adapter_key(n)} == {
        f"{m}.{ab}.weight" for m in adapted for ab in ("lora_A", "lora_B")
    }
    # the dense layers' MLP, the MoE layers' shared expert and every attention, but no MTP layer
    assert "layers.0.feed_forward.w1" in adapted and "layers.3.moe.shared_experts.w2" in adapted
    assert "layers.0.attention.wkv_b" in adapted and not any(m.startswith("mtp.") for m in adapted)
    assert all(p.requires_grad == is_adapter_key(n) for n, p in names.items())
    a, b = (
        names["layers.0.attention.wq_a.lora_A.weight"],
        names["layers.0.attention.wq_a.lora_B.weight"],
    )
    assert a.shape == (4, 64) and b.shape == (48, 4) and torch.all(b == 0) and a.abs().max() > 0
    assert a.abs().max() <= 64**-0.5
    with torch.no_grad():  # B = 0: exactly the base model
        assert torch.equal(model(tokens(2048)), base(tokens(2048)))


@pytest.mark.parametrize(
    "targets", [ATTENTION_TARGETS, ("kv_b_proj",), ("gate_proj", "up_proj", "down_proj")]
)
@pytest.mark.parametrize("dense_prefix", [True, False])
def test_adapted_model_is_the_base_model_with_merged_weights(targets, dense_prefix):
    """Every use of a target's weight sees the adapter: the module call and kv_b_proj's weight in
    the absorbed attention (index_topk 8 < 32 tokens, so both the dense prefix rows, which call
    wkv_b, and the sparse rows, which take its weight, run)."""
    base = GLM52Model(
        get_flavor("debug").replace(index_topk=8), ModelOptions(dense_prefix=dense_prefix)
    )
    base.init_weights()
    model = copy.deepcopy(base)
    apply_lora(model, LoRASpec(rank=4, alpha=8, target_modules=targets))
    randomise_adapters(model)
    merged = copy.deepcopy(base)
    merged.load_state_dict(merge_adapters(model.state_dict(), adapter_scales(model)))
    x = tokens(2048)
    with torch.no_grad():
        got, want, plain = model(x), merged(x), base(x)
    assert (want - plain).abs().max() > 1e-3  # the adapters do change the model
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_merge_is_base_plus_scaled_product():
    model = debug_model()
    spec = LoRASpec(rank=4, alpha=6, target_modules=("kv_b_proj",), use_rslora=True)
    apply_lora(model, spec)
    randomise_adapters(model)
    state = model.state_dict()
    merged = merge_adapters(state, adapter_scales(model))
    assert not any(is_adapter_key(k) for k in merged)
    key = "layers.2.attention.wkv_b"
    a, b = state[f"{key}.lora_A.weight"], state[f"{key}.lora_B.weight"]
    assert spec.scale == 6 / 2  # rsLoRA: alpha / sqrt(r)
    torch.testing.assert_close(merged[f"{key}.weight"], state[f"{key}.weight"] + 3.0 * (b @ a))
    layer = model.layers["2"].attention.wkv_b
    assert isinstance(layer, LoRALinear)
    torch.testing.assert_close(layer.effective_weight(), merged[f"{key}.weight"])


def test_training_changes_only_the_adapters():
    """Steps of AdamW (weight decay on) through the recipe (parallelize_model without a mesh):
    every base parameter and buffer stays bitwise the same, every adapter moves, and the optimizer
    keeps state for the adapters alone."""
    model = debug_model()
    parallelize_model(model, None, lora=LoRASpec(rank=4, alpha=8, target_modules=ALL))
    init_adapters_(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1)
    x = tokens(2048, batch=2, seq=32)
    labels = torch.roll(x, -1, 1)
    for _ in range(3):
        ce, mtp = model(x, with_mtp=True, labels=labels, mtp_labels=torch.roll(x, -2, 1))
        (ce + 0.3 * mtp).backward()
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        opt.step()
        opt.zero_grad()
    after = model.state_dict()
    for k, v in before.items():
        if is_adapter_key(k):
            assert not torch.equal(after[k], v), f"{k} did not train"
        else:
            assert torch.equal(after[k], v), f"base {k} changed"
    assert len(opt.state) == len(trainable)


def _training_state_bytes(model, master_bytes: int) -> int:
    """Gradient (4) + Adam moments (8) + master (``master_bytes``) per trained parameter."""
    n = parameter_counts([model])["trainable"]
    return n * (4 + 8 + master_bytes)


def test_memory_of_the_training_state():
    """The parameters that get gradients, Adam state and fp32 masters: all of them without LoRA,
    the adapters with it (the debug flavor, every supported target, r = 8). Measured on the real
    optimizer state after one step."""
    full = debug_model()
    lora = debug_model()
    apply_lora(lora, LoRASpec(rank=8, alpha=16, target_modules=ALL))
    counts = parameter_counts([lora])
    assert counts["frozen"] == sum(p.numel() for p in full.parameters())
    assert counts["trainable"] == 66_816  # 7.5% of the 885,488 base parameters
    for model in (full, lora):
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        state_bytes = sum(
            t.numel() * t.element_size()
            for s in opt.state.values()
            for k, t in s.items()
            if k != "step"
        )
        assert state_bytes == 8 * sum(p.numel() for p in params)
    assert _training_state_bytes(lora, 4) / _training_state_bytes(full, 4) < 0.08


def test_frozen_base_in_the_compute_dtype_gets_no_master():
    """On one GPU the optimizer holds the fp32 masters (master_weights.py): with LoRA only the
    adapters have one; the frozen base is kept in bf16 and used as it is."""
    model = debug_model()
    apply_lora(model, LoRASpec(rank=4, target_modules=ALL, base_dtype=torch.bfloat16))
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if is_adapter_key(name) else torch.bfloat16), name
    master = MasterWeights([model], torch.bfloat16)
    n_adapters = sum(is_adapter_key(n) for n, _ in model.named_parameters())
    assert len(master._slots) == n_adapters
    wq_a = model.layers["0"].attention.wq_a
    base_weight = wq_a.weight
    with master.computing():
        assert wq_a.weight is base_weight and wq_a.lora_A.weight.dtype == torch.bfloat16
        ce = model(tokens(2048), labels=tokens(2048))
        ce.backward()
    assert wq_a.lora_A.weight.dtype == torch.float32
    assert len(master.grads()) == n_adapters and base_weight.grad is None


def lora_config(**lora) -> JobConfig:
    cfg = JobConfig()
    cfg.lora.enable = True
    cfg.moe.bias_update_rate = 0.0
    for k, v in lora.items():
        setattr(cfg.lora, k, v)
    return cfg


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(target_modules=["gate_up_proj"]), "routed experts"),
        (dict(target_modules=["experts"]), "target_parameters"),
        (dict(target_modules=["weights_proj"]), "indexer"),
        (dict(target_modules=["lm_head"]), "fused loss"),
        (dict(target_modules=["q_proj"]), "not a module of GLM-5.2"),
        (dict(target_modules=[]), "lora.target_modules: empty"),
        (dict(rank=0), "lora.rank"),
        (dict(dropout=0.1), "absorbed MLA"),
        (dict(dropout=0.1, target_modules=["o_proj"], _ac="full"), "activation checkpointing"),
        (dict(_moe_rate=1e-3), "moe.bias_update_rate"),
        (dict(_kl=0.01), "dsa.indexer_loss_coeff"),
    ],
)
def test_refusals_name_the_key_and_the_fix(change, message):
    change = dict(change)
    ac, rate, kl = change.pop("_ac", None), change.pop("_moe_rate", None), change.pop("_kl", None)
    cfg = lora_config(**change)
    if ac:
        cfg.activation_checkpoint.mode = ac
    if rate is not None:
        cfg.moe.bias_update_rate = rate
    if kl is not None:
        cfg.dsa.indexer_loss_coeff = kl
    with pytest.raises(ConfigError, match=message) as e:
        validate(cfg)
    assert "\n" not in str(e.value)


def test_valid_lora_configs_pass():
    validate(lora_config(target_modules=list(ALL)))
    cfg = lora_config(dropout=0.1, target_modules=["q_a_proj", "o_proj", "up_proj"])
    cfg.activation_checkpoint.mode = "none"
    validate(cfg)
    validate(JobConfig())  # and without LoRA nothing of it is checked


def test_dropout_drops_the_adapter_input_in_training_only():
    layer = LoRALinear(torch.nn.Linear(16, 8, bias=False), rank=2, scale=0.5, dropout=0.5)
    torch.nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(64, 16)
    layer.eval()
    torch.testing.assert_close(layer(x), x @ layer.effective_weight().T)
    layer.train()
    torch.manual_seed(0)
    dropped = layer(x)
    base = x @ layer.weight.T
    assert not torch.allclose(dropped, x @ layer.effective_weight().T)
    assert not torch.allclose(dropped, base)
