"""Warp-specialised scoring of the lightning indexer for Hopper (sm_90), in Triton's Gluon dialect.

The same scores as ``indexer_topk._score_kernel`` (the same bf16 products accumulated in fp32 by
``wgmma``, then ReLU, head weight, head sum and scale in the same order), for the indexer GLM-5.2
has: 32 heads of 128, bf16. One program scores BQ query rows (N = BQ x 32 columns of every product)
against the key tiles their documents span: a loader warpgroup streams the [BN, 128] key tiles
through a ring of shared memory (``cp.async``, each stage signalled on an mbarrier) and two consumer
warpgroups take alternate tiles, so that one's epilogue (ReLU, weights, head sums, the scores'
stores and the row's running max / min) runs while the other's product is on the tensor cores. The
Triton kernel waits for each product before its epilogue, and reads each key tile for 4 queries;
this one reads it for 8.

Gluon has no interpreter mode: the kernel runs on the GPU only
(``tests/kernels/test_kernels_gpu.py`` checks its scores bit for bit against the Triton kernel's and
its selection against the reference). ``indexer_topk`` uses it where ``supported`` holds and its
caller asks for it (``gluon=True``), unless a ``tuning`` override disables it (``enable``); the
Triton kernel everywhere else.
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

H = 32  # indexer heads
D = 128  # indexer head dim
# every loader thread arrives (cp.async.mbarrier.arrive.noinc) on a stage's barrier
LOADER_ARRIVALS = 128


@gluon.jit
def _rows(starts_ptr, row0, row_end, topk, BQ: gl.constexpr, layout: gl.constexpr):
    """The program's BQ query rows, their document starts and whether each needs a selection (more
    than topk visible keys), in ``layout``."""
    rows = row0 + gl.program_id(0) * BQ + gl.arange(0, BQ, layout=layout)
    ok = rows < row_end
    rstart = gl.load(starts_ptr + rows, mask=ok, other=0)
    return rows, rstart, ok & (rows - rstart + 1 > topk)


@gluon.jit
def _key_span(rows, rstart, big, BN: gl.constexpr):
    """Keys lo .. hi - 1 that the program's selecting rows see (``_rows``' results), the first
    tile's key and the number of tiles."""
    lo = gl.min(gl.where(big, rstart, 2147483647), axis=0)
    hi = gl.max(gl.where(big, rows + 1, 0), axis=0)  # 0 when no row of the program needs scores
    lo = gl.minimum(lo, hi)
    first = (lo // BN) * BN
    return lo, hi, first, gl.cdiv(hi - first, BN)


@gluon.jit
def _score_loader(
    k_smem,
    full,
    empty,
    k_ptr,
    starts_ptr,
    row0,
    row_end,
    topk,
    stride_kt,
    BQ: gl.constexpr,
    BN: gl.constexpr,
    D: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Key tile i (keys first + i * BN ..; those outside lo .. hi - 1 read as zeros) into stage i %
    STAGES."""
    # [BN, D] tiles, 16-byte copies
    lt: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    rows, rstart, big = _rows(starts_ptr, row0, row_end, topk, BQ, gl.SliceLayout(0, lt))
    lo, hi, first, n = _key_span(rows, rstart, big, BN)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, lt))
    for i in range(n):
        s = i % STAGES
        keys = first + i * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, lt))
        ok = (keys >= lo) & (keys < hi)
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        async_copy.async_copy_global_to_shared(
            k_smem.index(s),
            k_ptr + keys.to(gl.int64)[:, None] * stride_kt + cols[None, :],
            mask=ok[:, None],
        )
        async_copy.mbarrier_arrive(full.index(s), increment_count=False)


@gluon.jit
def _score_consumer(
    q_smem,
    k_smem,
    w_smem,
    x_max,
    x_min,
    full,
    empty,
    x_bar,
    starts_ptr,
    scores_ptr,
    rmax_ptr,
    rmin_ptr,
    row0,
    row_end,
    scale,
    topk,
    stride_sr,
    C: gl.constexpr,
    BQ: gl.constexpr,
    BN: gl.constexpr,
    H: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Tiles C, C + 2, ...: S = K_tile Q^T [BN, BQ x H], the weighted head sums of its ReLU into the
    scores, and the rows' running max / min; consumer 1 hands its max / min to consumer 0, which
    stores both combined."""
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BQ * H, 16]
    )
    # [BN, BQ] scores, keys fastest
    ep_l: gl.constexpr = gl.BlockedLayout([2, 2], [32, 1], [1, 4], [0, 1])
    q_l: gl.constexpr = gl.SliceLayout(0, ep_l)
    rows, rstart, big = _rows(starts_ptr, row0, row_end, topk, BQ, q_l)
    lo, hi, first, n = _key_span(rows, rstart, big, BN)
    # scores of key s at srow + s
    srow = scores_ptr + (rows - row0).to(gl.int64) * stride_sr - rstart
    # elementwise; reduced once after the loop
    run_max = gl.full([BN, BQ], float("-inf"), gl.float32, ep_l)
    run_min = gl.full([BN, BQ], float("inf"), gl.float32, ep_l)
    # use_acc=False below: only its registers are reused
    acc = gl.zeros([BN, BQ * H], gl.float32, acc_l)
    for i in range(C, n, 2):
        s = i % STAGES
        mbarrier.wait(full.index(s), (i // STAGES) & 1)
        fence_async_shared()
        acc = warpgroup_mma(
            k_smem.index(s), q_smem.permute((1, 0)), acc, use_acc=False, is_async=True
        )
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index(s), count=1)
        # each tile, so the weights hold no registers across the MMA
        w = w_smem.load(gl.SliceLayout(0, acc_l))
        sc = gl.sum(gl.reshape(gl.maximum(acc, 0.0) * w[None, :], [BN, BQ, H]), axis=2) * scale
        sc = gl.convert_layout(sc, ep_l)
        sc = gl.where(sc == 0.0, 0.0, sc)  # -0.0 -> +0.0
        keys = first + i * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ep_l))
        vis = (keys[:, None] >= rstart[None, :]) & (keys[:, None] <= rows[None, :]) & big[None, :]
        gl.store(srow[None, :] + keys[:, None], sc, mask=vis)
        run_max = gl.maximum(run_max, gl.where(vis, sc, float("-inf")))
        run_min = gl.minimum(run_min, gl.where(vis, sc, float("inf")))
    mx = gl.max(run_max, axis=0)
    mn = gl.min(run_min, axis=0)
    if C == 1:
        x_max.store(mx)
        x_min.store(mn)
        gl.thread_barrier()
        mbarrier.arrive(x_bar, count=1)
    else:
        mbarrier.wait(x_bar, 0)
        mx = gl.maximum(mx, x_max.load(q_l))
        mn = gl.minimum(mn, x_min.load(q_l))
        gl.store(rmax_ptr + rows - row0, mx, mask=big)
        gl.store(rmin_ptr + rows - row0, mn, mask=big)


