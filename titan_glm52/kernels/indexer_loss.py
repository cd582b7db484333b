"""Triton indexer KL loss for the sparse stage (DeepSeek-V3.2), without [T, T] tensors.

Contract: ``reference.indexer_kl(q, kv, sm_scale, q_idx, k_idx, w_idx, idx_scale, cu_seqlens,
indices=indices)`` per row ``[T]``: KL(target || softmax(indexer logits)) over the selected keys of
each row, 0 for a row without a valid key; gradients flow into q_idx, k_idx and w_idx only.

* target: the main attention's probabilities on the selected keys summed over heads and
  L1-normalised. They are recomputed from the attention LSE that ``sparse_mla`` returned (one QK^T
  pass, no softmax passes): ``p[h, s] = exp(q_h . kv_s * sm_scale - lse_h)``. ``lse`` must come from
  ``sparse_mla`` with the same q, kv, indices and sm_scale.
* logits: ``sum_h w_idx[t, h] * relu(q_idx[t, h] . k_idx[s]) * idx_scale``.

Forward (one program per row), one pass: walk the K slots in blocks; per block gather kv and k_idx
rows, compute the head sum of P and the logits, and keep the sums the KL needs: the target's sum,
its sums of ``p log p`` and ``p x logit``, and the logits' running logsumexp; ``KL = norm (sum p log
p - sum p logit) + norm sum(p) (log norm + lse)``, ``norm = 1 / sum(p)``. The head sum of P [T, K]
(fp32), its sum and the logits' logsumexp [T] are kept for backward. Backward (one program
per row): recompute the logits from q_idx, k_idx; ``dlogit = (sum(target) * softmax - target) *
grad``; dw and dq_idx accumulate in registers, dk_idx with fp32 atomic adds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from ._triton_env import check_device, pow2
from .sparse_mla import LOG2E, _contig, _dot, _gather, _slots, valid_extent
from .sparse_mla import _bwd as _sparse_bwd
from .sparse_mla import _fwd as _sparse_fwd

# What ``tuning.launch_overrides({"indexer_loss": {part: {...}}})`` may set over the defaults
# (``_fwd_launch``, ``_bwd_launch``), per kernel: the slots per step and the launch's warps and
# stages. "fwd" is the forward that recomputes the target, "fwd_given" the one that reads it.
LAUNCH_KEYS = {
    "fwd": frozenset({"BK", "num_warps", "num_stages"}),
    "fwd_given": frozenset({"BK", "num_warps", "num_stages"}),
    "bwd": frozenset({"BK", "num_warps", "num_stages"}),
}


@triton.jit
def _index_logits(qi, w, ki, idx_scale, IEEE_I: tl.constexpr):
    """qi [HIP, DIP], w [HIP], ki [BK, DIP] -> (r = ki qi^T [BK, HIP], logits [BK]). The keys are
    the products' M side (here and in the backward): 64 of them fill a Hopper warpgroup MMA, which
    32 heads do not."""
    r = _dot(ki, tl.trans(qi), IEEE_I)
    return r, tl.sum(tl.maximum(r, 0.0) * w[None, :], axis=1) * idx_scale


@triton.jit
def _kl_fwd_kernel(
    q_ptr,
    kv_ptr,
    lse_ptr,
    qi_ptr,
    ki_ptr,
    wi_ptr,
    idx_ptr,
    tgt_ptr,
    kl_ptr,
    stat_ptr,
    T,
    H,
    HI,
    K,
    qk_scale,
    idx_scale,
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_lt,
    stride_qit,
    stride_qih,
    stride_kit,
    stride_wit,
    stride_it,
    stride_st,
    DA: tl.constexpr,
    DB: tl.constexpr,
    DAP: tl.constexpr,
    DBP: tl.constexpr,
    HAS_B: tl.constexpr,
    BH: tl.constexpr,
    DI: tl.constexpr,
    DIP: tl.constexpr,
    HIP: tl.constexpr,
    BK: tl.constexpr,
    IEEE: tl.constexpr,
    IEEE_I: tl.constexpr,
    GIVEN: tl.constexpr,
):
    """With GIVEN, ``tgt`` already holds the head sum of P per slot (the sparse backward's) and q,
    kv and lse are not read."""
    t = tl.program_id(0)
    t64 = t.to(tl.int64)
    if not GIVEN:
        offs_h = tl.arange(0, BH)
        hmask = offs_h < H
        offs_a = tl.arange(0, DAP)
        qrow = q_ptr + t64 * stride_qt + offs_h[:, None] * stride_qh
        qa = tl.load(
            qrow + offs_a[None, :], mask=hmask[:, None] & (offs_a < DA)[None, :], other=0.0
        )
        if HAS_B:
            offs_b = tl.arange(0, DBP)
            qb = tl.load(
                qrow + DA + offs_b[None, :],
                mask=hmask[:, None] & (offs_b < DB)[None, :],
                other=0.0,
            )
        lse = tl.load(lse_ptr + t64 * stride_lt + offs_h, mask=hmask, other=float("-inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)

    offs_hi = tl.arange(0, HIP)
    offs_di = tl.arange(0, DIP)
    himask = offs_hi < HI
    dimask = offs_di < DI
    qi = tl.load(
        qi_ptr + t64 * stride_qit + offs_hi[:, None] * stride_qih + offs_di[None, :],
        mask=himask[:, None] & dimask[None, :],
        other=0.0,
    )
    w = tl.load(wi_ptr + t64 * stride_wit + offs_hi, mask=himask, other=0.0).to(tl.float32)
    idx_row = idx_ptr + t64 * stride_it
    tgt_row = tgt_ptr + t64 * stride_st

    # per lane: the target's sum, its sums of p log p and p x logit over the slots with p > 0 (the
    # KL follows from them and the logsumexp in one pass), the logits' running max and sum of exp
    p_total = tl.zeros([BK], tl.float32)
    plogp = tl.zeros([BK], tl.float32)
    plg = tl.zeros([BK], tl.float32)
    m_l = tl.full([BK], float("-inf"), tl.float32)
    s_l = tl.zeros([BK], tl.float32)
    for k0 in range(0, K, BK):
        if GIVEN:
            offs_k, valid, safe = _slots(idx_row, k0, K, T, BK)
            psum = tl.load(tgt_row + offs_k, mask=valid, other=0.0)
        else:
            offs_k = k0 + tl.arange(0, BK)
            valid, safe, ka, kb = _gather(
                kv_ptr, idx_row, k0, K, T, stride_kvt, DA, DB, DAP, DBP, BK, HAS_B
            )
            s = _dot(qa, tl.trans(ka), IEEE)
            if HAS_B:
                s += _dot(qb, tl.trans(kb), IEEE)
            p = tl.math.exp2(s * qk_scale - lse2[:, None])
            p = tl.where(valid[None, :] & hmask[:, None], p, 0.0)
            psum = tl.sum(p, axis=0)  # [BK]
            tl.store(tgt_row + offs_k, psum, mask=offs_k < K)  # the target, for the backward
        ki = tl.load(
            ki_ptr + safe[:, None] * stride_kit + offs_di[None, :],
            mask=valid[:, None] & dimask[None, :],
            other=0.0,
        )
        _, lg = _index_logits(qi, w, ki, idx_scale, IEEE_I)
        lg = tl.where(valid, lg, float("-inf"))
        pos = valid & (psum > 0.0)
        p_total += psum
        plogp += tl.where(pos, psum * tl.log(tl.where(pos, psum, 1.0)), 0.0)
        plg += tl.where(pos, psum * tl.where(pos, lg, 0.0), 0.0)
        m_new = tl.maximum(m_l, lg)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_l = s_l * tl.exp(m_l - m_use) + tl.exp(lg - m_use)
        m_l = m_new
    # combine the per-lane logsumexp
    m_all = tl.max(m_l, axis=0)
    has = m_all > float("-inf")
    m_use = tl.where(has, m_all, 0.0)
    l_all = tl.sum(s_l * tl.exp(m_l - m_use), axis=0)
    lse_l = tl.where(has, m_use + tl.log(tl.where(has, l_all, 1.0)), float("-inf"))
    p_sum = tl.sum(p_total, axis=0)
    norm = 1.0 / tl.maximum(p_sum, 1e-10)
    # KL = sum t (log t - logit + lse) with t = p x norm, over the slots with p > 0
    kl_row = norm * (
        tl.sum(plogp, axis=0)
        - tl.sum(plg, axis=0)
        + p_sum * (tl.log(norm) + tl.where(has, lse_l, 0.0))
    )
    tl.store(kl_ptr + t, tl.where(has, kl_row, 0.0))
    tl.store(stat_ptr + t64 * 2, lse_l)
    tl.store(stat_ptr + t64 * 2 + 1, p_sum)


@triton.jit
def _kl_bwd_kernel(
    qi_ptr,
    ki_ptr,
    wi_ptr,
    idx_ptr,
    tgt_ptr,
    stat_ptr,
    g_ptr,
    dqi_ptr,
    dki_ptr,
    dwi_ptr,
    T,
    HI,
    K,
    idx_scale,
    stride_qit,
    stride_qih,
    stride_kit,
    stride_wit,
    stride_it,
    stride_st,
    stride_dqt,
    stride_dqh,
    stride_dkt,
    stride_dwt,
    DI: tl.constexpr,
    DIP: tl.constexpr,
    HIP: tl.constexpr,
    BK: tl.constexpr,
    IEEE_I: tl.constexpr,
):
    t = tl.program_id(0)
    t64 = t.to(tl.int64)
    offs_hi = tl.arange(0, HIP)
    offs_di = tl.arange(0, DIP)
    himask = offs_hi < HI
    dimask = offs_di < DI
    qmask = himask[:, None] & dimask[None, :]
    qi = tl.load(
        qi_ptr + t64 * stride_qit + offs_hi[:, None] * stride_qih + offs_di[None, :],
        mask=qmask,
        other=0.0,
    )
    w = tl.load(wi_ptr + t64 * stride_wit + offs_hi, mask=himask, other=0.0).to(tl.float32)
    lse_l = tl.load(stat_ptr + t64 * 2)
    p_sum = tl.load(stat_ptr + t64 * 2 + 1)
    norm = 1.0 / tl.maximum(p_sum, 1e-10)  # the target's normaliser, as the forward formed it
    tsum = p_sum * norm
    g = tl.load(g_ptr + t).to(tl.float32)
    idx_row = idx_ptr + t64 * stride_it
    tgt_row = tgt_ptr + t64 * stride_st

    dw = tl.zeros([HIP], tl.float32)
    dqi_t = tl.zeros([DIP, HIP], tl.float32)  # dq_idx transposed (dims on the M side)
    for k0 in range(0, K, BK):
        offs_k, valid, safe = _slots(idx_row, k0, K, T, BK)
        ki = tl.load(
            ki_ptr + safe[:, None] * stride_kit + offs_di[None, :],
            mask=valid[:, None] & dimask[None, :],
            other=0.0,
        )
        r, lg = _index_logits(qi, w, ki, idx_scale, IEEE_I)
        tg = tl.load(tgt_row + offs_k, mask=valid, other=0.0) * norm
        dl = tl.where(
            valid,
            (tsum * tl.exp(tl.where(valid, lg, 0.0) - tl.where(valid, lse_l, 0.0)) - tg) * g,
            0.0,
        )
        dw += tl.sum(tl.maximum(r, 0.0) * dl[:, None], axis=0)
        dr = tl.where(r > 0.0, w[None, :] * dl[:, None], 0.0).to(ki.dtype)  # [BK, HIP]
        dqi_t += _dot(tl.trans(ki), dr, IEEE_I)
        dki = _dot(dr, qi, IEEE_I)  # [BK, DIP]
        tl.atomic_add(
            dki_ptr + safe[:, None] * stride_dkt + offs_di[None, :],
            dki * idx_scale,
            mask=valid[:, None] & dimask[None, :],
            sem="relaxed",
        )
    tl.store(
        dqi_ptr + t64 * stride_dqt + offs_hi[None, :] * stride_dqh + offs_di[:, None],
        (dqi_t * idx_scale).to(dqi_ptr.dtype.element_ty),
        mask=dimask[:, None] & himask[None, :],
    )
    tl.store(
        dwi_ptr + t64 * stride_dwt + offs_hi,
        (dw * idx_scale).to(dwi_ptr.dtype.element_ty),
        mask=himask,
    )


def _config(h: int, d_qk: int, h_i: int, d_i: int):
    # largest power of two <= D_qk: 576 -> 512 + 64, no padding waste
    d_v = 1 << (d_qk.bit_length() - 1)
    dap = pow2(d_v)
    db = d_qk - d_v
    big = dap >= 256
    return dict(
        DA=d_v,
        DB=db,
        DAP=dap,
        DBP=pow2(db) if db > 0 else 16,
        HAS_B=db > 0,
        BH=pow2(h),
        DI=d_i,
        DIP=pow2(d_i),
        HIP=pow2(h_i),
        BK=64 if big else 16,
    ), (8 if big else 4)


def _fwd_launch(c: dict, num_warps: int, given: bool) -> dict:
    """The forward's slots per step, warps and stages, with the active overrides laid over them."""
    if given:
        # only k_idx rows are gathered, so 128 slots in a 2-stage pipeline fit: at T = 32K on one
        # H100 2.96 ms, 3.12 with 64 slots, 8.62 with the recomputing forward's launch (8 warps,
        # one stage; bench/results/2026-12-06_h100_h200_real_mode_kl.md)
        base = {"BK": 128 if c["DIP"] >= 64 else c["BK"], "num_warps": 4, "num_stages": 2}
    else:  # 64 slots x 576 dims in two stages would not fit shared memory
        base = {"BK": c["BK"], "num_warps": num_warps, "num_stages": 1 if c["BK"] >= 64 else 2}
    return {**base, **tuning.overrides("indexer_loss", "fwd_given" if given else "fwd")}


def _bwd_launch(dip: int) -> dict:
    """The backward's slots per step, warps and stages, with the active overrides laid over them."""
    # at T = 32K on one H100: 14.50 ms against 17.68 for 32 slots (whose 32 x 32 products miss
    # the warpgroup MMA) and 23.22 for 8 warps (bench/results/2026-12-06_h100_h200_real_mode_kl.md)
    base = (
        {"BK": 64, "num_warps": 4, "num_stages": 3}
        if dip >= 64
        else {"BK": 16, "num_warps": 4, "num_stages": 2}
    )
    return {**base, **tuning.overrides("indexer_loss", "bwd")}


def _kl_forward(q, kv, lse, q_idx, k_idx, w_idx, indices, tgt, sm_scale, idx_scale, given):
    """Per-row KL ``[T]`` and the row statistics ``[T, 2]`` (the logits' logsumexp, the target's
    sum before normalising) for ``_kl_backward``; ``tgt [T, K]`` (fp32) ends as the head sum of P
    per slot, not normalised. ``given``: ``tgt`` already holds it (q, kv and lse
    unused)."""
    total, h, d_qk = q.shape
    h_i, d_i = q_idx.shape[1:]
    n_k = indices.shape[1]
    kl = torch.zeros(total, dtype=torch.float32, device=q_idx.device)
    stat = torch.zeros((total, 2), dtype=torch.float32, device=q_idx.device)
    if total and n_k:
        c, nw = _config(h, d_qk, h_i, d_i)
        _kl_fwd_kernel[(total,)](
            q,
            kv,
            lse,
            q_idx,
            k_idx,
            w_idx,
            indices,
            tgt,
            kl,
            stat,
            k_idx.shape[0],
            h,
            h_i,
            n_k,
            sm_scale * LOG2E,
            idx_scale,
            q.stride(0),
            q.stride(1),
            kv.stride(0),
            lse.stride(0),
            q_idx.stride(0),
            q_idx.stride(1),
            k_idx.stride(0),
            w_idx.stride(0),
            indices.stride(0),
            tgt.stride(0),
            IEEE=q.dtype == torch.float32,
            IEEE_I=q_idx.dtype == torch.float32,
            GIVEN=given,
            **{**c, **_fwd_launch(c, nw, given)},
        )
    return kl, stat


def _kl_backward(q_idx, k_idx, w_idx, indices, tgt, stat, grad, idx_scale, h, d_qk):
    """(dq_idx, dk_idx, dw_idx) of the rows' KL weighted by ``grad [T]`` (fp32)."""
    total, h_i, d_i = q_idx.shape
    n_k = indices.shape[1]
    dq = torch.zeros_like(q_idx)
    dw = torch.zeros_like(w_idx)
    dk = torch.zeros(k_idx.shape, dtype=torch.float32, device=k_idx.device)
    if total and n_k:
        c, _ = _config(h, d_qk, h_i, d_i)
        _kl_bwd_kernel[(total,)](
            q_idx,
            k_idx,
            w_idx,
            indices,
            tgt,
            stat,
            grad,
            dq,
            dk,
            dw,
            k_idx.shape[0],
            h_i,
            n_k,
            idx_scale,
            q_idx.stride(0),
            q_idx.stride(1),
            k_idx.stride(0),
            w_idx.stride(0),
            indices.stride(0),
            tgt.stride(0),
            dq.stride(0),
            dq.stride(1),
            dk.stride(0),
            dw.stride(0),
            DI=c["DI"],
            DIP=c["DIP"],
            HIP=c["HIP"],
            IEEE_I=q_idx.dtype == torch.float32,
            **_bwd_launch(c["DIP"]),
        )
    return dq, dk.to(k_idx.dtype), dw


def _indexer_inputs(q_idx, k_idx, w_idx):
    q_idx, w_idx = _contig(q_idx.detach()), _contig(w_idx.detach())
    return q_idx, _contig(k_idx.detach().to(q_idx.dtype)), w_idx


class _IndexerKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, lse, q_idx, k_idx, w_idx, indices, sm_scale, idx_scale):
        q, kv = _contig(q.detach()), _contig(kv.detach().to(q.dtype))
        lse = _contig(lse.detach().float())
        q_idx, k_idx, w_idx = _indexer_inputs(q_idx, k_idx, w_idx)
        indices = _contig(indices.to(torch.int32))
        tgt = torch.empty((q.shape[0], indices.shape[1]), dtype=torch.float32, device=q.device)
        kl, stat = _kl_forward(
            q, kv, lse, q_idx, k_idx, w_idx, indices, tgt, sm_scale, idx_scale, False
        )
        ctx.save_for_backward(q_idx, k_idx, w_idx, indices, tgt, stat)
        ctx.idx_scale = idx_scale
        ctx.cfg = q.shape[1:]
        return kl

    @staticmethod
    def backward(ctx, grad):
        q_idx, k_idx, w_idx, indices, tgt, stat = ctx.saved_tensors
        grad = _contig(grad.float())
        dq, dk, dw = _kl_backward(
            q_idx, k_idx, w_idx, indices, tgt, stat, grad, ctx.idx_scale, *ctx.cfg
        )
        return None, None, None, dq, dk, dw, None, None, None


