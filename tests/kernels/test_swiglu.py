"""The routed experts' SwiGLU (model/moe.py ``swiglu``) of the fused gate/up projection ``gu = [gate
| up]``: the Triton kernels (kernels/swiglu.py; the interpreter on CPU, compiled on a GPU) against
the torch formulas the CPU path runs, which are the ops autograd runs for ``F.silu(gate) * up`` in
fp32 (gradcheck in fp64); one rounding per output instead of silu's extra one."""

import pytest
import torch
import torch.nn.functional as F

from titan_glm52.kernels._triton_env import interpreting
from titan_glm52.kernels.swiglu import swiglu_backward, swiglu_forward
from titan_glm52.model.moe import swiglu

DEV = "cpu" if interpreting() else "cuda"
# the interpreter's sigmoid at -90
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")
ROWS, COLS = 31, 97  # F = 97: not a power of two (the kernels divide offsets by F)


def _fwd(gu):
    return swiglu_forward(gu.to(DEV)).cpu()


def _bwd(gu, grad):
    return swiglu_backward(gu.to(DEV), grad.to(DEV)).cpu()


def _inputs(dtype, rows=ROWS, cols=COLS, seed=0):
    """(gu [rows, 2 cols], grad [rows, cols])."""
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(rows, cols, generator=g) * 4
    # tails of the sigmoid
    gate.view(-1)[:8] = torch.tensor([-90.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 90.0, 3.0])
    up = torch.randn(rows, cols, generator=g)
    grad = torch.randn(rows, cols, generator=g)
    return torch.cat((gate, up), dim=-1).to(dtype), grad.to(dtype)


def _exact(gu, grad):
    g, u = (t.double().requires_grad_() for t in gu.chunk(2, dim=-1))
    h = F.silu(g) * u
    h.backward(grad.double())
    return h.detach(), torch.cat((g.grad, u.grad), dim=-1)


def test_kernels_round_the_exact_values_once_in_bf16():
    """Within an ulp of the exact (fp64) values: the fp32 arithmetic's error is far below bf16's
    ulp. The gate and up halves stay apart (a swap of the two would change every value)."""
    gu, grad = _inputs(torch.bfloat16)
    wide = torch.cat((gu, torch.zeros_like(gu)), dim=-1)
    h = _fwd(wide[:, : 2 * COLS])  # rows strided by 4 F: made contiguous
    assert h.shape == (ROWS, COLS) and h.dtype == torch.bfloat16
    assert torch.equal(h, _fwd(gu))
    d_gu = _bwd(gu, grad)
    assert d_gu.shape == gu.shape and d_gu.dtype == torch.bfloat16
    exact = _exact(gu, grad)
    for name, got, want in (("h", h, exact[0]), ("d_gu", d_gu, exact[1])):
        err = (got.double() - want).abs()
        assert (err <= torch.finfo(torch.bfloat16).eps * want.abs() + 1e-30).all(), (
            name,
            float(err.max()),
        )


def test_kernels_match_the_torch_formulas_in_fp32():
    """fp32 in and out: the CPU path's torch ops (autograd's for ``F.silu(gate) * up``) up to fp32
    rounding (d_gate cancels near silu's minimum, so absolute)."""
    gu, grad = _inputs(torch.float32)
    x = gu.clone().requires_grad_()
    h = swiglu(x)
    h.backward(grad)
    for got, want in ((_fwd(gu), h), (_bwd(gu, grad), x.grad)):
        want = want.detach()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


def test_cpu_path_is_autograd_of_silu_times_up_in_fp32():
    """fp32: the same bits as autograd through ``F.silu(gate) * up`` of the two halves; fp64:
    gradcheck."""
    gu, grad = _inputs(torch.float32, rows=3, cols=41, seed=1)
    a, b = gu.clone().requires_grad_(), gu.clone().requires_grad_()
    ha = swiglu(a)
    gate, up = b.chunk(2, dim=-1)
    hb = F.silu(gate) * up
    ha.backward(grad)
    hb.backward(grad)
    assert torch.equal(ha, hb) and torch.equal(a.grad, b.grad)
    gu64, _ = _inputs(torch.float64, rows=3, cols=11, seed=2)
    assert torch.autograd.gradcheck(swiglu, (gu64.requires_grad_(),))


def test_cpu_path_and_kernels_agree_in_bf16():
    """Both round the fp32 result once: at most an ulp apart (fp32 exp / sigmoid differ in the last
    bits)."""
    gu, grad = _inputs(torch.bfloat16, seed=3)
    x = gu.clone().requires_grad_()
    h = swiglu(x)
    h.backward(grad)
    for got, want in ((_fwd(gu), h), (_bwd(gu, grad), x.grad)):
        err = (got.float() - want.float()).abs()
        assert (err <= torch.finfo(torch.bfloat16).eps * want.float().abs()).all()
        assert (err == 0).float().mean() > 0.99


def test_odd_width_is_refused():
    with pytest.raises(ValueError, match="even last dimension"):
        swiglu_forward(torch.zeros(2, 5, device=DEV))
