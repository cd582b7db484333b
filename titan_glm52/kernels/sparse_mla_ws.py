"""Warp-specialised sparse MLA kernels for Hopper (sm_90), written in Triton's Gluon dialect: the
forward and both parts of the backward.

Same math and outputs as the Triton kernels of ``sparse_mla`` (``_fwd_kernel``, ``_bwd_ps_kernel``,
``_bwd_grad_kernel``), for the shape GLM-5.2 has: 64 heads, d_qk = 576 = 512 latent + 64 rope, d_v =
512, bf16. Each kernel has a loader warpgroup that gathers the selected kv rows (``cp.async``,
invalid slots clamped or zero-filled) into a ring of shared memory and signals each stage on an
mbarrier (``cp.async.mbarrier.arrive.noinc``, every loader thread), and consumer warpgroups that run
``wgmma`` from shared memory and release each stage when their products are done; each warpgroup
gets its own register budget.

* forward, one program per query row: the softmax warpgroup (the default partition) computes S = Q
  K^T [64 heads, 64 slots], the online softmax, hands P (bf16) and the rescale to the other consumer
  through shared memory and accumulates O[:, :256] += P V[:, :256]; the second consumer accumulates
  O[:, 256:] for the same step while the softmax warpgroup already waits for the next stage (the
  schedule of FlashMLA's and TileLang's pipelined sparse forward; an independent implementation);
* backward part 1 (P, dS into the scratch), one program per query row: two consumers take alternate
  steps of 64 rows, so one's exponentials and scratch stores overlap the other's products; the rows
  arrive in 64-column chunks through a ring of chunk slots (each consumer its half and its own
  loader), which is what lets a 64-row step fit beside Q and dO in shared memory;
* backward part 2 (dKV by fp32 atomics, dQ), one program per (192-column group, query row): the
  loader streams the P / dS tiles and the group's kv columns, three consumers (one per 64-column
  chunk) run the products and the atomics of every step.

Gluon has no interpreter mode: these kernels run on the GPU only
(``tests/kernels/test_kernels_gpu.py`` checks them against the fp32 reference and the Triton
kernels). ``sparse_mla`` uses them where ``supported`` holds and its caller asks for them
(``gluon=True``), unless a ``tuning`` override disables a part (``enable``); the Triton kernels
everywhere else.
"""

from __future__ import annotations

import torch
import triton

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import tuning

H = 64  # heads (the M side of every wgmma)
DA = 512  # latent part of a kv row (= d_v)
DB = 64  # rope part
DH = 256  # output columns per consumer warpgroup
# every loader thread arrives (cp.async.mbarrier.arrive.noinc) on the stage's barrier
LOADER_ARRIVALS = 128


@gluon.jit
def _kv_rows(idx_row, i, K, T, stride_kvt, BK: gl.constexpr, layout: gl.constexpr):
    """Row offsets into kv of step i's BK slots (the slice of ``layout`` along its rows); invalid
    slots read row 0 (finite; the softmax gives them probability 0)."""
    offs = i * BK + gl.arange(0, BK, layout=gl.SliceLayout(1, layout))
    idx = gl.load(idx_row + offs, mask=offs < K, other=-1)
    return gl.where((idx >= 0) & (idx < T), idx, 0).to(gl.int64) * stride_kvt


