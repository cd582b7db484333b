"""Chat SFT through train.py: the shipped SFT config trains on the embedded chat sample with the
loss on the assistant's tokens, resumes exactly (the chat loader's position and counters go through
the checkpoint), and a checkpoint of a text run is not resumed as a chat run."""

import os

from tests.e2e.test_train import ROOT, copy_checkpoints, read_metrics, run_train

SFT_TOML = os.path.join(ROOT, "train_configs", "glm52_sft_debug.toml")

# Six steps pinned to a six-step LR schedule, a checkpoint every three, every metric logged.
COMMON = (
    "--training.local_batch_size",
    "2",
    "--lr_scheduler.warmup_steps",
    "2",
    "--lr_scheduler.total_steps",
    "6",
    "--checkpoint.interval",
    "3",
    "--checkpoint.keep_latest_k",
    "0",
    "--metrics.log_freq",
    "1",
)


def test_sft_config_trains_and_resumes_exactly(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    log = run_train(full, "--training.steps", "6", *COMMON, config=SFT_TOML)
    out = log.stdout + log.stderr
    # seq_len 512 truncates some conversations of the sample; the loader says how many
    assert "were truncated" in out and "data.chat_overflow" in out
    copy_checkpoints(full, part, 3)  # resumed from a copy of the step-3 checkpoint
    run_train(part, "--training.steps", "6", *COMMON, config=SFT_TOML)
    a = {r["step"]: r for r in read_metrics(full)}
    b = {r["step"]: r for r in read_metrics(part)}
    assert sorted(a) == list(range(1, 7)) and sorted(b) == [4, 5, 6]
    assert all(0 < r["loss/ce"] < 20 for r in a.values())
    for step in b:
        assert a[step]["loss/total"] == b[step]["loss/total"], step
        assert a[step]["grad_norm"] == b[step]["grad_norm"], step


def test_a_text_checkpoint_is_not_resumed_as_chat(tmp_path):
    run_train(tmp_path, "--training.steps", "1", "--training.seq_len", "128", nproc=1)
    proc = run_train(
        tmp_path,
        "--training.steps",
        "2",
        *COMMON,
        config=SFT_TOML,
        nproc=1,
        check=False,
        torchrun=True,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "exitcode  : 2" in out  # torchrun's report of the refusal
    line = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert len(line) == 1 and "data.format: checkpoint 'text', this run 'chat'" in line[0], line
