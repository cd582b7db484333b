"""The step's token counts (the loss normalisers) are counted on the host and sent to the device
without a sync: exact, and without a collective on one rank (the multi-rank sum is covered by the
distributed tests' equality with one process)."""

from types import SimpleNamespace

import torch

from titan_glm52 import trainer as trainer_mod
from titan_glm52.trainer import IGNORE_INDEX, Trainer


def test_global_counts_on_one_rank_are_exact_and_need_no_collective(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("one rank must not run a collective for the token counts")

    monkeypatch.setattr(trainer_mod.dist, "all_reduce", refuse)
    x = IGNORE_INDEX
    # Row 0: a document ending at position 3 (label ignored), then another; row 1: padding at the
    # end.
    a = torch.tensor([[5, 6, 7, x, 9, 4, 2, 1], [3, 3, 3, 3, 3, x, x, x]])
    b = torch.tensor([[x, x, 1, 2, 3, 4, 5, 6]])
    me = SimpleNamespace(dp_world=1, device=torch.device("cpu"))
    n_tok, n_mtp, n_rows, tokens = Trainer._global_counts(me, [{"labels": a}, {"labels": b}])
    # MTP: position i is valid when labels i and i + 1 are (and i + 1 is inside the row).
    assert (n_tok.item(), n_mtp.item(), n_rows, tokens.item()) == (7 + 5 + 6, 5 + 4 + 5, 3.0, 18)
    assert n_tok.dtype == n_mtp.dtype == torch.float32 and tokens.dtype == torch.float64


def test_global_counts_are_at_least_one():
    labels = torch.full((2, 4), IGNORE_INDEX)
    me = SimpleNamespace(dp_world=1, device=torch.device("cpu"))
    n_tok, n_mtp, n_rows, tokens = Trainer._global_counts(me, [{"labels": labels}])
    assert (n_tok.item(), n_mtp.item(), n_rows, tokens.item()) == (1.0, 1.0, 2.0, 1.0)


def test_global_counts_sum_over_ranks(monkeypatch):
    world, calls = 2, []

    def fake_all_reduce(t, group=None):
        calls.append(group)
        t.mul_(world)  # every rank holds the same counts here

    monkeypatch.setattr(trainer_mod.dist, "all_reduce", fake_all_reduce)
    labels = torch.tensor([[1, 2, IGNORE_INDEX, 4]])
    me = SimpleNamespace(dp_world=world, device=torch.device("cpu"), dp_group="dp")
    n_tok, n_mtp, n_rows, tokens = Trainer._global_counts(me, [{"labels": labels}])
    assert (n_tok.item(), n_mtp.item(), n_rows, tokens.item()) == (
        3.0 * world,
        1.0 * world,
        1.0 * world,
        3.0 * world,
    )
    assert calls == ["dp"]
