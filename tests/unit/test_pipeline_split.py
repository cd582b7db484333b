"""Tests for titan_glm52/pipeline_split.py: placement, cost model, the skip-aware splitter and
layout checks.

The splitter is claimed exact, so the property tests compare it with brute force over every valid
cut set on small models (random IndexShare schedules, stage counts and costs) and assert equal
maximum stage cost.
"""

from __future__ import annotations

import itertools
import math
import random
import re

import pytest

from titan_glm52 import pipeline_split as ps
from titan_glm52.model import flops
from titan_glm52.model.args import _debug_args, get_flavor
from titan_glm52.model.index_share import IndexShareSchedule, build_schedule

REL = 1e-9


@pytest.fixture(scope="module")
def glm52():
    return get_flavor("glm52_744b")


# ------------------------------------------------------------------------------------- helpers
def _valid_layouts(sched: IndexShareSchedule, num_stages: int):
    """Every valid layout, by brute force over the cut sets."""
    cuts = [i for i in sched.full_layers if i > 0]
    for chosen in itertools.combinations(cuts, num_stages - 1):
        bounds = [0, *chosen, sched.num_layers]
        yield [e - b for b, e in zip(bounds, bounds[1:])]


def _assert_valid(sched: IndexShareSchedule, num_stages: int, layout: list[int]) -> None:
    assert len(layout) == num_stages
    assert all(n >= 1 for n in layout)
    assert sum(layout) == sched.num_layers
    covered, start = [], 0
    for n in layout:
        assert sched.is_full(start), (layout, start, sched.pattern)
        covered += range(start, start + n)
        start += n
    assert covered == list(range(sched.num_layers))


def _random_schedule(rng: random.Random, num_layers: int) -> IndexShareSchedule:
    """One of the three config forms, in proportion; always valid (layer 0 full)."""
    form = rng.randrange(3)
    if form == 0:
        freq = rng.randint(1, 5)
        offset = rng.randint(1, 4)
        return build_schedule(num_layers, index_topk_freq=freq, index_skip_topk_offset=offset)
    types = ["full"] + [rng.choice(["full", "shared", "shared"]) for _ in range(num_layers - 1)]
    if form == 1:
        return build_schedule(num_layers, indexer_types=types)
    return build_schedule(
        num_layers, index_topk_pattern="".join("F" if t == "full" else "S" for t in types)
    )


def _suggestion(message: str) -> list[int]:
    m = re.search(r"Nearest valid layout: ([0-9,]+)$", message)
    assert m, message
    return [int(x) for x in m.group(1).split(",")]


# ------------------------------------------------------------------------------------- placement
@pytest.mark.parametrize("name", ["1F1B", "GPipe", "1f1b", "gpipe"])
def test_single_stage_schedules_hold_one_stage_per_rank(name):
    pl = ps.stage_placement(name, 4)
    assert (pl.style, pl.stages_per_rank, pl.num_stages) == ("single", 1, 4)
    assert pl.stage_to_rank == (0, 1, 2, 3)
    assert ps.stage_placement(name, 4, 1) == pl


@pytest.mark.parametrize(
    "name", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "interleaved1f1b"]
)
def test_loop_schedules_place_stage_s_on_rank_s_mod_pp(name):
    # default 2 per rank
    assert ps.stage_placement(name, 4).stage_to_rank == (0, 1, 2, 3, 0, 1, 2, 3)
    pl = ps.stage_placement(name, 3, 4)
    assert (pl.style, pl.num_stages) == ("loop", 12)
    assert pl.stage_to_rank == tuple(s % 3 for s in range(12))
    assert pl.stages_of_rank(1) == (1, 4, 7, 10)


@pytest.mark.parametrize("name", ["ZBVZeroBubble", "DualPipeV"])
def test_v_schedules_place_stages_r_and_2pp_minus_1_minus_r(name):
    pl = ps.stage_placement(name, 4)
    assert (pl.style, pl.stages_per_rank, pl.num_stages) == ("v", 2, 8)
    assert pl.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    for r in range(4):
        assert pl.stages_of_rank(r) == (r, 7 - r)
    assert ps.stage_placement(name, 4, 2) == pl