@gluon.jit
def _loader(
    kv_a,
    kv_b,
    kv_full,
    kv_empty,
    kv_ptr,
    idx_ptr,
    kend_ptr,
    T,
    K,
    stride_kvt,
    stride_it,
    row0,
    BK: gl.constexpr,
    DA: gl.constexpr,
    DB: gl.constexpr,
    STAGES: gl.constexpr,
    IDX_EARLY: gl.constexpr,
):
    """Gathers kv[idx[t, i*BK : (i+1)*BK]] of every step i of row t = row0 + program id into stage i
    % STAGES. IDX_EARLY: the step's indices are loaded before waiting for its stage to be freed, so
    the gather starts as soon as it is (False: after, so each refill first pays the index load's
    round trip)."""
    la: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    lb: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    t = row0 + gl.program_id(0)
    idx_row = idx_ptr + t.to(gl.int64) * stride_it
    kend = gl.load(kend_ptr + t)
    cols_a = gl.arange(0, DA, layout=gl.SliceLayout(0, la))
    cols_b = DA + gl.arange(0, DB, layout=gl.SliceLayout(0, lb))
    for i in range(gl.cdiv(kend, BK)):
        s = i % STAGES
        if IDX_EARLY:
            row_a = _kv_rows(idx_row, i, K, T, stride_kvt, BK, la)
            row_b = _kv_rows(idx_row, i, K, T, stride_kvt, BK, lb)
        mbarrier.wait(kv_empty.index(s), ((i // STAGES) & 1) ^ 1)
        if not IDX_EARLY:
            row_a = _kv_rows(idx_row, i, K, T, stride_kvt, BK, la)
        async_copy.async_copy_global_to_shared(
            kv_a.index(s), kv_ptr + row_a[:, None] + cols_a[None, :]
        )
        if not IDX_EARLY:
            row_b = _kv_rows(idx_row, i, K, T, stride_kvt, BK, lb)
        async_copy.async_copy_global_to_shared(
            kv_b.index(s), kv_ptr + row_b[:, None] + cols_b[None, :]
        )
        async_copy.mbarrier_arrive(kv_full.index(s), increment_count=False)


@gluon.jit
def _pv_right(
    kv_a,
    p_smem,
    a_smem,
    l_smem,
    kv_full,
    kv_empty,
    p_full,
    p_empty,
    l_ready,
    out_ptr,
    kend_ptr,
    stride_ot,
    stride_oh,
    BK: gl.constexpr,
    DH: gl.constexpr,
    H: gl.constexpr,
    STAGES: gl.constexpr,
):
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DH, 16]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    t = gl.program_id(0)
    kend = gl.load(kend_ptr + t)
    acc = gl.zeros([H, DH], gl.float32, o_layout)
    for i in range(gl.cdiv(kend, BK)):
        s = i % STAGES
        mbarrier.wait(kv_full.index(s), (i // STAGES) & 1)
        mbarrier.wait(p_full, i & 1)
        fence_async_shared()
        alpha = a_smem.load(row_layout)
        acc = acc * alpha[:, None]
        acc = warpgroup_mma(p_smem, kv_a.index(s).slice(DH, DH, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(p_empty, count=1)
        mbarrier.arrive(kv_empty.index(s), count=1)
    mbarrier.wait(l_ready, 0)
    linv = l_smem.load(row_layout)
    out = (acc * linv[:, None]).to(out_ptr.dtype.element_ty)
    rows = gl.arange(0, H, layout=row_layout)
    cols = DH + gl.arange(0, DH, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + t.to(gl.int64) * stride_ot + rows[:, None] * stride_oh + cols[None, :], out)


@gluon.jit
def _issue_scores(q_a, q_b, kv_a, kv_b, kv_full, i, s_zero, STAGES: gl.constexpr):
    """S = Q K^T of step i, issued asynchronously once its stage has landed."""
    s = i % STAGES
    mbarrier.wait(kv_full.index(s), (i // STAGES) & 1)
    fence_async_shared()
    sc = warpgroup_mma(q_a, kv_a.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return warpgroup_mma(q_b, kv_b.index(s).permute((1, 0)), sc, is_async=True)


@gluon.jit
def _valid_slots(idx_row, i, K, T, BK: gl.constexpr, layout: gl.constexpr):
    """Whether each of step i's BK slots holds a kv row (the slice of ``layout`` along its
    columns)."""
    offs = i * BK + gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    idx = gl.load(idx_row + offs, mask=offs < K, other=-1)
    return (idx >= 0) & (idx < T)


@gluon.jit
def _softmax_step(sc, valid, m_i, l_i, qk_scale):
    """Online softmax (base 2) over a step's scores: (P, rescale of the running output, new max, new
    sum)."""
    sc = gl.where(valid[None, :], sc * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sc, axis=1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: keep exp2 finite (= 0)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(sc - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _hand_off(p, alpha, i, p_smem, a_smem, p_full, p_empty):
    """P (bf16) and the rescale of step i to shared memory for both P V products, once the other
    consumer has finished with the previous ones."""
    mbarrier.wait(p_empty, (i & 1) ^ 1)
    p_smem.store(p.to(gl.bfloat16))
    a_smem.store(alpha)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(p_full, count=1)


@gluon.jit
def _softmax_left(
    q_a,
    q_b,
    kv_a,
    kv_b,
    p_smem,
    a_smem,
    l_smem,
    kv_full,
    kv_empty,
    p_full,
    p_empty,
    l_ready,
    idx_ptr,
    kend_ptr,
    out_ptr,
    lse_ptr,
    T,
    K,
    qk_scale,
    stride_it,
    stride_ot,
    stride_oh,
    stride_lt,
    BK: gl.constexpr,
    DH: gl.constexpr,
    H: gl.constexpr,
    STAGES: gl.constexpr,
    IDX_EARLY: gl.constexpr,
):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BK, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DH, 16]
    )
    srow: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow: gl.constexpr = gl.SliceLayout(1, o_layout)
    t = gl.program_id(0)
    idx_row = idx_ptr + t.to(gl.int64) * stride_it
    kend = gl.load(kend_ptr + t)
    m_i = gl.full([H], float("-inf"), gl.float32, srow)
    l_i = gl.zeros([H], gl.float32, srow)
    acc = gl.zeros([H, DH], gl.float32, o_layout)
    s_zero = gl.zeros([H, BK], gl.float32, s_layout)
    n = gl.cdiv(kend, BK)
    for i in range(n):
        s = i % STAGES
        sc = _issue_scores(q_a, q_b, kv_a, kv_b, kv_full, i, s_zero, STAGES)
        if IDX_EARLY:  # the valid slots load while the scores run
            valid = _valid_slots(idx_row, i, K, T, BK, s_layout)
        sc = warpgroup_mma_wait(0, deps=[sc])
        if not IDX_EARLY:
            valid = _valid_slots(idx_row, i, K, T, BK, s_layout)
        p, alpha, m_i, l_i = _softmax_step(sc, valid, m_i, l_i, qk_scale)
        _hand_off(p, alpha, i, p_smem, a_smem, p_full, p_empty)
        acc = acc * gl.convert_layout(alpha, orow)[:, None]
        acc = warpgroup_mma(p_smem, kv_a.index(s).slice(0, DH, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(kv_empty.index(s), count=1)
    has = l_i > 0.0
    linv = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
    l_smem.store(linv)
    gl.thread_barrier()
    mbarrier.arrive(l_ready, count=1)
    lse = gl.where(
        has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf")
    )
    rows = gl.arange(0, H, layout=srow)
    gl.store(lse_ptr + t.to(gl.int64) * stride_lt + rows, lse)
    out = (acc * gl.convert_layout(linv, orow)[:, None]).to(out_ptr.dtype.element_ty)
    orows = gl.arange(0, H, layout=orow)
    cols = gl.arange(0, DH, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + t.to(gl.int64) * stride_ot + orows[:, None] * stride_oh + cols[None, :], out)


@gluon.jit
def _copy_rows(smem, base, stride_h, col0, H: gl.constexpr, D: gl.constexpr):
    """cp.async of base[h * stride_h + col0 + (0..D)] for the H heads into smem [H, D] (4 warps)."""
    layout: gl.constexpr = (
        gl.BlockedLayout([1, 8], [32 * 8 // D, D // 8], [4, 1], [1, 0])
        if D < 256
        else gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    )
    h = gl.arange(0, H, layout=gl.SliceLayout(1, layout))
    c = col0 + gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    async_copy.async_copy_global_to_shared(smem, base + h[:, None] * stride_h + c[None, :])


@gluon.jit
def _fwd_ws_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    kend_ptr,
    out_ptr,
    lse_ptr,
    T,
    K,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_it,
    stride_ot,
    stride_oh,
    stride_lt,
    H: gl.constexpr,
    DA: gl.constexpr,
    DB: gl.constexpr,
    DH: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    LOADER_ARRIVALS: gl.constexpr,
    PV_REGS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
    IDX_EARLY: gl.constexpr,
):
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    la: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, DA], dtype)
    lb: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, DB], dtype)
    q_a = gl.allocate_shared_memory(dtype, [H, DA], la)
    q_b = gl.allocate_shared_memory(dtype, [H, DB], lb)
    kv_a = gl.allocate_shared_memory(dtype, [STAGES, BK, DA], la)
    kv_b = gl.allocate_shared_memory(dtype, [STAGES, BK, DB], lb)
    p_smem = gl.allocate_shared_memory(
        dtype, [H, BK], gl.NVMMASharedLayout.get_default_for([H, BK], dtype)
    )
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    a_smem = gl.allocate_shared_memory(gl.float32, [H], vec)
    l_smem = gl.allocate_shared_memory(gl.float32, [H], vec)
    kv_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    l_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(kv_full.index(s), count=LOADER_ARRIVALS)
        mbarrier.init(kv_empty.index(s), count=2)  # both consumers release a stage
    mbarrier.init(p_full, count=1)
    mbarrier.init(p_empty, count=1)
    mbarrier.init(l_ready, count=1)

    # this row's queries into shared memory (all partitions start after this)
    t = gl.program_id(0)
    _copy_rows(q_a, q_ptr + t.to(gl.int64) * stride_qt, stride_qh, 0, H, DA)
    _copy_rows(q_b, q_ptr + t.to(gl.int64) * stride_qt, stride_qh, DA, H, DB)
    async_copy.commit_group()
    async_copy.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()

    gl.warp_specialize(
        [
            (
                _softmax_left,
                (
                    q_a,
                    q_b,
                    kv_a,
                    kv_b,
                    p_smem,
                    a_smem,
                    l_smem,
                    kv_full,
                    kv_empty,
                    p_full,
                    p_empty,
                    l_ready,
                    idx_ptr,
                    kend_ptr,
                    out_ptr,
                    lse_ptr,
                    T,
                    K,
                    qk_scale,
                    stride_it,
                    stride_ot,
                    stride_oh,
                    stride_lt,
                    BK,
                    DH,
                    H,
                    STAGES,
                    IDX_EARLY,
                ),
            ),
            (
                _pv_right,
                (
                    kv_a,
                    p_smem,
                    a_smem,
                    l_smem,
                    kv_full,
                    kv_empty,
                    p_full,
                    p_empty,
                    l_ready,
                    out_ptr,
                    kend_ptr,
                    stride_ot,
                    stride_oh,
                    BK,
                    DH,
                    H,
                    STAGES,
                ),
            ),
            (
                _loader,
                (
                    kv_a,
                    kv_b,
                    kv_full,
                    kv_empty,
                    kv_ptr,
                    idx_ptr,
                    kend_ptr,
                    T,
                    K,
                    stride_kvt,
                    stride_it,
                    0,
                    BK,
                    DA,
                    DB,
                    STAGES,
                    IDX_EARLY,
                ),
            ),
        ],
        [4, 4],
        [PV_REGS, LOADER_REGS],
    )


@gluon.jit
def _delta_to(d_smem, o_row, do_row, stride_oh, stride_doh, H: gl.constexpr, DA: gl.constexpr):
    """Delta = rowsum(O dO) per head of one query row into d_smem [H], in two halves of the columns
    (4 warps)."""
    half: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    h = gl.arange(0, H, layout=gl.SliceLayout(1, half))
    c = gl.arange(0, DA // 2, layout=gl.SliceLayout(0, half))
    o_base = o_row + h[:, None] * stride_oh + c[None, :]
    d_base = do_row + h[:, None] * stride_doh + c[None, :]
    delta = gl.sum(gl.load(o_base).to(gl.float32) * gl.load(d_base).to(gl.float32), axis=1)
    delta += gl.sum(
        gl.load(o_base + DA // 2).to(gl.float32) * gl.load(d_base + DA // 2).to(gl.float32), axis=1
    )
    d_smem.store(delta)


@gluon.jit
def _ps_slot(i, k, NCH: gl.constexpr, STAGES: gl.constexpr):
    """(ring slot, phase parity) of chunk k of step i: steps alternate between the two consumers,
    each with its own half of the ring (an mbarrier wait must never be more than one phase ahead of
    its barrier)."""
    half: gl.constexpr = STAGES // 2
    g = (i // 2) * NCH + k
    return (i % 2) * half + g % half, (g // half) & 1


@gluon.jit
def _ps_loader(
    ring,
    full,
    empty,
    kv_ptr,
    idx_ptr,
    kend_ptr,
    T,
    K,
    stride_kvt,
    stride_it,
    row0,
    BK: gl.constexpr,
    DC: gl.constexpr,
    NCH: gl.constexpr,
    STAGES: gl.constexpr,
    C: gl.constexpr,
):
    """Gathers the BK kv rows of consumer C's steps C, C + 2, ... of row t = row0 + program id one
    column chunk [BK, DC] at a time into the slots of ``_ps_slot`` (one loader per consumer and its
    half of the ring, so neither loader waits for the other consumer's slots). The step's indices
    load once, before its first chunk's wait."""
    # [BK, 64] tiles, 16-byte copies
    lt: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    t = row0 + gl.program_id(0)
    idx_row = idx_ptr + t.to(gl.int64) * stride_it
    kend = gl.load(kend_ptr + t)
    cols = gl.arange(0, DC, layout=gl.SliceLayout(0, lt))
    for i in range(C, gl.cdiv(kend, BK), 2):
        base = kv_ptr + _kv_rows(idx_row, i, K, T, stride_kvt, BK, lt)[:, None] + cols[None, :]
        for k in gl.static_range(NCH):
            s, ph = _ps_slot(i, k, NCH, STAGES)
            mbarrier.wait(empty.index(s), ph ^ 1)
            async_copy.async_copy_global_to_shared(ring.index(s), base + k * DC)
            async_copy.mbarrier_arrive(full.index(s), increment_count=False)


@gluon.jit
def _ps_consumer(
    q_c,
    do_c,
    ring,
    d_smem,
    full,
    empty,
    idx_ptr,
    kend_ptr,
    lse_ptr,
    p_ptr,
    ds_ptr,
    tgt_ptr,
    T,
    K,
    sm_scale,
    row0,
    stride_it,
    stride_lt,
    stride_pt,
    stride_pk,
    stride_gt,
    C: gl.constexpr,
    BK: gl.constexpr,
    H: gl.constexpr,
    NA: gl.constexpr,
    STAGES: gl.constexpr,
    TGT: gl.constexpr,
):
    """Steps C, C + 2, ... of one row, BK slots each: S = Q K^T and dP = dO V^T accumulated over the
    step's column chunks as they land (chunk k's slot is released once chunk k + 1's products are
    issued and chunk k's are done), then P = exp(S - lse), dS = P (dP - Delta) sm_scale into the
    scratch [rows, K, H] (heads innermost)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BK, 16]
    )
    row: gl.constexpr = gl.SliceLayout(1, s_layout)
    # stores: 8 consecutive heads of one slot per thread (16-byte stores into the heads-innermost
    # scratch)
    st: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
    t = row0 + gl.program_id(0)
    t64 = t.to(gl.int64)
    kend = gl.load(kend_ptr + t)
    lse = gl.load(lse_ptr + t64 * stride_lt + gl.arange(0, H, layout=row))
    # empty row -> P = 0
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = d_smem.load(row)
    qk_scale = sm_scale * 1.4426950408889634
    zero = gl.zeros([H, BK], gl.float32, s_layout)
    heads = gl.arange(0, H, layout=gl.SliceLayout(1, st))
    prow = (t - row0).to(gl.int64) * stride_pt
    idx_row = idx_ptr + t64 * stride_it
    for j in range(C, gl.cdiv(kend, BK), 2):
        s, ph = _ps_slot(j, 0, NA + 1, STAGES)
        mbarrier.wait(full.index(s), ph)
        fence_async_shared()
        kt = ring.index(s).permute((1, 0))
        sc = warpgroup_mma(q_c.index(0), kt, zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_c.index(0), kt, zero, use_acc=False, is_async=True)
        for k in gl.static_range(1, NA + 1):
            prev = s
            s, ph = _ps_slot(j, k, NA + 1, STAGES)
            mbarrier.wait(full.index(s), ph)
            fence_async_shared()
            kt = ring.index(s).permute((1, 0))
            sc = warpgroup_mma(q_c.index(k), kt, sc, is_async=True)
            if k < NA:
                dp = warpgroup_mma(do_c.index(k), kt, dp, is_async=True)
                sc, dp = warpgroup_mma_wait(2, deps=[sc, dp])
            else:  # the rope chunk: S only
                sc, dp = warpgroup_mma_wait(1, deps=[sc, dp])
            mbarrier.arrive(empty.index(prev), count=1)
        offs = j * BK + gl.arange(0, BK, layout=gl.SliceLayout(0, s_layout))
        idx = gl.load(idx_row + offs, mask=offs < K, other=-1)
        sc, dp = warpgroup_mma_wait(0, deps=[sc, dp])
        mbarrier.arrive(empty.index(s), count=1)
        p = gl.where(((idx >= 0) & (idx < T))[None, :], gl.exp2(sc * qk_scale - lse2[:, None]), 0.0)
        ds = p * (dp - delta[:, None]) * sm_scale  # gradient w.r.t. q.k
        slots = j * BK + gl.arange(0, BK, layout=gl.SliceLayout(0, st))
        offs_p = prow + slots[None, :] * stride_pk + heads[:, None]
        smask = (slots < K)[None, :] & (heads < H)[:, None]
        p_st = gl.convert_layout(p.to(p_ptr.dtype.element_ty), st)
        gl.store(p_ptr + offs_p, p_st, mask=smask)
        gl.store(ds_ptr + offs_p, gl.convert_layout(ds.to(ds_ptr.dtype.element_ty), st), mask=smask)
        if TGT:
            p_sum = gl.sum(p_st.to(gl.float32), axis=0)
            gl.store(tgt_ptr + t64 * stride_gt + slots, p_sum, mask=slots < K)


@gluon.jit
def _bwd_ps_ws_kernel(
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
    H: gl.constexpr,
    DA: gl.constexpr,
    DB: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    LOADER_ARRIVALS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
    TGT: gl.constexpr,
):
    """Backward part 1 (see ``sparse_mla._bwd_ps_kernel``), one program per query row of a chunk,
    with the kv rows streamed in column chunks of DB (= 64): Q and dO stay in shared memory as
    chunks [H, DB] (136 KB) and a ring of STAGES (even) chunk slots [BK, DB] carries each step's DA
    / DB + 1 chunks, so a step can be BK = 64 rows (wgmma N = 64) within shared memory. Two
    consumers take alternate steps, each with its own half of the ring and its own loader warpgroup,
    so one's exponentials and scratch stores overlap the other's products."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, DB], dtype)
    NA: gl.constexpr = DA // DB
    q_c = gl.allocate_shared_memory(dtype, [NA + 1, H, DB], tile)
    do_c = gl.allocate_shared_memory(dtype, [NA, H, DB], tile)
    ring = gl.allocate_shared_memory(dtype, [STAGES, BK, DB], tile)
    d_smem = gl.allocate_shared_memory(gl.float32, [H], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=LOADER_ARRIVALS)
        mbarrier.init(empty.index(s), count=1)

    t64 = (row0 + gl.program_id(0)).to(gl.int64)
    for c in gl.static_range(NA + 1):
        _copy_rows(q_c.index(c), q_ptr + t64 * stride_qt, stride_qh, c * DB, H, DB)
    for c in gl.static_range(NA):
        _copy_rows(do_c.index(c), do_ptr + t64 * stride_dot, stride_doh, c * DB, H, DB)
    async_copy.commit_group()
    _delta_to(
        d_smem, out_ptr + t64 * stride_ot, do_ptr + t64 * stride_dot, stride_oh, stride_doh, H, DA
    )
    async_copy.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()

    gl.warp_specialize(
        [
            (
                _ps_consumer,
                (
                    q_c,
                    do_c,
                    ring,
                    d_smem,
                    full,
                    empty,
                    idx_ptr,
                    kend_ptr,
                    lse_ptr,
                    p_ptr,
                    ds_ptr,
                    tgt_ptr,
                    T,
                    K,
                    sm_scale,
                    row0,
                    stride_it,
                    stride_lt,
                    stride_pt,
                    stride_pk,
                    stride_gt,
                    0,
                    BK,
                    H,
                    NA,
                    STAGES,
                    TGT,
                ),
            ),
            (
                _ps_consumer,
                (
                    q_c,
                    do_c,
                    ring,
                    d_smem,
                    full,
                    empty,
                    idx_ptr,
                    kend_ptr,
                    lse_ptr,
                    p_ptr,
                    ds_ptr,
                    tgt_ptr,
                    T,
                    K,
                    sm_scale,
                    row0,
                    stride_it,
                    stride_lt,
                    stride_pt,
                    stride_pk,
                    stride_gt,
                    1,
                    BK,
                    H,
                    NA,
                    STAGES,
                    TGT,
                ),
            ),
            (
                _ps_loader,
                (
                    ring,
                    full,
                    empty,
                    kv_ptr,
                    idx_ptr,
                    kend_ptr,
                    T,
                    K,
                    stride_kvt,
                    stride_it,
                    row0,
                    BK,
                    DB,
                    NA + 1,
                    STAGES,
                    0,
                ),
            ),
            (
                _ps_loader,
                (
                    ring,
                    full,
                    empty,
                    kv_ptr,
                    idx_ptr,
                    kend_ptr,
                    T,
                    K,
                    stride_kvt,
                    stride_it,
                    row0,
                    BK,
                    DB,
                    NA + 1,
                    STAGES,
                    1,
                ),
            ),
        ],
        [4, 4, 4],
        [CONSUMER_REGS, LOADER_REGS, LOADER_REGS],
    )


@gluon.jit
def _grad_program(n, NC: gl.constexpr, DC: gl.constexpr, GROUP_ROWS: gl.constexpr):
    """(chunk row, first column) of this part-2 program (``bwd_grad``'s 1-D grid). GROUP_ROWS = 0: a
    row's three column groups side by side (the group fastest); -1: one column group over every row,
    then the next; R > 0: blocks of R rows, the block's rows fastest and its groups one after
    another (the grid rounds n up to R; rows >= n have no work). The last two hit fewer dKV columns
    at a time."""
    pid = gl.program_id(0)
    if GROUP_ROWS == 0:
        r = pid // 3
        g = pid % 3
    elif GROUP_ROWS < 0:
        r = pid % n
        g = pid // n
    else:
        rem = pid % (3 * GROUP_ROWS)
        r = (pid // (3 * GROUP_ROWS)) * GROUP_ROWS + rem % GROUP_ROWS
        g = rem // GROUP_ROWS
    return r, g * (NC * DC)


@gluon.jit
def _grad_row(kend_ptr, row0, n, NC: gl.constexpr, DC: gl.constexpr, GROUP_ROWS: gl.constexpr):
    """(chunk row r, query row t, first column, whether r < n, its valid extent (0 past the
    chunk))."""
    r, c0 = _grad_program(n, NC, DC, GROUP_ROWS)
    live = r < n
    # a row past the chunk (GROUP_ROWS > 0) reads row n - 1 and does nothing
    t = row0 + gl.minimum(r, n - 1)
    kend = gl.where(live, gl.load(kend_ptr + t), 0)
    return r, t, c0, live, kend


@gluon.jit
def _grad_loader(
    kv_c,
    p_s,
    ds_s,
    full,
    empty,
    kv_ptr,
    idx_ptr,
    kend_ptr,
    p_ptr,
    ds_ptr,
    T,
    K,
    stride_kvt,
    stride_it,
    row0,
    n,
    stride_pt,
    stride_pk,
    BK: gl.constexpr,
    H: gl.constexpr,
    DC: gl.constexpr,
    NC: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_ROWS: gl.constexpr,
    IDX_EARLY: gl.constexpr,
):
    """Step i of row t: the P and dS tiles [BK slots, H] of the scratch and the NC column chunks
    [BK, DC] of the gathered kv rows (this program's column group) into stage i % STAGES; invalid
    slots read as zeros. IDX_EARLY: the step's indices load before the wait for its stage (see
    ``_loader``)."""
    # [BK, 64] tiles, 16-byte copies
    lt: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r, t, c0, live, kend = _grad_row(kend_ptr, row0, n, NC, DC, GROUP_ROWS)
    idx_row = idx_ptr + t.to(gl.int64) * stride_it
    prow = r.to(gl.int64) * stride_pt
    heads = gl.arange(0, H, layout=gl.SliceLayout(0, lt))
    cols = gl.arange(0, DC, layout=gl.SliceLayout(0, lt))
    for i in range(gl.cdiv(kend, BK)):
        s = i % STAGES
        slots = i * BK + gl.arange(0, BK, layout=gl.SliceLayout(1, lt))
        if IDX_EARLY:
            idx = gl.load(idx_row + slots, mask=slots < K, other=-1)
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        if not IDX_EARLY:
            idx = gl.load(idx_row + slots, mask=slots < K, other=-1)
        ok = (idx >= 0) & (idx < T)
        valid = ok[:, None]
        offs = prow + slots.to(gl.int64)[:, None] * stride_pk + heads[None, :]
        async_copy.async_copy_global_to_shared(p_s.index(s), p_ptr + offs, mask=valid)
        async_copy.async_copy_global_to_shared(ds_s.index(s), ds_ptr + offs, mask=valid)
        # clamped before addressing
        rows = gl.where(ok, idx, 0).to(gl.int64)[:, None] * stride_kvt + c0
        for c in gl.static_range(NC):
            async_copy.async_copy_global_to_shared(
                kv_c.index(s * NC + c), kv_ptr + rows + c * DC + cols[None, :], mask=valid
            )
        async_copy.mbarrier_arrive(full.index(s), increment_count=False)


@gluon.jit
def _grad_consumer(
    q_c,
    do_c,
    kv_c,
    p_s,
    ds_s,
    full,
    empty,
    idx_ptr,
    kend_ptr,
    dkv_ptr,
    dq_ptr,
    T,
    K,
    row0,
    n,
    stride_it,
    stride_dkvt,
    stride_dqt,
    stride_dqh,
    C: gl.constexpr,
    BK: gl.constexpr,
    H: gl.constexpr,
    DC: gl.constexpr,
    NC: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_ROWS: gl.constexpr,
):
    """Column chunk C of this program's group over every step: dKV[idx, cols] += dS^T Q_C + P^T dO_C
    (fp32 atomics, 16 bytes each) and dQ[:, cols] = sum over steps of dS KV[idx, cols]."""
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DC, 16]
    )
    red_l: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
    r, t, c0, live, kend = _grad_row(kend_ptr, row0, n, NC, DC, GROUP_ROWS)
    col0 = c0 + C * DC
    t64 = t.to(gl.int64)
    idx_row = idx_ptr + t64 * stride_it
    zero = gl.zeros([BK, DC], gl.float32, acc_l)
    dq = gl.zeros([H, DC], gl.float32, acc_l)
    cols = col0 + gl.arange(0, DC, layout=gl.SliceLayout(0, red_l))
    for i in range(gl.cdiv(kend, BK)):
        s = i % STAGES
        mbarrier.wait(full.index(s), (i // STAGES) & 1)
        fence_async_shared()
        ds_t = ds_s.index(s)
        kv = kv_c.index(s * NC + C)
        acc = warpgroup_mma(ds_t, q_c.index(C), zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(p_s.index(s), do_c.index(C), acc, is_async=True)
        dq = warpgroup_mma(ds_t.permute((1, 0)), kv, dq, is_async=True)
        slots = i * BK + gl.arange(0, BK, layout=gl.SliceLayout(1, red_l))
        idx = gl.load(idx_row + slots, mask=slots < K, other=-1)
        acc, dq = warpgroup_mma_wait(0, deps=[acc, dq])
        mbarrier.arrive(empty.index(s), count=1)
        valid = (idx >= 0) & (idx < T)
        rows = gl.where(valid, idx, 0).to(gl.int64)
        gl.atomic_add(
            dkv_ptr + rows[:, None] * stride_dkvt + cols[None, :],
            gl.convert_layout(acc, red_l),
            mask=valid[:, None],
            sem="relaxed",
        )
    heads = gl.arange(0, H, layout=gl.SliceLayout(1, acc_l))
    dcols = col0 + gl.arange(0, DC, layout=gl.SliceLayout(0, acc_l))
    gl.store(
        dq_ptr + t64 * stride_dqt + heads[:, None] * stride_dqh + dcols[None, :],
        dq.to(dq_ptr.dtype.element_ty),
        mask=live,
    )


@gluon.jit
def _bwd_grad_ws_kernel(
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
    K,
    row0,
    n,
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
    H: gl.constexpr,
    DA: gl.constexpr,
    BK: gl.constexpr,
    DC: gl.constexpr,
    NC: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_ROWS: gl.constexpr,
    LOADER_ARRIVALS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
    IDX_EARLY: gl.constexpr,
):
    """Backward part 2 (see ``sparse_mla._bwd_grad_kernel``): one program per (group of NC column
    chunks of DC, query row of the chunk; their order: ``_grad_program``). A loader warpgroup
    streams the P / dS tiles and the group's gathered kv columns through a ring of STAGES; NC
    consumer warpgroups, one per column chunk, run the products and the atomics of every step, so
    loads, products and atomics of different steps overlap."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, DC], dtype)
    q_c = gl.allocate_shared_memory(dtype, [NC, H, DC], tile)
    do_c = gl.allocate_shared_memory(dtype, [NC, H, DC], tile)
    kv_c = gl.allocate_shared_memory(dtype, [STAGES * NC, BK, DC], tile)
    p_s = gl.allocate_shared_memory(dtype, [STAGES, BK, H], tile)
    ds_s = gl.allocate_shared_memory(dtype, [STAGES, BK, H], tile)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=LOADER_ARRIVALS)
        mbarrier.init(empty.index(s), count=NC)

    # this row's Q and dO columns of the group (dO is zero past d_v: those chunks add dS^T Q only)
    lt: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r, t, c0, live, kend = _grad_row(kend_ptr, row0, n, NC, DC, GROUP_ROWS)
    t64 = t.to(gl.int64)
    h = gl.arange(0, H, layout=gl.SliceLayout(1, lt))
    cc = gl.arange(0, DC, layout=gl.SliceLayout(0, lt))
    for c in gl.static_range(NC):
        col = c0 + c * DC + cc
        async_copy.async_copy_global_to_shared(
            q_c.index(c), q_ptr + t64 * stride_qt + h[:, None] * stride_qh + col[None, :]
        )
        async_copy.async_copy_global_to_shared(
            do_c.index(c),
            do_ptr + t64 * stride_dot + h[:, None] * stride_doh + col[None, :],
            mask=(col < DA)[None, :],
        )
    async_copy.commit_group()
    async_copy.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()

    gl.warp_specialize(
        [
            (
                _grad_consumer,
                (
                    q_c,
                    do_c,
                    kv_c,
                    p_s,
                    ds_s,
                    full,
                    empty,
                    idx_ptr,
                    kend_ptr,
                    dkv_ptr,
                    dq_ptr,
                    T,
                    K,
                    row0,
                    n,
                    stride_it,
                    stride_dkvt,
                    stride_dqt,
                    stride_dqh,
                    0,
                    BK,
                    H,
                    DC,
                    NC,
                    STAGES,
                    GROUP_ROWS,
                ),
            ),
            (
                _grad_consumer,
                (
                    q_c,
                    do_c,
                    kv_c,
                    p_s,
                    ds_s,
                    full,
                    empty,
                    idx_ptr,
                    kend_ptr,
                    dkv_ptr,
                    dq_ptr,
                    T,
                    K,
                    row0,
                    n,
                    stride_it,
                    stride_dkvt,
                    stride_dqt,
                    stride_dqh,
                    1,
                    BK,
                    H,
                    DC,
                    NC,
                    STAGES,
                    GROUP_ROWS,
                ),
            ),
            (
                _grad_consumer,
                (
                    q_c,
                    do_c,
                    kv_c,
                    p_s,
                    ds_s,
                    full,
                    empty,
                    idx_ptr,
                    kend_ptr,
                    dkv_ptr,
                    dq_ptr,
                    T,
                    K,
                    row0,
                    n,
                    stride_it,
                    stride_dkvt,
                    stride_dqt,
                    stride_dqh,
                    2,
                    BK,
                    H,
                    DC,
                    NC,
                    STAGES,
                    GROUP_ROWS,
                ),
            ),
            (
                _grad_loader,
                (
                    kv_c,
                    p_s,
                    ds_s,
                    full,
                    empty,
                    kv_ptr,
                    idx_ptr,
                    kend_ptr,
                    p_ptr,
                    ds_ptr,
                    T,
                    K,
                    stride_kvt,
                    stride_it,
                    row0,
                    n,
                    stride_pt,
                    stride_pk,
                    BK,
                    H,
                    DC,
                    NC,
                    STAGES,
                    GROUP_ROWS,
                    IDX_EARLY,
                ),
            ),
        ],
        [4, 4, 4],
        [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS],
    )


# Launch parameters per part, measured on one H200; a benchmark lays variants over them with
# ``tuning.launch_overrides({"sparse_mla_ws": {part: {...}}})`` (keys: LAUNCH_KEYS, those of
# DEFAULTS). enable: ``sparse_mla`` (with gluon=True) takes this part's kernel where ``supported``
# holds (False: the Triton kernel, for comparisons). fwd: maxnreg: the launch's register cap (12
# warps x 168 fill the register file); pv_regs / loader_regs: the two workers' budgets (the softmax
# warpgroup gets the rest: 12 x 168 - 4 x (192 + 80) = 4 x 232); bk / stages: gathered rows per step
# and the depth of the ring (shared memory: Q 72 KB + stages x bk x 1152 B). bwd_ps: the backward's
# part 1 (two consumers on alternate steps of bk rows, each owning stages / 2 slots of a ring of
# 64-column chunks: Q, dO 136 KB + stages x bk x 128 B; a loader warpgroup per consumer; 16 warps x
# 128 registers: consumers 200, loaders 56). Whole backward at T = 32K: 81.9 ms, against 82.6 with
# one loader for both consumers and 85.3 with 32-row steps of whole rows in 2 stages; at 4K 7.66
# against 8.10 for the latter (bench/results/2026-12-02_h200_dsa_kernels.md). bwd_grad: part 2 (16
# warps x 128 registers: three consumers at 152, the loader 56; a ring of `stages` steps).
# group_rows: the programs' order, see _grad_program; -1, one column group at a time: 88.5 ms of
# backward at T = 32K against 91.3 with a row's groups side by side (0), 4K unchanged
# (bench/ws_bwd_sweep.py; bench/results/2026-12-01_h200_dsa_kernels.md). idx_early (forward, part
# 2): the loader loads a step's indices before it waits for the step's stage (the forward's softmax
# warpgroup its valid-slot mask while S = Q K^T runs; part 1's loaders always do); False: after
# (forward 21.04 against 21.36 ms, whole backward 86.2 against 87.3 ms at T = 32K;
# bench/results/2026-12-02_h200_dsa_kernels.md).
DEFAULTS = {
    "fwd": {
        "enable": True,
        "maxnreg": 168,
        "pv_regs": 192,
        "loader_regs": 80,
        "bk": 64,
        "stages": 2,
        "idx_early": True,
    },
    "bwd_ps": {
        "enable": True,
        "maxnreg": 128,
        "consumer_regs": 200,
        "loader_regs": 56,
        "bk": 64,
        "stages": 10,
    },
    "bwd_grad": {
        "enable": True,
        "maxnreg": 128,
        "consumer_regs": 152,
        "loader_regs": 56,
        "stages": 3,
        "group_rows": -1,
        "idx_early": True,
    },
}
LAUNCH_KEYS = {part: frozenset(cfg) for part, cfg in DEFAULTS.items()}


def config(part: str) -> dict:
    """The launch parameters of a part ("fwd", "bwd_ps", "bwd_grad"): ``DEFAULTS[part]`` with the
    part's active ``tuning`` overrides laid over them (a new dict)."""
    return {**DEFAULTS[part], **tuning.overrides("sparse_mla_ws", part)}


def supported(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> bool:
    """Whether ``fwd`` takes this call: CUDA sm_90, bf16, 64 heads, d_qk = 576, d_v = 512, unit
    inner strides."""
    return (
        q.is_cuda
        and q.dtype == torch.bfloat16
        and kv.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(q.device) == (9, 0)
        and q.dim() == 3
        and q.shape[1] == H
        and q.shape[2] == DA + DB
        and kv.shape[1] == DA + DB
        and d_v == DA
        and q.stride(2) == 1
        and kv.stride(1) == 1
    )


def fwd(q, kv, indices, kend, qk_scale_log2, out, lse):
    """Fill out [T, 64, 512] and lse [T, 64] (fp32); qk_scale_log2 = sm_scale * log2(e); kend from
    ``sparse_mla.valid_extent``."""
    total = q.shape[0]
    if total == 0:
        return
    c = config("fwd")
    _fwd_ws_kernel[(total,)](
        q,
        kv,
        indices,
        kend,
        out,
        lse,
        kv.shape[0],
        indices.shape[1],
        qk_scale_log2,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        indices.stride(0),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        H=H,
        DA=DA,
        DB=DB,
        DH=DH,
        BK=c["bk"],
        STAGES=c["stages"],
        LOADER_ARRIVALS=LOADER_ARRIVALS,
        PV_REGS=c["pv_regs"],
        LOADER_REGS=c["loader_regs"],
        IDX_EARLY=c["idx_early"],
        num_warps=4,
        maxnreg=c["maxnreg"],
    )


def bwd_ps(q, kv, indices, kend, out, grad_out, lse, p, ds, sm_scale, row0, n, tgt=None):
    """Part 1 of the backward for rows row0 .. row0 + n - 1 into the scratches p, ds [>= n, K,
    64]; with ``tgt [T, K]`` (fp32) also the head sum of P per slot of those rows (slots at or past
    a row's valid extent are left as they are)."""
    c = config("bwd_ps")
    if c["stages"] % 2 or c["stages"] < 4:
        # a consumer holds one slot while it waits for the next, so each half of the ring needs two
        raise ValueError(f"sparse_mla_ws bwd_ps stages must be even and >= 4, got {c['stages']}")
    _bwd_ps_ws_kernel[(n,)](
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
        H=H,
        DA=DA,
        DB=DB,
        BK=c["bk"],
        STAGES=c["stages"],
        LOADER_ARRIVALS=LOADER_ARRIVALS,
        CONSUMER_REGS=c["consumer_regs"],
        LOADER_REGS=c["loader_regs"],
        TGT=tgt is not None,
        num_warps=4,
        maxnreg=c["maxnreg"],
    )


def bwd_grad(q, kv, indices, kend, grad_out, p, ds, dkv, dq, row0, n):
    """Part 2 of the backward for rows row0 .. row0 + n - 1: dKV (fp32, atomics) and dQ from the
    scratches."""
    c = config("bwd_grad")
    nc, dc, rows = 3, 64, c["group_rows"]  # three column groups of 192 (_grad_program's order)
    _bwd_grad_ws_kernel[(3 * (triton.cdiv(n, rows) * rows if rows > 0 else n),)](
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
        indices.shape[1],
        row0,
        n,
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
        H=H,
        DA=DA,
        BK=64,
        DC=dc,
        NC=nc,
        STAGES=c["stages"],
        GROUP_ROWS=c["group_rows"],
        LOADER_ARRIVALS=LOADER_ARRIVALS,
        CONSUMER_REGS=c["consumer_regs"],
        LOADER_REGS=c["loader_regs"],
        IDX_EARLY=c["idx_early"],
        num_warps=4,
        maxnreg=c["maxnreg"],
    )


def compile_specs(small: bool = False):
    """Launch configurations for ``bench/compile_check.py`` (offline sm_90 compile: registers,
    spills, shared memory), with the active ``tuning`` overrides. These kernels exist at GLM-5.2's
    shape only, so ``small`` gives the same ones."""
    ptr = {
        n: "*bf16" for n in ("q_ptr", "kv_ptr", "out_ptr", "do_ptr", "p_ptr", "ds_ptr", "dq_ptr")
    }
    ptr.update(
        idx_ptr="*i32",
        kend_ptr="*i32",
        lse_ptr="*fp32",
        dkv_ptr="*fp32",
        tgt_ptr="*fp32",
        qk_scale="fp32",
        sm_scale="fp32",
    )
    f, p1, p2 = config("fwd"), config("bwd_ps"), config("bwd_grad")
    kernels = (
        (
            "sparse_mla_ws_fwd",
            _fwd_ws_kernel,
            f,
            dict(
                H=H,
                DA=DA,
                DB=DB,
                DH=DH,
                BK=f["bk"],
                STAGES=f["stages"],
                PV_REGS=f["pv_regs"],
                LOADER_REGS=f["loader_regs"],
            ),
        ),
        *(
            (
                f"sparse_mla_ws_bwd_ps{suffix}",
                _bwd_ps_ws_kernel,
                p1,
                dict(
                    H=H,
                    DA=DA,
                    DB=DB,
                    BK=p1["bk"],
                    STAGES=p1["stages"],
                    CONSUMER_REGS=p1["consumer_regs"],
                    LOADER_REGS=p1["loader_regs"],
                    TGT=tgt,
                ),
            )
            for suffix, tgt in (("", False), ("_kl", True))  # with the KL's target or without
        ),
        (
            "sparse_mla_ws_bwd_grad",
            _bwd_grad_ws_kernel,
            p2,
            dict(
                H=H,
                DA=DA,
                BK=64,
                DC=64,
                NC=3,
                STAGES=p2["stages"],
                GROUP_ROWS=p2["group_rows"],
                CONSUMER_REGS=p2["consumer_regs"],
                LOADER_REGS=p2["loader_regs"],
            ),
        ),
    )
    out = []
    for name, fn, c, consts in kernels:
        consts.update(
            LOADER_ARRIVALS=LOADER_ARRIVALS,
            **({"IDX_EARLY": c["idx_early"]} if "idx_early" in c else {}),
        )
        sig = {n: ptr.get(n, "i32") for n in fn.arg_names if n not in consts}
        out.append((name, (fn, sig, consts, 4, 1, (), {"maxnreg": c["maxnreg"]})))
    return out
