"""Triton sparse indexer KL vs reference.indexer_kl(..., indices=...) (interpreter on CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

try:
    from ._cases import cu_seqlens, gen, indices_for
except ImportError:
    from _cases import cu_seqlens, gen, indices_for

from titan_glm52.kernels import reference as R
from titan_glm52.kernels.indexer_loss import indexer_kl_sparse
from titan_glm52.kernels.indexer_topk import indexer_topk
from titan_glm52.kernels.sparse_mla import sparse_mla

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
