"""[moe] recompute_expert_inputs: the routed experts' backward rebuilds the inputs of their GEMMs
(the gathered token rows, the SwiGLU product silu(gate) * up) instead of keeping them, with the same
bits, so every gradient is the same. (The fused SwiGLU keeps only gate and up: silu's output is
neither kept nor rebuilt.)"""

import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from titan_glm52 import get_flavor
from titan_glm52.model import recompute as recompute_mod
from titan_glm52.model.aux_loss import AuxTerms
from titan_glm52.model.init import init_weights_
from titan_glm52.model.moe import MoE
from titan_glm52.model.options import ModelOptions


def _block(dtype, grouped: bool, seq_aux_loss_coeff: float = 0.0) -> MoE:
    # Widths that are multiples of 8: torch._grouped_mm on CPU needs 16-byte strides.
    args = get_flavor("debug").replace(
        n_routed_experts=16, num_experts_per_tok=8, moe_intermediate_size=48
    )
    torch.manual_seed(0)
    block = MoE(args, ModelOptions(grouped_mm=grouped, seq_aux_loss_coeff=seq_aux_loss_coeff))
    init_weights_(block, 0.1)
    block = block.to(dtype)
    block.router.e_score_correction_bias.normal_(0, 0.05)
    return block


def _grads(block: MoE, x: torch.Tensor, g: torch.Tensor, recompute: bool, wrap=None):
    # (the option's switch, flipped on one block's weights)
    block.experts.recompute_inputs = recompute
    block.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    out = (wrap or (lambda f, t: f(t)))(block, xi)
    out.backward(g)
    return [out, xi.grad] + [p.grad for _, p in sorted(block.named_parameters())]


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "per_expert"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_recompute_gives_the_same_bits(dtype, grouped):
    """Output and every gradient, with the sequence-level balance loss on over two sequences."""
    block = _block(dtype, grouped, seq_aux_loss_coeff=0.5)
    x = torch.randn(40, block.router.weight.shape[1]).to(dtype)
    g = torch.randn_like(x)
    aux = AuxTerms()
    two_rows = lambda f, t: f(t, batch=2, aux=aux)  # noqa: E731
    kept = _grads(block, x, g, recompute=False, wrap=two_rows)
    rebuilt = _grads(block, x, g, recompute=True, wrap=two_rows)
    assert aux.seq_aux is not None
    for a, b in zip(kept, rebuilt):
        assert torch.equal(a, b)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "per_expert"])
def test_recompute_frees_the_gemm_inputs(grouped, monkeypatch):
    """After forward nothing holds the gathered rows or the SwiGLU product any more; without the
    option nothing is registered for rebuilding and the graph keeps the gathered rows."""
    registered = []
    real = recompute_mod.RecomputeSaved.recompute

    def spy(self, t, fn, *sources):
        registered.append(weakref.ref(t))
        return real(self, t, fn, *sources)

    monkeypatch.setattr(recompute_mod.RecomputeSaved, "recompute", spy)
    block = _block(torch.bfloat16, grouped)
    x = torch.randn(40, block.router.weight.shape[1]).to(torch.bfloat16).requires_grad_()
    out = block(x)
    # the gathered rows and the SwiGLU product (either way of forming the experts' products)
    assert len(registered) >= 2 and all(r() is None for r in registered)
    out.sum().backward()

    # Without the option: no rule is registered, and a weak reference to the rows of a direct call
    # stays alive.
    registered.clear()
    block.experts.recompute_inputs = False
    rows = torch.arange(40).repeat_interleave(2)
    xp = x.detach()[rows].requires_grad_()
    probe = weakref.ref(xp)
    routed = block.experts(xp, torch.tensor([80] + [0] * 15), gathered_from=(x.detach(), rows))
    del xp
    assert registered == [] and probe() is not None
    del routed


def test_each_tensor_is_rebuilt_once_per_backward(monkeypatch):
    """The gathered rows (saved by the gate/up GEMM) and the SwiGLU output (saved by the down GEMM)
    are each rebuilt once per backward pass (also in a second pass over a retained graph)."""
    calls = []
    real = recompute_mod.RecomputeSaved.recompute

    def counting(self, t, fn, *sources):
        def wrapped():
            calls.append(tuple(t.shape))
            return fn()

        return real(self, t, wrapped, *sources)

    monkeypatch.setattr(recompute_mod.RecomputeSaved, "recompute", counting)
    block = _block(torch.float32, grouped=True)
    x = torch.randn(40, block.router.weight.shape[1]).requires_grad_()
    out = block(x)
    g = torch.randn_like(out)
    out.backward(g, retain_graph=True)
    first = sorted(calls)
    rows, d, f = 40 * 8, x.shape[1], block.experts.w2.shape[2]
    assert first == sorted([(rows, d), (rows, f)])
    out.backward(g)
    assert sorted(calls) == sorted(first * 2)


