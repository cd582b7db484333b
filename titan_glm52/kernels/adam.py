"""One Adam / AdamW update of one tensor in one pass: read the parameter, its gradient and both
moments, write the parameter and both moments (28 bytes per fp32 parameter, the least an fp32 Adam
step can move). The optional gradient multiplier (the clip coefficient) and skip flag (a non-finite
step) are device scalars, so the update never waits for the host.

torch's fused AdamW moves 32 bytes per parameter when it is handed a ``grad_scale`` (it writes the
divided gradient back), and its DTensor dispatch over every parameter costs milliseconds of host
time per step; the optimizer that calls this kernel (``titan_glm52.optimizer``) hands it the local
tensors instead.

The math is torch's Adam / AdamW: fp32 with IEEE-rounded division and square root, the moments and
the bias corrections in double as torch's CUDA kernel forms them, AdamW's decay as torch's for-loop
and CPU kernels apply it (its CUDA kernel forms ``p - lr * wd * p`` in double instead):

    g = grad * coef;  g += wd * p (Adam)  |  p *= 1 - lr * wd (AdamW)
    m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g * g
    p -= (lr / (1 - beta1^step)) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)

``step`` is the state's device counter, already incremented for this step.
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from ._triton_env import check_device, elementwise_block

# Launch parameters (bench/adam.py sweeps them on the GPU).
BLOCK = 1024
NUM_WARPS = 4


_DOUBLES = (
    "lr",
    "beta1",
    "beta2",
    "one_minus_beta1",
    "one_minus_beta2",
    "eps",
    "weight_decay",
    "decay",
    "log2_beta1",
    "log2_beta2",
)


@triton.jit
def _f64(bits):
    # (an argument that fits in 32 bits, such as the bits of 0.0, arrives as an int32: widen it
    # first)
    return bits.to(tl.int64).to(tl.float64, bitcast=True)


@triton.jit(do_not_specialize=list(_DOUBLES))
def _adam_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    step_ptr,
    coef_ptr,
    skip_ptr,
    c_ptr,
    n,
    lr,
    beta1,
    beta2,
    one_minus_beta1,
    one_minus_beta2,
    eps,
    weight_decay,
    decay,
    log2_beta1,
    log2_beta2,
    HAS_COEF: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    HAS_COPY: tl.constexpr,
    DECOUPLED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # The hyperparameters arrive as the bits of Python floats (a float argument would be rounded to
    # fp32), so the expressions torch's CUDA kernel forms in double are formed in double here and
    # rounded where it rounds.
    lr = _f64(lr)
    beta1 = _f64(beta1)
    beta2 = _f64(beta2)
    one_minus_beta1 = _f64(one_minus_beta1)
    one_minus_beta2 = _f64(one_minus_beta2)
    eps = _f64(eps)
    weight_decay = _f64(weight_decay)
    decay = _f64(decay)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if HAS_SKIP:  # a skipped step reads and writes nothing
        n = tl.where(tl.load(skip_ptr) == 0, n, 0)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # Launched with fp fusion off (no multiply-add contraction), so every operation rounds where it
    # is written, as in torch, and the result does not depend on the launch variant (a clip in the
    # kernel equals the in-place clip, bit for bit); the double expressions use explicit FMAs.
    if HAS_COEF:  # the in-place clip's product
        g = g * tl.load(coef_ptr).to(tl.float32)
    if DECOUPLED:  # torch's p.mul_(1 - lr * wd): the factor rounded to fp32
        p = p * decay.to(tl.float32)
    else:
        g = tl.fma(p.to(tl.float64), weight_decay, g.to(tl.float64)).to(tl.float32)
    g64 = g.to(tl.float64)
    m = tl.fma(beta1, m.to(tl.float64), one_minus_beta1 * g64).to(tl.float32)
    v = tl.fma(beta2, v.to(tl.float64), (one_minus_beta2 * g64) * g64).to(tl.float32)
    step = tl.load(step_ptr).to(tl.float64)
    bc1 = 1.0 - tl.exp2(step * _f64(log2_beta1))
    bc2_sqrt = tl.sqrt(1.0 - tl.exp2(step * _f64(log2_beta2)))
    step_size = (lr / bc1).to(tl.float32)
    denom = (tl.sqrt_rn(v).to(tl.float64) / bc2_sqrt + eps).to(tl.float32)
    p = p - tl.div_rn(step_size * m, denom)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    # the compute copy of the updated parameter (torch's ``copy_``: round to nearest even)
    if HAS_COPY:
        tl.store(c_ptr + offs, p.to(c_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def _bits(x: float) -> int:
    """The IEEE double bits of ``x`` as a signed int64 (how the kernel receives a double)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense with positive strides: its elements fill ``numel`` slots from
    ``data_ptr``."""
    if t.is_contiguous():
        return True
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return all(s > 0 for s in t.stride()) and t.permute(order).is_contiguous()


def adam_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    grad_coef: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
    copy_to: torch.Tensor | None = None,
) -> None:
    """Updates ``param``, ``exp_avg``, ``exp_avg_sq`` in place (one kernel; ``grad`` and ``step``
    are read only).

    The four tensors share shape and memory layout (any dense layout; a transposed shard is fine);
    ``grad`` may have another floating dtype than the parameter (a bf16 gradient of fp32 master
    weights is widened exactly). ``step`` is a one-element tensor on the same device holding this
    step's count (>= 1); ``grad_coef`` multiplies the gradient; where ``skip`` (one element) is
    non-zero nothing is read or written. ``copy_to`` (same shape and layout, e.g. bf16) receives the
    updated parameter rounded to its dtype, as ``copy_`` would (2 more bytes per bf16 element;
    ``master_weights``' compute weights).
    """
    tensors = (param, grad, exp_avg, exp_avg_sq) + ((copy_to,) if copy_to is not None else ())
    for name, t in zip(("grad", "exp_avg", "exp_avg_sq", "copy_to"), tensors[1:]):
        if t.shape != param.shape or t.stride() != param.stride() or t.device != param.device:
            raise ValueError(
                f"adam_step_: {name} has shape {tuple(t.shape)}, strides {t.stride()} on "
                f"{t.device}; "
                f"the parameter has {tuple(param.shape)}, {param.stride()} on {param.device}"
            )
    if not _dense(param):
        raise ValueError(
            f"adam_step_: the parameter's layout (shape {tuple(param.shape)}, strides "
            f"{param.stride()}) "
            "is not dense; the kernel walks the tensors' memory linearly"
        )
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if any(t.dtype not in floats for t in tensors):
        raise ValueError(
            f"adam_step_: unsupported dtypes {[t.dtype for t in tensors]}; fp32 / bf16 / fp16 only"
        )
    scalars = [s for s in (step, grad_coef, skip) if s is not None]
    for s in scalars:
        if s.numel() != 1 or s.device != param.device:
            raise ValueError(
                f"adam_step_: step / grad_coef / skip must be one-element tensors on "
                f"{param.device}, "
                f"got shape {tuple(s.shape)} on {s.device}"
            )
    check_device(*tensors, *scalars)
    n = param.numel()
    if n == 0:
        return
    block = elementwise_block(BLOCK, n)
    _adam_kernel[(triton.cdiv(n, block),)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        step,
        grad_coef if grad_coef is not None else step,
        skip if skip is not None else step,
        copy_to if copy_to is not None else param,
        n,
        *[
            _bits(x)
            for x in (
                lr,
                beta1,
                beta2,
                1.0 - beta1,
                1.0 - beta2,
                eps,
                weight_decay,
                1.0 - lr * weight_decay,
                math.log2(beta1) if beta1 > 0 else -math.inf,
                math.log2(beta2) if beta2 > 0 else -math.inf,
            )
        ],
        HAS_COEF=grad_coef is not None,
        HAS_SKIP=skip is not None,
        HAS_COPY=copy_to is not None,
        DECOUPLED=bool(decoupled),
        BLOCK=block,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )


def compile_specs(small: bool = False):
    """Launch configurations for ``bench/compile_check.py`` (offline sm_90 compile): fp32 and bf16
    state."""
    out = []
    ptrs = ("p_ptr", "g_ptr", "m_ptr", "v_ptr", "c_ptr")
    for name, (dt, gdt, copy) in {
        "fp32": ("fp32", "fp32", False),
        "bf16": ("bf16", "bf16", False),
        "fp32_master_bf16": ("fp32", "bf16", True),
    }.items():
        sig = {
            "p_ptr": f"*{dt}",
            "g_ptr": f"*{gdt}",
            "m_ptr": f"*{dt}",
            "v_ptr": f"*{dt}",
            "step_ptr": "*fp32",
            "coef_ptr": "*fp32",
            "skip_ptr": "*fp32",
            "c_ptr": "*bf16" if copy else f"*{dt}",
            "n": "i64",
            **{d: "i64" for d in _DOUBLES},
        }
        consts = {
            "HAS_COEF": True,
            "HAS_SKIP": True,
            "HAS_COPY": copy,
            "DECOUPLED": True,
            "BLOCK": BLOCK,
        }
        out.append(
            (
                f"adam_{name}",
                (_adam_kernel, sig, consts, NUM_WARPS, 3, ptrs, {"enable_fp_fusion": False}),
            )
        )
    return out


__all__ = ["adam_step_"]