def test_schedule_name_is_the_torch_name():
    assert ps.stage_placement("interleavedzerobubble", 2).schedule == "InterleavedZeroBubble"
    assert ps.stage_placement("zbvzerobubble", 2).schedule == "ZBVZeroBubble"


@pytest.mark.parametrize(
    "name,spr,needle",
    [
        ("1F1B", 2, "one stage per rank"),
        ("GPipe", 3, "one stage per rank"),
        ("ZBVZeroBubble", 3, "exactly 2 stages per rank"),
        ("DualPipeV", 1, "exactly 2 stages per rank"),
        ("Interleaved1F1B", 1, "stages_per_rank >= 2"),
        ("LoopedBFS", 0, "stages_per_rank must be an integer >= 1"),
    ],
)
def test_impossible_schedule_combinations_are_refused(name, spr, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        ps.stage_placement(name, 4, spr)


def test_unknown_schedule_and_bad_pp_are_refused():
    with pytest.raises(ValueError, match="Unknown schedule name"):
        ps.stage_placement("2F2B", 4)
    with pytest.raises(ValueError, match="pipeline parallel degree"):
        ps.stage_placement("1F1B", 0)


# ------------------------------------------------------------------------------------- cost model
def test_cost_model_pieces(glm52):
    a = glm52
    costs = ps.layer_costs(a, 4096)
    sched = a.index_share
    assert len(costs) == 78
    # Same kind of MLP: a full layer costs exactly one indexer more than a shared one.
    full_moe, shared_moe = costs[6], costs[7]
    assert a.is_moe_layer(6) and a.is_moe_layer(7) and sched.is_full(6) and not sched.is_full(7)
    indexer = 2.0 * (
        flops.indexer_macs_per_token(a) + flops.indexer_macs_per_pair(a) * flops.mean_keys(4096)
    )
    assert full_moe - shared_moe == pytest.approx(indexer, rel=REL)
    # Layers 0-2 are dense and full; 6 is MoE and full.
    mlp = 2.0 * (flops.mlp_macs_per_token(a, True) - flops.mlp_macs_per_token(a, False))
    assert costs[6] - costs[2] == pytest.approx(mlp, rel=REL)
    assert costs[2] < costs[7] < costs[6]  # dense < MoE shared < MoE full for GLM-5.2's widths
    assert len({costs[i] for i in range(3, 78) if sched.is_full(i)}) == 1
    assert len({costs[i] for i in range(3, 78) if not sched.is_full(i)}) == 1
    # Head and MTP.
    first, last = ps.stage_extra_costs(a, 4096)
    head = 2.0 * 154880 * 6144
    assert flops.head_flops(a) == head and first == 0.0
    assert last == pytest.approx(head + (2.0 * 2 * 6144 * 6144 + full_moe + head), rel=REL)
    assert ps.stage_extra_costs(a.replace(num_nextn_predict_layers=0), 4096) == (0.0, head)
    # The indexer is the O(seq_len) part; attention is capped by index_topk.
    costs_32k, moe_mlp = ps.layer_costs(a, 32768), 2.0 * flops.mlp_macs_per_token(a, True)
    assert costs_32k[6] - costs_32k[7] > 4 * (full_moe - shared_moe)  # indexers
    assert costs_32k[7] - moe_mlp < 1.3 * (shared_moe - moe_mlp)  # attention


def test_mean_causal_keys_matches_direct_average():
    for seq_len, cap in [(1, None), (7, None), (7, 3), (7, 7), (7, 100), (100, 16), (2048, 2048)]:
        direct = sum(t if cap is None else min(cap, t) for t in range(1, seq_len + 1)) / seq_len
        assert flops.mean_keys(seq_len, cap) == pytest.approx(direct, rel=1e-12)


def test_seq_len_is_checked(glm52):
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="seq_len"):
            ps.layer_costs(glm52, bad)


