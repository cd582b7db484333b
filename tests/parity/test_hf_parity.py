"""Parity with ``transformers.GlmMoeDsaForCausalLM`` (>= 5.13) on tiny random configs where DSA is
sparse.

Every parameter is randomised (norms, ``k_norm.bias`` and ``e_score_correction_bias`` included),
index_topk is well below the sequence length, the indexer has 8 heads, the batch has 2 rows, and
several IndexShare patterns are covered. We compare fp32 logits and the top-k set of every full
layer.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from packaging.version import Version  # noqa: E402

from titan_glm52 import load_hf_model  # noqa: E402
from titan_glm52.model.options import ModelOptions  # noqa: E402
from titan_glm52.model.attention import Attention  # noqa: E402

pytestmark = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.13"),
    reason="transformers >= 5.13 has GLM-5.2's interleaved indexer RoPE",
)

PATTERNS = {
    "freq4_offset3": dict(index_topk_freq=4, index_skip_topk_offset=3),  # FFFSSSFS, GLM-5.2's rule
    "explicit_FSFSSFFS": dict(
        indexer_types=["full", "shared", "full", "shared", "shared", "full", "full", "shared"]
    ),
    "all_full": dict(index_topk_freq=1),
}


def tiny_hf_config(pattern: dict, index_topk: int = 6):
    from transformers import GlmMoeDsaConfig

    cfg = dict(
        vocab_size=97,
        hidden_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=40,
        kv_lora_rank=32,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=24,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=3,
        first_k_dense_replace=3,
        index_topk=index_topk,
        index_n_heads=8,
        index_head_dim=16,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        max_position_embeddings=512,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        n_group=1,
        topk_group=1,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    cfg.update(pattern)
    if (
        "indexer_types" not in pattern
        and "index_topk_freq" in pattern
        and pattern["index_topk_freq"] == 1
    ):
        cfg["indexer_types"] = ["full"] * 8
    return GlmMoeDsaConfig(**cfg)


def randomise(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point():
                continue
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                t.copy_(1.0 + 0.3 * torch.randn(t.shape, generator=g))
            elif "e_score_correction_bias" in name or name.endswith(".bias"):
                t.copy_(0.2 * torch.randn(t.shape, generator=g))
            elif "inv_freq" in name:
                continue
            else:
                t.copy_(0.08 * torch.randn(t.shape, generator=g))


def build_pair(tmp_path, pattern: dict, seed: int, index_topk: int = 6):
    from transformers import GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    hf = GlmMoeDsaForCausalLM(tiny_hf_config(pattern, index_topk)).float().eval()
    randomise(hf, seed)
    hf.save_pretrained(tmp_path)
    return hf, load_ours(tmp_path)


def load_ours(tmp_path, **options):
    """Our model of the checkpoint ``build_pair`` wrote, with ``ModelOptions(**options)``."""
    # transformers hard-codes eps 1e-6 for q_a/kv_a_layernorm; the trained model used rms_norm_eps.
    return load_hf_model(
        str(tmp_path), dtype=torch.float32, latent_norm_eps=1e-6, options=ModelOptions(**options)
    ).eval()


def capture_hf_topk(hf) -> dict[int, torch.Tensor]:
    got = {}
    for i, layer in enumerate(hf.model.layers):
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.register_forward_hook(
                lambda m, a, out, i=i: got.__setitem__(i, out)
            )
    return got


def capture_our_topk(model) -> dict[int, torch.Tensor]:
    got = {}
    for name, block in model.layers.items():
        if block.attention.indexer is not None:
            block.attention.register_forward_hook(
                lambda m, a, out, i=int(name): got.__setitem__(i, out[1])
            )
    return got


def topk_sets_hf(idx: torch.Tensor, row: int, pos: int) -> set[int]:
    return {int(s) for s in idx[row, pos] if int(s) <= pos}  # HF also returns masked (future) slots


def topk_sets_ours(idx: torch.Tensor, row: int, pos: int, seq: int) -> set[int]:
    return {int(s) - row * seq for s in idx[row * seq + pos] if int(s) >= 0}


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("seed", [0, 1])
def test_logits_and_topk_match_transformers(tmp_path, pattern, seed):
    hf, ours = build_pair(tmp_path, PATTERNS[pattern], seed)
    hf_topk, our_topk = capture_hf_topk(hf), capture_our_topk(ours)
    batch, seq = 2, 29  # index_topk 6 << 29: DSA really selects
    tokens = torch.randint(0, 97, (batch, seq), generator=torch.Generator().manual_seed(100 + seed))
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens)
    rel = (got - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4, f"max relative logit difference {rel:.2e}"
    assert sorted(hf_topk) == sorted(our_topk) == ours.args.index_share.full_layers
    for layer in hf_topk:
        for row in range(batch):
            for pos in range(seq):
                assert topk_sets_hf(hf_topk[layer], row, pos) == topk_sets_ours(
                    our_topk[layer], row, pos, seq
                ), f"layer {layer} row {row} position {pos}"


def test_dense_attention_is_a_different_model(tmp_path):
    """The comparison above is discriminative: turning the sparsity off moves logits far beyond
    tolerance."""
    hf, ours = build_pair(tmp_path, PATTERNS["freq4_offset3"], 3)
    tokens = torch.randint(0, 97, (2, 29), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(tokens).logits
        dense = load_ours(tmp_path, sparse_attention=False)(tokens)
    assert (dense - ref).abs().max() / ref.abs().max() > 1e-2


def test_short_sequences_are_dense_causal_attention(tmp_path):
    """With fewer visible keys than index_topk, DSA is exactly dense causal attention."""
    _, ours = build_pair(tmp_path, PATTERNS["freq4_offset3"], 4, index_topk=32)
    tokens = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        sparse = ours(tokens)
        dense = load_ours(tmp_path, sparse_attention=False)(tokens)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)


def test_packed_documents_equal_separate_rows(tmp_path):
    """Two documents packed in one row with cu_seqlens give the logits of the two run as separate
    rows."""
    _, ours = build_pair(tmp_path, PATTERNS["freq4_offset3"], 5)
    g = torch.Generator().manual_seed(9)
    a, b = torch.randint(0, 97, (1, 17), generator=g), torch.randint(0, 97, (1, 12), generator=g)
    with torch.no_grad():
        packed = ours(
            torch.cat((a, b), dim=1), cu_seqlens=torch.tensor([0, 17, 29], dtype=torch.int32)
        )
        sep_a, sep_b = ours(a), ours(b)
    torch.testing.assert_close(packed[:, :17], sep_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, 17:], sep_b, rtol=1e-5, atol=1e-5)


def test_our_modules_are_attention_with_indexer_only_on_full_layers(tmp_path):
    _, ours = build_pair(tmp_path, PATTERNS["explicit_FSFSSFFS"], 6)
    has = [blk.attention.indexer is not None for blk in ours.layers.values()]
    assert has == [c == "F" for c in "FSFSSFFS"]
    assert all(isinstance(blk.attention, Attention) for blk in ours.layers.values())
