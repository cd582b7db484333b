"""The output head and its fused linear + cross-entropy loss.

``OutputHead`` is the checkpoint's ``lm_head`` (a bias-free ``nn.Linear``, state-dict key
``weight``). Called with labels it returns the summed token cross-entropy instead of logits, and the
``[T, vocab]`` logits never exist at once: ``LOSS_CHUNK`` tokens at a time, each chunk's logits are
formed, reduced to the loss, turned into their gradient ``softmax - onehot`` right away and
multiplied out into the gradients of the hidden states and of the weight. Backward then only scales
those two by the incoming gradient. Against a chunked loss that recomputes each chunk's logits in
backward this saves the recompute (one head GEMM and one softmax per chunk) and, under FSDP, makes
one module call per loss instead of one per chunk (one gradient reduce-scatter instead of one per
chunk).

The three products (a chunk's logits, their gradient times the weight, the weight gradient) come
from a products object: ``Bf16Products`` (in the weight's dtype) or, for FP8 training,
``model/fp8_mm.Fp8HeadProducts`` (``fp8_training.Fp8OutputHead``).

Numerics: the loss is ``logsumexp(z) - z[label]`` over fp32 logits ``z = float(h W^T)`` (on CUDA one
Triton kernel forms loss and gradient from the logits in two reads, with no fp32 copy), as
``F.cross_entropy(head(h).float(), labels, reduction="sum")`` computes it up to fp32 rounding. The
logits' gradient is rounded to the compute dtype before the incoming gradient multiplies the
products (autograd rounds after); with bf16 weights the two agree to bf16 rounding, with fp32 to
fp32 rounding. The weight's gradient is summed over chunks in its own dtype, as autograd sums the
per-chunk gradients of a recomputed loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_glm52.kernels import triton_available

IGNORE_INDEX = -100
LOSS_CHUNK = 4096


class Bf16Products:
    """The head's three products in the weight's dtype: the logits of a chunk of tokens ``h_c
    W^T``, the input gradient ``g W`` and the weight gradient ``g^T h_c`` summed over the chunks
    (``model/fp8_mm.Fp8HeadProducts`` is the FP8 form)."""

    def __init__(self, weight: torch.Tensor, input_grad: bool) -> None:
        self.weight = weight

    def logits(self, h_c: torch.Tensor) -> torch.Tensor:
        return F.linear(h_c, self.weight)

    def input_grad(self, g: torch.Tensor, out: torch.Tensor) -> None:
        torch.mm(g, self.weight, out=out)

    def weight_grad(
        self, g: torch.Tensor, h_c: torch.Tensor, dw: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        if dw is None:
            return torch.mm(g.t(), h_c).to(dtype)
        return dw.addmm_(g.t(), h_c.to(dw.dtype))


def _chunk_loss_and_grad(z: torch.Tensor, labels_c: torch.Tensor, want_grad: bool):
    """(summed fp32 CE of a chunk's logits ``z``, the gradient of that sum w.r.t. them in z's dtype
    or None). On CUDA one Triton kernel (``kernels/cross_entropy.py``) reads the logits twice and
    writes the gradient over them; elsewhere the same numbers in torch through an fp32 copy."""
    if z.is_cuda and triton_available():
        from titan_glm52.kernels.cross_entropy import cross_entropy_rows  # lazy, as in _scaled

        loss_rows = cross_entropy_rows(z, labels_c, IGNORE_INDEX, grad_in_place=want_grad)
        return loss_rows.sum(), (z if want_grad else None)
    dtype = z.dtype
    z = z.float()
    valid = labels_c != IGNORE_INDEX
    target = torch.where(valid, labels_c, 0).unsqueeze(1)
    lse = torch.logsumexp(z, dim=1)
    loss = torch.where(valid, lse - z.gather(1, target).squeeze(1), 0.0).sum()
    if not want_grad:
        return loss, None
    # d loss / d z = softmax(z) - onehot(label) on valid rows, 0 on ignored ones; formed in place in
    # z.
    z.sub_(lse.unsqueeze(1)).exp_()
    z.scatter_add_(1, target, torch.full_like(target, -1.0, dtype=z.dtype))
    z.mul_(valid.unsqueeze(1))
    return loss, z.to(dtype)


class _LinearCrossEntropySum(torch.autograd.Function):
    """``sum_t CE(h_t W^T, labels_t)``; the gradients are formed in forward (module docstring)."""

    @staticmethod
    def forward(
        ctx, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int, products
    ):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        mm = products(weight, input_grad=need_h)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        dh = torch.empty_like(h) if need_h else None
        dw = None
        start = 0
        for h_c, labels_c in zip(h.split(chunk), labels.split(chunk)):
            loss, g = _chunk_loss_and_grad(mm.logits(h_c), labels_c, True)
            total += loss
            if need_h:
                mm.input_grad(g, dh[start : start + h_c.shape[0]])
            if need_w:
                dw = mm.weight_grad(g, h_c, dw, weight.dtype)
            start += h_c.shape[0]
        if need_w and dw is None:  # no tokens
            dw = torch.zeros_like(weight)
        ctx.save_for_backward(dh, dw)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        # Out of place: a schedule may run backward through this node more than once (zero-bubble
        # pipelines take the input gradient and the weight gradient in two passes with the graph
        # retained).
        dh, dw = ctx.saved_tensors
        return _scaled(dh, grad_total), _scaled(dw, grad_total), None, None, None


def _scaled(x: torch.Tensor | None, g: torch.Tensor, rows: int = 8192) -> torch.Tensor | None:
    """``x * g`` in x's dtype with the product formed in fp32 and rounded once (a 0-dim fp32 ``g``
    would otherwise be rounded to a bf16 ``x``'s dtype first). On CUDA one Triton pass
    (``kernels/scale.py``); elsewhere the same numbers in torch, ``rows`` rows at a time to bound
    the fp32 temporary."""
    if x is None:
        return None
    g = g.detach().to(torch.float32)
    if x.is_cuda and triton_available():
        # lazy: importing the package must not import triton
        from titan_glm52.kernels.scale import scaled

        return scaled(x, g)
    out = torch.empty_like(x)
    for src, dst in zip(x.split(rows), out.split(rows)):
        dst.copy_(src.float() * g)
    return out


def linear_cross_entropy_sum(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk: int | None = None,
    products=Bf16Products,
) -> torch.Tensor:
    """``sum_t CE(h_t W^T, labels_t)`` in fp32 (``IGNORE_INDEX`` rows count 0) for ``h [T, D]``,
    ``weight [V, D]``, ``labels [T]``, ``chunk`` (default ``LOSS_CHUNK``) tokens at a time, the
    products formed by ``products(weight, input_grad)`` (``Bf16Products``' interface).
    Differentiable in ``h`` and ``weight``."""
    chunk = chunk or LOSS_CHUNK
    labels = labels.reshape(-1)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropySum.apply(h, weight, labels, chunk, products)
    mm = products(weight, input_grad=False)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for h_c, labels_c in zip(h.split(chunk), labels.split(chunk)):
        total += _chunk_loss_and_grad(mm.logits(h_c), labels_c, False)[0]
    return total


class OutputHead(nn.Linear):
    """The vocabulary projection (``lm_head``). ``head(h)`` gives logits; ``head(h, labels)`` the
    summed fp32 cross-entropy by ``linear_cross_entropy_sum``. Going through the module call keeps
    FSDP's unshard and gradient hooks on it."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(hidden_size, vocab_size, bias=False)

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return F.linear(h, self.weight)
        return linear_cross_entropy_sum(h, self.weight, labels)
