"""The routed experts' SwiGLU (model/moe.py ``swiglu``): the Triton kernels (kernels/swiglu.py; the interpreter on
CPU, compiled on a GPU) against the torch formulas the CPU path runs, which are the ops autograd runs for
``F.silu(gate) * up`` in fp32 (gradcheck in fp64); one rounding per output instead of silu's extra one."""

import pytest
import torch
import torch.nn.functional as F

from titan_glm52.kernels._triton_env import interpreting
from titan_glm52.kernels.swiglu import swiglu_backward, swiglu_forward
from titan_glm52.model.moe import swiglu

DEV = "cpu" if interpreting() else "cuda"
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's sigmoid at -90


def _fwd(gate, up):
    return swiglu_forward(gate.to(DEV), up.to(DEV)).cpu()


def _bwd(gate, up, grad):
    return tuple(t.cpu() for t in swiglu_backward(gate.to(DEV), up.to(DEV), grad.to(DEV)))


def _inputs(dtype, n=3 * 1000 + 7, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(n, generator=g) * 4
    gate[:8] = torch.tensor([-90.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 90.0, 3.0])  # tails of the sigmoid
    up = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g)
    return gate.to(dtype), up.to(dtype), grad.to(dtype)


def _torch(gate, up, grad):
    g, u = gate.double().requires_grad_(), up.double().requires_grad_()
    h = F.silu(g) * u
    h.backward(grad.double())
    return h.detach(), g.grad, u.grad


def test_kernels_round_the_exact_values_once_in_bf16():
    """Within an ulp of the exact (fp64) values: the fp32 arithmetic's error is far below bf16's ulp."""
    gate, up, grad = _inputs(torch.bfloat16)
    h = _fwd(gate[:3000].view(3, -1)[:, :999], up[:3000].view(3, -1)[:, :999])  # strided: made contiguous
    assert h.shape == (3, 999) and h.dtype == torch.bfloat16
    assert torch.equal(h, _fwd(gate, up)[:3000].view(3, -1)[:, :999])
    d_gate, d_up = _bwd(gate, up, grad)
    exact = _torch(gate, up, grad)
    for name, got, want in (("h", _fwd(gate, up), exact[0]), ("d_gate", d_gate, exact[1]),
                            ("d_up", d_up, exact[2])):
        err = (got.double() - want).abs()
        assert (err <= torch.finfo(torch.bfloat16).eps * want.abs() + 1e-30).all(), (name, float(err.max()))


def test_kernels_match_the_torch_formulas_in_fp32():
    """fp32 in and out: the CPU path's torch ops (autograd's for ``F.silu(gate) * up``) up to fp32 rounding (d_gate
    cancels near silu's minimum, so absolute)."""
    gate, up, grad = _inputs(torch.float32)
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    h = swiglu(g, u)
    h.backward(grad)
    for got, want in ((_fwd(gate, up), h), *zip(_bwd(gate, up, grad), (g.grad, u.grad))):
        want = want.detach()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


def test_cpu_path_is_autograd_of_silu_times_up_in_fp32():
    """fp32: the same bits as autograd through ``F.silu(gate) * up``; fp64: gradcheck."""
    gate, up, grad = _inputs(torch.float32, n=257, seed=1)
    a = [t.clone().requires_grad_() for t in (gate, up)]
    b = [t.clone().requires_grad_() for t in (gate, up)]
    ha, hb = swiglu(*a), F.silu(b[0]) * b[1]
    ha.backward(grad)
    hb.backward(grad)
    assert torch.equal(ha, hb) and torch.equal(a[0].grad, b[0].grad) and torch.equal(a[1].grad, b[1].grad)
    g64, u64, _ = _inputs(torch.float64, n=33, seed=2)
    assert torch.autograd.gradcheck(swiglu, (g64.requires_grad_(), u64.requires_grad_()))


def test_cpu_path_and_kernels_agree_in_bf16():
    """Both round the fp32 result once: at most an ulp apart (fp32 exp / sigmoid differ in the last bits)."""
    gate, up, grad = _inputs(torch.bfloat16, seed=3)
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    h = swiglu(g, u)
    h.backward(grad)
    for got, want in ((_fwd(gate, up), h), *zip(_bwd(gate, up, grad), (g.grad, u.grad))):
        err = (got.float() - want.float()).abs()
        assert (err <= torch.finfo(torch.bfloat16).eps * want.float().abs()).all()
        assert (err == 0).float().mean() > 0.99
