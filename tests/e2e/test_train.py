"""End-to-end: the README's main command on the debug config, resume, HF export, config errors,
faults."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEBUG_TOML = os.path.join(ROOT, "train_configs", "glm52_debug.toml")


def run_train(
    tmp_path,
    *overrides: str,
    nproc: int = 2,
    check: bool = True,
    script: str = os.path.join(ROOT, "train.py"),
    config: str = DEBUG_TOML,
    torchrun: bool | None = None,
) -> subprocess.CompletedProcess:
    """``script`` under torchrun, or for one process (unless ``torchrun``) as ``python train.py``:
    the same one-process group (``trainer.one_process_env``) without the agent's start-up (about 3
    s of CPU per launch on the CI machine)."""
    env = dict(
        os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1"
    )
    cmd = [
        *launcher(nproc, torchrun),
        script,
        "--job.config_file",
        config,
        "--job.dump_folder",
        str(tmp_path),
        *overrides,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"train.py failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def launcher(nproc: int, torchrun: bool | None = None) -> list[str]:
    if nproc == 1 and not torchrun:
        return [sys.executable]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--standalone",
    ]


def read_metrics(folder) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def copy_checkpoints(run, to, *steps: int):
    """``to/checkpoint`` holding copies of run folder ``run``'s complete checkpoints at ``steps``:
    what a run stopped after the last of them leaves, when both take the same steps on a pinned LR
    schedule. Returns ``to/checkpoint``."""
    ckpt = to / "checkpoint"
    for step in steps:
        src = run / "checkpoint" / f"step-{step}"
        assert (src / ".metadata").exists(), src
        shutil.copytree(src, ckpt / f"step-{step}")
    return ckpt


def small(*extra: str) -> tuple[str, ...]:
    return (
        "--training.seq_len",
        "128",
        "--training.local_batch_size",
        "2",
        "--metrics.log_freq",
        "1",
        *extra,
    )


def test_main_command_trains_and_writes_tensorboard(tmp_path):
    # 20 steps: the debug config's checkpoint interval, and the loss has fallen by about 1 by then
    run_train(tmp_path, "--training.steps", "20", "--metrics.log_freq", "1")
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 21))
    first, last = sum(r["loss/ce"] for r in rows[:5]) / 5, sum(r["loss/ce"] for r in rows[-5:]) / 5
    assert last < first - 0.5, (first, last)  # real text: the loss falls
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = [os.path.join(tmp_path, "tb", d) for d in os.listdir(os.path.join(tmp_path, "tb"))] or [
        os.path.join(tmp_path, "tb")
    ]
    acc = EventAccumulator(os.path.join(tmp_path, "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in (
        "loss/total",
        "loss/ce",
        "loss/mtp",
        "loss/indexer_kl",
        "lr",
        "grad_norm",
        "throughput/tokens_per_s_per_device",
        "time/step_s",
        "time/data_s",
        "time/forward_backward_s",
        "time/optimizer_s",
        "dsa/topk_recall",
        "memory/peak_rss_gib",
        "moe/imbalance/layers.3",
    ):
        assert tag in tags, (tag, sorted(tags), tb)
    assert 0.0 <= rows[0]["dsa/topk_recall"] <= 1.0
    assert os.path.isdir(os.path.join(tmp_path, "checkpoint", "step-20"))


@pytest.mark.parametrize("impl", ["triton-master-weights", "triton-bf16-moments"])
def test_resume_reproduces_uninterrupted_losses(tmp_path, impl):
    """TritonAdamW's state (the device step counter, both moments on the FSDP2 shards, in bf16 by
    ``[optimizer] state_dtype``) goes through the DCP checkpoint and back. With the master weights
    in the optimizer (one process, bf16 copies, fp32 moments) the checkpoint holds the fp32
    masters, and the copies are re-cast from them after the load. (torch's AdamW state resumes in
    the SIGTERM tests below and in tests/e2e/test_faults.py.)"""
    full, part = tmp_path / "full", tmp_path / "part"
    # The LR schedule is pinned to 6 steps, so stopping after 3 and extending to 6 is the same run.
    common = small(
        "--checkpoint.interval",
        "3",
        "--checkpoint.keep_latest_k",
        "0",
        "--lr_scheduler.total_steps",
        "6",
        "--optimizer.implementation",
        impl.split("-")[0],
    )
    nproc = 2
    if impl == "triton-master-weights":
        common += ("--training.master_weights", "optimizer", "--training.mixed_precision_on_cpu")
        nproc = 1
    if impl == "triton-bf16-moments":
        common += ("--optimizer.state_dtype", "bfloat16")
    log = run_train(full, "--training.steps", "6", *common, nproc=nproc)
    assert ("fp32 masters in the optimizer" in log.stdout + log.stderr) == (
        impl == "triton-master-weights"
    )
    # resumed from a copy of the uninterrupted run's step-3 checkpoint alone, in a fresh folder
    copy_checkpoints(full, part, 3)
    meta = FileSystemReader(str(part / "checkpoint" / "step-3")).read_metadata()
    moments = {
        m.properties.dtype
        for key, m in meta.state_dict_metadata.items()
        if key.endswith(("exp_avg", "exp_avg_sq"))
    }
    assert moments == {torch.bfloat16 if impl == "triton-bf16-moments" else torch.float32}
    run_train(part, "--training.steps", "6", *common, nproc=nproc)
    a = {r["step"]: r for r in read_metrics(full)}
    b = {r["step"]: r for r in read_metrics(part)}
    assert sorted(b) == [4, 5, 6]  # resumed after step 3
    for step in b:
        assert a[step]["loss/total"] == b[step]["loss/total"], step
        assert a[step]["grad_norm"] == b[step]["grad_norm"], step


def _worker_pids(agent_pid: int) -> dict[int, int]:
    """rank -> pid of the worker processes that torchrun's agent ``agent_pid`` started (from
    /proc)."""
    pids = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != agent_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        except (OSError, ValueError, IndexError):
            continue
        if b"RANK" in env:
            pids[int(env[b"RANK"])] = int(entry)
    return pids


def _sigterm_resumes_exactly(
    tmp_path, common: tuple[str, ...], nproc: int, signal_rank: int | None, sig=None
) -> None:
    """Trains toward 1000 steps, sends SIGTERM after two logged steps (to the one process, or with
    torchrun to the worker of ``signal_rank`` only), and checks: exit 0, one checkpoint at the last
    logged step, and two more steps resumed from it equal to a run that was never stopped."""
    import signal
    import time

    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(
        [
            *launcher(nproc),
            os.path.join(ROOT, "train.py"),
            "--job.config_file",
            DEBUG_TOML,
            "--job.dump_folder",
            str(run),
            "--training.steps",
            "1000",
            *common,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (
        metrics.exists() and len(metrics.read_text().splitlines()) >= 2
    ):
        time.sleep(0.5)
    os.kill(
        proc.pid if signal_rank is None else _worker_pids(proc.pid)[signal_rank],
        sig or signal.SIGTERM,
    )
    try:
        out, _ = proc.communicate(timeout=300)
    # (ranks that disagree on the stop wait on each other's collectives)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, out[-3000:]
    steps = [int(d.split("-")[1]) for d in os.listdir(run / "checkpoint") if d.startswith("step-")]
    assert len(steps) == 1 and 2 <= steps[0] < 1000
    saved = steps[0]
    assert os.path.exists(run / "checkpoint" / f"step-{saved}" / ".metadata")
    assert max(r["step"] for r in read_metrics(run)) == saved
    run_train(run, "--training.steps", str(saved + 2), *common, nproc=nproc)
    ref = tmp_path / "ref"
    run_train(ref, "--training.steps", str(saved + 2), *common, nproc=nproc)
    a = {r["step"]: r for r in read_metrics(ref)}
    b = {r["step"]: r for r in read_metrics(run)}
    for step in (saved + 1, saved + 2):
        assert a[step]["loss/total"] == b[step]["loss/total"], step
        assert a[step]["grad_norm"] == b[step]["grad_norm"], step


def _sigterm_args(impl: str) -> tuple[str, ...]:
    return (
        "--checkpoint.interval",
        "500",
        "--lr_scheduler.total_steps",
        "1000",
        "--optimizer.implementation",
        impl,
        *small(),
    )


def test_sigterm_saves_a_checkpoint_and_stops(tmp_path):
    """The checkpoint written on SIGTERM resumes exactly (one process, the foreach step)."""
    _sigterm_resumes_exactly(tmp_path, _sigterm_args("foreach"), nproc=1, signal_rank=None)


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """A preemption signal that reaches one rank only: every rank learns it with a step's numbers (a
    maximum over the ranks), so they stop after the same step and write one checkpoint together
    instead of waiting on each other's collectives. With the fused step the host has the next step
    queued when the signal comes: it finishes that step and saves after it, so the data loader's
    position matches."""
    _sigterm_resumes_exactly(tmp_path, _sigterm_args("fused"), nproc=2, signal_rank=1)


def test_export_to_hf_loads_in_transformers_with_same_logits(tmp_path):
    run_train(
        tmp_path,
        "--training.steps",
        "2",
        "--checkpoint.last_save_in_hf",
        "--checkpoint.export_dtype",
        "float32",
        *small(),
        nproc=2,
    )
    out = tmp_path / "checkpoint" / "step-2-hf"
    from transformers import GlmMoeDsaForCausalLM

    from titan_glm52 import load_hf_model

    hf = GlmMoeDsaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = load_hf_model(str(out), dtype=torch.float32, latent_norm_eps=1e-6).eval()
    assert ours.mtp is not None
    tokens = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = hf(tokens).logits, ours(tokens)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-4


@pytest.mark.parametrize("impl", ["foreach", "fused", "triton"])
def test_forced_nan_is_skipped_and_counted(tmp_path, impl):
    """foreach: the host checks the loss and norm, then steps; fused / triton: the kernel skips the
    update on the device (found_inf) and the host counts it after the launch. Either way the NaN
    step changes nothing: the run goes on with finite losses, and the step after it sees the
    parameters of step 1."""
    run_train(
        tmp_path,
        "--training.steps",
        "4",
        "--faults.inject_nan_at_steps",
        "2",
        "--optimizer.implementation",
        impl,
        *small(),
        nproc=1,
    )
    rows = {r["step"]: r for r in read_metrics(tmp_path)}
    assert rows[1]["faults/skipped_steps"] == 0 and rows[2]["faults/skipped_steps"] == 1
    assert rows[4]["faults/skipped_steps"] == 1
    assert all(
        math.isfinite(rows[s]["loss/total"]) and math.isfinite(rows[s]["grad_norm"])
        for s in (1, 3, 4)
    )
    # the scheduler did not step on the skipped step
    assert rows[2]["lr"] == rows[1]["lr"] != rows[3]["lr"]


def test_consecutive_faults_stop_and_keep_last_good_checkpoint(tmp_path):
    proc = run_train(
        tmp_path,
        "--training.steps",
        "8",
        "--faults.inject_nan_at_steps",
        "3",
        "4",
        "5",
        "--faults.max_consecutive_nonfinite",
        "3",
        "--checkpoint.interval",
        "2",
        *small(),
        nproc=1,
        check=False,
    )
    assert proc.returncode != 0
    assert "consecutive steps with a non-finite loss" in proc.stdout + proc.stderr
    assert os.path.exists(tmp_path / "checkpoint" / "step-2" / ".metadata")
    assert not os.path.exists(tmp_path / "checkpoint" / "step-4")


@pytest.mark.parametrize(
    "override, message",
    [
        (("--parallelism.expert_parallel_degree", "3"), "parallelism.expert_parallel_degree"),
        (("--model.flavor", "nope"), "unknown model flavor"),
    ],
)
def test_config_errors_name_the_key(tmp_path, override, message):
    """Through torchrun; every other refusal is checked in-process in tests/unit/test_config.py."""
    proc = run_train(tmp_path, *override, nproc=1, check=False, torchrun=True)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr


def test_profiler_trace_on_request(tmp_path):
    run_train(
        tmp_path,
        "--training.steps",
        "6",
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "5",
        "--profiling.profiler_warmup",
        "2",
        *small(),
        nproc=1,
    )
    trace = tmp_path / "profile_traces" / "iteration_5" / "rank0_trace.json"
    assert trace.exists() and json.loads(trace.read_text())["traceEvents"]


SAME_BATCH = (
    "--training.steps",
    "3",
    "--training.seq_len",
    "64",
    "--data.same_global_batch",
    "--checkpoint.no-enable",
    "--metrics.log_freq",
    "1",
)


PIPELINE_2 = (
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--parallelism.pipeline_parallel_schedule",
    "1F1B",
)


@pytest.fixture(scope="module")
def one_process_reference(tmp_path_factory):
    """Metrics of the 1-process run with 4 rows per step (shared by the layout comparisons)."""
    folder = tmp_path_factory.mktemp("one")
    run_train(folder, *SAME_BATCH, "--training.local_batch_size", "4", nproc=1)
    return read_metrics(folder)


@pytest.mark.parametrize(
    "layout",
    [
        ("--parallelism.data_parallel_shard_degree", "2"),
        ("--parallelism.expert_parallel_degree", "2"),
        PIPELINE_2,
    ],
)
def test_two_processes_train_like_one(tmp_path, one_process_reference, layout):
    """Same global batches (data.same_global_batch) and layout-independent init: the trainer's
    losses and grad norms on 2 processes (FSDP, EP x FSDP, or PP) equal the 1-process run step for
    step."""
    pp = "--parallelism.pipeline_parallel_degree" in layout
    run_train(
        tmp_path / "two",
        *SAME_BATCH,
        "--training.local_batch_size",
        "4" if pp else "2",
        *layout,
        nproc=2,
    )
    one, two = one_process_reference, read_metrics(tmp_path / "two")
    for a, b in zip(one, two, strict=True):
        for key in ("loss/total", "loss/ce", "loss/mtp", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)


def test_context_parallel_trains_like_one_process(tmp_path, one_process_reference):
    """The README's command with ``--parallelism.context_parallel_degree 2`` (CP 2, dp 1: both
    ranks read the same 4 rows and train their zigzag halves of every sequence) on the same global
    batches: losses, grad norms, the indexer KL, the MoE sequence loss and the top-k recall equal
    the 1-process run step for step (there the dense prefix runs on SDPA, here on the sparse
    kernels: the same math, in another rounding order)."""
    run_train(
        tmp_path / "cp",
        *SAME_BATCH,
        "--training.local_batch_size",
        "4",
        "--parallelism.context_parallel_degree",
        "2",
        nproc=2,
    )
    one, cp = one_process_reference, read_metrics(tmp_path / "cp")
    for a, b in zip(one, cp, strict=True):
        for key in ("loss/total", "loss/ce", "loss/mtp", "loss/moe_aux", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
        for key in ("dsa/indexer_kl_per_token", "dsa/topk_recall"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), (a["step"], key)


# train.py with the clip NOT folded into the fused step: in-place clip, then the same fused AdamW
# step.
_IN_PLACE_CLIP_TRAIN = f"""import sys
sys.path.insert(0, {ROOT!r})
import titan_glm52.trainer as trainer
trainer.folds_clip = lambda optimizers: False
trainer.main(sys.argv[1:])
"""


@pytest.mark.parametrize("impl", ["fused", "triton"])
def test_adamw_kernel_folds_the_clip_like_the_in_place_clip(tmp_path, impl):
    """optimizer.implementation = "fused" / "triton" in the trainer: the gradient clip applied
    inside the optimizer's kernel (pipeline stages, the norm reduced over stages) trains like the
    in-place clip before the same optimizer's step: to fp32 rounding with torch's fused kernel (it
    divides by 1 / c), bitwise with the Triton one (it multiplies by c, as the in-place clip does).
    max_norm 0.05 clips every step; without the clip the losses differ by ~1e-4. (On FSDP2 DTensor
    parameters: tests/distributed/test_parallel_training.py, the *_clip cases.)"""
    common = (
        "--training.steps",
        "3",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--checkpoint.no-enable",
        "--metrics.log_freq",
        "1",
        "--optimizer.implementation",
        impl,
        "--training.max_norm",
        "0.05",
        *PIPELINE_2,
    )
    reference = tmp_path / "in_place_clip_train.py"
    reference.write_text(_IN_PLACE_CLIP_TRAIN)
    run_train(tmp_path / "folded", *common, nproc=2)
    run_train(tmp_path / "in_place", *common, nproc=2, script=str(reference))
    for a, b in zip(
        read_metrics(tmp_path / "in_place"), read_metrics(tmp_path / "folded"), strict=True
    ):
        assert a["grad_norm"] > 0.05, a
        for key in ("loss/total", "grad_norm"):
            if impl == "triton":
                assert b[key] == a[key], (a["step"], key)
            else:
                assert b[key] == pytest.approx(a[key], rel=1e-6), (a["step"], key)


_ORDER_TRAIN = f"""import gc, json, sys
sys.path.insert(0, {ROOT!r})
import titan_glm52.trainer as trainer
events, collections, gc_on = [], [], []
T = trainer.Trainer
step_fb, finish, log = T.train_step, T._finish, T._log
collect = trainer.GarbageCollection.collect
def spy_fb(self, batches, **kwargs):
    events.append(("fb", self._launching))
    gc_on.append(gc.isenabled())
    return step_fb(self, batches, **kwargs)
