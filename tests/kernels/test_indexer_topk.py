"""Triton indexer top-k vs reference.indexer_topk (interpreter on CPU): the selected sets must be
identical."""

from __future__ import annotations

import pytest
import torch

try:
    from ._cases import cu_seqlens, gen
except ImportError:
    from _cases import cu_seqlens, gen

from titan_glm52 import packed
from titan_glm52.kernels import reference as R
from titan_glm52.kernels.indexer_topk import indexer_topk
from titan_glm52.kernels.tuning import launch_overrides


def _inputs(lengths, h_i, d_i, seed, zero_frac=0.0, dup_keys=False):
    g = gen(seed)
    total = sum(lengths)
    q = torch.randn(total, h_i, d_i, generator=g)
    k = torch.randn(total, d_i, generator=g)
    w = torch.randn(total, h_i, generator=g)  # negative weights too: scores of both signs
    if zero_frac:  # heads with q = 0 give exact ties at score 0
        q[torch.rand(total, h_i, generator=g) < zero_frac] = 0.0
    if dup_keys:  # identical key rows tie exactly with any weights
        k[1::3] = k[0::3][: k[1::3].shape[0]]
    return q, k, w


def _check(out, ref, lengths, topk):
    starts = packed.doc_starts(cu_seqlens(lengths), out.shape[0])
    assert out.dtype == torch.int32 and out.shape == ref.shape
    for t in range(out.shape[0]):
        row = out[t].tolist()
        n_vis = t - int(starts[t]) + 1
        n = min(topk, n_vis)
        assert all(x >= 0 for x in row[:n]) and all(x == -1 for x in row[n:]), (
            f"row {t}: -1 not at the end: {row}"
        )
        assert len(set(row[:n])) == n, f"row {t}: duplicates"
        assert set(row[:n]) == set(ref[t, :n].tolist()), (
            f"row {t}: {sorted(row[:n])} vs {sorted(ref[t, :n].tolist())}"
        )


CASES = [
    # lengths, H_I, D_I, topk, seed, extra kwargs for the inputs
    ([40], 4, 16, 8, 0, {}),
    ([7, 20, 23], 4, 16, 5, 1, {}),
    ([3, 29, 32], 2, 24, 9, 2, {"zero_frac": 0.7}),
    ([64], 4, 16, 6, 3, {"zero_frac": 0.9}),
    ([1, 1, 17, 30], 3, 8, 4, 4, {}),
    ([37, 27], 4, 16, 11, 5, {"dup_keys": True}),
    ([5, 9], 4, 16, 16, 6, {}),  # topk above every document length: all visible keys, then -1
]


@pytest.mark.parametrize("lengths,h_i,d_i,topk,seed,kw", CASES)
def test_matches_reference(lengths, h_i, d_i, topk, seed, kw):
    q, k, w = _inputs(lengths, h_i, d_i, seed, **kw)
    cu = cu_seqlens(lengths)
    out = indexer_topk(q, k, w, cu, topk, 0.37)
    _check(out, R.indexer_topk(q, k, w, cu, topk, 0.37), lengths, topk)
    # the host-side longest length (no device-to-host copy) gives the same selection
    assert torch.equal(indexer_topk(q, k, w, cu, topk, 0.37, max_len=max(lengths)), out)


def test_chunked_scratch_and_stash_overflow():
    """Tiny scratch (several query chunks) and a stash of 1 (every tie bucket falls back to the
    full-row radix)."""
    lengths = [10, 33, 21]
    q, k, w = _inputs(lengths, 4, 16, 7, zero_frac=0.8)
    cu = cu_seqlens(lengths)
    ref = R.indexer_topk(q, k, w, cu, 6, 1.0)
    for kw in ({"scratch_bytes": 8 * 40 * 16}, {"stash_cap": 1}):
        _check(indexer_topk(q, k, w, cu, 6, 1.0, **kw), ref, lengths, 6)


def test_deterministic():
    lengths = [30, 34]
    q, k, w = _inputs(lengths, 4, 16, 8, zero_frac=0.5)
    cu = cu_seqlens(lengths)
    assert torch.equal(indexer_topk(q, k, w, cu, 7, 0.5), indexer_topk(q, k, w, cu, 7, 0.5))


def test_queries_per_scoring_program():
    """The scoring's BQ (queries per program, 4 by default at 32 heads): other blocks, including
    one that straddles documents and a last block past the rows, select the same keys."""
    lengths = [7, 20, 23]
    q, k, w = _inputs(lengths, 4, 16, 1)
    cu = cu_seqlens(lengths)
    ref = R.indexer_topk(q, k, w, cu, 5, 0.37)
    for bq in (8, 16):
        with launch_overrides({"indexer_topk": {"score": {"BQ": bq}}}):
            _check(indexer_topk(q, k, w, cu, 5, 0.37), ref, lengths, 5)


@pytest.mark.parametrize("sample,margin", [(8, 4.0), (2, 0.0), (1, 4.0)])
def test_sampled_band(sample, margin):
    """The selection's pass 1 histograms every SAMPLE-th key and stashes a band of MARGIN standard
    deviations around the estimated threshold: keys emitted above the band and picked from it make
    the reference's set at any stride (1: every key) and margin (0: the narrowest band)."""
    lengths = [100, 20]
    q, k, w = _inputs(lengths, 4, 16, 9)
    cu = cu_seqlens(lengths)
    ref = R.indexer_topk(q, k, w, cu, 12, 0.37)
    with launch_overrides({"indexer_topk": {"select": {"SAMPLE": sample, "MARGIN": margin}}}):
        _check(indexer_topk(q, k, w, cu, 12, 0.37), ref, lengths, 12)


@pytest.mark.parametrize("sampled", ["low", "high"])
def test_misleading_sample_falls_back_to_the_whole_row(sampled):
    """Every 2nd key (the sampled ones, with SAMPLE 2 and the narrowest band) scores below every
    other key ("low": the band lands under the threshold, more than top-k keys lie above it) or
    above them ("high": the band lands over it, fewer than top-k keys lie in and above it); the
    row's exact radix select must take over."""
    lengths = [90]
    q, k, w = _inputs(lengths, 4, 16, 10)
    w = w.abs() + 0.1
    q = q.abs()
    k = k.abs()  # every score > 0
    if sampled == "low":
        k[0::2] = 0.0  # exact ties at score 0, broken by the tie rule
    else:
        # distinct high keys, at least 2% apart: equal rows would tie only up to the interpreter's
        # matmul, whose sums round differently by a row's place on some CPUs' BLAS kernels
        k[0::2] = 10.0 * (1.0 + torch.arange(k[0::2].shape[0]).float() / 50.0)[:, None]
    cu = cu_seqlens(lengths)
    ref = R.indexer_topk(q, k, w, cu, 10, 0.37)
    with launch_overrides({"indexer_topk": {"select": {"SAMPLE": 2, "MARGIN": 0.0}}}):
        _check(indexer_topk(q, k, w, cu, 10, 0.37), ref, lengths, 10)
