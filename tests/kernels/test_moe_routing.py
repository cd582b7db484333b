"""The MoE routing gathers (kernels/moe_routing.py; the interpreter on CPU, compiled on a GPU)
against the torch path model/moe.py runs elsewhere (on CPU here): the combine and the dispatch
gather's backward bit for bit, the combine weights' gradient (an fp32 dot product in another order)
against fp64."""

import pytest
import torch

from titan_glm52.kernels._triton_env import interpreting
from titan_glm52.kernels.moe_routing import combine_backward, gather_sum
from titan_glm52.model import moe as moe_mod

DEV = "cpu" if interpreting() else "cuda"
# (tokens, experts, top-k, hidden)
CASES = [(37, 16, 8, 64), (50, 8, 3, 33), (5, 4, 1, 8), (9, 32, 8, 1100)]


def _case(n, e, k, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + n * k + d)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    order = torch.argsort(idx.reshape(-1), stable=True)
    pos = moe_mod.token_positions(order, k)
    rows = (torch.randn(n * k, d, generator=g) * 3).to(dtype)
    w = torch.rand(n, k, generator=g) * 2.5
    grad = torch.randn(n, d, generator=g).to(dtype)
    return rows, pos, w, grad


def _on(*tensors):
    return [t.to(DEV) for t in tensors]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("n,e,k,d", CASES)
def test_gather_sum_equals_the_torch_path(dtype, weighted, n, e, k, d):
    rows, pos, w, _ = _case(n, e, k, d, dtype)
    w = w if weighted else None
    want = moe_mod.gather_sum(rows, pos, w)  # CPU: the torch path
    got = gather_sum(*_on(rows, pos), *([] if w is None else _on(w))).cpu()
    assert got.dtype == dtype and torch.equal(got, want)
    # an output dtype other than the rows' (the combine of fp32 rows into bf16)
    if weighted and dtype == torch.float32:
        got = gather_sum(*_on(rows, pos, w), out_dtype=torch.bfloat16).cpu()
        assert torch.equal(got, moe_mod.gather_sum(rows, pos, w, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,e,k,d", CASES)
def test_combine_backward_equals_the_torch_path(dtype, n, e, k, d):
    rows, pos, w, grad = _case(n, e, k, d, dtype, seed=1)
    r, ww = rows.clone().requires_grad_(), w.clone().requires_grad_()
    moe_mod._WeightedRowSum.apply(r, ww, pos, dtype).backward(grad)  # CPU: the torch path
    d_rows, d_w = (t.cpu() for t in combine_backward(*_on(grad, rows, pos, w)))
    assert d_rows.dtype == dtype and d_w.dtype == torch.float32
    assert torch.equal(d_rows, r.grad)
    exact = torch.stack(
        [(grad.double() * rows.double()[pos[:, j]]).sum(-1) for j in range(k)], dim=1
    )
    scale = (grad.double().abs()[:, None, :] * rows.double().abs()[pos]).sum(-1)
    tol = 2 * d * torch.finfo(torch.float32).eps * scale + 1e-30
    for got in (d_w, ww.grad):  # both fp32 dot products, in different orders
        assert ((got.double() - exact).abs() <= tol).all()


def test_combine_through_moe_uses_the_kernels_on_cuda():
    """model/moe.py's combine: forward and both gradients from the kernels on CUDA equal the torch
    path on CPU (the weights' gradient up to its summation order)."""
    if DEV == "cpu":
        pytest.skip(
            "on CPU the model takes the torch path (the kernels' own tests above run them here)"
        )
    rows, pos, w, grad = _case(40, 16, 8, 300, torch.bfloat16, seed=2)
    results = []
    for dev in ("cpu", DEV):
        r, ww = rows.to(dev).clone().requires_grad_(), w.to(dev).clone().requires_grad_()
        out = moe_mod._WeightedRowSum.apply(r, ww, pos.to(dev), torch.bfloat16)
        out.backward(grad.to(dev))
        results.append((out.cpu(), r.grad.cpu(), ww.grad.cpu()))
    (o1, r1, w1), (o2, r2, w2) = results
    assert torch.equal(o1, o2) and torch.equal(r1, r2)
    torch.testing.assert_close(w1, w2, rtol=1e-5, atol=1e-5)


def test_inputs_are_checked():
    rows, pos, w, grad = _case(5, 4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="pos must be a contiguous int64"):
        gather_sum(*_on(rows, pos.int()))
    with pytest.raises(ValueError, match="w must be a contiguous fp32"):
        gather_sum(*_on(rows, pos, w.double()))
    with pytest.raises(ValueError, match="rows must be 2-D"):
        gather_sum(*_on(rows.double(), pos))
    # rows with another column stride are read through a contiguous copy
    wide = torch.stack([rows, rows], dim=2)[:, :, 0]  # the same values, column stride 2
    assert wide.stride(1) == 2
    assert torch.equal(gather_sum(*_on(wide, pos, w)).cpu(), moe_mod.gather_sum(rows, pos, w))
    with pytest.raises(ValueError, match="grad"):
        combine_backward(*_on(grad[:3], rows, pos, w))
