"""HF checkpoint round trips: names, shapes and values survive transformers -> ours -> transformers,
and our own save/load keeps the MTP layer (which transformers drops)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from titan_glm52 import GLM52Model, get_flavor, load_hf_model, save_hf_model
from titan_glm52.hf_checkpoint import hf_state_dict, hf_weight_files
from tests.parity.test_hf_parity import PATTERNS, randomise, tiny_hf_config

transformers = pytest.importorskip("transformers")


def read_all(hf_dir: str) -> dict[str, torch.Tensor]:
    out = {}
    for key, path in hf_weight_files(hf_dir).items():
        with safe_open(path, "pt") as f:
            out[key] = f.get_tensor(key)
    return out


@pytest.mark.parametrize("shard_bytes", [None, 40_000])  # single file, and sharded with an index
def test_transformers_ours_transformers(tmp_path, shard_bytes):
    from transformers import GlmMoeDsaForCausalLM

    torch.manual_seed(0)
    hf = GlmMoeDsaForCausalLM(tiny_hf_config(PATTERNS["freq4_offset3"])).float()
    randomise(hf, 0)
    hf.save_pretrained(tmp_path / "a")
    ours = load_hf_model(str(tmp_path / "a"), dtype=torch.float32)
    kwargs = {} if shard_bytes is None else {"max_shard_bytes": shard_bytes}
    save_hf_model(ours, str(tmp_path / "b"), dtype=torch.float32, **kwargs)
    assert os.path.exists(
        tmp_path / "b" / ("model.safetensors.index.json" if shard_bytes else "model.safetensors")
    )
    a, b = read_all(str(tmp_path / "a")), read_all(str(tmp_path / "b"))
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    back = GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.float32)
    ref = hf.state_dict()
    for key, t in back.state_dict().items():
        assert torch.equal(t, ref[key]), key


def test_mtp_layer_survives_our_round_trip(tmp_path):
    args = get_flavor("debug")
    torch.manual_seed(1)
    model = GLM52Model(args)
    model.init_weights()
    randomise(model, 1)
    save_hf_model(model, str(tmp_path), dtype=torch.bfloat16)
    keys = set(hf_weight_files(str(tmp_path)))
    mtp = f"model.layers.{args.num_hidden_layers}."
    assert {
        mtp + k
        for k in (
            "enorm.weight",
            "hnorm.weight",
            "eh_proj.weight",
            "shared_head.norm.weight",
            "self_attn.indexer.wk.weight",
            "mlp.experts.0.gate_proj.weight",
        )
    } <= keys
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert (
            f.get_tensor("model.layers.3.mlp.gate.e_score_correction_bias").dtype == torch.float32
        )
        assert f.get_tensor("model.layers.3.mlp.gate.weight").dtype == torch.bfloat16
    back = load_hf_model(str(tmp_path), dtype=torch.float32)
    assert back.mtp is not None
    for key, t in hf_state_dict(model, torch.bfloat16).items():
        assert torch.equal(hf_state_dict(back, torch.bfloat16)[key], t), key
    tokens = torch.randint(0, args.vocab_size, (2, 24))
    with torch.no_grad():
        model_bf16 = load_hf_model(str(tmp_path), dtype=torch.float32)
        torch.testing.assert_close(
            model_bf16(tokens, with_mtp=True)[1], back(tokens, with_mtp=True)[1]
        )
    # Training without MTP from a checkpoint that has it: the MTP layer is skipped, everything else
    # loads.
    no_mtp = load_hf_model(str(tmp_path), dtype=torch.float32, with_mtp=False)
    assert no_mtp.mtp is None
    with torch.no_grad():
        torch.testing.assert_close(no_mtp(tokens), back(tokens, with_mtp=True)[0], rtol=0, atol=0)


def test_published_names_and_shapes_on_meta():
    """The 744B flavor's HF names and shapes are exactly the published checkpoint's (section 4 of
    the model doc)."""
    args = get_flavor("glm52_744b")
    with torch.device("meta"):
        model = GLM52Model(args)
    from titan_glm52.model.state_dict_adapter import to_hf

    shapes = {
        k: tuple(t.shape)
        for k, t in to_hf(
            {k: v for k, v in model.state_dict().items() if "tokens_per_expert" not in k}, args
        )
    }
    assert shapes["model.embed_tokens.weight"] == (154880, 6144)
    assert shapes["lm_head.weight"] == (154880, 6144)
    assert shapes["model.layers.0.self_attn.q_b_proj.weight"] == (16384, 2048)
    assert shapes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (576, 6144)
    assert shapes["model.layers.0.self_attn.kv_b_proj.weight"] == (28672, 512)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (6144, 16384)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (12288, 6144)
    assert shapes["model.layers.3.mlp.gate.weight"] == (256, 6144)
    assert shapes["model.layers.3.mlp.gate.e_score_correction_bias"] == (256,)
    assert shapes["model.layers.77.mlp.experts.255.down_proj.weight"] == (6144, 2048)
    assert shapes["model.layers.78.eh_proj.weight"] == (6144, 12288)
    assert shapes["model.layers.78.shared_head.norm.weight"] == (6144,)
    indexer_layers = sorted({int(k.split(".")[2]) for k in shapes if ".indexer.wk." in k})
    assert indexer_layers == args.index_share.full_layers + [78]
    assert shapes["model.layers.74.self_attn.indexer.wq_b.weight"] == (4096, 2048)
    assert shapes["model.layers.74.self_attn.indexer.weights_proj.weight"] == (32, 6144)
    assert "model.layers.75.self_attn.indexer.wk.weight" not in shapes
    assert not any(
        "embed_tokens" in k or "shared_head.head" in k
        for k in shapes
        if k.startswith("model.layers.")
    )
    # 3 global + 78 x 9 (attention, norms) + 21 x 5 (indexers) + 3 x 3 (dense MLP) + 75 x (256 x 3 +
    # 3 + 2) (MoE).
    backbone = [k for k in shapes if not k.startswith("model.layers.78.")]
    assert len(backbone) == 3 + 78 * 9 + 21 * 5 + 3 * 3 + 75 * 773
    bias = sum(1 for k in shapes if k.endswith("e_score_correction_bias"))
    assert bias == 76  # 75 MoE layers + MTP
    total = sum(int(torch.tensor(s).prod()) if s else 1 for s in shapes.values())
    assert total - bias * 256 == 753_329_921_024


def test_config_json_round_trip(tmp_path):
    path = os.path.join(os.path.dirname(__file__), "..", "..", "titan_glm52", "glm52_config.json")
    with open(path) as f:
        published = json.load(f)
    args = get_flavor("glm52_744b")
    assert args.to_hf_config() == published