@gluon.jit
def _score_ws_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    starts_ptr,
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
    H: gl.constexpr,
    D: gl.constexpr,
    BQ: gl.constexpr,
    BN: gl.constexpr,
    STAGES: gl.constexpr,
    LOADER_ARRIVALS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
):
    """Scores of rows row0 + pid * BQ .. (the contract of ``indexer_topk._score_kernel``)."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_smem = gl.allocate_shared_memory(
        dtype, [BQ * H, D], gl.NVMMASharedLayout.get_default_for([BQ * H, D], dtype)
    )
    k_smem = gl.allocate_shared_memory(
        dtype, [STAGES, BN, D], gl.NVMMASharedLayout.get_default_for([BN, D], dtype)
    )
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    w_smem = gl.allocate_shared_memory(gl.float32, [BQ * H], vec)
    x_max = gl.allocate_shared_memory(gl.float32, [BQ], vec)
    x_min = gl.allocate_shared_memory(gl.float32, [BQ], vec)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=LOADER_ARRIVALS)
        mbarrier.init(empty.index(s), count=1)  # the one consumer of the tile releases the stage
    mbarrier.init(x_bar, count=1)

    # the program's queries (row b, head h at row b * H + h; rows past row_end read zeros) and head
    # weights
    lq: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    c = gl.arange(0, BQ * H, layout=gl.SliceLayout(1, lq))
    qrow = row0 + gl.program_id(0) * BQ + c // H
    d = gl.arange(0, D, layout=gl.SliceLayout(0, lq))
    async_copy.async_copy_global_to_shared(
        q_smem,
        q_ptr + qrow.to(gl.int64)[:, None] * stride_qt + (c % H)[:, None] * stride_qh + d[None, :],
        mask=(qrow < row_end)[:, None],
    )
    async_copy.commit_group()
    lw: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])
    cw = gl.arange(0, BQ * H, layout=lw)
    wrow = row0 + gl.program_id(0) * BQ + cw // H
    w_smem.store(
        gl.load(w_ptr + wrow.to(gl.int64) * stride_wt + cw % H, mask=wrow < row_end, other=0.0)
    )
    async_copy.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()

    gl.warp_specialize(
        [
            (
                _score_consumer,
                (
                    q_smem,
                    k_smem,
                    w_smem,
                    x_max,
                    x_min,
                    full,
                    empty,
                    x_bar,
                    starts_ptr,
                    scores_ptr,
                    rmax_ptr,
                    rmin_ptr,
                    row0,
                    row_end,
                    scale,
                    topk,
                    stride_sr,
                    0,
                    BQ,
                    BN,
                    H,
                    STAGES,
                ),
            ),
            (
                _score_consumer,
                (
                    q_smem,
                    k_smem,
                    w_smem,
                    x_max,
                    x_min,
                    full,
                    empty,
                    x_bar,
                    starts_ptr,
                    scores_ptr,
                    rmax_ptr,
                    rmin_ptr,
                    row0,
                    row_end,
                    scale,
                    topk,
                    stride_sr,
                    1,
                    BQ,
                    BN,
                    H,
                    STAGES,
                ),
            ),
            (
                _score_loader,
                (
                    k_smem,
                    full,
                    empty,
                    k_ptr,
                    starts_ptr,
                    row0,
                    row_end,
                    topk,
                    stride_kt,
                    BQ,
                    BN,
                    D,
                    STAGES,
                ),
            ),
        ],
        [4, 4],
        [CONSUMER_REGS, LOADER_REGS],
    )


# Launch parameters, measured on one H200 (bench/indexer_sweep.py;
# bench/results/2026-12-03_h200_kernels.md); a benchmark lays variants over them with
# ``tuning.launch_overrides({"indexer_topk_ws": {"score": {...}}})``. enable: ``indexer_topk`` (with
# gluon=True) scores with this kernel where ``supported`` holds (False: the Triton kernel, for
# comparisons); bq: query rows per program (N = bq x 32 of each product); bn: keys per tile; stages:
# the key ring's depth; maxnreg: the launch's register cap (12 warps x 168 fill the register file:
# the default consumer gets 3 x 168 - consumer_regs - loader_regs).
DEFAULTS = {
    "score": {
        "enable": True,
        "bq": 8,
        "bn": 64,
        "stages": 4,
        "maxnreg": 168,
        "consumer_regs": 224,
        "loader_regs": 56,
    }
}
LAUNCH_KEYS = {part: frozenset(cfg) for part, cfg in DEFAULTS.items()}


def config(part: str = "score") -> dict:
    """The launch parameters of ``score``: ``DEFAULTS["score"]`` with its active ``tuning``
    overrides laid over them (a new dict)."""
    return {**DEFAULTS[part], **tuning.overrides("indexer_topk_ws", part)}


def supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``score`` can take the call: CUDA sm_90, bf16, 32 heads of 128, unit inner
    strides."""
    return (
        q.is_cuda
        and q.dtype == torch.bfloat16
        and k.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(q.device) == (9, 0)
        and q.dim() == 3
        and q.shape[1] == H
        and q.shape[2] == D
        and k.shape[1] == D
        and q.stride(2) == 1
        and k.stride(1) == 1
    )


