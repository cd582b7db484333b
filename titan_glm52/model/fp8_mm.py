"""FP8 products with DeepSeek-V3's block-wise scaling: ``fp8_linear(x, w)`` (``x @ w^T``) and
``fp8_expert_mm(x, w, splits)`` (``expert_mm``'s per-expert products), forward and backward.

Each operand is quantised to e4m3 where it enters a product, per 1 x 128 tile of the contraction for
activations and gradients and per 128 x 128 block for weights, and the product accumulates in fp32
(cuBLAS's block-scaled FP8 GEMM, aten's ``_scaled_mm_v2`` behind ``F.scaled_mm``, on CUDA):

    forward         y  = x  @ w^T    x: 1 x 128 along K       w: 128 x 128
    input gradient  dx = dy @ w      dy: 1 x 128 along N      w: 128 x 128 (laid transposed)
    weight gradient dw = dy^T @ x    dy and x: 128 x 1 along the tokens

The weight gradient's tiles run along the tokens and, for the routed experts, start at each expert's
first row; a tile an expert does not fill is padded with zeros. The result of a product is rounded
once to the input's dtype (the weight gradient to the weight's). What is kept for backward is what a
bf16 product keeps (x and w), so memory and activation checkpointing are unchanged.

On CUDA the quantisation is ``kernels/fp8_quant.py`` (one Triton pass per operand) and the products
cuBLAS; elsewhere the same quantisation in torch (the same bits) and each product on the dequantised
operands in fp32 (what the FP8 GEMM computes, up to the order of its fp32 sums; float64 into a
float64 output, ``scaled_mm``), so that the CPU tests and the gloo cases run the recipe. On CUDA
each expert's quantised rows start on a multiple of 16 rows, with its scales laid out on their own:
cuBLAS refused the products of uneven row counts otherwise (bench/results/2026-12-04_h200_fp8.md).
The product and its two gradient products are registered ops (``model/ops.py``, as ``expert_mm``):
``torch.compile`` keeps them whole and op-level activation checkpointing can save their outputs.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from titan_glm52.host_copy import host_to_device
from titan_glm52.kernels import triton_available
from titan_glm52.model.expert_mm import _setup, _spans  # expert_mm's spans and saved inputs
from titan_glm52.model.ops import define

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
EPS = 1e-12  # kernels/fp8_quant.EPS (not imported here: importing the model must not import triton)
TILE = 128


def _on_kernel(*ts: torch.Tensor) -> bool:
    return all(t.is_cuda for t in ts) and triton_available()


# ------------------------------------------------------------------------------ quantisation
def _e4m3(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' formulas: (``e4m3(clamp(x * (448 / amax)))``, ``amax / 448``)."""
    amax = amax.clamp_min(EPS)
    # Tensor by tensor: with a python number torch multiplies by its reciprocal (not IEEE-rounded:
    # a number over a tensor on CPU, a tensor over a number on CUDA).
    fp8_max = amax.new_tensor(FP8_MAX)
    q = (x * (fp8_max / amax)).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    return q, amax / fp8_max


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` per 1 x 128 tile along K -> (``q [M, K]``, scales ``[M, K / 128]``)."""
    m, k = x.shape
    tiles = x.float().view(m, k // TILE, TILE)
    q, s = _e4m3(tiles, tiles.abs().amax(-1, keepdim=True))
    return q.view(m, k), s.view(m, k // TILE)


def quant_cols(x: torch.Tensor, splits: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` per 128 x 1 tile along M, the tiles of each segment of ``splits`` rows starting
    at its first row -> (``qt [K, 128 n]``, scales ``[K, n]``), n the tiles of all segments; a
    segment's tiles are consecutive and the rows a tile lacks are zeros."""
    cols = []
    start = 0
    for rows in splits:
        n = -(-rows // TILE)
        seg = F.pad(x[start : start + rows].float(), (0, 0, 0, n * TILE - rows))
        cols.append(seg.view(n, TILE, x.shape[1]))
        start += rows
    tiles = torch.cat(cols) if cols else x.new_zeros(0, TILE, x.shape[1], dtype=torch.float32)
    q, s = _e4m3(tiles, tiles.abs().amax(1, keepdim=True))  # [n, 128, K], [n, 1, K]
    return q.permute(2, 0, 1).reshape(x.shape[1], -1), s[:, 0].t()


def quant_blocks(w: torch.Tensor, transpose: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [G, N, K]`` per 128 x 128 block -> (``q [G, N, K]``, scales ``[G, N / 128, K / 128]``),
    or with ``transpose`` the blocks of w^T (``[G, K, N]``, ``[G, K / 128, N / 128]``)."""
    g, n, k = w.shape
    blocks = w.float().view(g, n // TILE, TILE, k // TILE, TILE)
    q, s = _e4m3(blocks, blocks.abs().amax((2, 4), keepdim=True))
    q, s = q.view(g, n, k), s.view(g, n // TILE, k // TILE)
    if transpose:
        return q.transpose(1, 2).contiguous(), s.transpose(1, 2).contiguous()
    return q, s


def tiles_of(splits: list[int], device: torch.device) -> torch.Tensor:
    """int32 ``[n, 2]``: each 128-row tile's first row and row count, segment by segment (one
    segment needs no table: ``kernels/fp8_quant.quant_cols`` without ``tiles``)."""
    rows, start = [], 0
    for n in splits:
        rows += [(start + t, min(TILE, n - t)) for t in range(0, n, TILE)]
        start += n
    return host_to_device(torch.tensor(rows, dtype=torch.int32).view(-1, 2), device)


# ------------------------------------------------------------------------------ the products
def _dequant(q: torch.Tensor, s: torch.Tensor, blocks: bool, dtype: torch.dtype) -> torch.Tensor:
    """``dtype`` values of ``q [R, C]``: scales ``s`` per 1 x 128 tile ``[R, C / 128]`` or per 128 x
    128 block ``[R / 128, C / 128]``."""
    s = s.repeat_interleave(TILE, -1)[..., : q.shape[1]]
    if blocks:
        s = s.repeat_interleave(TILE, 0)[: q.shape[0]]
    return q.to(dtype) * s.to(dtype)


def _k_major(s: torch.Tensor) -> torch.Tensor:
    """A 128 x 128 scale ``[N / 128, Kc / 128]`` as cuBLAS reads it for ``B [Kc, N]``: ``[Kc / 128,
    N / 128]`` with the Kc blocks contiguous, their count padded to a multiple of 4."""
    nb, kb = s.shape
    if s.is_contiguous() and kb % 4 == 0:
        return s.t()
    out = s.new_ones(nb, -(-kb // 4) * 4)
    out[:, :kb] = s
    return out.t()


def scaled_mm(
    a: torch.Tensor,
    a_s: torch.Tensor,
    bt: torch.Tensor,
    bt_s: torch.Tensor,
    blocks: bool,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out = a @ bt^T`` of e4m3 operands: ``a [M, Kc]`` with 1 x 128 scales ``a_s [M, Kc / 128]``
    (M contiguous on CUDA), ``bt [N, Kc]`` (rows contiguous) with 128 x 128 scales ``[N / 128, Kc /
    128]`` (``blocks``) or 1 x 128 scales ``[N, Kc / 128]`` (N contiguous on CUDA); fp32 sums (on
    CPU float64 ones into a float64 output), rounded once to ``out``'s dtype (``out [M, N]``
    contiguous). Returns ``out``."""
    if not a.is_cuda:
        # (float64: the distributed tests' FP8 cases, whose rows then do not depend on how many rows
        # the product has: a context-parallel rank's against the whole sequence's, which fp32's
        # blocked sums made differ in the last bit)
        acc = torch.float64 if out.dtype == torch.float64 else torch.float32
        return out.copy_(_dequant(a, a_s, False, acc) @ _dequant(bt, bt_s, blocks, acc).t())
    # aten's out= form of F.scaled_mm: cuBLAS writes into out (an expert's rows of the output)
    # instead of a new tensor copied there
    b_recipe = F.ScalingType.BlockWise128x128 if blocks else F.ScalingType.BlockWise1x128
    return torch.ops.aten._scaled_mm_v2.out(
        a, bt.t(),
        [a_s], [F.ScalingType.BlockWise1x128.value], [],
        [_k_major(bt_s) if blocks else bt_s], [b_recipe.value], [],
        None, out.dtype, [], False, out=out,
    )  # fmt: skip


def _cols(xs: tuple[torch.Tensor, ...], splits: list[int]):
    """Each of ``xs`` per 128 x 1 tile of each segment's rows (the segments' tiles made once)."""
    if _on_kernel(*xs):
        from titan_glm52.kernels import fp8_quant

        tiles = _table(tiles_of, splits, xs[0].device) if len(splits) > 1 else None
        return [fp8_quant.quant_cols(x, tiles) for x in xs]
    return [quant_cols(x, splits) for x in xs]


def _blocks(w: torch.Tensor, transpose: bool = False):
    if _on_kernel(w):
        from titan_glm52.kernels import fp8_quant

        return fp8_quant.quant_blocks(w, transpose)
    return quant_blocks(w, transpose)


def _blocks_transposed(w: torch.Tensor):
    """``w [E, N, K]`` per 128 x 128 block, laid as ``w^T`` for the input gradient: (``[E, K, N]``
    e4m3, scales ``[E, K / 128, N / 128]``; the blocks of w^T are w's, transposed)."""
    return _blocks(w.contiguous(), transpose=True)


# ------------------------------------------------------------------------------ the ops
# kernels/fp8_quant.ROW_ALIGN: each segment's quantised rows start on a multiple of this many
ROW_ALIGN = 16


def _padded(n: int) -> int:
    return -(-n // ROW_ALIGN) * ROW_ALIGN


def segments_of(splits: list[int], device: torch.device) -> torch.Tensor:
    """int32 ``[3, rows]``: each row's segment's first row, row count and first row in the padded
    output of ``kernels/fp8_quant.quant_rows`` (segments on multiples of ``ROW_ALIGN`` rows), made
    on the device from the counts."""
    counts = host_to_device(torch.tensor(splits, dtype=torch.int32), device)
    padded = (counts + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
    rows = sum(splits)
    starts = [torch.cumsum(c, 0, dtype=torch.int32) - c for c in (counts, padded)]
    return torch.stack(
        [
            torch.repeat_interleave(v, counts, output_size=rows)
            for v in (starts[0], counts, starts[1])
        ]
    )


# The last few tables made (``segments_of``, ``tiles_of``): a MoE layer's two products and their
# backward meet the same splits four times in a step, and each table costs the host a pinned copy
# and a few launches (bench/results/2026-12-04_h200_fp8.md: 260 and 129 us). A table depends only
# on the splits and is never written after it is made.
_TABLES: dict = {}
_TABLES_KEPT = 8
_TABLES_LOCK = threading.Lock()  # a CUDA backward runs on the autograd engine's thread


def _table(make, splits: list[int], device: torch.device) -> torch.Tensor:
    key = (make, tuple(splits), device)
    with _TABLES_LOCK:
        table = _TABLES.get(key)
        if table is None:
            while len(_TABLES) >= _TABLES_KEPT:
                del _TABLES[next(iter(_TABLES))]  # the oldest
            table = _TABLES[key] = make(splits, device)
    return table


def _rows_per_segment(x: torch.Tensor, splits: list[int]):
    """``x`` per 1 x 128 tile along K, as each segment's (rows, scales) in the GEMM's layout: on
    CUDA its ``ROW_ALIGN``-padded rows (a product's extra rows are dropped), elsewhere its rows.
    The views come from one ``split`` per tensor: at 4K tokens the host's time per product
    matters (bench/results/2026-12-04_h200_fp8.md)."""
    if not _on_kernel(x):
        q, s = quant_rows(x)
        return list(zip(q.split(splits), s.split(splits)))
    from titan_glm52.kernels import fp8_quant  # lazy: the model must not import triton

    padded = [_padded(n) for n in splits]
    if len(splits) == 1:  # a linear: no segment table
        q, flat = fp8_quant.quant_rows(x)
    else:
        q, flat = fp8_quant.quant_rows(x, _table(segments_of, splits, x.device), sum(padded))
    kb = x.shape[1] // TILE
    scales = flat.split([p * kb for p in padded])
    return [(qe, se.view(kb, p).t()) for qe, se, p in zip(q.split(padded), scales, padded)]


def _check(x: torch.Tensor, w: torch.Tensor, splits: list[int], what: str) -> None:
    if x.dim() != 2 or w.dim() != 3 or len(splits) != w.shape[0] or sum(splits) != x.shape[0]:
        raise ValueError(
            f"{what}: x {tuple(x.shape)}, w {tuple(w.shape)} and {len(splits)} splits do not fit "
            "(x [rows, K], w [E, N, K], one split per expert, covering x's rows)"
        )
    if x.shape[1] != w.shape[2] or w.shape[1] % TILE or w.shape[2] % TILE:
        raise ValueError(
            f"{what}: w {tuple(w.shape)}: the FP8 products need both weight dimensions in "
            f"multiples of {TILE}"
        )


def _times_blocks(
    a: torch.Tensor,
    bt: torch.Tensor,
    bt_s: torch.Tensor,
    splits: list[int],
    out: torch.Tensor | None = None,
):
    """``out[rows of e] = a[rows of e] @ bt[e]^T``: ``a`` quantised here per 1 x 128 tile, ``bt``
    e4m3 ``[E, N, Kc]`` with 128 x 128 scales ``bt_s [E, N / 128, Kc / 128]``; ``out`` (contiguous
    ``[rows, N]``) defaults to a new tensor of a's dtype."""
    a = a.contiguous()
    out = a.new_empty(a.shape[0], bt.shape[1]) if out is None else out
    parts = zip(_spans(splits), _rows_per_segment(a, splits), bt.unbind(0), bt_s.unbind(0))
    for (_, s, n), (aq, a_s), b, b_s in parts:
        if n:
            p = aq.shape[0]  # n, or n padded on CUDA (the product's extra rows are dropped)
            # Experts run in row order, so an expert's extra rows may land on the next one's
            # rows of out (which it writes after); past out's end they go to a scratch tensor.
            if s + p <= out.shape[0]:
                scaled_mm(aq, a_s, b, b_s, True, out[s : s + p])
            else:
                out[s : s + n] = scaled_mm(aq, a_s, b, b_s, True, out.new_empty(p, len(b)))[:n]
    return out


def _fp8_mm(x: torch.Tensor, w: torch.Tensor, splits: list[int]) -> torch.Tensor:
    _check(x, w, splits, "fp8_expert_mm")
    return _times_blocks(x, *_blocks(w.contiguous()), splits)


def _fp8_mm_fake(x, w, splits):
    _check(x, w, splits, "fp8_expert_mm")
    return x.new_empty(x.shape[0], w.shape[1])


def _input_grad_impl(grad: torch.Tensor, w: torch.Tensor, splits: list[int]) -> torch.Tensor:
    """``dx[rows of e] = grad[rows of e] @ w[e]``: the gradient per 1 x 128 tile along N, w per
    128 x 128 block, laid transposed."""
    return _times_blocks(grad, *_blocks_transposed(w), splits)


_input_grad = define(
    "fp8_mm_input_grad(Tensor grad, Tensor w, SymInt[] splits) -> Tensor",
    _input_grad_impl, lambda grad, w, splits: grad.new_empty(grad.shape[0], w.shape[2]),
)  # fmt: skip


def _weight_grad_impl(
    grad: torch.Tensor, x: torch.Tensor, splits: list[int], dtype: torch.dtype
) -> torch.Tensor:
    """``dw[e] = grad[rows of e]^T @ x[rows of e]`` (``[E, N, K]`` in ``dtype``; zero for an expert
    without rows), both operands per 128 x 1 tile of the expert's rows."""
    g, x = grad.contiguous(), x.contiguous()
    (gt, gts), (xt, xts) = _cols((g, x), splits)
    dw = g.new_empty(len(splits), g.shape[1], x.shape[1], dtype=dtype)
    tiles = [-(-rows // TILE) for rows in splits]  # each expert's 128 x 1 tiles
    cols = [n * TILE for n in tiles]
    parts = zip(
        dw.unbind(0), tiles, gt.split(cols, 1), gts.split(tiles, 1), xt.split(cols, 1),
        xts.split(tiles, 1),
    )  # fmt: skip
    for dwe, n, ge, ges, xe, xes in parts:
        if n:
            scaled_mm(ge, ges, xe, xes, False, dwe)
        else:
            dwe.zero_()
    return dw


_weight_grad = define(
    "fp8_mm_weight_grad(Tensor grad, Tensor x, SymInt[] splits, ScalarType dtype) -> Tensor",
    _weight_grad_impl,
    lambda grad, x, splits, dtype: grad.new_empty(
        len(splits), grad.shape[1], x.shape[1], dtype=dtype
    ),
)


def _backward(ctx, grad: torch.Tensor):
    x, w = ctx.saved_tensors
    dx = _input_grad(grad, w, ctx.splits) if ctx.needs_input_grad[0] else None
    dw = _weight_grad(grad, x, ctx.splits, w.dtype) if ctx.needs_input_grad[1] else None
    return dx, dw, None


# ``out[rows of e] = x[rows of e] @ w[e]^T`` for every expert e (``model/expert_mm.py``'s product;
# ``splits[e]`` rows each), in FP8 (module docstring)
fp8_expert_mm = define(
    "fp8_mm(Tensor x, Tensor w, SymInt[] splits) -> Tensor",
    _fp8_mm, _fp8_mm_fake, _backward, _setup,
)  # fmt: skip


class Fp8HeadProducts:
    """The three products of the LM head's fused loss (``model/head.py``) in FP8, for ``weight [V,
    D]``: the logits ``h W^T``, the input gradient ``g W`` and the weight gradient ``g^T h`` of a
    chunk of tokens, with the module docstring's scaling. The weight is quantised once per loss
    (and once more, laid transposed, when the input gradient is asked for), not per chunk.

    The weight gradient accumulates over the chunks in the weight's dtype: the first chunk's
    product is written into it, a later chunk's is formed ``PIECE`` vocabulary rows at a time and
    added (cuBLAS's FP8 GEMM cannot add into its output; a piece bounds the temporary)."""

    PIECE = 16384  # vocabulary rows per temporary of a later chunk's weight gradient

    def __init__(self, weight: torch.Tensor, input_grad: bool) -> None:
        if weight.shape[0] % TILE or weight.shape[1] % TILE:
            raise ValueError(
                f"Fp8HeadProducts: the head's weight {tuple(weight.shape)} is not in 128 x 128 "
                "blocks"
            )
        w = weight.unsqueeze(0).contiguous()
        self.wq, self.ws = _blocks(w)
        if input_grad:
            self.wtq, self.wts = _blocks_transposed(w)

    def logits(self, h_c: torch.Tensor) -> torch.Tensor:
        """``h_c [c, D] @ W^T`` -> ``[c, V]`` in h's dtype."""
        return _times_blocks(h_c, self.wq, self.ws, [h_c.shape[0]])

    def input_grad(self, g: torch.Tensor, out: torch.Tensor) -> None:
        """``out [c, D] = g [c, V] @ W``."""
        _times_blocks(g, self.wtq, self.wts, [g.shape[0]], out)

    def weight_grad(
        self, g: torch.Tensor, h_c: torch.Tensor, dw: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """``dw [V, D] += g^T @ h_c`` (a new ``dw`` of ``dtype`` when None); returns ``dw``."""
        (gt, gts), (ht, hts) = _cols((g.contiguous(), h_c.contiguous()), [g.shape[0]])
        first = dw is None
        if first:
            dw = g.new_empty(gt.shape[0], ht.shape[0], dtype=dtype)
        for r0 in range(0, gt.shape[0], self.PIECE):
            rows = slice(r0, r0 + self.PIECE)
            # a row slice of the scales, repacked rows-contiguous as cuBLAS reads them
            a_s = gts[rows].t().contiguous().t()
            out = dw[rows] if first else dw.new_empty(a_s.shape[0], dw.shape[1])
            scaled_mm(gt[rows], a_s, ht, hts, False, out)
            if not first:
                dw[rows] += out
        return dw


def fp8_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ w [N, K]^T`` in FP8 (module docstring), rounded to x's dtype: the one-expert
    case of ``fp8_expert_mm``."""
    x2 = x.reshape(-1, x.shape[-1])
    return fp8_expert_mm(x2, w.unsqueeze(0), [x2.shape[0]]).view(*x.shape[:-1], w.shape[0])


__all__ = [
    "Fp8HeadProducts",
    "fp8_expert_mm",
    "fp8_linear",
    "quant_blocks",
    "quant_cols",
    "quant_rows",
    "scaled_mm",
]
