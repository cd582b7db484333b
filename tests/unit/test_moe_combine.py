"""model/moe.py's combine of the routed expert outputs: the same bits as the index_add_ formulation
it replaced."""

import pytest
import torch

from titan_glm52 import get_flavor
from titan_glm52.model import moe as moe_mod
from titan_glm52.model.init import init_weights_
from titan_glm52.model.moe import MoE, combine_routed
from tests.unit._cuda_memory import backward_peak


def index_add_combine(routed, weights, order, dtype):
    """The previous formulation: fp32 products rounded to ``dtype``, index_add_ into zeros in
    expert-sorted order."""
    k = weights.shape[1]
    products = (routed.float() * weights.reshape(-1)[order, None]).to(dtype)
    return torch.zeros(weights.shape[0], routed.shape[1], dtype=dtype).index_add_(
        0, order // k, products
    )


def index_add_moe_forward(self, x, rows=1):
    """MoE.forward as it was before combine_routed (no seq-aux term; the tests below leave it
    off)."""
    k = self.router.top_k
    scores, idx, weights = self.router(x)
    flat = idx.reshape(-1)
    counts = torch.bincount(flat, minlength=self.num_experts)
    order = torch.argsort(flat, stable=True)
    token_of = order // k
    routed = self.experts(x[token_of], counts)
    routed = (routed.float() * weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, routed) + self.shared_experts(x)


def _case(n, e, k, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g)
    order = torch.argsort(idx.reshape(-1), stable=True)
    routed = torch.randn(n * k, d, generator=g).to(dtype)
    grad = torch.randn(n, d, generator=g).to(dtype)
    return routed, weights, order, grad


def _run(fn, routed, weights, order, grad, dtype):
    r, w = routed.clone().requires_grad_(), weights.clone().requires_grad_()
    out = fn(r, w, order, dtype)
    out.backward(grad)
    return out, r.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("n,e,k,d", [(37, 16, 8, 64), (50, 8, 3, 33), (5, 4, 1, 8), (1, 8, 8, 16)])
def test_combine_routed_equals_index_add(dtype, n, e, k, d):
    """Gradients: the same bits. Output: the same k rounded products summed in fp32 (fp64 for fp64
    rows) and rounded once; only the order of that sum may differ (CPU ``sum`` over k is sequential,
    as index_add_ was, for all but tiny tensors: bitwise there), so the two differ by at most the
    summation-order error."""
    routed, weights, order, grad = _case(n, e, k, d, dtype, seed=n * 100 + k)
    want = _run(index_add_combine, routed, weights, order, grad, dtype)
    got = _run(combine_routed, routed, weights, order, grad, dtype)
    for a, b in zip(want, got):
        assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(want[1], got[1]) and torch.equal(want[2], got[2])
    products = (routed.float() * weights.reshape(-1)[order, None]).to(dtype).double().abs()
    magnitude = torch.zeros(n, d, dtype=torch.float64).index_add_(0, order // k, products)
    acc = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    tol = 2 * k * acc * magnitude + torch.finfo(dtype).eps * want[0].double().abs()
    assert ((want[0].double() - got[0].double()).abs() <= tol).all(), f"{dtype}, n={n} k={k}"


def test_combine_routed_compiled_expression_is_the_same(monkeypatch):
    """Under torch.compile the products are written as the plain (r.float() * w).to(dtype)
    expression; eagerly that expression gives the same bits as the fused mul(out=) path."""
    routed, weights, order, grad = _case(29, 16, 8, 40, torch.bfloat16, seed=3)
    fused = _run(combine_routed, routed, weights, order, grad, torch.bfloat16)
    monkeypatch.setattr(moe_mod.torch.compiler, "is_compiling", lambda: True)
    plain = _run(combine_routed, routed, weights, order, grad, torch.bfloat16)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the caching allocator's peak)"
)
def test_combine_routed_backward_forms_only_the_rows_gradient():
    """On CUDA the combine's backward is one pass (kernels/moe_routing.py): it allocates the rows'
    gradient (bf16 [k n, D]) and the weights' [n, k] fp32 one, nothing else: no permuted copy of
    either, no fp32 product (the [k, n, D] fp32 product of an earlier version was 6 GiB at 32K
    tokens on the proxy and ran a one-GPU eager 32K step out of memory; the torch path after it
    still held two bf16 [k n, D] tensors at its peak)."""
    n, e, k, d = 4096, 16, 8, 1024
    routed, weights, order, grad = (t.cuda() for t in _case(n, e, k, d, torch.bfloat16, seed=1))
    r, w = routed.clone().requires_grad_(), weights.clone().requires_grad_()
    out = combine_routed(r, w, order.cuda(), torch.bfloat16)
    extra = backward_peak(out, grad)
    rows_grad = 2 * k * n * d
    # slack (16 MiB): the weights' gradient, rounding
    assert extra <= rows_grad + n * d * 4, (extra, rows_grad)


