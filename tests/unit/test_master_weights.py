"""MasterWeights (titan_glm52/master_weights.py): the swap of fp32 masters and bf16 compute copies
around a step. The optimizer's side (the step from bf16 gradients) is in tests/kernels/test_adam.py;
whole runs against FSDP on one rank in tests/e2e/test_train.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from titan_glm52.master_weights import MasterWeights


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8, bias=False)
        self.tied = nn.Linear(8, 8, bias=False)
        self.tied.weight = self.b.weight  # one parameter in two modules
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tied(torch.relu(self.b(self.a(x)))) * self.scale


def test_modules_hold_masters_outside_and_copies_inside_a_step():
    torch.manual_seed(0)
    net = Net()
    masters = dict(net.named_parameters())
    mw = MasterWeights([net])
    assert len(mw._slots) == 3  # the tied weight once
    with mw.computing():
        assert all(p.dtype == torch.bfloat16 for p in net.parameters())
        assert net.tied.weight is net.b.weight  # still shared: both places got the same copy
        for name, p in net.named_parameters():
            assert torch.equal(p, masters[name].detach().to(torch.bfloat16))
        net(torch.randn(4, 8, dtype=torch.bfloat16)).sum().backward()
        with pytest.raises(RuntimeError, match="reentrant"):
            with mw.computing():
                pass
    assert dict(net.named_parameters()) == masters  # the very same fp32 Parameters
    assert all(v.dtype == torch.float32 for k, v in net.state_dict().items() if k != "scale")
    assert all(p.grad is None for p in net.parameters())  # gradients live on the copies
    assert len(mw.grads()) == 3 and all(g.dtype == torch.bfloat16 for g in mw.grads())
    assert net.scale.dtype == torch.float32  # buffers are left alone
    mw.zero_grad()
    assert mw.grads() == []


def test_a_master_changed_in_place_is_recast_before_the_next_step():
    net = Net()
    mw = MasterWeights([net])
    with torch.no_grad():
        net.a.weight.mul_(3.0)  # e.g. a checkpoint load: the version counter moves
    with mw.computing():
        copy_a, copy_b = net.a.weight.detach().clone(), net.b.weight.detach().clone()
    assert torch.equal(copy_a, net.a.weight.detach().to(torch.bfloat16))
    assert torch.equal(copy_b, net.b.weight.detach().to(torch.bfloat16))


def test_recompute_and_accumulation_use_the_copies():
    """Activation recompute inside the step sees the compute copies (the backward runs before the
    swap back), and two backward passes sum their bf16 gradients in fp32."""
    torch.manual_seed(0)
    x1, x2 = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
    grads = {}
    for recompute in (False, True):
        net = Net()
        torch.manual_seed(1)
        net.load_state_dict(Net().state_dict())
        mw = MasterWeights([net], accumulate=True)
        with mw.computing():
            for x in (x1, x2):
                out = checkpoint(net, x, use_reentrant=False) if recompute else net(x)
                out.sum().backward()
        grads[recompute] = mw.grads()
        assert all(g.dtype == torch.float32 for g in grads[recompute])
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True], strict=True))
    # the fp32 sum of the two micro-batches' bf16 gradients
    net = Net()
    torch.manual_seed(1)
    net.load_state_dict(Net().state_dict())
    single = []
    for x in (x1, x2):
        mw = MasterWeights([net])
        with mw.computing():
            net(x).sum().backward()
        single.append(mw.grads())
    for acc, g1, g2 in zip(grads[True], *single, strict=True):
        assert torch.equal(acc, g1.float() + g2.float())


def test_non_fp32_masters_are_refused():
    with pytest.raises(ValueError, match="fp32"):
        MasterWeights([nn.Linear(4, 4).to(torch.bfloat16)])
