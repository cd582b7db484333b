"""Checkpoints: torchtitan's DCP manager for training state, and the published HF format in and out.

A DCP checkpoint (``<dump_folder>/<checkpoint.folder>/step-N``) holds the model parts, the
optimizers, the LR schedules, the data loader's position and ``TrainState``; a run resumes from the
newest one in its folder. An HF checkpoint (the published safetensors) is read once at the start
with ``checkpoint.initial_load_path`` + ``initial_load_in_hf`` when no DCP checkpoint exists, and
written at the end with ``last_save_in_hf``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torchtitan.components import checkpoint as tt_checkpoint

from titan_glm52.config import JobConfig
from titan_glm52.errors import CheckpointError, ConfigError
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


RUN_RECORD = "titan_glm52_run.json"  # in every step folder: what a resume must match
# What a resume must match ("layout" is recorded for the reader: DCP reshards the parameters)
RECORD_CHECKED = ("model", "mtp", "data", "lora")
_STEP_DIR = re.compile(r"^step-(\d+)$")


def unusable_reason(path: str) -> str | None:
    """Why the DCP checkpoint folder ``path`` cannot be loaded (None: it is complete). A save writes
    every rank's ``.distcp`` files, then ``.metadata``: a folder without it is a save that did not
    finish; one whose metadata does not read, or names a file that is missing or shorter than its
    entries, is damaged."""
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isfile(os.path.join(path, ".metadata")):
        return "no .metadata (a save that did not finish)"
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:  # a truncated or foreign file: pickle and torch raise many kinds
        return f".metadata cannot be read ({type(e).__name__}: {e})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        if os.path.getsize(file) < size:
            return f"{name} is truncated ({os.path.getsize(file)} of at least {size} bytes)"
    return None


def step_folders(folder: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the ``step-N`` folders of ``folder``, oldest first."""
    if not os.path.isdir(folder):
        return []
    found = [
        (int(m.group(1)), os.path.join(folder, name))
        for name in os.listdir(folder)
        if (m := _STEP_DIR.match(name)) and os.path.isdir(os.path.join(folder, name))
    ]
    return sorted(found)


def _differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "(absent)"), current.get(key, "(absent)")
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: checkpoint {a!r}, this run {b!r}")
    return out