# ---------------------------------------------------------------------------------- GLM-5.2 layouts
def test_glm52_pp4_20_20_20_18_is_refused_with_a_near_valid_layout(glm52):
    with pytest.raises(ps.LayoutError) as err:
        ps.split(glm52, 4, explicit=[20, 20, 20, 18])
    msg = str(err.value)
    assert "stage 1 starts at layer 20, a shared layer (source layer 18)" in msg
    assert "stage 2 starts at layer 40, a shared layer (source layer 38)" in msg
    assert "stage 3 starts at layer 60, a shared layer (source layer 58)" in msg
    assert _suggestion(msg) == [18, 20, 20, 20]


@pytest.mark.parametrize(
    "layout", [[18, 20, 20, 20], [14, 8, 8, 8, 8, 8, 8, 16], [38, 40], [1, 77], [78]]
)
def test_glm52_known_good_layouts_are_accepted(glm52, layout):
    assert ps.split(glm52, len(layout), explicit=layout) == layout


@pytest.mark.parametrize("pp", [2, 3, 6, 13])
def test_glm52_uniform_splits_are_refused(glm52, pp):
    with pytest.raises(ps.LayoutError, match="a shared layer"):
        ps.split(glm52, pp, explicit=[78 // pp] * pp)


def test_glm52_explicit_layout_count_sum_and_empty_stage_errors(glm52):
    with pytest.raises(ps.LayoutError, match="it has 3 stages but the schedule runs 4") as err:
        ps.split(glm52, 4, explicit=[26, 26, 26])
    _assert_valid(glm52.index_share, 4, _suggestion(str(err.value)))
    with pytest.raises(ps.LayoutError, match="it covers 76 layers but the model has 78") as err:
        ps.split(glm52, 4, explicit=[18, 20, 20, 18])
    _assert_valid(glm52.index_share, 4, _suggestion(str(err.value)))
    with pytest.raises(ps.LayoutError, match="stage 1 has 0 layers") as err:
        ps.split(glm52, 3, explicit=[38, 0, 40])
    _assert_valid(glm52.index_share, 3, _suggestion(str(err.value)))
    with pytest.raises(ps.LayoutError, match="integers"):
        ps.split(glm52, 2, explicit=[38.0, 40])


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 5, 8, 16, 21])
def test_glm52_best_split_is_valid_and_optimal_among_valid_layouts(glm52, num_stages):
    layout = ps.split(glm52, num_stages)
    sched = glm52.index_share
    _assert_valid(sched, num_stages, layout)
    if num_stages <= 4:  # brute force stays small: C(20, 3) = 1140 cut sets
        costs = ps.layer_costs(glm52)
        first, last = ps.stage_extra_costs(glm52)
        best = min(
            max(ps.stage_costs(v, costs, first, last)) for v in _valid_layouts(sched, num_stages)
        )
        assert max(ps.stage_costs(layout, costs, first, last)) == pytest.approx(best, rel=REL)


def test_glm52_too_many_stages_is_refused(glm52):
    with pytest.raises(ps.LayoutError, match=r"into 22 pipeline stages.*only 21"):
        ps.split(glm52, 22)
    with pytest.raises(ps.LayoutError, match="only 21"):
        ps.choose_layout(glm52, "Interleaved1F1B", 8, 3)


def test_glm52_choose_layout(glm52):
    plan = ps.choose_layout(
        glm52, "ZBVZeroBubble", 4, layers_per_stage=[10, 8, 8, 12, 12, 12, 12, 4]
    )
    assert plan.placement.num_stages == 8
    assert plan.first_layers == (0, 10, 18, 26, 38, 50, 62, 74)
    assert plan.module_names[0][:2] == ("tok_embeddings", "layers.0")
    assert plan.module_names[-1] == (
        "layers.74",
        "layers.75",
        "layers.76",
        "layers.77",
        "norm",
        "output",
        "mtp",
    )
    assert sum(plan.rank_costs) == pytest.approx(plan.total_cost, rel=REL)
    assert plan.rank_costs[0] == pytest.approx(plan.stage_costs[0] + plan.stage_costs[7], rel=REL)
    with pytest.raises(ps.LayoutError, match="Nearest valid layout"):
        ps.choose_layout(glm52, "1F1B", 4, layers_per_stage=[20, 20, 20, 18])
    assert ps.choose_layout(glm52, "1F1B", 2, with_mtp=False).module_names[-1][-2:] == (
        "norm",
        "output",
    )


