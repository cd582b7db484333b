"""model/head.py: the fused linear + cross-entropy loss against autograd through F.cross_entropy
(loss and gradients), no recompute in backward, and the module's two call forms."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from titan_glm52.model.head import OutputHead, linear_cross_entropy_sum


def _setup(dtype, t=45, d=24, vocab=50, seed=7):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(vocab, d, generator=g) * 0.3).to(dtype).requires_grad_()
    h = torch.randn(t, d, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (t,), generator=g)
    labels[::5] = -100
    return h, w, labels


def _reference(h, w, labels, scale):
    """Autograd through the plain formulation, in the inputs' dtype."""
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = F.cross_entropy(F.linear(h, w).float(), labels, ignore_index=-100, reduction="sum")
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [8, 16, 45, 64])
def test_fp32_loss_and_grads_equal_autograd(chunk):
    h, w, labels = _setup(torch.float32)
    # not a power of two: the scale is applied after the products, autograd applies it before
    scale = 0.37
    loss = linear_cross_entropy_sum(h, w, labels, chunk)
    (loss * scale).backward()
    ref_loss, ref_dh, ref_dw = _reference(h, w, labels, scale)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(h.grad, ref_dh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, ref_dw, rtol=1e-5, atol=1e-6)
    assert loss.dtype == torch.float32 and h.grad.dtype == w.grad.dtype == torch.float32


@pytest.mark.parametrize("chunk", [8, 45])
def test_bf16_grads_within_bf16_rounding_of_autograd(chunk):
    h, w, labels = _setup(torch.bfloat16, t=90, d=64, vocab=300)
    scale = 1 / 3
    loss = linear_cross_entropy_sum(h, w, labels, chunk)
    (loss * scale).backward()
    ref_loss, ref_dh, ref_dw = _reference(h, w, labels, scale)
    # fp32 logits of the same bf16 GEMM
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-4)
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    # Both sides round to bf16 (2^-8 relative); elements that cancel differ more, so compare whole
    # tensors: against each other, and against the fp64 truth (no worse than autograd's own bf16
    # error by more than that).
    for ours, ref in ((h.grad, ref_dh), (w.grad, ref_dw)):
        assert (ours.float() - ref.float()).norm() / ref.float().norm() < 8e-3
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (
        F.cross_entropy(F.linear(h64, w64), labels, ignore_index=-100, reduction="sum") * scale
    ).backward()
    for ours, ref, truth in ((h.grad, ref_dh, h64.grad), (w.grad, ref_dw, w64.grad)):
        err, ref_err = (
            (ours.double() - truth).norm() / truth.norm(),
            (ref.double() - truth).norm() / truth.norm(),
        )
        assert err < ref_err + 4e-3, (float(err), float(ref_err))


class _CountGemms(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (
            torch.ops.aten.mm.default,
            torch.ops.aten.mm.out,
            torch.ops.aten.addmm.default,
            torch.ops.aten.addmm_.default,
            torch.ops.aten.matmul.default,
            torch.ops.aten.linear.default,
        ):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_three_gemms_per_chunk_in_forward_none_in_backward():
    h, w, labels = _setup(torch.float32)
    with _CountGemms() as fwd:
        loss = linear_cross_entropy_sum(h, w, labels, 16)  # 3 chunks: 16, 16, 13
    with _CountGemms() as bwd:
        loss.backward()
    assert (fwd.count, bwd.count) == (9, 0)


def test_backward_twice_and_in_two_passes():
    """A retained graph gives the same gradients again, and a zero-bubble schedule's two passes
    (input gradient, then weight gradient) give the one-pass gradients."""
    h, w, labels = _setup(torch.float32)
    loss = linear_cross_entropy_sum(h, w, labels, 16) * 0.5
    loss.backward(retain_graph=True)
    first = h.grad.clone(), w.grad.clone()
    h.grad, w.grad = None, None
    loss.backward(retain_graph=True)
    assert torch.equal(h.grad, first[0]) and torch.equal(w.grad, first[1])
    (dh,) = torch.autograd.grad(loss, [h], retain_graph=True)
    (dw,) = torch.autograd.grad(loss, [w])
    assert torch.equal(dh, first[0]) and torch.equal(dw, first[1])


def test_frozen_weight_no_grad_and_empty_input():
    h, w, labels = _setup(torch.float32)
    w.requires_grad_(False)
    loss = linear_cross_entropy_sum(h, w, labels, 16)
    loss.backward()
    _, ref_dh, _ = _reference(h, w, labels, 1.0)
    torch.testing.assert_close(h.grad, ref_dh, rtol=1e-5, atol=1e-6)
    assert w.grad is None
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy_sum(h, w, labels, 16), loss.detach())
    w.requires_grad_(True)
    empty = linear_cross_entropy_sum(h[:0], w, labels[:0])
    empty.backward()
    assert float(empty.detach()) == 0.0 and torch.count_nonzero(w.grad) == 0


def test_all_ignored_rows_give_zero_loss_and_gradient():
    h, w, labels = _setup(torch.float32)
    loss = linear_cross_entropy_sum(h, w, torch.full_like(labels, -100), 16)
    loss.backward()
    assert (
        float(loss.detach()) == 0.0
        and torch.count_nonzero(h.grad) == 0
        and torch.count_nonzero(w.grad) == 0
    )


def test_output_head_module_forms():
    head = OutputHead(24, 50)
    assert list(head.state_dict()) == ["weight"] and head.bias is None
    h, _, labels = _setup(torch.float32)
    torch.testing.assert_close(head(h), F.linear(h, head.weight))
    torch.testing.assert_close(head(h, labels), linear_cross_entropy_sum(h, head.weight, labels))
