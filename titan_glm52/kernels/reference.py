"""Plain-torch DSA math: the definition the Triton kernels are tested against, and the ``torch``
backend.

All functions work on packed sequences: T tokens of several documents, described by ``cu_seqlens``
(int32, ``[N + 1]``, ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == T``). Token ``t`` of the document
``[a, b)`` sees keys ``a <= s <= t``. Indices are global rows of the packed stream; ``-1`` means "no
key".

Queries may be a subset of the keys' rows (context parallelism): ``q_rows`` then gives each
query's global row, which bounds its causal window ``[document start, q_rows[t]]``; without it query
``t`` is row ``t``. Keys (and ``kv``) always cover the whole packed stream.

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
def _window(starts, rows, a, b):
    """(query rows, their document starts, lo, hi) of queries a..b-1: their keys lie in [lo, hi).
    ``rows`` None: query t is row t (then lo is the first query's start, hi = b)."""
    if rows is None:
        return torch.arange(a, b, device=starts.device), starts[a:b], int(starts[a]), b
    r, s = rows[a:b], starts[rows[a:b]]
    return r, s, int(s.min()), int(r.max()) + 1


def _indexer_scores_chunk(q, k, weights, scale, starts, a, b, rows=None):
    """fp32 ``[b - a, hi - lo]`` scores of queries a..b-1 against keys lo..hi-1 (masked to -inf),
    and lo (``_window``)."""
    rows, q_starts, lo, hi = _window(starts, rows, a, b)
    kf = _acc(k[lo:hi])
    acc = torch.zeros(b - a, hi - lo, dtype=kf.dtype, device=q.device)
    for h in range(q.shape[1]):  # one head at a time keeps the chunk O(chunk * T)
        acc += _acc(weights[a:b, h, None]) * torch.relu(_acc(q[a:b, h]) @ kf.T)
    acc = acc * scale
    keys = torch.arange(lo, hi, device=q.device)
    visible = (keys[None, :] >= q_starts[:, None]) & (keys[None, :] <= rows[:, None])
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
    q_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-k keys of the lightning indexer.

    q ``[T, H_I, D_I]``, k ``[T, D_I]``, weights ``[T, H_I]`` (fp32). Score of key s for query t:
    ``sum_h weights[t, h] * relu(q[t, h] . k[s]) * scale`` over the causally visible keys of t's
    document. Returns int32 ``[T, topk]``: the selected global rows sorted by descending score
    (ties: lower row first, so the result is deterministic), then ``-1`` where fewer than ``topk``
    keys are visible. With ``q_rows`` (int64 ``[T_q]``, the queries' global rows) q and weights hold
    ``T_q`` queries and k every row of the stream; the result is ``[T_q, topk]``.
    """
    total = q.shape[0]
    n_keys = k.shape[0] if q_rows is not None else total
    check_cu_seqlens(cu_seqlens, n_keys)
    starts = doc_starts(cu_seqlens, n_keys)
    out = torch.full((total, topk), -1, dtype=torch.int32, device=q.device)
    for a, b in _chunks(total, chunk):
        scores, lo = _indexer_scores_chunk(q, k, weights, scale, starts, a, b, q_rows)
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


def _dense_kl_chunk(q, kv, sm_scale, q_i, k_i, w_i, idx_scale, starts, a, q_rows=None):
    b = a + q.shape[0]
    with torch.no_grad():
        rows, q_starts, lo, hi = _window(starts, q_rows, a, b)
        g = _acc(kv[lo:hi])
        keys = torch.arange(lo, hi, device=q.device)
        visible = (keys[None, :] >= q_starts[:, None]) & (keys[None, :] <= rows[:, None])
        s = torch.einsum("chd,kd->chk", _acc(q), g) * sm_scale
        s = s.masked_fill(~visible[:, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).sum(dim=1)
        target = p / p.sum(dim=-1, keepdim=True).clamp_min(1e-10)
    logits = torch.einsum("chd,kd->chk", _acc(q_i), _acc(k_i[lo:hi])).relu()
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
    q_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row indexer KL loss ``[T]`` (DeepSeek-V3.2): KL(target || softmax(indexer logits)).

    The target is the main attention (absorbed ``q [T, H, D_qk]`` over ``kv [T, D_qk]``,
    ``sm_scale``) summed over heads and L1-normalised; it carries no gradient. The indexer logits
    are ``sum_h w_idx * relu(q_idx . k_idx) * idx_scale``. With ``indices`` (sparse stage) both
    distributions are restricted to the selected keys; without (dense warm-up) they cover every
    causally visible key of the document. Rows with no valid key give 0. Gradients flow into q_idx,
    k_idx and w_idx only. With ``q_rows`` (the queries' global rows) q, q_idx and w_idx hold those
    queries, kv and k_idx every row of the stream.
    """
    total = q.shape[0]
    n_keys = kv.shape[0] if q_rows is not None else total
    check_cu_seqlens(cu_seqlens, n_keys)
    q, kv = q.detach(), kv.detach()
    starts = doc_starts(cu_seqlens, n_keys)
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
                (q[a:b], kv, sm_scale, q_idx[a:b], k_idx, w_idx[a:b], idx_scale, starts, a)
                + ((q_rows,) if q_rows is not None else ()),
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
    q_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed attention over every causally visible key of the document (no top-k), ``[T, H,
    d_v]``; ``q_rows`` as in ``indexer_topk`` (kv then holds every row of the stream)."""
    total = q.shape[0]
    starts = doc_starts(cu_seqlens, kv.shape[0] if q_rows is not None else total)
    outs = []
    for a, b in _chunks(total, chunk):
        rows, q_starts, lo, hi = _window(starts, q_rows, a, b)
        width = hi - lo
        idx = torch.arange(lo, hi, device=q.device, dtype=torch.int32).expand(b - a, width)
        visible = (idx >= q_starts[:, None]) & (idx <= rows[:, None])
        idx = torch.where(visible, idx, torch.full_like(idx, -1))
        o, _ = sparse_mla(q[a:b], kv, idx, sm_scale, d_v, chunk=b - a)
        outs.append(o)
    return torch.cat(outs)


__all__ = ["indexer_topk", "sparse_mla", "indexer_kl", "dense_causal_attention"]
