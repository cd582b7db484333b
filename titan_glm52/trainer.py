"""The training loop: config -> model -> parallelize -> data -> forward/backward -> optimizer ->
checkpoints.

Device-agnostic: CUDA + NCCL on GPUs (bf16 mixed precision: fp32 master weights, bf16 compute, fp32
gradient reduction; the masters live in FSDP, or on one process in the Triton optimizer:
``master_weights.py``), CPU + gloo elsewhere (fp32 unless ``training.mixed_precision_on_cpu``), same
code. Losses are normalised by the global number of valid tokens: every rank divides its summed
token losses by the count over all data-parallel ranks and all micro-batches of the step, and
gradients are summed across ranks. Under context parallelism the ranks of a CP group read the same
batch and each trains its zigzag part of every sequence (``context_parallel.py``): the count is
still that of the whole sequences, the losses and gradients are summed over the CP ranks too.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.tools.utils import GarbageCollection

from titan_glm52 import distributed as tdist
from titan_glm52.checkpoint import (
    TrainState,
    build_checkpointer,
    export_hf,
    initial_load,
    run_record,
    step_folders,
)
from titan_glm52.context_parallel import CPGroup, next_token_ids, zigzag_split
from titan_glm52.config import (
    ConfigError,
    JobConfig,
    fp8_spec,
    lora_spec,
    model_args,
    model_options,
    resolve_master_weights,
    validate,
)
from titan_glm52.data import IGNORE_INDEX, Prefetcher, build_dataloader, build_tokenizer
from titan_glm52.errors import (
    CheckpointError,
    DataError,
    TrainingStopped,
    UserError,
    report_refusal,
    show_tracebacks,
)
from titan_glm52.fp8_training import is_fp8
from titan_glm52.host_copy import host_to_device
from titan_glm52.lora import init_adapters_, parameter_counts, save_adapter
from titan_glm52.master_weights import MasterWeights
from titan_glm52.memory_check import log_memory_check
from titan_glm52.metrics import (
    MetricsLogger,
    format_line,
    memory_stats,
    peak_flops,
    reset_peak_memory,
)
from titan_glm52.model.aux_loss import AuxTerms
from titan_glm52.model.flops import step_flops
from titan_glm52.model.model import GLM52Model
from titan_glm52.model.moe import MoE
from titan_glm52.optimizer import (
    build_optimizers,
    clip_grad_norm_,
    clip_in_fused_step,
    folds_clip,
    total_grad_norm,
)
from titan_glm52.packed import cu_seqlens_from_positions, doc_lengths, one_document_per_row
from titan_glm52.parallelize import parallelize_model
from titan_glm52.pipeline import build_pipeline_stages, build_schedule, micro_batch_bounds
from titan_glm52.pipeline_split import choose_layout, microbatches, parse_layout
from titan_glm52.profiling import profiling
from titan_glm52.run_lock import OutputLock
from titan_glm52.step import GpuMarks, Launched, Readback, StepLosses, mtp_labels

logger = logging.getLogger("titan_glm52")


def moe_modules(parts) -> list[tuple[str, MoE]]:
    """(name, MoE) of a model or of a list of pipeline model parts."""
    parts = parts if isinstance(parts, (list, tuple)) else [parts]
    return [(name, m) for part in parts for name, m in part.named_modules() if isinstance(m, MoE)]


class Trainer:
    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        if cfg.training.memory_check:
            # before the process group: the plan builds a fake world of its own
            log_memory_check(cfg)
        self.env = tdist.init_distributed()
        self.device = self.env.device
        validate(cfg, self.env.world_size, self.device.type)
        torch.manual_seed(cfg.debug.seed if cfg.debug.seed is not None else 0)
        self.args = model_args(cfg)
        self.options = model_options(cfg, self.device.type)
        self._build_mesh()
        try:
            self.tokenizer = build_tokenizer(cfg.model.hf_assets_path)
        except (OSError, ValueError) as e:
            raise DataError(f"model.hf_assets_path: {e}") from e
        if self.tokenizer.vocab_size > self.args.vocab_size:
            raise ConfigError(
                f"model.hf_assets_path: the tokenizer has {self.tokenizer.vocab_size} tokens but "
                "the "
                f"model's vocab_size is {self.args.vocab_size}; use a matching tokenizer/flavor"
            )
        self.with_mtp = cfg.mtp.enable and self.args.num_nextn_predict_layers > 0
        if cfg.mtp.enable and not self.with_mtp:
            logger.warning(
                "mtp.enable is set but the model args have num_nextn_predict_layers = 0: no MTP "
                "loss"
            )
        self.bf16 = cfg.training.mixed_precision_param == "bfloat16" and (
            self.device.type == "cuda" or cfg.training.mixed_precision_on_cpu
        )
        self.master_mode = resolve_master_weights(cfg, self.env.world_size, self.bf16)
        self.lora = lora_spec(cfg, torch.bfloat16 if self.bf16 else torch.float32)
        self.fp8 = fp8_spec(cfg)
        if self.fp8 is not None and self.device.type == "cuda":
            cap = torch.cuda.get_device_capability(self.device)
            if cap[0] < 9:
                raise ConfigError(
                    f"model.converters: FP8 training runs cuBLAS's block-scaled FP8 GEMMs, which "
                    f"need a Hopper-class GPU (sm_90 or later); this one is sm_{cap[0]}{cap[1]}: "
                    "remove the FP8 converters"
                )
            if self.fp8.expert_fqns and self.fp8.expert_recipe == "rowwise":
                try:
                    import torchao.prototype.moe_training.fp8_grouped_mm  # noqa: F401
                except ImportError as e:
                    raise ConfigError(
                        "quantize.grouped_mm.float8.recipe_name: 'rowwise' runs torchao's FP8 "
                        f"grouped GEMM, which does not import here ({e}); pip install "
                        "torchao==0.18.0, or use 'blockwise'"
                    ) from None
        self._build_model()
        self._build_data()
        self._build_optimizer()
        self.state = TrainState()
        self._launching = 0  # the step being queued (``_launch``)
        self.checkpointer = build_checkpointer(
            cfg,
            self.model_parts,
            self.optimizers,
            self.lr_schedulers,
            self.dataloader,
            self.state,
            self._run_record(),
            trainable_only=self.lora is not None,
        )
        # With LoRA a checkpoint holds the adapters only: the base is loaded at every start.
        if self.lora is not None and cfg.checkpoint.initial_load_path:
            self._initial_load()
        resumed = self.checkpointer.load(step=cfg.checkpoint.load_step)
        if not resumed and cfg.checkpoint.initial_load_path and self.lora is None:
            self._initial_load()
        self._last_loss: float | None = None
        self.metrics = MetricsLogger(
            os.path.join(cfg.job.dump_folder, cfg.metrics.save_tb_folder)
            if cfg.metrics.enable_tensorboard
            else None,
            os.path.join(cfg.job.dump_folder, "metrics.jsonl"),
            enabled=self.env.rank == 0,
        )
        self.peak = peak_flops(self.device)
        # torchtitan's: Python's automatic garbage collection off, generation 1 every
        # training.gc_freq steps.
        self.gc = GarbageCollection(gc_freq=cfg.training.gc_freq, debug=cfg.training.gc_debug)
        # SIGTERM sets _sigterm on the ranks it reaches; every step carries the maximum over all
        # ranks back with its numbers, and _stop (the loop's test) is set from that, so all ranks
        # stop after the same step.
        self._sigterm = self._stop = False
        signal.signal(signal.SIGTERM, self._on_sigterm)
        # Ctrl-C: the same checkpoint, then a clean exit
        signal.signal(signal.SIGINT, self._on_sigterm)
        logger.info(
            "model %s: %s params (%s active/token), layers %d (IndexShare %s), MTP %s, DSA %s/%s, "
            "world %d (dp %d, cp %d), accum %d, mixed precision: %s",
            cfg.model.hf_config or cfg.model.flavor,
            f"{self.args.num_params(self.with_mtp):,}",
            f"{self.args.num_active_params():,}",
            self.args.num_hidden_layers,
            self.args.index_share.pattern,
            self.with_mtp,
            self.options.dsa_backend,
            cfg.dsa.mode,
            self.env.world_size,
            self.dp_world,
            self.cp.size if self.cp is not None else 1,
            self.accum,
            "bf16, fp32 masters in the optimizer"
            if self.master is not None
            else "bf16, fp32 masters in FSDP"
            if self.bf16
            else "off (fp32)",
        )

    # -----------------------------------------------------------------------------------------
    # setup
    def _initial_load(self) -> None:
        path = self.cfg.checkpoint.initial_load_path
        try:
            initial_load(
                self.model_parts, path, self.cfg.checkpoint.initial_load_in_hf, pipelined=self.pp
            )
        except (OSError, KeyError, ValueError) as e:
            raise CheckpointError(f"checkpoint.initial_load_path {path}: {e}") from e

    def _build_mesh(self) -> None:
        p = self.cfg.parallelism
        try:
            self.mesh = tdist.build_mesh(
                self.env.world_size,
                dp_replicate=p.data_parallel_replicate_degree,
                dp_shard=p.data_parallel_shard_degree,
                ep=p.expert_parallel_degree,
                pp=p.pipeline_parallel_degree,
                device_type=self.device.type,
                n_routed_experts=self.args.n_routed_experts,
                cp=p.context_parallel_degree,
            )
        except ValueError as e:
            raise ConfigError(str(e)) from e
        dp_mesh = self.mesh["dp"]
        self.dp_rank, self.dp_world = dp_mesh.get_local_rank(), dp_mesh.size()
        self.dp_group = dp_mesh.get_group()
        # the ranks whose losses and expert loads add up (data- and context-parallel)
        self.stage_group, self.stage_world = (
            self.mesh["dp_cp"].get_group(),
            self.mesh["dp_cp"].size(),
        )
        self.cp = CPGroup.of(self.mesh["cp"].get_group()) if self.mesh.cp_enabled else None
        self.pp = p.pipeline_parallel_degree > 1

    def _build_model(self) -> None:
        """The model (or this rank's pipeline stages) on meta, parallelized, then materialised and
        initialised."""
        cfg, p = self.cfg, self.cfg.parallelism
        if self.pp:
            layout = (
                parse_layout(p.pipeline_parallel_layout) if p.pipeline_parallel_layout else None
            )
            try:
                self.layout = choose_layout(
                    self.args,
                    p.pipeline_parallel_schedule,
                    p.pipeline_parallel_degree,
                    p.pipeline_parallel_stages_per_rank,
                    seq_len=cfg.training.seq_len,
                    layers_per_stage=layout,
                    with_mtp=self.with_mtp,
                )
            except ValueError as e:
                raise ConfigError(f"parallelism.pipeline_parallel_layout / _schedule: {e}") from e
            pp_mesh = self.mesh["pp"]
            stages, self.model_parts = build_pipeline_stages(
                self.args,
                self.layout,
                pp_mesh.get_local_rank(),
                pp_mesh.get_group(),
                self.device,
                self.options,
                self._parallelize,
            )
            self.has_first = any(m.spec.embedding for m in self.model_parts)
            self.has_last = any(m.spec.head for m in self.model_parts)
            self._last_stage = next((m for m in self.model_parts if m.spec.head), None)
            n_micro = microbatches(
                cfg.training.local_batch_size, p.pipeline_parallel_microbatch_size
            )
            self.schedule = build_schedule(
                stages,
                p.pipeline_parallel_schedule,
                n_micro,
                self._pp_loss,
                context_parallel=self.cp is not None,
            )
            self._pp_losses: list[torch.Tensor] = []
        else:
            with torch.device("meta"):
                model = GLM52Model(self.args, self.options, with_mtp=self.with_mtp)
            self.model_parts = [self._parallelize(model)]
        if self.fp8 is not None:  # on the meta device still: a refusal comes before any work
            self._log_fp8()
        for part in self.model_parts:
            part.to_empty(device=self.device)
            with torch.no_grad():
                part.init_weights()
            if self.lora is not None:
                init_adapters_(part)
            part.train()
        self.model = self.model_parts[0]
        if self.lora is not None:
            self._log_lora_counts()
        if self.pp:
            self._pp_warmup()

    def _parallelize(self, model: GLM52Model) -> GLM52Model:
        """EP -> compile -> AC -> FSDP on a meta-device model (or stage)."""
        cfg, p = self.cfg, self.cfg.parallelism
        # Under master_weights = "optimizer" the model stays fp32 here (no FSDP); MasterWeights adds
        # the bf16 copies.
        fsdp_bf16 = self.bf16 and self.master_mode == "fsdp"
        return parallelize_model(
            model,
            self.mesh,
            param_dtype=torch.bfloat16 if fsdp_bf16 else torch.float32,
            reduce_dtype=torch.float32,
            reshard_after_forward=p.fsdp_reshard_after_forward,
            ac_mode=cfg.activation_checkpoint.mode,
            selective_ac_option=cfg.activation_checkpoint.selective_ac_option,
            compile=cfg.compile.enable,
            compile_backend=cfg.compile.backend,
            ep_enabled=p.expert_parallel_degree > 1,
            lora=self.lora,
            fp8=self.fp8,
        )

    def _run_record(self) -> dict:
        p = self.cfg.parallelism
        layout = dict(
            world=self.env.world_size,
            pp=p.pipeline_parallel_degree,
            ep=p.expert_parallel_degree,
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree,
        )
        data_world = 1 if self.cfg.data.same_global_batch else self.dp_world
        record = run_record(
            self.args, self.with_mtp, data_world, self.cfg.data.seed, layout, self.data_format
        )
        record["lora"] = (
            None
            if self.lora is None
            else dict(
                rank=self.lora.rank,
                alpha=self.lora.alpha,
                targets=sorted(self.lora.target_modules),
                rslora=self.lora.use_rslora,
            )
        )
        return record

    def _build_data(self) -> None:
        cfg, same = self.cfg, self.cfg.data.same_global_batch
        try:
            self.dataloader = build_dataloader(
                self.tokenizer,
                cfg.training.dataset,
                cfg.training.seq_len,
                cfg.training.local_batch_size * (self.dp_world if same else 1),
                dp_rank=0 if same else self.dp_rank,
                dp_world=1 if same else self.dp_world,
                seed=cfg.data.seed,
                text_field=cfg.data.text_field,
                format=cfg.data.format,
                messages_field=cfg.data.messages_field,
                tools_field=cfg.data.tools_field,
                chat_template=cfg.data.chat_template or None,
                train_on=cfg.data.train_on,
                overflow=cfg.data.chat_overflow,
                end_of_turn=cfg.data.end_of_turn,
            )
        except (OSError, ValueError) as e:
            raise DataError(f"training.dataset {cfg.training.dataset!r}: {e}") from e
        self.data_format = self.dataloader.format  # "text" or "chat" ("auto" resolved)
        # pinned batches: the copies to the GPU below do not wait for the host
        if cfg.data.prefetch > 0:
            self.dataloader = Prefetcher(
                self.dataloader, cfg.data.prefetch, pin_memory=self.device.type == "cuda"
            )
        per_step = cfg.training.local_batch_size * self.dp_world
        self.accum = (
            max(cfg.training.global_batch_size // per_step, 1)
            if cfg.training.global_batch_size > 0
            else 1
        )

    def _build_optimizer(self) -> None:
        cfg = self.cfg
        self.master = None
        if self.master_mode == "optimizer":
            if self.bf16:
                self.master = MasterWeights(
                    self.model_parts, torch.bfloat16, accumulate=self.accum > 1
                )
            else:
                logger.info(
                    "training.master_weights = 'optimizer': the model computes in fp32 on CPU (see "
                    "training.mixed_precision_on_cpu), so there are no bf16 copies to keep"
                )
        self.optimizers = build_optimizers(self.model_parts, cfg.optimizer, self.master)
        # Fused / Triton Adam(W): the gradient clip is applied inside the optimizer kernel
        # (clip_in_fused_step), which saves a separate pass over all gradients; foreach / for-loop
        # clip the gradients in place.
        self.fold_clip = folds_clip(self.optimizers.optimizers)
        self.lr_schedulers = build_lr_schedulers(
            self.optimizers, cfg.lr_scheduler, cfg.training.steps
        )

    def _on_sigterm(self, signum, frame) -> None:
        logger.warning(
            "%s: saving a checkpoint within two steps (at the same step on every rank), then "
            "stopping",
            signal.Signals(signum).name,
        )
        self._sigterm = True

    def _stop_flag(self) -> torch.Tensor:
        """1.0 where SIGTERM has reached any rank (all ranks), as a device scalar; no host sync."""
        flag = host_to_device(torch.tensor([float(self._sigterm)]), self.device)
        if self.env.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag[0]

    # ------------------------------------------------------------------------------------- one step
    def train_step(
        self, batches: list[dict], recall_queries: int = 0
    ) -> tuple[StepLosses, AuxTerms, torch.Tensor]:
        """Forward and backward of the step's micro-batches: (its losses summed over ranks, its
        auxiliary terms, the global valid-token count in fp64)."""
        n_tok, n_mtp, n_seq, tokens = self._global_counts(batches)
        aux = AuxTerms(tokens=n_tok, sequences=n_seq, recall_queries=recall_queries)
        losses = StepLosses.zeros(self.device)
        with self.master.computing() if self.master is not None else contextlib.nullcontext():
            for i, b in enumerate(batches):
                inject_nan = self._launching in self.cfg.faults.inject_nan_at_steps and i == 0
                if self.pp:
                    self._pp_step(b, losses, aux, n_tok, n_mtp, inject_nan)
                else:
                    self._micro_step(b, losses, aux, n_tok, n_mtp, inject_nan)
        kl = aux.indexer_kl_sum()
        if kl is not None:
            losses.indexer_kl = losses.indexer_kl + kl * self.cfg.dsa.indexer_loss_coeff / n_tok
            losses.kl_per_token = losses.kl_per_token + kl / n_tok
        if aux.seq_aux is not None:
            losses.moe_aux = losses.moe_aux + aux.seq_aux
        pp_group = self.mesh["pp"].get_group() if self.pp else None
        # the loss lives on the last stage: share it with every stage (each part counted once)
        if self.pp:
            losses.all_reduce(pp_group, ("ce", "mtp"))
            losses.total = losses.ce + losses.mtp
        if self.stage_world > 1:
            losses.all_reduce(self.stage_group)
        if self.pp:  # aux terms live on the stage of their layer
            losses.all_reduce(pp_group, ("indexer_kl", "moe_aux", "kl_per_token"))
        losses.total = losses.total + (losses.indexer_kl + losses.moe_aux)
        return losses, aux, tokens

    def _global_counts(
        self, batches: list[dict]
    ) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]:
        """The step's valid tokens and valid MTP tokens summed over the data-parallel ranks (fp32
        device scalars, at least 1: the loss normalisers), its sequences (every rank trains
        ``local_batch_size`` per micro-batch) and the valid tokens again in fp64 (exact, for the
        count of tokens seen). Counted on the whole sequences, which every rank of a CP group
        holds, so the CP ranks need no sum. Counted on the host, where the loader's batches are, and
        sent to the device without a sync: several ranks sum them there, and no rank waits for the
        device before queuing the step's forward."""
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
        sequences = float(sum(b["labels"].shape[0] for b in batches) * self.dp_world)
        return norm[0], norm[1], sequences, counts[0]

    def _micro_step(
        self,
        b: dict,
        losses: StepLosses,
        aux: AuxTerms,
        n_tok: torch.Tensor,
        n_mtp: torch.Tensor,
        inject_nan: bool,
    ) -> None:
        """Forward and backward of one micro-batch; adds its losses to ``losses``."""
        local = self._rank_inputs(b)
        # cu_seqlens goes as a host list (a tensor argument would be copied to the GPU by FSDP's
        # root, blocking): the model reads its bounds on the host and copies it over itself without
        # a sync.
        out = self.model(
            local["input_ids"],
            b["cu_seqlens"].tolist(),
            with_mtp=self.with_mtp,
            labels=local["labels"],
            mtp_labels=local.get("mtp_labels"),
            aux=aux,
            **({"cp": self.cp, "next_tokens": local["next_tokens"]} if self.cp else {}),
        )
        ce_sum, mtp_sum = out if self.with_mtp else (out, None)
        ce = ce_sum / n_tok
        loss = ce
        losses.ce = losses.ce + ce.detach()
        if mtp_sum is not None:
            mtp = mtp_sum / n_mtp * self.cfg.mtp.loss_weight
            loss = loss + mtp
            losses.mtp = losses.mtp + mtp.detach()
        if inject_nan:
            loss = loss * float("nan")
        loss.backward()
        losses.total = losses.total + loss.detach()

    def _rank_inputs(self, b: dict) -> dict[str, torch.Tensor]:
        """This rank's device tensors of a micro-batch: its token ids, labels and (with MTP) MTP
        labels; under context parallelism the zigzag part of each sequence, and the ids after each
        position (the MTP layer's next tokens), formed on the whole sequences before the split. Made
        on the device from the batch's (pinned) copies: no host sync."""
        dev = self.device
        ids = b["input_ids"].to(dev, non_blocking=True)
        labels = b["labels"].to(dev, non_blocking=True)
        out = {"input_ids": ids, "labels": labels}
        if self.with_mtp:
            out["mtp_labels"] = mtp_labels(labels)
        if self.cp is None:
            return out
        out["next_tokens"] = next_token_ids(ids)
        return {k: zigzag_split(v, self.cp.size, self.cp.rank) for k, v in out.items()}

    # -----------------------------------------------------------------------------------------
    # pipeline
    def _pp_loss(self, output, labels: torch.Tensor) -> torch.Tensor:
        """Loss of one micro-batch on the last stage, normalised by the step's global token
        counts. With MTP ``labels [mb, S, 2]`` hold the main and the MTP labels (the latter cannot
        be formed from a CP rank's part of the sequence)."""
        n_tok, n_mtp = self._pp_norm
        labels, mtp = labels.unbind(-1) if labels.dim() == 3 else (labels, None)
        ce_sum, mtp_sum = self._last_stage.loss_sums(output, labels, mtp)
        ce = ce_sum / n_tok
        loss = ce
        mtp = torch.zeros((), device=ce.device)
        if mtp_sum is not None:
            mtp = mtp_sum / n_mtp * self.cfg.mtp.loss_weight
            loss = loss + mtp
        self._pp_losses.append(torch.stack((ce.detach(), mtp.detach())))
        if self._pp_inject_nan:
            loss = loss * float("nan")
            self._pp_inject_nan = False
        return loss

    def _pp_warmup(self) -> None:
        """One schedule step on a synthetic batch, then its side effects undone.

        The first step of a ``torch.distributed.pipelining`` schedule infers the stages' shapes by
        running them on placeholder tensors; that forward would count MoE loads of uninitialised
        values (its auxiliary terms go to an ``AuxTerms`` of its own, dropped here).
        """
        b, s = self.cfg.training.local_batch_size, self.cfg.training.seq_len
        _, positions = one_document_per_row(b, s)
        batch = {
            "input_ids": torch.zeros(b, s, dtype=torch.long),
            "labels": torch.zeros(b, s, dtype=torch.long),
            "positions": positions,
        }
        n = float(b * s)
        self._pp_step(
            batch,
            StepLosses.zeros(self.device),
            AuxTerms(tokens=n, sequences=float(b)),
            n,
            n,
            False,
        )
        for part in self.model_parts:
            part.zero_grad(set_to_none=True)
        with torch.no_grad():
            for _, moe in moe_modules(self.model_parts):
                moe.tokens_per_expert.zero_()

    def _pp_step(
        self, batch: dict, losses: StepLosses, aux: AuxTerms, n_tok, n_mtp, inject_nan: bool
    ) -> None:
        dev = self.device
        local = self._rank_inputs(batch)
        tokens, labels = local["input_ids"], local["labels"]
        if self.with_mtp:
            labels = torch.stack((labels, local["mtp_labels"]), dim=-1)
        # (pinned first: made on the host when not packed)
        positions = host_to_device(batch["positions"], dev)
        self._pp_norm = (n_tok, n_mtp)
        self._pp_inject_nan = inject_nan
        self._pp_losses = []
        # Every micro-batch's document bounds, read here on the host (the stages would otherwise
        # read them back from the GPU); keyed by the device chunk of positions the schedule passes.
        bounds = micro_batch_bounds(positions, batch["positions"], self.schedule._n_microbatches)
        kwargs = dict(
            target=labels if self.has_last else None,
            positions=positions,
            aux=aux,
            bounds=bounds,
            # (the last stage keeps no micro-batch outputs: losses are collected)
            return_outputs=False,
            **({"cp": self.cp, "next_tokens": local["next_tokens"]} if self.cp else {}),
        )
        if self.has_first:
            self.schedule.step(tokens, **kwargs)
        else:
            self.schedule.step(**kwargs)
        if self._pp_losses:
            summed = torch.stack(self._pp_losses).sum(0).to(torch.float64)
            losses.ce = losses.ce + summed[0]
            losses.mtp = losses.mtp + summed[1]

    @torch.no_grad()
    def _moe_balance(self, apply_update: torch.Tensor) -> dict[str, torch.Tensor]:
        """All-reduces the per-expert token counts, returns each layer's max/mean load (device
        tensors: no host sync) and steps the bias where ``apply_update`` (a bool tensor: False on a
        skipped step) holds."""
        out = {}
        rate = self.cfg.moe.bias_update_rate
        for name, moe in moe_modules(self.model_parts):
            load = moe.tokens_per_expert.clone()
            if self.stage_world > 1:
                dist.all_reduce(load, group=self.stage_group)
            mean = load.mean()
            out[f"moe/imbalance/{name.removesuffix('.moe')}"] = load.max() / mean.clamp_min(1e-9)
            if rate > 0:
                bias = moe.router.e_score_correction_bias
                bias += (rate * torch.sign(mean - load) * apply_update.to(load.device)).to(
                    bias.dtype
                )
            moe.tokens_per_expert.zero_()
        return out

    # ------------------------------------------------------------------------------------- the loop
    def train(self) -> None:
        """Steps until ``training.steps``, then one summary line. The host queues step N + 1's
        forward and backward before it reads step N's numbers, where step N ``overlaps`` (see
        ``_launch``), so it stays a step ahead of the GPU."""
        cfg = self.cfg
        total = cfg.training.steps
        self._t_start, self._start_step = time.perf_counter(), self.state.step
        if self.state.step >= total:
            if self.env.rank == 0:
                logger.info(
                    "the checkpoint in %s is at step %d, training.steps is %d: nothing left to "
                    "train "
                    "(raise --training.steps to train on)",
                    os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder),
                    self.state.step,
                    total,
                )
            self._close()
            return
        with profiling(
            cfg.profiling, cfg.job.dump_folder, self.env.rank, self.device, self.state.step
        ) as self._profilers:
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
            out_dir = os.path.join(
                cfg.job.dump_folder, cfg.checkpoint.folder, f"step-{self.state.step}-hf"
            )
            export_hf(
                self.model_parts,
                self.args,
                self.with_mtp,
                out_dir,
                getattr(torch, cfg.checkpoint.export_dtype),
                writer=self.dp_rank == 0 and (self.cp is None or self.cp.rank == 0),
            )
            if self.env.rank == 0:
                logger.info("exported HF checkpoint to %s", out_dir)
        if self.lora is not None and self.state.step == total:
            self._save_adapter(self.state.step)
        self._close()
        if self.env.rank == 0:
            logger.info(self._summary(time.perf_counter() - self._t_start))

    def _summary(self, seconds: float) -> str:
        """One line: what the run did and where its outputs went."""
        cfg, steps = self.cfg, self.state.step - self._start_step
        folder = os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder)
        saved = (
            [os.path.basename(p) for _, p in step_folders(folder)] if cfg.checkpoint.enable else []
        )
        parts = [
            f"run summary: {steps} steps ({self._start_step + 1}-{self.state.step} of "
            f"{cfg.training.steps})"
            f" in {seconds:.1f} s"
            if steps
            else "run summary: no step trained",
            f"final loss {self._last_loss:.4f}" if self._last_loss is not None else "",
            "stopped by a signal" if self._stop else "",
            f"checkpoints {folder} ({', '.join(saved)})" if saved else "no checkpoint written",
            f"TensorBoard {os.path.join(cfg.job.dump_folder, cfg.metrics.save_tb_folder)}"
            if cfg.metrics.enable_tensorboard
            else "",
            f"metrics {os.path.join(cfg.job.dump_folder, 'metrics.jsonl')}",
        ]
        hf = os.path.join(folder, f"step-{self.state.step}-hf")
        if cfg.checkpoint.last_save_in_hf and os.path.isdir(hf):
            parts.append(f"HF export {hf}")
        return "; ".join(p for p in parts if p)

    def _close(self) -> None:
        self.metrics.close()
        self.checkpointer.close()
        if isinstance(self.dataloader, Prefetcher):
            self.dataloader.close()

    def _launch(self, step: int, prev: Launched | None) -> Launched:
        """Queues step ``step``: its batches, forward and backward, the gradient norm, the MoE
        balance and, with the fused step (``fold_clip``: it skips a non-finite step on the device),
        the update; then one copy of its numbers to the host. ``prev``, launched and not finished,
        is finished after this step's forward and backward are queued and before its update, which
        takes the learning rate that ``prev`` schedules."""
        cfg = self.cfg
        t0 = time.perf_counter()
        reset_peak_memory(self.device)
        batches = [self._next_batch() for _ in range(self.accum)]
        t_data = time.perf_counter()
        marks = GpuMarks(self.device)
        log = step == 1 or step % cfg.metrics.log_freq == 0 or step == cfg.training.steps
        probe = (step == 1 or step % cfg.metrics.log_freq == 0) and cfg.dsa.mode == "sparse"
        self._launching = step
        losses, aux, tokens = self.train_step(
            batches, recall_queries=cfg.dsa.recall_queries if probe else 0
        )
        t_fb = time.perf_counter()
        marks.record()
        if self.master is not None:  # the gradients are the compute copies' (the Triton step clips)
            grad_norm = total_grad_norm([self.master.grads()], device=self.device)
        else:
            grad_norm = clip_grad_norm_(
                [p for part in self.model_parts for p in part.parameters() if p.requires_grad],
                cfg.training.max_norm,
                pp_mesh=self.mesh["pp"] if self.pp else None,
                scale_grads=not self.fold_clip,
            )
        finite = torch.isfinite(losses.total) & torch.isfinite(grad_norm).to(losses.total.device)
        moe_stats = self._moe_balance(apply_update=finite)
        t_other = time.perf_counter()
        if prev is not None:
            self._finish(prev, later_queued=True)
        t_other = time.perf_counter() - t_other
        memory = {}
        if self.fold_clip:
            with clip_in_fused_step(
                self.optimizers.optimizers, grad_norm, cfg.training.max_norm, skip=~finite
            ):
                self.optimizers.step()
            memory = self._after_update(marks, log)
        scalars = dict(
            losses.scalars(),
            tokens=tokens,
            grad_norm=grad_norm,
            stop=self._stop_flag(),
            **moe_stats,
            **memory.pop("device", {}),
            **({"dsa/topk_recall": aux.recall} if aux.recall is not None else {}),
        )
        return Launched(
            step,
            batches,
            Readback(scalars, self.device),
            marks,
            after=prev.marks if prev is not None else None,
            overlaps=self._overlaps(step),
            log=log,
            memory=memory,
            t0=t0,
            t_data=t_data,
            t_fb=t_fb,
            t_end=time.perf_counter(),
            host_other_s=t_other,
        )

    def _overlaps(self, step: int) -> bool:
        """Whether step ``step + 1`` may be queued before ``step`` is finished: where the update
        does not wait for the step's numbers (``fold_clip``), and not when ``step`` writes a
        checkpoint (it holds the data loader's position, which the next step's batches move on) or
        is the last."""
        total = self.cfg.training.steps
        return (
            self.fold_clip
            and step < total
            and not self.checkpointer._should_save(step, last_step=step == total)
        )

    def _profilers_step(self) -> None:
        """Ends a step's profiler window once all of its work is queued (a trace then holds one
        step's kernels)."""
        for profiler in self._profilers:
            if profiler is not None:
                profiler.step()

    def _after_update(self, marks: GpuMarks, log: bool) -> dict:
        """Once a step's update is queued: its end mark, the gradients zeroed, its peak memory
        (``_memory``) and the profilers' step boundary."""
        marks.record()
        self.optimizers.zero_grad()
        if self.master is not None:
            self.master.zero_grad()
        memory = self._memory(log)
        self._profilers_step()
        return memory

    def _memory(self, log: bool) -> dict:
        """The peak memory since the step began (host-side counters: no sync), on log steps; with
        several ranks also the peaks' maximum over the ranks, as device scalars (``"device"``) for
        the step's read-back."""
        if not log:
            return {}
        mem = memory_stats(self.device)
        if self.env.world_size > 1:
            peak = host_to_device(
                torch.tensor(list(mem.values()), dtype=torch.float64), self.device
            )
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the fullest rank (pipeline stages differ)
            mem["device"] = {f"{k}_max_over_ranks": v for k, v in zip(mem, peak.unbind())}
        return mem

    def _finish(self, s: Launched, later_queued: bool = False) -> None:
        """Step ``s``'s host side, once its numbers are on the host: the step counters, the
        optimizer update where it waits for them (foreach / for-loop: skipped on a non-finite loss
        or norm), the LR schedule, the log line and the checkpoint. ``later_queued``: the next step
        is already queued (then no checkpoint is due here, see ``_overlaps``, and a SIGTERM is
        served after that step)."""
        cfg = self.cfg
        t_start = time.perf_counter()
        vals = s.readback.values()
        grad_norm = vals["grad_norm"]
        finite = math.isfinite(vals["total"]) and math.isfinite(grad_norm)
        self._last_loss = vals["total"]
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
            logger.warning(
                "step %d: non-finite loss (%s) or grad norm (%s): step skipped (%d in a row, %d "
                "total)",
                s.step,
                vals["total"],
                grad_norm,
                self.state.consecutive_skips,
                self.state.skipped_steps,
            )
        if not self.fold_clip:
            s.memory = self._after_update(s.marks, s.log)
            vals.update({k: float(v) for k, v in s.memory.pop("device", {}).items()})
        t_host = (s.t_end - s.t0 - s.host_other_s) + (time.perf_counter() - t_start)
        if self.state.consecutive_skips >= cfg.faults.max_consecutive_nonfinite:
            raise TrainingStopped(
                f"stopping: {self.state.consecutive_skips} consecutive steps with a non-finite "
                "loss or "
                f"gradient (faults.max_consecutive_nonfinite = "
                f"{cfg.faults.max_consecutive_nonfinite}); "
                "the last checkpoint was written before the fault and is intact"
            )
        # (after the next step's forward and backward are queued, where they are)
        self.gc.run(s.step)
        self._stop = self._stop or vals["stop"] > 0
        # SIGTERM: a full checkpoint of this step, then leave the loop
        if self._stop and not later_queued:
            self.checkpointer.save_now(s.step)
        elif finite and not later_queued:  # a skipped (non-finite) step is never checkpointed
            last = s.step == cfg.training.steps
            due = self.checkpointer._should_save(s.step, last_step=last)
            self.checkpointer.save(s.step, last_step=last)
            # (the last step's adapter is written at the end of ``train``)
            if due and not last and self.lora is not None and cfg.lora.save_at_checkpoints:
                self._save_adapter(s.step)
        if s.log:
            self._log(s, vals, t_host)

    def _log_fp8(self) -> None:
        """Which products run in FP8 (this rank's model parts), and which linears stay bf16; none
        in FP8 is refused (the model's widths are not in multiples of 128, or 16 for torchao's
        recipes)."""
        fp8 = [n for part in self.model_parts for n, m in part.named_modules() if is_fp8(m)]
        if not fp8:
            raise ConfigError(
                "model.converters: no product of this model runs in FP8: a linear needs both "
                "dimensions in multiples of 128 (16 with torchao's recipes) and a name outside "
                "quantize.linear.float8.filter_fqns; remove the FP8 converters"
            )
        if self.env.rank:
            return
        kept = sorted(
            {
                ".".join(n.split(".")[-2:]).removeprefix("attention.")
                for part in self.model_parts
                for n, m in part.named_modules()
                if isinstance(m, torch.nn.Linear) and not is_fp8(m)
            }
        )
        logger.info(
            "FP8 (%s; experts %s): %d linears and %d routed-expert modules of this rank's model "
            "parts run their products in FP8; bf16: %s",
            self.fp8.recipe,
            self.fp8.expert_recipe,
            sum(1 for n in fp8 if not n.endswith("experts")),
            sum(1 for n in fp8 if n.endswith("experts")),
            ", ".join(kept) or "none",
        )

    # ----------------------------------------------------------------------------------------- LoRA
    def _log_lora_counts(self) -> None:
        """The trainable and frozen parameter counts, and what the frozen ones no longer cost."""
        counts = parameter_counts(self.model_parts)
        if self.pp:  # each stage counts its own parameters
            t = host_to_device(
                torch.tensor(list(counts.values()), dtype=torch.float64), self.device
            )
            dist.all_reduce(t, group=self.mesh["pp"].get_group())
            counts = dict(zip(counts, (int(v) for v in t.tolist())))
        if self.env.rank == 0:
            logger.info(
                "LoRA r=%d on %s: %s trainable parameters (%.4f%%), %s frozen (no gradient, no "
                "optimizer state, no fp32 master)",
                self.lora.rank,
                ",".join(self.lora.target_modules),
                f"{counts['trainable']:,}",
                100.0 * counts["trainable"] / max(sum(counts.values()), 1),
                f"{counts['frozen']:,}",
            )

    def _save_adapter(self, step: int) -> None:
        """The adapters of step ``step`` in PEFT's format, in ``<dump_folder>/adapters/step-N``."""
        cfg = self.cfg
        out_dir = os.path.join(cfg.job.dump_folder, "adapters", f"step-{step}")
        save_adapter(
            self.model_parts,
            self.lora,
            self.args,
            out_dir,
            writer=self.dp_rank == 0,
            base_model_name_or_path=cfg.lora.base_model_name_or_path
            or cfg.checkpoint.initial_load_path,
        )
        if self.env.rank == 0:
            logger.info("wrote the LoRA adapter (PEFT format) to %s", out_dir)

    def _next_batch(self) -> dict:
        try:
            batch = next(self.dataloader)
        except (OSError, ValueError) as e:  # a row the data options refuse (chat_overflow "error")
            raise DataError(f"training.dataset {self.cfg.training.dataset!r}: {e}") from e
        if self.cfg.data.same_global_batch:  # keep this rank's rows of the global batch
            n = self.cfg.training.local_batch_size
            batch = {
                k: v[self.dp_rank * n : (self.dp_rank + 1) * n]
                for k, v in batch.items()
                if k != "cu_seqlens"
            }
            batch["cu_seqlens"] = cu_seqlens_from_positions(batch["positions"])
        if not self.cfg.data.document_masking:  # one sequence per row
            batch["cu_seqlens"], batch["positions"] = one_document_per_row(
                *batch["input_ids"].shape
            )
        return batch

    def _log(self, st: Launched, vals: dict, host_s: float) -> None:
        """One log record of step ``st``. ``time/step_s`` on a GPU: from the end of the step queued
        before it to its own end, as the GPU ran them (idle gaps between them included), when that
        step was still queued; else its data time plus its GPU forward, backward and update. On CPU:
        the host time of its work (``host_s``)."""
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
        lengths = torch.cat([doc_lengths(b["cu_seqlens"]) for b in st.batches])
        flops = step_flops(
            self.args,
            lengths,
            self.with_mtp,
            sparse=self.cfg.dsa.mode == "sparse",
            dense_prefix=self.options.dense_prefix,
            dense_masked_ratio=self.cfg.dsa.dense_masked_ratio,
            indexer_kl=self.cfg.dsa.indexer_loss_coeff > 0,
            kl_in_sparse=self.options.dsa_backend == "triton",
        )
        flops /= devices_per_replica
        tokens_local = sum(b["input_ids"].numel() for b in st.batches) / devices_per_replica
        s = {
            "loss/total": vals["total"],
            "loss/ce": vals["ce"],
            "lr": self.lr_schedulers.schedulers[0].get_last_lr()[0],
            "grad_norm": vals["grad_norm"],
            "throughput/tokens_per_s_per_device": tokens_local / step_s,
            "time/step_s": step_s,
            "time/data_s": st.t_data - st.t0,
            "time/forward_backward_s": fb_s,
            "time/optimizer_s": opt_s,
            "faults/skipped_steps": self.state.skipped_steps,
        }
        if self.with_mtp:
            s["loss/mtp"] = vals["mtp"]
        if self.cfg.dsa.indexer_loss_coeff > 0:
            s["loss/indexer_kl"] = vals["indexer_kl"]  # coefficient x KL, as added to the loss
            s["dsa/indexer_kl_per_token"] = vals["kl_per_token"]  # summed over indexer layers
        if self.cfg.moe.seq_aux_loss_coeff > 0:
            s["loss/moe_aux"] = vals["moe_aux"]
        if self.peak:
            s["throughput/mfu_pct"] = 100.0 * flops / step_s / self.peak
        s["throughput/tflops_per_device"] = flops / step_s / 1e12
        s.update({k: v for k, v in vals.items() if k.startswith(("moe/", "dsa/"))})
        s.update(st.memory)
        s.update(
            {
                f"{k}_max_over_ranks": vals.get(f"{k}_max_over_ranks", v)
                for k, v in st.memory.items()
            }
        )
        avg_step_s = (time.perf_counter() - self._t_start) / max(
            self.state.step - self._start_step, 1
        )
        eta = avg_step_s * (self.cfg.training.steps - self.state.step)
        self.metrics.log(
            self.state.step, s, format_line(self.state.step, self.cfg.training.steps, s, eta)
        )


