"""The fp32 projections of the router and the indexer's head weights (model/fp32_linear.py
``linear_fp32``): the Triton kernels (kernels/linear_fp32.py; the interpreter on CPU, compiled on a
GPU) against fp64 products of the same values, and the autograd function (the kernels under a
patched dispatch on CPU, its torch path) against what autograd gives for ``F.linear(x.float(),
w.float())``."""

import pytest
import torch
import torch.nn.functional as F

from titan_glm52.kernels._triton_env import interpreting
from titan_glm52.kernels.linear_fp32 import (
    linear_fp32_forward,
    linear_fp32_grad_input,
    linear_fp32_grad_weight,
)
from titan_glm52.model import fp32_linear
from titan_glm52.model.fp32_linear import linear_fp32

DEV = "cpu" if interpreting() else "cuda"
# T not a multiple of the row block nor of the weight gradient's slab; D not a multiple of the
# column block
CASES = [(2100, 200, 16), (70, 136, 32), (5, 24, 3)]


def _inputs(t, d, n, dtype, w_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, d, generator=g) * 2).to(dtype)
    w = (torch.randn(n, d, generator=g) * 0.05).to(w_dtype)
    gy = torch.randn(t, n, generator=g)
    return x, w, gy


def _close(got, want, rel=2e-6):
    """fp32 sums of D products against fp64: within a few fp32 roundings of the magnitudes
    summed."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got.double() - want).abs().max().item()
    assert err <= rel * want.abs().max().item() * 8 + 1e-12, err


@pytest.mark.parametrize("t,d,n", CASES)
# of the input gradient; the weight is fp32
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_against_fp64(t, d, n, dtype):
    """fp32 weights and gradients (split into three bf16 terms each) against fp64 products: fp32
    accuracy."""
    x, w, gy = _inputs(t, d, n, torch.bfloat16)
    x64, w64, gy64 = x.double(), w.double(), gy.double()
    _close(linear_fp32_forward(x.to(DEV), w.to(DEV)).cpu(), x64 @ w64.t())
    _close(linear_fp32_grad_weight(gy.to(DEV), x.to(DEV)).cpu(), gy64.t() @ x64)
    dx = linear_fp32_grad_input(gy.to(DEV), w.to(DEV), dtype).cpu()
    assert dx.dtype == dtype
    want = gy64 @ w64
    if dtype == torch.float32:
        _close(dx, want)
    # one rounding into bf16 of the fp32 sum: within half a bf16 step of the exact value (plus
    # fp32's error),
    else:
        # and mostly the bf16 of the exact value itself (a second rounding, e.g. via fp16, would
        # miss more often)
        err = (dx.double() - want).abs()
        assert err.le(want.abs() * 2**-8 + 1e-6 * want.abs().max()).all(), err.max()
        assert (dx == want.to(torch.bfloat16)).float().mean() > 0.99


def test_bf16_weight_and_empty_input():
    x, w, gy = _inputs(40, 64, 16, torch.bfloat16, w_dtype=torch.bfloat16)
    _close(linear_fp32_forward(x.to(DEV), w.to(DEV)).cpu(), x.double() @ w.double().t())
    _close(
        linear_fp32_grad_input(gy.to(DEV), w.to(DEV), torch.float32).cpu(), gy.double() @ w.double()
    )
    assert linear_fp32_forward(x[:0].to(DEV), w.to(DEV)).shape == (0, 16)
    assert linear_fp32_grad_weight(gy[:0].to(DEV), x[:0].to(DEV)).abs().sum() == 0


def test_refuses_wide_mismatched_or_not_bf16():
    x, w, _ = _inputs(8, 32, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="at most 64 output features"):
        linear_fp32_forward(x, torch.zeros(65, 32))
    with pytest.raises(ValueError, match="x \\[T, D\\] and w \\[N, D\\]"):
        linear_fp32_forward(x, torch.zeros(16, 31))
    with pytest.raises(ValueError, match="x must be bf16"):
        linear_fp32_forward(x.float(), w)


@pytest.mark.parametrize("kernel", [False, True])
def test_autograd_matches_float_linear(monkeypatch, kernel):
    """``linear_fp32`` on a 3-D bf16 input against autograd through ``F.linear(x.float(),
    w.float())``: the torch path bit for bit; the kernels (run on CPU tensors through the
    interpreter by patching the dispatch) to fp32 summation order. The input gradient arrives in x's
    dtype, the weight's in w's."""
    if kernel and not interpreting() and DEV == "cpu":
        pytest.skip("no GPU and the Triton interpreter is off")
    monkeypatch.setattr(fp32_linear, "_on_kernel", lambda x, w: kernel)
    x, w, _ = _inputs(2 * 37, 48, 16, torch.bfloat16)
    x = x.view(2, 37, 48).to(DEV).requires_grad_()
    w = w.to(DEV).requires_grad_()
    gy = torch.randn(2, 37, 16, generator=torch.Generator().manual_seed(1)).to(DEV)
    y = linear_fp32(x, w)
    (y * gy).sum().backward()
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y_ref = F.linear(x_ref.float(), w_ref.float())
    (y_ref * gy).sum().backward()
    assert (
        y.dtype == torch.float32
        and x.grad.dtype == torch.bfloat16
        and w.grad.dtype == torch.float32
    )
    if kernel:
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad.float(), x_ref.grad.float(), rtol=2**-7, atol=1e-6)
    else:
        assert (
            torch.equal(y, y_ref)
            and torch.equal(w.grad, w_ref.grad)
            and torch.equal(x.grad, x_ref.grad)
        )


@pytest.mark.parametrize("programs", [4, 528])
def test_weight_gradient_slabs(monkeypatch, programs):
    """The weight gradient's row slabs: long ones (few programs: many row blocks per slab, a partial
    last one) and the default (one row block per slab at this size) give the same fp32 sums."""
    from titan_glm52.kernels import linear_fp32 as module

    monkeypatch.setattr(module, "PROGRAMS", programs)
    x, _, gy = _inputs(2100, 200, 16, torch.bfloat16)
    _close(linear_fp32_grad_weight(gy.to(DEV), x.to(DEV)).cpu(), gy.double().t() @ x.double())
