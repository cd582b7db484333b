"""Faults and bad input through ``train.py`` (CPU, gloo; torchrun for two processes and where its
report is the subject, plain ``python`` for one): one clear line and status 2 for
a refusal, the newest complete checkpoint after a crash or a damaged file (nothing lost, the losses
of an uninterrupted run), resumes that would misread a checkpoint refused, one job per output
folder, what a run did."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from tests.e2e.test_train import ROOT, copy_checkpoints, read_metrics, run_train, small

# Six steps, a checkpoint every two, all kept, the LR schedule pinned to six steps: a run stopped
# anywhere and resumed is the same run.
COMMON = small(
    "--checkpoint.interval",
    "2",
    "--checkpoint.keep_latest_k",
    "0",
    "--lr_scheduler.total_steps",
    "6",
    "--metrics.no_enable_tensorboard",
)


def _output(proc) -> str:
    return proc.stdout + proc.stderr


def _same_losses(a_folder, b_folder, steps) -> None:
    a = {r["step"]: r for r in read_metrics(a_folder)}
    b = {
        r["step"]: r for r in read_metrics(b_folder)
    }  # (a resumed run appends: the last record wins)
    for step in steps:
        assert a[step]["loss/total"] == b[step]["loss/total"], step
        assert a[step]["grad_norm"] == b[step]["grad_norm"], step


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted six-step run on one process."""
    folder = tmp_path_factory.mktemp("reference")
    run_train(folder, "--training.steps", "6", *COMMON, nproc=1)
    return folder


# ----------------------------------------------------------------------------------------- refusals
def test_a_refusal_is_one_line_once_with_status_2(tmp_path):
    proc = run_train(tmp_path, "--training.steps", "0", nproc=2, check=False)
    out = _output(proc)
    assert proc.returncode != 0
    lines = [ln for ln in out.splitlines() if "training.steps: 0 is out of range" in ln]
    # printed once by the rank that reported it, and once more as the root cause of torchrun's
    # summary
    assert len([ln for ln in lines if ln.startswith("error: ")]) == 1, out[-3000:]
    # torchrun's own traceback (its agent) is the only one: no frame of the workers' code
    assert out.count("Traceback (most recent call last)") <= 1
    assert "titan_glm52" not in "".join(
        ln for ln in out.splitlines() if ln.strip().startswith("File ")
    )
    assert "exitcode  : 2" in out
    tail = out.strip().splitlines()[-3:]
    assert any("training.steps: 0 is out of range" in ln for ln in tail), tail
    assert not os.path.exists(tmp_path / ".titan_glm52.lock")


def test_fp8_on_a_model_it_cannot_convert_is_refused_before_any_work(tmp_path):
    # the debug flavor's widths are not in 128 x 128 blocks: nothing would run in FP8
    proc = run_train(
        tmp_path,
        "--model.converters",
        "quantize.linear.float8",
        nproc=1,
        check=False,
        torchrun=True,
    )
    out = _output(proc)
    assert proc.returncode != 0 and "exitcode  : 2" in out, out[-2000:]
    line = [ln for ln in out.splitlines() if ln.startswith("error: model.converters:")]
    assert len(line) == 1 and "no product of this model runs in FP8" in line[0], out[-2000:]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_the_traceback_comes_back_on_request(tmp_path):
    env_before = os.environ.get("TITAN_GLM52_TRACEBACK")
    os.environ["TITAN_GLM52_TRACEBACK"] = "1"
    try:
        proc = run_train(tmp_path, "--training.steps", "0", nproc=1, check=False)
    finally:
        os.environ.pop("TITAN_GLM52_TRACEBACK")
        if env_before is not None:
            os.environ["TITAN_GLM52_TRACEBACK"] = env_before
    assert proc.returncode != 0 and "Traceback (most recent call last)" in _output(proc)
    assert "ConfigError: training.steps" in _output(proc)


@pytest.mark.parametrize(
    "toml, message",
    [
        ('[training]\nsteps = "abc"\n', "training.steps: expected int, got 'abc' (str)"),
        ('[optimizer]\nlr = "3e-3"\n', "optimizer.lr: expected float, got '3e-3' (str)"),
        (
            "[training]\nseq_len = 8192\n",
            "training.seq_len: 8192 is above the model's max_position_embeddings",
        ),
        ("[training]\nsteps = \n", "is not valid TOML"),
    ],
)
def test_bad_config_files_are_refused_before_any_work(tmp_path, toml, message):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        "--job.config_file",
        str(path),
        "--job.dump_folder",
        str(tmp_path / "out"),
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 2, _output(proc)[-2000:]
    assert _output(proc).strip().splitlines()[-1].startswith("error: ") and message in _output(proc)
    assert "Traceback" not in _output(proc)
    assert not os.path.exists(tmp_path / "out" / "checkpoint")


