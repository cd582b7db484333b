"""The logged top-k recall (``attention.topk_recall``): the same value as a per-query reference with
the host's set operations, over packed documents, with rows that select fewer keys than ``topk`` (-1
slots)."""

import torch

from titan_glm52.model.attention import topk_recall


def _reference(q, kv, topk, rows, starts, sm_scale) -> float:
    recalls = []
    for i in range(q.shape[0]):
        lo, hi = int(starts[i]), int(rows[i]) + 1
        probs = torch.softmax(
            torch.einsum("hd,kd->hk", q[i].float(), kv[lo:hi].float()) * sm_scale, -1
        ).sum(0)
        sel = topk[i][topk[i] >= 0].long()
        dense = set((probs.topk(sel.numel()).indices + lo).tolist())
        recalls.append(len(dense & set(sel.tolist())) / max(sel.numel(), 1))
    return sum(recalls) / len(recalls)


def test_recall_matches_the_per_query_reference():
    g = torch.Generator().manual_seed(0)
    t, h, d, k = 96, 4, 16, 12
    q_all = torch.randn(t, h, d, generator=g)
    kv = torch.randn(t, d, generator=g)
    doc_start = torch.tensor([0] * 40 + [40] * 56)  # two documents: 0..39, 40..95
    rows = torch.tensor([5, 30, 39, 41, 45, 60, 80, 95])
    starts = doc_start[rows]
    # Half the selections follow the true scores (high recall), half are random keys (low recall);
    # rows with fewer visible keys than k select all of them and pad with -1.
    topk = torch.full((rows.numel(), k), -1, dtype=torch.int32)
    for i, (r, s) in enumerate(zip(rows.tolist(), starts.tolist())):
        visible = torch.arange(s, r + 1)
        if visible.numel() <= k:
            topk[i, : visible.numel()] = visible.int()
        elif i % 2:
            topk[i] = visible[torch.randperm(visible.numel(), generator=g)[:k]].int()
        else:
            scores = torch.einsum("hd,kd->k", q_all[r], kv[s : r + 1])
            topk[i] = (scores.topk(k).indices + s).int()
    q = q_all[rows]
    got = topk_recall(q, kv, topk, rows, starts, 0.25, chunk=3)
    want = _reference(q, kv, topk, rows, starts, 0.25)
    assert got.dim() == 0 and got.dtype == torch.float32
    assert abs(got.item() - want) < 1e-6, (got.item(), want)
    assert 0.0 < want < 1.0
