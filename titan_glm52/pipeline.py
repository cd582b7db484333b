"""Pipeline parallelism: GLM52Model cut into stages by the skip-aware splitter, run by a
``torch.distributed.pipelining`` schedule (built through torchtitan's ``build_pipeline_schedule``).

A stage is the model with the other stages' pieces removed; its layers keep their global names
(``layers.17``), so DCP checkpoints move between pipeline layouts. Stages exchange plain float tensors:

    first stage in : tokens [mb, S]
    between stages : hidden [mb * S, D] (+ next-token embeddings [mb * S, D] with MTP)
    last stage out : final hidden states [mb * S, D] (or (hidden, MTP hidden))

The last stage returns hidden states, not logits: the schedule's loss function runs the output head over them
in chunks (``GLM52Stage.loss_sums`` -> ``GLM52Model.head_loss_sums``), so no ``[tokens, vocab]`` logits are
kept for backward (154,880 x 4 bytes a token in fp32).

Tensors sent between stages are never views (the schedules detach stage outputs in place), so the pass-through
next-token embeddings are copied.

``positions [mb, S]`` (restarting at 0 on every document) carries the packing. It is not sent between stages:
every pipeline rank has the batch, and the schedule hands it to every stage as a keyword argument
(``schedule.step(..., positions=positions)``, split into micro-batches like the inputs); each stage rebuilds
``cu_seqlens`` from it. (torch 2.11's stages mark every received tensor as requiring grad, which integer
tensors cannot.) Reading the bounds from device positions would sync the host with the GPU in every stage's
forward, so the trainer also hands the stages each micro-batch's bounds read on the host (``micro_batch_bounds``),
keyed by the device chunk the schedule passes. With MTP, the first stage also sends the embeddings of the next
tokens down the pipeline, so the MTP layer on the last stage uses the one embedding table of stage 0 and its
gradient flows back through the pipeline (no tied copy to synchronise). IndexShare top-k never crosses a stage:
the splitter only cuts before full layers, and each stage starts with no top-k.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from titan_glm52.model.args import GLM52ModelArgs
from titan_glm52.model.model import GLM52Model, next_token_embeddings
from titan_glm52.packed import cu_seqlens_from_positions
from titan_glm52.pipeline_split import PipelinePlan, plan_pipeline

logger = logging.getLogger(__name__)


def micro_batch_bounds(positions: torch.Tensor, host_positions: torch.Tensor, n_microbatches: int
                       ) -> dict[tuple[int, tuple[int, ...]], list[int]]:
    """For ``GLM52Stage.host_bounds``: each micro-batch's ``cu_seqlens``, read from ``host_positions`` on the host,
    keyed by the storage and shape of the chunk of ``positions`` (the same values, on the device) that the
    schedule hands the stage. The schedule chunks keyword tensors with ``torch.tensor_split`` along dim 0, into
    views of ``positions``; a chunk never seen here is read from the device instead (one sync)."""
    if host_positions.device.type != "cpu" or host_positions.shape != positions.shape:
        raise ValueError(f"host_positions must be the host copy of positions {tuple(positions.shape)}, got "
                         f"{tuple(host_positions.shape)} on {host_positions.device}")
    return {(d.data_ptr(), tuple(d.shape)): cu_seqlens_from_positions(h).tolist()
            for d, h in zip(torch.tensor_split(positions, n_microbatches), torch.tensor_split(host_positions,
                                                                                            n_microbatches))}


class GLM52Stage(GLM52Model):
    """One pipeline stage: GLM52Model holding only this stage's pieces (same parameter names as the full
    model, so checkpoints move between layouts), with a tensor-in, tensor-out forward (module docstring)."""

    def __init__(self, args: GLM52ModelArgs, layer_ids: range, is_first: bool, is_last: bool,
                 with_mtp: bool) -> None:
        super().__init__(args, with_mtp=with_mtp and is_last)
        for key in list(self.layers.keys()):
            if int(key) not in layer_ids:
                del self.layers[key]
        if not is_first:
            self.tok_embeddings = None
        if not is_last:
            self.norm, self.output = None, None
        self.is_first, self.is_last, self.with_mtp = is_first, is_last, with_mtp
        # Set by the trainer for one schedule step (``micro_batch_bounds``): the forward then reads no bounds back.
        self.host_bounds: dict[tuple[int, tuple[int, ...]], list[int]] = {}
        self._missed_bounds = False

    def forward(self, x: torch.Tensor, emb_next: torch.Tensor | None = None, *, positions: torch.Tensor):
        mb, s = positions.shape
        bounds = self.host_bounds.get((positions.data_ptr(), tuple(positions.shape)))
        if bounds is None and self.host_bounds and not self._missed_bounds:
            self._missed_bounds = True  # (the same values either way; only the sync differs)
            logger.warning("pipeline stage with layers %s: the schedule passed positions that are not a chunk of "
                           "the step's (micro_batch_bounds); their document bounds are read from the GPU, a host "
                           "sync per forward", list(self.layers.keys()))
        ctx = self.packed_context(mb, s, bounds if bounds is not None else cu_seqlens_from_positions(positions),
                                  positions.device)
        if self.is_first:
            h = self.tok_embeddings(x).view(mb * s, -1)
            if self.with_mtp:
                emb_next = next_token_embeddings(h, mb)
        else:
            h = x
        h = self.run_layers(h, ctx)
        if not self.is_last:
            if not self.with_mtp:
                return h
            return h, emb_next if self.is_first else emb_next.clone()
        h = self.norm(h)
        if not self.with_mtp:
            return h
        return h, self.mtp(h, emb_next, ctx)

    def loss_sums(self, output, labels: torch.Tensor, mtp_labels: torch.Tensor | None = None):
        """Last stage: summed fp32 cross-entropy of the head over ``output`` (this stage's forward output) against
        ``labels [mb, S]``, and of the MTP hidden states against ``mtp_labels`` (None without MTP), chunked as
        in ``GLM52Model.forward``."""
        h, x = output if self.with_mtp else (output, None)
        return self.head_loss_sums(h, labels, x, mtp_labels)


def stage_modules(args: GLM52ModelArgs, plan: PipelinePlan, pp_rank: int, with_mtp: bool):
    """Yields ``(stage index, GLM52Stage on the meta device)`` for the stages pipeline rank ``pp_rank`` holds."""
    num_stages = len(plan.layers_per_stage)
    for stage_idx, rank in enumerate(plan.placement.stage_to_rank):
        if rank == pp_rank:
            start = sum(plan.layers_per_stage[:stage_idx])
            layers = range(start, start + plan.layers_per_stage[stage_idx])
            with torch.device("meta"):
                yield stage_idx, GLM52Stage(args, layers, stage_idx == 0, stage_idx == num_stages - 1, with_mtp)


def build_pipeline_stages(args: GLM52ModelArgs, plan: PipelinePlan, pp_rank: int, pp_group, device: torch.device,
                          with_mtp: bool, prepare: Callable[[nn.Module], nn.Module]) -> tuple[list[PipelineStage],
                                                                                              list[nn.Module]]:
    """Builds this rank's stages on the meta device; ``prepare`` parallelizes each stage module (the caller
    materialises and initialises them). Returns the PipelineStages and their modules (the model parts)."""
    stages, parts = [], []
    for stage_idx, module in stage_modules(args, plan, pp_rank, with_mtp):
        module = prepare(module)
        stages.append(PipelineStage(module, stage_idx, len(plan.layers_per_stage), device, group=pp_group))
        parts.append(module)
    return stages, parts


def make_plan(args: GLM52ModelArgs, schedule: str, pp_degree: int, stages_per_rank: int | None, seq_len: int,
              layers_per_stage: list[int] | None) -> PipelinePlan:
    """The splitter's plan; a bad explicit layout raises before any work (LayoutError names the fix)."""
    return plan_pipeline(args, schedule, pp_degree, stages_per_rank, seq_len=seq_len,
                         layers_per_stage=layers_per_stage)
