"""Plain-torch DSA math: the definition the Triton kernels are tested against, and the ``torch``
backend.

All functions work on packed sequences: T tokens of several documents, described by ``cu_seqlens``
(int32, ``[N + 1]``, ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == T``). Token ``t`` of the document
``[a, b)`` sees keys ``a <= s <= t``. Indices are global rows of the packed stream; ``-1`` means "no
key".

Everything is chunked over queries, so peak memory is O(chunk * T) for the indexer scores and O(T *
k) for the sparse attention (each chunk is recomputed in backward instead of keeping its ``[chunk,
k, D]`` gather).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from titan_glm52.packed import check_cu_seqlens, doc_starts

QUERY_CHUNK = 256


def _acc(x: torch.Tensor) -> torch.Tensor:
    """Accumulation precision: fp32, or fp64 for fp64 inputs (gradchecks)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _chunks(total: int, chunk: int):
    for a in range(0, total, chunk):
        yield a, min(a + chunk, total)


# ----------------------------------------------------------------------------------------- indexer
def _indexer_scores_chunk(q, k, weights, scale, starts, a, b):
    """fp32 ``[b - a, b - lo]`` scores of queries a..b-1 against keys lo..b-1 (masked to -inf), and
    lo."""
    lo = int(starts[a])
    kf = _acc(k[lo:b])
    acc = torch.zeros(b - a, b - lo, dtype=kf.dtype, device=q.device)
    for h in range(q.shape[1]):  # one head at a time keeps the chunk O(chunk * T)
        acc += _acc(weights[a:b, h, None]) * torch.relu(_acc(q[a:b, h]) @ kf.T)
    acc = acc * scale
    keys = torch.arange(lo, b, device=q.device)
    rows = torch.arange(a, b, device=q.device)
    visible = (keys[None, :] >= starts[a:b, None]) & (keys[None, :] <= rows[:, None])
    return acc.masked_fill(~visible, float("-inf")), lo


@torch.no_grad()
def indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlens: torch.Tensor,
    topk: int,
    scale: float,
    chunk: int = QUERY_CHUNK,
) -> torch.Tensor:
    """Top-k keys of the lightning indexer.

    q ``[T, H_I, D_I]``, k ``[T, D_I]``, weights ``[T, H_I]`` (fp32). Score of key s for query t:
    ``sum_h weights[t, h] * relu(q[t, h] . k[s]) * scale`` over the causally visible keys of t's
    document. Returns int32 ``[T, topk]``: the selected global rows sorted by descending score
    (ties: lower row first, so the result is deterministic), then ``-1`` where fewer than ``topk``
    keys are visible.
    """
    total = q.shape[0]
    check_cu_seqlens(cu_seqlens, total)
    starts = doc_starts(cu_seqlens, total)
    out = torch.full((total, topk), -1, dtype=torch.int32, device=q.device)
    for a, b in _chunks(total, chunk):
        scores, lo = _indexer_scores_chunk(q, k, weights, scale, starts, a, b)
        vals, order = torch.sort(scores, dim=-1, descending=True, stable=True)
        n = min(topk, scores.shape[1])
        sel = (order[:, :n] + lo).to(torch.int32)
        out[a:b, :n] = torch.where(torch.isfinite(vals[:, :n]), sel, torch.full_like(sel, -1))
    return out


# ----------------------------------------------------------------------------------------- sparse
# MLA
def _sparse_mla_chunk(q, kv, idx, sm_scale: float, d_v: int):
    """fp32 attention of ``q [c, H, D]`` over the rows ``kv[idx]`` (idx ``[c, K]``, -1 = none)."""
    valid = idx >= 0
    g = _acc(kv[idx.clamp(min=0).long()])  # [c, K, D]
    s = torch.einsum("chd,ckd->chk", _acc(q), g) * sm_scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)  # 0 at invalid slots
    denom = e.sum(dim=-1, keepdim=True)
    p = e / denom.clamp_min(torch.finfo(torch.float32).tiny)
    out = torch.einsum("chk,ckd->chd", p, g[..., :d_v])
    lse = (m + torch.log(denom.clamp_min(torch.finfo(torch.float32).tiny))).squeeze(-1)
    lse = torch.where(denom.squeeze(-1) > 0, lse, torch.full_like(lse, float("-inf")))
    return out, lse


