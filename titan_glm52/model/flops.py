"""The one FLOP model of GLM-5.2: the pipeline splitter's stage costs and the MFU metric both come
from here.

Forward FLOPs, 2 per multiply-add, matmuls only (norms, activations, RoPE, softmax and the top-k
selection are left out: small next to the matmuls). A training step is 3 forwards (backward costs
twice the forward; activation recomputation is not counted).

Per token, the weights a token multiplies:
  * MLA projections: q down ``D x q_lora_rank``, q up ``q_lora_rank x H (nope + rope)``, kv down ``D
    x (kv_lora_rank + rope)``, kv up ``kv_lora_rank x H (nope + v)`` (or its absorption into the
    queries and outputs: the same products), output ``H v x D``;
  * on layers with an indexer (IndexShare full layers and the MTP layer): ``wq_b`` ``q_lora_rank x
    H_I D_I``, ``wk`` ``D x D_I``, ``weights_proj`` ``D x H_I``;
  * the MLP: the dense SwiGLU ``3 D I``, or the router ``D x E`` plus ``num_experts_per_tok`` routed
    and ``n_shared_experts`` shared experts of ``3 D F`` each;
  * the output head ``D x V``; with MTP, ``eh_proj`` ``2D x D``, the MTP layer, and the head once
    more.
Per (query, key) pair:
  * the sparse attention core in the absorbed form the kernels run: ``H (2 kv_lora_rank + rope)``
    per selected pair (scores over ``kv_lora_rank + rope``, values over ``kv_lora_rank``); a query
    selects ``min(index_topk, position + 1)`` keys (every visible key in the dense warm-up);
  * the indexer: ``H_I (D_I + 1)`` per visible pair (the per-head scores, then their weighted sum);
  * the indexer KL loss (``[dsa] indexer_loss_coeff > 0``), on layers with an indexer: the indexer
    logits once more over the KL's keys, ``H_I (D_I + 1)`` per selected pair (every visible pair in
    the dense warm-up). Its target, the main attention's probabilities on those keys, is not
    counted: the attention already computes them (a kernel that computes them again for the KL
    does a recompute, left out like activation checkpointing's).
Dense prefix (``[dsa] dense_prefix``): the first ``index_topk`` rows of each document of at least
``index_topk`` tokens run in the plain MLA form instead: ``H (qk_head_dim + v_head_dim)`` per pair,
plus their keys' up-projection ``kv_lora_rank x H (nope + v)`` per row. Masked dense (``[dsa]
dense_masked_ratio``): a document of ``index_topk < L <= ratio x index_topk`` tokens runs its later
rows in the plain form too, per selected pair, plus the up-projection of all its ``L`` keys. The
absorbed-form work such rows still do and discard is not counted, nor the gradient-free sparse
forward that gives a trained indexer's KL those rows' log-sum-exp. Where the sparse backward forms
the KL (the Triton backend), the layers with an indexer run their prefix rows in the absorbed form.
"""

from __future__ import annotations

import torch

from titan_glm52.model.args import GLM52ModelArgs


# -------------------------------------------------------------------------------------
# multiply-adds
def attention_macs_per_token(args: GLM52ModelArgs) -> int:
    d, h = args.hidden_size, args.num_attention_heads
    return (
        d * args.q_lora_rank
        + args.q_lora_rank * h * args.qk_head_dim
        + d * (args.kv_lora_rank + args.qk_rope_head_dim)
        + args.kv_lora_rank * h * (args.qk_nope_head_dim + args.v_head_dim)
        + h * args.v_head_dim * d
    )


def core_macs_per_pair(args: GLM52ModelArgs) -> int:
    """The absorbed sparse attention, per selected (query, key) pair."""
    return args.num_attention_heads * (2 * args.kv_lora_rank + args.qk_rope_head_dim)


def indexer_macs_per_token(args: GLM52ModelArgs) -> int:
    d, hi, di = args.hidden_size, args.index_n_heads, args.index_head_dim
    return args.q_lora_rank * hi * di + d * di + d * hi


def indexer_macs_per_pair(args: GLM52ModelArgs) -> int:
    """The indexer's scores of one visible (query, key) pair: every head, then the weighted sum."""
    return args.index_n_heads * (args.index_head_dim + 1)


def mlp_macs_per_token(args: GLM52ModelArgs, moe: bool) -> int:
    d = args.hidden_size
    if not moe:
        return 3 * d * args.intermediate_size
    experts = args.num_experts_per_tok + args.n_shared_experts
    return experts * 3 * d * args.moe_intermediate_size + d * args.n_routed_experts


def head_macs_per_token(args: GLM52ModelArgs) -> int:
    return args.vocab_size * args.hidden_size


# ------------------------------------------------------------------------------------- pieces
def layer_flops(
    args: GLM52ModelArgs, layer_id: int, tokens: float, selected_pairs: float, visible_pairs: float
) -> float:
    """Forward FLOPs of decoder layer ``layer_id`` (``num_hidden_layers``: the MTP layer's block)
    over ``tokens`` tokens whose queries select ``selected_pairs`` keys and see ``visible_pairs``
    keys in all."""
    macs = (
        attention_macs_per_token(args) + mlp_macs_per_token(args, args.is_moe_layer(layer_id))
    ) * tokens + core_macs_per_pair(args) * selected_pairs
    if args.index_share.has_indexer(layer_id):
        macs += indexer_macs_per_token(args) * tokens + indexer_macs_per_pair(args) * visible_pairs
    return 2.0 * macs