class _SparseMLAWithKL(torch.autograd.Function):
    """``sparse_mla`` whose backward also trains the indexer: the KL's target is the head sum of P
    that the sparse backward's part 1 forms anyway (no second pass over the selected keys), the KL
    is formed from it there, its gradient (times ``weight``) goes into q_idx, k_idx and w_idx, and
    its sum is added into ``sink`` (a detached fp32 scalar: the value, known after backward)."""

    @staticmethod
    def forward(ctx, q, kv, indices, q_idx, k_idx, w_idx, sm_scale, d_v, gluon, idx_scale, kl):
        weight, sink = kl
        q, kv, indices = _contig(q), _contig(kv.to(q.dtype)), _contig(indices.to(torch.int32))
        q_i, k_i, w_i = _indexer_inputs(q_idx, k_idx, w_idx)
        kend = valid_extent(indices)
        out, lse = _sparse_fwd(q, kv, indices, kend, sm_scale, d_v, gluon)
        ctx.save_for_backward(q, kv, indices, kend, out, lse, q_i, k_i, w_i)
        ctx.cfg = (sm_scale, d_v, gluon, idx_scale, weight, sink)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, kv, indices, kend, out, lse, q_i, k_i, w_i = ctx.saved_tensors
        sm_scale, d_v, gluon, idx_scale, weight, sink = ctx.cfg
        grad_out = torch.zeros_like(out) if grad_out is None else _contig(grad_out.to(out.dtype))
        tgt = torch.empty(indices.shape, dtype=torch.float32, device=q.device)
        dq, dkv = _sparse_bwd(q, kv, indices, kend, out, lse, grad_out, sm_scale, d_v, gluon, tgt)
        kl, stat = _kl_forward(q, kv, lse, q_i, k_i, w_i, indices, tgt, sm_scale, idx_scale, True)
        with torch.no_grad():
            sink.add_(kl.sum())
        grad = torch.ones_like(kl).mul_(weight)
        dq_i, dk_i, dw_i = _kl_backward(
            q_i, k_i, w_i, indices, tgt, stat, grad, idx_scale, *q.shape[1:]
        )
        return dq, dkv, None, dq_i, dk_i, dw_i, None, None, None, None, None


