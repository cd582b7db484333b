"""Pipeline parallelism: GLM52Model cut into stages by the skip-aware splitter, run by a
``torch.distributed.pipelining`` schedule (built through torchtitan's ``build_pipeline_schedule``).

A stage is the model with the other stages' pieces removed; its layers keep their global names
(``layers.17``), so DCP checkpoints move between pipeline layouts. Stages exchange plain float
tensors:

    first stage in : tokens [mb, S]
    between stages : hidden [mb * S, D] (+ next-token embeddings [mb * S, D] with MTP)
    last stage out : final hidden states [mb * S, D] (or (hidden, MTP hidden))

The last stage returns hidden states, not logits: the schedule's loss function runs the output head
over them in chunks (``GLM52Stage.loss_sums`` -> ``GLM52Model.head_loss_sums``), so no ``[tokens,
vocab]`` logits are kept for backward (154,880 x 4 bytes a token in fp32).

Tensors sent between stages are never views (the schedules detach stage outputs in place), so the
pass-through next-token embeddings are copied.

``positions [mb, S]`` (restarting at 0 on every document) carries the packing. It is not sent
between stages: every pipeline rank has the batch, and the schedule hands it to every stage as a
keyword argument (``schedule.step(..., positions=positions)``, split into micro-batches like the
inputs); each stage rebuilds ``cu_seqlens`` from it. (torch 2.11's stages mark every received tensor
as requiring grad, which integer tensors cannot.) Reading the bounds from device positions would
sync the host with the GPU in every stage's forward, so the trainer also hands the stages each
micro-batch's bounds read on the host (``micro_batch_bounds``), keyed by the device chunk the
schedule passes. With MTP, the first stage also sends the embeddings of the next tokens down the
pipeline, so the MTP layer on the last stage uses the one embedding table of stage 0 and its
gradient flows back through the pipeline (no tied copy to synchronise). IndexShare top-k never
crosses a stage: the splitter only cuts before full layers, and each stage starts with no top-k.

Under context parallelism every stage holds this rank's zigzag part of each sequence: the tokens,
the hidden states and the labels are local (``[mb, S / N]``), ``positions`` and the bounds stay
global (the documents of the whole sequence), and the schedule also hands every stage the CP group
(``cp``) and the next-token ids of the local positions (``next_tokens``, for the MTP layer's
embeddings on the first stage).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from titan_glm52.model.args import GLM52ModelArgs
from titan_glm52.model.aux_loss import AuxTerms
from titan_glm52.context_parallel import CPGroup
from titan_glm52.model.model import GLM52Model, mtp_embeddings
from titan_glm52.model.options import ModelOptions
from titan_glm52.packed import cu_seqlens_from_positions
from titan_glm52.pipeline_split import PipelineLayout, StageSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostBounds:
    """Each micro-batch's ``cu_seqlens`` read on the host (``micro_batch_bounds``), keyed by the
    storage and shape of its chunk of the step's device ``positions``. (A plain class, not a dict:
    the schedule hands it to every micro-batch as it is instead of splitting it as a pytree.)"""

    by_chunk: dict[tuple[int, tuple[int, ...]], list[int]]

    def of(self, positions: torch.Tensor) -> list[int] | None:
        return self.by_chunk.get((positions.data_ptr(), tuple(positions.shape)))


def micro_batch_bounds(
    positions: torch.Tensor, host_positions: torch.Tensor, n_microbatches: int
) -> HostBounds:
    """For the stages' ``bounds``: each micro-batch's ``cu_seqlens``, read from ``host_positions``
    on the host, keyed by the chunk of ``positions`` (the same values, on the device) that the
    schedule hands the stage. The schedule chunks keyword tensors with ``torch.tensor_split`` along
    dim 0, into views of ``positions``; a chunk never seen here is read from the device instead (one
    sync)."""
    if host_positions.device.type != "cpu" or host_positions.shape != positions.shape:
        raise ValueError(
            f"host_positions must be the host copy of positions {tuple(positions.shape)}, got "
            f"{tuple(host_positions.shape)} on {host_positions.device}"
        )
    chunks = zip(
        torch.tensor_split(positions, n_microbatches),
        torch.tensor_split(host_positions, n_microbatches),
    )
    return HostBounds(
        {(d.data_ptr(), tuple(d.shape)): cu_seqlens_from_positions(h).tolist() for d, h in chunks}
    )


class GLM52Stage(GLM52Model):
    """One pipeline stage: GLM52Model holding only what its ``StageSpec`` says (same parameter names
    as the full model, so checkpoints move between layouts), with a tensor-in, tensor-out forward
    (module docstring)."""

    def __init__(
        self, args: GLM52ModelArgs, spec: StageSpec, options: ModelOptions | None = None
    ) -> None:
        super().__init__(args, options, with_mtp=spec.mtp)
        for key in list(self.layers.keys()):
            if int(key) not in spec.layers:
                del self.layers[key]
        if not spec.embedding:
            self.tok_embeddings = None
        if not spec.head:
            self.norm, self.output = None, None
        self.spec = spec
        self._missed_bounds = False

    def forward(
        self,
        x: torch.Tensor,
        emb_next: torch.Tensor | None = None,
        *,
        positions: torch.Tensor,
        aux: AuxTerms | None = None,
        bounds: HostBounds | None = None,
        cp: CPGroup | None = None,
        next_tokens: torch.Tensor | None = None,
    ):
        """``bounds``: ``micro_batch_bounds`` of the step, so that no stage reads document bounds
        from the GPU; ``aux``: the step's auxiliary terms (``AuxTerms``), shared by every
        micro-batch and stage of the rank; ``cp``, ``next_tokens``: context parallelism (module
        docstring)."""
        mb, s = positions.shape
        cu = bounds.of(positions) if bounds is not None else None
        if cu is None and bounds is not None and bounds.by_chunk and not self._missed_bounds:
            self._missed_bounds = True  # (the same values either way; only the sync differs)
            logger.warning(
                "pipeline stage with layers %s: the schedule passed positions that are not a chunk "
                "of "
                "the step's (micro_batch_bounds); their document bounds are read from the GPU, a "
                "host "
                "sync per forward",
                list(self.layers.keys()),
            )
        ctx = self.packed_context(
            mb,
            s // cp.size if cp is not None else s,
            cu if cu is not None else cu_seqlens_from_positions(positions),
            positions.device,
            aux,
            cp,
        )
        if self.spec.embedding:
            h = self.tok_embeddings(x).view(x.numel(), -1)
            if self.spec.with_mtp:
                emb_next = mtp_embeddings(self.tok_embeddings, h, ctx, next_tokens)
        else:
            h = x
        h = self.run_layers(h, ctx)
        if not self.spec.head:
            if not self.spec.with_mtp:
                return h
            return h, emb_next if self.spec.embedding else emb_next.clone()
        h = self.norm(h)
        if self.mtp is None:
            return h
        return h, self.mtp(h, emb_next, ctx)

    def loss_sums(self, output, labels: torch.Tensor, mtp_labels: torch.Tensor | None = None):
        """Last stage: summed fp32 cross-entropy of the head over ``output`` (this stage's forward
        output) against ``labels [mb, S]``, and of the MTP hidden states against ``mtp_labels``
        (None without MTP), chunked as in ``GLM52Model.forward``."""
        h, x = output if self.mtp is not None else (output, None)
        return self.head_loss_sums(h, labels, x, mtp_labels)


def stage_modules(
    args: GLM52ModelArgs, layout: PipelineLayout, pp_rank: int, options: ModelOptions | None = None
):
    """Yields ``(StageSpec, GLM52Stage on the meta device)`` for the stages pipeline rank
    ``pp_rank`` holds."""
    for spec in layout.stages_of_rank(pp_rank):
        with torch.device("meta"):
            yield spec, GLM52Stage(args, spec, options)


def build_pipeline_stages(
    args: GLM52ModelArgs,
    layout: PipelineLayout,
    pp_rank: int,
    pp_group,
    device: torch.device,
    options: ModelOptions | None,
    prepare: Callable[[nn.Module], nn.Module],
) -> tuple[list[PipelineStage], list[nn.Module]]:
    """Builds this rank's stages on the meta device; ``prepare`` parallelizes each stage module (the
    caller materialises and initialises them). Returns the PipelineStages and their modules (the
    model parts)."""
    stages, parts = [], []
    for spec, module in stage_modules(args, layout, pp_rank, options):
        module = prepare(module)
        stages.append(PipelineStage(module, spec.index, len(layout.stages), device, group=pp_group))
        parts.append(module)
    return stages, parts


# The stages' keyword inputs: ``positions`` is split into micro-batches like the tokens; the step's
# ``AuxTerms`` and host-side bounds go to every micro-batch as they are.
KWARGS_CHUNK_SPEC = {"positions": TensorChunkSpec(0), "aux": _Replicate, "bounds": _Replicate}
# and under context parallelism the group and the next-token ids of the local positions
CP_KWARGS_CHUNK_SPEC = {"cp": _Replicate, "next_tokens": TensorChunkSpec(0)}


def build_schedule(
    stages: list[PipelineStage],
    schedule: str,
    n_microbatches: int,
    loss_fn: Callable,
    context_parallel: bool = False,
):
    """The ``torch.distributed.pipelining`` schedule ``schedule`` over this rank's stages, with the
    gradients left unscaled (the loss is already normalised by the step's global token count) and
    the keyword inputs of ``KWARGS_CHUNK_SPEC`` (with ``context_parallel``, also
    ``CP_KWARGS_CHUNK_SPEC``'s). (torchtitan's ``build_pipeline_schedule`` takes no keyword chunk
    spec.)"""
    cls = get_schedule_class(schedule)
    looped = issubclass(cls, PipelineScheduleMulti)
    if not looped and len(stages) != 1:
        raise ValueError(f"schedule {schedule} runs one stage per rank, got {len(stages)}")
    logger.info(
        "pipeline schedule %s: %d micro-batches, %d stage(s) on this rank",
        schedule,
        n_microbatches,
        len(stages),
    )
    return cls(
        stages if looped else stages[0],
        n_microbatches=n_microbatches,
        loss_fn=loss_fn,
        kwargs_chunk_spec=(
            {**KWARGS_CHUNK_SPEC, **CP_KWARGS_CHUNK_SPEC} if context_parallel else KWARGS_CHUNK_SPEC
        ),
        scale_grads=False,
    )
