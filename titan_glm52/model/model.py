"""GLM52Model: token embedding, 78 MLA+DSA blocks (3 dense, 75 MoE), final norm, output head, MTP
layer.

Inputs are ``tokens [B, S]`` and optionally ``cu_seqlens`` (int32 over the flattened ``B * S``
stream) for packed documents: no attention or indexer score crosses a document and positions restart
per document. Without ``cu_seqlens`` each row is one document. Internally tokens are flattened to
``[T = B * S, D]``.

Context parallelism (``cp``, ``titan_glm52/context_parallel.py``): ``tokens [B, S / N]`` are this
rank's zigzag part of each sequence, ``cu_seqlens`` describes the global ``[B * S]`` stream, and the
MTP layer takes the ids of the next token of each local position (``next_tokens``, split like the
tokens), since those cross the chunk boundaries.

Pipeline stages are this same module with pieces removed (``tok_embeddings``, ``norm``, ``output``
or ``mtp`` set to None and layers deleted from ``layers``); ``forward`` then takes / returns hidden
states.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from titan_glm52.model.args import GLM52ModelArgs
from titan_glm52.model.head import OutputHead
from titan_glm52.model.init import init_weights_
from titan_glm52.host_copy import host_to_device
from titan_glm52.model.attention import Attention, DenseMasked, DensePrefix, PackedContext
from titan_glm52.model.moe import MoE, FeedForward
from titan_glm52.model.norms import RMSNorm
from titan_glm52.model.options import ModelOptions
from titan_glm52.model.recompute import token_chunked
from titan_glm52.model.aux_loss import AuxTerms
from titan_glm52.model.rope import rope_cos_sin
from titan_glm52.packed import check_cu_seqlens, doc_positions
from titan_glm52.context_parallel import CPContext, CPGroup


class Block(nn.Module):
    """Pre-norm block: ``h += attn(norm(h))``; ``h += mlp(norm(h))``; threads the IndexShare
    top-k."""

    def __init__(self, layer_id: int, args: GLM52ModelArgs, options: ModelOptions) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attention = Attention(args, layer_id, options)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.moe_enabled = args.is_moe_layer(layer_id)
        if self.moe_enabled:
            self.moe = MoE(args, options)
        else:
            self.feed_forward = FeedForward(args.hidden_size, args.intermediate_size)
        self.mlp_token_chunk = options.mlp_token_chunk

    def forward(self, h: torch.Tensor, ctx: PackedContext, topk: torch.Tensor | None):
        a, topk = self.attention(self.attention_norm(h), ctx, topk)
        h = h + a
        m = self.ffn_norm(h)
        if self.moe_enabled:
            h = h + self.moe(m, ctx.batch, ctx.aux, ctx.cp)
        elif self.mlp_token_chunk and m.shape[0] > self.mlp_token_chunk and torch.is_grad_enabled():
            h = h + token_chunked(self.feed_forward, self.mlp_token_chunk, m)  # bounded memory
        else:
            h = h + self.feed_forward(m)
        return h, topk


class MTPLayer(nn.Module):
    """Depth-1 multi-token prediction (checkpoint layer ``num_hidden_layers``).

    At position i it combines the main model's final-normed hidden ``h_i`` with the embedding of
    token ``t_{i+1}``: ``x = eh_proj([enorm(emb), hnorm(h)])``, runs its own full block (own
    indexer, MoE), and returns ``shared_head.norm(x)``; the caller applies the shared output head to
    predict ``t_{i+2}``.

    With ``options.mtp_token_chunk`` the token-wise parts (the input projection, the block's MLP,
    the final norm) run over chunks of that many tokens, each recomputed in backward. The MTP
    layer's backward runs first, while every main block still holds its activations, so a
    recompute of the whole layer would rebuild them all at the step's peak; chunks rebuild one
    chunk's at a time. Only the attention (which mixes tokens) keeps its saved set.
    """

    def __init__(self, args: GLM52ModelArgs, options: ModelOptions) -> None:
        super().__init__()
        d = args.hidden_size
        self.enorm = RMSNorm(d, args.rms_norm_eps)
        self.hnorm = RMSNorm(d, args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.token_chunk = options.mtp_token_chunk
        if self.token_chunk:
            options = replace(options, mlp_token_chunk=self.token_chunk)
        self.block = Block(args.num_hidden_layers, args, options)
        self.norm = RMSNorm(d, args.rms_norm_eps)  # shared_head.norm

    def forward(self, h: torch.Tensor, emb_next: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        x = self._by_rows(self._project, emb_next, h)
        x, _ = self.block(x, ctx, None)
        return self._by_rows(self.norm, x)

    def _project(self, emb_next: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat((self.enorm(emb_next), self.hnorm(h)), dim=-1))

    def _by_rows(self, fn, *rows: torch.Tensor) -> torch.Tensor:
        """``fn(*rows)``, over ``token_chunk`` rows at a time when it is set and training: then
        only the rows are kept for backward (not the normalised copies or the ``[T, 2D]``
        concatenation), and each chunk is rebuilt there."""
        chunk = self.token_chunk
        if chunk and rows[0].shape[0] > chunk and torch.is_grad_enabled():
            return token_chunked(fn, chunk, *rows)
        return fn(*rows)


def next_token_embeddings(emb: torch.Tensor, batch: int) -> torch.Tensor:
    """``emb [B*S, D]`` shifted left by one token within each row (the last position gets zeros); a
    new tensor, not a view."""
    shifted = torch.cat((emb[1:], emb.new_zeros(1, emb.shape[-1])))
    row_end = (torch.arange(emb.shape[0], device=emb.device) + 1) % (emb.shape[0] // batch) == 0
    return shifted.masked_fill(row_end[:, None], 0.0)


def mtp_embeddings(
    embedding: nn.Embedding,
    emb: torch.Tensor,
    ctx: PackedContext,
    next_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MTP layer's next-token embeddings of the token embeddings ``emb [T, D]``: shifted
    (``next_token_embeddings``), or under context parallelism the embeddings of ``next_tokens``
    (the next ids of the local positions), zero at each sequence's last position."""
    if ctx.cp is None:
        return next_token_embeddings(emb, ctx.batch)
    if next_tokens is None:
        raise ValueError(
            "context parallelism with MTP needs next_tokens: the ids of the token after each local "
            "position (the shifted global tokens, split like the tokens)"
        )
    nxt = embedding(next_tokens).view(emb.shape)
    return nxt.masked_fill(ctx.cp.row_end()[:, None], 0.0)