def indexer_kl_sparse(
    q: torch.Tensor,
    kv: torch.Tensor,
    sm_scale: float,
    lse: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor,
    idx_scale: float,
    indices: torch.Tensor,
) -> torch.Tensor:
    """Per-row sparse indexer KL ``[T]`` (fp32), differentiable in q_idx, k_idx, w_idx.

    q ``[T, H, D_qk]``, kv ``[T, D_qk]``: the main (absorbed) attention inputs, used without
    gradient; lse ``[T, H]``: the natural-log LSE that ``sparse_mla(q, kv, indices, sm_scale, d_v)``
    returned; q_idx ``[T, H_I, D_I]``, k_idx ``[T, D_I]``, w_idx ``[T, H_I]``: indexer inputs;
    indices ``[T, K]`` (-1 = none). The keys ``kv`` and ``k_idx`` may hold more rows than there are
    queries (context parallelism: every row of the stream, the indices being rows of it).
    """
    total, h, d_qk = q.shape
    n_keys = kv.shape[0]
    if kv.shape != (n_keys, d_qk) or lse.shape != (total, h) or indices.shape[0] != total:
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, kv {tuple(kv.shape)}, lse {tuple(lse.shape)}, "
            f"indices {tuple(indices.shape)}"
        )
    if (
        q_idx.dim() != 3
        or q_idx.shape[0] != total
        or k_idx.shape != (n_keys, q_idx.shape[2])
        or w_idx.shape != q_idx.shape[:2]
    ):
        raise ValueError(
            f"indexer shape mismatch: q_idx {tuple(q_idx.shape)}, k_idx {tuple(k_idx.shape)}, "
            f"w_idx {tuple(w_idx.shape)}"
        )
    check_device(q, kv, lse, q_idx, k_idx, w_idx, indices)
    return _IndexerKL.apply(
        q, kv, lse, q_idx, k_idx, w_idx, indices, float(sm_scale), float(idx_scale)
    )


