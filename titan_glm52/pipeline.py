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
tensors cannot.) With MTP, the first stage also sends the embeddings of the next tokens down the pipeline, so
the MTP layer on the last stage uses the one embedding table of stage 0 and its gradient flows back through the
pipeline (no tied copy to synchronise). IndexShare top-k never crosses a stage: the splitter only cuts before
full layers, and each stage starts with no top-k.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from titan_glm52.model.args import GLM52ModelArgs
from titan_glm52.model.model import GLM52Model, next_token_embeddings
from titan_glm52.pipeline_split import PipelinePlan, plan_pipeline


def cu_seqlens_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """int32 ``cu_seqlens`` of the flattened ``[B, S]`` stream: a document starts wherever position == 0
    (every row starts a document)."""
    flat = positions.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    row_starts = torch.arange(0, flat.numel(), positions.shape[-1], device=flat.device)
    starts = torch.unique(torch.cat((starts, row_starts)))
    return torch.cat((starts, starts.new_tensor([flat.numel()]))).to(torch.int32)


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

    def forward(self, x: torch.Tensor, emb_next: torch.Tensor | None = None, *, positions: torch.Tensor):
        mb, s = positions.shape
        ctx = self.packed_context(mb, s, cu_seqlens_from_positions(positions), positions.device)
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
