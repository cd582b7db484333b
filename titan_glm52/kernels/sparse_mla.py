"""Triton sparse MLA (absorbed / MQA form) forward and backward over top-k gathered latent rows.

Contract: ``reference.sparse_mla``. q ``[T, H, D_qk]``, kv ``[T, D_qk]`` (one latent row per token
shared by all heads; values are ``kv[:, :d_v]``), indices int32 ``[T, K]`` of global rows, ``-1`` =
none. Returns ``out [T, H, d_v]`` (q's dtype) and ``lse [T, H]`` (fp32, natural log, ``-inf`` for a
row without a valid key, whose output and gradients are 0). Differentiable in q and kv; lse is
returned without gradient.

Layout: D_qk is split into the value part A = ``[:d_v]`` and the tail B = ``[d_v:]`` (512 + 64 for
GLM-5.2); each part is padded to a power of two (masked), so any D_qk/d_v works. One program handles
one query and a block of BH heads and walks the K selected rows in blocks of BK: gather the rows
once (masked for -1, clamped before addressing), S = Q_A K_A^T + Q_B K_B^T, online softmax in base
2, O += P V with V = K_A. On an H100/H200 with GLM-5.2's shape (64 heads, 576 / 512, bf16) the
forward and both backward parts run the warp-specialised Gluon kernels of ``sparse_mla_ws`` instead,
unless the caller passes ``gluon=False`` (same outputs; one H200 at T = 32K: forward 426 against 271
TFLOP/s, backward 81.9 against 117.6 ms).

Backward, two kernels per chunk of queries. Part 1 (same grid as forward, all 64 heads per program)
recomputes S and P = exp(S - lse) from the saved lse, dP = dO V^T, dS = P (dP - Delta) with Delta =
rowsum(O dO), and writes P and dS ([chunk, K, H], q's dtype) to a scratch. Part 2 runs one program
per (64-column block of D_qk, query): dKV[idx, cols] += dS^T Q_cols * scale + P^T dO_cols (heads are
the GEMM reduction) into an fp32 buffer with atomics, cast to kv's dtype at the end
(non-deterministic summation order, fp32 accuracy), and dQ[:, cols] = dS KV[idx, cols]. Column
blocks keep each program small, so several share an SM and hide one another's load latency (what
bounds part 2, by ncu); part 1 holds no dQ accumulator, so its 64 heads share one gather. Measured
on one H200 (T = 32K, top-2048): 122 ms against 160 for a split with dQ in part 1 and 32 heads per
program (bench/results/2026-11-30_h200_dsa_kernels.md), 117 ms with part 2's registers capped at 128
(a fourth program per SM); a one-kernel backward needs Q and dO in two operand layouts each and was
slower.

Launch parameters: ``_config``'s measured defaults; a benchmark lays variants over them with
``tuning.launch_overrides`` (parts and keys: ``LAUNCH_KEYS``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import sparse_mla_ws as _ws
from . import tuning
from ._triton_env import check_device, interpreting, pow2

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# What ``tuning.launch_overrides`` may set, per part: the kernels' blocks (BH heads, BK slots, DC
# columns of part 2), num_warps, num_stages, maxnreg (the register cap per thread; None = the
# compiler's choice); "bwd": scratch_bytes, the backward's P / dS budget (SCRATCH_BYTES), i.e. its
# chunk of queries.
LAUNCH_KEYS = {
    "fwd": frozenset({"BH", "BK", "num_warps", "num_stages", "maxnreg"}),
    "bwd_ps": frozenset({"BH", "BK", "num_warps", "num_stages", "maxnreg"}),
    "bwd_grad": frozenset({"BH", "BK", "DC", "num_warps", "num_stages", "maxnreg"}),
    "bwd": frozenset({"scratch_bytes"}),
}


@triton.jit
def _slots(idx_ptr, k0, K, T, BK: tl.constexpr):
    """Slots k0..k0+BK of one row's indices: (slot offsets [BK], valid [BK], row ids clamped to 0
    where invalid, int64 [BK])."""
    offs_k = k0 + tl.arange(0, BK)
    idx = tl.load(idx_ptr + offs_k, mask=offs_k < K, other=-1)
    valid = (idx >= 0) & (idx < T)
    safe = tl.where(valid, idx, 0).to(tl.int64)  # clamp before addressing
    return offs_k, valid, safe


@triton.jit
def _gather(
    kv_ptr,
    idx_ptr,
    k0,
    K,
    T,
    stride_kvt,
    DA: tl.constexpr,
    DB: tl.constexpr,
    DAP: tl.constexpr,
    DBP: tl.constexpr,
    BK: tl.constexpr,
    HAS_B: tl.constexpr,
):
    """Rows kv[idx[k0:k0+BK]] split into parts A [BK, DAP] and B [BK, DBP]; invalid slots read as 0.
    Returns (valid [BK], clamped row ids [BK] int64, A, B)."""
    _, valid, safe = _slots(idx_ptr, k0, K, T, BK)
    rows = safe * stride_kvt
    offs_a = tl.arange(0, DAP)
    ka = tl.load(
        kv_ptr + rows[:, None] + offs_a[None, :],
        mask=valid[:, None] & (offs_a < DA)[None, :],
        other=0.0,
    )
    if HAS_B:
        offs_b = tl.arange(0, DBP)
        kb = tl.load(
            kv_ptr + rows[:, None] + DA + offs_b[None, :],
            mask=valid[:, None] & (offs_b < DB)[None, :],
            other=0.0,
        )
    else:
        kb = ka
    return valid, safe, ka, kb


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _dot_acc(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b, accumulated in place by the MMA."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _fwd_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    kend_ptr,
    out_ptr,
    lse_ptr,
    T,
    H,
    K,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_it,
    stride_ot,
    stride_oh,
    stride_lt,
    DA: tl.constexpr,
    DB: tl.constexpr,
    DAP: tl.constexpr,
    DBP: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    HAS_B: tl.constexpr,
    IEEE: tl.constexpr,
):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = offs_h < H
    offs_a = tl.arange(0, DAP)
    qrow = q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
    qa = tl.load(qrow + offs_a[None, :], mask=hmask[:, None] & (offs_a < DA)[None, :], other=0.0)
    if HAS_B:
        offs_b = tl.arange(0, DBP)
        qb = tl.load(
            qrow + DA + offs_b[None, :], mask=hmask[:, None] & (offs_b < DB)[None, :], other=0.0
        )
    idx_row = idx_ptr + t.to(tl.int64) * stride_it
    kend = tl.load(kend_ptr + t)  # slots past the row's last valid index are skipped

    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, DAP], tl.float32)
    for k0 in range(0, kend, BK):
        valid, safe, ka, kb = _gather(
            kv_ptr, idx_row, k0, K, T, stride_kvt, DA, DB, DAP, DBP, BK, HAS_B
        )
        s = _dot(qa, tl.trans(ka), IEEE)
        if HAS_B:
            s += _dot(qb, tl.trans(kb), IEEE)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # no valid key yet: keep exp2 finite (= 0)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(ka.dtype), ka, IEEE)
        m_i = m_new
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(
        has, (m_i + tl.math.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf")
    )
    orow = out_ptr + t.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh
    tl.store(
        orow + offs_a[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=hmask[:, None] & (offs_a < DA)[None, :],
    )
    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + offs_h, lse, mask=hmask)


@triton.jit
def _bwd_ps_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    kend_ptr,
    out_ptr,
    do_ptr,
    lse_ptr,
    p_ptr,
    ds_ptr,
    tgt_ptr,
    T,
    H,
    K,
    sm_scale,
    row0,
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_it,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_lt,
    stride_pt,
    stride_pk,
    stride_gt,
    DA: tl.constexpr,
    DB: tl.constexpr,
    DAP: tl.constexpr,
    DBP: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    HAS_B: tl.constexpr,
    IEEE: tl.constexpr,
    TGT: tl.constexpr,
):
    """Backward, part 1 (no atomics, no accumulator): recompute P and form dS (already times
    sm_scale) of every (slot, head) into a scratch ``[rows, K, H]`` for part 2 (heads innermost:
    part 2 reads [slots, heads] tiles coalesced). Without a [heads, D_qk] accumulator all 64 heads
    fit one program: one gather per query. TGT = 1 also stores the head sum of P (as stored) per
    slot into ``tgt [T, K]`` (fp32; the indexer KL's target), TGT = 2 adds it there atomically
    (heads split over programs)."""
    t = row0 + tl.program_id(0)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = offs_h < H
    offs_a = tl.arange(0, DAP)
    amask = hmask[:, None] & (offs_a < DA)[None, :]
    t64 = t.to(tl.int64)
    qrow = q_ptr + t64 * stride_qt + offs_h[:, None] * stride_qh
    qa = tl.load(qrow + offs_a[None, :], mask=amask, other=0.0)
    if HAS_B:
        offs_b = tl.arange(0, DBP)
        qb = tl.load(
            qrow + DA + offs_b[None, :], mask=hmask[:, None] & (offs_b < DB)[None, :], other=0.0
        )
    do = tl.load(
        do_ptr + t64 * stride_dot + offs_h[:, None] * stride_doh + offs_a[None, :],
        mask=amask,
        other=0.0,
    )
    o = tl.load(
        out_ptr + t64 * stride_ot + offs_h[:, None] * stride_oh + offs_a[None, :],
        mask=amask,
        other=0.0,
    )
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)  # [BH]
    lse = tl.load(lse_ptr + t64 * stride_lt + offs_h, mask=hmask, other=float("-inf"))
    # empty row -> P = 0
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    qk_scale = sm_scale * 1.4426950408889634
    idx_row = idx_ptr + t64 * stride_it
    kend = tl.load(kend_ptr + t)
    prow = (t - row0).to(tl.int64) * stride_pt + offs_h[:, None]  # [BH, 1] offsets into P / dS
    for k0 in range(0, kend, BK):
        valid, safe, ka, kb = _gather(
            kv_ptr, idx_row, k0, K, T, stride_kvt, DA, DB, DAP, DBP, BK, HAS_B
        )
        s = _dot(qa, tl.trans(ka), IEEE)
        if HAS_B:
            s += _dot(qb, tl.trans(kb), IEEE)
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        p = tl.where(valid[None, :], p, 0.0)  # [BH, BK]
        dp = _dot(do, tl.trans(ka), IEEE)
        ds_c = (p * (dp - delta[:, None]) * sm_scale).to(ka.dtype)  # gradient w.r.t. q.k
        offs_k = k0 + tl.arange(0, BK)
        smask = hmask[:, None] & (offs_k < K)[None, :]
        p_st = p.to(p_ptr.dtype.element_ty)
        tl.store(p_ptr + prow + offs_k[None, :] * stride_pk, p_st, mask=smask)
        tl.store(ds_ptr + prow + offs_k[None, :] * stride_pk, ds_c, mask=smask)
        if TGT > 0:
            p_sum = tl.sum(tl.where(hmask[:, None], p_st.to(tl.float32), 0.0), axis=0)
            g_at = tgt_ptr + t64 * stride_gt + offs_k
            if TGT == 1:
                tl.store(g_at, p_sum, mask=offs_k < K)
            else:
                tl.atomic_add(g_at, p_sum, mask=offs_k < K, sem="relaxed")


@triton.jit
def _grad_block(
    kv_ptr,
    p_ptr,
    ds_ptr,
    dkv_ptr,
    dq_ptr,
    idx_row,
    kend,
    T,
    K,
    qrow,
    dorow,
    prow,
    dqrow,
    stride_kvt,
    stride_pk,
    stride_dkvt,
    hmask,
    offs_c,
    DA: tl.constexpr,
    DQK: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    DC: tl.constexpr,
    WITH_P: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Over one row's slots: dKV[idx, offs_c] += dS^T Q[:, offs_c] (+ P^T dO[:, offs_c] with WITH_P)
    and dQ[:, offs_c] = dS KV[idx, offs_c]."""
    cmask = offs_c < DQK
    q_c = tl.load(qrow + offs_c[None, :], mask=hmask[:, None] & cmask[None, :], other=0.0)
    if WITH_P:
        do_c = tl.load(
            dorow + offs_c[None, :], mask=hmask[:, None] & (offs_c < DA)[None, :], other=0.0
        )
    dq = tl.zeros([BH, DC], tl.float32)
    for k0 in range(0, kend, BK):
        offs_k, valid, safe = _slots(idx_row, k0, K, T, BK)
        lmask = valid[:, None] & hmask[None, :]
        # [BK, BH], heads contiguous
        dst = tl.load(ds_ptr + prow + offs_k[:, None] * stride_pk, mask=lmask, other=0.0)
        acc = _dot(dst, q_c, IEEE)
        if WITH_P:
            pt = tl.load(p_ptr + prow + offs_k[:, None] * stride_pk, mask=lmask, other=0.0)
            acc = _dot_acc(pt, do_c, acc, IEEE)
        kmask = valid[:, None] & cmask[None, :]
        tl.atomic_add(
            dkv_ptr + safe[:, None] * stride_dkvt + offs_c[None, :], acc, mask=kmask, sem="relaxed"
        )
        kv_c = tl.load(kv_ptr + safe[:, None] * stride_kvt + offs_c[None, :], mask=kmask, other=0.0)
        dq = _dot_acc(tl.trans(dst), kv_c, dq, IEEE)
    tl.store(
        dqrow + offs_c[None, :],
        dq.to(dq_ptr.dtype.element_ty),
        mask=hmask[:, None] & cmask[None, :],
    )


@triton.jit
def _bwd_grad_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    kend_ptr,
    do_ptr,
    p_ptr,
    ds_ptr,
    dkv_ptr,
    dq_ptr,
    T,
    H,
    K,
    row0,
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_it,
    stride_dot,
    stride_doh,
    stride_pt,
    stride_pk,
    stride_dkvt,
    stride_dqt,
    stride_dqh,
    DA: tl.constexpr,
    DQK: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    DC: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Backward, part 2: dKV[idx] += dS^T Q + P^T dO (fp32 atomics, once per (query, slot), head
    block and column block; dS carries sm_scale) and dQ = dS KV[idx]. One program per (column block
    of DC, query, head block), the column block fastest, so the programs of one query run side by
    side and share its P / dS tiles in L2. Small programs (a [BK, DC] tile, Q and dO of DC columns)
    let several run per SM (4 with the 128-register cap), so their loads, products and atomics
    overlap: the latency of its loads is what bounds this kernel. Blocks past d_v only add dS^T
    Q."""
    c0 = tl.program_id(0) * DC
    t = row0 + tl.program_id(1)
    offs_h = tl.program_id(2) * BH + tl.arange(0, BH)
    hmask = offs_h < H
    t64 = t.to(tl.int64)
    qrow = q_ptr + t64 * stride_qt + offs_h[:, None] * stride_qh
    dorow = do_ptr + t64 * stride_dot + offs_h[:, None] * stride_doh
    dqrow = dq_ptr + t64 * stride_dqt + offs_h[:, None] * stride_dqh
    idx_row = idx_ptr + t64 * stride_it
    kend = tl.load(kend_ptr + t)
    prow = (t - row0).to(tl.int64) * stride_pt + offs_h[None, :]  # [1, BH]
    offs_c = c0 + tl.arange(0, DC)
    if c0 < DA:
        _grad_block(
            kv_ptr,
            p_ptr,
            ds_ptr,
            dkv_ptr,
            dq_ptr,
            idx_row,
            kend,
            T,
            K,
            qrow,
            dorow,
            prow,
            dqrow,
            stride_kvt,
            stride_pk,
            stride_dkvt,
            hmask,
            offs_c,
            DA,
            DQK,
            BH,
            BK,
            DC,
            True,
            IEEE,
        )
    else:
        _grad_block(
            kv_ptr,
            p_ptr,
            ds_ptr,
            dkv_ptr,
            dq_ptr,
            idx_row,
            kend,
            T,
            K,
            qrow,
            dorow,
            prow,
            dqrow,
            stride_kvt,
            stride_pk,
            stride_dkvt,
            hmask,
            offs_c,
            DA,
            DQK,
            BH,
            BK,
            DC,
            False,
            IEEE,
        )


def _config(h: int, d_qk: int, d_v: int, part: str = "fwd"):
    """Launch parameters of one kernel, ``(constexprs, num_warps, num_stages)``: the defaults for
    the shape with the part's active ``tuning`` overrides laid over them. part: "fwd", "bwd_ps"
    (backward part 1), "bwd_grad" (part 2)."""
    dap = pow2(d_v)
    db = d_qk - d_v
    dbp = pow2(db) if db > 0 else 16
    big = dap >= 256
    bh = min(pow2(h), 64)
    num_warps = 8 if big else 4
    if part == "fwd":
        bk, num_stages = (64, 2) if big else (16, 2)
        cfg = dict(DA=d_v, DB=db, DAP=dap, DBP=dbp, BH=bh, BK=bk, HAS_B=db > 0)
    elif part == "bwd_ps":
        # 64 heads x 64 slots unpipelined measured best on one H200 (43.96 ms at T = 32K against
        # 59.1 with 32 slots and 2 stages; 128 registers, 217 KB shared memory)
        bk, num_stages = (64, 1) if big else (16, 2)
        cfg = dict(DA=d_v, DB=db, DAP=dap, DBP=dbp, BH=bh, BK=bk, HAS_B=db > 0)
    elif part == "bwd_grad":
        # 64 slots per step: the dKV tile is the M side of the products (wgmma needs M >= 64); one
        # warpgroup per [64, DC] tile. DC = 64 unpipelined (41 KB shared memory) measured best on
        # one H200 at T = 4K and 32K (DC = 128: 3% slower with 1 stage, 50% slower with 2; 8 warps
        # 50% slower; 128 slots per step 11% slower). The kernel is latency-bound (ncu: 3 warps per
        # scheduler, half the stalls on global loads), so registers are capped at 128 (from 146): 4
        # programs per SM instead of 3, 4-7% less backward time at 32K, 3.5-4.5% at 4K in two calls
        # (96: 5 per SM, 21% slower; bench/results/2026-12-01_h200_dsa_kernels.md)
        bk, num_stages = (64, 1) if big else (16, 2)
        num_warps = 4
        cfg = dict(DA=d_v, DQK=d_qk, BH=bh, BK=bk, DC=64)
        if big:
            cfg["maxnreg"] = 128
    else:
        raise ValueError(f"unknown kernel part {part!r}")
    tune = tuning.overrides("sparse_mla", part)
    num_warps = tune.pop("num_warps", num_warps)
    num_stages = tune.pop("num_stages", num_stages)
    cfg.update(tune)
    if part == "bwd_grad" and big and cfg["DC"] not in (64, 128):
        # DC = 32 at 64 heads x 576 faulted with an illegal memory access on one H200 under Triton
        # 3.6 (every run, T = 512, 1024 and 32K; bench/results/2026-11-30_h200_dsa_kernels.md); 64
        # and 128 are checked on the GPU
        raise ValueError(f"sparse_mla bwd_grad DC = {cfg['DC']}: at d_v >= 256 use 64 or 128")
    return cfg, num_warps, num_stages


def _check(q, kv, indices, d_v):
    if q.dim() != 3 or kv.dim() != 2 or indices.dim() != 2:
        raise ValueError(
            f"expected q [T,H,D], kv [T,D], indices [T,K]; got {tuple(q.shape)}, "
            f"{tuple(kv.shape)}, "
            f"{tuple(indices.shape)}"
        )
    if kv.shape[1] != q.shape[2] or indices.shape[0] != q.shape[0] or not 0 < d_v <= q.shape[2]:
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, kv {tuple(kv.shape)}, indices "
            f"{tuple(indices.shape)}, d_v {d_v}"
        )
    check_device(q, kv, indices)


def valid_extent(indices: torch.Tensor) -> torch.Tensor:
    """int32 ``[T]``: 1 + the slot of each row's last valid index (0 for a row without one). The
    kernels walk only these slots: the indexer pads rows with fewer visible keys than top-k with a
    -1 tail, which at short contexts is a large share of the slots (at T = 4K, a quarter)."""
    k = indices.shape[1]
    if k == 0:
        return torch.zeros(indices.shape[0], dtype=torch.int32, device=indices.device)
    slot = torch.arange(1, k + 1, device=indices.device, dtype=torch.int32)
    return torch.where(indices >= 0, slot, 0).amax(dim=1).to(torch.int32)


def _gluon_parts(q, kv, d_v, gluon: bool) -> set[str]:
    """The parts ("fwd", "bwd_ps", "bwd_grad") that run the Gluon kernels of ``sparse_mla_ws`` for
    this call: with ``gluon``, where ``sparse_mla_ws.supported`` holds, not under the interpreter
    (Gluon has no interpreter mode), and the part not disabled by a ``tuning`` override of its
    ``enable``."""
    if not gluon or interpreting() or not _ws.supported(q, kv, d_v):
        return set()
    return {part for part in ("fwd", "bwd_ps", "bwd_grad") if _ws.config(part)["enable"]}


def _fwd(q, kv, indices, kend, sm_scale, d_v, gluon: bool = True):
    """(out, lse) of the forward; ``gluon`` as in ``sparse_mla``."""
    total, h, d_qk = q.shape
    out = torch.empty((total, h, d_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((total, h), dtype=torch.float32, device=q.device)
    if total == 0:
        return out, lse
    if "fwd" in _gluon_parts(q, kv, d_v, gluon):
        _ws.fwd(q, kv, indices, kend, sm_scale * LOG2E, out, lse)
        return out, lse
    c, nw, ns = _config(h, d_qk, d_v)
    grid = (total, triton.cdiv(h, c["BH"]))
    _fwd_kernel[grid](
        q,
        kv,
        indices,
        kend,
        out,
        lse,
        kv.shape[0],
        h,
        indices.shape[1],
        sm_scale * LOG2E,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        indices.stride(0),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        IEEE=q.dtype == torch.float32,
        num_warps=nw,
        num_stages=ns,
        **c,
    )
    return out, lse


SCRATCH_BYTES = 1 << 30  # P and dS of one chunk of queries (backward)


MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension, where part 2 puts a chunk's rows


def chunk_rows(
    total: int, h: int, n_k: int, element_size: int, scratch_bytes: int = SCRATCH_BYTES
) -> int:
    """Queries per backward chunk: as many as fit P and dS ([rows, n_k, h] each) in
    ``scratch_bytes``, at least 1, and at most MAX_GRID_Y (reached with a small top-k: 64 slots at
    64 heads would fit 65,536 rows)."""
    return max(1, min(total, MAX_GRID_Y, scratch_bytes // max(1, 2 * h * n_k * element_size)))


def _triton_bwd_ps(
    q, kv, indices, kend, out, grad_out, lse, p, ds, sm_scale, row0, n, cfg=None, tgt=None
):
    """The Triton part 1 for rows row0 .. row0 + n - 1 into the scratches p, ds (same contract as
    ``sparse_mla_ws.bwd_ps``, with its ``tgt``); cfg: ``_config(..., "bwd_ps")`` when the caller
    has it."""
    h, d_qk = q.shape[1:]
    c, nw, ns = cfg or _config(h, d_qk, out.shape[2], "bwd_ps")
    head_blocks = triton.cdiv(h, c["BH"])
    if tgt is not None and head_blocks > 1:
        tgt[row0 : row0 + n].zero_()  # the head blocks add their sums
    _bwd_ps_kernel[(n, head_blocks)](
        q,
        kv,
        indices,
        kend,
        out,
        grad_out,
        lse,
        p,
        ds,
        p if tgt is None else tgt,
        kv.shape[0],
        h,
        indices.shape[1],
        sm_scale,
        row0,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        indices.stride(0),
        out.stride(0),
        out.stride(1),
        grad_out.stride(0),
        grad_out.stride(1),
        lse.stride(0),
        p.stride(0),
        p.stride(1),
        0 if tgt is None else tgt.stride(0),
        IEEE=q.dtype == torch.float32,
        TGT=0 if tgt is None else (1 if head_blocks == 1 else 2),
        num_warps=nw,
        num_stages=ns,
        **c,
    )


def _triton_bwd_grad(q, kv, indices, kend, grad_out, p, ds, dkv, dq, row0, n, cfg=None):
    """The Triton part 2 for rows row0 .. row0 + n - 1 (same contract as
    ``sparse_mla_ws.bwd_grad``); cfg: ``_config(..., "bwd_grad")`` when the caller has it."""
    h, d_qk = q.shape[1:]
    c, nw, ns = cfg or _config(h, d_qk, grad_out.shape[2], "bwd_grad")
    _bwd_grad_kernel[(triton.cdiv(d_qk, c["DC"]), n, triton.cdiv(h, c["BH"]))](
        q,
        kv,
        indices,
        kend,
        grad_out,
        p,
        ds,
        dkv,
        dq,
        kv.shape[0],
        h,
        indices.shape[1],
        row0,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        indices.stride(0),
        grad_out.stride(0),
        grad_out.stride(1),
        p.stride(0),
        p.stride(1),
        dkv.stride(0),
        dq.stride(0),
        dq.stride(1),
        IEEE=q.dtype == torch.float32,
        num_warps=nw,
        num_stages=ns,
        **c,
    )


def _bwd(q, kv, indices, kend, out, lse, grad_out, sm_scale, d_v, gluon: bool = True, tgt=None):
    """(dq, dkv): part 1 (P and dS, q's dtype, into a scratch) then part 2 (dKV, dQ), per chunk of
    queries; ``gluon`` as in ``sparse_mla``. With ``tgt [T, K]`` (fp32) part 1 also writes there
    the head sum of P per slot (slots at or past a row's valid extent are left as they are)."""
    total, h, d_qk = q.shape
    n_k = indices.shape[1]
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    if total == 0:
        return dq, dkv.to(kv.dtype)
    cfg_ps, cfg_grad = _config(h, d_qk, d_v, "bwd_ps"), _config(h, d_qk, d_v, "bwd_grad")
    budget = tuning.overrides("sparse_mla", "bwd").get("scratch_bytes", SCRATCH_BYTES)
    rows = chunk_rows(total, h, n_k, q.element_size(), budget)
    p = torch.empty((rows, n_k, h), dtype=q.dtype, device=q.device)
    ds = torch.empty_like(p)
    parts = _gluon_parts(q, kv, d_v, gluon)
    for a in range(0, total, rows):
        n = min(rows, total - a)
        if "bwd_ps" in parts:
            _ws.bwd_ps(q, kv, indices, kend, out, grad_out, lse, p, ds, sm_scale, a, n, tgt)
        else:
            _triton_bwd_ps(
                q, kv, indices, kend, out, grad_out, lse, p, ds, sm_scale, a, n, cfg_ps, tgt
            )
        if "bwd_grad" in parts:
            _ws.bwd_grad(q, kv, indices, kend, grad_out, p, ds, dkv, dq, a, n)
        else:
            _triton_bwd_grad(q, kv, indices, kend, grad_out, p, ds, dkv, dq, a, n, cfg_grad)
    return dq, dkv.to(kv.dtype)


INT32_LIMIT = 2**31


def _contig(x: torch.Tensor) -> torch.Tensor:
    """``x`` with unit stride in its last dim, and in the standard layout where an offset along its
    inner dims passes int32: the kernels take each row's start in 64 bits but its heads' offsets
    (``h * stride_h``) in 32. The gradient of the absorbed value projection arrives as a ``[T, H,
    r]`` view with head stride ``T * r``, past 2^31 above 65K tokens at 64 heads (the gradient
    defect of bench/results/2026-12-03_h200_long_context.md)."""
    inner = max((n - 1) * st for n, st in zip(x.shape[1:], x.stride()[1:])) if x.dim() > 1 else 0
    return x if x.stride(-1) == 1 and inner < INT32_LIMIT else x.contiguous()


class _SparseMLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, indices, sm_scale, d_v, gluon):
        q, kv, indices = _contig(q), _contig(kv.to(q.dtype)), _contig(indices.to(torch.int32))
        kend = valid_extent(indices)
        out, lse = _fwd(q, kv, indices, kend, sm_scale, d_v, gluon)
        ctx.save_for_backward(q, kv, indices, kend, out, lse)
        ctx.sm_scale, ctx.d_v, ctx.gluon = sm_scale, d_v, gluon
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, kv, indices, kend, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        grad_out = _contig(grad_out.to(out.dtype))
        dq, dkv = _bwd(q, kv, indices, kend, out, lse, grad_out, ctx.sm_scale, ctx.d_v, ctx.gluon)
        return dq, dkv, None, None, None, None


def sparse_mla(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int,
    *,
    gluon: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``reference.sparse_mla``: ``(out [T, H, d_v], lse [T, H] fp32)``,
    differentiable in q and kv.

    ``gluon``: True runs the warp-specialised Gluon kernels (``sparse_mla_ws``) where they apply
    (CUDA sm_90, GLM-5.2's shape, not under the interpreter) and the Triton kernels elsewhere; False
    runs the Triton kernels only. The backward takes the forward's choice."""
    _check(q, kv, indices, d_v)
    return _SparseMLA.apply(q, kv, indices, float(sm_scale), int(d_v), bool(gluon))


def compile_specs(small: bool = False):
    """Launch configurations for ``bench/compile_check.py`` (offline sm_90 compile)."""
    h, d_qk, d_v = (4, 24, 16) if small else (64, 576, 512)
    out = []
    for name, fn, part, tgt in (
        ("sparse_mla_fwd", _fwd_kernel, "fwd", 0),
        ("sparse_mla_bwd_ps", _bwd_ps_kernel, "bwd_ps", 0),
        ("sparse_mla_bwd_ps_kl", _bwd_ps_kernel, "bwd_ps", 1),
        ("sparse_mla_bwd_grad", _bwd_grad_kernel, "bwd_grad", 0),
    ):
        c, nw, ns = _config(h, d_qk, d_v, part)
        c.update(IEEE=False, TGT=tgt)
        sig = {
            n: "i32" for n in fn.arg_names if n.startswith("stride") or n in ("T", "H", "K", "row0")
        }
        sig.update({n: "*bf16" for n in fn.arg_names if n.endswith("_ptr")})
        sig.update(
            {
                "idx_ptr": "*i32",
                "kend_ptr": "*i32",
                "lse_ptr": "*fp32",
                "qk_scale": "fp32",
                "sm_scale": "fp32",
                "dkv_ptr": "*fp32",
                "tgt_ptr": "*fp32",
            }
        )
        sig = {k: v for k, v in sig.items() if k in fn.arg_names}
        div = tuple(
            n
            for n in fn.arg_names
            if n.endswith("_ptr")
            or (n.startswith("stride") and not n.endswith("h") and n != "stride_lt")
        )
        opts = {k: c[k] for k in ("maxnreg",) if k in c}
        out.append(
            (name, (fn, sig, {k: v for k, v in c.items() if k in fn.arg_names}, nw, ns, div, opts))
        )
    return out


__all__ = ["sparse_mla"]
