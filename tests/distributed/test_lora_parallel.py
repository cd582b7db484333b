"""LoRA under FSDP2, EP, activation checkpointing and compile on 2 gloo processes against a single
process: loss, every adapter gradient, no base gradient, the PEFT adapter and the merged HF export
written from the shards (see lora_cases.check_lora_train_step); and the bf16 setting with the
frozen base kept in bf16 in units that also hold the fp32 adapters."""

import pytest

from tests.distributed import lora_cases
from tests.distributed.launcher import run_on_ranks

CASES = {
    "fsdp2": dict(dp_shard=2),
    "ep2_fsdp2": dict(dp_shard=2, ep=2),
    "fsdp2_ac_full_reshard": dict(dp_shard=2, ac_mode="full", reshard_after_forward="always"),
    "ep2_compile_ac_selective": dict(dp_shard=2, ep=2, compile=True, ac_mode="selective"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_lora_matches_single_process(name, tmp_path):
    run_on_ranks(
        lora_cases.check_lora_train_step, 2, timeout_s=240, out_dir=str(tmp_path), **CASES[name]
    )


def test_lora_bf16_frozen_base_with_fp32_adapters():
    run_on_ranks(lora_cases.check_lora_mixed_precision, 2, timeout_s=90, ep=2)