# ------------------------------------------------------------------------------ damaged checkpoints
def _truncate(path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize(
    "damage", ["truncated .distcp", "truncated .metadata", "missing .metadata"]
)
def test_a_damaged_latest_checkpoint_is_skipped_and_kept(tmp_path, reference, damage):
    ckpt = copy_checkpoints(reference, tmp_path, 2, 4)
    step4 = ckpt / "step-4"
    if damage == "truncated .distcp":
        _truncate(
            max(
                (step4 / n for n in os.listdir(step4) if n.endswith(".distcp")), key=os.path.getsize
            )
        )
    elif damage == "truncated .metadata":
        _truncate(step4 / ".metadata")
    else:
        os.remove(step4 / ".metadata")
    damaged = sorted(os.listdir(step4))
    proc = run_train(tmp_path, "--training.steps", "6", *COMMON, nproc=1)
    assert re.search(
        r"resuming from \S*step-2, the newest complete checkpoint; not from step-4", _output(proc)
    )
    _same_losses(reference, tmp_path, range(3, 7))
    aside = [n for n in os.listdir(ckpt) if n.startswith("step-4.unusable-")]
    assert len(aside) == 1 and sorted(os.listdir(ckpt / aside[0])) == damaged  # kept as it was
    assert {"step-2", "step-4", "step-6"} <= set(os.listdir(ckpt))


def test_no_complete_checkpoint_is_refused_or_started_over_on_request(tmp_path, reference):
    os.remove(copy_checkpoints(reference, tmp_path, 2) / "step-2" / ".metadata")
    proc = run_train(tmp_path, "--training.steps", "6", *COMMON, nproc=1, check=False)
    out = _output(proc)
    assert proc.returncode != 0 and "holds no complete checkpoint: step-2 (no .metadata" in out
    assert "checkpoint.start_fresh_if_unusable" in out
    proc = run_train(
        tmp_path, "--training.steps", "6", *COMMON, "--checkpoint.start_fresh_if_unusable", nproc=1
    )
    records = read_metrics(tmp_path)
    ref = {r["step"]: r["loss/total"] for r in read_metrics(reference)}
    assert [r["loss/total"] for r in records[-6:]] == [ref[s] for s in range(1, 7)]


_CRASH_TRAIN = f"""import os, sys
sys.path.insert(0, {ROOT!r})
import torch.distributed.checkpoint.filesystem as fs
import titan_glm52.checkpoint as ck
import titan_glm52.trainer as trainer
WHEN, STEP = os.environ["CRASH_WHEN"], int(os.environ["CRASH_STEP"])
saving = [None]
save = ck.CheckpointManager.save
def save_(self, step, last_step=False):
    saving[0] = step
    return save(self, step, last_step)
ck.CheckpointManager.save = save_
write, finish = fs.FileSystemWriter.write_data, fs.FileSystemWriter.finish
def write_(self, plan, planner):
    out = write(self, plan, planner)
    if WHEN == "after files" and saving[0] == STEP:
        out.wait()
        os._exit(9)
    return out
def finish_(self, metadata, results):
    if WHEN == "during metadata" and saving[0] == STEP:
        finish(self, metadata, results)
        path = os.path.join(str(self.path), ".metadata")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 3)
        os._exit(9)
    finish(self, metadata, results)
    if WHEN == "after metadata" and saving[0] == STEP:
        os._exit(9)
fs.FileSystemWriter.write_data, fs.FileSystemWriter.finish = write_, finish_
trainer.main(sys.argv[1:])
"""


@pytest.mark.parametrize("when", ["after files", "during metadata", "after metadata"])
def test_a_kill_during_a_save_loses_nothing(tmp_path, reference, when):
    """The process dies while step 4's checkpoint is written (its shard files written and no
    .metadata; the .metadata half written; everything written): the next run resumes from the newest
    complete checkpoint and trains the uninterrupted run's losses."""
    script = tmp_path / "crash_train.py"
    script.write_text(_CRASH_TRAIN)
    os.environ.update(CRASH_WHEN=when, CRASH_STEP="4")
    try:
        proc = run_train(
            tmp_path, "--training.steps", "6", *COMMON, nproc=1, check=False, script=str(script)
        )
    finally:
        os.environ.pop("CRASH_WHEN"), os.environ.pop("CRASH_STEP")
    assert proc.returncode != 0
    assert os.path.isdir(tmp_path / "checkpoint" / "step-4") and os.path.isdir(
        tmp_path / "checkpoint" / "step-2"
    )
    proc = run_train(tmp_path, "--training.steps", "6", *COMMON, nproc=1)
    resumed_from = 4 if when == "after metadata" else 2
    assert f"Loading the checkpoint from {tmp_path}/checkpoint/step-{resumed_from}" in _output(proc)
    _same_losses(reference, tmp_path, range(resumed_from + 1, 7))
    assert os.path.isfile(tmp_path / "checkpoint" / "step-6" / ".metadata")


# ----------------------------------------------------------------------------- resume compatibility
@pytest.mark.parametrize(
    "change, difference",
    [
        (("--model.num_layers", "4"), "model.num_hidden_layers: checkpoint 8, this run 4"),
        (("--mtp.no_enable",), "mtp: checkpoint True, this run False"),
        (("--model.n_routed_experts", "4"), "model.n_routed_experts: checkpoint 8, this run 4"),
    ],
)
def test_resuming_a_different_model_is_refused(tmp_path, reference, change, difference):
    copy_checkpoints(reference, tmp_path, 2)
    proc = run_train(tmp_path, "--training.steps", "4", *COMMON, *change, nproc=1, check=False)
    assert proc.returncode != 0 and difference in _output(proc), _output(proc)[-2000:]
    assert sorted(os.listdir(tmp_path / "checkpoint")) == [
        "step-2"
    ]  # nothing written, nothing moved


def test_resuming_on_another_data_parallel_size_is_refused_with_the_fix(tmp_path):
    run_train(tmp_path, "--training.steps", "2", *COMMON, nproc=2)
    proc = run_train(tmp_path, "--training.steps", "4", *COMMON, nproc=1, check=False)
    out = _output(proc)
    assert proc.returncode != 0 and "data.world: checkpoint 2, this run 1" in out
    assert "resume on as many data-parallel ranks as the checkpoint had" in out


# ------------------------------------------------------------------------------- one job per folder
def test_a_live_job_holds_its_output_folder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        os.makedirs(tmp_path, exist_ok=True)
        lock = tmp_path / ".titan_glm52.lock"
        lock.write_text(
            json.dumps({"host": socket.gethostname(), "pid": holder.pid, "started": "earlier"})
        )
        proc = run_train(tmp_path, "--training.steps", "2", *COMMON, nproc=2, check=False)
        out = _output(proc)
        assert (
            proc.returncode != 0
            and f"is in use by a job started earlier on host {socket.gethostname()}" in out
        )
        assert f"pid {holder.pid}" in out and "delete the lock file" in out
        assert json.loads(lock.read_text())["pid"] == holder.pid and not os.path.exists(
            tmp_path / "checkpoint"
        )
    finally:
        holder.kill()
        holder.wait()
    proc = run_train(
        tmp_path, "--training.steps", "2", *COMMON, nproc=1
    )  # its process is gone: taken over
    assert "taking over" in _output(proc) and "its process" in _output(proc)
    assert not os.path.exists(tmp_path / ".titan_glm52.lock")


# ----------------------------------------------------------------------------------- what a run did
def test_a_finished_run_says_so_and_keep_latest_k_holds_after_the_last_save(tmp_path):
    args = small(
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "2",
        "--metrics.no_enable_tensorboard",
    )
    proc = run_train(tmp_path, "--training.steps", "6", *args, nproc=1)
    summary = [ln for ln in _output(proc).splitlines() if "run summary: 6 steps (1-6 of 6)" in ln]
    assert len(summary) == 1 and "final loss" in summary[0] and "(step-4, step-6)" in summary[0]
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-4", "step-6"]
    lines = len(read_metrics(tmp_path))
    proc = run_train(tmp_path, "--training.steps", "6", *args, nproc=1)
    assert "nothing left to train" in _output(proc) and len(read_metrics(tmp_path)) == lines
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-4", "step-6"]


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    """SIGINT, as Ctrl-C sends it, behaves like SIGTERM (tests/e2e/test_train.py checks those
    resumes)."""
    from tests.e2e.test_train import _sigterm_args, _sigterm_resumes_exactly

    _sigterm_resumes_exactly(
        tmp_path, _sigterm_args("fused"), nproc=1, signal_rank=None, sig=signal.SIGINT
    )


def test_help_lists_this_projects_options_first_and_no_refused_ones():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), "--help"],
        cwd=ROOT,
        timeout=120,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0
    sections = re.findall(r"^\[(\w+)\]$", proc.stdout, re.M)
    assert sections[:7] == ["model", "training", "data", "dsa", "moe", "mtp", "faults"]
    assert "--metrics.enable_wandb" not in proc.stdout
    # the FP8 options are listed under their nested sections, the refused quantize ones are not
    assert "[quantize.linear.float8]" in proc.stdout.split("Not listed:")[0]
    assert "--quantize.linear.float8.recipe_name" in proc.stdout
    assert "--quantize.linear.float8.emulate" not in proc.stdout
    assert (
        "--quantize.linear.mx." not in proc.stdout
        and "--quantize.grouped_mm.mx." not in proc.stdout
    )
    assert (
        "Not listed:" in proc.stdout
        and "metrics.enable_wandb" in proc.stdout.split("Not listed:")[1]
    )
    # Every option the README spells exists in the help, spelled the same way.
    with open(os.path.join(ROOT, "README.md")) as f:
        readme_flags = set(re.findall(r"(--[a-z_]+\.[a-z_]+)", f.read()))
    listed = set(re.findall(r"(--[a-z_]+\.[a-z_]+)", proc.stdout))
    assert readme_flags and readme_flags <= listed, readme_flags - listed
