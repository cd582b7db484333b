"""The zigzag split of context parallelism, its inverse, the per-rank rows, the reordering of the
gathered key state, and the degrees and config rules of CP (no process group needed)."""

import pytest
import torch

from titan_glm52.config import model_options, parse_job_config, validate
from titan_glm52.context_parallel import (
    CPContext,
    CPGroup,
    laid_to_global,
    next_token_ids,
    zigzag_columns,
    zigzag_inverse,
    zigzag_merge,
    zigzag_order,
    zigzag_split,
)
from titan_glm52.distributed import validate_degrees


def test_rank_r_holds_chunks_r_and_2n_minus_1_minus_r():
    assert zigzag_columns(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_columns(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_columns(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert zigzag_columns(6, 1, 0).tolist() == list(range(6))


@pytest.mark.parametrize("size", [1, 2, 4])
def test_split_and_merge_are_inverse(size):
    x = torch.randn(3, 24, 5)
    parts = [zigzag_split(x, size, r) for r in range(size)]
    for r, p in enumerate(parts):
        assert torch.equal(p, x[:, zigzag_columns(24, size, r)])
    assert torch.equal(zigzag_merge(parts), x)
    order, inverse = zigzag_order(24, size), zigzag_inverse(24, size)
    assert sorted(order.tolist()) == list(range(24))
    assert torch.equal(order[inverse], torch.arange(24))
    assert torch.equal(zigzag_merge([p.transpose(0, 1) for p in parts], dim=0), x.transpose(0, 1))


def test_a_sequence_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="divisible by 2 x context_parallel_degree"):
        zigzag_columns(12, 4, 0)


@pytest.mark.parametrize("size", [2, 4, 8])
def test_every_rank_scores_the_same_causal_pairs_of_one_document(size):
    """The indexer scores every visible key: query at position p sees p + 1 keys."""
    work = [int((zigzag_columns(64, size, r) + 1).sum()) for r in range(size)]
    assert len(set(work)) == 1, work


@pytest.mark.parametrize("size", [2, 4])
def test_laid_rows_go_back_to_the_global_order(size):
    """What the all-gather returns (every rank's local rows, rank after rank) reordered is the
    global stream, and the gradient of the reordering is the inverse reordering."""
    batch, seq = 3, 16
    x = torch.randn(batch * seq, 7)
    cpu = torch.device("cpu")
    rows = [CPContext.build(CPGroup("g", r, size), batch, seq, cpu).rows for r in range(size)]
    laid = torch.cat([x[r] for r in rows]).requires_grad_()
    out = laid_to_global(laid, size, batch, seq)
    assert torch.equal(out, x)
    grad = torch.randn_like(x)
    out.backward(grad)
    assert torch.equal(laid.grad, torch.cat([grad[r] for r in rows]))


def test_cp_context_rows_and_row_ends():
    ctx = CPContext.build(CPGroup("g", 1, 2), 2, 8, torch.device("cpu"))
    assert ctx.rows.tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    ctx = CPContext.build(CPGroup("g", 0, 2), 2, 8, torch.device("cpu"))
    assert ctx.rows.tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert ctx.row_end().tolist() == [False, False, False, True] * 2
    # the last 3 positions of the first sequence (5, 6, 7): rank 0 holds 6 and 7
    assert ctx.last_of_first_sequence(3).tolist() == [2, 3]
    assert next_token_ids(torch.tensor([[4, 5, 6]])).tolist() == [[5, 6, 0]]


def test_cp_joins_the_fsdp_ranks_and_ep_is_carved_out_of_both():
    d = validate_degrees(16, dp_shard=-1, ep=8, pp=2, cp=4, n_routed_experts=8)
    assert (d.dp_shard, d.fsdp_shard, d.efsdp, d.dp, d.ep) == (2, 8, 1, 2, 8)
    with pytest.raises(ValueError, match=r"data_parallel_shard_degree x .*context_parallel_degree"):
        validate_degrees(2, dp_shard=1, ep=4, cp=2)
    with pytest.raises(ValueError, match="context_parallel_degree"):
        validate_degrees(6, dp_shard=-1, cp=4)


def test_cp_config_runs_every_row_sparse():
    cfg = parse_job_config(["--parallelism.context_parallel_degree", "2"])
    validate(cfg, world_size=4, device_type="cpu")
    assert cfg.dsa.dense_prefix and not model_options(cfg, "cpu").dense_prefix
    one = parse_job_config([])
    assert model_options(one, "cpu").dense_prefix
