"""Checkpoints: torchtitan's DCP manager for training state, and the published HF format in and out.

A DCP checkpoint (``<dump_folder>/<checkpoint.folder>/step-N``) holds the model parts, the
optimizers, the LR schedules, the data loader's position and ``TrainState``; a run resumes from the
newest one in its folder. An HF checkpoint (the published safetensors) is read once at the start
with ``checkpoint.initial_load_path`` + ``initial_load_in_hf`` when no DCP checkpoint exists, and
written at the end with ``last_save_in_hf``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn
from torchtitan.components import checkpoint as tt_checkpoint

from titan_glm52.config import ConfigError, JobConfig
from titan_glm52.hf_checkpoint import load_hf_state
from titan_glm52.hf_export import save_hf_distributed
from titan_glm52.model.args import GLM52ModelArgs

logger = logging.getLogger("titan_glm52")


@dataclass
class TrainState:
    """Step counters saved with every checkpoint (torch.distributed.checkpoint Stateful)."""

    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, sd: dict) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, int(sd[f.name]))


class CheckpointManager(tt_checkpoint.CheckpointManager):
    """torchtitan's DCP manager, plus ``save_now`` (a full checkpoint outside the interval, e.g. on
    SIGTERM)."""

    _force = False

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        return (self.enable and not self.load_only and self._force) or super()._should_save(
            curr_step, last_step
        )

    def save_now(self, step: int) -> None:
        self._force = True
        try:
            self.save(step)
        finally:
            self._force = False


class _TrainableModel(tt_checkpoint.ModelWrapper):
    """The model's state in a checkpoint restricted to its trainable parameters (LoRA: the
    adapters; the frozen base comes from ``checkpoint.initial_load_path`` or the seeded init at
    every start)."""

    def _get_state_dict(self) -> dict:
        trainable = {
            name for part in self.model for name, p in part.named_parameters() if p.requires_grad
        }
        return {k: v for k, v in super()._get_state_dict().items() if k in trainable}


def build_checkpointer(
    cfg: JobConfig,
    model_parts: list[nn.Module],
    optimizers,
    lr_schedulers,
    dataloader,
    state: TrainState,
    trainable_only: bool = False,
) -> CheckpointManager:
    """The DCP manager of a job. The initial HF load and the final HF export are done by
    ``initial_load`` and ``export_hf``, so torchtitan's own HF paths are switched off here.
    ``trainable_only`` (LoRA): checkpoints hold the trainable parameters of the model only."""
    ckpt_cfg = dataclasses.replace(
        cfg.checkpoint, initial_load_path=None, initial_load_in_hf=False, last_save_in_hf=False
    )
    manager = CheckpointManager(
        dataloader=dataloader,
        model_parts=model_parts,
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": state},
        checkpoint_config=ckpt_cfg,
        sd_adapter=None,
        base_folder=cfg.job.dump_folder,
    )
    if trainable_only:
        manager.states[tt_checkpoint.MODEL] = _TrainableModel(model_parts)
    return manager


def initial_load(model_parts: list[nn.Module], path: str, in_hf: bool, pipelined: bool) -> None:
    """Loads an HF checkpoint into the (sharded, possibly pipelined) model parts: every rank reads
    only the slices its shards hold. Names and shapes are checked against the model args."""
    if not in_hf:
        raise ConfigError(
            "checkpoint.initial_load_path without checkpoint.initial_load_in_hf: put a DCP "
            "checkpoint in checkpoint.folder to resume from it, or set initial_load_in_hf"
        )
    logger.info("initial load of the HF checkpoint %s", path)
    for part in model_parts:
        load_hf_state(part, path, partial=pipelined)


def export_hf(
    model_parts: list[nn.Module],
    args: GLM52ModelArgs,
    with_mtp: bool,
    out_dir: str,
    dtype: torch.dtype,
    writer: bool,
) -> None:
    """Writes the model as an HF safetensors directory (published names) that transformers can load.

    Streamed one unit at a time (embedding, each decoder layer, MTP layer, final norm + head; one
    file each): the ranks of a unit's pipeline stage gather its full tensors together and the
    stage's data-parallel rank 0 (``writer``) writes them, then rank 0 writes the index and
    config.json (``hf_export.save_hf_distributed``). Memory: one unit's full weights on each stage's
    writer (host), one full parameter at a time on every device.
    """
    save_hf_distributed(
        model_parts,
        args if with_mtp else args.replace(num_nextn_predict_layers=0),
        out_dir,
        dtype,
        writer=writer,
    )
