"""``float(x) @ float(w)^T`` for a bf16 input ``x [T, D]`` and a few output features (``w [N, D]``,
N up to 64): the fp32 projections the published model keeps beside its bf16 ones, the MoE router (N
= n_routed_experts) and the indexer's head weights (N = index_n_heads).

In torch that is a cast of the whole input to fp32 (``[T, D]`` fp32: 805 MB per layer at 32K tokens
and the proxy's hidden 6144) and a cuBLAS fp32 GEMM whose narrow output keeps it on a small-tile
FFMA kernel; the backward casts again and runs two more (about 2 ms per router forward + backward at
32K tokens on an H200). Here each product is one pass over ``x`` on the tensor cores, exact to fp32:
every fp32 operand is split into three bf16 terms, ``a = a_hi + a_mid + a_lo`` (8 significant bits
each, together fp32's 24; split in registers), each bf16 product is exact in the fp32 accumulator,
and the terms' products are summed from the smallest up (a bf16 weight is its own single term). The
result is the fp32 product up to fp32 summation order (``tests/kernels/test_linear_fp32.py`` bounds
it against fp64):

* ``linear_fp32_forward(x, w) -> [T, N]`` fp32;
* ``linear_fp32_grad_input(g, w, dtype) -> [T, D]``: ``g @ float(w)`` summed in fp32 and rounded
  once into ``dtype`` (what autograd gives through ``x.float()``: the fp32 gradient, then the cast);
* ``linear_fp32_grad_weight(g, x) -> [N, D]`` fp32: ``g^T @ float(x)``, each program summing a slab
  of rows, the slabs then added in a fixed order (deterministic).

``model/fp32_linear.py`` wires them into autograd (and runs torch where they do not apply).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_env import check_device, pow2

MAX_N = 64
BT = 64  # rows per program (forward, input gradient) and per step (weight gradient)
BD = 128  # input columns per step (forward) and per program (input gradient, weight gradient)
# weight gradient: row slabs enough for about this many programs (4 per SM of an H100 / H200)
PROGRAMS = 528


@triton.jit
def _split3(a):
    """fp32 ``a`` as three bf16 terms (hi, mid, lo) whose sum is ``a`` (to fp32's precision)."""
    hi = a.to(tl.bfloat16)
    r = a - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _lin32_fwd_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    T,
    D,
    stride_xt,
    stride_wn,
    stride_ot,
    N: tl.constexpr,
    NP: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    W_BF16: tl.constexpr,
):
    """out = x @ (w_lo + w_mid + w_hi)^T (W_BF16: w is its own hi term)."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < T
    n = tl.arange(0, NP)
    acc = tl.zeros([BT, NP], tl.float32)
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        cmask = cols < D
        x = tl.load(
            x_ptr + rows.to(tl.int64)[:, None] * stride_xt + cols[None, :],
            mask=rmask[:, None] & cmask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + n[None, :] * stride_wn + cols[:, None],
            mask=(n < N)[None, :] & cmask[:, None],
            other=0.0,
        )  # [BD, NP]
        if W_BF16:
            acc = tl.dot(x, w, acc)
        else:
            w_hi, w_mid, w_lo = _split3(w.to(tl.float32))
            acc = tl.dot(x, w_lo, acc)
            acc = tl.dot(x, w_mid, acc)
            acc = tl.dot(x, w_hi, acc)
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_ot + n[None, :],
        acc,
        mask=rmask[:, None] & (n < N)[None, :],
    )


@triton.jit
def _lin32_grad_input_kernel(
    g_ptr,
    w_ptr,
    dx_ptr,
    T,
    D,
    stride_gt,
    stride_wn,
    stride_dt,
    N: tl.constexpr,
    NP: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    DOWN: tl.constexpr,
    W_BF16: tl.constexpr,
):
    """dx = (g_lo + g_mid + g_hi) @ (w_lo + w_mid + w_hi), the bf16 products from the smallest up
    (W_BF16: the three with w itself)."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    rmask, cmask = rows < T, cols < D
    n = tl.arange(0, NP)
    g = tl.load(
        g_ptr + rows.to(tl.int64)[:, None] * stride_gt + n[None, :],
        mask=rmask[:, None] & (n < N)[None, :],
        other=0.0,
    )
    g_hi, g_mid, g_lo = _split3(g)
    w = tl.load(
        w_ptr + n[:, None] * stride_wn + cols[None, :],
        mask=(n < N)[:, None] & cmask[None, :],
        other=0.0,
    )  # [NP, BD]
    if W_BF16:
        dx = tl.dot(g_lo, w)
        dx = tl.dot(g_mid, w, dx)
        dx = tl.dot(g_hi, w, dx)
    else:
        w_hi, w_mid, w_lo = _split3(w.to(tl.float32))
        dx = tl.dot(g_lo, w_lo)
        dx = tl.dot(g_mid, w_lo, dx)
        dx = tl.dot(g_lo, w_mid, dx)
        dx = tl.dot(g_hi, w_lo, dx)
        dx = tl.dot(g_mid, w_mid, dx)
        dx = tl.dot(g_lo, w_hi, dx)
        dx = tl.dot(g_hi, w_mid, dx)
        dx = tl.dot(g_mid, w_hi, dx)
        dx = tl.dot(g_hi, w_hi, dx)
    if DOWN:  # a narrower dtype than fp32: round to nearest even, as torch's cast
        dx = dx.to(dx_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(
        dx_ptr + rows.to(tl.int64)[:, None] * stride_dt + cols[None, :],
        dx,
        mask=rmask[:, None] & cmask[None, :],
    )


@triton.jit
def _lin32_grad_weight_kernel(
    g_ptr,
    x_ptr,
    part_ptr,
    T,
    D,
    SLAB,
    stride_gt,
    stride_xt,
    stride_ps,
    N: tl.constexpr,
    NP: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
):
    """part[slab] = (g_lo + g_mid + g_hi)^T @ x over the slab's rows."""
    cols = tl.program_id(0) * BD + tl.arange(0, BD)
    slab = tl.program_id(1)
    cmask = cols < D
    n = tl.arange(0, NP)
    acc = tl.zeros([NP, BD], tl.float32)
    for t0 in range(slab * SLAB, tl.minimum(slab * SLAB + SLAB, T), BT):
        rows = t0 + tl.arange(0, BT)
        rmask = rows < T
        g = tl.load(
            g_ptr + rows.to(tl.int64)[None, :] * stride_gt + n[:, None],
            mask=rmask[None, :] & (n < N)[:, None],
            other=0.0,
        )  # [NP, BT]
        g_hi, g_mid, g_lo = _split3(g)
        x = tl.load(
            x_ptr + rows.to(tl.int64)[:, None] * stride_xt + cols[None, :],
            mask=rmask[:, None] & cmask[None, :],
            other=0.0,
        )
        acc = tl.dot(g_lo, x, acc)
        acc = tl.dot(g_mid, x, acc)
        acc = tl.dot(g_hi, x, acc)
    tl.store(
        part_ptr + slab.to(tl.int64) * stride_ps + n[:, None] * D + cols[None, :],
        acc,
        mask=(n < N)[:, None] & cmask[None, :],
    )


def _check_bf16(x: torch.Tensor) -> None:
    if x.dtype != torch.bfloat16:
        raise ValueError(f"linear_fp32: x must be bf16 (exact in the bf16 products), got {x.dtype}")


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"linear_fp32: x [T, D] and w [N, D] expected, got {tuple(x.shape)} and "
            f"{tuple(w.shape)}"
        )
    if not 1 <= w.shape[0] <= MAX_N:
        raise ValueError(
            f"linear_fp32: at most {MAX_N} output features, got {w.shape[0]} (use F.linear)"
        )
    _check_bf16(x)


