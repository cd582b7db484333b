"""TritonAdam / TritonAdamW (titan_glm52/optimizer.py, kernel in kernels/adam.py) against torch's
Adam / AdamW: in the Triton interpreter on CPU, compiled on a GPU (against torch's CUDA kernels; the
device run passes them). DTensor (FSDP2, EP, dim-1 shards) cases are in tests/distributed
(``*_triton_clip``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from titan_glm52.kernels._triton_env import interpreting
from titan_glm52.master_weights import MasterWeights
from titan_glm52.optimizer import TritonAdam, TritonAdamW
from titan_glm52.optimizer import clip_grad_norm_, clip_in_fused_step, folds_clip, total_grad_norm

SHAPES = [(96, 40), (40,), (3, 5, 7), (1,), (5000,)]
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
PAIRS = [(TritonAdamW, torch.optim.AdamW), (TritonAdam, torch.optim.Adam)]
DEV = "cpu" if interpreting() else "cuda"


def make_params(dtype=torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(DEV, dtype)) for s in SHAPES]
    # never gets a gradient
    ps.append(torch.nn.Parameter(torch.randn(4, generator=g).to(DEV, dtype)))
    return ps


def grads_for(step: int, dtype=torch.float32) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(100 + step)
    return [(1.0 + step) * torch.randn(s, generator=g).to(DEV, dtype) for s in SHAPES] + [None]


def run(opt, params, steps: int, max_norm: float | None = None, folded: bool = False):
    for step in range(steps):
        for p, g in zip(params, grads_for(step, params[0].dtype)):
            p.grad = None if g is None else g.clone()
        if max_norm is None:
            opt.step()
        elif folded:
            with clip_in_fused_step(
                [opt], clip_grad_norm_(params, max_norm, scale_grads=False), max_norm
            ):
                opt.step()
        else:
            clip_grad_norm_(params, max_norm)
            opt.step()
    return opt


def moments(opt, params):
    return [(opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]) for p in params if p in opt.state]


@pytest.mark.parametrize("ours_cls,torch_cls", PAIRS)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fp32_matches_torch_to_the_last_bits(ours_cls, torch_cls, weight_decay):
    hyper = dict(HYPER, weight_decay=weight_decay)
    ours_p, ref_p, fused_p = make_params(), make_params(), make_params()
    ours = run(ours_cls(ours_p, **hyper), ours_p, steps=6)
    ref = run(torch_cls(ref_p, foreach=False, **hyper), ref_p, steps=6)
    run(torch_cls(fused_p, fused=True, **hyper), fused_p, steps=6)
    for a, b, c in zip(ours_p, ref_p, fused_p):
        # torch's own for-loop and fused kernels differ by an fp32 rounding here and there; so do we
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.detach().abs().max()))
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6 * float(c.detach().abs().max()))
    for (m, v), (m_ref, v_ref) in zip(moments(ours, ours_p), moments(ref, ref_p)):
        torch.testing.assert_close(m, m_ref, rtol=1e-6, atol=1e-6 * float(m_ref.abs().max()))
        torch.testing.assert_close(v, v_ref, rtol=1e-6, atol=1e-6 * float(v_ref.abs().max()))
    assert ours_p[-1].grad is None and ours_p[-1] not in ours.state
    assert torch.equal(ours_p[-1], make_params()[-1])  # no gradient, no update
    assert all(ours.state[p]["step"].item() == 6 for p in ours_p[:-1])


@pytest.mark.parametrize("ours_cls,torch_cls", PAIRS)
def test_bf16_step_matches_torch_fused(ours_cls, torch_cls):
    """bf16 parameters and moments: from the same state (three steps of torch's fused kernel, so the
    moments are non-zero), one step of each stores the same values but for one bf16 step here and
    there. The math is fp32 (fp64 where torch's CUDA kernel uses double) with one rounding per
    stored value, as torch's fused kernel; values can still differ because fp64 -> fp32 -> bf16
    rounds twice, and torch's CUDA kernel applies AdamW's decay as ``p - lr * wd * p`` in double
    where its CPU kernel and the for-loop optimizer (and we) use ``p * (1 - lr * wd)``. (Over
    several steps such a difference feeds the next update, so trajectories drift apart as any two
    bf16 implementations do: compared step by step.)"""
    fused_p = make_params(torch.bfloat16)
    fused = run(torch_cls(fused_p, fused=True, **HYPER), fused_p, steps=3)
    ours_p = [torch.nn.Parameter(p.detach().clone()) for p in fused_p]
    ours = ours_cls(ours_p, **HYPER)
    ours.load_state_dict(copy.deepcopy(fused.state_dict()))
    for P, o in ((fused_p, fused), (ours_p, ours)):
        for p, g in zip(P, grads_for(3, torch.bfloat16)):
            p.grad = None if g is None else g.clone()
        o.step()
    pairs = list(zip(ours_p, fused_p))
    for (m, v), (m_ref, v_ref) in zip(moments(ours, ours_p), moments(fused, fused_p)):
        pairs += [(m, m_ref), (v, v_ref)]
    differing = sum(int((a != b).sum()) for a, b in pairs)
    assert differing <= 2e-2 * sum(b.numel() for _, b in pairs), differing
    # by one bf16 step: 2^-7 of the value, 2^-6 where the two sit across a power of two
    for a, b in pairs:
        torch.testing.assert_close(a, b, rtol=2**-6, atol=0)


@pytest.mark.parametrize("ours_cls", [TritonAdamW, TritonAdam])
def test_folded_clip_is_bitwise_the_in_place_clip(ours_cls):
    """grad_coef multiplies as the in-place clip does, so the step is bitwise the same; the
    gradients are read only."""
    in_place_p, folded_p = make_params(), make_params()
    in_place = run(ours_cls(in_place_p, **HYPER), in_place_p, steps=3, max_norm=0.5)
    folded_opt = ours_cls(folded_p, **HYPER)
    assert folds_clip([folded_opt])
    folded = run(folded_opt, folded_p, steps=3, max_norm=0.5, folded=True)
    for a, b in zip(folded_p, in_place_p):
        assert torch.equal(a, b)
    for (m, v), (m_ref, v_ref) in zip(moments(folded, folded_p), moments(in_place, in_place_p)):
        assert torch.equal(m, m_ref) and torch.equal(v, v_ref)
    for p, g in zip(folded_p, grads_for(2)):  # unclipped (max_norm 0.5 clips every step)
        assert (p.grad is None and g is None) or torch.equal(p.grad, g)
    assert folded_opt.grad_coef is None and folded_opt.found_inf is None


def test_skipped_step_touches_nothing():
    params = make_params()
    opt = run(TritonAdamW(params, **HYPER), params, steps=2)
    before = [p.detach().clone() for p in params]
    state = {
        i: {k: v.clone() for k, v in opt.state[p].items()}
        for i, p in enumerate(params)
        if p in opt.state
    }
    for p in params[:-1]:
        p.grad = torch.full_like(p, float("nan"))
    norm = clip_grad_norm_(params, 1.0, scale_grads=False)
    with clip_in_fused_step([opt], norm, 1.0, skip=~torch.isfinite(norm)):
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p, b)
    for i, s in state.items():
        for k, v in s.items():
            assert torch.equal(opt.state[params[i]][k], v), k
    # the next finite step goes on from there
    for p, g in zip(params, grads_for(5)):
        p.grad = g
    opt.step()
    assert opt.state[params[0]]["step"].item() == 3 and not torch.equal(params[0], before[0])


@pytest.mark.parametrize("source", ["fused", "for-loop"])
def test_state_dict_moves_between_torch_and_triton(source):
    """A checkpoint of torch's optimizer continues under TritonAdamW as under torch's, and the other
    way round."""
    flags = {"fused": dict(fused=True), "for-loop": dict(foreach=False)}[source]
    torch_p, ours_p = make_params(), make_params()
    torch_opt = run(torch.optim.AdamW(torch_p, **flags, **HYPER), torch_p, steps=2)
    ours_p = [torch.nn.Parameter(p.detach().clone()) for p in torch_p]
    ours = TritonAdamW(ours_p, **HYPER)
    # (loading shares the tensors otherwise)
    ours.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    for step in (2, 3):
        for P, o in ((torch_p, torch_opt), (ours_p, ours)):
            for p, g in zip(P, grads_for(step)):
                p.grad = None if g is None else g.clone()
            o.step()
    for a, b in zip(ours_p, torch_p):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.detach().abs().max()))
    assert (
        ours.state[ours_p[0]]["step"].dtype == torch.float32
        and ours.state[ours_p[0]]["step"].item() == 4
    )
    back = torch.optim.AdamW(
        [torch.nn.Parameter(p.detach().clone()) for p in ours_p], fused=True, **HYPER
    )
    back.load_state_dict(copy.deepcopy(ours.state_dict()))
    assert set(back.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("accumulate", [False, True])
def test_master_weights_step_is_the_fp32_step_on_widened_gradients(accumulate):
    """``master_weights``: the step reads the bf16 gradients of the compute copies (or their fp32
    micro-batch sum), updates the fp32 masters bitwise as the fp32 step on the widened gradients
    would (clip folded in), and writes each copy as ``master.to(bf16)``; the masters' version
    counters do not move, so nothing is re-cast."""
    ref_p = make_params()
    module = torch.nn.ParameterList([torch.nn.Parameter(p.detach().clone()) for p in ref_p])
    mw = MasterWeights([module], accumulate=accumulate)
    ours = TritonAdamW(list(module), **HYPER)
    ours.master_weights = mw
    ref = TritonAdamW(ref_p, **HYPER)
    for step in range(3):
        with mw.computing():
            compute = list(module)
            assert all(c.dtype == torch.bfloat16 for c in compute)
            for micro in range(2 if accumulate else 1):
                out = sum(
                    (c.float() * g.float()).sum()
                    for c, g in zip(compute, grads_for(3 * step + micro))
                    if g is not None
                )
                out.backward()
        assert all(p.dtype == torch.float32 for p in module)  # the masters are back
        grads = mw.grads()
        assert all(g.dtype == (torch.float32 if accumulate else torch.bfloat16) for g in grads)
        for p, slot_grad in zip(ref_p, (mw.slot(m).grad for m in module)):
            p.grad = None if slot_grad is None else slot_grad.float().clone()
        norm = clip_grad_norm_(ref_p, 0.5, scale_grads=False)
        assert torch.equal(norm, total_grad_norm([grads]))
        if accumulate:  # the micro-batches' bf16 gradients summed in fp32
            expect = [
                a.to(torch.bfloat16).float() + b.to(torch.bfloat16).float()
                for a, b in zip(grads_for(3 * step)[:-1], grads_for(3 * step + 1)[:-1])
            ]
            assert all(torch.equal(g, e) for g, e in zip(grads, expect))
        for o in (ref, ours):
            with clip_in_fused_step([o], norm, 0.5):
                o.step()
        mw.zero_grad()
        versions = [m._version for m in module]
        for m, p in zip(module, ref_p):
            assert torch.equal(m, p)
            assert torch.equal(mw.slot(m).compute, m.detach().to(torch.bfloat16))
        mw.refresh()
        assert [m._version for m in module] == versions


def test_transposed_parameter_walks_its_memory():
    """A dense non-contiguous layout (an FSDP2 dim-1 shard is a transposed view) updates element for
    element."""
    base = torch.randn(40, 96, device=DEV)
    p_t = torch.nn.Parameter(base.clone().t())  # (96, 40), strides (1, 96)
    p_c = torch.nn.Parameter(base.clone().t().contiguous())
    g = torch.randn(40, 96, device=DEV)
    p_t.grad, p_c.grad = g.clone().t(), g.clone().t().contiguous()
    o_t, o_c = TritonAdamW([p_t], **HYPER), TritonAdamW([p_c], **HYPER)
    o_t.step()
    o_c.step()
    assert not p_t.is_contiguous() and o_t.state[p_t]["exp_avg"].stride() == p_t.stride()
    assert torch.equal(p_t, p_c)


def test_layout_mismatch_and_unsupported_options_are_refused():
    p = torch.nn.Parameter(torch.randn(8, 6, device=DEV))
    p.grad = torch.randn(6, 8, device=DEV).t()  # same shape, other strides
    with pytest.raises(ValueError, match="strides"):
        TritonAdamW([p], **HYPER).step()
    for option in ("amsgrad", "maximize", "capturable", "differentiable", "fused", "foreach"):
        with pytest.raises(ValueError, match=option):
            TritonAdamW([p], **{option: True})
    with pytest.raises(ValueError, match="floats"):
        TritonAdamW([p], lr=torch.tensor(1e-3))
    assert (
        TritonAdamW([p]).defaults["weight_decay"] == torch.optim.AdamW([p]).defaults["weight_decay"]
    )
    assert (
        TritonAdam([p]).defaults["weight_decay"] == torch.optim.Adam([p]).defaults["weight_decay"]
    )


@pytest.mark.parametrize("ours_cls,torch_cls", PAIRS)
def test_bf16_moments_are_the_fp32_step_from_rounded_moments(ours_cls, torch_cls):
    """``state_dtype`` bf16 (``[optimizer] state_dtype``): the moments are stored in bf16, and each
    step is torch's fp32 step from the stored (rounded) moments, which it then rounds to nearest:
    torch's for-loop optimizer with its moments rounded to bf16 after every step, up to its fp32
    roundings here and there (as in the fp32 test) and the bf16 step such a rounding can move."""
    ours_p, ref_p = make_params(), make_params()
    ours = ours_cls(ours_p, **HYPER)
    ours.state_dtype = torch.bfloat16
    ref = torch_cls(ref_p, foreach=False, **HYPER)
    for step in range(5):
        for P, o in ((ours_p, ours), (ref_p, ref)):
            for p, g in zip(P, grads_for(step)):
                p.grad = None if g is None else g.clone()
            o.step()
        for m, v in moments(ref, ref_p):
            m.copy_(m.bfloat16())
            v.copy_(v.bfloat16())
    for a, b in zip(ours_p, ref_p):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.detach().abs().max()))
    for (m, v), (m_ref, v_ref) in zip(moments(ours, ours_p), moments(ref, ref_p)):
        assert m.dtype == v.dtype == torch.bfloat16
        torch.testing.assert_close(m.float(), m_ref, rtol=2**-7, atol=0)
        torch.testing.assert_close(v.float(), v_ref, rtol=2**-7, atol=0)


def test_bf16_moments_survive_a_state_dict_round_trip():
    """torch's ``load_state_dict`` casts the moments to the parameters' dtype; the next step keeps
    them in bf16 again, with the same values, and goes on as an uninterrupted run does. A state
    dict of fp32 moments loads into a bf16-moment optimizer the same way."""
    params = make_params()
    opt = TritonAdamW(params, **HYPER)
    opt.state_dtype = torch.bfloat16
    run(opt, params, steps=2)
    resumed_p = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = TritonAdamW(resumed_p, **HYPER)
    resumed.state_dtype = torch.bfloat16
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert resumed.state[resumed_p[0]]["exp_avg"].dtype == torch.float32  # torch's cast
    for P, o in ((params, opt), (resumed_p, resumed)):
        for p, g in zip(P, grads_for(2)):
            p.grad = None if g is None else g.clone()
        o.step()
    for a, b in zip(resumed_p, params):
        assert torch.equal(a, b)
    for (m, v), (m_ref, v_ref) in zip(moments(resumed, resumed_p), moments(opt, params)):
        assert m.dtype == v.dtype == torch.bfloat16
        assert torch.equal(m, m_ref) and torch.equal(v, v_ref)
    fp32_p = make_params()
    fp32 = run(TritonAdamW(fp32_p, **HYPER), fp32_p, steps=2)
    into = TritonAdamW([torch.nn.Parameter(p.detach().clone()) for p in fp32_p], **HYPER)
    into.state_dtype = torch.bfloat16
    into.load_state_dict(copy.deepcopy(fp32.state_dict()))
    for p, g in zip(into.param_groups[0]["params"], grads_for(2)):
        p.grad = None if g is None else g.clone()
    into.step()
    assert into.state[into.param_groups[0]["params"][0]]["exp_avg"].dtype == torch.bfloat16
