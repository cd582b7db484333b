"""End-to-end FP8 training through train.py (CPU, 2 processes, the "debug_fp8" flavor, whose widths
the 128 x 128 blocks divide; on CPU the block-wise products are emulated): it trains and says
which products run in FP8, a resume reproduces the uninterrupted run, and the DCP checkpoint and the
HF export have the names and shapes of a run without FP8."""

from __future__ import annotations

import math
import os
import re

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tests.e2e.test_train import copy_checkpoints, read_metrics, run_train, small

CONVERTERS = ("--model.converters", "quantize.linear.float8,quantize.grouped_mm.float8")
# The LR schedule is pinned to 4 steps, so a run stopped after 2 and extended to 4 is the same run.
COMMON = small(
    "--model.flavor",
    "debug_fp8",
    "--checkpoint.interval",
    "2",
    "--checkpoint.keep_latest_k",
    "0",
    "--lr_scheduler.total_steps",
    "4",
    "--checkpoint.last_save_in_hf",
)


def _checkpoint_entries(folder) -> dict[str, tuple | None]:
    """Every key of a DCP checkpoint with its tensor shape (None for other values)."""
    meta = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return {
        k: tuple(v.size) if isinstance(v, TensorStorageMetadata) else None for k, v in meta.items()
    }


def _hf_tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def _fp8_counts(recipe: str = "blockwise") -> tuple[int, int]:
    """(linears, routed-expert modules) that FP8 converts in the debug_fp8 model with MTP, the
    linears in ``recipe``."""
    from titan_glm52.fp8_training import Fp8Spec, apply_fp8
    from titan_glm52.model.args import get_flavor
    from titan_glm52.model.model import GLM52Model

    with torch.device("meta"):
        model = GLM52Model(get_flavor("debug_fp8"))
    done = apply_fp8(model, Fp8Spec(recipe=recipe))["fp8"]
    experts = sum(1 for what in done.values() if what.startswith("routed experts"))
    return len(done) - experts, experts


def test_fp8_trains_resumes_exactly_and_keeps_checkpoint_and_export_names(tmp_path):
    """Three launches: FP8 for 4 steps (checkpoints at steps 2 and 4, HF export at the end); FP8
    resumed from a copy of that run's step-2 checkpoint in a fresh folder (the checkpoint a run
    stopped after step 2 writes), to step 4; and the same model without the converters for 2 steps.

    (a) The FP8 run logs how many linears and routed-expert modules run their products in FP8 and
    which linears stay bf16; its losses are finite and differ from the run without FP8 (the
    products really changed) by less than FP8's rounding.
    (b) The resumed run's losses and grad norms at steps 3 and 4 equal the uninterrupted run's
    exactly, and so does its HF export; the DCP checkpoint holds the keys and shapes of the run
    without FP8 (same parameters, names and optimizer state).
    (c) The HF export of the FP8 run has the tensor names, shapes and dtypes (and config.json) of
    the export without FP8.
    (d) With the linears in torchao's rowwise recipe (2 steps) it trains, says so, its losses
    are those without FP8 up to FP8's rounding, and its checkpoint holds the same keys and
    shapes."""
    full, part, plain = tmp_path / "full", tmp_path / "part", tmp_path / "plain"
    log = run_train(full, "--training.steps", "4", *COMMON, *CONVERTERS)

    # (a) it trains and says what runs in FP8
    n_linears, n_experts = _fp8_counts()
    assert n_experts == 6 and n_linears > 0  # 5 MoE layers and the MTP block
    text = log.stdout + log.stderr
    found = re.search(
        r"FP8 \(blockwise; experts blockwise\): (\d+) linears and (\d+) routed-expert modules of "
        r"this rank's model parts run their products in FP8; bf16: ([^\n]*)",
        text,
    )
    assert found, text[-4000:]
    assert (int(found[1]), int(found[2])) == (n_linears, n_experts), found[0]
    kept = found[3].split(", ")
    for name in ("wkv_a", "wkv_b", "wk", "weights_proj"):  # (docs/fp8_training.md)
        assert any(k == name or k.endswith(f".{name}") for k in kept), found[0]
    assert "output" not in kept, found[0]  # the head runs in FP8 by default
    a = {r["step"]: r for r in read_metrics(full)}
    assert sorted(a) == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss/total"]) and math.isfinite(r["grad_norm"]) for r in a.values())

    # (b) resume from the step-2 checkpoint
    copy_checkpoints(full, part, 2)
    run_train(part, "--training.steps", "4", *COMMON, *CONVERTERS)
    b = {r["step"]: r for r in read_metrics(part)}
    assert sorted(b) == [3, 4]  # resumed after step 2
    for step in (3, 4):
        assert b[step]["loss/total"] == a[step]["loss/total"], step
        assert b[step]["grad_norm"] == a[step]["grad_norm"], step
    resumed, exported = (_hf_tensors(r / "checkpoint" / "step-4-hf") for r in (part, full))
    assert resumed.keys() == exported.keys()
    for k in exported:
        assert torch.equal(resumed[k], exported[k]), k

    # the same model without FP8
    run_train(plain, "--training.steps", "2", *COMMON)
    p = {r["step"]: r for r in read_metrics(plain)}
    for step in (1, 2):
        assert p[step]["loss/ce"] != a[step]["loss/ce"], step
        assert math.isclose(p[step]["loss/ce"], a[step]["loss/ce"], rel_tol=2e-2), step
    want = _checkpoint_entries(plain / "checkpoint" / "step-2")
    got = _checkpoint_entries(full / "checkpoint" / "step-2")
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    assert got == want
    assert any(k.endswith("moe.experts.w13") for k in got)

    # (c) the HF export
    hf_plain = plain / "checkpoint" / "step-2-hf"
    hf_fp8 = full / "checkpoint" / "step-4-hf"
    ref = _hf_tensors(hf_plain)
    assert exported.keys() == ref.keys(), sorted(exported.keys() ^ ref.keys())
    for k, t in ref.items():
        assert (exported[k].shape, exported[k].dtype) == (t.shape, t.dtype), k
    assert (hf_fp8 / "config.json").read_text() == (hf_plain / "config.json").read_text()

    # (d) torchao's rowwise linears (torchao's Float8Linear in place of each linear)
    rowwise = tmp_path / "rowwise"
    recipe = ("--quantize.linear.float8.recipe_name", "rowwise")
    log = run_train(rowwise, "--training.steps", "2", *COMMON, *CONVERTERS, *recipe)
    found = re.search(r"FP8 \(rowwise; experts blockwise\): (\d+) linears and (\d+)", log.stderr)
    assert found, log.stderr[-4000:]
    n_rowwise = _fp8_counts("rowwise")
    # wkv_a's 576 outputs are a multiple of 16: in FP8 here, not block-wise
    assert (int(found[1]), int(found[2])) == n_rowwise and n_rowwise[0] > n_linears, found[0]
    r = read_metrics(rowwise)
    assert [m["step"] for m in r] == [1, 2]
    for step in (1, 2):
        assert math.isclose(r[step - 1]["loss/ce"], p[step]["loss/ce"], rel_tol=2e-2), step
    assert _checkpoint_entries(rowwise / "checkpoint" / "step-2") == want