def sparse_mla(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int,
    chunk: int = QUERY_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA in the absorbed (MQA) form.

    q ``[T, H, D_qk]``; kv ``[T, D_qk]``, one latent row per token shared by all heads, values
    ``kv[:, :d_v]``; indices int32 ``[T, K]`` (``-1`` = no key). Returns ``out [T, H, d_v]`` (q's
    dtype) and ``lse [T, H]`` (fp32, or fp64 for fp64 inputs; natural log). A row without a valid
    key gives out 0, lse -inf and zero gradients. Differentiable in q and kv.
    """
    total = q.shape[0]
    outs, lses = [], []
    need_grad = torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad)
    for a, b in _chunks(total, chunk):
        if need_grad:
            o, lse = checkpoint(
                _sparse_mla_chunk, q[a:b], kv, indices[a:b], sm_scale, d_v, use_reentrant=False
            )
        else:
            o, lse = _sparse_mla_chunk(q[a:b], kv, indices[a:b], sm_scale, d_v)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs).to(q.dtype), torch.cat(lses)


# ----------------------------------------------------------------------------------------- indexer
# KL
def _kl_rows(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(target || softmax(logits)) per row; -inf logits are excluded; 0 * log 0 = 0."""
    logq = torch.log_softmax(logits, dim=-1)
    has = torch.isfinite(logits)
    t = torch.where(has, target, torch.zeros_like(target))
    logt = torch.log(t.clamp_min(1e-30))
    terms = torch.where(
        t > 0, t * (logt - torch.where(has, logq, torch.zeros_like(logq))), torch.zeros_like(t)
    )
    return terms.sum(dim=-1)


def _sparse_kl_chunk(q, kv, sm_scale, idx, q_i, k_i, w_i, idx_scale):
    valid = idx >= 0
    safe = idx.clamp(min=0).long()
    with torch.no_grad():
        g = _acc(kv[safe])
        s = torch.einsum("chd,ckd->chk", _acc(q), g) * sm_scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0).sum(dim=1)  # [c, K], sum over heads
        target = p / p.sum(dim=-1, keepdim=True).clamp_min(1e-10)
    ki = _acc(k_i[safe])  # [c, K, D_I]
    logits = torch.einsum("chd,ckd->chk", _acc(q_i), ki).relu()
    logits = (_acc(w_i)[:, :, None] * logits).sum(dim=1) * idx_scale
    logits = logits.masked_fill(~valid, float("-inf"))
    kl = _kl_rows(target, logits)
    return torch.where(valid.any(dim=-1), kl, torch.zeros_like(kl))


def _dense_kl_chunk(q, kv, sm_scale, q_i, k_i, w_i, idx_scale, starts, a):
    b = a + q.shape[0]
    with torch.no_grad():
        lo = int(starts[a])
        g = _acc(kv[lo:b])
        rows = torch.arange(a, b, device=q.device)
        keys = torch.arange(lo, b, device=q.device)
        visible = (keys[None, :] >= starts[a:b, None]) & (keys[None, :] <= rows[:, None])
        s = torch.einsum("chd,kd->chk", _acc(q), g) * sm_scale
        s = s.masked_fill(~visible[:, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).sum(dim=1)
        target = p / p.sum(dim=-1, keepdim=True).clamp_min(1e-10)
    logits = torch.einsum("chd,kd->chk", _acc(q_i), _acc(k_i[lo:b])).relu()
    logits = (_acc(w_i)[:, :, None] * logits).sum(dim=1) * idx_scale
    logits = logits.masked_fill(~visible, float("-inf"))
    return _kl_rows(target, logits)


def indexer_kl(
    q: torch.Tensor,
    kv: torch.Tensor,
    sm_scale: float,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor,
    idx_scale: float,
    cu_seqlens: torch.Tensor,
    indices: torch.Tensor | None = None,
    chunk: int = QUERY_CHUNK,
) -> torch.Tensor:
    """Per-row indexer KL loss ``[T]`` (DeepSeek-V3.2): KL(target || softmax(indexer logits)).

    The target is the main attention (absorbed ``q [T, H, D_qk]`` over ``kv [T, D_qk]``,
    ``sm_scale``) summed over heads and L1-normalised; it carries no gradient. The indexer logits
    are ``sum_h w_idx * relu(q_idx . k_idx) * idx_scale``. With ``indices`` (sparse stage) both
    distributions are restricted to the selected keys; without (dense warm-up) they cover every
    causally visible key of the document. Rows with no valid key give 0. Gradients flow into q_idx,
    k_idx and w_idx only.
    """
    total = q.shape[0]
    check_cu_seqlens(cu_seqlens, total)
    q, kv = q.detach(), kv.detach()
    starts = doc_starts(cu_seqlens, total)
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_idx, k_idx, w_idx))
    rows = []
    for a, b in _chunks(total, chunk):
        if indices is not None:
            fn, args = (
                _sparse_kl_chunk,
                (q[a:b], kv, sm_scale, indices[a:b], q_idx[a:b], k_idx, w_idx[a:b], idx_scale),
            )
        else:
            fn, args = (
                _dense_kl_chunk,
                (q[a:b], kv, sm_scale, q_idx[a:b], k_idx, w_idx[a:b], idx_scale, starts, a),
            )
        rows.append(checkpoint(fn, *args, use_reentrant=False) if need_grad else fn(*args))
    return torch.cat(rows)


def dense_causal_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    sm_scale: float,
    d_v: int,
    chunk: int = QUERY_CHUNK,
) -> torch.Tensor:
    """Absorbed attention over every causally visible key of the document (no top-k), ``[T, H,
    d_v]``."""
    total = q.shape[0]
    starts = doc_starts(cu_seqlens, total)
    outs = []
    for a, b in _chunks(total, chunk):
        lo = int(starts[a])
        width = b - lo
        idx = torch.arange(lo, b, device=q.device, dtype=torch.int32).expand(b - a, width)
        rows = torch.arange(a, b, device=q.device)
        visible = (idx >= starts[a:b, None]) & (idx <= rows[:, None])
        idx = torch.where(visible, idx, torch.full_like(idx, -1))
        o, _ = sparse_mla(q[a:b], kv, idx, sm_scale, d_v, chunk=b - a)
        outs.append(o)
    return torch.cat(outs)


__all__ = ["indexer_topk", "sparse_mla", "indexer_kl", "dense_causal_attention"]
