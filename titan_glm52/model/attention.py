"""MLA attention with DeepSeek Sparse Attention (lightning indexer + top-k) and IndexShare.

Tokens arrive packed: ``x [T, D]`` with ``cu_seqlens`` marking documents (see
``kernels/reference.py``). Attention runs in the absorbed (MQA) form for both backends: the key
up-projection is folded into the queries (``q_nope @ W_uk`` -> 512-d latent), every head attends
over the same latent row per key ``[c_kv (512) | k_rope (64)]``, and the value up-projection is
applied to the latent output. This is algebraically the published MLA; it makes a selected key cost
576 values instead of 64 * 448.

Dense prefix: the first ``index_topk`` tokens of a document see at most ``index_topk`` keys, so
their top-k is every visible key and their DSA attention is plain causal attention. When
``PackedContext.dense_prefix`` is set, those rows (of every document of at least ``index_topk``
tokens) run in the plain MLA form (per-head 256-d keys and values from ``wkv_b``) on a dense causal
kernel (SDPA: cuDNN / FlashAttention on GPU), and only the remaining rows go through the sparse
kernels. Same math, a different summation order; it saves a third of the sparse work at ``T = 2 *
index_topk`` (``bench/attn_paths.py``). A layer that trains its indexer on the Triton backend runs
its prefix rows on the sparse kernels all the same, since their backward forms the KL too.

Masked dense: a document a little longer than ``index_topk`` (up to ``PackedContext.dense_masked``'s
ratio times it) has rows that select most of what they see. When ``dense_masked`` is set, such a
document's rows after the prefix run in the plain MLA form too, on SDPA with a boolean mask of
exactly the selected keys, which on H200 costs less than the sparse kernels while a row selects at
least about 40% of its visible keys (``bench/attn_paths.py``). Same math again; the indexer and the
selection are unchanged. Off by default (``[dsa] dense_masked_ratio``: the end-to-end gain measured
so far is small, and negative with selective AC).

Context parallelism (``PackedContext.cp``, ``titan_glm52/context_parallel.py``): ``x`` holds this
rank's rows of every sequence; the queries stay local, the latent rows ``kv`` and the indexer's keys
are gathered over the CP group into the global row order, so the top-k (computed for the local
queries' global rows, ``q_rows``) holds global key rows, and the sparse kernels and the KL run on
the gathered keys. Every row runs on the sparse kernels there (no dense prefix or masked rows: their
plain-form keys would have to come from other ranks; the same math).

IndexShare is explicit dataflow (docs/architecture.md): ``forward`` takes the top-k of the previous
block and returns the top-k its successors use. A full layer computes new indices
(deterministically, so a recompute under activation checkpointing selects the same keys); a shared
layer passes its input on.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from titan_glm52.host_copy import host_ints
from titan_glm52.kernels import reference, triton_kernels
from titan_glm52.model.args import GLM52ModelArgs
from titan_glm52.model.aux_loss import AuxTerms
from titan_glm52.model.fp32_linear import linear_fp32
from titan_glm52.model.recompute import RecomputeSaved, can_recompute
from titan_glm52.model.norms import RMSNorm
from titan_glm52.model.options import ModelOptions
from titan_glm52.model.rope import apply_rope
from titan_glm52.packed import doc_starts

if TYPE_CHECKING:
    from titan_glm52.context_parallel import CPContext

BACKENDS = ("torch", "triton")


_DSA_OPS: dict[tuple[str, bool], tuple] = {}


def dsa_ops(backend: str, gluon: bool = True):
    """(indexer_topk, sparse_mla, indexer_kl_sparse) of a backend (with ``gluon``, the Triton
    backend takes the warp-specialised Gluon kernels where they apply); signatures as in
    ``kernels/reference.py`` (``indexer_topk`` also takes ``max_len``, the longest document when
    known on the host, and ``q_rows``, the queries' global rows under context parallelism;
    ``indexer_kl_sparse(q, kv, sm_scale, lse, q_idx, k_idx, w_idx, idx_scale, indices, cu_seqlens,
    q_rows) -> [T]``).

    Under torch.compile they stay opaque (``torch.compiler.disable``): the blocks' projections and
    MoE compile around them, the DSA kernels run as they are (the torch reference has data-dependent
    chunk bounds, the Triton wrappers allocate scratch and pick launch shapes from the packing).
    Built once per choice and kept in a plain dict: a compiled block that finds them there looks
    them up without a graph break (``prepare_compiled_calls``)."""
    ops = _DSA_OPS.get((backend, gluon))
    if ops is None:
        ops = _DSA_OPS[backend, gluon] = tuple(
            torch.compiler.disable(fn) for fn in _dsa_ops(backend, gluon)
        )
    return ops


def _dsa_ops(backend: str, gluon: bool):
    if backend == "torch":

        def topk_fn(q, k, w, cu_seqlens, topk, scale, max_len=None, q_rows=None):
            return reference.indexer_topk(q, k, w, cu_seqlens, topk, scale, q_rows=q_rows)

        def kl_sparse(
            q, kv, sm_scale, lse, q_idx, k_idx, w_idx, idx_scale, indices, cu_seqlens, q_rows=None
        ):
            return reference.indexer_kl(
                q,
                kv,
                sm_scale,
                q_idx,
                k_idx,
                w_idx,
                idx_scale,
                cu_seqlens,
                indices=indices,
                q_rows=q_rows,
            )

        return topk_fn, reference.sparse_mla, kl_sparse
    if backend == "triton":
        k = triton_kernels()

        def topk_fn(q, kk, w, cu_seqlens, topk, scale, max_len=None, q_rows=None):
            return k["indexer_topk"](
                q, kk, w, cu_seqlens, topk, scale, max_len=max_len, gluon=gluon, q_rows=q_rows
            )

        def mla_fn(q, kv, indices, sm_scale, d_v, kl=None):
            if kl is None:
                return k["sparse_mla"](q, kv, indices, sm_scale, d_v, gluon=gluon)
            return k["sparse_mla_indexer_kl"](q, kv, indices, sm_scale, d_v, *kl, gluon=gluon)

        def kl_sparse(
            q, kv, sm_scale, lse, q_idx, k_idx, w_idx, idx_scale, indices, cu_seqlens, q_rows=None
        ):
            return k["indexer_kl_sparse"](
                q, kv, sm_scale, lse, q_idx, k_idx, w_idx, idx_scale, indices
            )

        return topk_fn, mla_fn, kl_sparse
    raise ValueError(f"unknown DSA backend {backend!r}; choose one of {BACKENDS}")


def applied_weight(linear: nn.Module) -> torch.Tensor:
    """The weight ``linear`` applies to its input, for code that uses a projection's weight
    directly instead of calling the module (the absorbed MLA form): ``linear.effective_weight()``
    where the module defines one (a layer adapted from outside the model, e.g. a LoRA layer: its
    base weight plus the adapter's update), else ``linear.weight``."""
    effective = getattr(linear, "effective_weight", None)
    return linear.weight if effective is None else effective()


@dataclass
class DensePrefix:
    """The rows whose DSA attention is plain causal attention: the first ``rows.shape[1]`` (=
    index_topk) tokens of every document that has at least that many."""

    rows: torch.Tensor  # int64 [n_docs, topk]: global rows, document by document
    is_prefix: torch.Tensor  # bool [T]
    starts: tuple[int, ...] = ()  # host: each such document's first row (rows[:, 0])

    @staticmethod
    def build(doc_lengths: list[int], topk: int, device: torch.device) -> DensePrefix | None:
        """From host-side document lengths (in stream order); None when no document reaches ``topk``
        tokens."""
        starts, at = [], 0
        for length in doc_lengths:
            if length >= topk:
                starts.append(at)
            at += length
        if not starts:
            return None
        rows = host_ints(starts, device)[:, None] + torch.arange(topk, device=device)
        is_prefix = torch.zeros(at, dtype=torch.bool, device=device).index_fill_(
            0, rows.reshape(-1), True
        )
        return DensePrefix(rows, is_prefix, tuple(starts))


@dataclass
class DenseMasked:
    """Documents of ``index_topk < length <= max_len`` tokens whose rows after the prefix run on a
    masked dense kernel: ``keys`` maps a document length to the rows of its documents (``[n_docs,
    length]``, in stream order)."""

    keys: dict[int, torch.Tensor]
    # int64 [n]: the rows after the prefix, by length group, then document, then position
    rows: torch.Tensor
    is_masked: torch.Tensor  # bool [T]

    @staticmethod
    def build(
        doc_lengths: list[int], topk: int, max_len: int, device: torch.device
    ) -> DenseMasked | None:
        """None when no document has ``topk < length <= max_len`` tokens."""
        groups: dict[int, list[int]] = {}
        at = 0
        for length in doc_lengths:
            if topk < length <= max_len:
                groups.setdefault(length, []).append(at)
            at += length
        if not groups:
            return None
        keys = {
            length: host_ints(starts, device)[:, None] + torch.arange(length, device=device)
            for length, starts in groups.items()
        }
        rows = torch.cat([k[:, topk:].reshape(-1) for k in keys.values()])
        is_masked = torch.zeros(at, dtype=torch.bool, device=device).index_fill_(0, rows, True)
        return DenseMasked(keys, rows, is_masked)


_EAGER: dict[str, object] = {}
_EAGER_NAMES = ("_absorbed_sparse_mla", "_causal_sdpa", "_plain_masked", "_indexer_outputs")


def _eager(name: str):
    """The module function ``name`` under ``torch.compiler.disable`` (compiled blocks call it
    eagerly), looked up when called. Built on first use: ``torch.compiler.disable`` imports
    torch._dynamo, and with it triton, which importing this package must not do. Kept in a plain
    dict, like ``dsa_ops``."""
    fn = _EAGER.get(name)
    if fn is None:
        fn = _EAGER[name] = torch.compiler.disable(lambda *args: globals()[name](*args))
    return fn


def prepare_compiled_calls(backend: str, gluon: bool = True) -> None:
    """Builds ``backend``'s DSA ops and the eager helpers before a compiled block first runs. A
    block that has to build them while dynamo traces it breaks its graph there
    (``torch.compiler.disable`` cannot be traced), on top of the break at the call itself: two more
    graphs per attention layer, each a host round trip per step (the debug model's 4 layers on the
    Triton backend: 19 -> 17 compiled graphs, 20 -> 14 graph breaks per step)."""
    dsa_ops(backend, gluon)
    for name in _EAGER_NAMES:
        _eager(name)


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``[N, H, L, D]`` tensors on the fastest exact SDPA backend (cuDNN first
    on GPU)."""
    backends = [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    with sdpa_kernel(backends, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def _masked_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of ``[N, H, L, D]`` tensors over the keys where the bool ``mask [N, 1, Lq, Lk]`` is
    True, on the fastest SDPA backend that takes a mask (cuDNN first on GPU)."""
    backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(backends, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@dataclass
class PackedContext:
    """What every block needs about the packed batch: document boundaries and rotary tables; under
    context parallelism the CP split (then ``cu_seqlens`` describes the global stream, the rotary
    tables and ``batch`` the local rows)."""

    cu_seqlens: torch.Tensor  # int32 [N + 1] over the flattened T tokens (global under CP)
    cos: torch.Tensor  # fp32 [T, qk_rope_head_dim // 2] (the local rows' under CP)
    sin: torch.Tensor
    batch: int = 1  # B: the flattened stream is B sequences of T / B tokens
    max_doc_len: int | None = None  # host-side, so that the indexer needs no device-to-host copy
    # set: sparse layers run these rows on a dense causal kernel
    dense_prefix: DensePrefix | None = None
    # set: and these rows on a dense kernel with a selection mask
    dense_masked: DenseMasked | None = None
    # the auxiliary losses' normalisers in, their sums out
    aux: AuxTerms = field(default_factory=AuxTerms)
    # set: context parallelism (this rank's rows of every sequence, the group to gather keys over)
    cp: CPContext | None = None

    @property
    def q_rows(self) -> torch.Tensor | None:
        """The local rows' global rows under context parallelism, else None (row t is row t)."""
        return self.cp.rows if self.cp is not None else None


@torch.no_grad()
def topk_recall(
    q: torch.Tensor,
    kv: torch.Tensor,
    topk: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    sm_scale: float,
    chunk: int | None = None,
) -> torch.Tensor:
    """Mean over queries of |selected ∩ dense top-k| / |dense top-k|, where the dense top-k are the
    k keys with the largest head-summed attention probability over all visible keys (k = the
    query's number of selected keys; queries ``rows`` with document starts ``starts``, ``q [n,
    H, D]``). A 0-dim fp32 tensor on ``q``'s device, computed without a host sync, so the host
    stays ahead of the GPU on the steps that probe it; ``chunk`` queries at a time (default: as
    many as keep the fp32 scores within 64 MiB)."""
    t = kv.shape[0]
    chunk = chunk or max(1, (64 << 20) // (q.shape[1] * t * 4))
    keys = torch.arange(t, device=q.device)
    kv32 = kv.float()
    selected = topk >= 0
    counts = selected.sum(1)  # k per query
    width = min(topk.shape[1], t)
    ranks = torch.arange(width, device=q.device)
    hits = []
    for c in range(0, q.shape[0], chunk):
        visible = (keys >= starts[c : c + chunk, None]) & (
            keys <= rows[c : c + chunk, None]
        )  # [m, T]
        scores = torch.einsum("mhd,kd->mhk", q[c : c + chunk].float(), kv32) * sm_scale
        probs = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), -1).sum(1)
        # [m, width], most probable first
        dense = probs.masked_fill(~visible, -1.0).topk(width, dim=-1).indices
        # Membership of the selected keys (column t collects the -1 slots and is never a dense
        # index).
        member = torch.zeros(dense.shape[0], t + 1, dtype=torch.bool, device=q.device)
        member.scatter_(
            1, torch.where(selected[c : c + chunk], topk[c : c + chunk].long(), t), True
        )
        hit = member.gather(1, dense) & (ranks < counts[c : c + chunk, None])
        hits.append(hit.sum(1).float() / counts[c : c + chunk].clamp_min(1))
    return torch.cat(hits).mean() if hits else torch.zeros((), device=q.device)


class Indexer(nn.Module):
    """The lightning indexer: scores ``sum_h w[t,h] * relu(q_I[t,h] . k_I[s]) / sqrt(d_I)``, keeps
    the top-k."""

    def __init__(self, args: GLM52ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.rope_dim, self.interleave = args.qk_rope_head_dim, args.indexer_rope_interleave
        self.topk = args.index_topk
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=args.index_norm_eps)
        self.weights_proj = nn.Linear(args.hidden_size, self.n_heads, bias=False)
        self.softmax_scale = self.head_dim**-0.5

    def project(self, x: torch.Tensor, c_q: torch.Tensor, ctx: PackedContext):
        """q_I ``[T, H_I, d_I]``, k_I ``[T, d_I]`` (RoPE on the first rope dims) and fp32 head
        weights ``[T, H_I]``."""
        t = x.shape[0]
        q = self.wq_b(c_q).view(t, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x))
        r = self.rope_dim
        q = torch.cat(
            (apply_rope(q[..., :r], ctx.cos, ctx.sin, self.interleave), q[..., r:]), dim=-1
        )
        k = torch.cat(
            (apply_rope(k[..., :r], ctx.cos, ctx.sin, self.interleave), k[..., r:]), dim=-1
        )
        # The head gate is computed in fp32 (the published model keeps weights_proj in fp32).
        w = linear_fp32(x, self.weights_proj.weight) * self.n_heads**-0.5
        return q, k, w


