"""IndexShare schedule: precedence, GLM-5.2's pattern, source layers, refusals."""

import pytest

from titan_glm52.model.index_share import build_schedule

GLM52_FULL = [0, 1, 2] + list(range(6, 78, 4))


def test_glm52_schedule_from_freq_offset():
    s = build_schedule(78, index_topk_freq=4, index_skip_topk_offset=3)
    assert s.full_layers == GLM52_FULL and len(GLM52_FULL) == 21
    assert s.pattern.startswith("FFFSSSFSSSF") and s.pattern.endswith("FSSS")
    assert [s.source_layer(i) for i in (3, 4, 5, 6, 7, 75, 76, 77)] == [2, 2, 2, 6, 6, 74, 74, 74]


def test_megatron_one_indexed_rule_agrees():
    for freq in range(1, 7):
        for offset in range(1, 6):
            s = build_schedule(60, index_topk_freq=freq, index_skip_topk_offset=offset)
            # slime's 1-indexed compute rule
            megatron = [max(n - offset, 0) % freq == 0 for n in range(1, 61)]
            assert list(s.full) == megatron, (freq, offset)


def test_o1_source_formula_matches_walk():
    for freq in range(1, 7):
        for offset in range(1, 6):
            s = build_schedule(50, index_topk_freq=freq, index_skip_topk_offset=offset)
            for i in range(50):
                n = i + 1  # 1-indexed closed form from the prior-art review
                src = n if n <= offset else offset + ((n - offset) // freq) * freq
                assert s.source_layer(i) == src - 1


def test_precedence_indexer_types_over_pattern_over_freq():
    types = ["full", "shared", "full", "shared"]
    s = build_schedule(
        4,
        indexer_types=types,
        index_topk_pattern="FFFF",
        index_topk_freq=2,
        index_skip_topk_offset=1,
    )
    assert s.pattern == "FSFS"
    s = build_schedule(4, index_topk_pattern="ffsf", index_topk_freq=2, index_skip_topk_offset=1)
    assert s.pattern == "FFSF"
    assert build_schedule(4, index_topk_freq=None).pattern == "FFFF"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(indexer_types=["shared", "full"]), "starts with a shared layer"),
        (dict(index_topk_pattern="SF"), "starts with a shared layer"),
        (dict(index_topk_freq=4, index_skip_topk_offset=0), "starts with a shared layer"),
        (dict(indexer_types=["full"]), "2 layers"),
        (dict(indexer_types=["full", "sparse"]), "full'/'shared"),
        (dict(index_topk_pattern="FX"), "'F'/'S'"),
        (dict(index_topk_freq=4), "needs index_skip_topk_offset"),
        (dict(index_topk_freq=0), ">= 1"),
    ],
)
def test_impossible_schedules_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_schedule(2, **kwargs)