def sparse_mla_indexer_kl(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor,
    idx_scale: float,
    weight: torch.Tensor | float,
    sink: torch.Tensor,
    gluon: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sparse_mla(q, kv, indices, sm_scale, d_v, gluon=gluon)`` (the same outputs and gradients)
    whose backward also forms ``indexer_kl_sparse`` of every row from its own probabilities, adds
    its sum into ``sink`` (fp32 scalar) and returns ``weight`` x its gradient into q_idx, k_idx,
    w_idx (shapes as in ``indexer_kl_sparse``). The KL's target is P as the backward stores it (q's
    dtype), where ``indexer_kl_sparse`` recomputes it in fp32."""
    total, h, d_qk = q.shape
    if (
        q_idx.dim() != 3
        or q_idx.shape[0] != total
        or k_idx.shape != (kv.shape[0], q_idx.shape[2])
        or w_idx.shape != q_idx.shape[:2]
        or sink.shape != ()
        or sink.dtype != torch.float32
    ):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, kv {tuple(kv.shape)}, q_idx "
            f"{tuple(q_idx.shape)}, k_idx {tuple(k_idx.shape)}, w_idx {tuple(w_idx.shape)}, sink "
            f"{tuple(sink.shape)} {sink.dtype} (an fp32 scalar)"
        )
    check_device(q, kv, indices, q_idx, k_idx, w_idx, sink)
    return _SparseMLAWithKL.apply(
        q,
        kv,
        indices,
        q_idx,
        k_idx,
        w_idx,
        float(sm_scale),
        int(d_v),
        bool(gluon),
        float(idx_scale),
        (weight, sink),
    )


def compile_specs(small: bool = False):
    """Launch configurations for ``bench/compile_check.py`` (offline sm_90 compile), with the
    active ``tuning`` overrides laid over them as the launches lay them."""
    h, d_qk, h_i, d_i = (4, 24, 4, 16) if small else (64, 576, 32, 128)
    c, nw = _config(h, d_qk, h_i, d_i)
    c.update(IEEE=False, IEEE_I=False)
    fwd, fwd_given = ({**c, **_fwd_launch(c, nw, given)} for given in (False, True))
    bwd = {
        "DI": c["DI"],
        "DIP": c["DIP"],
        "HIP": c["HIP"],
        "IEEE_I": False,
        **_bwd_launch(c["DIP"]),
    }
    out = []
    for name, fn, launch in (
        ("indexer_kl_fwd", _kl_fwd_kernel, {**fwd, "GIVEN": False}),
        ("indexer_kl_fwd_given", _kl_fwd_kernel, {**fwd_given, "GIVEN": True}),
        ("indexer_kl_bwd", _kl_bwd_kernel, bwd),
    ):
        sig = {
            n: "i32" for n in fn.arg_names if n.startswith("stride") or n in ("T", "H", "HI", "K")
        }
        sig.update({n: "*bf16" for n in fn.arg_names if n.endswith("_ptr")})
        sig.update(
            {
                n: "*fp32"
                for n in (
                    "lse_ptr",
                    "wi_ptr",
                    "tgt_ptr",
                    "kl_ptr",
                    "stat_ptr",
                    "g_ptr",
                    "dki_ptr",
                    "dwi_ptr",
                )
            }
        )
        sig.update({"idx_ptr": "*i32", "qk_scale": "fp32", "idx_scale": "fp32"})
        sig = {k: v for k, v in sig.items() if k in fn.arg_names}
        div = tuple(n for n in fn.arg_names if n.endswith("_ptr"))
        consts = {k: v for k, v in launch.items() if k in fn.arg_names}
        out.append((name, (fn, sig, consts, launch["num_warps"], launch["num_stages"], div)))
    return out


__all__ = ["indexer_kl_sparse"]