def main(argv: list[str]) -> None:
    """``train.py``: a refusal (``UserError``) ends the job with one line and status 2, any other
    error keeps its traceback (``errors.py``)."""
    from titan_glm52.config import parse_job_config

    logging.basicConfig(
        level=logging.INFO, format="[%(asctime)s rank%(rank)s] %(message)s", datefmt="%H:%M:%S"
    )
    rank = os.environ.get("RANK", "0")
    for h in logging.getLogger().handlers:
        h.addFilter(lambda r: setattr(r, "rank", rank) or True)
    lock = None
    try:
        cfg = parse_job_config(argv)
        one_process_env()
        if rank == "0":  # one job per output folder (the first process holds the lock for the job)
            lock = OutputLock(cfg.job.dump_folder)
            lock.acquire()
        trainer = Trainer(cfg)
        trainer.train()
        if dist.is_initialized():
            # nobody tears down (rank 0 hosts the store) while another rank still works
            dist.barrier()
        tdist.destroy_distributed()
    except UserError as e:
        if lock is not None:
            lock.release()
        if show_tracebacks():
            raise
        logging.shutdown()
        report_refusal(e)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    if lock is not None:
        lock.release()
    # The run is complete and everything is written. Rarely (about 1 in 30 two-process CPU runs
    # here), a C++ thread of the distributed stack aborted during interpreter teardown ("terminate
    # called without an active exception"), turning a finished run into a failure; leave without
    # that teardown.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def one_process_env() -> None:
    """Outside torchrun (plain ``python train.py``): the environment of a one-process group, which
    keeps one code path."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
