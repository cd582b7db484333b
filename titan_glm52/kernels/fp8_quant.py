"""Block-wise e4m3 quantisation for FP8 training (DeepSeek-V3's scaling), one pass per operand.

A tile of values shares one fp32 scale ``s = max(amax, EPS) / 448`` and is stored as ``e4m3(clamp(x
* (448 / max(amax, EPS))))`` (round to nearest even), so that ``q * s`` dequantises it; the two
divisions are IEEE-rounded (``div_rn``), the product and the clamp exact, so ``model/fp8_mm.py``'s
torch formulas give the same bits. The layouts are the ones cuBLAS's block-scaled FP8 GEMM reads
(``F.scaled_mm`` with ``BlockWise1x128`` / ``BlockWise128x128``):

* ``quant_rows(x [M, K], segments)``: tiles of 1 x 128 along K (an operand's contraction
  dimension), per segment of rows (the routed experts' rows, one segment per expert; a linear's
  rows are one segment): each segment's rows start at a multiple of ``ROW_ALIGN`` rows of ``q``
  and its scales lie M-contiguous on their own in one flat buffer, so that a segment's slices
  are an operand and a scale tensor in cuBLAS's layout. Without segments (a linear's input) x's
  rows are one segment, with nothing read from a segment table.
* ``quant_cols(x [M, K], tiles)``: tiles of 128 x 1 along M (the tokens: the weight gradient's
  contraction), written transposed: ``qt [K, 128 n_tiles]`` and the scales ``[K, n_tiles]`` with K
  contiguous. ``tiles [n_tiles, 2]`` int32 holds each tile's first row and row count (at most 128):
  a tile never crosses a segment, a segment's tiles are consecutive, and the rows a tile lacks are
  written as zeros. Without ``tiles`` x's rows are one segment.
* ``quant_blocks(w [G, N, K])``: 128 x 128 blocks of each of G matrices -> ``q [G, N, K]`` and
  the scales ``[G, N / 128, K / 128]``, or transposed (the blocks of w^T: ``[G, K, N]``, ``[G, K /
  128, N / 128]``).
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
# cuBLAS's block-scaled GEMM reads a 1 x 128 operand's scales M-contiguous: each segment's rows
# start on a multiple of this many rows, so that every column of its scales is 16-byte aligned
ROW_ALIGN = 16
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
    x_ptr, q_ptr, s_ptr, seg_ptr, M, K,
    BM: tl.constexpr, TILE: tl.constexpr, ALIGN: tl.constexpr, EPS: tl.constexpr,
    SEGMENTED: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    kb = tl.program_id(1)
    cols = kb * TILE + tl.arange(0, TILE)
    live = rows < M
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * K + cols[None, :], mask=live[:, None], other=0.0)
    amax = tl.maximum(tl.max(tl.abs(x.to(tl.float32)), axis=1), EPS)
    q, s = _to_e4m3(x.to(tl.float32), amax[:, None])
    if SEGMENTED:  # the row's segment: its first row in x, its rows, its first row in the output
        start = tl.load(seg_ptr + rows, mask=live, other=0).to(tl.int64)
        n = tl.load(seg_ptr + M + rows, mask=live, other=1).to(tl.int64)
        first = tl.load(seg_ptr + 2 * M + rows, mask=live, other=0).to(tl.int64)
        pos = r64 - start  # the row within its segment
    else:  # one segment: x's rows
        n = M
        first = 0
        pos = r64
    tl.store(q_ptr + (first + pos)[:, None] * K + cols[None, :], q, mask=live[:, None])
    padded = (n + ALIGN - 1) // ALIGN * ALIGN
    at = first * (K // TILE) + kb * padded + pos
    tl.store(s_ptr + at, tl.reshape(s, (BM,)), mask=live)


@triton.jit
def _quant_cols_kernel(
    x_ptr, q_ptr, s_ptr, tiles_ptr, M, K, width,
    BK: tl.constexpr, TILE: tl.constexpr, EPS: tl.constexpr, SEGMENTED: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    if SEGMENTED:
        first = tl.load(tiles_ptr + 2 * t).to(tl.int64)
        n = tl.load(tiles_ptr + 2 * t + 1)
    else:  # one segment: tile t holds rows 128 t on
        first = t.to(tl.int64) * TILE
        n = tl.minimum(M - first, TILE)
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
    scale = tl.max(tl.max(s, axis=1), axis=0)
    if TRANSPOSE:
        tl.store(q_ptr + base + rk[None, :].to(tl.int64) * N + rn[:, None], q)
        tl.store(s_ptr + (g * (K // B) + kb) * (N // B) + nb, scale)
    else:
        tl.store(q_ptr + base + rn[:, None].to(tl.int64) * K + rk[None, :], q)
        tl.store(s_ptr + (g * (N // B) + nb) * (K // B) + kb, scale)


def _check(x: torch.Tensor, what: str, dims: tuple[int, ...]) -> None:
    if not x.is_contiguous():
        raise ValueError(f"{what}: needs a contiguous tensor")
    for d in dims:
        if x.shape[d] % TILE:
            raise ValueError(
                f"{what}: dimension {d} of {tuple(x.shape)} is not a multiple of {TILE}"
            )


def quant_rows(
    x: torch.Tensor, segments: torch.Tensor | None = None, padded_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (K a multiple of 128) per 1 x 128 tile, in segments (module docstring):
    ``segments`` int32 ``[3, M]`` holds each row's segment's first row, row count and first row in
    the output, whose segments start on multiples of ``ROW_ALIGN`` rows (``padded_rows`` in all);
    without them x's rows are one segment (M padded to ``ROW_ALIGN``). Returns (``q [padded_rows,
    K]`` e4m3, the flat fp32 scales ``[padded_rows K / 128]``: a segment of n rows padded to p has
    its ``[K / 128, p]`` block at its first output row x K / 128). The padding rows are left
    unwritten."""
    _check(x, "quant_rows", (1,))
    m, k = x.shape
    if segments is None:
        check_device(x)
        padded_rows = -(-m // ROW_ALIGN) * ROW_ALIGN
    else:
        check_device(x, segments)
    q = torch.empty(padded_rows, k, dtype=E4M3, device=x.device)
    s = torch.empty(padded_rows * (k // TILE), dtype=torch.float32, device=x.device)
    if m:
        _quant_rows_kernel[(triton.cdiv(m, ROWS_BM), k // TILE)](
            x, q, s, x if segments is None else segments, m, k,
            BM=ROWS_BM, TILE=TILE, ALIGN=ROW_ALIGN, EPS=EPS, SEGMENTED=segments is not None,
        )  # fmt: skip
    return q, s


def quant_cols(
    x: torch.Tensor, tiles: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` per 128 x 1 tile along M as ``tiles`` lays them (module docstring; without
    them x's rows are one segment) -> (``qt [K, 128 n]`` e4m3, scales ``[K, n]`` fp32 with K
    contiguous), n the number of tiles."""
    _check(x, "quant_cols", ())
    m, k = x.shape
    if tiles is None:
        check_device(x)
        n = triton.cdiv(m, TILE)
    else:
        check_device(x, tiles)
        n = tiles.shape[0]
    qt = torch.empty(k, n * TILE, dtype=E4M3, device=x.device)
    s = torch.empty(n, k, dtype=torch.float32, device=x.device)
    if n:
        _quant_cols_kernel[(n, triton.cdiv(k, COLS_BK))](
            x, qt, s, x if tiles is None else tiles, m, k, n * TILE,
            BK=COLS_BK, TILE=TILE, EPS=EPS, SEGMENTED=tiles is not None,
        )  # fmt: skip
    return qt, s.t()


def quant_blocks(w: torch.Tensor, transpose: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [G, N, K]`` (N, K multiples of 128) per 128 x 128 block -> (``q`` e4m3 ``[G, N, K]``,
    scales ``[G, N / 128, K / 128]`` fp32), or with ``transpose`` the blocks of w^T (``[G, K, N]``,
    ``[G, K / 128, N / 128]``)."""
    _check(w, "quant_blocks", (1, 2))
    check_device(w)
    g, n, k = w.shape
    q = torch.empty((g, k, n) if transpose else (g, n, k), dtype=E4M3, device=w.device)
    blocks = (k // TILE, n // TILE) if transpose else (n // TILE, k // TILE)
    s = torch.empty(g, *blocks, dtype=torch.float32, device=w.device)
    if g:
        _quant_blocks_kernel[(n // TILE, k // TILE, g)](
            w, q, s, n, k, TRANSPOSE=transpose, B=TILE, EPS=EPS
        )
    return q, s


def compile_specs(small: bool = False):
    """Launch configurations for ``bench/compile_check.py`` (offline sm_90 compile): bf16 input,
    segmented and not (the sizes are runtime arguments)."""
    x, seg = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}, {"M": "i32", "K": "i32"}
    base = {"TILE": TILE, "EPS": EPS}
    rows = {**x, "seg_ptr": "*i32", **seg}
    cols = {**x, "tiles_ptr": "*i32", **seg, "width": "i32"}
    blocks = {"w_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "N": "i32", "K": "i32"}
    specs = []
    for on in (False, True):
        name = "_segmented" if on else ""
        row_c = {**base, "BM": ROWS_BM, "ALIGN": ROW_ALIGN, "SEGMENTED": on}
        specs += [
            (f"fp8_quant_rows{name}", (_quant_rows_kernel, rows, row_c, 4, 3, ())),
            (
                f"fp8_quant_cols{name}",
                (_quant_cols_kernel, cols, {**base, "BK": COLS_BK, "SEGMENTED": on}, 4, 3, ()),
            ),
            (
                f"fp8_quant_blocks{'_t' if on else ''}",
                (_quant_blocks_kernel, blocks, {"TRANSPOSE": on, "B": TILE, "EPS": EPS}, 4, 3, ()),
            ),
        ]
    return specs


__all__ = [
    "E4M3",
    "EPS",
    "FP8_MAX",
    "ROW_ALIGN",
    "TILE",
    "quant_blocks",
    "quant_cols",
    "quant_rows",
]
