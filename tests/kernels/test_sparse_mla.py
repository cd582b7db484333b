"""Triton sparse MLA forward/backward vs reference.sparse_mla (interpreter on CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

try:
    from ._cases import gen, indices_for
except ImportError:
    from _cases import gen, indices_for

from titan_glm52.kernels import reference as R
from titan_glm52.kernels.sparse_mla import sparse_mla
from titan_glm52.kernels.tuning import launch_overrides

CASES = [
    # lengths, H, D_qk, d_v, K, seed, rows with no key
    ([40], 4, 24, 16, 8, 0, (0, 5)),
    ([7, 20, 23], 3, 40, 32, 12, 1, (8,)),
    ([33], 2, 16, 16, 20, 2, ()),  # D_qk == d_v: no second part; K not a multiple of the key block
    ([1, 30, 19], 1, 48, 32, 5, 3, (0, 1)),  # single-token document, one head
]


def _run(fn, q, kv, idx, scale, d_v, go):
    q = q.clone().requires_grad_()
    kv = kv.clone().requires_grad_()
    out, lse = fn(q, kv, idx, scale, d_v)
    (out.float() * go).sum().backward()
    return out.detach(), lse.detach(), q.grad, kv.grad


@pytest.mark.parametrize("lengths,h,d_qk,d_v,topk,seed,empty", CASES)
def test_matches_reference(lengths, h, d_qk, d_v, topk, seed, empty):
    g = gen(seed)
    total = sum(lengths)
    q = torch.randn(total, h, d_qk, generator=g)
    kv = torch.randn(total, d_qk, generator=g)
    idx = indices_for(lengths, topk, seed, empty_rows=empty)
    go = torch.randn(total, h, d_v, generator=g)
    scale = d_qk**-0.5
    out, lse, dq, dkv = _run(sparse_mla, q, kv, idx, scale, d_v, go)
    r_out, r_lse, r_dq, r_dkv = _run(R.sparse_mla, q, kv, idx, scale, d_v, go)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and out.shape == (total, h, d_v)
    torch.testing.assert_close(out, r_out, atol=2e-5, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(r_lse))
    fin = torch.isfinite(r_lse)
    torch.testing.assert_close(lse[fin], r_lse[fin], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(dq, r_dq, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(dkv, r_dkv, atol=5e-5, rtol=1e-5)
    for r in empty:
        assert (
            torch.all(out[r] == 0) and torch.all(lse[r] == float("-inf")) and torch.all(dq[r] == 0)
        )
    assert torch.isfinite(dq).all() and torch.isfinite(dkv).all() and torch.isfinite(out).all()


def test_all_rows_empty():
    g = gen(9)
    total, h, d_qk, d_v = 12, 2, 24, 16
    q = torch.randn(total, h, d_qk, generator=g, requires_grad=True)
    kv = torch.randn(total, d_qk, generator=g, requires_grad=True)
    idx = torch.full((total, 8), -1, dtype=torch.int32)
    out, lse = sparse_mla(q, kv, idx, 0.2, d_v)
    out.float().sum().backward()
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    assert torch.all(q.grad == 0) and torch.all(kv.grad == 0)


@pytest.mark.parametrize(
    "tune",
    [
        # column blocks narrower than d_v (the d_v = 512 layout), a tail-only block
        {"bwd_grad": {"DC": 16}},
        {"bwd_grad": {"DC": 64}},  # one column block holding the values and the tail
        {
            "bwd_ps": {"BH": 1},
            "bwd_grad": {"BH": 1},
        },  # one head per program: head blocks in both parts
        {
            "bwd": {"scratch_bytes": 3 * 2 * 2 * 8 * 4}
        },  # P / dS scratch of 3 queries: several chunks
    ],
)
def test_backward_variants(tune):
    lengths, h, d_qk, d_v, topk = [9, 14], 2, 40, 32, 8
    g = gen(21)
    total = sum(lengths)
    q = torch.randn(total, h, d_qk, generator=g)
    kv = torch.randn(total, d_qk, generator=g)
    idx = indices_for(lengths, topk, 21, empty_rows=(3,))
    go = torch.randn(total, h, d_v, generator=g)
    with launch_overrides({"sparse_mla": tune}):  # both passes inside: their launches read it
        _, _, dq, dkv = _run(sparse_mla, q, kv, idx, 0.2, d_v, go)
    _, _, r_dq, r_dkv = _run(R.sparse_mla, q, kv, idx, 0.2, d_v, go)
    torch.testing.assert_close(dq, r_dq, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(dkv, r_dkv, atol=5e-5, rtol=1e-5)


def test_grad_column_block_is_checked():
    """At GLM-5.2's widths only the column blocks checked on the GPU are accepted (DC = 32 faulted
    there)."""
    from titan_glm52.kernels import sparse_mla as SM

    assert SM._config(64, 576, 512, "bwd_grad")[0]["DC"] == 64
    assert SM._config(64, 576, 512, "bwd_grad")[0]["maxnreg"] == 128  # 4 programs per SM
    with launch_overrides({"sparse_mla": {"bwd_grad": {"DC": 32}}}):
        with pytest.raises(ValueError, match="bwd_grad.*DC.*64 or 128"):
            SM._config(64, 576, 512, "bwd_grad")
        # small widths: any block (interpreter tests)
        assert SM._config(2, 40, 32, "bwd_grad")[0]["DC"] == 32


def test_backward_chunks_fit_the_grid():
    """Part 2 puts a chunk's rows on the grid's second dimension (at most 65,535): a small top-k at
    many tokens would fit more rows in the scratch than that."""
    from titan_glm52.kernels import sparse_mla as SM

    assert SM.chunk_rows(10, 64, 2048, 2) == 10
    assert SM.chunk_rows(1 << 20, 64, 2048, 2) == 2048  # GLM-5.2: 1 GiB of P and dS
    assert SM.chunk_rows(1 << 20, 64, 64, 2) == SM.MAX_GRID_Y == 65535


def test_gluon_choice_reaches_the_backward(monkeypatch):
    """``gluon=False`` (the Triton kernels only) gives the default call's numbers where the Gluon
    kernels do not apply (here: the CPU), and the backward runs with the forward's choice."""
    from titan_glm52.kernels import sparse_mla as SM

    lengths, h, d_qk, d_v, topk = [9, 14], 2, 40, 32, 8
    g = gen(23)
    total = sum(lengths)
    q = torch.randn(total, h, d_qk, generator=g)
    kv = torch.randn(total, d_qk, generator=g)
    idx = indices_for(lengths, topk, 23)
    go = torch.randn(total, h, d_v, generator=g)
    seen = []
    bwd = SM._bwd

    def spy(*args):
        seen.append(args[-1])
        return bwd(*args)

    monkeypatch.setattr(SM, "_bwd", spy)
    runs = [
        _run(lambda *a, flag=flag: sparse_mla(*a, gluon=flag), q, kv, idx, 0.2, d_v, go)
        for flag in (False, True)
    ]
    assert seen == [False, True]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_head_strided_gradient_matches_and_is_laid_out_within_int32():
    """The absorbed value projection's gradient reaches the backward as a ``[T, H, r]`` view with
    head stride ``T * r`` (the einsum's batched product over heads). Such a view gives the results
    of a contiguous gradient, and where its head offsets pass int32 (GLM-5.2 above 65K tokens: 63 x
    T x 512 >= 2^31) it is laid out again before the kernels see it."""
    from titan_glm52.kernels import sparse_mla as SM

    lengths, h, d_qk, d_v, topk = [21, 11], 3, 40, 32, 8
    g = gen(4)
    total = sum(lengths)
    q = torch.randn(total, h, d_qk, generator=g)
    kv = torch.randn(total, d_qk, generator=g)
    idx = indices_for(lengths, topk, 4)
    go_heads_first = torch.randn(h, total, d_v, generator=g)
    go = go_heads_first.transpose(0, 1)  # [T, H, r], head stride T * r
    assert go.stride(1) == total * d_v
    grads = []
    for g_out in (go, go.contiguous()):
        q_ = q.clone().requires_grad_()
        kv_ = kv.clone().requires_grad_()
        out, _ = sparse_mla(q_, kv_, idx, 0.2, d_v)
        out.backward(g_out)
        grads.append((q_.grad, kv_.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=0, rtol=0)
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=0, rtol=0)

    def head_strided(t):
        return torch.empty_strided((t, 64, 512), (512, t * 512, 1), device="meta")

    assert SM._contig(head_strided(65536)).stride(1) == 65536 * 512  # 63 x T x 512 < 2^31: kept
    laid = SM._contig(head_strided(98304))
    assert laid.is_contiguous() and laid.stride(1) == 512