# ------------------------------------------------------------------------------------- properties
def test_split_is_exact_on_random_small_models():
    """Against brute force: valid, covers every layer once, optimal max stage cost, and the
    documented tie-break (smallest sum of squares among optimal splits)."""
    rng = random.Random(1234)
    checked = 0
    for _ in range(400):
        num_layers = rng.randint(1, 13)
        sched = _random_schedule(rng, num_layers)
        num_stages = rng.randint(1, len(sched.full_layers))
        costs = [rng.choice([1.0, 2.0, 3.0, rng.uniform(0.1, 5.0)]) for _ in range(num_layers)]
        first, last = rng.choice([0.0, 0.5, 4.0]), rng.choice([0.0, 2.0, rng.uniform(0.0, 10.0)])
        layout = ps.split_layers(sched, num_stages, costs, first, last)
        _assert_valid(sched, num_stages, layout)
        got = ps.stage_costs(layout, costs, first, last)
        options = [ps.stage_costs(v, costs, first, last) for v in _valid_layouts(sched, num_stages)]
        best_max = min(max(o) for o in options)
        assert max(got) == pytest.approx(best_max, rel=REL), (
            sched.pattern,
            num_stages,
            costs,
            layout,
        )
        best_sq = min(
            sum(c * c for c in o) for o in options if math.isclose(max(o), best_max, rel_tol=REL)
        )
        assert sum(c * c for c in got) == pytest.approx(best_sq, rel=REL)
        checked += 1
    assert checked == 400


def test_split_is_exact_with_model_costs():
    """Same, with the cost model on small models of every (freq, offset, dense prefix, MTP, seq_len)
    mix."""
    rng = random.Random(99)
    base = _debug_args()
    for num_layers, freq, offset in itertools.product([1, 2, 5, 8, 11], [1, 2, 3, 4], [1, 2, 3]):
        args = base.replace(
            num_hidden_layers=num_layers,
            index_topk_freq=freq,
            index_skip_topk_offset=offset,
            first_k_dense_replace=rng.randint(0, 3),
            num_nextn_predict_layers=rng.randint(0, 1),
        )
        seq_len = rng.choice([1, 8, 16, 100, 4096])
        sched = args.index_share
        costs = ps.layer_costs(args, seq_len)
        first, last = ps.stage_extra_costs(args, seq_len)
        for num_stages in range(1, len(sched.full_layers) + 1):
            layout = ps.split(args, num_stages, seq_len=seq_len)
            _assert_valid(sched, num_stages, layout)
            best = min(
                max(ps.stage_costs(v, costs, first, last))
                for v in _valid_layouts(sched, num_stages)
            )
            assert max(ps.stage_costs(layout, costs, first, last)) == pytest.approx(best, rel=REL)
        with pytest.raises(ps.LayoutError, match="only"):
            ps.split(args, len(sched.full_layers) + 1, seq_len=seq_len)


def test_split_invariants_on_random_larger_models():
    rng = random.Random(7)
    for _ in range(150):
        num_layers = rng.randint(14, 160)
        sched = _random_schedule(rng, num_layers)
        num_stages = rng.randint(1, min(len(sched.full_layers), 32))
        costs = [rng.uniform(0.5, 2.0) for _ in range(num_layers)]
        first, last = rng.uniform(0, 3), rng.uniform(0, 8)
        layout = ps.split_layers(sched, num_stages, costs, first, last)
        _assert_valid(sched, num_stages, layout)
        assert ps.validate_layout(sched, num_stages, layout) == layout
        # No valid single-cut move lowers the maximum (a necessary condition of optimality).
        got = max(ps.stage_costs(layout, costs, first, last))
        for k in range(num_stages - 1):
            for delta in (-1, 1):
                moved = _move_cut(sched, layout, k, delta)
                if moved is not None:
                    assert max(ps.stage_costs(moved, costs, first, last)) >= got * (1 - REL)


