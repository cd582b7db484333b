"""Queries that are a subset of the stream's rows (context parallelism's ``q_rows``): the reference
and the Triton kernels (interpreter on CPU) give each query exactly what the whole-stream call gives
its row; the kernels that take explicit indices work on the gathered keys as they are."""

from __future__ import annotations

import pytest
import torch

try:
    from ._cases import cu_seqlens, gen
except ImportError:
    from _cases import cu_seqlens, gen

from titan_glm52.context_parallel import zigzag_columns
from titan_glm52.kernels import reference as R
from titan_glm52.kernels.indexer_loss import indexer_kl_sparse
from titan_glm52.kernels.indexer_topk import indexer_topk
from titan_glm52.kernels.sparse_mla import sparse_mla

# two sequences of 48 tokens; documents crossing the chunk boundaries (every 6 tokens at CP 4) and
# documents shorter than a chunk
LENGTHS = [13, 2, 25, 8, 3, 1, 36, 8]
SEQ, CP = 48, 4
H_I, D_I, TOPK = 4, 16, 6


def _rows(rank: int) -> torch.Tensor:
    assert sum(LENGTHS) % SEQ == 0
    cols = zigzag_columns(SEQ, CP, rank)
    return torch.cat([b * SEQ + cols for b in range(sum(LENGTHS) // SEQ)])


def _indexer_inputs(seed: int, zero_frac: float = 0.0):
    g = gen(seed)
    t = sum(LENGTHS)
    q = torch.randn(t, H_I, D_I, generator=g)
    if zero_frac:  # exact ties at score 0
        q[torch.rand(t, H_I, generator=g) < zero_frac] = 0.0
    return q, torch.randn(t, D_I, generator=g), torch.randn(t, H_I, generator=g)


@pytest.mark.parametrize("zero_frac", [0.0, 0.8])
def test_reference_topk_of_query_rows_is_the_whole_stream_result(zero_frac):
    q, k, w = _indexer_inputs(0, zero_frac)
    cu = cu_seqlens(LENGTHS)
    whole = R.indexer_topk(q, k, w, cu, TOPK, 0.3)
    for rank in range(CP):
        rows = _rows(rank)
        got = R.indexer_topk(q[rows], k, w[rows], cu, TOPK, 0.3, q_rows=rows)
        assert torch.equal(got, whole[rows]), rank  # same keys, same order (ties: lower row)


@pytest.mark.parametrize("zero_frac", [0.0, 0.8])
def test_triton_topk_of_query_rows_is_the_whole_stream_result(zero_frac):
    q, k, w = _indexer_inputs(1, zero_frac)
    cu = cu_seqlens(LENGTHS)
    whole = indexer_topk(q, k, w, cu, TOPK, 0.3)
    ref = R.indexer_topk(q, k, w, cu, TOPK, 0.3)
    assert torch.equal(whole.sort(1).values, ref.sort(1).values)
    for rank in range(CP):
        rows = _rows(rank)
        for kw in ({}, {"max_len": max(LENGTHS)}, {"scratch_bytes": 8 * 40 * 16}):
            got = indexer_topk(q[rows], k, w[rows], cu, TOPK, 0.3, q_rows=rows, **kw)
            assert torch.equal(got, whole[rows]), (rank, kw)


def test_dense_attention_and_kl_of_query_rows():
    g = gen(2)
    t, h, d = sum(LENGTHS), 3, 24
    cu = cu_seqlens(LENGTHS)
    q, kv = torch.randn(t, h, d, generator=g), torch.randn(t, d, generator=g)
    qi, ki, wi = _indexer_inputs(3)
    whole_o = R.dense_causal_attention(q, kv, cu, d**-0.5, 16)
    idx = R.indexer_topk(qi, ki, wi, cu, TOPK, 0.3)
    for sparse in (False, True):
        leaves = [x.clone().requires_grad_() for x in (qi, ki, wi)]
        kl = R.indexer_kl(q, kv, 0.2, *leaves, 0.5, cu, indices=idx if sparse else None)
        kl.sum().backward()
        want = [x.grad for x in leaves]
        got_ki = torch.zeros_like(ki)
        for rank in range(CP):
            rows = _rows(rank)
            o = R.dense_causal_attention(q[rows], kv, cu, d**-0.5, 16, q_rows=rows)
            torch.testing.assert_close(o, whole_o[rows], rtol=1e-6, atol=1e-6)
            lq, lk, lw = (x.clone().requires_grad_() for x in (qi[rows], ki, wi[rows]))
            sel = idx[rows] if sparse else None
            part = R.indexer_kl(q[rows], kv, 0.2, lq, lk, lw, 0.5, cu, indices=sel, q_rows=rows)
            torch.testing.assert_close(part, kl.detach()[rows], rtol=1e-6, atol=1e-6)
            part.sum().backward()
            torch.testing.assert_close(lq.grad, want[0][rows], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(lw.grad, want[2][rows], rtol=1e-5, atol=1e-6)
            got_ki += lk.grad
        # the key gradient is each rank's share, summed (the reduce-scatter's sum)
        torch.testing.assert_close(got_ki, want[1], rtol=1e-5, atol=1e-6)


def test_sparse_kernels_take_queries_over_gathered_keys():
    """sparse_mla and indexer_kl_sparse on a subset of the queries over every row's keys give the
    whole-stream rows, and the key gradients of the subsets add up to the whole one."""
    g = gen(4)
    t, h, d, d_v = sum(LENGTHS), 4, 24, 16
    cu = cu_seqlens(LENGTHS)
    q, kv = torch.randn(t, h, d, generator=g), torch.randn(t, d, generator=g)
    qi, ki, wi = _indexer_inputs(5)
    idx = indexer_topk(qi, ki, wi, cu, TOPK, 0.3)
    grad_o = torch.randn(t, h, d_v, generator=g)
    kv_leaf = kv.clone().requires_grad_()
    out, lse = sparse_mla(q, kv_leaf, idx, d**-0.5, d_v)
    (out * grad_o).sum().backward()
    k_leaf = ki.clone().requires_grad_()
    kl = indexer_kl_sparse(q, kv, d**-0.5, lse, qi, k_leaf, wi, 0.5, idx)
    kl.sum().backward()
    dkv, dki = torch.zeros_like(kv), torch.zeros_like(ki)
    for rank in range(CP):
        rows = _rows(rank)
        kv_r = kv.clone().requires_grad_()
        o, ls = sparse_mla(q[rows], kv_r, idx[rows], d**-0.5, d_v)
        torch.testing.assert_close(o, out.detach()[rows], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ls, lse[rows], rtol=1e-5, atol=1e-6)
        (o * grad_o[rows]).sum().backward()
        dkv += kv_r.grad
        k_r = ki.clone().requires_grad_()
        part = indexer_kl_sparse(q[rows], kv, d**-0.5, ls, qi[rows], k_r, wi[rows], 0.5, idx[rows])
        torch.testing.assert_close(part, kl.detach()[rows], rtol=1e-5, atol=1e-6)
        part.sum().backward()
        dki += k_r.grad
    torch.testing.assert_close(dkv, kv_leaf.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dki, k_leaf.grad, rtol=1e-5, atol=1e-5)
