"""Block-wise e4m3 quantisation for FP8 training (DeepSeek-V3's scaling), one pass per operand.

A tile of values shares one fp32 scale ``s = max(amax, EPS) / 448`` and is stored as ``e4m3(clamp(x
* (448 / max(amax, EPS))))`` (round to nearest even), so that ``q * s`` dequantises it; the two
divisions are IEEE-rounded (``div_rn``), the product and the clamp exact, so ``model/fp8_mm.py``'s
torch formulas give the same bits. The layouts are the ones cuBLAS's block-scaled FP8 GEMM reads
(``F.scaled_mm`` with ``BlockWise1x128`` / ``BlockWise128x128``):

* ``quant_rows(x [M, K])``: tiles of 1 x 128 along K (an operand's contraction dimension) ->
  ``q [M, K]`` and the scales ``[M, K / 128]`` with M contiguous. With ``segments`` (the routed
  experts' rows, one segment per expert) each segment's scales lie M-contiguous on their own, at
  ``start x K / 128`` of one flat buffer, so that a segment's slice is a scale tensor in cuBLAS's
  layout.
* ``quant_cols(x [M, K], tiles)``: tiles of 128 x 1 along M (the tokens: the weight gradient's
  contraction), written transposed: ``qt [K, 128 n_tiles]`` and the scales ``[K, n_tiles]`` with K
  contiguous. ``tiles [n_tiles, 2]`` int32 holds each tile's first row and row count (at most 128):
  a tile never crosses a segment, a segment's tiles are consecutive, and the rows a tile lacks are
  written as zeros.
* ``quant_blocks(w [G, N, K])``: 128 x 128 blocks of each of G matrices -> ``q [G, N, K]`` (or
  ``[G, K, N]``, transposed) and the scales ``[G, N / 128, K / 128]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_env import check_device

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
EPS = 1e-12  # an all-zero tile gets scale EPS / 448 and stays zero
TILE = 128
ROWS_BM = 32  # rows per program of quant_rows
COLS_BK = 64  # columns per program of quant_cols


@triton.jit
def _to_e4m3(x, amax):
    """(e4m3 of ``x`` scaled by 448 / amax, the fp32 scale amax / 448); amax broadcast to x."""
    inv = tl.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax)
    q = tl.clamp(x * inv, -448.0, 448.0).to(tl.float8e4nv, fp_downcast_rounding="rtne")
    return q, tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))


@triton.jit
def _quant_rows_kernel(
    x_ptr, q_ptr, s_ptr, seg_start_ptr, seg_len_ptr, M, K,
    SEGMENTED: tl.constexpr, BM: tl.constexpr, TILE: tl.constexpr, EPS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    kb = tl.program_id(1)
    cols = kb * TILE + tl.arange(0, TILE)
    live = rows < M
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * K + cols[None, :], mask=live[:, None], other=0.0)
    amax = tl.maximum(tl.max(tl.abs(x.to(tl.float32)), axis=1), EPS)
    q, s = _to_e4m3(x.to(tl.float32), amax[:, None])
    tl.store(q_ptr + r64[:, None] * K + cols[None, :], q, mask=live[:, None])
    if SEGMENTED:  # the segment's own [K / TILE, rows of the segment] block of scales
        start = tl.load(seg_start_ptr + rows, mask=live, other=0).to(tl.int64)
        n = tl.load(seg_len_ptr + rows, mask=live, other=1).to(tl.int64)
        at = start * (K // TILE) + kb * n + (r64 - start)
    else:
        at = kb.to(tl.int64) * M + r64
    tl.store(s_ptr + at, tl.reshape(s, (BM,)), mask=live)


@triton.jit
def _quant_cols_kernel(
    x_ptr, q_ptr, s_ptr, tiles_ptr, K, width,
    BK: tl.constexpr, TILE: tl.constexpr, EPS: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    first = tl.load(tiles_ptr + 2 * t).to(tl.int64)
    n = tl.load(tiles_ptr + 2 * t + 1)
    r = tl.arange(0, TILE)
    live = cols < K
    mask = (r[:, None] < n) & live[None, :]
    x = tl.load(x_ptr + (first + r)[:, None] * K + cols[None, :], mask=mask, other=0.0)
    amax = tl.maximum(tl.max(tl.abs(x.to(tl.float32)), axis=0), EPS)  # [BK]
    q, s = _to_e4m3(x.to(tl.float32), amax[None, :])
    out = cols.to(tl.int64)[None, :] * width + t.to(tl.int64) * TILE + r[:, None]
    tl.store(q_ptr + out, q, mask=live[None, :])
    tl.store(s_ptr + t.to(tl.int64) * K + cols, tl.reshape(s, (BK,)), mask=live)


@triton.jit
def _quant_blocks_kernel(
    w_ptr, q_ptr, s_ptr, N, K, TRANSPOSE: tl.constexpr, B: tl.constexpr, EPS: tl.constexpr
):
    nb, kb, g = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rn = nb * B + tl.arange(0, B)
    rk = kb * B + tl.arange(0, B)
    base = g * N * K
    w = tl.load(w_ptr + base + rn[:, None].to(tl.int64) * K + rk[None, :]).to(tl.float32)
    amax = tl.maximum(tl.max(tl.max(tl.abs(w), axis=1), axis=0), EPS)
    q, s = _to_e4m3(w, tl.full((1, 1), 0.0, tl.float32) + amax)
    if TRANSPOSE:
        tl.store(q_ptr + base + rk[None, :].to(tl.int64) * N + rn[:, None], q)
    else:
        tl.store(q_ptr + base + rn[:, None].to(tl.int64) * K + rk[None, :], q)
    tl.store(s_ptr + (g * (N // B) + nb) * (K // B) + kb, tl.max(tl.max(s, axis=1), axis=0))


def _check(x: torch.Tensor, what: str, dims: tuple[int, ...]) -> None:
    if not x.is_contiguous():
        raise ValueError(f"{what}: needs a contiguous tensor")
    for d in dims:
        if x.shape[d] % TILE:
            raise ValueError(
                f"{what}: dimension {d} of {tuple(x.shape)} is not a multiple of {TILE}"
            )


def quant_rows(
    x: torch.Tensor, segments: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (K a multiple of 128) per 1 x 128 tile -> (``q [M, K]`` e4m3, scales fp32):
    ``[M, K / 128]`` with M contiguous; with ``segments = (start, length)`` (int32 ``[M]``: each
    row's segment's first row and row count) the flat ``[M K / 128]`` buffer, segment by segment."""
    _check(x, "quant_rows", (1,))
    check_device(x)
    m, k = x.shape
    q = torch.empty(m, k, dtype=E4M3, device=x.device)
    s = torch.empty(m * (k // TILE), dtype=torch.float32, device=x.device)
    start, length = segments if segments is not None else (x, x)  # unread without segments
    grid = (triton.cdiv(m, ROWS_BM), k // TILE)
    if m:
        _quant_rows_kernel[grid](
            x, q, s, start, length, m, k, SEGMENTED=segments is not None, BM=ROWS_BM, TILE=TILE,
            EPS=EPS,
        )  # fmt: skip
    return q, (s if segments is not None else s.view(k // TILE, m).t())


def quant_cols(x: torch.Tensor, tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` per 128 x 1 tile along M as ``tiles`` lays them (module docstring) -> (``qt [K,
    128 n]`` e4m3, scales ``[K, n]`` fp32 with K contiguous), n = ``tiles.shape[0]``."""
    _check(x, "quant_cols", ())
    check_device(x, tiles)
    _m, k = x.shape
    n = tiles.shape[0]
    qt = torch.empty(k, n * TILE, dtype=E4M3, device=x.device)
    s = torch.empty(n, k, dtype=torch.float32, device=x.device)
    if n:
        _quant_cols_kernel[(n, triton.cdiv(k, COLS_BK))](
            x, qt, s, tiles, k, n * TILE, BK=COLS_BK, TILE=TILE, EPS=EPS
        )
    return qt, s.t()


def quant_blocks(w: torch.Tensor, transpose: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [G, N, K]`` (N, K multiples of 128) per 128 x 128 block -> (``q`` e4m3 ``[G, N, K]``, or
    ``[G, K, N]`` with ``transpose``; scales ``[G, N / 128, K / 128]`` fp32)."""
    _check(w, "quant_blocks", (1, 2))
    check_device(w)
    g, n, k = w.shape
    q = torch.empty((g, k, n) if transpose else (g, n, k), dtype=E4M3, device=w.device)
    s = torch.empty(g, n // TILE, k // TILE, dtype=torch.float32, device=w.device)
    if g:
        _quant_blocks_kernel[(n // TILE, k // TILE, g)](
            w, q, s, n, k, TRANSPOSE=transpose, B=TILE, EPS=EPS
        )
    return q, s


__all__ = ["E4M3", "EPS", "FP8_MAX", "TILE", "quant_blocks", "quant_cols", "quant_rows"]
