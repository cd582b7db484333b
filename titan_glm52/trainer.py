"""The training loop: config -> model -> parallelize -> data -> forward/backward -> optimizer -> checkpoints.

Device-agnostic: CUDA + NCCL on GPUs (bf16 mixed precision: fp32 master weights, bf16 compute, fp32 gradient
reduction; the masters live in FSDP, or on one process in the Triton optimizer: ``master_weights.py``), CPU + gloo
elsewhere (fp32 unless ``training.mixed_precision_on_cpu``), same code. Losses are normalised by the global number
of valid tokens (architecture rule 6): every rank divides its summed token losses by the count over all
data-parallel ranks and all micro-batches of the step, and gradients are summed across ranks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import time
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchtitan.components import checkpoint as tt_checkpoint
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import OptimizersContainer

from titan_glm52 import distributed as tdist
from titan_glm52.config import ConfigError, JobConfig, resolve_master_weights, validate
from titan_glm52.data import IGNORE_INDEX, Prefetcher, build_dataloader, build_tokenizer
from titan_glm52.hf_checkpoint import load_hf_state
from titan_glm52.hf_export import save_hf_distributed
from titan_glm52.master_weights import MasterWeights
from titan_glm52.host_copy import host_to_device
from titan_glm52.metrics import (MetricsLogger, format_line, memory_stats, peak_flops, reset_peak_memory,
                                 step_flops)
from titan_glm52.model.args import GLM52ModelArgs, get_flavor
from titan_glm52.model.attention import Attention
from titan_glm52.model.model import GLM52Model
from titan_glm52.model.moe import MoE
from titan_glm52.optimizer import (TritonAdam, TritonAdamW, clip_grad_norm_, clip_in_fused_step, folds_clip,
                                   total_grad_norm)
from titan_glm52.parallelize import parallelize_model
from titan_glm52.packed import cu_seqlens_from_positions, doc_lengths
from titan_glm52.pipeline import build_pipeline_stages, make_plan, micro_batch_bounds
from titan_glm52.profiling import profiling
from torchtitan.tools.utils import GarbageCollection

logger = logging.getLogger("titan_glm52")


# --------------------------------------------------------------------------------------------- pieces
def build_model_args(cfg: JobConfig) -> GLM52ModelArgs:
    args = GLM52ModelArgs.from_hf_config(cfg.model.hf_config) if cfg.model.hf_config else get_flavor(cfg.model.flavor)
    changes = {}
    if cfg.model.num_layers is not None:
        changes["num_hidden_layers"] = cfg.model.num_layers
        changes["first_k_dense_replace"] = min(args.first_k_dense_replace, cfg.model.num_layers)
    if cfg.model.n_routed_experts is not None:
        changes["n_routed_experts"] = cfg.model.n_routed_experts
    if cfg.dsa.index_topk is not None:
        changes["index_topk"] = cfg.dsa.index_topk
    try:
        return args.replace(**changes) if changes else args
    except ValueError as e:
        raise ConfigError(f"model overrides ({', '.join(changes)}): {e}") from e


def mtp_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels of the MTP head: position i predicts token i + 2, valid when i -> i+1 -> i+2 stay in one document."""
    nxt = torch.cat((labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)), dim=1)
    return torch.where(labels == IGNORE_INDEX, torch.full_like(nxt, IGNORE_INDEX), nxt)


def _modules_of(parts, cls) -> list:
    parts = parts if isinstance(parts, (list, tuple)) else [parts]
    return [(name, m) for part in parts for name, m in part.named_modules() if isinstance(m, cls)]


def moe_modules(parts) -> list[tuple[str, MoE]]:
    """(name, MoE) of a model or of a list of pipeline model parts."""
    return _modules_of(parts, MoE)


def attention_modules(parts) -> list[tuple[str, Attention]]:
    return _modules_of(parts, Attention)


@dataclass
class TrainState:
    """Step counters saved with every checkpoint (torch.distributed.checkpoint Stateful)."""

    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps,
                "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])
        self.tokens_seen = int(sd["tokens_seen"])
        self.skipped_steps = int(sd["skipped_steps"])
        self.consecutive_skips = int(sd["consecutive_skips"])


