"""A training step queues its work without waiting for the GPU: no host-device synchronisation from
the batch's arrival to the optimizer step (``torch.cuda.set_sync_debug_mode("error")`` raises on
any), on the one-GPU path (masters in the optimizer; also with FP8 and the rowwise routed experts,
whose grouped products take the expert counts on the device) and on FSDP2's path, whose root copies
tensor arguments to the GPU with a blocking copy (the model's ``cu_seqlens`` therefore goes as a
host list); nor in a pipeline stage's forward and backward, which takes its micro-batch's document
bounds from the host (``pipeline.micro_batch_bounds``) instead of reading the device positions back.
A sync there stops the host from queuing ahead, and on several GPUs it delays FSDP's all-gathers and
the pipeline's sends. On the CPU: a list and a tensor give the model the same result, and the stage
finds the bounds of every chunk that torch's pipelining splitter hands it."""

import pytest
import torch

from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from titan_glm52 import get_flavor, pipeline, trainer as trainer_mod
from titan_glm52.config import parse_job_config
from titan_glm52.model.init import init_weights_
from titan_glm52.model.model import GLM52Model
from titan_glm52.model.options import ModelOptions
from titan_glm52.pipeline_split import stage_specs

cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a Hopper-class GPU (sync debug mode, the Triton DSA kernels)",
)


MASTERS_IN_OPTIMIZER = [
    "--training.master_weights",
    "optimizer",
    "--optimizer.implementation",
    "triton",
]


@cuda
@pytest.mark.parametrize(
    "config, path",
    [
        ("glm52_debug", MASTERS_IN_OPTIMIZER),
        ("glm52_debug", ["--training.master_weights", "fsdp"]),
        # FP8 with the rowwise experts: one grouped product, the counts never on the host
        (
            "glm52_fp8_debug",
            [*MASTERS_IN_OPTIMIZER, "--quantize.grouped_mm.float8.recipe_name", "rowwise"],
        ),
    ],
    ids=["masters-in-optimizer", "fsdp", "fp8-rowwise-experts"],
)
def test_a_training_step_makes_no_host_sync(tmp_path, monkeypatch, config, path):
    cfg = parse_job_config(
        [
            "--job.config_file",
            f"train_configs/{config}.toml",
            "--job.dump_folder",
            str(tmp_path),
            "--training.steps",
            "4",
            "--training.no-memory-check",
            "--checkpoint.no-enable",
            "--metrics.no-enable-tensorboard",
            "--metrics.log_freq",
            "2",
            *path,
        ]
    )
    trainer_mod.one_process_env()
    tr = trainer_mod.Trainer(cfg)
    checked = []
    launch = tr._launch

    # step 1 sets things up (FSDP's lazy init, the kernels' first launches)
    def strict_launch(step, prev):
        torch.cuda.set_sync_debug_mode("error" if step >= 2 else "default")
        try:
            return launch(step, prev)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(step)

    monkeypatch.setattr(tr, "_launch", strict_launch)
    try:
        tr.train()
    finally:
        torch.distributed.destroy_process_group()
    assert checked == [1, 2, 3, 4] and tr.state.step == 4


def test_cu_seqlens_as_a_host_list_gives_the_tensor_result():
    args = get_flavor("debug")
    torch.manual_seed(0)
    model = GLM52Model(args, ModelOptions(dsa_backend="torch"))
    init_weights_(model, 0.02)
    tokens = torch.randint(0, args.vocab_size, (2, 40))
    bounds = [0, 13, 40, 52, 80]
    with torch.no_grad():
        as_tensor = model(tokens, torch.tensor(bounds, dtype=torch.int32))
        as_list = model(tokens, bounds)
        as_tuple = model(tokens, tuple(bounds))
    assert torch.equal(as_tensor, as_list) and torch.equal(as_tensor, as_tuple)
    with pytest.raises(ValueError, match="end at T"):
        model(tokens, [0, 13, 79])


def _stage_and_batch(device: str):
    args = get_flavor("debug")
    torch.manual_seed(0)
    spec = stage_specs([args.num_hidden_layers], [0], with_mtp=False)[0]
    options = ModelOptions(dsa_backend="torch" if device == "cpu" else "triton")
    stage = pipeline.GLM52Stage(args, spec, options).to(device)
    init_weights_(stage, 0.02)
    # as the GPU trains it (in fp32 the experts would run their per-expert loop, which syncs)
    if device != "cpu":
        stage = stage.to(torch.bfloat16)
    tokens = torch.randint(0, args.vocab_size, (4, 48), device=device)
    positions = (
        torch.cat([torch.arange(n) for n in (48, 20, 28, 48, 5, 30, 13)]).view(4, 48).to(device)
    )
    return stage, tokens, positions


def _refuse(positions):
    raise AssertionError("a stage read its bounds from the device positions")


def test_pipeline_stages_find_the_host_bounds_of_every_chunk(monkeypatch):
    stage, tokens, positions = _stage_and_batch("cpu")
    n = 2
    t_chunks, kw_chunks = split_args_kwargs_into_chunks((tokens,), {"positions": positions}, n)
    with torch.no_grad():
        # bounds read from the positions
        expected = [stage(t, **kw) for (t,), kw in zip(t_chunks, kw_chunks)]
        bounds = pipeline.micro_batch_bounds(positions, positions.clone(), n)
        monkeypatch.setattr(pipeline, "cu_seqlens_from_positions", _refuse)
        got = [stage(t, **kw, bounds=bounds) for (t,), kw in zip(t_chunks, kw_chunks)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    # 3 and 4 documents in the two halves
    assert sorted(len(b) for b in bounds.by_chunk.values()) == [4, 5]
    assert not stage._missed_bounds
    with torch.no_grad():  # positions the trainer did not announce: read from them, with a warning
        monkeypatch.undo()
        assert torch.equal(
            stage(t_chunks[0][0], positions=kw_chunks[0]["positions"].clone(), bounds=bounds),
            expected[0],
        )
    assert stage._missed_bounds
    with pytest.raises(ValueError, match="host copy"):
        pipeline.micro_batch_bounds(positions, positions[:2], n)


@cuda
def test_a_pipeline_stage_makes_no_host_sync():
    stage, tokens, positions = _stage_and_batch("cuda")
    bounds = pipeline.micro_batch_bounds(positions, positions.cpu(), 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stage(tokens, positions=positions, bounds=bounds).float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert stage.tok_embeddings.weight.grad is not None  # the backward ran through the whole stage