class Attention(nn.Module):
    """MLA + DSA for one layer. ``indexer`` is None on IndexShare-shared layers (as in the
    checkpoint).

    ``layer_id`` is the checkpoint's layer (``num_hidden_layers`` for the MTP layer); ``options``
    choose the kernels and the mode (``ModelOptions``). Layer 0 measures its top-k recall when a
    forward's ``AuxTerms.recall_queries`` asks for it.
    """

    def __init__(
        self, args: GLM52ModelArgs, layer_id: int, options: ModelOptions | None = None
    ) -> None:
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = (
            args.qk_nope_head_dim,
            args.qk_rope_head_dim,
            args.v_head_dim,
        )
        self.kv_rank = args.kv_lora_rank
        self.interleave = args.rope_interleave
        self.softmax_scale = args.qk_head_dim**-0.5
        self.wq_a = nn.Linear(args.hidden_size, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, args.latent_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * args.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(args.hidden_size, self.kv_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, args.latent_eps)
        self.wkv_b = nn.Linear(self.kv_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(self.n_heads * self.v_dim, args.hidden_size, bias=False)
        has_indexer = args.index_share.has_indexer(layer_id)
        self.indexer = Indexer(args) if has_indexer else None
        self.layer_id = layer_id
        options = options or ModelOptions()
        self.backend, self.gluon, self.sparse = (
            options.dsa_backend,
            options.gluon_kernels,
            options.sparse_attention,
        )
        self.recompute_latent_query = options.recompute_latent_query
        # The indexer KL loss (DeepSeek-V3.2) trains this layer's indexer where the coefficient is >
        # 0.
        self.indexer_loss_coeff = options.indexer_loss_coeff if has_indexer else 0.0
        self.probes_recall = layer_id == 0

    def forward(self, x: torch.Tensor, ctx: PackedContext, topk_in: torch.Tensor | None):
        """``x [T, D]`` -> (``out [T, D]``, top-k ``[T, index_topk]`` int32 for the following
        layers)."""
        t = x.shape[0]
        c_q = self.q_norm(self.wq_a(x))
        q = self.wq_b(c_q).view(t, self.n_heads, self.nope + self.rope_dim)
        q_nope, q_rope = q.split((self.nope, self.rope_dim), dim=-1)
        c_kv, k_rope = self.wkv_a(x).split((self.kv_rank, self.rope_dim), dim=-1)
        c_kv = self.kv_norm(c_kv)
        q_rope = apply_rope(q_rope, ctx.cos, ctx.sin, self.interleave)
        k_rope = apply_rope(k_rope, ctx.cos, ctx.sin, self.interleave)

        w_kv_b = applied_weight(self.wkv_b).view(self.n_heads, self.nope + self.v_dim, self.kv_rank)
        w_uk, w_uv = w_kv_b[:, : self.nope], w_kv_b[:, self.nope :]
        kv = torch.cat((c_kv, k_rope), dim=-1)  # [T, kv_rank + rope]
        if ctx.cp is not None:  # every row's latent key (its gradient goes back to its owner)
            kv = ctx.cp.gather(kv)

        indexer_topk, sparse_mla, _ = dsa_ops(self.backend, self.gluon)
        train_indexer = self.indexer_loss_coeff > 0 and torch.is_grad_enabled()
        # On the Triton backend the sparse attention's backward forms the KL from its own P.
        kl_fused = train_indexer and self.sparse and self.backend == "triton"
        if self.indexer is not None:
            # The indexer sees detached inputs: it learns only from its KL loss, the model only from
            # the LM loss.
            with torch.set_grad_enabled(train_indexer):
                q_i, k_i, w_i = self.indexer.project(x.detach(), c_q.detach(), ctx)
                if ctx.cp is not None:
                    k_i = ctx.cp.gather(k_i)
            with torch.no_grad():
                topk = indexer_topk(
                    q_i.detach(),
                    k_i.detach(),
                    w_i.detach(),
                    ctx.cu_seqlens,
                    self.indexer.topk,
                    self.indexer.softmax_scale,
                    max_len=ctx.max_doc_len,
                    q_rows=ctx.q_rows,
                )
        elif topk_in is None:
            raise ValueError(
                "an IndexShare-shared layer got no top-k: it needs a full layer before it in the "
                "same pipeline stage (check indexer_types and the pipeline layout)"
            )
        else:
            topk = topk_in

        lse = kl_rows = None
        # A layer whose KL the sparse backward forms runs its prefix rows there too: their KL on
        # the separate kernel cost more than the dense kernel saves (10.8% of the step at 4K on one
        # H200, bench/results/2026-12-04_h200_real_mode.md).
        prefix = ctx.dense_prefix if self.sparse and not kl_fused else None
        masked = ctx.dense_masked if self.sparse else None
        if self.sparse:
            dense_rows = [
                d
                for d in (prefix and prefix.is_prefix, masked and masked.is_masked)
                if d is not None
            ]
            skip = functools.reduce(torch.logical_or, dense_rows) if dense_rows else None
            idx = topk if skip is None else topk.masked_fill(skip[:, None], -1)
            q_abs, q_pre, o_lat, lse = _eager("_absorbed_sparse_mla")(
                sparse_mla,
                q_nope,
                q_rope,
                w_uk,
                kv,
                idx,
                self.softmax_scale,
                self.kv_rank,
                self.recompute_latent_query,
                prefix,
                (q_i, k_i, w_i, self, ctx.aux) if kl_fused else None,
            )
            # the KL needs the dense rows' LSE too: their sparse forward
            if dense_rows and train_indexer:
                flat = torch.cat(
                    [
                        r
                        for r in (prefix and prefix.rows.reshape(-1), masked and masked.rows)
                        if r is not None
                    ]
                )
                with torch.no_grad():
                    _, lse_dense = sparse_mla(
                        q_abs[flat], kv, topk[flat], self.softmax_scale, self.kv_rank
                    )
                if kl_fused:  # their KL, the sparse backward's has none of them
                    kl_rows, lse = flat, lse_dense
                else:
                    lse = lse.index_copy(0, flat, lse_dense)
        else:
            q_abs, _ = _absorb(q_nope, q_rope, w_uk)
            o_lat = reference.dense_causal_attention(
                q_abs, kv, ctx.cu_seqlens, self.softmax_scale, self.kv_rank, q_rows=ctx.q_rows
            )
        o = torch.einsum("thr,hvr->thv", o_lat, w_uv)
        # those rows' sparse output is 0 (no key); put the dense result there
        if prefix is not None:
            # (two statements: torch.compile resumes after the SDPA call's graph break at a
            # statement boundary)
            dense = self._plain_causal(prefix.rows, q_pre, c_kv, k_rope)
            o = _PutRows.apply(o, prefix.rows.reshape(-1), dense)
        # the same for the masked rows (eager: a loop over the host-side length groups)
        if masked is not None:
            dense = _eager("_plain_masked")(self, masked, topk, q_nope, q_rope, c_kv, k_rope)
            o = _PutRows.apply(o, masked.rows, dense)
        out = self.wo(o.reshape(t, self.n_heads * self.v_dim))
        kl_here = train_indexer and (not kl_fused or kl_rows is not None)
        if kl_here or (self.probes_recall and ctx.aux.recall_queries):
            out = _eager("_indexer_outputs")(
                self, out, kl_here, q_abs, kv, lse, q_i, k_i, w_i, topk, ctx, kl_rows
            )
        return out, topk

    def _plain_causal(self, rows: torch.Tensor, q_pre: torch.Tensor, c_kv, k_rope) -> torch.Tensor:
        """Causal attention in the plain MLA form over each document prefix ``rows [n, L]``, whose
        queries ``q_pre [n * L, H, nope + rope]`` are given: ``[n * L, H, v_dim]``. Keys and values
        come from ``wkv_b`` per head; the rope key is shared by the heads."""
        n, length = rows.shape
        flat = rows.reshape(-1)
        h = self.n_heads
        kvb = self.wkv_b(c_kv[flat]).view(n, length, h, self.nope + self.v_dim)
        k = torch.cat(
            (kvb[..., : self.nope], k_rope[flat].view(n, length, 1, -1).expand(-1, -1, h, -1)),
            dim=-1,
        )
        q = q_pre.view(n, length, h, -1)
        v = kvb[..., self.nope :]
        o = _eager("_causal_sdpa")(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.softmax_scale
        )
        return o.transpose(1, 2).reshape(n * length, h, self.v_dim)


class _PutRows(torch.autograd.Function):
    """``o.index_copy(0, rows, src)`` for an ``o`` that is exactly 0 on ``rows`` (the dense rows'
    sparse output: no key), which is ``o.index_add(0, rows, src)``: index_copy's forward (compiled,
    one pass that also gives ``o`` its contiguous layout) and index_add's backward, which passes
    ``o``'s gradient on as it is instead of a copy with those rows zeroed ([T, H, v_dim], 2 ms per
    step at 32K on the proxy). The gradient it leaves on those rows of the sparse output is dropped
    there: a row without keys has zero gradients (every sparse_mla backend's contract)."""

    @staticmethod
    def forward(ctx, o: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows)
        return o.index_copy(0, rows, src)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rows,) = ctx.saved_tensors
        return grad, None, grad.index_select(0, rows)


def _absorb(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    w_uk: torch.Tensor,
    starts: tuple[int, ...] = (),
    length: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The latent query ``[q_nope W_uk, q_rope]`` ``[T, H, kv_rank + rope]``: W_uk absorbed into the
    queries, ``q_lat[t, h] = q_nope[t, h] @ W_uk[h]`` (``W_uk[h]: [nope, kv_rank]``); and given
    ``starts`` (eager only) the plain queries ``[q_nope, q_rope]`` of the ``length`` rows from each
    start (the dense prefix's), else None."""
    # the compiler writes the product into the concatenation itself
    if torch.compiler.is_compiling():
        if starts:
            raise NotImplementedError("_absorb: the prefix rows' queries are formed eagerly only")
        return torch.cat((torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rope), dim=-1), None
    if not starts:
        return _LatentQuery.apply(q_nope, q_rope, w_uk), None
    return _LatentQuery.apply(q_nope, q_rope, w_uk, tuple(starts), length)


class _LatentQuery(torch.autograd.Function):
    """``cat(einsum("thn,hnr->thr", q_nope, w_uk), q_rope)`` (eager), the batched product written
    straight into its columns of the output: no separate concatenation, which read and wrote the
    whole ``[T, H, 576]`` query again (6.0 -> 1.3 ms per layer at T = 32K on an H200). The backward
    is the einsum's two products.

    Given ``starts`` and ``length`` (host ints), also the dense prefix's plain queries ``[q_nope,
    q_rope]`` of the row blocks ``start : start + length``, one after another: their gradient is
    then added into those blocks of this node's input gradients (one slice add per block) instead of
    arriving as full-size ``[T, H, nope]`` and ``[T, H, rope]`` tensors, zero but on those rows,
    that autograd would add to them (zero-fill, scatter and add: 5.3 ms per step at 32K tokens on
    the proxy, one H200)."""

    @staticmethod
    def forward(
        ctx,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        w_uk: torch.Tensor,
        starts: tuple[int, ...] = (),
        length: int = 0,
    ):
        t, h, nope = q_nope.shape
        r = w_uk.shape[-1]
        out = q_nope.new_empty(t, h, r + q_rope.shape[-1])
        # [H, T, r], row stride H * 576
        torch.bmm(q_nope.transpose(0, 1), w_uk, out=out[..., :r].transpose(0, 1))
        out[..., r:].copy_(q_rope)
        ctx.save_for_backward(q_nope, w_uk)
        # (row in the output, start, length)
        ctx.blocks = [(i * length, s, length) for i, s in enumerate(starts)]
        if not starts:
            return out
        pre = q_nope.new_empty(len(starts) * length, h, nope + q_rope.shape[-1])
        for at, s, n in ctx.blocks:
            pre[at : at + n, :, :nope].copy_(q_nope[s : s + n])
            pre[at : at + n, :, nope:].copy_(q_rope[s : s + n])
        return out, pre

    @staticmethod
    def backward(ctx, grad: torch.Tensor, grad_pre: torch.Tensor | None = None):
        q_nope, w_uk = ctx.saved_tensors
        r, nope = w_uk.shape[-1], q_nope.shape[-1]
        d_nope = d_w = None
        d_rope = grad[..., r:]
        # contiguous [T, H, nope], as the gradient it is added to (a vectorised add)
        if ctx.needs_input_grad[0]:
            d_nope = q_nope.new_empty(q_nope.shape)
            torch.bmm(
                grad[..., :r].transpose(0, 1), w_uk.transpose(1, 2), out=d_nope.transpose(0, 1)
            )
            if grad_pre is not None:
                for at, s, n in ctx.blocks:
                    d_nope[s : s + n].add_(grad_pre[at : at + n, :, :nope])
        if ctx.needs_input_grad[1] and grad_pre is not None:
            # (a view of the incoming gradient, which must not be written)
            d_rope = d_rope.contiguous()
            for at, s, n in ctx.blocks:
                d_rope[s : s + n].add_(grad_pre[at : at + n, :, nope:])
        if ctx.needs_input_grad[2]:
            d_w = torch.bmm(q_nope.permute(1, 2, 0), grad[..., :r].transpose(0, 1))
        return d_nope, d_rope, d_w, None, None


def _absorbed_sparse_mla(
    sparse_mla,
    q_nope,
    q_rope,
    w_uk,
    kv,
    idx,
    scale: float,
    kv_rank: int,
    rebuild: bool,
    prefix: DensePrefix | None,
    kl: tuple | None = None,
):
    """(latent query, the plain queries of the dense prefix's rows or None, latent output, lse): the
    latent query formed here and the sparse attention over it, eagerly (called through ``_eager``,
    which also keeps the prefix's host-side starts out of the compiled graphs). With ``rebuild``
    (``[dsa] recompute_latent_query``) the attention's backward forms the latent query again, by the
    same eager ops on the same inputs (the same bits), instead of keeping it: H x kv_rank values per
    token fewer held from forward to backward (64 KB per token and layer at GLM-5.2's widths, bf16;
    the rope part, a source of the rebuild, stays), for one batched GEMM of 2 H nope kv_rank FLOPs
    per token in backward. ``kl`` = (q_idx, k_idx, w_idx, the Attention, the step's AuxTerms): the
    attention's backward also trains the indexer (``sparse_mla_indexer_kl``), its KL summed into
    the layer's sink. Why the module, not its layer id: an int attribute passed out of a compiled
    block is a constant that dynamo guards, so every layer compiled the block's attention again and
    past 8 layers (torch._dynamo's recompile_limit) the rest ran it uncompiled."""
    if kl is not None:
        q_i, k_i, w_i, attn, aux = kl
        sink = aux.indexer_kl_sink(attn.layer_id, q_nope.device)
        kl = (
            q_i,
            k_i,
            w_i,
            attn.indexer.softmax_scale,
            attn.indexer_loss_coeff / aux.tokens,
            sink,
        )
    q_abs, q_pre = (
        _absorb(q_nope, q_rope, w_uk)
        if prefix is None
        else _absorb(q_nope, q_rope, w_uk, prefix.starts, prefix.rows.shape[1])
    )
    saved = (
        RecomputeSaved("sparse attention", "[dsa] recompute_latent_query")
        if rebuild and can_recompute()
        else None
    )
    with saved if saved is not None else contextlib.nullcontext():
        if saved is not None:
            saved.recompute(q_abs, lambda: _absorb(q_nope, q_rope, w_uk)[0], q_nope, q_rope, w_uk)
        o_lat, lse = (
            sparse_mla(q_abs, kv, idx, scale, kv_rank)
            if kl is None
            else sparse_mla(q_abs, kv, idx, scale, kv_rank, kl)
        )
    return q_abs, q_pre, o_lat, lse


def _plain_masked(
    attn: Attention, masked: DenseMasked, topk: torch.Tensor, q_nope, q_rope, c_kv, k_rope
):
    """The masked rows in the plain MLA form: per length group, the documents' keys and values from
    ``wkv_b``, their rows after the prefix attending to exactly their selected keys (``topk``:
    global rows, -1 = none) on SDPA with a boolean mask. ``[len(masked.rows), H, v_dim]`` in
    ``masked.rows`` order."""
    h, nope, k_sel = attn.n_heads, attn.nope, topk.shape[1]
    outs = []
    for length, keys in masked.keys.items():
        n = keys.shape[0]
        rows = keys[:, k_sel:]  # [n, length - k_sel]
        kvb = attn.wkv_b(c_kv[keys]).view(n, length, h, nope + attn.v_dim)
        k = torch.cat(
            (kvb[..., :nope], k_rope[keys].view(n, length, 1, -1).expand(-1, -1, h, -1)), dim=-1
        )
        q = torch.cat((q_nope[rows], q_rope[rows]), dim=-1)
        sel = topk[rows].long()  # [n, length - k_sel, k_sel]
        # -1 -> a dummy column, dropped below
        local = torch.where(sel >= 0, sel - keys[:, :1, None], length)
        mask = torch.zeros(n, length - k_sel, length + 1, dtype=torch.bool, device=sel.device)
        mask = mask.scatter_(2, local, True)[..., :length]
        o = _masked_sdpa(
            q.transpose(1, 2),
            k.transpose(1, 2),
            kvb[..., nope:].transpose(1, 2),
            mask[:, None],
            attn.softmax_scale,
        )
        outs.append(o.transpose(1, 2).reshape(-1, h, attn.v_dim))
    return torch.cat(outs)


def _indexer_outputs(
    attn: Attention,
    out,
    train_indexer: bool,
    q_abs,
    kv,
    lse,
    q_i,
    k_i,
    w_i,
    topk,
    ctx: PackedContext,
    rows: torch.Tensor | None = None,
):
    """The indexer's KL loss (attached to ``out``) and its logged numbers (eager: it keeps Python
    state). ``rows``: the sparse KL of these rows only, whose LSE ``lse`` is (the sparse
    attention's backward forms the others')."""
    if train_indexer:
        if attn.sparse:  # KL over the selected keys, from the attention's own LSE
            _, _, indexer_kl_sparse = dsa_ops(attn.backend, attn.gluon)
            sel = (lambda x: x) if rows is None else (lambda x: x[rows])
            kl = indexer_kl_sparse(
                sel(q_abs).detach(),
                kv.detach(),
                attn.softmax_scale,
                lse.detach(),
                sel(q_i),
                k_i,
                sel(w_i),
                attn.indexer.softmax_scale,
                sel(topk),
                ctx.cu_seqlens,
                ctx.q_rows if rows is None else None,
            ).sum()
        else:  # dense warm-up: KL over every visible key (chunked torch path on any backend)
            kl = reference.indexer_kl(
                q_abs.detach(),
                kv.detach(),
                attn.softmax_scale,
                q_i,
                k_i,
                w_i,
                attn.indexer.softmax_scale,
                ctx.cu_seqlens,
                q_rows=ctx.q_rows,
            ).sum()
        out = ctx.aux.attach_indexer_kl(out, kl, attn.indexer_loss_coeff, attn.layer_id)
    if attn.probes_recall and ctx.aux.recall_queries:  # the last queries of the first sequence
        ctx.aux.recall = _recall_probe(attn, q_abs, kv, topk, ctx)
    return out


def _recall_probe(attn: Attention, q_abs, kv, topk, ctx: PackedContext) -> torch.Tensor:
    """``topk_recall`` of the last ``ctx.aux.recall_queries`` queries of the first sequence; under
    context parallelism each rank measures those it holds and the CP group adds up the hits (the
    one collective of a probing step's layer 0)."""
    n = ctx.aux.recall_queries
    if ctx.cp is None:
        seq = q_abs.shape[0] // ctx.batch
        local = rows = torch.arange(seq - min(n, seq), seq, device=q_abs.device)
    else:
        local = ctx.cp.last_of_first_sequence(n)
        rows = ctx.cp.rows[local]
    starts = doc_starts(ctx.cu_seqlens, kv.shape[0])[rows]
    recall = topk_recall(
        q_abs[local].detach(), kv.detach(), topk[local], rows, starts, attn.softmax_scale
    )
    if ctx.cp is None:
        return recall
    count = torch.full((), float(local.numel()), device=recall.device)
    hits, count = ctx.cp.all_reduce(torch.stack((recall * count, count))).unbind()
    return hits / count.clamp_min(1.0)
