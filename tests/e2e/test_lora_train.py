"""End-to-end LoRA through train.py (train_configs/glm52_lora_debug.toml): a resume from a DCP
checkpoint of the adapters reproduces the uninterrupted run, started from an HF base checkpoint;
pipeline parallelism trains like one process and writes the same adapter and the merged export."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.test_train import ROOT, copy_checkpoints, read_metrics, run_train

LORA_TOML = os.path.join(ROOT, "train_configs", "glm52_lora_debug.toml")
SMALL = ("--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.log_freq", "1")


def run_lora(folder, *overrides: str, nproc: int = 2) -> subprocess.CompletedProcess:
    return run_train(folder, *overrides, nproc=nproc, config=LORA_TOML)


def adapter(folder, step: int) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "adapters", f"step-{step}", "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    """A random base checkpoint in the published format (not the trainer's seeded init, so that a
    run that did not load it would train another model)."""
    from titan_glm52.hf_checkpoint import save_hf_model
    from titan_glm52.model.args import get_flavor
    from titan_glm52.model.model import GLM52Model

    folder = tmp_path_factory.mktemp("hf_base")
    model = GLM52Model(get_flavor("debug"))
    model.init_weights(seed=7)
    save_hf_model(model, str(folder), dtype=torch.float32)
    return str(folder)


def test_resume_from_a_lora_checkpoint_reproduces_the_uninterrupted_run(tmp_path, hf_base):
    full, part = tmp_path / "full", tmp_path / "part"
    common = (
        *SMALL,
        "--checkpoint.initial_load_path",
        hf_base,
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.interval",
        "3",
        "--checkpoint.keep_latest_k",
        "0",
        "--lr_scheduler.total_steps",
        "6",
        "--lora.save_at_checkpoints",
    )
    log = run_lora(full, "--training.steps", "6", *common)
    assert "trainable parameters" in log.stdout + log.stderr
    copy_checkpoints(full, part, 3)  # resumed from a copy of the step-3 checkpoint
    run_lora(part, "--training.steps", "6", *common)
    a = {r["step"]: r for r in read_metrics(full)}
    b = {r["step"]: r for r in read_metrics(part)}
    assert sorted(b) == [4, 5, 6]
    for step in b:
        assert a[step]["loss/total"] == b[step]["loss/total"], step
        assert a[step]["grad_norm"] == b[step]["grad_norm"], step
    # the checkpoints hold the adapters, not the base model
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(full / "checkpoint" / "step-3")).read_metadata()
    model_keys = [
        k for k in keys.state_dict_metadata if k.startswith(("layers.", "mtp.", "tok_", "output."))
    ]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    # the adapters written at the end, in PEFT's format, agree across the runs
    x, y = adapter(full, 6), adapter(part, 6)
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert not all(torch.equal(adapter(full, 3)[k], adapter(full, 6)[k]) for k in adapter(full, 3))
    config = json.loads((full / "adapters" / "step-6" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == hf_base and config["r"] == 8


def test_pipeline_trains_like_one_process_and_writes_the_same_adapter(tmp_path, hf_base):
    """PP = 2 (1F1B) against one process on the same global batches: the losses, the adapter in
    PEFT's format and the merged HF export, which is the base checkpoint plus (alpha / r) B A."""
    common = (
        *SMALL,
        "--training.steps",
        "3",
        "--training.local_batch_size",
        "4",
        "--data.same_global_batch",
        "--checkpoint.no-enable",
        "--checkpoint.initial_load_path",
        hf_base,
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.last_save_in_hf",
        "--checkpoint.export_dtype",
        "float32",
    )
    one, pp = tmp_path / "one", tmp_path / "pp"
    run_lora(one, *common, nproc=1)
    pipeline = ("--parallelism.pipeline_parallel_degree", "2")
    run_lora(pp, *common, *pipeline, "--parallelism.pipeline_parallel_schedule", "1F1B")
    for x, y in zip(read_metrics(one), read_metrics(pp), strict=True):
        for key in ("loss/total", "loss/ce", "loss/mtp", "grad_norm"):
            assert y[key] == pytest.approx(x[key], rel=1e-5), (x["step"], key)
    a, b = adapter(one, 3), adapter(pp, 3)
    assert a.keys() == b.keys() and len(a) == 2 * (8 * 5 + 3 * 3 + 5 * 3)
    for k in a:  # (three Adam steps: fp32 summation order, moved by Adam's normalisation)
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
    # the merged export: every adapted weight is the base's plus (alpha / r) B A
    base, merged = {}, {}
    for name in os.listdir(hf_base):
        if name.endswith(".safetensors"):
            base.update(load_file(os.path.join(hf_base, name)))
    hf_dir = pp / "checkpoint" / "step-3-hf"
    for name in os.listdir(hf_dir):
        if name.endswith(".safetensors"):
            merged.update(load_file(os.path.join(hf_dir, name)))
    assert merged.keys() == base.keys()
    for key, w in base.items():
        prefix = "base_model.model." + key.removesuffix(".weight")
        if f"{prefix}.lora_A.weight" in b:
            want = w + (16.0 / 8) * (b[f"{prefix}.lora_B.weight"] @ b[f"{prefix}.lora_A.weight"])
            torch.testing.assert_close(merged[key], want, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(merged[key], w), key
