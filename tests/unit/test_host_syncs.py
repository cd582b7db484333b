"""A training step queues its work without waiting for the GPU: no host-device synchronisation from the batch's
arrival to the optimizer step (``torch.cuda.set_sync_debug_mode("error")`` raises on any), on the one-GPU path
(masters in the optimizer) and on FSDP2's path, whose root copies tensor arguments to the GPU with a blocking copy
(the model's ``cu_seqlens`` therefore goes as a host list). A sync there stops the host from queuing ahead, and
on several GPUs it delays FSDP's all-gathers. The model's own contract is checked on the CPU: a list and a tensor
give the same result."""

import pytest
import torch

from titan_glm52 import get_flavor, trainer as trainer_mod
from titan_glm52.config import parse_job_config
from titan_glm52.model.init import init_weights_
from titan_glm52.model.model import GLM52Model

cuda = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                          reason="needs a Hopper-class GPU (sync debug mode, the Triton DSA kernels)")


@cuda
@pytest.mark.parametrize("path", [["--training.master_weights", "optimizer", "--optimizer.implementation", "triton"],
                                  ["--training.master_weights", "fsdp"]], ids=["masters-in-optimizer", "fsdp"])
def test_a_training_step_makes_no_host_sync(tmp_path, monkeypatch, path):
    cfg = parse_job_config([
        "--job.config_file", "train_configs/glm52_debug.toml", "--job.dump_folder", str(tmp_path),
        "--training.steps", "4", "--training.no-memory-check", "--checkpoint.no-enable",
        "--metrics.no-enable-tensorboard", "--metrics.log_freq", "2", *path])
    trainer_mod.one_process_env()
    tr = trainer_mod.Trainer(cfg)
    checked = []
    launch = tr._launch

    def strict_launch(step, prev):  # step 1 sets things up (FSDP's lazy init, the kernels' first launches)
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
    model = GLM52Model(args)
    init_weights_(model, 0.02)
    model.set_dsa_backend("torch")
    tokens = torch.randint(0, args.vocab_size, (2, 40))
    bounds = [0, 13, 40, 52, 80]
    with torch.no_grad():
        as_tensor = model(tokens, torch.tensor(bounds, dtype=torch.int32))
        as_list = model(tokens, bounds)
        as_tuple = model(tokens, tuple(bounds))
    assert torch.equal(as_tensor, as_list) and torch.equal(as_tensor, as_tuple)
    with pytest.raises(ValueError, match="end at T"):
        model(tokens, [0, 13, 79])