def linear_fp32_forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``float(x) @ float(w)^T`` ``[T, N]`` fp32."""
    _check(x, w)
    x, w = x.contiguous(), w.contiguous()
    check_device(x, w)
    t, d = x.shape
    n = w.shape[0]
    out = torch.empty(t, n, dtype=torch.float32, device=x.device)
    if t:
        _lin32_fwd_kernel[(triton.cdiv(t, BT),)](
            x,
            w,
            out,
            t,
            d,
            x.stride(0),
            w.stride(0),
            out.stride(0),
            N=n,
            NP=pow2(n),
            BT=BT,
            BD=BD,
            W_BF16=w.dtype == torch.bfloat16,
            num_warps=4,
        )
    return out


def linear_fp32_grad_input(g: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``g @ float(w)`` for ``g [T, N]`` fp32, summed in fp32 and rounded once into ``dtype``: ``[T,
    D]``."""
    g, w = g.float().contiguous(), w.contiguous()
    if g.dim() != 2 or g.shape[1] != w.shape[0]:
        raise ValueError(
            f"linear_fp32: gradient {tuple(g.shape)} does not match the weight {tuple(w.shape)}"
        )
    check_device(g, w)
    t, n = g.shape
    d = w.shape[1]
    dx = torch.empty(t, d, dtype=dtype, device=g.device)
    if t:
        _lin32_grad_input_kernel[(triton.cdiv(t, BT), triton.cdiv(d, BD))](
            g,
            w,
            dx,
            t,
            d,
            g.stride(0),
            w.stride(0),
            dx.stride(0),
            N=n,
            NP=pow2(n),
            BT=BT,
            BD=BD,
            DOWN=dtype != torch.float32,
            W_BF16=w.dtype == torch.bfloat16,
            num_warps=4,
        )
    return dx


