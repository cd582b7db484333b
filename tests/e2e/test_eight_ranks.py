"""The 8-rank layouts on CPU: 8 gloo processes, debug model with MTP and IndexShare, the same global
batches as a 1-process run: losses and grad norms equal step for step.

PP=2 x EP=2 x FSDP (pp 2, dp_shard 4 = EP 2 x expert-FSDP 2) with 1F1B, and PP=2 with
Interleaved1F1B (2 stages per rank, layout 1,1,4,2: the only one whose stages all start on full
layers) x EP=4.
"""

import pytest

from tests.e2e.test_train import read_metrics, run_train

COMMON = (
    "--training.steps",
    "3",
    "--training.seq_len",
    "64",
    "--data.same_global_batch",
    "--checkpoint.no-enable",
    "--metrics.log_freq",
    "1",
)
LAYOUTS = {
    "pp2_ep2_fsdp": (
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "1F1B",
        "--parallelism.expert_parallel_degree",
        "2",
    ),
    "pp2_interleaved_v2_ep4": (
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "Interleaved1F1B",
        "--parallelism.pipeline_parallel_stages_per_rank",
        "2",
        "--parallelism.pipeline_parallel_layout",
        "1,1,4,2",
        "--parallelism.expert_parallel_degree",
        "4",
    ),
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    folder = tmp_path_factory.mktemp("one")
    run_train(folder, *COMMON, "--training.local_batch_size", "8", nproc=1)
    return read_metrics(folder)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_eight_ranks_train_like_one(tmp_path, one_process, name):
    # 4 data-parallel ranks x 2 rows = the 1-process run's 8 rows per step
    run_train(
        tmp_path / "eight", *COMMON, "--training.local_batch_size", "2", *LAYOUTS[name], nproc=8
    )
    for a, b in zip(one_process, read_metrics(tmp_path / "eight"), strict=True):
        for key in ("loss/total", "loss/ce", "loss/mtp", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
