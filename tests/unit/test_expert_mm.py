"""``expert_mm``: the routed experts' products one GEMM per expert (model/expert_mm.py), and
``moe.grouped_mm = "auto"``'s choice between it and ``torch._grouped_mm``."""

import pytest
import torch

from titan_glm52.model import moe as moe_mod
from titan_glm52.model.expert_mm import expert_mm
from titan_glm52.model.init import init_weights_
from titan_glm52.model.moe import GroupedExperts


def _reference(x, w, splits):
    out, start = [], 0
    for e, n in enumerate(splits):
        out.append(x[start : start + n] @ w[e].T)
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("splits", [[3, 0, 5, 2], [0, 4, 6, 0], [0, 0, 0, 0]])
def test_products_and_gradients_match_per_expert_math(splits):
    """Experts without tokens included (first, middle, last, all): output and both gradients as
    autograd forms them for the concatenated per-expert products, an expert without rows getting a
    zero weight gradient."""
    torch.manual_seed(0)
    x = torch.randn(sum(splits), 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, 5, dtype=torch.float64, requires_grad=True)
    got = expert_mm(x, w, splits)
    want = _reference(x, w, splits)
    assert got.shape == (sum(splits), 6)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (x, w), g), torch.autograd.grad(want, (x, w), g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    if sum(splits):
        assert torch.autograd.gradcheck(lambda a, b: expert_mm(a, b, splits), (x, w))


def test_registered_op_passes_torch_checks():
    """Fake (meta) kernel, autograd registration and schema, as torch.library checks them."""
    x = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(4, 16, 8, requires_grad=True)
    torch.library.opcheck(expert_mm, (x, w, [3, 0, 5, 2]))
    with torch.device("meta"):
        assert expert_mm(torch.empty(10, 8), torch.empty(4, 16, 8), [3, 0, 5, 2]).shape == (10, 16)


@pytest.mark.parametrize(
    "splits,match", [([3, 0, 5], "fit"), ([3, 0, 5, 1], "cover"), ([3, -1, 6, 2], "cover")]
)
def test_bad_splits_are_refused(splits, match):
    with pytest.raises(ValueError, match=match):
        expert_mm(torch.randn(10, 8), torch.randn(4, 16, 8), splits)


@pytest.mark.parametrize(
    "rows_per_expert,grouped",
    [(moe_mod.PER_EXPERT_MIN_ROWS - 1, True), (moe_mod.PER_EXPERT_MIN_ROWS, False)],
)
def test_auto_takes_grouped_below_the_row_threshold(monkeypatch, rows_per_expert, grouped):
    """ "auto" (``use_grouped_mm = None``) on a GPU with grouped products: torch._grouped_mm below
    PER_EXPERT_MIN_ROWS mean rows per expert, expert_mm from there on; "on" / "off" force either."""
    calls = []

    def fake_grouped(a, b, offs):
        calls.append("grouped")
        return a.new_zeros(a.shape[0], b.shape[-1])

    monkeypatch.setattr(moe_mod, "_grouped_mm_usable", lambda x: True)
    monkeypatch.setattr(torch, "_grouped_mm", fake_grouped, raising=False)
    monkeypatch.setattr(
        GroupedExperts,
        "per_expert_mm",
        staticmethod(
            lambda x, w, splits: calls.append("per_expert") or x.new_zeros(x.shape[0], w.shape[1])
        ),
    )
    ex = GroupedExperts(2, 4, 4)
    init_weights_(ex, 0.1)
    rows = 2 * rows_per_expert
    x = torch.randn(rows, 4)
    counts = torch.tensor([rows_per_expert, rows_per_expert])
    with torch.no_grad():
        ex(x, counts)
        assert calls == ["grouped"] * 2 if grouped else ["per_expert"] * 2
        for force, want in ((True, "grouped"), (False, "per_expert")):
            calls.clear()
            ex.use_grouped_mm = force
            ex(x, counts)
            assert calls == [want] * 2