def linear_fp32_grad_weight(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``g^T @ float(x)`` for ``g [T, N]`` fp32 and ``x [T, D]``: ``[N, D]`` fp32, deterministic
    (per-slab sums added in slab order)."""
    g, x = g.float().contiguous(), x.contiguous()
    if g.dim() != 2 or x.dim() != 2 or g.shape[0] != x.shape[0]:
        raise ValueError(
            f"linear_fp32: gradient {tuple(g.shape)} does not match the input {tuple(x.shape)}"
        )
    _check_bf16(x)
    check_device(g, x)
    t, n = g.shape
    d = x.shape[1]
    if not t:
        return torch.zeros(n, d, dtype=torch.float32, device=x.device)
    col_blocks = triton.cdiv(d, BD)
    # slabs of whole row blocks, as many as give every SM a few programs (at 4K tokens one slab per
    # 2K rows left most of an H200 idle: 96 programs); a constant, not a device query, so that
    # compiled graphs trace it as is
    want = max(1, PROGRAMS // col_blocks)
    slab = triton.cdiv(triton.cdiv(t, want), BT) * BT
    slabs = triton.cdiv(t, slab)
    part = torch.empty(slabs, n, d, dtype=torch.float32, device=x.device)
    _lin32_grad_weight_kernel[(col_blocks, slabs)](
        g,
        x,
        part,
        t,
        d,
        slab,
        g.stride(0),
        x.stride(0),
        part.stride(0),
        N=n,
        NP=pow2(n),
        BT=BT,
        BD=BD,
        num_warps=4,
    )
    return part.sum(0)


def compile_specs(small: bool = False):
    """Launch configurations for ``bench/compile_check.py`` (offline sm_90 compile): bf16 input, 16
    features."""
    n, np_ = 16, 16
    fwd = (
        {
            "x_ptr": "*bf16",
            "w_ptr": "*fp32",
            "out_ptr": "*fp32",
            "T": "i32",
            "D": "i32",
            "stride_xt": "i32",
            "stride_wn": "i32",
            "stride_ot": "i32",
        },
        {"N": n, "NP": np_, "BT": BT, "BD": BD, "W_BF16": False},
    )
    gin = (
        {
            "g_ptr": "*fp32",
            "w_ptr": "*fp32",
            "dx_ptr": "*bf16",
            "T": "i32",
            "D": "i32",
            "stride_gt": "i32",
            "stride_wn": "i32",
            "stride_dt": "i32",
        },
        {"N": n, "NP": np_, "BT": BT, "BD": BD, "DOWN": True, "W_BF16": False},
    )
    gw = (
        {
            "g_ptr": "*fp32",
            "x_ptr": "*bf16",
            "part_ptr": "*fp32",
            "T": "i32",
            "D": "i32",
            "SLAB": "i32",
            "stride_gt": "i32",
            "stride_xt": "i32",
            "stride_ps": "i32",
        },
        {"N": n, "NP": np_, "BT": BT, "BD": BD},
    )
    return [
        ("linear_fp32_fwd", (_lin32_fwd_kernel, *fwd, 4, 3, ("x_ptr", "w_ptr", "out_ptr"))),
        (
            "linear_fp32_grad_input",
            (_lin32_grad_input_kernel, *gin, 4, 3, ("g_ptr", "w_ptr", "dx_ptr")),
        ),
        (
            "linear_fp32_grad_weight",
            (_lin32_grad_weight_kernel, *gw, 4, 3, ("g_ptr", "x_ptr", "part_ptr")),
        ),
    ]


__all__ = ["linear_fp32_forward", "linear_fp32_grad_input", "linear_fp32_grad_weight", "MAX_N"]
