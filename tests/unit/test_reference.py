"""The torch DSA reference: top-k semantics, sparse attention vs a dense formula, KL, chunking."""

import pytest
import torch

from titan_glm52 import packed
from titan_glm52.kernels import reference as R


def dense_scores(q, k, w, scale):
    return (w[:, :, None] * torch.relu(torch.einsum("thd,sd->ths", q, k))).sum(1) * scale


def test_topk_matches_brute_force_with_documents_and_padding():
    torch.manual_seed(0)
    t, cu = 41, torch.tensor([0, 7, 30, 41], dtype=torch.int32)
    q, k, w = torch.randn(t, 8, 16), torch.randn(t, 16), torch.randn(t, 8)
    got = R.indexer_topk(q, k, w, cu, 5, 0.25, chunk=6)
    s = dense_scores(q, k, w, 0.25)
    starts = packed.doc_starts(cu, t)
    for i in range(t):
        keys = list(range(int(starts[i]), i + 1))
        ranked = sorted(keys, key=lambda j: (-float(s[i, j]), j))[:5]
        assert got[i, : len(ranked)].tolist() == ranked
        assert (got[i, len(ranked) :] == -1).all()


def test_topk_ties_break_toward_lower_index():
    q, k = torch.zeros(6, 8, 4), torch.zeros(6, 4)  # every score is 0: all ties
    got = R.indexer_topk(q, k, torch.ones(6, 8), torch.tensor([0, 6], dtype=torch.int32), 3, 1.0)
    assert got[5].tolist() == [0, 1, 2] and got[1].tolist() == [0, 1, -1]


def test_sparse_mla_equals_masked_dense_softmax_and_grads():
    torch.manual_seed(1)
    t, h, d, dv = 23, 3, 20, 12
    cu = torch.tensor([0, 9, 23], dtype=torch.int32)
    idx = R.indexer_topk(torch.randn(t, 8, 8), torch.randn(t, 8), torch.randn(t, 8), cu, 4, 1.0)
    q = torch.randn(t, h, d, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(t, d, dtype=torch.float64, requires_grad=True)
    out, lse = R.sparse_mla(q, kv, idx, 0.3, dv, chunk=5)
    mask = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        mask[i, idx[i][idx[i] >= 0].long()] = True
    s = torch.einsum("thd,sd->ths", q, kv) * 0.3
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    torch.testing.assert_close(out, torch.einsum("ths,sd->thd", torch.softmax(s, -1), kv[:, :dv]))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))
    torch.autograd.gradcheck(lambda a, b: R.sparse_mla(a, b, idx, 0.3, dv, chunk=7)[0], (q, kv))


def test_empty_rows_give_zero_output_and_finite_grads():
    q = torch.randn(4, 2, 6, requires_grad=True)
    kv = torch.randn(4, 6, requires_grad=True)
    idx = torch.tensor([[0, -1], [-1, -1], [1, 0], [-1, -1]], dtype=torch.int32)
    out, lse = R.sparse_mla(q, kv, idx, 1.0, 4)
    assert (
        torch.equal(out[1], torch.zeros(2, 4)) and torch.isinf(lse[1]).all() and (lse[1] < 0).all()
    )
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()
    assert torch.equal(q.grad[1], torch.zeros(2, 6))


@pytest.mark.parametrize("sparse", [True, False])
def test_indexer_kl_matches_direct_formula(sparse):
    torch.manual_seed(2)
    t, cu = 15, torch.tensor([0, 6, 15], dtype=torch.int32)
    q, kv = torch.randn(t, 2, 10), torch.randn(t, 10)
    qi = torch.randn(t, 8, 6, dtype=torch.float64, requires_grad=True)
    ki, wi = torch.randn(t, 6, dtype=torch.float64), torch.randn(t, 8, dtype=torch.float64)
    idx = R.indexer_topk(qi.detach(), ki, wi, cu, 4, 0.5) if sparse else None
    kl = R.indexer_kl(q, kv, 0.4, qi, ki, wi, 0.5, cu, indices=idx, chunk=4)
    starts = packed.doc_starts(cu, t)
    for i in range(t):
        keys = idx[i][idx[i] >= 0].long() if sparse else torch.arange(int(starts[i]), i + 1)
        p = torch.softmax(
            torch.einsum("hd,kd->hk", q[i].double(), kv[keys].double()) * 0.4, -1
        ).sum(0)
        p = p / p.sum()
        logits = (wi[i, :, None] * torch.relu(qi[i] @ ki[keys].T)).sum(0) * 0.5
        ref = (p * (p.log() - torch.log_softmax(logits, -1))).sum()
        torch.testing.assert_close(kl[i].double(), ref.detach(), rtol=1e-5, atol=1e-6)
    kl.sum().backward()
    assert torch.isfinite(qi.grad).all() and qi.grad.abs().sum() > 0
    torch.autograd.gradcheck(
        lambda a: R.indexer_kl(q, kv, 0.4, a, ki, wi, 0.5, cu, indices=idx, chunk=4), (qi,)
    )


def test_cu_seqlens_checks():
    with pytest.raises(ValueError, match="end at T"):
        packed.check_cu_seqlens(torch.tensor([0, 5], dtype=torch.int32), 6)
    with pytest.raises(ValueError, match="non-decreasing"):
        packed.check_cu_seqlens(torch.tensor([0, 4, 3, 6], dtype=torch.int32), 6)
    assert (
        packed.check_cu_seqlens([0, 4, 6], 6)
        == packed.check_cu_seqlens(torch.tensor([0, 4, 6]), 6)
        == [0, 4, 6]
    )
    with pytest.raises(ValueError, match=">= 2 entries"):
        packed.check_cu_seqlens([6], 6)
    with pytest.raises(ValueError, match="non-decreasing"):
        packed.check_cu_seqlens((0, 4, 3, 6), 6)
    with pytest.raises(TypeError):
        packed.check_cu_seqlens([0, 2.5, 6], 6)
    assert packed.doc_positions(torch.tensor([0, 3, 5], dtype=torch.int32), 5).tolist() == [
        0,
        1,
        2,
        0,
        1,
    ]