def test_combine_routed_refuses_non_fp32_weights():
    routed, weights, order, _ = _case(4, 8, 2, 8, torch.float64, seed=0)
    with pytest.raises(TypeError, match="fp32"):
        combine_routed(routed, weights.double(), order, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_forward_backward_equal_to_index_add_formulation(dtype, monkeypatch):
    """The whole MoE block (router, grouped experts, shared expert): every parameter gradient
    bit-identical, the output equal up to the order of the fp32 sum of each token's k products
    (bitwise in practice at these sizes). The input's gradient: bitwise in fp32; in bf16 the
    dispatch gather's backward now sums a token's k row gradients in fp32 and rounds once, where
    ``x[token_of]``'s backward added them in bf16 one by one (see
    ``test_dispatch_rows_backward_is_the_fp32_index_add``), so there it is close, not equal."""
    args = get_flavor("debug").replace(n_routed_experts=16, num_experts_per_tok=8)
    torch.manual_seed(0)
    block = MoE(args)
    init_weights_(block, 0.1)
    block = block.to(dtype)
    block.router.e_score_correction_bias.normal_(0, 0.05)
    x = torch.randn(48, args.hidden_size).to(dtype)
    g = torch.randn(48, args.hidden_size).to(dtype)
    results = []
    for forward in (index_add_moe_forward, MoE.forward):
        monkeypatch.setattr(MoE, "forward", forward)
        block.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out = block(xi)
        out.backward(g)
        results.append([out, xi.grad] + [p.grad for _, p in sorted(block.named_parameters())])
    (out_old, *grads_old), (out_new, *grads_new) = results
    # only the fp32 summation order of the k products may differ
    torch.testing.assert_close(out_new, out_old)
    if dtype == torch.bfloat16:
        # the old one-by-one bf16 adds: at most one rounding (half an ulp of the largest partial
        # sum) per add
        bound = args.num_experts_per_tok * torch.finfo(dtype).eps * grads_old[0].float().abs().max()
        assert (grads_new[0].float() - grads_old[0].float()).abs().max() <= bound
        grads_old, grads_new = grads_old[1:], grads_new[1:]
    for a, b in zip(grads_old, grads_new):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k,d", [(37, 8, 64), (50, 3, 33), (1, 1, 8)])
def test_dispatch_rows_backward_is_the_fp32_index_add(dtype, n, k, d):
    """``dispatch_rows`` is ``x[token_of]``; its backward is an index_add_ of the row gradients into
    fp32 zeros (in row order: ascending expert per token), rounded once, bit for bit, and is
    deterministic."""
    e = 16
    g = torch.Generator().manual_seed(n + k)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    order = torch.argsort(idx.reshape(-1), stable=True)
    token_of = order // k
    x = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(n * k, d, generator=g).to(dtype)
    rows = moe_mod.dispatch_rows(x, token_of, moe_mod.token_positions(order, k))
    assert torch.equal(rows, x.detach()[token_of])
    rows.backward(grad)
    want = torch.zeros(n, d).index_add_(0, token_of, grad.float()).to(dtype)
    assert torch.equal(x.grad, want)


@pytest.mark.parametrize("n,e", [(0, 4), (7, 16), (1000, 256)])
def test_expert_counts_equal_bincount_and_trace_without_a_break(n, e):
    """The sync-free expert counts are torch.bincount's (empty experts included, int64), and
    torch.compile traces them in one graph (bincount was a graph break)."""
    g = torch.Generator().manual_seed(n)
    # the upper half of the experts gets no token
    flat = torch.randint(0, max(e // 2, 1), (n,), generator=g)
    got = moe_mod.expert_counts(flat, e)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.bincount(flat, minlength=e))
    torch._dynamo.reset()
    compiled = torch.compile(moe_mod.expert_counts, fullgraph=True, backend="eager")
    assert torch.equal(compiled(flat, e), got)