def _move_cut(sched, layout, k, delta):
    """``layout`` with the cut after stage k moved to the previous/next full layer, or None."""
    bounds = [0]
    for n in layout:
        bounds.append(bounds[-1] + n)
    full = sched.full_layers
    i = full.index(bounds[k + 1]) + delta
    if not 0 < i < len(full) or not bounds[k] < full[i] < bounds[k + 2]:
        return None
    bounds[k + 1] = full[i]
    return [e - b for b, e in zip(bounds, bounds[1:])]


def test_infeasible_requests_raise_clear_errors():
    sched = build_schedule(10, index_topk_pattern="FSSFSSSFSS")
    with pytest.raises(
        ps.LayoutError, match=r"cannot split 10 layers into 4 pipeline stages.*only 3 \(0,3,7\)"
    ):
        ps.split_layers(sched, 4, [1.0] * 10)
    with pytest.raises(ps.LayoutError, match="only 3"):
        ps.validate_layout(sched, 4, [3, 4, 2, 1])
    with pytest.raises(ps.LayoutError, match=">= 1"):
        ps.split_layers(sched, 0, [1.0] * 10)
    with pytest.raises(ValueError, match="9 layer costs for 10 layers"):
        ps.split_layers(sched, 2, [1.0] * 9)


def test_validation_agrees_with_brute_force_and_suggests_the_nearest_layout():
    rng = random.Random(5)
    for _ in range(300):
        num_layers = rng.randint(2, 12)
        sched = _random_schedule(rng, num_layers)
        num_stages = rng.randint(1, len(sched.full_layers))
        valid = list(_valid_layouts(sched, num_stages))
        given = (
            rng.choice(valid) if rng.random() < 0.3 else _random_layout(rng, num_layers, num_stages)
        )
        if given in valid:
            assert ps.validate_layout(sched, num_stages, given) == given
            continue
        with pytest.raises(ps.LayoutError) as err:
            ps.validate_layout(sched, num_stages, given)
        msg = str(err.value)
        suggestion = _suggestion(msg)
        _assert_valid(sched, num_stages, suggestion)
        if len(given) == num_stages:
            dist = min(sum(abs(a - b) for a, b in zip(v, given)) for v in valid)
            assert sum(abs(a - b) for a, b in zip(suggestion, given)) == dist
        # Every stage that starts on a shared layer is named with its source layer.
        start = 0
        for k, n in enumerate(given):
            if 0 < start < num_layers and n >= 1 and not sched.is_full(start):
                assert (
                    f"stage {k} starts at layer {start}, a shared layer (source layer "
                    f"{sched.source_layer(start)})" in msg
                )
            start += max(n, 0)


def _random_layout(rng, num_layers, num_stages):
    count = max(1, num_stages + rng.choice([0, 0, 0, -1, 1]))
    layout = [rng.randint(0, num_layers) for _ in range(count)]
    if rng.random() < 0.6:  # mostly the right total, so the boundary check is what fails
        layout[-1] = num_layers - sum(layout[:-1])
    return layout


# ------------------------------------------------------------------------------------- module names
def _module_names(layers_per_stage, has_mtp):
    specs = ps.stage_specs(layers_per_stage, range(len(layers_per_stage)), with_mtp=has_mtp)
    return [list(s.module_names) for s in specs]


def test_module_names_per_stage():
    assert _module_names([2, 1, 2], has_mtp=True) == [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2"],
        ["layers.3", "layers.4", "norm", "output", "mtp"],
    ]
    assert _module_names([3], has_mtp=False) == [
        ["tok_embeddings", "layers.0", "layers.1", "layers.2", "norm", "output"]
    ]
    names = _module_names([14, 8, 8, 8, 8, 8, 8, 16], has_mtp=True)
    flat = [n for stage in names for n in stage if n.startswith("layers.")]
    assert flat == [f"layers.{i}" for i in range(78)]
    for bad in ([], [3, 0]):
        with pytest.raises(ValueError, match="at least one layer"):
            _module_names(bad, has_mtp=True)


def test_parse_layout():
    assert ps.parse_layout("14, 8,8,8,8,8,8,16") == (14, 8, 8, 8, 8, 8, 8, 16)
    with pytest.raises(ps.LayoutError, match="comma-separated integers"):
        ps.parse_layout("14,x")