def head_flops(args: GLM52ModelArgs, tokens: float = 1.0) -> float:
    return 2.0 * head_macs_per_token(args) * tokens


def mtp_flops(
    args: GLM52ModelArgs, tokens: float, selected_pairs: float, visible_pairs: float
) -> float:
    """The MTP layer's forward: ``eh_proj``, its block, and the output head once more."""
    d = args.hidden_size
    return (
        2.0 * 2 * d * d * tokens
        + layer_flops(args, args.num_hidden_layers, tokens, selected_pairs, visible_pairs)
        + head_flops(args, tokens)
    )


# ------------------------------------------------------------------------------------- pairs
def mean_keys(seq_len: int, cap: int | None = None) -> float:
    """Mean over query positions t = 1..seq_len of min(cap, t) (all t keys when cap is None)."""
    if cap is None or cap >= seq_len:
        return (seq_len + 1) / 2
    return (cap * (cap + 1) / 2 + (seq_len - cap) * cap) / seq_len


def pairs(doc_lengths: torch.Tensor, cap: int | None = None) -> int:
    """Sum over documents and their queries of min(cap, position + 1) (every visible key when cap is
    None)."""
    lengths = doc_lengths.to(torch.int64)
    causal = lengths * (lengths + 1) // 2
    if cap is None:
        return int(causal.sum())
    return int(
        torch.where(lengths <= cap, causal, cap * (cap + 1) // 2 + (lengths - cap) * cap).sum()
    )


# ---------------------------------------------------------------------------------- a training step
def step_flops(
    args: GLM52ModelArgs,
    doc_lengths: torch.Tensor,
    with_mtp: bool,
    sparse: bool = True,
    dense_prefix: bool = False,
    dense_masked_ratio: float = 0.0,
    indexer_kl: bool = False,
    kl_in_sparse: bool = False,
) -> float:
    """Training FLOPs (forward + backward) of the documents ``doc_lengths`` (their lengths sum to
    the token count). ``sparse``: the DSA sparse stage (else the dense warm-up); ``dense_prefix`` /
    ``dense_masked_ratio``: the model runs with those ``[dsa]`` options; ``indexer_kl``: the
    indexers train by their KL loss (``[dsa] indexer_loss_coeff > 0``); ``kl_in_sparse``: the
    sparse backward forms that KL (the Triton backend), so the layers with an indexer run their
    prefix rows on the sparse kernels (absorbed form) rather than the dense prefix."""
    tokens = int(doc_lengths.sum())
    selected = pairs(doc_lengths, args.index_topk if sparse else None)
    visible = pairs(doc_lengths)
    forward = sum(
        layer_flops(args, i, tokens, selected, visible) for i in range(args.num_hidden_layers)
    )
    forward += head_flops(args, tokens)
    attention_layers = args.num_hidden_layers
    if with_mtp:
        forward += mtp_flops(args, tokens, selected, visible)
        attention_layers += 1
    if dense_prefix and sparse:
        if indexer_kl and kl_in_sparse:
            attention_layers -= _indexer_layers(args, with_mtp)
        forward += attention_layers * _dense_rows_extra(args, doc_lengths, dense_masked_ratio)
    if indexer_kl:
        forward += indexer_kl_flops(args, selected if sparse else visible, with_mtp)
    return 3.0 * forward


def _indexer_layers(args: GLM52ModelArgs, with_mtp: bool) -> int:
    """The layers that run an indexer (the MTP layer's block too, with MTP)."""
    layer_ids = range(args.num_hidden_layers + (1 if with_mtp else 0))
    return sum(1 for i in layer_ids if args.index_share.has_indexer(i))


def indexer_kl_flops(args: GLM52ModelArgs, kl_pairs: float, with_mtp: bool) -> float:
    """Forward FLOPs of the indexer KL's logits over ``kl_pairs`` (query, key) pairs per layer, on
    every layer with an indexer (the MTP layer's block too, with MTP). Its backward, into the
    indexer alone, is twice this, as for the rest of the step."""
    return 2.0 * _indexer_layers(args, with_mtp) * indexer_macs_per_pair(args) * kl_pairs


def _dense_rows_extra(
    args: GLM52ModelArgs, doc_lengths: torch.Tensor, masked_ratio: float
) -> float:
    """Per attention layer: the plain form's FLOPs over the absorbed form's for the dense prefix's
    (and the masked dense) rows, plus their keys' up-projection."""
    k, h = args.index_topk, args.num_attention_heads
    lengths = doc_lengths.to(torch.int64)
    docs = int((lengths >= k).sum())
    # per selected pair
    extra = 2 * h * (args.qk_head_dim + args.v_head_dim) - 2 * core_macs_per_pair(args)
    up = 2 * args.kv_lora_rank * h * (args.qk_nope_head_dim + args.v_head_dim)  # per key row
    total = docs * (extra * (k * (k + 1) // 2) + up * k)
    if masked_ratio > 0:
        short = lengths[(lengths > k) & (lengths <= int(masked_ratio * k))]
        total += int((extra * k * (short - k) + up * short).sum())
    return float(total)
