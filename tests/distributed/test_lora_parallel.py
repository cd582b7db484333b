"""LoRA under FSDP2, EP, activation checkpointing and compile on 2 gloo processes against a single
process: loss, every adapter gradient, no base gradient, the PEFT adapter and the merged HF export
written from the shards (see lora_cases.check_lora_train_step); and the bf16 setting with the
frozen base kept in bf16 in units that also hold the fp32 adapters."""

import dataclasses

import pytest

from tests.distributed import lora_cases
from tests.distributed.launcher import Case, assert_passed, run_cases, selected_cases

LAYOUTS = {
    "fsdp2": dict(dp_shard=2),
    "ep2_fsdp2": dict(dp_shard=2, ep=2),
    "fsdp2_ac_full_reshard": dict(dp_shard=2, ac_mode="full", reshard_after_forward="always"),
    "ep2_compile_ac_selective": dict(dp_shard=2, ep=2, compile=True, ac_mode="selective"),
}


CASES = {
    **{
        name: Case(lora_cases.check_lora_train_step, 2, kwargs, timeout_s=240)
        for name, kwargs in LAYOUTS.items()
    },
    "bf16_frozen_base": Case(lora_cases.check_lora_mixed_precision, 2, dict(ep=2), 90),
}


@pytest.fixture(scope="module")
def case_results(request, tmp_path_factory):
    """The conftest's, each case with a folder of its own for the files it writes (``out_dir``)."""
    cases = {
        name: dataclasses.replace(
            case, kwargs=dict(case.kwargs, out_dir=str(tmp_path_factory.mktemp(name)))
        )
        if name in LAYOUTS
        else case
        for name, case in selected_cases(request, CASES).items()
    }
    return run_cases(cases, str(tmp_path_factory.mktemp("rank_reports")))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_matches_single_process(name, case_results):
    assert_passed(case_results, name)


@pytest.mark.parametrize("name", ["bf16_frozen_base"])
def test_lora_bf16_frozen_base_with_fp32_adapters(name, case_results):
    assert_passed(case_results, name)
