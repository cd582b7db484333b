"""Context parallelism (zigzag split, gathered key state, top-k over global rows) on 2 and 4 gloo
processes, alone and with FSDP, EP, activation checkpointing, compile, the dense warm-up, FP8 and
the Triton kernels, against a single process on the same global batch
(cp_cases.check_cp_train_step): loss, auxiliary sums, every gradient, expert loads and every
layer's top-k."""

import pytest

from tests.distributed import cp_cases
from tests.distributed.launcher import Case, assert_passed

TRAIN_STEP = {
    "cp2": (2, dict(cp=2)),
    "cp4": (4, dict(cp=4)),
    "cp2_fsdp2": (4, dict(cp=2, dp_shard=2)),
    "cp2_ep2": (2, dict(cp=2, ep=2)),
    "cp2_ac_full": (2, dict(cp=2, ac_mode="full")),
    "cp2_ep2_ac_selective_op": (2, dict(cp=2, ep=2, ac_mode="selective")),
    "cp2_compile_ac_full": (2, dict(cp=2, compile=True, ac_mode="full")),
    "cp2_dense_warmup": (2, dict(cp=2, dense_warmup=True)),
    # FP8 (block-wise) where training puts it by default, float64 otherwise
    "cp2_fp8": (2, dict(cp=2, fp8=True)),
    # the Triton kernels (interpreter on CPU) with q_rows; 2 layers + MTP and two of the rows (4
    # documents crossing the chunks, one document) to keep it short
    "cp2_triton": (2, dict(cp=2, dsa_backend="triton", num_hidden_layers=2, row_ids=(0, 1))),
}


CASES = {
    **{
        name: Case(
            cp_cases.check_cp_train_step, world, kwargs, 420 if "dsa_backend" in kwargs else 180
        )
        for name, (world, kwargs) in TRAIN_STEP.items()
    },
    "cp2_pp2_1f1b": Case(cp_cases.check_cp_pipeline, 4, dict(cp=2, pp=2, schedule="1F1B"), 180),
}


@pytest.mark.parametrize("name", list(TRAIN_STEP))
def test_context_parallel_matches_single_process(name, case_results):
    assert_passed(case_results, name)


@pytest.mark.parametrize("name", ["cp2_pp2_1f1b"])
def test_context_parallel_with_pipeline_matches_single_process(name, case_results):
    assert_passed(case_results, name)
