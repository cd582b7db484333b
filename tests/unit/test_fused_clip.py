"""Gradient clipping folded into the fused Adam/AdamW step (optimizer.clip_in_fused_step) against
the in-place clip followed by the same fused step; DTensor (FSDP2 / EP) cases are in
tests/distributed (``*_fused_clip``)."""

from __future__ import annotations

import pytest
import torch

from titan_glm52.optimizer import (
    FOREACH_NORM_MAX_NUMEL,
    clip_coefficient,
    clip_grad_norm_,
    clip_in_fused_step,
    folds_clip,
    total_grad_norm,
)

SHAPES = [(64, 48), (48,), (3, 5, 7), (1,), (200,)]


def make_params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    ps.append(torch.nn.Parameter(torch.randn(4, generator=g)))  # never gets a gradient
    return ps


def grads_for(step: int) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(100 + step)
    # the norm (and with a small max_norm the clip coefficient) changes between steps
    scale = 1.0 + step
    return [scale * torch.randn(s, generator=g) for s in SHAPES] + [None]


def run(opt_cls, max_norm: float, folded: bool, steps: int = 3):
    params = make_params(0)
    opt = opt_cls(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    norms, coefs = [], []
    for step in range(steps):
        for p, g in zip(params, grads_for(step)):
            p.grad = None if g is None else g.clone()
        if folded:
            norm = clip_grad_norm_(params, max_norm, scale_grads=False)
            with clip_in_fused_step([opt], norm, max_norm):
                opt.step()
        else:
            norm = clip_grad_norm_(params, max_norm)
            opt.step()
        norms.append(float(norm))
        coefs.append(float(clip_coefficient(norm, max_norm)))
    return params, opt, norms, coefs


def state_of(params, opt) -> dict[str, list[torch.Tensor]]:
    with_grad = [p for p in params if p.grad is not None]
    return {
        "param": [p.detach() for p in params],
        "grad": [p.grad for p in with_grad],
        "exp_avg": [opt.state[p]["exp_avg"] for p in with_grad],
        "exp_avg_sq": [opt.state[p]["exp_avg_sq"] for p in with_grad],
    }


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.Adam])
def test_active_clip_equals_in_place_clip_to_fp32_rounding(opt_cls):
    p_ref, o_ref, n_ref, c_ref = run(opt_cls, 0.5, folded=False)
    p_new, o_new, n_new, c_new = run(opt_cls, 0.5, folded=True)
    assert n_new == n_ref and c_new == c_ref
    # the clip is active at every step, with different coefficients
    assert all(c < 0.2 for c in c_ref), c_ref
    assert len(set(c_ref)) == len(c_ref), c_ref
    ref, new = state_of(p_ref, o_ref), state_of(p_new, o_new)
    for key in ref:
        for a, b in zip(new[key], ref[key]):
            # g / (1 / c) vs g * c: the last fp32 bit of a gradient element, carried through three
            # steps (near-zero elements of the moments and of the parameters lose relative
            # precision: atol relative to the tensor)
            torch.testing.assert_close(
                a, b, rtol=2e-6, atol=2e-6 * float(b.abs().max()), msg=lambda m: f"{key}: {m}"
            )
    # the gradients left after the step are the clipped ones, as after the in-place clip
    assert not torch.equal(new["grad"][0], grads_for(2)[0])


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.Adam])
def test_inactive_clip_is_bitwise_the_in_place_clip(opt_cls):
    p_ref, o_ref, _, c_ref = run(opt_cls, 1e6, folded=False)
    p_new, o_new, _, _ = run(opt_cls, 1e6, folded=True)
    assert c_ref == [1.0, 1.0, 1.0]
    ref, new = state_of(p_ref, o_ref), state_of(p_new, o_new)
    for key in ref:
        for a, b in zip(new[key], ref[key]):
            assert torch.equal(a, b), key
    for got, want in zip(new["grad"], grads_for(2)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("total", [0.3, 1.7, 1e6, 0.0])
def test_clip_coefficient_is_torchs(total):
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    p = torch.nn.Parameter(torch.zeros(1000))
    p.grad = g.clone()
    t = torch.tensor(total)
    torch.nn.utils.clip_grads_with_norm_([p], 0.9, t)
    assert torch.equal(p.grad, g * clip_coefficient(t, 0.9))


def test_scale_grads_false_leaves_gradients_and_returns_the_norm():
    params = make_params(0)
    for p, g in zip(params, grads_for(0)):
        p.grad = None if g is None else g.clone()
    norm = clip_grad_norm_(params, 0.01, scale_grads=False)
    want = torch.nn.utils.get_total_norm([g for g in grads_for(0) if g is not None])
    assert torch.equal(norm, want)
    for p, g in zip(params, grads_for(0)):
        assert (p.grad is None) if g is None else torch.equal(p.grad, g)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the large tensors leave the foreach kernel on CUDA only"
)
def test_bf16_norm_with_large_tensors_is_torchs_to_fp32_summation_order():
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = [
        FOREACH_NORM_MAX_NUMEL + 7,
        3 * FOREACH_NORM_MAX_NUMEL,
        1000,
        FOREACH_NORM_MAX_NUMEL - 1,
        5,
    ]
    grads = [torch.randn(n, generator=g, device="cuda").to(torch.bfloat16) for n in sizes]
    want = torch.nn.utils.get_total_norm([t.float() for t in grads])
    got = total_grad_norm([grads])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
    grads[1][123] = float("nan")  # a non-finite value in a large tensor reaches the total
    assert not torch.isfinite(total_grad_norm([grads]))