def spy_finish(self, s, later_queued=False):
    events.append(("finish", s.step))
    finish(self, s, later_queued)
def spy_collect(reason, generation=1):
    collections.append((events[-1][1] if events else 0, reason))
    collect(reason, generation)
def spy_log(self, st, vals, host_s):
    log(self, st, vals, host_s)
    with open(self.cfg.job.dump_folder + "/order.json", "w") as f:  # main() leaves by os._exit
        json.dump(dict(events=events, collections=collections, gc_on=gc_on), f)
T.train_step, T._finish, T._log = spy_fb, spy_finish, spy_log
trainer.GarbageCollection.collect = staticmethod(spy_collect)
trainer.main(sys.argv[1:])
"""


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_host_queues_the_next_step_before_reading_this_one(tmp_path, impl):
    """With the fused step (the clip and the skip of a non-finite step happen on the device) the
    host queues step N + 1's forward and backward before it finishes step N, except after a
    checkpoint step (the checkpoint holds the data loader's position) and the last step; foreach
    waits for each step's numbers before its update. Python's automatic garbage collection is off;
    generation 1 is collected every training.gc_freq steps (torchtitan's)."""
    script = tmp_path / "order_train.py"
    script.write_text(_ORDER_TRAIN)
    run_train(
        tmp_path,
        "--training.steps",
        "5",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--checkpoint.interval",
        "2",
        "--metrics.log_freq",
        "2",
        "--optimizer.implementation",
        impl,
        "--training.gc_freq",
        "2",
        nproc=1,
        script=str(script),
    )
    with open(tmp_path / "order.json") as f:
        seen = json.load(f)
    events = [f"{kind}{step}" for kind, step in seen["events"]]
    # (the checkpointer's too)
    periodic = [step for step, reason in seen["collections"] if "periodic" in reason]
    assert periodic == [2, 4] and seen["collections"][0][0] == 0 and not any(seen["gc_on"])
    if impl == "fused":
        assert events == [
            "fb1",
            "fb2",
            "finish1",
            "finish2",
            "fb3",
            "fb4",
            "finish3",
            "finish4",
            "fb5",
            "finish5",
        ]
    else:
        assert events == [f"{kind}{i}" for i in range(1, 6) for kind in ("fb", "finish")]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 4, 5]
    assert all(r["time/step_s"] > 0 and r["time/forward_backward_s"] > 0 for r in rows)
    # keep_latest_k = 2 (the debug config) holds after the last save too
    assert sorted(int(d.split("-")[1]) for d in os.listdir(tmp_path / "checkpoint")) == [4, 5]


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    common = (
        "--training.steps",
        "3",
        "--training.seq_len",
        "64",
        "--checkpoint.no-enable",
        "--metrics.log_freq",
        "1",
    )
    run_train(tmp_path / "big", *common, "--training.local_batch_size", "4", nproc=1)
    run_train(
        tmp_path / "acc",
        *common,
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "4",
        nproc=1,
    )
    for a, b in zip(read_metrics(tmp_path / "big"), read_metrics(tmp_path / "acc"), strict=True):
        for key in ("loss/total", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)


@pytest.mark.parametrize(
    "extra",
    [
        ("--mtp.no-enable",),
        ("--mtp.no-enable", "--training.global_batch_size", "4"),  # two micro-batches: the fp32 sum
        (),
    ],
)
def test_master_weights_in_the_optimizer_train_like_fsdp_on_one_rank(tmp_path, extra):
    """training.master_weights = "optimizer" (bf16 copies, fp32 masters in the Triton step, no FSDP)
    against FSDP2 on a one-rank mesh, both in bf16 (training.mixed_precision_on_cpu) with the clip
    active every step: the same losses and norms bit for bit, and the same final weights. With MTP
    the embedding output's gradient is the bf16 sum of the uses that meet there (layer 0 and the MTP
    layer's shifted input); under FSDP's autograd hooks it differs in the last bf16 bits (every
    other gradient is bitwise equal), and Adam's normalised update carries that into the next steps:
    step 1 is equal (loss bitwise, norm within 1e-4), the next ones within 1%."""
    common = (
        "--training.steps",
        "3",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--checkpoint.interval",
        "3",
        "--metrics.log_freq",
        "1",
        "--optimizer.implementation",
        "triton",
        "--training.max_norm",
        "0.05",
        "--training.mixed_precision_on_cpu",
        *extra,
    )
    log_fsdp = run_train(tmp_path / "fsdp", *common, "--training.master_weights", "fsdp", nproc=1)
    # "optimizer"
    log_opt = run_train(
        tmp_path / "optimizer", *common, "--training.master_weights", "auto", nproc=1
    )
    assert "mixed precision: bf16, fp32 masters in FSDP" in log_fsdp.stdout + log_fsdp.stderr
    assert "mixed precision: bf16, fp32 masters in the optimizer" in log_opt.stdout + log_opt.stderr
    for a, b in zip(
        read_metrics(tmp_path / "fsdp"), read_metrics(tmp_path / "optimizer"), strict=True
    ):
        assert a["grad_norm"] > 0.05, a
        for key in ("loss/total", "grad_norm"):
            if extra:
                assert b[key] == a[key], (a["step"], key)
            else:
                assert b[key] == pytest.approx(a[key], rel=1e-4 if a["step"] == 1 else 1e-2), (
                    a["step"],
                    key,
                )
    assert (
        read_metrics(tmp_path / "fsdp")[0]["loss/total"]
        == read_metrics(tmp_path / "optimizer")[0]["loss/total"]
    )
    if extra:
        ref, ours = _state_at(tmp_path / "fsdp", 3), _state_at(tmp_path / "optimizer", 3)
        assert ref.keys() == ours.keys()
        for k in ref:
            assert ours[k].dtype == ref[k].dtype and torch.equal(ours[k], ref[k]), k


def _state_at(folder, step):
    """Model weights of the run's DCP checkpoint at ``step``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder / "checkpoint" / f"step-{step}"), str(folder / f"step{step}.pt"))
    state = torch.load(folder / f"step{step}.pt", weights_only=False)
    model_roots = {"tok_embeddings", "layers", "norm", "output", "mtp"}
    return {
        k: v
        for k, v in state.items()
        if k.split(".")[0] in model_roots and isinstance(v, torch.Tensor)
    }


@pytest.mark.parametrize(
    "mode, trained",
    [
        (("--dsa.mode", "dense_warmup", "--dsa.indexer_loss_coeff", "1.0"), "indexers only"),
        (("--dsa.freeze_indexer", "--dsa.indexer_loss_coeff", "0"), "all but the indexers"),
        (("--dsa.indexer_loss_coeff", "0.1"), "everything"),
    ],
)
def test_indexer_training_stages(tmp_path, mode, trained):
    """dense warm-up trains only the indexers; a frozen indexer never changes; the sparse KL trains
    them too."""
    run_train(
        tmp_path,
        "--training.steps",
        "2",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--checkpoint.interval",
        "1",
        "--checkpoint.keep_latest_k",
        "0",
        "--metrics.log_freq",
        "1",
        *mode,
        nproc=1,
    )
    first, last = _state_at(tmp_path, 1), _state_at(tmp_path, 2)
    changed = {
        k
        for k in first
        if first[k].is_floating_point()
        and "e_score_correction_bias" not in k
        and not torch.equal(first[k], last[k])
    }
    indexer = {k for k in first if ".indexer." in k}
    if trained == "indexers only":
        assert changed and changed <= indexer
        assert "dsa/indexer_kl_per_token" in read_metrics(tmp_path)[0]
    elif trained == "all but the indexers":
        assert changed and not (changed & indexer)
    else:
        assert changed & indexer and changed - indexer


def test_initial_load_from_hf_checkpoint(tmp_path):
    """A run started from an exported HF checkpoint begins from exactly those weights: its first
    logged loss equals the loss of the loaded checkpoint on the same first batch, computed here
    in-process."""
    args = (
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--metrics.log_freq",
        "1",
    )
    run_train(
        tmp_path / "a",
        "--training.steps",
        "2",
        "--checkpoint.last_save_in_hf",
        "--checkpoint.export_dtype",
        "float32",
        *args,
        nproc=1,
    )
    hf_dir = tmp_path / "a" / "checkpoint" / "step-2-hf"
    run_train(
        tmp_path / "b",
        "--training.steps",
        "1",
        "--checkpoint.initial_load_path",
        str(hf_dir),
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.no-enable",
        *args,
        nproc=1,
    )
    from titan_glm52 import load_hf_model
    from titan_glm52.data import build_dataloader, build_tokenizer
    from titan_glm52.step import mtp_labels

    model = load_hf_model(str(hf_dir), dtype=torch.float32)
    batch = next(build_dataloader(build_tokenizer("embedded"), "embedded", 64, 2))
    labels = batch["labels"]
    with torch.no_grad():
        ce, _ = model(
            batch["input_ids"],
            batch["cu_seqlens"],
            with_mtp=True,
            labels=labels,
            mtp_labels=mtp_labels(labels),
        )
    logged = read_metrics(tmp_path / "b")[0]["loss/ce"]
    assert logged == pytest.approx(float(ce) / int((labels != -100).sum()), rel=1e-5)
