"""Pipeline parallel (skip-aware stages, MTP on the last stage, IndexShare inside stages) on 2 and 4
gloo processes: loss, gradients, grad norm and MoE loads equal the single-process run."""

import pytest

from tests.distributed.launcher import Case, assert_passed
from tests.distributed.pipeline_cases import check_pipeline

LAYOUTS = {
    "1f1b_pp2": (2, dict(schedule="1F1B", pp=2)),
    "gpipe_pp2_explicit_layout": (2, dict(schedule="GPipe", pp=2, layout=[2, 6])),
    "interleaved1f1b_pp2_v2": (2, dict(schedule="Interleaved1F1B", pp=2, stages_per_rank=2)),
    "zbv_pp2": (2, dict(schedule="ZBVZeroBubble", pp=2, stages_per_rank=2)),
    "1f1b_pp2_ac_full": (2, dict(schedule="1F1B", pp=2, ac_mode="full")),
    # the MTP layer (last stage) in token chunks of 12 (micro-batches of 32 tokens), also in the
    # zero-bubble schedule's separate input- and weight-gradient passes
    "1f1b_pp2_mtp_token_chunk": (2, dict(schedule="1F1B", pp=2, mtp_token_chunk=12)),
    "zbv_pp2_mtp_token_chunk": (
        2,
        dict(schedule="ZBVZeroBubble", pp=2, stages_per_rank=2, mtp_token_chunk=12),
    ),
    # FP8 products (linears and routed experts) on both sides; the reference accumulates the
    # schedule's one-sequence micro-batches (pipeline_cases.check_pipeline)
    "fp8_1f1b_pp2": (2, {"schedule": "1F1B", "pp": 2, "fp8": True}),
    "1f1b_pp2_x_fsdp2": (4, dict(schedule="1F1B", pp=2, dp_shard=2)),
    "interleaved_pp2_x_ep2_fsdp2": (
        4,
        dict(schedule="Interleaved1F1B", pp=2, dp_shard=2, ep=2, stages_per_rank=2),
    ),
}


CASES = {name: Case(check_pipeline, world, kwargs) for name, (world, kwargs) in LAYOUTS.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_matches_single_process(name, case_results):
    assert_passed(case_results, name)