class _Readback:
    """Device scalars read by the host without stalling it: one copy into pinned host memory, queued behind the work
    that produces them, and an event after it. ``values()`` waits for that event only, not for work queued later
    (the next step's forward and backward). On CPU the values are read at once."""

    def __init__(self, scalars: dict[str, torch.Tensor], device: torch.device) -> None:
        self.names = list(scalars)
        flat = torch.cat([v.detach().reshape(1).to(device, torch.float64) for v in scalars.values()])
        self.event = None
        if device.type == "cuda":
            self.host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
            self.host.copy_(flat, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = flat.cpu()

    def values(self) -> dict[str, float]:
        if self.event is not None:
            self.event.synchronize()
        return dict(zip(self.names, self.host.tolist()))


LOSS_PARTS = ("ce", "mtp", "indexer_kl", "moe_aux", "total", "kl_per_token")  # StepLosses.parts, in order


@dataclass
class StepLosses:
    """A step's summed losses, still on the device: ``parts`` = ``LOSS_PARTS``, and the global valid-token count
    (an fp64 device scalar: several ranks sum it without a host sync)."""
    parts: torch.Tensor
    tokens: torch.Tensor


class _GpuMarks:
    """CUDA events at the start of forward, the end of backward and the end of the optimizer step: the step's
    forward+backward and optimizer times as the GPU ran them. Elsewhere (CPU) ``seconds()`` is None and host times
    are exact."""

    def __init__(self, device: torch.device) -> None:
        self.events = []
        if device.type == "cuda":
            self.events = [torch.cuda.Event(enable_timing=True)]
            self.events[0].record()

    def record(self) -> None:
        if self.events:
            self.events.append(torch.cuda.Event(enable_timing=True))
            self.events[-1].record()

    def wait(self) -> None:
        """Blocks the host until the GPU has run everything up to the last mark."""
        if self.events:
            self.events[-1].synchronize()

    def seconds(self) -> tuple[float, float] | None:
        if len(self.events) != 3:
            return None
        self.wait()
        return (self.events[0].elapsed_time(self.events[1]) / 1e3, self.events[1].elapsed_time(self.events[2]) / 1e3)

    def since(self, earlier: "_GpuMarks") -> float | None:
        """GPU seconds from ``earlier``'s last mark to this one's last (None on CPU)."""
        if not (self.events and earlier.events):
            return None
        self.wait()
        return earlier.events[-1].elapsed_time(self.events[-1]) / 1e3


@dataclass
class _Launched:
    """A step whose work is queued on the device. Its host-side bookkeeping (``Trainer._finish``: counters, LR
    schedule, logging, checkpoint) waits for its numbers; when it ``overlaps``, that happens after the next step's
    forward and backward are queued, so the GPU finds the next step's work queued when this one ends."""
    step: int
    batches: list[dict]
    readback: _Readback
    marks: _GpuMarks
    after: _GpuMarks | None  # the step queued just before this one, still unfinished when this one was launched
    overlaps: bool
    log: bool
    memory: dict[str, float]
    t0: float
    t_data: float
    t_fb: float
    t_end: float = 0.0  # host time when the launch ended
    host_other_s: float = 0.0  # host time in this launch spent finishing the step before


class CheckpointManager(tt_checkpoint.CheckpointManager):
    """torchtitan's DCP manager, plus ``save_now`` (a full checkpoint outside the interval, e.g. on SIGTERM)."""

    _force = False

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        return (self.enable and not self.load_only and self._force) or super()._should_save(curr_step, last_step)

    def save_now(self, step: int) -> None:
        self._force = True
        try:
            self.save(step)
        finally:
            self._force = False


# --------------------------------------------------------------------------------------------- trainer
class Trainer:
    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        if cfg.training.memory_check:
            log_memory_plan(cfg)  # before the process group: the plan builds a fake world of its own
        self.env = tdist.init_distributed()
        self.device = self.env.device
        validate(cfg, self.env.world_size)
        p = cfg.parallelism
        torch.manual_seed(cfg.debug.seed if cfg.debug.seed is not None else 0)
        self.args = build_model_args(cfg)
        try:
            self.mesh = tdist.build_mesh(
                self.env.world_size, dp_replicate=p.data_parallel_replicate_degree,
                dp_shard=p.data_parallel_shard_degree, ep=p.expert_parallel_degree,
                pp=p.pipeline_parallel_degree, device_type=self.device.type,
                n_routed_experts=self.args.n_routed_experts)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        dp_mesh = self.mesh["dp"]
        self.dp_rank, self.dp_world = dp_mesh.get_local_rank(), dp_mesh.size()
        self.dp_group = dp_mesh.get_group()

        # Model.
        self.tokenizer = build_tokenizer(cfg.model.hf_assets_path)
        if self.tokenizer.vocab_size > self.args.vocab_size:
            raise ConfigError(f"model.hf_assets_path: the tokenizer has {self.tokenizer.vocab_size} tokens but the "
                              f"model's vocab_size is {self.args.vocab_size}; use a matching tokenizer/flavor")
        self.with_mtp = cfg.mtp.enable and self.args.num_nextn_predict_layers > 0
        if cfg.mtp.enable and not self.with_mtp:
            logger.warning("mtp.enable is set but the model args have num_nextn_predict_layers = 0: no MTP loss")
        backend = cfg.dsa.backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        self.backend = backend
        self.bf16 = cfg.training.mixed_precision_param == "bfloat16" and (
            self.device.type == "cuda" or cfg.training.mixed_precision_on_cpu)
        self.master_mode = resolve_master_weights(cfg, self.env.world_size, self.bf16)
        self.pp = p.pipeline_parallel_degree > 1
        if self.pp:
            layout = ([int(v) for v in p.pipeline_parallel_layout.split(",")]
                      if p.pipeline_parallel_layout else None)
            try:
                self.plan = make_plan(self.args, p.pipeline_parallel_schedule, p.pipeline_parallel_degree,
                                      p.pipeline_parallel_stages_per_rank, cfg.training.seq_len, layout)
            except ValueError as e:
                raise ConfigError(f"parallelism.pipeline_parallel_layout / _schedule: {e}") from e
            pp_mesh = self.mesh["pp"]
            stages, self.model_parts = build_pipeline_stages(
                self.args, self.plan, pp_mesh.get_local_rank(), pp_mesh.get_group(), self.device, self.with_mtp,
                self._prepare)
            self.has_first = any(s.is_first for s in stages)
            self.has_last = any(s.is_last for s in stages)
            self._last_stage = next((m for m in self.model_parts if m.is_last), None)
            # (imported here: torchtitan's pipeline module pulls in its dataset stack, ~1.7 s of every start-up)
            from torchtitan.distributed.pipeline_parallel import build_pipeline_schedule

            self.schedule = build_pipeline_schedule(cfg, stages, self._pp_loss)
            self._pp_parts: list[torch.Tensor] = []
        else:
            with torch.device("meta"):
                model = GLM52Model(self.args, with_mtp=self.with_mtp)
            self.model_parts = [self._prepare(model)]
        for part in self.model_parts:
            part.to_empty(device=self.device)
            with torch.no_grad():
                part.init_weights()
            part.train()
        self.model = self.model_parts[0]
        if self.pp:
            self._pp_warmup()

        # Data.
        same = cfg.data.same_global_batch
        self.dataloader = build_dataloader(
            self.tokenizer, cfg.training.dataset, cfg.training.seq_len,
            cfg.training.local_batch_size * (self.dp_world if same else 1),
            dp_rank=0 if same else self.dp_rank, dp_world=1 if same else self.dp_world, seed=cfg.data.seed,
            text_field=cfg.data.text_field)
        if cfg.data.prefetch > 0:  # pinned batches: the copies to the GPU below do not wait for the host
            self.dataloader = Prefetcher(self.dataloader, cfg.data.prefetch, pin_memory=self.device.type == "cuda")
        per_step = cfg.training.local_batch_size * self.dp_world
        self.accum = max(cfg.training.global_batch_size // per_step, 1) if cfg.training.global_batch_size > 0 else 1
        self.master = None
        if self.master_mode == "optimizer":
            if self.bf16:
                self.master = MasterWeights(self.model_parts, torch.bfloat16, accumulate=self.accum > 1)
            else:
                logger.info("training.master_weights = 'optimizer': the model computes in fp32 on CPU (see "
                            "training.mixed_precision_on_cpu), so there are no bf16 copies to keep")

        # Optimizer, LR schedule, checkpoints.
        o = cfg.optimizer
        if o.implementation == "triton":
            opt_cls = TritonAdamW if o.name == "AdamW" else TritonAdam
            impl = {}
        else:
            opt_cls = torch.optim.AdamW if o.name == "AdamW" else torch.optim.Adam
            impl = {"fused": {"fused": True}, "foreach": {"foreach": True},
                    "for-loop": {"foreach": False}}[o.implementation]
        self.optimizers = OptimizersContainer(self.model_parts, opt_cls, dict(
            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, **impl))
        # Fused / Triton Adam(W): the gradient clip is applied inside the optimizer kernel (clip_in_fused_step),
        # which saves a separate pass over all gradients; foreach / for-loop clip the gradients in place.
        self.fold_clip = folds_clip(self.optimizers.optimizers)
        for opt in self.optimizers.optimizers:
            opt.master_weights = self.master  # (validate: master_weights = "optimizer" implies the Triton step)
        self.lr_schedulers = build_lr_schedulers(self.optimizers, cfg.lr_scheduler, cfg.training.steps)
        self.state = TrainState()
        self._launching = 0  # the step being queued (``_launch``)
        # Initial HF loads and the final HF export are this trainer's (see _initial_load / export_hf).
        ckpt_cfg = dataclasses.replace(cfg.checkpoint, initial_load_path=None, initial_load_in_hf=False,
                                       last_save_in_hf=False)
        self.checkpointer = CheckpointManager(
            dataloader=self.dataloader, model_parts=self.model_parts, optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers, states={"train_state": self.state}, checkpoint_config=ckpt_cfg,
            sd_adapter=None, base_folder=cfg.job.dump_folder)
        resumed = self.checkpointer.load(step=cfg.checkpoint.load_step)
        if not resumed and cfg.checkpoint.initial_load_path:
            self._initial_load(cfg.checkpoint.initial_load_path, cfg.checkpoint.initial_load_in_hf)

        # Metrics.
        self.metrics = MetricsLogger(
            os.path.join(cfg.job.dump_folder, cfg.metrics.save_tb_folder) if cfg.metrics.enable_tensorboard else None,
            os.path.join(cfg.job.dump_folder, "metrics.jsonl"), enabled=self.env.rank == 0)
        self.peak = peak_flops(self.device)
        # torchtitan's: Python's automatic garbage collection off, generation 1 every training.gc_freq steps.
        self.gc = GarbageCollection(gc_freq=cfg.training.gc_freq, debug=cfg.training.gc_debug)
        # SIGTERM sets _sigterm on the ranks it reaches; every step carries the maximum over all ranks back with its
        # numbers, and _stop (the loop's test) is set from that, so all ranks stop after the same step.
        self._sigterm = self._stop = False
        signal.signal(signal.SIGTERM, self._on_sigterm)
        logger.info("model %s: %s params (%s active/token), layers %d (IndexShare %s), MTP %s, DSA %s/%s, "
                    "world %d (dp %d), accum %d, mixed precision: %s", cfg.model.hf_config or cfg.model.flavor,
                    f"{self.args.num_params(self.with_mtp):,}", f"{self.args.num_active_params():,}",
                    self.args.num_hidden_layers, self.args.index_share.pattern, self.with_mtp, backend,
                    cfg.dsa.mode, self.env.world_size, self.dp_world, self.accum,
                    "bf16, fp32 masters in the optimizer" if self.master is not None
                    else "bf16, fp32 masters in FSDP" if self.bf16 else "off (fp32)")

    # ----------------------------------------------------------------------------------------- setup helpers
    def _prepare(self, model: GLM52Model) -> GLM52Model:
        """DSA/MoE settings, freezing, then EP -> AC -> compile -> FSDP on a meta-device model (or stage)."""
        cfg, p = self.cfg, self.cfg.parallelism
        model.set_dsa_backend(self.backend)
        model.set_sparse_attention(cfg.dsa.mode == "sparse")
        model.dense_prefix = cfg.dsa.dense_prefix
        model.dense_masked_ratio = cfg.dsa.dense_masked_ratio
        grouped = {"auto": None, "on": True, "off": False}[cfg.moe.grouped_mm]
        for _, moe in moe_modules(model):
            moe.experts.use_grouped_mm = grouped
            moe.experts.recompute_inputs = cfg.moe.recompute_expert_inputs
        for _, attn in attention_modules([model]):
            attn.recompute_latent_query = cfg.dsa.recompute_latent_query
        self._freeze(model)
        # Under master_weights = "optimizer" the model stays fp32 here (no FSDP); MasterWeights adds the bf16 copies.
        fsdp_bf16 = self.bf16 and self.master_mode == "fsdp"
        return parallelize_model(
            model, self.mesh, param_dtype=torch.bfloat16 if fsdp_bf16 else torch.float32, reduce_dtype=torch.float32,
            reshard_after_forward=p.fsdp_reshard_after_forward, ac_mode=cfg.activation_checkpoint.mode,
            selective_ac_option=cfg.activation_checkpoint.selective_ac_option, compile=cfg.compile.enable,
            compile_backend=cfg.compile.backend, ep_enabled=p.expert_parallel_degree > 1)

    def _freeze(self, model: GLM52Model) -> None:
        """dsa.freeze_indexer freezes the indexers; the dense warm-up freezes everything else."""
        for name, param in model.named_parameters():
            is_indexer = ".indexer." in name
            if self.cfg.dsa.mode == "dense_warmup":
                param.requires_grad_(is_indexer)
            elif self.cfg.dsa.freeze_indexer and is_indexer:
                param.requires_grad_(False)

    def _initial_load(self, path: str, in_hf: bool) -> None:
        """Loads an HF checkpoint into the (sharded, possibly pipelined) model parts: every rank reads only the
        slices its shards hold. Names and shapes are checked against this job's model args."""
        if not in_hf:
            raise ConfigError("checkpoint.initial_load_path without checkpoint.initial_load_in_hf: put a DCP "
                              "checkpoint in checkpoint.folder to resume from it, or set initial_load_in_hf")
        logger.info("initial load of the HF checkpoint %s", path)
        for part in self.model_parts:
            load_hf_state(part, path, partial=self.pp)

    def _on_sigterm(self, signum, frame) -> None:
        logger.warning("SIGTERM: saving a checkpoint within two steps (at the same step on every rank), then stopping")
        self._sigterm = True

    def _stop_flag(self) -> torch.Tensor:
        """1.0 where SIGTERM has reached any rank (all ranks), as a device scalar; no host sync."""
        flag = host_to_device(torch.tensor([float(self._sigterm)]), self.device)
        if self.env.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag[0]

    # ----------------------------------------------------------------------------------------- one step
    def _set_aux_scales(self, global_tokens: torch.Tensor | float, global_rows: float) -> None:
        coeff = self.cfg.dsa.indexer_loss_coeff
        for _, attn in attention_modules(self.model_parts):
            attn.indexer_loss_scale = coeff / global_tokens if coeff > 0 and attn.indexer is not None else None
        alpha = self.cfg.moe.seq_aux_loss_coeff
        for _, moe in moe_modules(self.model_parts):
            moe.seq_aux_scale = alpha / global_rows if alpha > 0 else None

    def train_step(self, batches: list[dict]) -> StepLosses:
        dev = self.device
        n_tok, n_mtp, n_rows, tokens = self._global_counts(batches)
        self._set_aux_scales(n_tok, n_rows)
        parts = torch.zeros(len(LOSS_PARTS), dtype=torch.float64, device=dev)
        if self.pp:
            self._pp_norm = (n_tok, n_mtp)
            self._pp_parts = []
        with self.master.computing() if self.master is not None else contextlib.nullcontext():
            for i, b in enumerate(batches):
                self._micro_step(i, b, parts, n_tok, n_mtp)
        if self.pp:  # the loss lives on the last stage: share it with every stage (each part counted once)
            dist.all_reduce(parts[:2], group=self.mesh["pp"].get_group())
            parts[4] = parts[0] + parts[1]
        if self.dp_world > 1:
            dist.all_reduce(parts, group=self.dp_group)
        if self.pp:  # aux terms live on the stage of their layer
            dist.all_reduce(parts[2:4], group=self.mesh["pp"].get_group())
            dist.all_reduce(parts[5:6], group=self.mesh["pp"].get_group())
        parts[4] += parts[2] + parts[3]
        return StepLosses(parts, tokens)

    def _global_counts(self, batches: list[dict]) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]:
        """The step's valid tokens and valid MTP tokens summed over the data-parallel ranks (fp32 device scalars, at
        least 1: the loss normalisers), its rows (every rank trains ``local_batch_size`` rows per micro-batch) and
        the valid tokens again in fp64 (exact, for the count of tokens seen). Counted on the host,
        where the loader's batches are, and sent to the device without a sync: several ranks sum them there, and no
        rank waits for the device before queuing the step's forward."""
        local = [0, 0]
        for b in batches:
            labels = b["labels"]
            local[0] += int((labels != IGNORE_INDEX).sum())
            local[1] += int((mtp_labels(labels) != IGNORE_INDEX).sum())
        counts = host_to_device(torch.tensor(local, dtype=torch.float64), self.device)
        if self.dp_world > 1:
            dist.all_reduce(counts, group=self.dp_group)
        counts = counts.clamp_min(1.0)
        norm = counts.to(torch.float32)
        rows = float(sum(b["labels"].shape[0] for b in batches) * self.dp_world)
        return norm[0], norm[1], rows, counts[0]

    def _micro_step(self, i: int, b: dict, parts: torch.Tensor, n_tok: torch.Tensor, n_mtp: torch.Tensor) -> None:
        """Forward and backward of micro-batch ``i``; adds its losses to ``parts``."""
        cfg, dev = self.cfg, self.device
        inject_nan = self._launching in cfg.faults.inject_nan_at_steps and i == 0
        if self.pp:
            self._pp_step(b, parts, inject_nan=inject_nan)
            self._collect_aux(parts, n_tok)
            return
        tokens, labels = b["input_ids"].to(dev, non_blocking=True), b["labels"].to(dev, non_blocking=True)
        # cu_seqlens goes as a host list (a tensor argument would be copied to the GPU by FSDP's root, blocking):
        # the model reads its bounds on the host and copies it over itself without a sync.
        out = self.model(tokens, b["cu_seqlens"].tolist(), with_mtp=self.with_mtp, labels=labels,
                         mtp_labels=mtp_labels(labels) if self.with_mtp else None)
        ce_sum, mtp_sum = out if self.with_mtp else (out, None)
        ce = ce_sum / n_tok
        loss = ce
        parts[0] += ce.detach()
        if mtp_sum is not None:
            mtp = mtp_sum / n_mtp * cfg.mtp.loss_weight
            loss = loss + mtp
            parts[1] += mtp.detach()
        if inject_nan:
            loss = loss * float("nan")
        loss.backward()
        parts[4] += loss.detach()
        self._collect_aux(parts, n_tok)

    def _collect_aux(self, parts: torch.Tensor, n_tok: torch.Tensor | float) -> None:
        """Adds this micro-batch's indexer KL and MoE balance terms (as logged) to ``parts``."""
        cfg, dev = self.cfg, self.device
        kl = sum((a.last_indexer_kl for _, a in attention_modules(self.model_parts)
                  if a.indexer_loss_scale is not None and a.last_indexer_kl is not None), torch.zeros((), device=dev))
        parts[2] += kl * cfg.dsa.indexer_loss_coeff / n_tok
        parts[5] += kl / n_tok
        parts[3] += sum((m.last_seq_aux * m.seq_aux_scale for _, m in moe_modules(self.model_parts)
                         if m.seq_aux_scale is not None and m.last_seq_aux is not None), torch.zeros((), device=dev))
        for _, a in attention_modules(self.model_parts):
            a.last_indexer_kl = None
        for _, m in moe_modules(self.model_parts):
            m.last_seq_aux = None

    # ----------------------------------------------------------------------------------------- pipeline
    def _pp_loss(self, output, labels: torch.Tensor) -> torch.Tensor:
        """Loss of one micro-batch on the last stage, normalised by the step's global token counts."""
        n_tok, n_mtp = self._pp_norm
        ce_sum, mtp_sum = self._last_stage.loss_sums(output, labels, mtp_labels(labels) if self.with_mtp else None)
        ce = ce_sum / n_tok
        loss = ce
        mtp = torch.zeros((), device=ce.device)
        if mtp_sum is not None:
            mtp = mtp_sum / n_mtp * self.cfg.mtp.loss_weight
            loss = loss + mtp
        self._pp_parts.append(torch.stack((ce.detach(), mtp.detach())))
        if self._pp_inject_nan:
            loss = loss * float("nan")
            self._pp_inject_nan = False
        return loss

    def _pp_warmup(self) -> None:
        """One schedule step on a synthetic batch, then every side effect undone.

        The first step of a ``torch.distributed.pipelining`` schedule infers the stages' shapes by running them on
        placeholder tensors; that forward would count MoE loads and auxiliary losses of uninitialised values.
        """
        b, s = self.cfg.training.local_batch_size, self.cfg.training.seq_len
        positions = torch.arange(s).repeat(b, 1)
        batch = {"input_ids": torch.zeros(b, s, dtype=torch.long), "labels": torch.zeros(b, s, dtype=torch.long),
                 "positions": positions}
        self._set_aux_scales(float(b * s), float(b))
        self._pp_norm = (float(b * s), float(b * s))
        self._pp_step(batch, torch.zeros(6, dtype=torch.float64, device=self.device), inject_nan=False)
        for part in self.model_parts:
            part.zero_grad(set_to_none=True)
        with torch.no_grad():
            for _, moe in moe_modules(self.model_parts):
                moe.tokens_per_expert.zero_()
        self._collect_aux(torch.zeros(6, dtype=torch.float64, device=self.device), 1.0)

    def _pp_step(self, batch: dict, parts: torch.Tensor, inject_nan: bool) -> None:
        dev = self.device
        tokens, labels = batch["input_ids"].to(dev, non_blocking=True), batch["labels"].to(dev, non_blocking=True)
        positions = host_to_device(batch["positions"], dev)  # (pinned first: made on the host when not packed)
        self._pp_inject_nan = inject_nan
        self._pp_parts = []
        target = labels if self.has_last else None
        bounds = micro_batch_bounds(positions, batch["positions"], self.schedule._n_microbatches)
        for part in self.model_parts:  # (the stages would otherwise read every micro-batch's bounds off the GPU)
            part.host_bounds = bounds
        try:
            if self.has_first:
                self.schedule.step(tokens, target=target, positions=positions, return_outputs=False)
            else:  # (return_outputs=False: the last stage keeps no micro-batch outputs; the losses are collected above)
                self.schedule.step(target=target, positions=positions, return_outputs=False)
        finally:  # keyed by device addresses, valid while this step's positions are alive
            for part in self.model_parts:
                part.host_bounds = {}
        if self._pp_parts:
            summed = torch.stack(self._pp_parts).sum(0).to(parts.dtype)
            parts[0] += summed[0]
            parts[1] += summed[1]

    @torch.no_grad()
    def _moe_balance(self, apply_update: torch.Tensor) -> dict[str, torch.Tensor]:
        """All-reduces the per-expert token counts, returns each layer's max/mean load (device tensors: no host sync)
        and steps the bias where ``apply_update`` (a bool tensor: False on a skipped step) holds."""
        out = {}
        rate = self.cfg.moe.bias_update_rate
        for name, moe in moe_modules(self.model_parts):
            load = moe.tokens_per_expert.clone()
            if self.dp_world > 1:
                dist.all_reduce(load, group=self.dp_group)
            mean = load.mean()
            out[f"moe/imbalance/{name.removesuffix('.moe')}"] = load.max() / mean.clamp_min(1e-9)
            if rate > 0:
                bias = moe.router.e_score_correction_bias
                bias += (rate * torch.sign(mean - load) * apply_update.to(load.device)).to(bias.dtype)
            moe.tokens_per_expert.zero_()
        return out

    def train(self) -> None:
        """Steps until ``training.steps``. The host queues step N + 1's forward and backward before it reads step N's
        numbers, where step N ``overlaps`` (see ``_launch``), so it stays a step ahead of the GPU."""
        cfg = self.cfg
        total = cfg.training.steps
        self._t_start, self._start_step = time.perf_counter(), self.state.step
        with profiling(cfg.profiling, cfg.job.dump_folder, self.env.rank, self.device,
                       self.state.step) as self._profilers:
            queued = None  # the launched step whose bookkeeping is still to do
            while not self._stop and self.state.step + (queued is not None) < total:
                if queued is not None and not queued.overlaps:
                    self._finish(queued)
                    queued = None
                else:
                    queued = self._launch(self.state.step + 1 + (queued is not None), queued)
            if queued is not None:
                self._finish(queued)
        if cfg.checkpoint.last_save_in_hf and self.state.step == total:
            self.export_hf(os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder, f"step-{self.state.step}-hf"),
                           getattr(torch, cfg.checkpoint.export_dtype))
        self.metrics.close()
        self.checkpointer.close()
        if isinstance(self.dataloader, Prefetcher):
            self.dataloader.close()

    def _launch(self, step: int, prev: _Launched | None) -> _Launched:
        """Queues step ``step``: its batches, forward and backward, the gradient norm, the MoE balance and, with the
        fused step (``fold_clip``: it skips a non-finite step on the device), the update; then one copy of its
        numbers to the host. ``prev``, launched and not finished, is finished after this step's forward and
        backward are queued and before its update, which takes the learning rate that ``prev`` schedules."""
        cfg = self.cfg
        t0 = time.perf_counter()
        reset_peak_memory(self.device)
        batches = [self._next_batch() for _ in range(self.accum)]
        t_data = time.perf_counter()
        marks = _GpuMarks(self.device)
        log = step == 1 or step % cfg.metrics.log_freq == 0 or step == cfg.training.steps
        self._probe_recall(on=step == 1 or step % cfg.metrics.log_freq == 0)
        self._launching = step
        losses = self.train_step(batches)
        t_fb = time.perf_counter()
        marks.record()
        if self.master is not None:  # the gradients are the compute copies' (the Triton step clips)
            grad_norm = total_grad_norm([self.master.grads()], device=self.device)
        else:
            grad_norm = clip_grad_norm_(
                [p for part in self.model_parts for p in part.parameters() if p.requires_grad],
                cfg.training.max_norm, pp_mesh=self.mesh["pp"] if self.pp else None, scale_grads=not self.fold_clip)
        finite = torch.isfinite(losses.parts[4]) & torch.isfinite(grad_norm).to(losses.parts.device)
        moe_stats = self._moe_balance(apply_update=finite)
        recall = [a.last_recall for _, a in attention_modules(self.model_parts) if a.last_recall is not None]
        t_other = time.perf_counter()
        if prev is not None:
            self._finish(prev, later_queued=True)
        t_other = time.perf_counter() - t_other
        memory = {}
        if self.fold_clip:
            with clip_in_fused_step(self.optimizers.optimizers, grad_norm, cfg.training.max_norm, skip=~finite):
                self.optimizers.step()
            memory = self._after_update(marks, log)
        scalars = dict(zip(LOSS_PARTS, losses.parts.unbind()), tokens=losses.tokens, grad_norm=grad_norm,
                       stop=self._stop_flag(), **moe_stats, **memory.pop("device", {}),
                       **({"dsa/topk_recall": recall[0]} if recall else {}))
        return _Launched(step, batches, _Readback(scalars, self.device), marks,
                         after=prev.marks if prev is not None else None, overlaps=self._overlaps(step), log=log,
                         memory=memory, t0=t0, t_data=t_data, t_fb=t_fb, t_end=time.perf_counter(),
                         host_other_s=t_other)

    def _overlaps(self, step: int) -> bool:
        """Whether step ``step + 1`` may be queued before ``step`` is finished: where the update does not wait for
        the step's numbers (``fold_clip``), and not when ``step`` writes a checkpoint (it holds the data loader's
        position, which the next step's batches move on) or is the last."""
        total = self.cfg.training.steps
        return self.fold_clip and step < total and not self.checkpointer._should_save(step, last_step=step == total)

    def _profilers_step(self) -> None:
        """Ends a step's profiler window once all of its work is queued (a trace then holds one step's kernels)."""
        for profiler in self._profilers:
            if profiler is not None:
                profiler.step()

    def _after_update(self, marks: _GpuMarks, log: bool) -> dict:
        """Once a step's update is queued: its end mark, the gradients zeroed, its peak memory (``_memory``) and the
        profilers' step boundary."""
        marks.record()
        self.optimizers.zero_grad()
        if self.master is not None:
            self.master.zero_grad()
        memory = self._memory(log)
        self._profilers_step()
        return memory

    def _memory(self, log: bool) -> dict:
        """The peak memory since the step began (host-side counters: no sync), on log steps; with several ranks also
        the peaks' maximum over the ranks, as device scalars (``"device"``) for the step's read-back."""
        if not log:
            return {}
        mem = memory_stats(self.device)
        if self.env.world_size > 1:
            peak = host_to_device(torch.tensor(list(mem.values()), dtype=torch.float64), self.device)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the fullest rank (pipeline stages differ)
            mem["device"] = {f"{k}_max_over_ranks": v for k, v in zip(mem, peak.unbind())}
        return mem

    def _finish(self, s: _Launched, later_queued: bool = False) -> None:
        """Step ``s``'s host side, once its numbers are on the host: the step counters, the optimizer update where it
        waits for them (foreach / for-loop: skipped on a non-finite loss or norm), the LR schedule, the log line and
        the checkpoint. ``later_queued``: the next step is already queued (then no checkpoint is due here, see
        ``_overlaps``, and a SIGTERM is served after that step)."""
        cfg = self.cfg
        t_start = time.perf_counter()
        vals = s.readback.values()
        losses = {k: vals[k] for k in LOSS_PARTS}
        grad_norm = vals["grad_norm"]
        finite = math.isfinite(losses["total"]) and math.isfinite(grad_norm)
        self.state.step = s.step
        self.state.tokens_seen += int(vals["tokens"])
        if finite:
            if not self.fold_clip:
                self.optimizers.step()
            self.lr_schedulers.step()
            self.state.consecutive_skips = 0
        else:
            self.state.skipped_steps += 1
            self.state.consecutive_skips += 1
            logger.warning("step %d: non-finite loss (%s) or grad norm (%s): step skipped (%d in a row, %d total)",
                           s.step, losses["total"], grad_norm, self.state.consecutive_skips,
                           self.state.skipped_steps)
        if not self.fold_clip:
            s.memory = self._after_update(s.marks, s.log)
            vals.update({k: float(v) for k, v in s.memory.pop("device", {}).items()})
        t_host = (s.t_end - s.t0 - s.host_other_s) + (time.perf_counter() - t_start)
        if self.state.consecutive_skips >= cfg.faults.max_consecutive_nonfinite:
            raise RuntimeError(
                f"stopping: {self.state.consecutive_skips} consecutive steps with a non-finite loss or "
                f"gradient (faults.max_consecutive_nonfinite = {cfg.faults.max_consecutive_nonfinite}); "
                "the last checkpoint was written before the fault and is intact")
        self.gc.run(s.step)  # (after the next step's forward and backward are queued, where they are)
        self._stop = self._stop or vals["stop"] > 0
        if self._stop and not later_queued:  # SIGTERM: a full checkpoint of this step, then leave the loop
            self.checkpointer.save_now(s.step)
        elif finite and not later_queued:  # a skipped (non-finite) step is never checkpointed
            self.checkpointer.save(s.step, last_step=s.step == cfg.training.steps)
        if s.log:
            self._log(s, losses, vals, t_host)

    def _next_batch(self) -> dict:
        batch = next(self.dataloader)
        if self.cfg.data.same_global_batch:  # keep this rank's rows of the global batch
            n = self.cfg.training.local_batch_size
            batch = {k: v[self.dp_rank * n:(self.dp_rank + 1) * n] for k, v in batch.items() if k != "cu_seqlens"}
            batch["cu_seqlens"] = cu_seqlens_from_positions(batch["positions"])
        if not self.cfg.data.document_masking:  # one sequence per row
            b, s = batch["input_ids"].shape
            batch["cu_seqlens"] = torch.arange(0, b * s + 1, s, dtype=torch.int32)
            batch["positions"] = torch.arange(s).repeat(b, 1)
        return batch

    def _probe_recall(self, on: bool) -> None:
        n = self.cfg.dsa.recall_queries if on and self.cfg.dsa.mode == "sparse" else 0
        first = True
        for _, attn in attention_modules(self.model_parts):
            attn.recall_queries = n if (first and attn.indexer is not None) else 0
            attn.last_recall = None
            first = first and attn.indexer is None

    def _log(self, st: _Launched, losses: dict, vals: dict, host_s: float) -> None:
        """One log record of step ``st``. ``time/step_s`` on a GPU: from the end of the step queued before it to its
        own end, as the GPU ran them (idle gaps between them included), when that step was still queued; else its
        data time plus its GPU forward, backward and update. On CPU: the host time of its work (``host_s``)."""
        gpu = st.marks.seconds()
        if gpu is None:
            fb_s = st.t_fb - st.t_data
            step_s = host_s
            opt_s = step_s - (st.t_fb - st.t0)
        else:
            fb_s, opt_s = gpu
            since = st.marks.since(st.after) if st.after is not None else None
            step_s = since if since is not None else (st.t_data - st.t0) + fb_s + opt_s
        # This data-parallel rank's tokens and FLOPs are shared by its pipeline stages' devices.
        devices_per_replica = self.env.world_size // self.dp_world
        doc_lengths = torch.cat([doc_lengths(b["cu_seqlens"]) for b in st.batches])
        flops = step_flops(self.args, doc_lengths, self.with_mtp, sparse=self.cfg.dsa.mode == "sparse",
                           dense_prefix=self.cfg.dsa.dense_prefix, dense_masked_ratio=self.cfg.dsa.dense_masked_ratio)
        flops /= devices_per_replica
        tokens_local = sum(b["input_ids"].numel() for b in st.batches) / devices_per_replica
        s = {"loss/total": losses["total"], "loss/ce": losses["ce"], "lr": self.lr_schedulers.schedulers[0].get_last_lr()[0],
             "grad_norm": vals["grad_norm"], "throughput/tokens_per_s_per_device": tokens_local / step_s,
             "time/step_s": step_s, "time/data_s": st.t_data - st.t0, "time/forward_backward_s": fb_s,
             "time/optimizer_s": opt_s, "faults/skipped_steps": self.state.skipped_steps}
        if self.with_mtp:
            s["loss/mtp"] = losses["mtp"]
        if self.cfg.dsa.indexer_loss_coeff > 0:
            s["loss/indexer_kl"] = losses["indexer_kl"]  # coefficient x KL, as added to the loss
            s["dsa/indexer_kl_per_token"] = losses["kl_per_token"]  # summed over indexer layers
        if self.cfg.moe.seq_aux_loss_coeff > 0:
            s["loss/moe_aux"] = losses["moe_aux"]
        if self.peak:
            s["throughput/mfu_pct"] = 100.0 * flops / step_s / self.peak
        s["throughput/tflops_per_device"] = flops / step_s / 1e12
        s.update({k: v for k, v in vals.items() if k.startswith(("moe/", "dsa/"))})
        s.update(st.memory)
        s.update({f"{k}_max_over_ranks": vals.get(f"{k}_max_over_ranks", v) for k, v in st.memory.items()})
        avg_step_s = (time.perf_counter() - self._t_start) / max(self.state.step - self._start_step, 1)
        eta = avg_step_s * (self.cfg.training.steps - self.state.step)
        self.metrics.log(self.state.step, s, format_line(self.state.step, self.cfg.training.steps, s, eta))

    def export_hf(self, out_dir: str, dtype: torch.dtype) -> None:
        """Writes the model as an HF safetensors directory (published names) that transformers can load.

        Streamed one unit at a time (embedding, each decoder layer, MTP layer, final norm + head; one file each):
        the ranks of a unit's pipeline stage gather its full tensors together and the stage's data-parallel rank 0
        writes them, then rank 0 writes the index and config.json (``hf_export.save_hf_distributed``). Memory: one
        unit's full weights on each stage's writer (host), one full parameter at a time on every device."""
        args = self.args if self.with_mtp else self.args.replace(num_nextn_predict_layers=0)
        save_hf_distributed(self.model_parts, args, out_dir, dtype, writer=self.dp_rank == 0)
        if self.env.rank == 0:
            logger.info("exported HF checkpoint to %s", out_dir)


