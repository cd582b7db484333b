"""Row-wise cross-entropy of a logits chunk and its gradient in place, in two passes over the
logits.

The fused loss (model/head.py) turns each chunk's logits ``z [M, V]`` (the head GEMM's output, in
the compute dtype) into the summed loss and ``d loss / d z = softmax(z) - onehot(label)``. In torch
that is a cast to fp32, a logsumexp, a gather, then subtract, exp, scatter, mask and a cast back:
some ten passes over an fp32 copy of the chunk (2.5 GB per 4096 tokens at GLM-5.2's vocabulary).
Here one program per row reads the row once for its running max and sum of exponentials (fp32), then
once more to write ``exp(z - lse) - onehot`` over ``z`` itself, rounded to z's dtype; an ignored row
(label ``ignore_index``) gets loss 0 and gradient 0. The numbers are the torch path's up to fp32
rounding (summation order, exp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_env import check_device

BLOCK = 8192


@triton.jit
def _ce_rows_kernel(
    z_ptr,
    labels_ptr,
    loss_ptr,
    V,
    stride_z,
    IGNORE: tl.constexpr,
    BLOCK: tl.constexpr,
    WANT_GRAD: tl.constexpr,
):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride_z
    label = tl.load(labels_ptr + row)
    valid = label != IGNORE
    offs = tl.arange(0, BLOCK)
    m = -float("inf")
    s = 0.0
    for v0 in range(0, V, BLOCK):  # running max and sum of exp(z - max), in fp32
        x = tl.load(base + v0 + offs, mask=v0 + offs < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    target = tl.where(valid, label, 0)
    z_target = tl.load(base + target).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - z_target, 0.0))
    if WANT_GRAD:
        for v0 in range(0, V, BLOCK):
            cols = v0 + offs
            x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
            g = tl.where(valid, g, 0.0)
            tl.store(
                base + cols,
                g.to(z_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                mask=cols < V,
            )


def cross_entropy_rows(
    z: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    grad_in_place: bool,
    block: int = BLOCK,
) -> torch.Tensor:
    """Per-row fp32 loss ``[M]`` of logits ``z [M, V]`` (rows contiguous) against ``labels [M]``;
    with ``grad_in_place`` z is overwritten by ``softmax(z) - onehot(label)`` (0 on ignored rows) in
    z's dtype."""
    if z.dim() != 2 or z.stride(1) != 1:
        raise ValueError(
            f"cross_entropy_rows: z must be a 2-D tensor with contiguous rows, got "
            f"{tuple(z.shape)} "
            f"strides {z.stride()}"
        )
    if labels.shape != (z.shape[0],):
        raise ValueError(
            f"cross_entropy_rows: labels {tuple(labels.shape)} do not match z {tuple(z.shape)}"
        )
    labels = labels.contiguous()
    check_device(z, labels)
    loss = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
    if z.shape[0]:
        _ce_rows_kernel[(z.shape[0],)](
            z,
            labels,
            loss,
            z.shape[1],
            z.stride(0),
            IGNORE=ignore_index,
            BLOCK=block,
            WANT_GRAD=grad_in_place,
            num_warps=8,
        )
    return loss


def compile_specs(small: bool = False):
    """Launch configurations for ``bench/compile_check.py`` (offline sm_90 compile): bf16 and fp32
    logits."""
    out = []
    for dt in ("bf16", "fp32"):
        sig = {
            "z_ptr": f"*{dt}",
            "labels_ptr": "*i64",
            "loss_ptr": "*fp32",
            "V": "i32",
            "stride_z": "i32",
        }
        consts = {"IGNORE": -100, "BLOCK": 256 if small else BLOCK, "WANT_GRAD": True}
        out.append(
            (
                f"cross_entropy_{dt}",
                (_ce_rows_kernel, sig, consts, 8, 3, ("z_ptr", "labels_ptr", "loss_ptr")),
            )
        )
    return out


__all__ = ["cross_entropy_rows"]
