"""Triton sparse indexer KL vs reference.indexer_kl(..., indices=...) (interpreter on CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

try:
    from ._cases import cu_seqlens, gen, indices_for
except ImportError:
    from _cases import cu_seqlens, gen, indices_for

from titan_glm52.kernels import reference as R
from titan_glm52.kernels.indexer_loss import indexer_kl_sparse, sparse_mla_indexer_kl
from titan_glm52.kernels.indexer_topk import indexer_topk
from titan_glm52.kernels.sparse_mla import sparse_mla
from titan_glm52.kernels.tuning import launch_overrides

CASES = [
    # lengths, H, D_qk, H_I, D_I, K, seed, rows with no key
    ([40], 4, 24, 4, 16, 8, 0, (3,)),
    ([7, 20, 23], 3, 40, 2, 8, 12, 1, (0, 30)),
    ([33], 2, 16, 4, 16, 20, 2, ()),
    ([2, 25, 18], 4, 48, 3, 24, 6, 3, ()),
]


def _inputs(lengths, h, d_qk, h_i, d_i, seed):
    g = gen(seed)
    total = sum(lengths)
    return (
        torch.randn(total, h, d_qk, generator=g),
        torch.randn(total, d_qk, generator=g),
        torch.randn(total, h_i, d_i, generator=g),
        torch.randn(total, d_i, generator=g),
        torch.randn(total, h_i, generator=g),
        torch.rand(total, generator=g),
    )


def _grads(loss_fn, qi, ki, wi, grow):
    leaves = [x.clone().requires_grad_() for x in (qi, ki, wi)]
    kl = loss_fn(*leaves)
    (kl * grow).sum().backward()
    return kl.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("lengths,h,d_qk,h_i,d_i,topk,seed,empty", CASES)
def test_matches_reference(lengths, h, d_qk, h_i, d_i, topk, seed, empty):
    q, kv, qi, ki, wi, grow = _inputs(lengths, h, d_qk, h_i, d_i, seed)
    cu = cu_seqlens(lengths)
    idx = indices_for(lengths, topk, seed, empty_rows=empty)
    sm, isc = d_qk**-0.5, 0.7
    _, lse = sparse_mla(q, kv, idx, sm, d_qk // 2)
    kl, grads = _grads(
        lambda a, b, c: indexer_kl_sparse(q, kv, sm, lse, a, b, c, isc, idx), qi, ki, wi, grow
    )
    r_kl, r_grads = _grads(
        lambda a, b, c: R.indexer_kl(q, kv, sm, a, b, c, isc, cu, indices=idx), qi, ki, wi, grow
    )
    assert kl.shape == (sum(lengths),) and kl.dtype == torch.float32
    torch.testing.assert_close(kl, r_kl, atol=1e-5, rtol=1e-5)
    for name, a, b in zip(("q_idx", "k_idx", "w_idx"), grads, r_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    for r in empty:
        assert kl[r] == 0 and torch.all(grads[0][r] == 0) and torch.all(grads[2][r] == 0)


def test_pipeline_topk_attention_loss():
    """The three Triton kernels chained as the model will call them, against the reference chain."""
    lengths = [19, 31, 14]
    q, kv, qi, ki, wi, grow = _inputs(lengths, 2, 24, 4, 16, 11)
    cu = cu_seqlens(lengths)
    idx = indexer_topk(qi, ki, wi, cu, 10, 0.25)
    out, lse = sparse_mla(q, kv, idx, 0.2, 16)
    r_idx = R.indexer_topk(qi, ki, wi, cu, 10, 0.25)
    r_out, _ = R.sparse_mla(q, kv, r_idx, 0.2, 16)
    # same sets, slot order does not matter
    torch.testing.assert_close(out, r_out, atol=2e-5, rtol=1e-5)
    kl, grads = _grads(
        lambda a, b, c: indexer_kl_sparse(q, kv, 0.2, lse, a, b, c, 0.25, idx), qi, ki, wi, grow
    )
    r_kl, r_grads = _grads(
        lambda a, b, c: R.indexer_kl(q, kv, 0.2, a, b, c, 0.25, cu, indices=r_idx), qi, ki, wi, grow
    )
    torch.testing.assert_close(kl, r_kl, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, r_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_all_rows_empty_finite():
    q, kv, qi, ki, wi, grow = _inputs([10], 2, 24, 2, 16, 12)
    idx = torch.full((10, 6), -1, dtype=torch.int32)
    _, lse = sparse_mla(q, kv, idx, 0.2, 16)
    kl, grads = _grads(
        lambda a, b, c: indexer_kl_sparse(q, kv, 0.2, lse, a, b, c, 1.0, idx), qi, ki, wi, grow
    )
    assert torch.all(kl == 0)
    assert all(torch.all(gr == 0) for gr in grads)


@pytest.mark.parametrize("lengths,h,d_qk,h_i,d_i,topk,seed,empty", CASES[:3])
def test_fused_into_sparse_backward(lengths, h, d_qk, h_i, d_i, topk, seed, empty):
    """sparse_mla_indexer_kl: sparse_mla's outputs and gradients, and in its backward the KL of
    indexer_kl_sparse (into the sink) with its gradient times the weight into the indexer inputs."""
    q, kv, qi, ki, wi, _ = _inputs(lengths, h, d_qk, h_i, d_i, seed)
    idx = indices_for(lengths, topk, seed, empty_rows=empty)
    sm, isc, weight, d_v = d_qk**-0.5, 0.7, 0.3, d_qk // 2
    g_out = torch.randn(q.shape[0], h, d_v, generator=gen(seed + 100))

    def run(fused):
        leaves = [x.clone().requires_grad_() for x in (q, kv, qi, ki, wi)]
        a, b, c, d, e = leaves
        sink = torch.zeros(())
        if fused:
            out, lse = sparse_mla_indexer_kl(a, b, idx, sm, d_v, c, d, e, isc, weight, sink)
            loss = (out * g_out).sum()
        else:
            out, lse = sparse_mla(a, b, idx, sm, d_v)
            kl = indexer_kl_sparse(a.detach(), b.detach(), sm, lse, c, d, e, isc, idx)
            sink += kl.sum().detach()
            loss = (out * g_out).sum() + weight * kl.sum()
        if fused:
            assert float(sink) == 0.0  # known after backward
        loss.backward()
        return out.detach(), lse, sink, [x.grad for x in leaves]

    out, lse, sink, grads = run(True)
    r_out, r_lse, r_sink, r_grads = run(False)
    assert torch.equal(out, r_out) and torch.equal(lse, r_lse)
    torch.testing.assert_close(sink, r_sink, atol=1e-5, rtol=1e-5)
    assert float(sink) > 0
    names = ("q", "kv", "q_idx", "k_idx", "w_idx")
    for name, a, b in zip(names, grads, r_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_fused_heads_split_over_programs():
    """More heads than one part-1 program holds: the head blocks add their sums of P into the
    target atomically, the same KL as one block."""
    lengths, h, d_qk = [30], 8, 24
    q, kv, qi, ki, wi, _ = _inputs(lengths, h, d_qk, 4, 16, 5)
    idx = indices_for(lengths, 9, 5)
    sinks = []
    for bh in (8, 4):
        sink = torch.zeros(())
        leaves = [x.clone().requires_grad_() for x in (qi, ki, wi)]
        with launch_overrides({"sparse_mla": {"bwd_ps": {"BH": bh}}}):
            out, _ = sparse_mla_indexer_kl(q, kv, idx, 0.3, 16, *leaves, 0.5, 1.0, sink)
            out.sum().backward()
        sinks.append((sink, [x.grad for x in leaves]))
    torch.testing.assert_close(sinks[0][0], sinks[1][0], atol=1e-6, rtol=1e-6)
    for a, b in zip(sinks[0][1], sinks[1][1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
