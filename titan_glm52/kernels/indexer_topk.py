"""Triton lightning indexer with exact, deterministic top-k over packed documents.

Contract: ``reference.indexer_topk``. Score of key s for query t is ``sum_h w[t,h] * relu(q[t,h] .
k[s]) * scale`` over the keys ``start(t) <= s <= t`` of t's document; the result holds the global
rows of the ``topk`` best keys (ties: lower row wins, exactly like the reference's stable sort)
followed by ``-1`` padding. Within a row the selected rows come in two runs, each in ascending row
order: those above the threshold band of the selection below, then those picked from the band; not
in score order.

How (per chunk of R query rows, so memory is O(R * longest document), never [T, T]):

1. ``_score_kernel`` (on Hopper at GLM-5.2's indexer shape, unless the caller passes
   ``gluon=False``: ``indexer_topk_ws``'s warp-specialised Gluon kernel, the same scores): BQ
   queries x all heads per program; streams the key tiles of the documents once, computes
   ``K_tile @ Q^T`` on tensor cores, ReLU, weight and head sum in registers, and writes one fp32
   score per visible (query, key) pair into the chunk's scratch, plus the row's max and min. Rows
   with at most ``topk`` visible keys are skipped (they keep all their keys).
2. ``_select_kernel``: one program per row. Pass 1: a 256-bin histogram of every 8th score
   (``SAMPLE``), bucketed linearly between the row's min and max; from it a band of buckets that
   holds the threshold with a margin of four standard deviations of the estimate. Pass 2: emit every
   key above the band, stash the band's keys (score + row, in row order). Then an exact 4 x 8-bit
   radix select on the stash (order-preserving int32 image of the fp32 score) and an emission that
   takes the lowest rows among exact ties. Where the band missed the threshold (a misleading sample)
   or outgrew the stash (massive ties), the radix select runs on the whole row instead: slower, same
   result.

-0.0 is canonicalised to +0.0 so that bit-level ties agree with the float comparison of the
reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import indexer_topk_ws as _ws
from . import tuning
from ._triton_env import check_device, interpreting, pow2

SCRATCH_BYTES = 1 << 30  # budget for one chunk's scores (fp32) + stash
# threshold-bucket candidates kept per row before falling back to a full-row radix select
STASH_CAP = 16384
NBINS = 256

# launch parameters (chosen on one H200 at T = 32K, bench/results/2026-11-30_h200_dsa_kernels.md); a
# benchmark lays variants over them with ``tuning.launch_overrides({"indexer_topk": {part:
# {...}}})``, keys as in LAUNCH_KEYS: also the scoring's BQ (queries per program; by default from
# the heads, ``_config``) and the selection's "skip" (no selection: times the scoring alone)
SCORE_LAUNCH = {"BN": 64, "num_warps": 8, "num_stages": 3}
# the selection's pass 1 histograms every SAMPLE-th key (1 = every key); the stashed band reaches
# MARGIN standard deviations of that estimate to either side of it. Every 8th key took the indexer +
# top-2048 at 32K from 13.55 to 12.63 ms on an H100, ahead of every 4th and every 16th
# (bench/results/2026-12-06_h100_topk_band_fp8_rowwise.md).
SELECT_LAUNCH = {"BLOCK": 1024, "num_warps": 4, "SAMPLE": 8, "MARGIN": 4.0}
LAUNCH_KEYS = {
    "score": frozenset({*SCORE_LAUNCH, "BQ"}),
    "select": frozenset({*SELECT_LAUNCH, "skip"}),
}


@triton.jit
def _score_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    starts_ptr,
    qrows_ptr,
    scores_ptr,
    rmax_ptr,
    rmin_ptr,
    row0,
    row_end,
    scale,
    topk,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_wt,
    stride_sr,
    H: tl.constexpr,
    D: tl.constexpr,
    HP: tl.constexpr,
    DP: tl.constexpr,
    BQ: tl.constexpr,
    BN: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_QROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    r0 = row0 + pid * BQ
    rows = r0 + tl.arange(0, BQ)
    row_ok = rows < row_end
    rstart = tl.load(starts_ptr + rows, mask=row_ok, other=0)
    # the queries' global rows: their causal bound (without q_rows, the query row itself)
    if HAS_QROWS:
        grows = tl.load(qrows_ptr + rows, mask=row_ok, other=0)
    else:
        grows = rows
    big = row_ok & (grows - rstart + 1 > topk)  # rows that need a selection
    lo = tl.min(tl.where(big, rstart, 2147483647), axis=0)
    # exclusive; 0 when no row of the block needs scores
    hi = tl.max(tl.where(big, grows + 1, 0), axis=0)
    lo = tl.minimum(lo, hi)

    cols = tl.arange(0, BQ * HP)
    qrow = r0 + cols // HP
    qh = cols % HP
    qmask = (qrow < row_end) & (qh < H)
    offs_d = tl.arange(0, DP)
    dmask = offs_d < D
    q = tl.load(
        q_ptr + qrow.to(tl.int64)[:, None] * stride_qt + qh[:, None] * stride_qh + offs_d[None, :],
        mask=qmask[:, None] & dmask[None, :],
        other=0.0,
    )
    w = tl.load(w_ptr + qrow.to(tl.int64) * stride_wt + qh, mask=qmask, other=0.0)
    q_t = tl.trans(q)  # [DP, BQ*HP]

    # scores of key s at srow + s
    srow = scores_ptr + (rows - row0).to(tl.int64) * stride_sr - rstart
    # elementwise; reduced once after the loop
    run_max = tl.full([BN, BQ], float("-inf"), tl.float32)
    run_min = tl.full([BN, BQ], float("inf"), tl.float32)
    for n0 in range((lo // BN) * BN, hi, BN):
        offs_n = n0 + tl.arange(0, BN)
        kt = tl.load(
            k_ptr + offs_n.to(tl.int64)[:, None] * stride_kt + offs_d[None, :],
            mask=((offs_n >= lo) & (offs_n < hi))[:, None] & dmask[None, :],
            other=0.0,
        )
        if IEEE:
            acc = tl.dot(kt, q_t, input_precision="ieee")
        else:
            acc = tl.dot(kt, q_t)
        acc = tl.maximum(acc, 0.0) * w[None, :]
        sc = tl.sum(tl.reshape(acc, (BN, BQ, HP)), axis=2) * scale  # [BN, BQ]
        sc = tl.where(sc == 0.0, 0.0, sc)  # -0.0 -> +0.0
        vis = (
            (offs_n[:, None] >= rstart[None, :])
            & (offs_n[:, None] <= grows[None, :])
            & big[None, :]
        )
        tl.store(srow[None, :] + offs_n[:, None], sc, mask=vis)
        run_max = tl.maximum(run_max, tl.where(vis, sc, float("-inf")))
        run_min = tl.minimum(run_min, tl.where(vis, sc, float("inf")))
    tl.store(rmax_ptr + rows - row0, tl.max(run_max, axis=0), mask=big)
    tl.store(rmin_ptr + rows - row0, tl.min(run_min, axis=0), mask=big)


@triton.jit
def _fkey(x):
    """Order-preserving int32 image of fp32 (signed comparison of keys == float comparison, -0.0
    excluded)."""
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _bucket(x, mn, inv, NB: tl.constexpr):
    # monotone non-decreasing in x, so a higher bucket always means a strictly larger score
    return tl.minimum(tl.maximum(((x - mn) * inv).to(tl.int32), 0), NB - 1)


@triton.jit
def _select_kernel(
    scores_ptr,
    stash_idx_ptr,
    rmax_ptr,
    rmin_ptr,
    starts_ptr,
    qrows_ptr,
    out_ptr,
    row0,
    topk,
    stride_sr,
    stride_ir,
    stride_ot,
    stash_off,
    stash_cap,
    BLOCK: tl.constexpr,
    SAMPLE: tl.constexpr,
    MARGIN: tl.constexpr,
    NB: tl.constexpr,
    HAS_QROWS: tl.constexpr,
):
    tl.static_assert(BLOCK <= 16384)  # pass 2's packed scan
    pid = tl.program_id(0)
    t = row0 + pid
    start = tl.load(starts_ptr + t)
    if HAS_QROWS:
        n = tl.load(qrows_ptr + t) - start + 1
    else:
        n = t - start + 1
    offs = tl.arange(0, BLOCK)
    out_row = out_ptr + t.to(tl.int64) * stride_ot
    if n <= topk:
        for c0 in range(0, n, BLOCK):
            tl.store(out_row + c0 + offs, start + c0 + offs, mask=c0 + offs < n)
    else:
        row = scores_ptr + pid.to(tl.int64) * stride_sr
        idx_row = stash_idx_ptr + pid.to(tl.int64) * stride_ir
        mx = tl.load(rmax_ptr + pid)
        mn = tl.load(rmin_ptr + pid)
        inv = tl.where(mx > mn, NB / tl.where(mx > mn, mx - mn, 1.0), 0.0)
        bins = tl.arange(0, NB)

        # ---- pass 1, on every SAMPLE-th key: a band of buckets [b_lo, b_hi] that holds the
        # threshold unless the sample misleads (checked after pass 2). The top-k's share q of the
        # row, estimated from n_s sampled keys, is off by sqrt(n_s q (1 - q)) keys at one standard
        # deviation; the band reaches MARGIN of them (and one key) to either side. SAMPLE 1: the
        # exact histogram, the band one bucket.
        hist = tl.zeros([NB], tl.int32)
        for c0 in range(0, n, BLOCK * SAMPLE):
            o = c0 + offs * SAMPLE
            m = o < n
            x = tl.load(row + o, mask=m, other=0.0)
            hist += tl.histogram(_bucket(x, mn, inv, NB), NB, mask=m)
        n_s = (n + SAMPLE - 1) // SAMPLE
        ge_s = (n_s - tl.cumsum(hist, 0) + hist).to(tl.float32)  # sampled keys in buckets >= i
        q = topk / n.to(tl.float32)
        r_est = q * n_s
        if SAMPLE == 1:
            dev = 0.0
        else:
            dev = MARGIN * tl.sqrt(r_est * (1.0 - q)) + 1.0
        b_hi = tl.sum((ge_s >= r_est - dev).to(tl.int32), 0) - 1  # above it: in the top-k
        b_lo = tl.maximum(tl.sum((ge_s >= r_est + dev).to(tl.int32), 0) - 1, 0)  # below: not

        # ---- pass 2: emit the keys above the band, stash the band's (row order is kept)
        n_sel = n * 0
        n_st = n * 0
        for c0 in range(0, n, BLOCK):
            m = c0 + offs < n
            x = tl.load(row + c0 + offs, mask=m, other=0.0)
            b = _bucket(x, mn, inv, NB)
            gt = m & (b > b_hi)
            st = m & (b >= b_lo) & (b <= b_hi)
            # one scan for both compactions: the emitted count in the low 16 bits, the stashed in
            # the high bits (BLOCK <= 16384 keeps both below 2^15 and the sum below 2^31); 4% off
            # the whole call at 32K (bench/results/2026-12-06_h200_real_mode_cells.md)
            both = gt.to(tl.int32) + (st.to(tl.int32) << 16)
            incl = tl.cumsum(both, 0)
            excl = incl - both
            pos = n_sel + (excl & 0xFFFF)
            tl.store(out_row + pos, start + c0 + offs, mask=gt & (pos < topk))
            spos = n_st + (excl >> 16)
            keep = st & (spos < stash_cap)
            tl.store(row + stash_off + spos, x, mask=keep)
            tl.store(idx_row + spos, start + c0 + offs, mask=keep)
            tot = tl.sum(both, 0)
            n_sel += tot & 0xFFFF
            n_st += tot >> 16
        tl.debug_barrier()  # stash written by other threads of this program

        # ---- exact radix select on the stash; on the whole row where the band missed the
        # threshold or outgrew the stash (a misleading sample, massive ties): slower, same result
        need = topk - n_sel
        overflow = (need < 0) | (n_st < need) | (n_st > stash_cap)
        m_len = tl.where(overflow, n, tl.where(need == 0, 0, n_st))
        src = row + tl.where(overflow, 0, stash_off)
        rneed = tl.where(overflow, topk, need)
        dst = out_row + tl.where(overflow, 0, n_sel)
        prefix = rneed * 0
        shift = rneed * 0
        done = m_len == 0
        for lvl in tl.static_range(4):
            n_it = tl.where(done, 0, m_len)
            h = tl.zeros([NB], tl.int32)
            for c0 in range(0, n_it, BLOCK):
                m = c0 + offs < n_it
                key = _fkey(tl.load(src + c0 + offs, mask=m, other=0.0))
                if lvl == 0:
                    h += tl.histogram((key >> 24) + 128, NB, mask=m)
                else:
                    h += tl.histogram(
                        (key >> (24 - 8 * lvl)) & 255,
                        NB,
                        mask=m & ((key >> (32 - 8 * lvl)) == prefix),
                    )
            tot = tl.sum(h, 0)
            ge = tot - tl.cumsum(h, 0) + h
            bs = tl.sum((ge >= rneed).to(tl.int32), 0) - 1
            c_gt = tl.sum(tl.where(bins > bs, h, 0), 0)
            c_eq = tl.sum(tl.where(bins == bs, h, 0), 0)
            if lvl == 0:
                new_prefix = bs - 128
            else:
                new_prefix = (prefix << 8) | bs
            prefix = tl.where(done, prefix, new_prefix)
            shift = tl.where(done, shift, 24 - 8 * lvl)
            new_need = rneed - c_gt
            rneed = tl.where(done, rneed, new_need)
            done = done | (c_eq == new_need)

        n_sel = rneed * 0
        n_eq = rneed * 0
        for c0 in range(0, m_len, BLOCK):
            m = c0 + offs < m_len
            key = _fkey(tl.load(src + c0 + offs, mask=m, other=0.0))
            idx = tl.load(idx_row + c0 + offs, mask=m & (~overflow), other=0)
            idx = tl.where(overflow, start + c0 + offs, idx)
            kp = key >> shift
            gt = m & (kp > prefix)
            eq = m & (kp == prefix)
            ei = eq.to(tl.int32)
            rank = n_eq + tl.cumsum(ei, 0) - ei
            sel = gt | (eq & (rank < rneed))
            si = sel.to(tl.int32)
            pos = n_sel + tl.cumsum(si, 0) - si
            tl.store(dst + pos, idx, mask=sel)
            n_sel += tl.sum(si, 0)
            n_eq += tl.sum(ei, 0)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _config(h_i: int, d_i: int, dtype: torch.dtype):
    hp = pow2(h_i, 1)
    bq = max(1, 128 // hp)
    if bq * hp < 16:
        bq = 16 // hp
    return hp, pow2(d_i), bq


@torch.no_grad()
def indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlens: torch.Tensor,
    topk: int,
    scale: float,
    *,
    max_len: int | None = None,
    scratch_bytes: int = SCRATCH_BYTES,
    stash_cap: int = STASH_CAP,
    gluon: bool = True,
    q_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``reference.indexer_topk`` (selected set identical; rows listed in two
    ascending runs, module docstring).

    ``max_len``: the longest document's length, when the caller knows it on the host (the model's
    packed context does); then ``cu_seqlens`` is taken as valid and the call makes no device-to-host
    copy. ``gluon``: True scores with the warp-specialised Gluon kernel (``indexer_topk_ws``) where
    it applies (CUDA sm_90, 32 heads of 128 in bf16, not under the interpreter) and with the Triton
    kernel elsewhere; False with the Triton kernel only (the same scores, so the same selection).

    ``q_rows`` (int ``[T_q]``, context parallelism): q and weights hold ``T_q`` queries whose global
    rows these are, k every row of the stream (``cu_seqlens`` over k); each query's causal bound is
    its global row. Scored by the Triton kernel (the Gluon scoring assumes query row = key row)."""
    total, h_i, d_i = q.shape
    n_keys = k.shape[0] if q_rows is not None else total
    if k.shape != (n_keys, d_i) or weights.shape != (total, h_i):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, weights "
            f"{tuple(weights.shape)}"
        )
    if q_rows is not None and q_rows.shape != (total,):
        raise ValueError(f"q_rows {tuple(q_rows.shape)} must hold one row per query ({total})")
    check_device(q, k, weights)
    out = torch.full((total, topk), -1, dtype=torch.int32, device=q.device)
    if total == 0 or topk == 0:
        return out
    cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
    if max_len is None and (cu.dim() != 1 or int(cu[0]) != 0 or int(cu[-1]) != n_keys):
        raise ValueError("cu_seqlens must be 1-D, start at 0 and end at T")
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=n_keys).to(torch.int32)
    if q_rows is not None:  # per query: its document's start, and its global row
        q_rows = q_rows.to(device=q.device, dtype=torch.int32).contiguous()
        starts = starts[q_rows.long()]
    maxlen = int(lengths.max()) if max_len is None else int(max_len)
    q = q.contiguous() if q.stride(-1) != 1 else q
    k = k.contiguous() if k.stride(-1) != 1 else k
    weights = weights.float().contiguous()
    k = k.to(q.dtype)
    hp, dp, bq = _config(h_i, d_i, q.dtype)
    sc_cfg = {**SCORE_LAUNCH, **tuning.overrides("indexer_topk", "score")}
    # queries per scoring program (each key tile is read once per BQ queries)
    bq = sc_cfg.pop("BQ", bq)
    # Hopper: the warp-specialised scoring
    ws = (
        gluon
        and q_rows is None
        and not interpreting()
        and _ws.supported(q, k)
        and _ws.config()["enable"]
    )
    if ws:
        bq = _ws.rows_per_program()
    ieee = q.dtype == torch.float32

    # scratch: per row the scores of its visible keys (column = key - doc start), then the stash
    cap = min(stash_cap, maxlen)
    width = maxlen + cap
    # a row's bytes: its fp32 scores and stash scores (width), its int32 stash rows (cap), its max
    # and min
    rows = max(bq, min(total, scratch_bytes // (4 * (width + cap) + 8)))
    wave = bq * _num_sms(q.device)
    # whole waves of score programs
    rows = rows // wave * wave if rows >= wave else max(bq, rows // bq * bq)
    scores = torch.empty((rows, width), dtype=torch.float32, device=q.device)
    stash_idx = torch.empty((rows, cap), dtype=torch.int32, device=q.device)
    rmax = torch.empty(rows, dtype=torch.float32, device=q.device)
    rmin = torch.empty(rows, dtype=torch.float32, device=q.device)
    se_cfg = {**SELECT_LAUNCH, **tuning.overrides("indexer_topk", "select")}
    skip_select = se_cfg.pop("skip", False)  # benchmark hook: time the scoring alone
    for a in range(0, total, rows):
        b = min(total, a + rows)
        if ws:
            _ws.score(q, k, weights, starts, scores, rmax, rmin, a, b, scale, topk)
        else:
            _score_kernel[(triton.cdiv(b - a, bq),)](
                q,
                k,
                weights,
                starts,
                q_rows if q_rows is not None else starts,
                scores,
                rmax,
                rmin,
                a,
                b,
                float(scale),
                topk,
                q.stride(0),
                q.stride(1),
                k.stride(0),
                weights.stride(0),
                scores.stride(0),
                H=h_i,
                D=d_i,
                HP=hp,
                DP=dp,
                BQ=bq,
                IEEE=ieee,
                HAS_QROWS=q_rows is not None,
                **sc_cfg,
            )
        if skip_select:
            continue
        _select_kernel[(b - a,)](
            scores,
            stash_idx,
            rmax,
            rmin,
            starts,
            q_rows if q_rows is not None else starts,
            out,
            a,
            topk,
            scores.stride(0),
            stash_idx.stride(0),
            out.stride(0),
            maxlen,
            cap,
            NB=NBINS,
            HAS_QROWS=q_rows is not None,
            **se_cfg,
        )
    return out


__all__ = ["indexer_topk"]


def compile_specs(small: bool = False):
    """Launch configurations for ``bench/compile_check.py`` (offline sm_90 compile), with the
    active ``tuning`` overrides."""
    h_i, d_i = (4, 16) if small else (32, 128)
    hp, dp, bq = _config(h_i, d_i, torch.bfloat16)
    sc = {**SCORE_LAUNCH, **tuning.overrides("indexer_topk", "score")}
    se = {**SELECT_LAUNCH, **tuning.overrides("indexer_topk", "select")}
    ptr = {n: "*fp32" for n in ("w_ptr", "scores_ptr", "rmax_ptr", "rmin_ptr")}
    score_sig = {
        "q_ptr": "*bf16",
        "k_ptr": "*bf16",
        "starts_ptr": "*i32",
        "qrows_ptr": "*i32",
        **ptr,
        "row0": "i32",
        "row_end": "i32",
        "scale": "fp32",
        "topk": "i32",
        "stride_qt": "i32",
        "stride_qh": "i32",
        "stride_kt": "i32",
        "stride_wt": "i32",
        "stride_sr": "i32",
    }
    score_c = {
        "H": h_i,
        "D": d_i,
        "HP": hp,
        "DP": dp,
        "BQ": sc.get("BQ", bq),
        "BN": sc["BN"],
        "IEEE": False,
        "HAS_QROWS": False,
    }
    sel_sig = {
        "scores_ptr": "*fp32",
        "stash_idx_ptr": "*i32",
        "rmax_ptr": "*fp32",
        "rmin_ptr": "*fp32",
        "starts_ptr": "*i32",
        "qrows_ptr": "*i32",
        "out_ptr": "*i32",
        "row0": "i32",
        "topk": "i32",
        "stride_sr": "i32",
        "stride_ir": "i32",
        "stride_ot": "i32",
        "stash_off": "i32",
        "stash_cap": "i32",
    }
    div = ("q_ptr", "k_ptr", "stride_qt", "stride_qh", "stride_kt", "stride_sr")
    sel_c = {
        "BLOCK": se["BLOCK"],
        "SAMPLE": se["SAMPLE"],
        "MARGIN": se["MARGIN"],
        "NB": NBINS,
        "HAS_QROWS": False,
    }
    return [
        (
            "indexer_score",
            (_score_kernel, score_sig, score_c, sc["num_warps"], sc["num_stages"], div),
        ),
        (
            "indexer_select",
            (_select_kernel, sel_sig, sel_c, se["num_warps"], 1, ("scores_ptr", "stride_sr")),
        ),
    ]
