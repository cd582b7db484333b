"""The DSA-aware FLOP count behind MFU (``model/flops.py``), against a row-by-row count whose
weights are read off the model's own parameters."""

import pytest
import torch

from titan_glm52 import GLM52Model, get_flavor
from titan_glm52.model.flops import step_flops


def _weights_per_token(args, with_mtp) -> float:
    """Multiply-adds per token of the weight matrices a token meets: every matmul weight of the
    model (norms, biases and the embedding lookup are not matmuls), the routed experts' by the share
    a token uses, and the output head a second time for the MTP loss."""
    with torch.device("meta"):
        model = GLM52Model(args, with_mtp=with_mtp)
    total = 0.0
    for name, p in model.named_parameters():
        if name.endswith(("norm.weight", ".bias")) or name.startswith("tok_embeddings"):
            continue
        share = args.num_experts_per_tok / args.n_routed_experts if ".experts.w" in name else 1.0
        total += p.numel() * share
    return total + (model.output.weight.numel() if with_mtp else 0)


def _row_by_row(args, lengths, with_mtp, dense_prefix, masked_ratio=0.0, kl_in_sparse=False):
    k, h = args.index_topk, args.num_attention_heads
    absorbed = 2 * h * (args.kv_lora_rank + args.qk_rope_head_dim + args.kv_lora_rank)
    plain = 2 * h * (args.qk_head_dim + args.v_head_dim)
    up = 2 * args.kv_lora_rank * h * (args.qk_nope_head_dim + args.v_head_dim)
    attn_layers, index_layers = args.num_hidden_layers, len(args.index_share.full_layers)
    if with_mtp:
        attn_layers, index_layers = attn_layers + 1, index_layers + 1
    # where the sparse backward forms the KL, the layers with an indexer run their prefix sparse
    prefix_layers = (attn_layers - (index_layers if kl_in_sparse else 0)) if dense_prefix else 0
    fwd = 2 * _weights_per_token(args, with_mtp) * sum(lengths)
    for length in lengths:
        # the masked rows' keys include the prefix rows' again
        if dense_prefix and k < length <= masked_ratio * k:
            fwd += attn_layers * up * k
        for p in range(length):
            # scores, weighted sum
            fwd += index_layers * 2 * args.index_n_heads * (args.index_head_dim + 1) * (p + 1)
            if length >= k and p < k:  # a prefix row: plain form on the prefix layers
                fwd += prefix_layers * (plain * (p + 1) + up) + (
                    attn_layers - prefix_layers
                ) * absorbed * (p + 1)
            # a masked dense row, and its key's up-projection
            elif dense_prefix and k < length <= masked_ratio * k:
                fwd += attn_layers * (plain * k + up)
            else:
                fwd += attn_layers * absorbed * min(k, p + 1)
    return 3 * fwd


@pytest.mark.parametrize(
    "dense_prefix,with_mtp", [(False, False), (True, False), (False, True), (True, True)]
)
def test_step_flops_counts_rows_as_they_run(dense_prefix, with_mtp):
    args = get_flavor("debug")  # index_topk 16
    lengths = [7, 16, 40, 3]
    got = step_flops(args, torch.tensor(lengths), with_mtp, dense_prefix=dense_prefix)
    assert got == pytest.approx(_row_by_row(args, lengths, with_mtp, dense_prefix), rel=1e-12)


@pytest.mark.parametrize("with_mtp", [False, True])
def test_step_flops_kl_in_sparse_runs_the_indexer_layers_prefix_sparse(with_mtp):
    args = get_flavor("debug")  # indexers on 4 of 8 layers (+ the MTP layer)
    lengths = [7, 16, 40, 3]

    def kl_flops(kl_in_sparse):
        return step_flops(
            args,
            torch.tensor(lengths),
            with_mtp,
            dense_prefix=True,
            indexer_kl=True,
            kl_in_sparse=kl_in_sparse,
        )

    # the KL's own term is the same either way: the difference is the prefix rows' form
    want = _row_by_row(args, lengths, with_mtp, True, kl_in_sparse=True) - _row_by_row(
        args, lengths, with_mtp, True
    )
    assert kl_flops(True) - kl_flops(False) == pytest.approx(want, rel=1e-9)
    assert want != 0


@pytest.mark.parametrize("ratio", [2.0, 2.5])
def test_step_flops_counts_masked_dense_rows(ratio):
    # index_topk 16: the 20- and 32-token documents are masked at 2, and the 40 at 2.5
    args = get_flavor("debug")
    lengths = [7, 16, 20, 32, 40, 3]
    got = step_flops(
        args, torch.tensor(lengths), False, dense_prefix=True, dense_masked_ratio=ratio
    )
    assert got == pytest.approx(_row_by_row(args, lengths, False, True, ratio), rel=1e-12)


def test_dense_prefix_counts_fewer_flops_at_glm52_widths():
    # plain form 2 * 64 * 512 per pair against 2 * 64 * 1088 absorbed
    args = get_flavor("glm52_proxy")
    sparse, prefix = (
        step_flops(args, torch.tensor([4096]), False, dense_prefix=d) for d in (False, True)
    )
    assert 0.9 * sparse < prefix < sparse
    masked = step_flops(
        args, torch.tensor([4096]), False, dense_prefix=True, dense_masked_ratio=2.0
    )
    # the later rows in the plain form too, plus every key's up-projection
    assert 0.9 * prefix < masked < prefix


def _indexers(args, with_mtp) -> int:
    """The attention modules that own an indexer, read off the model itself."""
    with torch.device("meta"):
        model = GLM52Model(args, with_mtp=with_mtp)
    return sum(1 for name, _ in model.named_modules() if name.endswith("attention.indexer"))


def _indexer_kl_by_hand(args, lengths, with_mtp, sparse) -> float:
    """Training FLOPs of the KL's indexer logits: per layer with an indexer, per query, its KL keys
    (the selected ones, or every visible one in the dense warm-up), per key every indexer head's
    scores and their weighted sum, as forward + twice that in backward."""
    per_pair = 2 * args.index_n_heads * (args.index_head_dim + 1)
    keys = sum(min(args.index_topk, p + 1) if sparse else p + 1 for n in lengths for p in range(n))
    return 3 * _indexers(args, with_mtp) * per_pair * keys


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("with_mtp", [False, True])
@pytest.mark.parametrize("dense_prefix", [False, True])
def test_step_flops_counts_the_indexer_kl_on_indexer_layers(sparse, with_mtp, dense_prefix):
    # debug: indexers on 4 of the 8 layers (0, 1, 2, 6) and the MTP layer; the 40-token document
    # is longer than index_topk 16, so the sparse stage's KL sees fewer keys than the warm-up's
    args = get_flavor("debug")
    assert _indexers(args, False) == 4 and _indexers(args, True) == 5
    lengths = torch.tensor([7, 16, 40, 3])
    on, off = (
        step_flops(args, lengths, with_mtp, sparse=sparse, dense_prefix=dense_prefix, indexer_kl=kl)
        for kl in (True, False)
    )
    want = _indexer_kl_by_hand(args, lengths.tolist(), with_mtp, sparse)
    assert on - off == pytest.approx(want, rel=1e-12)