class CheckpointManager(tt_checkpoint.CheckpointManager):
    """torchtitan's DCP manager, made careful about what is on disk:

    * it resumes from the newest *complete* checkpoint (``unusable_reason``), saying which newer
      ones it skipped and why; with none complete but some present it refuses (``start_fresh``
      starts over instead);
    * every step folder holds the run record (``RUN_RECORD``: the model, MTP, the data loader's
      world), and a resume whose record differs is refused, listing the differences;
    * a damaged folder is never deleted or written into: a new save of its step first moves it aside
      (``step-N.unusable-<time>``), and the keep-latest-k purge counts and removes only folders
      older than the newest complete ones kept, after every save including the last;
    * ``save_now`` writes a full checkpoint outside the interval (SIGTERM / SIGINT).
    """

    _force = False

    def __init__(self, *args, run_record: dict, start_fresh: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.run_record, self.start_fresh = run_record, start_fresh

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

    # ------------------------------------------------------------------------------------ loading
    def _find_load_step(self, folder: str = "") -> int:
        skipped = []
        for step, path in reversed(step_folders(folder or self.folder)):
            reason = unusable_reason(path)
            if reason is None:
                if skipped:
                    logger.warning(
                        "resuming from %s, the newest complete checkpoint; not from %s",
                        path,
                        "; ".join(skipped),
                    )
                return step
            skipped.append(f"{os.path.basename(path)} ({reason})")
        if skipped and not self.start_fresh:
            raise CheckpointError(
                f"checkpoint folder {folder or self.folder} holds no complete checkpoint: "
                f"{'; '.join(skipped)}. "
                "Move them away (or use another job.dump_folder) to start over, or set "
                "checkpoint.start_fresh_if_unusable to train from the start and keep them"
            )
        if skipped:
            logger.warning(
                "no complete checkpoint in %s (%s): starting from the beginning, as "
                "checkpoint.start_fresh_if_unusable asks; those folders are left as they are",
                folder or self.folder,
                "; ".join(skipped),
            )
        return -1

    def load(self, step: int = -1) -> bool:
        if self.enable and os.path.isdir(self.folder):
            step = self._find_load_step() if step == -1 else step
            if step == -1:
                return False
            path = self._create_checkpoint_id(step)
            if os.path.isdir(path) and (reason := unusable_reason(path)):
                raise CheckpointError(
                    f"checkpoint.load_step = {step}: {path} cannot be loaded: {reason}"
                )
            self._check_record(path)
        return super().load(step)

    def _check_record(self, path: str) -> None:
        record = os.path.join(path, RUN_RECORD)
        if not os.path.isfile(record):
            logger.warning(
                "%s has no %s (written by an older version): resuming without checking that the "
                "model and the data layout match",
                path,
                RUN_RECORD,
            )
            return
        with open(record) as f:
            saved = json.load(f)
        if isinstance(saved.get("data"), dict):  # records without a format are text loaders'
            saved["data"].setdefault("format", "text")
        diffs = _differences(
            {k: saved.get(k) for k in RECORD_CHECKED},
            {k: self.run_record.get(k) for k in RECORD_CHECKED},
        )
        if diffs:
            hint = (
                " The data loader's position is per data-parallel rank: resume on as many "
                "data-parallel ranks as the checkpoint had (a new run with "
                "data.same_global_batch keeps positions that do not depend on them)."
                if any(d.startswith("data.world") for d in diffs)
                else ""
            )
            raise CheckpointError(
                f"{path} was saved by a different run; resuming it here would drop or misread "
                f"state. Differences: {'; '.join(diffs)}.{hint} Resume with the checkpoint's "
                "settings, or start a new run in another job.dump_folder"
            )

    # ------------------------------------------------------------------------------------ saving
    def save(self, curr_step: int, last_step: bool = False) -> None:
        if not self._should_save(curr_step, last_step):
            return
        path = self._create_checkpoint_id(curr_step)
        if dist.get_rank() == 0:
            if os.path.isdir(path) and unusable_reason(path) is not None:
                aside = f"{path}.unusable-{time.strftime('%Y%m%dT%H%M%S')}"
                os.rename(path, aside)
                logger.warning(
                    "%s could not be loaded; moved to %s before saving step %d there",
                    path,
                    aside,
                    curr_step,
                )
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, RUN_RECORD), "w") as f:
                json.dump(self.run_record, f, indent=1)
        dist.barrier()
        super().save(curr_step, last_step)
        if last_step:  # (torchtitan's last-step save returns before its purge)
            self._purge_stale_checkpoints()

    def _purge_stale_checkpoints(self) -> None:
        """Keeps the newest ``keep_latest_k`` complete checkpoints, and whatever is newer than
        them."""
        if self.keep_latest_k <= 0 or dist.get_rank() != 0:
            return
        folders = step_folders(self.folder)
        complete = [(s, p) for s, p in folders if unusable_reason(p) is None]
        if len(complete) <= self.keep_latest_k:
            return
        oldest_kept = complete[-self.keep_latest_k][0]
        for step, path in folders:
            if step < oldest_kept:
                self.purge_queue.put(path)


def run_record(
    args: GLM52ModelArgs,
    with_mtp: bool,
    data_world: int,
    seed: int,
    layout: dict,
    data_format: str = "text",
) -> dict:
    """What a resume must match: the model (its config.json fields), whether the MTP layer trains,
    and the data loader's world (ranks reading different documents), seed and format (text and
    chat loaders keep different positions); ``layout`` (the parallel degrees) is recorded for the
    reader only."""
    skip = ("transformers_version", "dtype", "torch_dtype", "quantization_config")
    model = {k: v for k, v in args.to_hf_config().items() if k not in skip}
    model.update(latent_norm_eps=args.latent_norm_eps, index_norm_eps=args.index_norm_eps)
    return {
        "model": model,
        "mtp": with_mtp,
        "data": {"world": data_world, "seed": seed, "format": data_format},
        "layout": layout,
    }


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
    record: dict,
    trainable_only: bool = False,
) -> CheckpointManager:
    """The DCP manager of a job, with ``run_record(...)`` written into every checkpoint. The initial
    HF load and the final HF export are done by ``initial_load`` and ``export_hf``, so torchtitan's
    own HF paths are switched off here. ``trainable_only`` (LoRA): checkpoints hold the trainable
    parameters of the model only."""
    ckpt_cfg = dataclasses.replace(
        cfg.checkpoint, initial_load_path=None, initial_load_in_hf=False, last_save_in_hf=False
    )
    manager = CheckpointManager(
        run_record=record,
        start_fresh=cfg.checkpoint.start_fresh_if_unusable,
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
