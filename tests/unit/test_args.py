"""GLM52ModelArgs: config.json fields, flavors and parameter counts (analytic and on the meta
device)."""

import json

import pytest
import torch

from titan_glm52 import GLM52Model, GLM52ModelArgs, get_flavor
from titan_glm52.model.args import _CONFIG_JSON


def meta_count(args, with_mtp):
    with torch.device("meta"):
        model = GLM52Model(args, with_mtp=with_mtp)
    return sum(p.numel() for p in model.parameters())


def test_744b_counts_on_meta():
    args = get_flavor("glm52_744b")
    assert meta_count(args, False) == 743_377_000_704
    assert meta_count(args, True) == 753_329_921_024
    assert args.num_params(include_mtp=False) == 743_377_000_704
    assert args.num_params(include_mtp=True) == 753_329_921_024
    assert args.num_active_params() == 40_298_928_384
    assert args.num_active_params(include_head=False) == 39_347_345_664
    assert args.index_share.full_layers == [0, 1, 2] + list(range(6, 78, 4))


@pytest.mark.parametrize("flavor", ["glm52_proxy", "debug"])
def test_flavor_counts_match_meta(flavor):
    args = get_flavor(flavor)
    assert meta_count(args, True) == args.num_params(include_mtp=True)
    assert meta_count(args, False) == args.num_params(include_mtp=False)


def test_proxy_keeps_every_per_layer_width():
    real, proxy = get_flavor("glm52_744b"), get_flavor("glm52_proxy")
    for key in (
        "hidden_size",
        "num_attention_heads",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "intermediate_size",
        "moe_intermediate_size",
        "num_experts_per_tok",
        "n_shared_experts",
        "index_topk",
        "index_n_heads",
        "index_head_dim",
        "vocab_size",
        "rope_parameters",
    ):
        assert getattr(proxy, key) == getattr(real, key), key
    assert proxy.num_hidden_layers == 4 and proxy.n_routed_experts == 16
    assert proxy.index_share.pattern == "FFFS"
    assert proxy.num_params() == 5_635_147_264 and proxy.num_active_params() == 2_885_845_760


def test_from_hf_config_reads_every_published_key(tmp_path):
    with open(_CONFIG_JSON) as f:
        published = json.load(f)
    args = GLM52ModelArgs.from_hf_config(published)
    assert args.extra == {}  # every key has a field
    assert args.to_hf_config() == published
    (tmp_path / "config.json").write_text(json.dumps(published))
    assert GLM52ModelArgs.from_hf_config(tmp_path).to_hf_config() == published
    assert args.qk_head_dim == 256 and args.rope_theta == 8e6 and args.latent_eps == 1e-5


def test_unknown_keys_round_trip():
    cfg = get_flavor("debug").to_hf_config()
    cfg["some_future_key"] = [1, 2]
    assert GLM52ModelArgs.from_hf_config(cfg).to_hf_config()["some_future_key"] == [1, 2]


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(scoring_func="softmax"), "scoring_func"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(rope_parameters={"rope_theta": 1e4, "rope_type": "yarn"}), "rope_type"),
        (dict(num_nextn_predict_layers=2), "num_nextn_predict_layers"),
        (dict(index_topk_freq=4, index_skip_topk_offset=0), "shared layer"),
    ],
)
def test_unsupported_values_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        get_flavor("debug").replace(**change)


def test_unknown_flavor():
    with pytest.raises(ValueError, match="unknown model flavor"):
        get_flavor("glm52_7b")