def test_recompute_is_skipped_under_checkpoint_and_other_hooks(monkeypatch):
    """Inside activation checkpointing (or any saved-tensor hooks of someone else) the experts
    install none of their own: the checkpoint's recompute covers the tensors, and gradients stay the
    same bits."""
    block = _block(torch.bfloat16, grouped=True)
    x = torch.randn(40, block.router.weight.shape[1]).to(torch.bfloat16)
    g = torch.randn_like(x)
    calls = []
    real_init = recompute_mod.RecomputeSaved.__init__

    def counting_init(self, *args):
        calls.append(1)
        real_init(self, *args)

    monkeypatch.setattr(recompute_mod.RecomputeSaved, "__init__", counting_init)
    plain = _grads(block, x, g, recompute=False)
    ckpt = _grads(
        block,
        x,
        g,
        recompute=True,
        wrap=lambda f, t: checkpoint(f, t, use_reentrant=False, preserve_rng_state=False),
    )
    assert calls == []
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)
    with torch.autograd.graph.save_on_cpu():
        offloaded = _grads(block, x, g, recompute=True)
    assert calls == []
    _grads(block, x, g, recompute=True)
    assert calls == [1]
    for a, b in zip(plain, offloaded):
        assert torch.equal(a, b)


def test_in_place_change_of_a_source_is_refused():
    block = _block(torch.float32, grouped=True)
    x = torch.randn(40, block.router.weight.shape[1])
    rows = torch.arange(40).repeat_interleave(2)
    src = x.clone()
    xp = src[rows].requires_grad_()
    out = block.experts(xp, torch.tensor([80] + [0] * 15), gathered_from=(src, rows))
    src.add_(1.0)
    with pytest.raises(RuntimeError, match="recompute_expert_inputs"):
        out.backward(torch.ones_like(out))


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch._grouped_mm on Hopper)"
)
def test_cuda_same_bits_and_the_expected_saving():
    """On the GPU path (bf16 torch._grouped_mm): the same bits, and the forward keeps k(D + F) bf16
    values per token fewer (the gathered rows, the SwiGLU product), less the rebuild's row indices
    (``token_of``, one int64 per routed row, which nothing else keeps: the dispatch's backward
    gathers through ``pos``)."""
    args = get_flavor("debug").replace(
        hidden_size=1024, n_routed_experts=16, num_experts_per_tok=8, moe_intermediate_size=512
    )
    torch.manual_seed(0)
    block = MoE(args)
    init_weights_(block, 0.02)
    block = block.to("cuda", torch.bfloat16)
    block.router.e_score_correction_bias.normal_(0, 0.05)
    n, d, k, f = 4096, args.hidden_size, args.num_experts_per_tok, args.moe_intermediate_size
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)
    kept = []

    def measured(f, t):  # what the forward leaves allocated: its saved tensors and its output
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = f(t)
        torch.cuda.synchronize()
        kept.append(torch.cuda.memory_allocated() - before)
        return out

    block(x).backward(g)  # first: cuBLAS allocates its workspace through the caching allocator
    results = [_grads(block, x, g, recompute, wrap=measured) for recompute in (False, True)]
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert kept[0] - kept[1] == n * k * ((d + f) * 2 - 8), (kept, n * k * ((d + f) * 2 - 8))


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "per_expert"])
def test_token_chunks_give_the_whole_batch_result(grouped):
    """``[activation_checkpoint] mlp_token_chunk``: the routed experts over chunks of tokens, each
    recomputed in backward, give the output and every gradient of the whole batch at once (the
    products row for row; the weight gradients summed chunk by chunk), and the load counts of the
    whole batch."""
    dtype = torch.float32 if grouped else torch.float64  # (torch._grouped_mm takes no fp64)
    whole, chunked = _block(dtype, grouped), _block(dtype, grouped)
    chunked.token_chunk = 16  # (the option's switch on the same weights: 40 tokens in 3 chunks)
    x = torch.randn(40, whole.router.weight.shape[1], dtype=dtype)
    g = torch.randn_like(x)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for a, b in zip(_grads(whole, x, g, recompute=False), _grads(chunked, x, g, recompute=False)):
        torch.testing.assert_close(a, b, **tol)
    assert torch.equal(whole.tokens_per_expert, chunked.tokens_per_expert)
