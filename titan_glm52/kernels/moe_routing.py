"""The MoE's token-routing gathers, one pass each over the ``tokens x top-k`` rows of the hidden
size.

``pos [n, k]`` (int64) holds, for token t, the rows of its k choices in the expert-sorted order
(ascending expert id); every token's rows are read through it, so nothing is scattered and nothing
is added atomically:

* ``gather_sum(src, pos, w)``: ``out[t] = sum_j y[t, j]`` summed in fp32, j ascending, rounded once,
  with ``y[t, j] = src[pos[t, j]]`` or, given fp32 weights ``w [n, k]``, ``y[t, j] =
  round(float(src[pos[t, j]]) * w[t, j])`` (the product formed in fp32 and rounded to the output's
  dtype). The combine of the routed expert outputs (weighted) and the backward of the dispatch
  gather ``x[token_of]`` (unweighted; in torch that backward is a scatter-add into a zero tensor,
  atomics on the GPU).
* ``combine_backward(grad, rows, pos, w)``: the combine's two gradients in one pass, ``d rows[pos[t,
  j]] = round(float(grad[t]) * w[t, j])`` and ``d w[t, j] = sum_c float(grad[t, c]) *
  float(rows[pos[t, j], c])`` (fp32).

``model/moe.py`` computes the same numbers in torch where these kernels do not run (CPU): the sums
in the same order (bitwise equal), the weights' gradient up to the order of its fp32 dot product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_env import check_device, interpreting, pow2

BLOCK = 1024  # hidden columns per program of gather_sum
BWD_BLOCK = 512  # hidden columns per loop step of combine_backward (k rows of them at a time)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _mul_rn(a, b, ASM: tl.constexpr):
    """``a * b`` (fp32) rounded on its own: compiled, the add that follows would otherwise be
    contracted with it into an fma (one rounding fewer than torch's mul then add); PTX's ``mul.rn``
    is never contracted. (The interpreter, numpy, does not contract: plain ``*`` there.)"""
    if ASM:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    return a * b


@triton.jit
def _gather_sum_kernel(
    src_ptr,
    pos_ptr,
    w_ptr,
    out_ptr,
    D,
    stride_src,
    stride_out,
    K: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK: tl.constexpr,
    ASM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K):
        p = tl.load(pos_ptr + t * K + j)
        y = tl.load(src_ptr + p * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
        if WEIGHTED:
            w = tl.load(w_ptr + t * K + j) + tl.zeros_like(y)
            y = _mul_rn(y, w, ASM).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        acc += y.to(tl.float32)
    tl.store(
        out_ptr + t * stride_out + cols,
        acc.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
        mask=mask,
    )


@triton.jit
def _combine_bwd_kernel(
    grad_ptr,
    rows_ptr,
    pos_ptr,
    w_ptr,
    grows_ptr,
    gw_ptr,
    D,
    stride_g,
    stride_r,
    stride_gr,
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, KP)
    live = j < K
    p = tl.load(pos_ptr + t * K + j, mask=live, other=0)
    w = tl.load(w_ptr + t * K + j, mask=live, other=0.0)
    dots = tl.zeros([KP], tl.float32)
    for c0 in range(0, D, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        cm = cols < D
        m2 = live[:, None] & cm[None, :]
        g = tl.load(grad_ptr + t * stride_g + cols, mask=cm, other=0.0).to(tl.float32)
        gr = (g[None, :] * w[:, None]).to(grows_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(grows_ptr + p[:, None] * stride_gr + cols[None, :], gr, mask=m2)
        r = tl.load(rows_ptr + p[:, None] * stride_r + cols[None, :], mask=m2, other=0.0).to(
            tl.float32
        )
        dots += tl.sum(g[None, :] * r, axis=1)
    tl.store(gw_ptr + t * K + j, dots, mask=live)


def _block(d: int, cap: int) -> int:
    """Columns per block: a power of two covering ``d``, at most ``cap`` on the GPU (the
    interpreter, which pays per program and loop step, takes the whole row)."""
    whole = pow2(d, minimum=1)
    return whole if interpreting() else min(cap, whole)


def _check(name: str, src: torch.Tensor, pos: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """Checks the arguments; returns ``src`` with unit column stride (a copy only if it had
    another)."""
    if src.dtype not in DTYPES or src.dim() != 2:
        raise ValueError(
            f"{name}: rows must be 2-D in bf16/fp16/fp32, got {tuple(src.shape)} {src.dtype}"
        )
    if pos.dtype != torch.int64 or pos.dim() != 2 or not pos.is_contiguous():
        raise ValueError(
            f"{name}: pos must be a contiguous int64 [n, k], got {tuple(pos.shape)} {pos.dtype}"
        )
    if w is not None and (
        w.dtype != torch.float32 or w.shape != pos.shape or not w.is_contiguous()
    ):
        raise ValueError(
            f"{name}: w must be a contiguous fp32 {tuple(pos.shape)}, got {tuple(w.shape)} "
            f"{w.dtype}"
        )
    check_device(src, pos, *([] if w is None else [w]))
    return src if src.stride(1) == 1 else src.contiguous()


def gather_sum(
    src: torch.Tensor,
    pos: torch.Tensor,
    w: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``[n, D]``: row t = the fp32 sum over j (ascending) of ``src[pos[t, j]]``, each weighted by
    ``w[t, j]`` and rounded to ``out_dtype`` (default ``src``'s) first when ``w`` is given; rounded
    once at the end."""
    src = _check("gather_sum", src, pos, w)
    n, k = pos.shape
    d = src.shape[1]
    out = torch.empty(n, d, dtype=out_dtype or src.dtype, device=src.device)
    if n and d:
        block = _block(d, BLOCK)
        _gather_sum_kernel[(n, triton.cdiv(d, block))](
            src,
            pos,
            pos if w is None else w,
            out,
            d,
            src.stride(0),
            out.stride(0),
            K=k,
            WEIGHTED=w is not None,
            BLOCK=block,
            ASM=not interpreting(),
            num_warps=4,
        )
    return out


def combine_backward(
    grad: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``d rows`` like ``rows``, ``d w`` fp32 ``[n, k]``) of ``gather_sum(rows, pos, w,
    grad.dtype)`` for the output gradient ``grad [n, D]``; every row of ``rows`` must appear in
    ``pos`` (it is written once, not zeroed)."""
    rows = _check("combine_backward", rows, pos, w)
    grad = grad.contiguous()
    check_device(grad)
    n, k = pos.shape
    d = rows.shape[1]
    if grad.shape != (n, d):
        raise ValueError(f"combine_backward: grad {tuple(grad.shape)} must be [{n}, {d}]")
    d_rows = torch.empty_like(rows)
    d_w = torch.empty(n, k, dtype=torch.float32, device=rows.device)
    if n:
        _combine_bwd_kernel[(n,)](
            grad,
            rows,
            pos,
            w,
            d_rows,
            d_w,
            d,
            grad.stride(0),
            rows.stride(0),
            d_rows.stride(0),
            K=k,
            KP=triton.next_power_of_2(k),
            BLOCK=_block(d, BWD_BLOCK),
            num_warps=4,
        )
    return d_rows, d_w


def compile_specs(small: bool = False):
    """Launch configurations for ``bench/compile_check.py`` (offline sm_90 compile): the proxy's
    top-8 at hidden 6144 (``small``: top-3), bf16 rows, weighted and not."""
    k = 3 if small else 8
    sig = {
        "src_ptr": "*bf16",
        "pos_ptr": "*i64",
        "w_ptr": "*fp32",
        "out_ptr": "*bf16",
        "D": "i32",
        "stride_src": "i32",
        "stride_out": "i32",
    }
    out = [
        (
            f"moe_gather_sum_w{int(weighted)}",
            (
                _gather_sum_kernel,
                sig,
                dict(K=k, WEIGHTED=weighted, BLOCK=BLOCK, ASM=True),
                4,
                3,
                (),
            ),
        )
        for weighted in (True, False)
    ]
    sig = {
        "grad_ptr": "*bf16",
        "rows_ptr": "*bf16",
        "pos_ptr": "*i64",
        "w_ptr": "*fp32",
        "grows_ptr": "*bf16",
        "gw_ptr": "*fp32",
        "D": "i32",
        "stride_g": "i32",
        "stride_r": "i32",
        "stride_gr": "i32",
    }
    out.append(
        (
            "moe_combine_bwd",
            (
                _combine_bwd_kernel,
                sig,
                dict(K=k, KP=triton.next_power_of_2(k), BLOCK=BWD_BLOCK),
                4,
                3,
                (),
            ),
        )
    )
    return out


__all__ = ["gather_sum", "combine_backward"]