def main(argv: list[str]) -> None:
    from titan_glm52.config import parse_job_config

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s rank%(rank)s] %(message)s",
                        datefmt="%H:%M:%S")
    rank = os.environ.get("RANK", "0")
    for h in logging.getLogger().handlers:
        h.addFilter(lambda r: setattr(r, "rank", rank) or True)
    cfg = parse_job_config(argv)
    one_process_env()
    trainer = Trainer(cfg)
    try:
        trainer.train()
        if dist.is_initialized():
            dist.barrier()  # nobody tears down (rank 0 hosts the store) while another rank still works
    finally:
        tdist.destroy_distributed()
    # The run is complete and everything is written. Rarely (about 1 in 30 two-process CPU runs here), a C++ thread of
    # the distributed stack aborted during interpreter teardown ("terminate called without an active exception"),
    # turning a finished run into a failure; leave without that teardown.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def log_memory_plan(cfg: JobConfig) -> None:
    """``training.memory_check``: on CUDA, the first process of each node logs the job's planned peak memory per GPU
    beside its GPU's size, as a warning where the plan exceeds it (``memory_plan.job_memory_check``)."""
    if not torch.cuda.is_available() or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    from titan_glm52.memory_plan import GIB, job_memory_check

    gib = torch.cuda.get_device_properties(0).total_memory / GIB
    try:
        fits, line = job_memory_check(cfg, int(os.environ.get("WORLD_SIZE", "1")), gib)
    except Exception as e:  # a job the plan cannot model must still train: say why, and go on
        logger.warning("memory plan: not available for this job (%s: %s); training.memory_check = false skips it",
                       type(e).__name__, e)
        return
    (logger.info if fits else logger.warning)(line)


def one_process_env() -> None:
    """Outside torchrun (plain ``python train.py``): the environment of a one-process group, which keeps one code
    path."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