def test_grad_scale_is_removed_and_not_in_the_state_dict():
    params, opt, _, _ = run(torch.optim.AdamW, 0.5, folded=True, steps=1)
    assert "grad_scale" not in vars(opt) and getattr(opt, "grad_scale", None) is None
    sd = opt.state_dict()
    assert "grad_scale" not in sd and all("grad_scale" not in g for g in sd["param_groups"])
    assert all("grad_scale" not in s for s in sd["state"].values())
    # also after an exception inside the block
    norm = clip_grad_norm_(params, 0.5, scale_grads=False)
    with pytest.raises(KeyError):
        with clip_in_fused_step([opt], norm, 0.5):
            assert opt.grad_scale.dtype == torch.float32 and opt.grad_scale.dim() == 0
            raise KeyError("boom")
    assert "grad_scale" not in vars(opt)


@pytest.mark.parametrize("kwargs", [dict(foreach=True), dict(foreach=False), dict()])
def test_non_fused_optimizers_are_refused(kwargs):
    params = make_params(0)
    opt = torch.optim.AdamW(params, **kwargs)
    assert not folds_clip([opt]) and not folds_clip([])
    assert not folds_clip([torch.optim.SGD(params, lr=0.1)])
    assert folds_clip([torch.optim.Adam(params, fused=True), torch.optim.AdamW(params, fused=True)])
    with pytest.raises(ValueError, match="fused"):
        with clip_in_fused_step([opt], torch.tensor(1.0), 0.5):
            pass
    assert "grad_scale" not in vars(opt)


def test_an_existing_grad_scale_is_refused():
    opt = torch.optim.AdamW(make_params(0), fused=True)
    opt.grad_scale = torch.tensor(4.0)
    with pytest.raises(RuntimeError, match="already has a grad_scale"):
        with clip_in_fused_step([opt], torch.tensor(1.0), 0.5):
            pass
    assert float(opt.grad_scale) == 4.0  # left as it was


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.Adam])
def test_skip_leaves_everything_untouched_without_a_host_sync(opt_cls):
    """skip=True (a non-finite loss or norm): the fused kernel returns before touching parameters,
    moments or the step count (found_inf), even with NaN gradients; skip=False is bitwise the step
    without it."""
    params, opt, _, _ = run(opt_cls, 0.5, folded=True, steps=2)
    before = {k: [t.clone() for t in v] for k, v in state_of(params, opt).items()}
    steps = [opt.state[p]["step"].clone() for p in params if p in opt.state]
    for p, g in zip(params, grads_for(2)):
        p.grad = None if g is None else torch.full_like(g, float("nan"))
    norm = clip_grad_norm_(params, 0.5, scale_grads=False)
    skip = ~torch.isfinite(norm)
    with clip_in_fused_step([opt], norm, 0.5, skip=skip):
        assert float(opt.found_inf) == 1.0
        opt.step()
    assert "found_inf" not in vars(opt) and "grad_scale" not in vars(opt)
    after = state_of(params, opt)
    for k in ("param", "exp_avg", "exp_avg_sq"):
        assert all(torch.equal(a, b) for a, b in zip(after[k], before[k])), k
    assert all(
        torch.equal(opt.state[p]["step"], s)
        for p, s in zip([p for p in params if p in opt.state], steps)
    )
    # skip=False: the same bits as no skip argument
    a_params, a_opt, _, _ = run(opt_cls, 0.5, folded=True, steps=1)
    b_params = make_params(0)
    b_opt = opt_cls(b_params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    for p, g in zip(b_params, grads_for(0)):
        p.grad = None if g is None else g.clone()
    norm = clip_grad_norm_(b_params, 0.5, scale_grads=False)
    with clip_in_fused_step([b_opt], norm, 0.5, skip=torch.tensor(False)):
        b_opt.step()
    for k, v in state_of(a_params, a_opt).items():
        assert all(torch.equal(a, b) for a, b in zip(v, state_of(b_params, b_opt)[k])), k