def rows_per_program() -> int:
    """Query rows per ``score`` program (its launch's ``bq``)."""
    return config()["bq"]


def score(q, k, weights, starts, scores, rmax, rmin, row0, row_end, scale, topk):
    """Scores of rows row0 .. row_end - 1 into the chunk's scratch (see
    ``indexer_topk._score_kernel``)."""
    c = config()
    bq = c["bq"]
    if bq not in (1, 2, 4, 8) or c["bn"] != 64 or c["stages"] < 1:
        # N = bq x 32 columns must be a wgmma width (<= 256); one consumer warpgroup covers M = 64
        # keys
        raise ValueError(
            f"indexer_topk_ws score needs bq in (1, 2, 4, 8), bn = 64 and stages "
            f">= 1, got bq={bq}, bn={c['bn']}, stages={c['stages']}"
        )
    _score_ws_kernel[(triton.cdiv(row_end - row0, bq),)](
        q,
        k,
        weights,
        starts,
        scores,
        rmax,
        rmin,
        row0,
        row_end,
        float(scale),
        topk,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        weights.stride(0),
        scores.stride(0),
        H=H,
        D=D,
        BQ=bq,
        BN=c["bn"],
        STAGES=c["stages"],
        LOADER_ARRIVALS=LOADER_ARRIVALS,
        CONSUMER_REGS=c["consumer_regs"],
        LOADER_REGS=c["loader_regs"],
        num_warps=4,
        maxnreg=c["maxnreg"],
    )


def compile_specs(small: bool = False):
    """Launch configuration for ``bench/compile_check.py`` (offline sm_90 compile), with the
    active ``tuning`` overrides. The kernel exists at GLM-5.2's indexer shape only, so ``small``
    gives the same one."""
    c = config()
    consts = dict(
        H=H,
        D=D,
        BQ=c["bq"],
        BN=c["bn"],
        STAGES=c["stages"],
        LOADER_ARRIVALS=LOADER_ARRIVALS,
        CONSUMER_REGS=c["consumer_regs"],
        LOADER_REGS=c["loader_regs"],
    )
    sig = {
        "q_ptr": "*bf16",
        "k_ptr": "*bf16",
        "w_ptr": "*fp32",
        "starts_ptr": "*i32",
        "scores_ptr": "*fp32",
        "rmax_ptr": "*fp32",
        "rmin_ptr": "*fp32",
        "scale": "fp32",
    }
    sig = {n: sig.get(n, "i32") for n in _score_ws_kernel.arg_names if n not in consts}
    return [
        ("indexer_score_ws", (_score_ws_kernel, sig, consts, 4, 1, (), {"maxnreg": c["maxnreg"]}))
    ]