class GLM52Model(nn.Module):
    """The model of ``args`` computed as ``options`` say (``ModelOptions``; default: the torch
    reference, every parameter trained); ``with_mtp`` builds the MTP layer (default: when the args
    have one)."""

    def __init__(
        self,
        args: GLM52ModelArgs,
        options: ModelOptions | None = None,
        *,
        with_mtp: bool | None = None,
    ) -> None:
        super().__init__()
        self.args, self.options = args, options or ModelOptions()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleDict(
            {str(i): Block(i, args, self.options) for i in range(args.num_hidden_layers)}
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.output = OutputHead(args.hidden_size, args.vocab_size)
        if with_mtp is None:
            with_mtp = args.num_nextn_predict_layers > 0
        self.mtp = MTPLayer(args, self.options) if with_mtp else None
        for name, param in self.named_parameters():
            param.requires_grad_(self.options.trains(name))

    # ------------------------------------------------------------------------------------- setup
    def init_weights(self, seed: int = 0) -> None:
        """Random init (normal with ``initializer_range``, norms 1, biases and buffers 0), the same
        values whatever the parallel layout (``model/init.py``); valid after ``to_empty``."""
        init_weights_(self, self.args.initializer_range, seed)

    # ------------------------------------------------------------------------------------- forward
    def packed_context(
        self,
        batch: int,
        seq: int,
        cu_seqlens: torch.Tensor | Sequence[int] | None,
        device: torch.device,
        aux: AuxTerms | None = None,
        cp: CPGroup | None = None,
    ) -> PackedContext:
        """The packed context of ``batch`` rows of ``seq`` local tokens; with ``cp`` each row is
        this rank's part of a sequence of ``seq * cp.size`` tokens, ``cu_seqlens`` is over the
        global stream, and every row runs on the sparse kernels (no dense prefix)."""
        if cp is not None:
            seq *= cp.size
        total = batch * seq
        if cu_seqlens is None:
            cu_seqlens = torch.arange(0, total + 1, seq, dtype=torch.int32, device=device)
            lengths = [seq] * batch
        else:
            # Validated where it arrives: host bounds (a list, or a host tensor) are read without a
            # device-to-host sync and go to the device pinned, without blocking; a tensor on the GPU
            # is read back (one sync).
            bounds = check_cu_seqlens(cu_seqlens, total)
            if not isinstance(cu_seqlens, torch.Tensor):
                cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
            cu_seqlens = (
                host_to_device(cu_seqlens.to(torch.int32), device)
                if cu_seqlens.device.type == "cpu"
                else cu_seqlens.to(device=device, dtype=torch.int32)
            )
            lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        positions = doc_positions(cu_seqlens, total)
        split = CPContext.build(cp, batch, seq, device) if cp is not None else None
        if split is not None:
            positions = positions[split.rows]
        cos, sin = rope_cos_sin(positions, self.args.qk_rope_head_dim, self.args.rope_theta)
        k = self.args.index_topk
        opts = self.options
        dense = opts.dense_prefix and split is None
        prefix = DensePrefix.build(lengths, k, device) if dense else None
        masked = (
            DenseMasked.build(lengths, k, int(opts.dense_masked_ratio * k), device)
            if dense and opts.dense_masked_ratio > 0
            else None
        )
        return PackedContext(
            cu_seqlens,
            cos,
            sin,
            batch=batch,
            max_doc_len=max(lengths),
            dense_prefix=prefix,
            dense_masked=masked,
            aux=aux if aux is not None else AuxTerms(),
            cp=split,
        )

    def run_layers(self, h: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        # every stage starts on a full layer (pipeline splitter), so it begins with no top-k
        topk = None
        for block in self.layers.values():
            h, topk = block(h, ctx, topk)
        return h

    def forward(
        self,
        tokens: torch.Tensor,
        cu_seqlens: torch.Tensor | Sequence[int] | None = None,
        *,
        with_mtp: bool = False,
        labels: torch.Tensor | None = None,
        mtp_labels: torch.Tensor | None = None,
        aux: AuxTerms | None = None,
        cp: CPGroup | None = None,
        next_tokens: torch.Tensor | None = None,
    ):
        """Main-head logits ``[B, S, vocab]``; with ``with_mtp`` also the MTP head's ``[B, S,
        vocab]`` (position i predicts token i + 2).

        ``cu_seqlens``: a tensor or a host sequence of ints. Under FSDP pass a list (as the trainer
        does): FSDP's root moves tensor arguments to the GPU with a blocking copy, and their bounds
        would then be read back, two host syncs per forward that stop the host from queuing ahead of
        the GPU.

        With ``labels`` (and ``mtp_labels`` when ``with_mtp``) it returns the summed token
        cross-entropies instead of logits (``OutputHead``: ``LOSS_CHUNK`` tokens at a time, the
        gradients formed in forward; the ``[T, vocab]`` logits never exist at once).

        ``aux``: the auxiliary losses' normalisers for this forward, and where their detached sums
        are added (``AuxTerms``; default: normalisers 1, the sums discarded).

        ``cp``: context parallelism over that group (module docstring): ``tokens`` (and ``labels``,
        ``mtp_labels``, ``next_tokens``) are this rank's part of each sequence, the results its
        rows' (in local order), the loss sums its tokens'.
        """
        b, s = tokens.shape[:2]
        ctx = self.packed_context(b, s, cu_seqlens, tokens.device, aux, cp)
        emb = self.tok_embeddings(tokens).view(b * s, -1)
        h = self.norm(self.run_layers(emb, ctx))
        if with_mtp and self.mtp is None:
            raise ValueError(
                "with_mtp=True but the model was built without its MTP layer "
                "(num_nextn_predict_layers = 0 or with_mtp=False)"
            )
        x = (
            self.mtp(h, mtp_embeddings(self.tok_embeddings, emb, ctx, next_tokens), ctx)
            if with_mtp
            else None
        )
        if labels is not None:
            ce, mtp = self.head_loss_sums(h, labels, x, mtp_labels)
            return (ce, mtp) if with_mtp else ce
        logits = self.output(h).view(b, s, -1)
        return (logits, self.output(x).view(b, s, -1)) if with_mtp else logits

    def head_loss_sums(
        self,
        h: torch.Tensor,
        labels: torch.Tensor,
        x: torch.Tensor | None = None,
        mtp_labels: torch.Tensor | None = None,
    ):
        """Summed fp32 cross-entropy of the output head over the final hidden states ``h`` against
        ``labels``, and over the MTP layer's ``x`` against ``mtp_labels`` (None without ``x``): one
        call of the head per loss (``OutputHead``)."""
        ce = self.output(h, labels)
        if x is None:
            return ce, None
        return ce, self.output(x, mtp_labels)
